"""Benchmark of the served stack's latency and overhead: what a screen waits for.

The script starts the whole served stack itself, in a temporary directory, and
stops all of it at the end (also on Ctrl-C or an error):

- a Prefect server started as `serve`'s embedded one is (the settings of
  `deployments.embedded.server_env`: file-backed leases, a SQLite database
  in its own home), without the UI, on a free port of 127.0.0.1; with
  `--prefect-database-url`, on that (empty) database instead;
- the gateway simulator (`flows.simulator.GatewaySimulator`) in this process;
- `insight-queue serve --safety-net 3600` as a subprocess, pointed at both
  through `PREFECT_API_URL`, `AI_JOB_DATABASE_URL` (a migrated SQLite file in
  the temporary directory), `AI_GATEWAY_URL`, `AI_JOB_GAP_SECONDS` and
  `AI_JOB_PLUGINS=flows.demo`.

`request_insight` and `trigger_backfill` are called in this process, as the
app would call them. It measures:

(a) gateway idle: the time from calling `request_insight` for a fresh key
    (user `lat-<i>`, demo kind `sleep`) to the simulator receiving that call.
    Before each request the previous job is done, every flow run has ended
    and the gap has passed, so the request starts a new flow run. Each
    request is broken down with Prefect's and the store's timestamps:
    request -> flow run created -> Pending (the runner picked it up) ->
    Running (the flow-run subprocess started) -> claim -> gateway task
    Running -> call received. Target: p95 <= 3 s; goal: p95 <= 1 s.
(b) gateway busy: a backfill's call (simulated latency `--busy-latency`) is
    in flight when `request_insight` queues a new key. Reported: how long
    past the in-flight call's end plus the gap the gateway received the
    screen's call, `received - (ended(in-flight) + gap)`, broken down into
    claim and gateway task start, and whether the running consumer took it
    (no new flow run).
(c) Prefect overhead per job: backfills of the 8 demo scopes with gap 0 and a
    short call (`serve` restarted with `AI_JOB_GAP_SECONDS=0`); the time
    between the end of call k and the start of call k+1 inside one drain,
    broken down the same way; and the cost from a flow run's creation to its
    first gateway call (from (a)).
(d) peak memory (VmRSS, summed over each process tree, sampled every 0.2 s
    during (a) to (c)): the Prefect server's tree, the `serve` process, and
    the flow-run subprocesses it starts (the consumers). RSS counts shared
    pages once per process, so the sums are upper bounds.

It also counts the requests the Prefect server answered 503 (a retryable
database error: on SQLite, "database is locked"), by API function; the
client retries those after about 2 s, which shows up in the figures.

Run from the repository root:

    .venv/bin/python benchmarks/latency.py
    .venv/bin/python benchmarks/latency.py --requests 40 --gap 2 --keep-logs
    # the Prefect server on an empty PostgreSQL database instead of SQLite:
    .venv/bin/python benchmarks/latency.py \
        --prefect-database-url postgresql+asyncpg://postgres@127.0.0.1:5432/prefect_bench

It takes about ten minutes with the defaults. Everything listens on
127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import itertools
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from uuid import UUID

from deployments.embedded import is_healthy, server_env, stop_process_group
from flows.simulator import GatewaySimulator, RequestRecord
from queue_store import JobStore, Settings, migrate

ROOT = Path(__file__).resolve().parent.parent
KIND = "sleep"  # a demo kind whose subject is a date
FIRST_SUBJECT = dt.date(1990, 1, 1)  # screen subjects count up from here: never a backfill's
DEMO_SCOPES = 8
SAFETY_NET_SECONDS = 3600
SAMPLE_SECONDS = 0.2
SERVE_READY_SECONDS = 180
CALL_TIMEOUT_SECONDS = 120
IDLE_TIMEOUT_SECONDS = 120
POLL = 0.01  # seconds between looks at the simulator's records
IDLE_MARGIN = 0.2  # seconds of quiet beyond the gap before an idle request
BUSY_ASK_AFTER = 0.5  # seconds into the in-flight call when the screen asks
STOP_GRACE_SECONDS = 20
RETRYABLE_FRAME = re.compile(r"prefect/server/api/(\w+)\.py\", line \d+, in (\w+)")
IMPORT_PROBE = "import prefect.engine, flows.flows, flows.demo"

TARGET_IDLE_P95 = 3.0
GOAL_IDLE_P95 = 1.0


# --- statistics ----------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def fmt(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds:.2f} s"


def spread(values: Sequence[float]) -> str:
    """p50 / p95 (min, max, n) of a list of seconds."""
    if not values:
        return "no samples"
    return (
        f"p50 {fmt(pct(values, 50))}, p95 {fmt(pct(values, 95))} "
        f"(min {fmt(min(values))}, max {fmt(max(values))}, n={len(values)})"
    )


def ts(value: dt.datetime | None) -> float | None:
    """A timestamp from Prefect or the store as `time.time()` seconds (naive = UTC)."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


# --- processes and memory ------------------------------------------------------


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process we can read."""
    table: dict[int, tuple[int, int]] = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    data = stat.read()
            except OSError:
                continue
            # Fields after the parenthesised command name, from field 3 (state).
            fields = data[data.rindex(b")") + 2 :].split()
            table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemorySampler:
    """Samples VmRSS of the served stack every `SAMPLE_SECONDS` in a thread.

    Also remembers every descendant it saw (pid and start time), so that
    `leftovers` can name processes our processes started and left behind.
    """

    def __init__(self, roots: Callable[[], dict[str, int | None]]) -> None:
        self._roots = roots
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak: dict[str, int] = {}  # part -> KiB
        self.peak_total = 0
        self.peak_consumers = 0  # flow-run subprocesses alive at once
        self.samples = 0
        self.seen: dict[int, int] = {}  # pid -> start time
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            with contextlib.suppress(Exception):  # a process may vanish mid-walk
                self.sample()

    def sample(self) -> None:
        table = process_table()
        roots = self._roots()
        parts: dict[str, int] = {"server": 0, "serve": 0, "flow-run consumers": 0}
        consumers = 0
        server = roots.get("server")
        if server is not None and server in table:
            tree = [server, *descendants(server, table)]
            parts["server"] = sum(rss_kib(pid) for pid in tree)
            self._remember(tree, table)
        serve = roots.get("serve")
        if serve is not None and serve in table:
            below = descendants(serve, table)
            parts["serve"] = rss_kib(serve)
            parts["flow-run consumers"] = sum(rss_kib(pid) for pid in below)
            consumers = sum(1 for pid in below if table[pid][0] == serve)
            self._remember([serve, *below], table)
        with self._lock:
            self.samples += 1
            for part, kib in parts.items():
                self.peak[part] = max(self.peak.get(part, 0), kib)
            self.peak["serve tree"] = max(
                self.peak.get("serve tree", 0), parts["serve"] + parts["flow-run consumers"]
            )
            self.peak_total = max(self.peak_total, sum(parts.values()))
            self.peak_consumers = max(self.peak_consumers, consumers)

    def _remember(self, pids: list[int], table: dict[int, tuple[int, int]]) -> None:
        with self._lock:
            for pid in pids:
                self.seen[pid] = table[pid][1]

    def leftovers(self) -> list[int]:
        """Processes seen in the stack's trees that are still the same processes."""
        table = process_table()
        with self._lock:
            return [pid for pid, start in self.seen.items() if table.get(pid, (0, -1))[1] == start]


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (other work on the machine skews figures)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_pids(pids: list[int], still_ours: Callable[[], list[int]]) -> None:
    """TERM, then KILL, processes by pid, each only while it is the process we saw."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and still_ours():
        time.sleep(0.1)
    for pid in still_ours():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- the stack -----------------------------------------------------------------


class PrefectServer:
    """A Prefect server subprocess with the embedded default's settings, no UI."""

    def __init__(self, home: Path, port: int, database_url: str | None = None) -> None:
        self.home = home
        self.port = port
        self.database_url = database_url
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.log_path = home / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **server_env(self.home),
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": "false",
        }
        if self.database_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url
        env.pop("PREFECT_API_URL", None)
        prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVE_READY_SECONDS
        while not is_healthy(self.api_url):
            if self._process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the Prefect server did not start:\n{tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_process_group(process, STOP_GRACE_SECONDS)


class Stack:
    """Prefect server + gateway simulator + `insight-queue serve`, in one temp dir."""

    def __init__(self, workdir: Path, latency: float, database_url: str | None) -> None:
        self.dir = workdir
        self.base_env = dict(os.environ)
        self.port = free_port()
        self.server = PrefectServer(self.dir / "prefect-server", self.port, database_url)
        self.sim = GatewaySimulator(latency=latency, seed=7)
        self.database_url = f"sqlite:///{self.dir / 'queue.db'}"
        self.serve: subprocess.Popen[bytes] | None = None
        self.serve_log = self.dir / "serve.log"
        self.serve_starts = 0
        self.sampler = MemorySampler(self.roots)

    @property
    def api_url(self) -> str:
        return self.server.api_url

    def roots(self) -> dict[str, int | None]:
        serve = self.serve.pid if self.serve is not None and self.serve.poll() is None else None
        return {"server": self.server.pid, "serve": serve}

    def queue_env(self, gap: float) -> dict[str, str]:
        return {
            "AI_JOB_DATABASE_URL": self.database_url,
            "AI_JOB_DATA_DIR": str(self.dir / "data"),
            "AI_GATEWAY_URL": self.sim.url,
            "AI_JOB_GAP_SECONDS": str(gap),
            "AI_JOB_PLUGINS": "flows.demo",
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
            "DO_NOT_TRACK": "1",
        }

    def configure_self(self, gap: float) -> None:
        """This process's settings; before prefect or deployments.triggers is imported."""
        os.environ.update(self.queue_env(gap))
        os.environ["PREFECT_HOME"] = str(self.dir / "prefect-client")
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
        # The server logs each request it answers 503 (SQLite busy): counted in the report.
        os.environ["PREFECT_API_LOG_RETRYABLE_ERRORS"] = "true"

    def start(self, gap: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sim.start()
        self.configure_self(gap)
        migrate.upgrade(self.database_url)
        self.server.start()
        self.sampler.start()
        self.start_serve(gap)

    def start_serve(self, gap: float) -> None:
        executable = shutil.which("insight-queue", path=str(Path(sys.executable).parent))
        command = [executable] if executable else [sys.executable, "-m", "deployments.cli"]
        env = {
            **self.base_env,
            **self.queue_env(gap),
            "PREFECT_HOME": str(self.dir / "prefect-serve"),
        }
        self.serve_starts += 1
        with open(self.serve_log, "ab") as log:
            log.write(f"\n--- serve start {self.serve_starts}, gap {gap} s ---\n".encode())
            log.flush()
            self.serve = subprocess.Popen(
                [*command, "serve", "--safety-net", str(SAFETY_NET_SECONDS)],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._wait_serving()

    def _wait_serving(self) -> None:
        """Until this serve printed its banner and the deployments exist."""
        from prefect import get_client

        from deployments.triggers import (
            BACKFILL_DEPLOYMENT,
            DRAIN_DEPLOYMENT,
            INTERACTIVE_DEPLOYMENT,
        )

        marker = f"--- serve start {self.serve_starts},"
        deadline = time.monotonic() + SERVE_READY_SECONDS
        while time.monotonic() < deadline:
            if self.serve is None or self.serve.poll() is not None:
                raise RuntimeError(f"serve exited; see {self.serve_log}")
            log = self.serve_log.read_text(errors="replace")
            if "insight-queue serving" in log.rsplit(marker, 1)[-1]:
                try:
                    with get_client(sync_client=True) as client:
                        for name in (BACKFILL_DEPLOYMENT, INTERACTIVE_DEPLOYMENT, DRAIN_DEPLOYMENT):
                            client.read_deployment_by_name(name)
                    return
                except Exception:  # noqa: BLE001 - not registered yet
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"serve was not ready in {SERVE_READY_SECONDS} s; see {self.serve_log}")

    def stop_serve(self) -> None:
        if self.serve is None:
            return
        process, self.serve = self.serve, None
        self.sampler.sample()  # note its latest children before it goes
        below = descendants(process.pid, process_table())
        stop_process_group(process, STOP_GRACE_SECONDS)
        # Prefect starts each flow run in its own session: stop any left over.
        self._stop_seen(below)

    def _stop_seen(self, pids: list[int]) -> None:
        def alive() -> list[int]:
            return [pid for pid in self.sampler.leftovers() if pid in pids]

        if alive():
            stop_pids(alive(), alive)

    def busy_errors(self) -> dict[str, int]:
        """Requests the Prefect server answered 503 (SQLite busy; clients retry in ~2 s),
        by the API function that failed."""
        try:
            log = self.server.log_path.read_text(errors="replace")
        except OSError:
            return {}
        counts: dict[str, int] = {}
        for block in log.split("Encountered retryable exception")[1:]:
            names = RETRYABLE_FRAME.findall(block.split("Exception in ASGI application")[0])
            name = next((f"{m}.{f}" for m, f in names if m != "server"), "?")
            counts[name] = counts.get(name, 0) + 1
        return counts

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_serve()
        self.sampler.stop()
        server_pid = self.server.pid
        below = descendants(server_pid, process_table()) if server_pid else []
        with contextlib.suppress(Exception):
            self.server.stop()
        self._stop_seen(below + self.sampler.leftovers())
        self.sim.stop()


# --- helpers over Prefect, the store and the simulator ------------------------


class Subjects:
    """Fresh keys for the screen: dates counting up from 1990, never a backfill's."""

    def __init__(self) -> None:
        self._next = 0

    def take(self) -> str:
        subject = (FIRST_SUBJECT + dt.timedelta(days=self._next)).isoformat()
        self._next += 1
        return subject


def records(sim: GatewaySimulator) -> tuple[RequestRecord, ...]:
    return sim.stats().requests


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = CALL_TIMEOUT_SECONDS, poll: float = POLL
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def received_call(sim: GatewaySimulator, label: str, after: float) -> RequestRecord | None:
    for record in records(sim):
        if record.job == label and record.received >= after:
            return record
    return None


def wait_received(sim: GatewaySimulator, label: str, after: float) -> RequestRecord:
    """The simulator's record of the call labelled `label` received after `after`."""
    record: RequestRecord = wait_for(f"the call {label}", lambda: received_call(sim, label, after))
    return record


def wait_done(store: JobStore, user: str, subject: str) -> None:
    def done() -> bool:
        status = store.status_of(user, KIND, subject)
        return status is not None and status["status"] == "done"

    wait_for(f"{KIND}:{subject} of {user} done", done)


def active_flow_runs() -> int:
    """Flow runs that are pending or running (scheduled ones do not count)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(
                        any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
                    )
                )
            )
        )
    return len(runs)


def wait_idle(stack: Stack, store: JobStore, gap: float) -> None:
    """No flow run active, no call in flight, and the gap (plus a margin) over."""

    def idle() -> bool:
        if store.calls_in_flight() or stack.sim.stats().in_flight or active_flow_runs():
            return False
        ends = [r.ended for r in records(stack.sim) if r.ended is not None]
        return not ends or time.time() >= max(ends) + gap + IDLE_MARGIN

    wait_for("an idle gateway", idle, timeout=IDLE_TIMEOUT_SECONDS, poll=0.1)


@dataclasses.dataclass
class RunTimes:
    """Prefect's timestamps of one flow run, and of its gateway task runs by name."""

    created: float | None = None
    pending: float | None = None
    running: float | None = None
    ended: float | None = None
    task_created: dict[str, float] = dataclasses.field(default_factory=dict)
    task_started: dict[str, float] = dataclasses.field(default_factory=dict)
    task_ended: dict[str, float] = dataclasses.field(default_factory=dict)


def run_times(flow_run_id: str) -> RunTimes:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.objects import StateType

    times = RunTimes()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(flow_run_id))
        times.created = ts(run.created)
        times.running = ts(run.start_time)
        times.ended = ts(run.end_time)
        for state in client.read_flow_run_states(UUID(flow_run_id)):
            if state.type == StateType.PENDING and times.pending is None:
                times.pending = ts(state.timestamp)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)]))
        )
    for task_run in tasks:
        for target, value in (
            (times.task_created, ts(task_run.created)),
            (times.task_started, ts(task_run.start_time)),
            (times.task_ended, ts(task_run.end_time)),
        ):
            if value is not None:
                target[task_run.name] = value
    return times


def flow_run_final(flow_run_id: str) -> bool:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(flow_run_id)).state
    return state is not None and state.is_final()


def claimed_at(store: JobStore, user: str, label: str) -> float | None:
    kind, subject = label.split(":", 1)
    job = store.job(user, kind, subject)
    return ts(job.claimed_at) if job is not None else None


# --- (a) gateway idle ----------------------------------------------------------

SEGMENTS = (
    ("request_insight returns (enqueue, create run)", "returned"),
    ("request -> flow run created", "created"),
    ("created -> Pending (runner poll)", "pending"),
    ("Pending -> Running (subprocess, imports, engine)", "running"),
    ("Running -> claim (flow body, store, claim)", "claim"),
    ("claim -> gateway task Running (task run, slot)", "task"),
    ("task Running -> call received (generator, HTTP)", "received"),
)


@dataclasses.dataclass
class IdleSample:
    user: str
    label: str
    asked: float
    returned: float
    received: float
    flow_run_id: str | None
    points: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def wait(self) -> float:
        return self.received - self.asked

    def segments(self) -> dict[str, float]:
        """Seconds per segment of SEGMENTS (cumulative points -> differences)."""
        out: dict[str, float] = {"returned": self.returned - self.asked}
        chain = ["created", "pending", "running", "claim", "task", "received"]
        previous = self.asked
        for name in chain:
            point = self.received if name == "received" else self.points.get(name)
            if point is None:
                return out
            out[name] = point - previous
            previous = point
        return out


def ask_idle(
    stack: Stack, store: JobStore, gap: float, user: str, subject: str, fingerprint: str
) -> IdleSample:
    from deployments.triggers import request_insight

    wait_idle(stack, store, gap)
    label = f"{KIND}:{subject}"
    asked = time.time()
    state = request_insight(user, KIND, subject, fingerprint, store=store)
    returned = time.time()
    record = wait_received(stack.sim, label, asked)
    sample = IdleSample(user, label, asked, returned, record.received, state.flow_run_id)
    wait_done(store, user, subject)
    return sample


def fill_breakdown(store: JobStore, sample: IdleSample) -> None:
    if sample.flow_run_id is None:
        return
    times = run_times(sample.flow_run_id)
    sample.points = {
        "created": times.created,
        "pending": times.pending,
        "running": times.running,
        "claim": claimed_at(store, sample.user, sample.label),
        "task": times.task_started.get(sample.label),
    }


def measure_idle(
    stack: Stack, store: JobStore, gap: float, n: int, subjects: Subjects, tag: str
) -> list[IdleSample]:
    samples = []
    for i in range(n):
        user = f"lat-{tag}-{i}"
        sample = ask_idle(stack, store, gap, user, subjects.take(), f"fp-{tag}-{i}")
        samples.append(sample)
        print(f"  (a) {i + 1:>3}/{n}: {sample.wait:.2f} s", flush=True)
    wait_idle(stack, store, gap)
    for sample in samples:
        fill_breakdown(store, sample)
    return samples


# --- (b) gateway busy ----------------------------------------------------------


@dataclasses.dataclass
class BusySample:
    beyond: float  # received - (ended(in-flight) + gap)
    wait: float  # received - asked
    remainder: float  # ended(in-flight) - asked
    new_run: bool  # request_insight started a flow run
    same_consumer: bool  # the job was run by the backfill's flow run
    due: float  # ended(in-flight) + gap: when the screen's call could start
    label: str
    flow_run_id: str | None  # the flow run that ran the screen's job
    claim: float | None  # when the screen's job was claimed
    task_started: float | None = None  # its gateway task run's start (Prefect)

    def segments(self) -> dict[str, float]:
        """in-flight end + gap -> claim -> task Running -> call received."""
        out: dict[str, float] = {}
        previous = self.due
        for key, point in (
            ("claim", self.claim),
            ("task", self.task_started),
            ("received", self.due + self.beyond),
        ):
            if point is None:
                return out
            out[key] = point - previous
            previous = point
        return out


BUSY_SEGMENTS = (
    ("in-flight end + gap -> claim (drain loop, claim)", "claim"),
    ("claim -> gateway task Running (task run, slot)", "task"),
    ("task Running -> call received (generator, HTTP)", "received"),
)


def measure_busy(
    stack: Stack,
    store: JobStore,
    gap: float,
    n: int,
    busy_latency: float,
    subjects: Subjects,
) -> list[BusySample]:
    from deployments.triggers import request_insight, trigger_backfill

    stack.sim.set_latency(busy_latency)
    samples: list[BusySample] = []
    used: set[int] = set()
    screen_labels: set[str] = set()
    backfill_run: str | None = None
    backfills = 0
    deadline = time.monotonic() + n * (2 * busy_latency + 2 * gap + 30) + 120
    next_check = 0.0  # when to ask Prefect again whether the backfill ended
    while len(samples) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("(b) did not collect its samples in time")
        due = time.monotonic() >= next_check
        if due:
            next_check = time.monotonic() + 0.5
        if backfill_run is None or (due and flow_run_final(backfill_run)):
            if backfills > n + 3:
                raise RuntimeError(f"(b): {backfills} backfills ended without enough samples")
            wait_idle(stack, store, gap)
            backfill_run = trigger_backfill(f"busy-{backfills}", sync_id=f"busy-{time.time()}")
            backfills += 1
            if backfill_run is None:
                raise RuntimeError("trigger_backfill could not reach Prefect")
        now = time.time()
        in_flight = [
            r
            for r in records(stack.sim)
            if r.started is not None
            and r.ended is None
            and r.id not in used
            and r.job not in screen_labels
        ]
        if not in_flight:
            time.sleep(POLL)
            continue
        call = in_flight[0]
        assert call.started is not None
        if now - call.started < BUSY_ASK_AFTER:
            time.sleep(POLL)
            continue
        if now - call.started > busy_latency - 1.0:
            used.add(call.id)  # too late to ask during this call
            continue
        used.add(call.id)
        i = len(samples)
        user, subject = f"busy-screen-{i}", subjects.take()
        label = f"{KIND}:{subject}"
        screen_labels.add(label)
        asked = time.time()
        state = request_insight(user, KIND, subject, f"fp-busy-{i}", store=store)
        screen = wait_received(stack.sim, label, asked)
        ended = next(r.ended for r in records(stack.sim) if r.id == call.id)
        assert ended is not None
        wait_done(store, user, subject)
        job = store.job(user, KIND, subject)
        sample = BusySample(
            beyond=screen.received - (ended + gap),
            wait=screen.received - asked,
            remainder=ended - asked,
            new_run=state.flow_run_id is not None,
            same_consumer=job is not None and job.flow_run_id == backfill_run,
            due=ended + gap,
            label=label,
            flow_run_id=job.flow_run_id if job is not None else None,
            claim=ts(job.claimed_at) if job is not None else None,
        )
        samples.append(sample)
        print(
            f"  (b) {len(samples):>3}/{n}: {sample.beyond:+.2f} s beyond "
            f"(waited {sample.wait:.2f} s, in-flight remainder {sample.remainder:.2f} s)",
            flush=True,
        )
    # Let the last backfill finish quickly, so nothing is left for the next phase.
    stack.sim.set_latency(0.05)
    if backfill_run is not None:
        wait_for("the last backfill", lambda: flow_run_final(backfill_run), poll=0.2)
    runs: dict[str, RunTimes] = {}
    for sample in samples:
        if sample.flow_run_id is not None:
            if sample.flow_run_id not in runs:
                runs[sample.flow_run_id] = run_times(sample.flow_run_id)
            sample.task_started = runs[sample.flow_run_id].task_started.get(sample.label)
    return samples


# --- (c) overhead inside one drain ---------------------------------------------

BETWEEN = (
    ("call k answered -> task k ended (finish, task state)", "task_end"),
    ("task k ended -> claim k+1 (heartbeat stop, claim)", "claim"),
    ("claim k+1 -> task k+1 Running (task run, slot)", "task_start"),
    ("task k+1 Running -> call k+1 received", "received"),
)


@dataclasses.dataclass
class DrainResult:
    between: list[float]  # received(k+1) - ended(k)
    parts: dict[str, list[float]]
    first_call: float  # trigger_backfill -> first call received
    run_first_call: float | None  # flow run created -> first call received


def measure_drain(stack: Stack, store: JobStore, user: str) -> DrainResult:
    from deployments.triggers import trigger_backfill

    wait_idle(stack, store, 0.0)
    asked = time.time()
    run_id = trigger_backfill(user, sync_id=f"overhead-{asked}")
    if run_id is None:
        raise RuntimeError("trigger_backfill could not reach Prefect")
    wait_for(f"backfill of {user}", lambda: flow_run_final(run_id), poll=0.2)

    def answered() -> list[RequestRecord]:
        calls = [r for r in records(stack.sim) if r.received >= asked and r.ended is not None]
        return calls if len(calls) >= DEMO_SCOPES else []

    with contextlib.suppress(TimeoutError):  # reported below as a count mismatch
        wait_for(f"the calls of {user}", answered, timeout=30, poll=0.2)
    calls = sorted((r for r in records(stack.sim) if r.received >= asked), key=lambda r: r.received)
    if len(calls) != DEMO_SCOPES:
        raise RuntimeError(f"expected {DEMO_SCOPES} calls for {user}, saw {len(calls)}")
    times = run_times(run_id)
    between: list[float] = []
    parts: dict[str, list[float]] = {key: [] for _, key in BETWEEN}
    for done, following in itertools.pairwise(calls):
        assert done.ended is not None and done.job and following.job
        between.append(following.received - done.ended)
        chain = [
            ("task_end", times.task_ended.get(done.job)),
            ("claim", claimed_at(store, user, following.job)),
            ("task_start", times.task_started.get(following.job)),
            ("received", following.received),
        ]
        previous = done.ended
        for key, point in chain:
            if point is None:
                break
            parts[key].append(point - previous)
            previous = point
    created = times.created
    return DrainResult(
        between,
        parts,
        calls[0].received - asked,
        calls[0].received - created if created is not None else None,
    )


def import_probe(env: dict[str, str], repeat: int = 3) -> list[float]:
    """Seconds to start Python and import what a flow-run subprocess needs."""
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE], env=env, cwd=ROOT, check=True, timeout=120
        )
        seconds.append(time.perf_counter() - started)
    return seconds


# --- report --------------------------------------------------------------------


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f} MiB"


def verdict(value: float, limit: float) -> str:
    return "met" if value <= limit else "NOT met"


def report(
    args: argparse.Namespace,
    cold: list[IdleSample],
    idle: list[IdleSample],
    busy: list[BusySample],
    drains: list[DrainResult],
    probe: list[float],
    stack: Stack,
    load: tuple[str, str],
) -> None:
    sampler = stack.sampler
    waits = [s.wait for s in idle]
    p95 = pct(waits, 95)
    beyond = [s.beyond for s in busy]
    between = [x for d in drains for x in d.between]
    run_first = [
        s.received - created for s in idle if (created := s.points.get("created")) is not None
    ]
    new_runs = sum(s.new_run for s in busy)
    same = sum(s.same_consumer for s in busy)

    print("\nBreakdown of (a), per request (seconds):")
    print(f"  {'segment':<52} {'mean':>6} {'p50':>6} {'p95':>6}")
    for title, key in SEGMENTS:
        values = [s.segments()[key] for s in idle if key in s.segments()]
        print(f"  {title:<52} {mean(values):>6.2f} {pct(values, 50):>6.2f} {pct(values, 95):>6.2f}")
    print(f"  {'total: request -> call received':<52} {mean(waits):>6.2f} ", end="")
    print(f"{pct(waits, 50):>6.2f} {p95:>6.2f}")
    print(
        f"  (python -c '{IMPORT_PROBE}': {spread(probe)}; "
        f"first request after each serve start: {', '.join(fmt(s.wait) for s in cold)})"
    )

    print("\nBreakdown of (b), from the in-flight call's end + gap (seconds):")
    print(f"  {'segment':<52} {'mean':>6} {'p50':>6} {'p95':>6}")
    for title, key in BUSY_SEGMENTS:
        values = [s.segments()[key] for s in busy if key in s.segments()]
        print(f"  {title:<52} {mean(values):>6.2f} {pct(values, 50):>6.2f} {pct(values, 95):>6.2f}")

    print("\nBreakdown of (c), between call k's answer and call k+1 (seconds):")
    print(f"  {'segment':<52} {'mean':>6} {'p50':>6} {'p95':>6}")
    for title, key in BETWEEN:
        values = [x for d in drains for x in d.parts[key]]
        print(f"  {title:<52} {mean(values):>6.2f} {pct(values, 50):>6.2f} {pct(values, 95):>6.2f}")

    rows = [
        (
            "(a) idle: request_insight -> call received",
            spread(waits),
            f"p95 <= {TARGET_IDLE_P95:.0f} s: {verdict(p95, TARGET_IDLE_P95)}; "
            f"goal <= {GOAL_IDLE_P95:.0f} s: {verdict(p95, GOAL_IDLE_P95)}",
        ),
        (
            "(b) busy: received - (in-flight end + gap)",
            spread(beyond),
            f"~0 (next after the gap); {len(busy) - new_runs}/{len(busy)} without "
            f"a new run, {same}/{len(busy)} by the backfill's run",
        ),
        (
            "(b) busy: request -> call received",
            spread([s.wait for s in busy]),
            f"in-flight remainder {fmt(mean([s.remainder for s in busy]))} + gap {args.gap:g} s",
        ),
        (
            "(c) between calls in one drain (gap 0)",
            f"mean {fmt(mean(between))}, p95 {fmt(pct(between, 95))} (n={len(between)})",
            "Prefect + store overhead per job",
        ),
        (
            "(c) new flow run: created -> first call",
            f"mean {fmt(mean(run_first))}, p95 {fmt(pct(run_first, 95))} (n={len(run_first)})",
            "from (a): what a new flow run costs",
        ),
        (
            "(c) trigger_backfill -> first call",
            spread([d.first_call for d in drains]),
            "backfill: 8 enqueues before the claim",
        ),
        (
            "(d) peak RSS, served stack total",
            mib(sampler.peak_total),
            f"{sampler.samples} samples every {SAMPLE_SECONDS:g} s",
        ),
        ("(d) peak RSS, Prefect server tree", mib(sampler.peak.get("server", 0)), ""),
        ("(d) peak RSS, serve process (runner)", mib(sampler.peak.get("serve", 0)), ""),
        (
            "(d) peak RSS, flow-run consumers",
            mib(sampler.peak.get("flow-run consumers", 0)),
            f"at most {sampler.peak_consumers} at once",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    figure_width = max(len(r[1]) for r in rows)
    print(
        f"\nSummary (requests {args.requests}, latency {args.latency:g} s, busy latency "
        f"{args.busy_latency:g} s, gap {args.gap:g} s, {os.cpu_count()} CPUs, Prefect server "
        f"on {(args.prefect_database_url or 'sqlite').split(':')[0].split('+')[0]}):"
    )
    print(f"  {'measure':<{width}}  {'figure':<{figure_width}}  target / note")
    print(f"  {'-' * width}  {'-' * figure_width}  {'-' * 13}")
    for name, figure, note in rows:
        print(f"  {name:<{width}}  {figure:<{figure_width}}  {note}")
    errors = stack.busy_errors()
    described = ", ".join(f"{name} {count}" for name, count in sorted(errors.items()))
    print(
        f"\nPrefect server requests answered 503 (a retryable database error, on SQLite "
        f"'database is locked'; the client retries after "
        f"~2 s): {sum(errors.values())}{f' ({described})' if described else ''}"
    )
    print(f"load average at start {load[0]}, at end {load[1]}")


# --- main ----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="samples for (a) and (b)")
    parser.add_argument(
        "--latency", type=float, default=0.5, help="simulated seconds per call in (a) and (c)"
    )
    parser.add_argument(
        "--busy-latency", type=float, default=3.0, help="simulated seconds per call in (b)"
    )
    parser.add_argument("--gap", type=float, default=1.0, help="AI_JOB_GAP_SECONDS in (a), (b)")
    parser.add_argument(
        "--backfills", type=int, default=3, help="backfills of 8 scopes measured in (c)"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir (logs, databases)"
    )
    parser.add_argument(
        "--prefect-database-url",
        default=None,
        metavar="URL",
        help="an empty database for the Prefect server (postgresql+asyncpg://...); "
        "default: SQLite in the temp dir, as `serve` does",
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.backfills < 1:
        parser.error("--requests and --backfills must be at least 1")
    if args.latency <= 0 or args.busy_latency < 2 or args.gap < 0:
        parser.error("--latency must be > 0, --busy-latency >= 2, --gap >= 0")
    return args


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run like Ctrl-C, so everything started is stopped."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="insight-queue-latency-"))
    stack = Stack(workdir, args.latency, args.prefect_database_url)
    code = 1
    load_at_start = loadavg()
    with terminate_as_interrupt():
        try:
            print(f"starting the stack in {workdir} ...", flush=True)
            started = time.monotonic()
            stack.start(args.gap)
            print(
                f"  Prefect server (pid {stack.server.pid}) at {stack.api_url}, simulator at "
                f"{stack.sim.url}, serve (pid {stack.roots()['serve']}) ready in "
                f"{time.monotonic() - started:.1f} s",
                flush=True,
            )
            settings = Settings.from_env()
            subjects = Subjects()
            with JobStore(stack.database_url, settings=settings) as store:
                print(f"(a) gateway idle, {args.requests} requests, gap {args.gap:g} s", flush=True)
                cold = measure_idle(stack, store, args.gap, 1, subjects, "warm")
                idle = measure_idle(stack, store, args.gap, args.requests, subjects, "a")

                print(f"(b) gateway busy, call {args.busy_latency:g} s, gap {args.gap:g} s")
                busy = measure_busy(
                    stack, store, args.gap, args.requests, args.busy_latency, subjects
                )

                print("(c) restarting serve with AI_JOB_GAP_SECONDS=0", flush=True)
                stack.stop_serve()
                stack.sim.set_latency(args.latency)
                stack.start_serve(0.0)
                cold += measure_idle(stack, store, 0.0, 1, subjects, "warm2")
                drains = []
                for k in range(args.backfills):
                    drains.append(measure_drain(stack, store, f"overhead-{k}"))
                    print(
                        f"  (c) backfill {k + 1}/{args.backfills}: between calls "
                        f"{', '.join(f'{x:.2f}' for x in drains[-1].between)} s",
                        flush=True,
                    )
            probe_env = {**stack.base_env, **stack.queue_env(0.0)}
            probe_env["PREFECT_HOME"] = str(workdir / "prefect-probe")
            probe = import_probe(probe_env)
            load = (load_at_start, loadavg())
            report(args, cold, idle, busy, drains, probe, stack, load)
            code = 0
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            code = 130
        finally:
            print("stopping everything started ...", flush=True)
            stack.stop()
            alive = stack.sampler.leftovers()
            if alive:
                print(f"warning: still running: {alive}", file=sys.stderr)
            if args.keep_logs or code != 0:
                print(f"logs and databases kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
