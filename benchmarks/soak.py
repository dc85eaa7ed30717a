"""Soak: the whole served stack under random failures, then every invariant checked.

The script starts the stack itself in a working directory and stops all of it
at the end (also on Ctrl-C, SIGTERM or an error), every process by the PID it
got when starting it:

- a Prefect server (`deployments.stack.PrefectServer`: file-backed
  concurrency leases, no UI) on a free 127.0.0.1 port with its own home;
- the gateway simulator (`devtools.simulator.GatewaySimulator`) in this process,
  4 workers, 0.3-1.0 s per answer, each finishing a call whose client went
  away (as the real gateway's threads do), so a call cut by a kill still
  holds the gateway until its start plus the hold (H1; the read timeout,
  20 s here);
- the store: a SQLite file (default) or, with `--postgres-url`, a database
  of its own (`insight_queue_soak_<hex>`) created on that server and dropped
  afterwards; a trigger logs every transition of a job to `done` with the
  holder that made it (table `soak_done_log`);
- `insight-queue serve` (`devtools.stack.ServeProcess`, reporting to that
  Prefect server; concurrency 1, gap 0.3 s, lease 15 s, heartbeat 1 s). Its
  warm consumer, a thread of the serve process, makes the gateway calls; the
  flow runs it starts (subprocesses) follow their jobs, and drain the queue
  themselves only when no consumer stands by.

For the first part of the run it injects seeded random events; the rest is
quiet, so the queue can settle. Faults are set off by events and counts, not
by timing windows a slow machine could miss. Processes are started and
stopped from the main thread only, one thing at a time: events that fall due
while Prefect or serve is starting run late, and the log shows when:

- kill:      SIGKILL of the process that holds the claim of the call in
             flight at the gateway (the simulator's open request and the
             store's running row name the same job; the claim's worker names
             the process). Serve's own worker: serve is SIGKILLed mid-call,
             what is left of its process group is reaped (as a supervisor
             would), and serve is started again on the same data directory
             (back once it wrote its own `serve.json`, its consumer said it is
             alive and its runner registered the deployments again); a
             flow-run process draining the queue: that process only, and serve
             must live on. With nothing queued, a new user's backfill is
             queued first; the kill looks for a call for up to 20 s;
- prefect:   the Prefect server stopped, a new user's backfill triggered
             while it is down, and the server started again once 2-8 s
             passed (and serve again if it was killed meanwhile: it cannot
             start without Prefect);
- outage:    the simulator answers 503 to the next 2-6 calls, or hangs the
             next call for 2-12 s, or refuses connections until the queue has
             met 1-3 refused calls (at most 30 s);
- backfill:  `deployments.triggers.trigger_backfill` for a new or known user
             (8 demo scopes each);
- screen:    a thread polls `deployments.triggers.request_insight` every
             second for a demo key (known or new) until it is done, and
             records the wait.

Then it checks:

1. every job ended done, or failed with a reason; none pending or running;
2. the simulator never had more than AI_JOB_CONCURRENCY calls in flight
   (its peak, and overlaps recomputed from its records);
3. no job was done twice in one round (`soak_done_log`: at most one `done`
   per job and fingerprint; a newer fingerprint legitimately starts a new
   round, counted apart);
4. no leaked `gateway` slot: once the leases of killed holders could lapse,
   the slots Prefect counts (`flows.limits.repair_gateway_slots(repair=False)`)
   are at most those held by live holders: serve's consumer (the leases it
   records in `serve.json`; it keeps its slot while idle) and task runs;
5. serve never exited on its own, and every serve killed here was started
   again and came back (deployments registered, consumer alive); the last one
   is alive at the end;
6. every screen that waited got its job done;
7. every backfilled user's scopes are in the store, even when Prefect was down.

It prints a summary (events injected, jobs and outcomes, gateway calls, peak
in flight, screen waits) and exits 0 when every invariant held, 1 otherwise.

Run from the repository root (not in CI at full length; CI runs two minutes
through tests/acceptance/test_soak.py):

    .venv/bin/python benchmarks/soak.py --minutes 30 --seed 7
    .venv/bin/python benchmarks/soak.py --minutes 10 --postgres-url postgresql://postgres@127.0.0.1:5432/test

`--minutes` is the length of the run after start-up: events during the
first part, quiet for the last `--quiet-seconds` (default: a quarter, at
least 45 s). If work is still queued then, the settling goes on for up to
`--settle-timeout` seconds and the overrun is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.figures import percentile  # noqa: E402 - after the path is set
from deployments import processes, table  # noqa: E402
from deployments.stack import PrefectServer, client_env  # noqa: E402
from deployments.triggers import Triggers  # noqa: E402
from devtools.simulator import GatewaySimulator, RequestRecord  # noqa: E402
from devtools.stack import ServeProcess  # noqa: E402
from queue_store import JobStore, Settings  # noqa: E402
from tests.support.reads import listed_jobs, pending  # noqa: E402
from tests.support.services import group_members  # noqa: E402

CONCURRENCY = 1
GAP_SECONDS = 0.3
LEASE_SECONDS = 15.0
HEARTBEAT_SECONDS = 1.0
POLL_SECONDS = 0.5
BACKOFF_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 8.0
LATENCY = (0.3, 1.0)
SIM_WORKERS = 4
# The whole call's deadline, and so the hold of a call we cut (H1): longer than
# the simulator works on any call (its longest hang, 12 s, plus an answer).
READ_TIMEOUT_SECONDS = 20.0
SCREEN_POLL_SECONDS = 1.0
MAX_SCREENS = 2
# A kill waits this long for a call in flight whose holder it can name.
KILL_WAIT_SECONDS = 20.0
# A refusal ends once the queue met its refused calls, or after this long.
REFUSE_MAX_SECONDS = 30.0
# A SIGKILLed holder keeps its `gateway` slot until its lease (60 s, renewed
# by the holder) lapses and Prefect's repossessor revokes it.
SLOT_RELEASE_SECONDS = 120.0
SERVE_START_ATTEMPTS = 2
SERVE_READY_SECONDS = 180.0

log = logging.getLogger("soak")


# -- processes ---------------------------------------------------------------------------------


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def worker_pid(worker: str) -> int | None:
    """The PID in a consumer's worker name (`role@host:pid:nonce`), if it has one."""
    parts = worker.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


# -- the stack ---------------------------------------------------------------------------------


class Stack:
    """The Prefect server, the simulator and serve; every start from the main thread.

    Processes are started from the main thread only, so each is sent SIGTERM
    by the kernel if this script dies without its cleanup (PR_SET_PDEATHSIG).
    """

    def __init__(self, workdir: Path, database_url: str, seed: int, postgres: bool) -> None:
        self.workdir = workdir
        self.database_url = database_url
        self.postgres = postgres
        self.server = PrefectServer(workdir / "prefect-server", processes.free_port(), ui=False)
        self.sim = GatewaySimulator(
            workers=SIM_WORKERS, latency=LATENCY, seed=seed, finish_abandoned=True
        )
        self.settings: Settings | None = None
        self.store: JobStore | None = None  # this script's reads, opened at the start
        self.serve: ServeProcess | None = None
        self.serve_pids: list[int] = []
        self.serve_start_failures: list[str] = []  # every failed attempt, with why
        self.serve_exit: int | None = None  # of the last serve, stopped at the end
        self.prefect_up = False

    @property
    def api_url(self) -> str:
        return self.server.api_url

    def start(self) -> None:
        self.sim.start()
        self.settings = Settings(
            database_url=self.database_url,
            data_dir=self.workdir / "data",
            concurrency=CONCURRENCY,
            gap_seconds=GAP_SECONDS,
            heartbeat_seconds=HEARTBEAT_SECONDS,
            lease_seconds=LEASE_SECONDS,
            poll_seconds=POLL_SECONDS,
            backoff_seconds=BACKOFF_SECONDS,
            backoff_max_seconds=BACKOFF_MAX_SECONDS,
            plugins="flows.demo",
            gateway={"url": self.sim.url, "read_timeout": READ_TIMEOUT_SECONDS},
        )
        # This process calls the triggers as the app would, and reads the
        # `gateway` limit: both from the environment, set before Prefect loads.
        os.environ.update(self.settings.to_env())
        os.environ.update(client_env(self.api_url, self.workdir / "prefect-client"))
        os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
        self.store = JobStore(self.database_url, settings=self.settings)
        self.start_prefect()
        self.start_serve()

    def start_prefect(self) -> None:
        self.server.start()
        self.prefect_up = True

    def stop_prefect(self) -> None:
        self.prefect_up = False
        self.server.stop()

    def start_serve(self) -> ServeProcess:
        """Start serve and wait until it is ready; a second try if the first one fails."""
        assert self.settings is not None
        args = ("--no-ui", "--upgrade") if self.postgres else ("--no-ui",)
        error: Exception | None = None
        for _ in range(SERVE_START_ATTEMPTS):
            # What a serve killed before this one left: its worker row (the
            # same stable name) looks alive for a lease, and its deployments
            # stay registered, so `ServeProcess.wait_ready` alone would pass
            # at once. Ready means: this serve wrote its own `serve.json`, its
            # consumer said it is alive after the one before it last did, and
            # its runner registered every deployment again (until then, a
            # Prefect outage makes serve exit: see `_serve_ready`).
            left = self._serve_seen()
            since = dt.datetime.now(dt.UTC)
            serve = ServeProcess(
                self.settings,
                self.api_url,
                env={"PYTHONPATH": str(ROOT), "PREFECT_LOGGING_LEVEL": "INFO"},
                log=self.workdir / "serve.log",
                args=args,
            )
            self.serve = serve
            try:
                serve.start()
                processes.wait_for(
                    functools.partial(self._serve_ready, serve, left, since),
                    timeout=SERVE_READY_SECONDS,
                    what=f"serve's own consumer (log: {serve.log})",
                    interval=0.2,
                    alive=serve.alive,
                )
            except (RuntimeError, TimeoutError) as exc:
                error = exc
                self.serve_start_failures.append(f"pid {serve.pid}: {str(exc)[:300]}")
                if serve.pid is not None:
                    self.serve_pids.append(serve.pid)
                serve.stop()
                continue
            assert serve.pid is not None
            self.serve_pids.append(serve.pid)
            return serve
        self.serve = None
        raise RuntimeError(f"serve did not start: {error}")

    def _serve_seen(self) -> dt.datetime | None:
        """When serve's consumer last said it is alive (the store's clock), if ever."""
        from deployments.serve import serve_worker
        from queue_store import StoreError

        assert self.settings is not None and self.store is not None
        name = serve_worker(self.settings)
        with contextlib.suppress(StoreError):
            return next(
                (w.seen_at for w in self.store.queue_view(0).workers if w.name == name), None
            )
        return None

    def _serve_ready(
        self, serve: ServeProcess, left: dt.datetime | None, since: dt.datetime
    ) -> bool:
        """This serve's own state, consumer and deployments (see `start_serve`).

        The deployments matter: serve exits with an error when Prefect cannot
        be reached before its runner has registered them, though its consumer
        is already serving. Waiting for them keeps the soak's Prefect
        restarts out of that start-up window.
        """
        from deployments.prefect_api import ServeState

        assert self.settings is not None
        state = ServeState.read(self.settings)
        if state is None or state.pid != serve.pid:
            return False
        seen = self._serve_seen()
        if seen is None or (left is not None and seen <= left):
            return False
        return all(
            (updated := self._deployment_updated(d.name)) is not None and updated >= since
            for d in table.DEPLOYMENTS
        )

    def _deployment_updated(self, name: str) -> dt.datetime | None:
        """When Prefect last had the deployment `flow/deployment` registered (upserted)."""
        flow, _, deployment = name.partition("/")
        try:
            response = httpx.get(
                f"{self.api_url}/deployments/name/{flow}/{deployment}", timeout=2.0
            )
            if response.status_code != 200:
                return None
            return dt.datetime.fromisoformat(str(response.json()["updated"]))
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def kill_serve(self) -> tuple[int, int | None, int]:
        """SIGKILL serve; reap what is left of its group. Returns (pid, exit code, reaped)."""
        serve = self.serve
        assert serve is not None and serve.process is not None
        pid = serve.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            serve.process.wait(10)
        # Its flow-run processes are left in its group, orphaned: a supervisor
        # restarting serve would end them with it.
        left = group_members(pid)
        code = serve.stop(grace_seconds=5)
        self.serve = None
        return pid, code, len(left)

    def stop(self) -> None:
        if self.serve is not None:
            self.serve_exit = self.serve.stop()
            self.serve = None
        with contextlib.suppress(Exception):
            self.sim.stop()
        self.stop_prefect()
        if self.store is not None:
            self.store.close()


# -- the store -------------------------------------------------------------------------------

DONE_LOG_SQLITE = [
    "CREATE TABLE soak_done_log (job_id TEXT NOT NULL, holder TEXT, attempts INTEGER,"
    " fingerprint TEXT, at TEXT DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')))",
    "CREATE TRIGGER soak_done AFTER UPDATE OF status ON ai_jobs"
    " WHEN NEW.status = 'done' AND OLD.status <> 'done'"
    " BEGIN INSERT INTO soak_done_log (job_id, holder, attempts, fingerprint)"
    " VALUES (NEW.id, OLD.holder, NEW.attempts, NEW.fingerprint); END",
]
DONE_LOG_POSTGRES = [
    "CREATE TABLE soak_done_log (job_id text NOT NULL, holder text, attempts int,"
    " fingerprint text, at timestamptz DEFAULT clock_timestamp())",
    "CREATE FUNCTION soak_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " INSERT INTO soak_done_log (job_id, holder, attempts, fingerprint)"
    " VALUES (NEW.id, OLD.holder, NEW.attempts, NEW.fingerprint); RETURN NEW; END $$",
    "CREATE TRIGGER soak_done AFTER UPDATE ON ai_jobs FOR EACH ROW"
    " WHEN (NEW.status = 'done' AND OLD.status IS DISTINCT FROM 'done')"
    " EXECUTE FUNCTION soak_done()",
]


class Database:
    """The soak's store: a SQLite file, or a PostgreSQL database created for it."""

    def __init__(self, workdir: Path, postgres_url: str | None) -> None:
        self.postgres_url = postgres_url
        self.created: str | None = None
        if postgres_url:
            from sqlalchemy.engine import make_url

            self.created = f"insight_queue_soak_{uuid.uuid4().hex[:10]}"
            self.url = (
                make_url(postgres_url)
                .set(database=self.created)
                .render_as_string(hide_password=False)
            )
        else:
            self.url = f"sqlite:///{workdir / 'queue.db'}"
        self._engine: Any = None

    def create(self) -> None:
        from sqlalchemy import text

        from queue_store import migrate
        from queue_store.engine import create_store_engine

        if self.created:
            with self._admin() as admin, admin.connect() as connection:
                connection.execute(text(f"CREATE DATABASE {self.created}"))
        migrate.upgrade(self.url)
        self._engine = create_store_engine(self.url)
        statements = DONE_LOG_POSTGRES if self.created else DONE_LOG_SQLITE
        with self._engine.begin() as connection:
            for statement in statements:
                connection.exec_driver_sql(statement)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def drop(self) -> None:
        from sqlalchemy import text

        self.close()
        if self.created:
            with self._admin() as admin, admin.connect() as connection:
                connection.execute(text(f"DROP DATABASE IF EXISTS {self.created} WITH (FORCE)"))

    @contextlib.contextmanager
    def _admin(self) -> Iterator[Any]:
        from sqlalchemy import create_engine

        from queue_store.engine import normalise_url

        engine = create_engine(normalise_url(self.postgres_url or ""), isolation_level="AUTOCOMMIT")
        try:
            yield engine
        finally:
            engine.dispose()

    def rows(self, query: str) -> list[Any]:
        assert self._engine is not None
        with self._engine.connect() as connection:
            return list(connection.exec_driver_sql(query).all())


# -- events -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Event:
    at: float  # seconds since the start of the run
    kind: str
    detail: str = ""


@dataclasses.dataclass
class ScreenWait:
    key: tuple[str, str, str]
    started: float
    fingerprint: str | None
    waited: float | None = None  # seconds until the state said done; None if it never did
    final: str = ""
    polls: int = 0
    errors: int = 0


@dataclasses.dataclass
class Refusal:
    """A refusal in force: it ends once the queue met `calls` refused calls."""

    calls: int
    baseline: int  # the store's outage streak when it began
    started: float


class Soak:
    def __init__(self, args: argparse.Namespace, stack: Stack, database: Database) -> None:
        assert stack.settings is not None and stack.store is not None
        self.args = args
        self.stack = stack
        self.settings = stack.settings
        self.database = database
        self.rng = random.Random(args.seed)
        self.events: list[Event] = []
        self.screens: list[ScreenWait] = []
        self.users: list[str] = []
        self.backfills = 0
        self.started = time.monotonic()
        self.stop_screens = threading.Event()
        self.screen_threads: list[threading.Thread] = []
        self.unstarted_backfills: list[str] = []
        self.evidence: list[dict[str, Any]] = []
        # Faults in force, ended by `tick()` from the main loop.
        self.prefect_back_at: float | None = None  # monotonic time to start Prefect again
        self.prefect_stopped_at: float | None = None
        self.serve_killed_at: float | None = None  # serve is down, to be started again
        self.refusal: Refusal | None = None
        self.triggers = Triggers.open(self.settings)
        self.serve_kills = 0
        self.serve_restarts = 0
        self.serve_exits_unasked: list[str] = []
        self.store = stack.store

    def now(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def record(self, kind: str, detail: str = "") -> None:
        event = Event(self.now(), kind, detail)
        self.events.append(event)
        log.warning("t=%6.1f %-9s %s", event.at, kind, detail)
        if self.args.verbose:
            print(f"t={event.at:6.1f} {kind:<9} {detail}", flush=True)

    # -- the schedule

    def schedule(self, chaos_seconds: float) -> list[tuple[float, str]]:
        """Seeded: each disruption at least once, then random fill every 4-10 s."""
        planned = [(0.0, "backfill")]
        for kind in ("kill", "outage", "prefect"):
            planned.append((self.rng.uniform(0.15, 0.8) * chaos_seconds, kind))
        at = 2.0
        kinds = ["backfill", "screen", "outage", "kill", "prefect"]
        weights = [30, 30, 18, 14, 8]
        while True:
            at += self.rng.uniform(4, 10)
            if at >= chaos_seconds:
                break
            planned.append((at, self.rng.choices(kinds, weights)[0]))
        return sorted(planned)

    def run(self) -> None:
        total = self.args.minutes * 60
        quiet = self.args.quiet_seconds
        if quiet is None:
            quiet = max(45.0, total / 4)
        chaos = max(total - quiet, 10.0)
        plan = self.schedule(chaos)
        log.warning("plan: %s", plan)
        for at, kind in plan:
            self._sleep_until(at)
            getattr(self, f"do_{kind}")()
            self.tick()
        # The quiet part: end every fault still in force.
        if self.prefect_back_at is not None:
            self.prefect_back_at = time.monotonic()
        if self.refusal is not None:
            self._end_refusal("the quiet part began")
        self.tick()
        self.stack.sim.clear_fault()
        self.record("quiet", f"no more events after {chaos:.0f} s")
        self._sleep_until(total)
        self.settle(total)

    def _sleep_until(self, at: float) -> None:
        while (left := at - (time.monotonic() - self.started)) > 0:
            self.tick()
            time.sleep(min(left, 0.5))

    def tick(self) -> None:
        """End the faults whose event came; notice a serve that exited on its own."""
        if self.prefect_back_at is not None and time.monotonic() >= self.prefect_back_at:
            self.prefect_back_at = None
            began = self.prefect_stopped_at or time.monotonic()
            self.stack.start_prefect()
            self.record("prefect", f"server back after {time.monotonic() - began:.1f} s down")
        if self.refusal is not None:
            with contextlib.suppress(Exception):  # the store may be slow: next tick
                streak = self.store.gate_state().outages_in_a_row
                if streak - self.refusal.baseline >= self.refusal.calls:
                    self._end_refusal(f"the queue met {streak - self.refusal.baseline}")
            if (
                self.refusal is not None
                and time.monotonic() - self.refusal.started > REFUSE_MAX_SECONDS
            ):
                self._end_refusal("no call met it in time")
        serve = self.stack.serve
        if serve is not None and not serve.alive():
            code = serve.process.returncode if serve.process is not None else None
            self.serve_exits_unasked.append(f"pid {serve.pid} exited with {code}")
            self.record("serve", f"exited on its own (pid {serve.pid}, code {code})")
            serve.stop()
            self.stack.serve = None
            self.serve_killed_at = time.monotonic()
        if self.serve_killed_at is not None and self.stack.prefect_up:
            killed_at, self.serve_killed_at = self.serve_killed_at, None
            try:
                started = self.stack.start_serve()
            except RuntimeError as exc:
                self.record("serve", f"could not be started again: {str(exc)[:200]}")
                return
            self.serve_restarts += 1
            self.record(
                "serve",
                f"back after {time.monotonic() - killed_at:.1f} s (pid {started.pid}, "
                "deployments registered, consumer alive)",
            )

    # -- the events

    def do_backfill(self, why: str = "", *, new_user: bool = False) -> None:
        # A known user's scopes are done already (same data): only a new
        # user's queue new work.
        if new_user or not self.users or self.rng.random() < 0.6:
            user = f"soak-{len(self.users) + 1:03d}"
            self.users.append(user)
        else:
            user = self.rng.choice(self.users)
        self.backfills += 1
        state = self.triggers.trigger_backfill(user, sync_id=f"sync-{self.backfills}")
        if state.flow_run_id is None:
            self.unstarted_backfills.append(user)
        run = state.flow_run_id or f"no run ({state.run_note})"
        error = f"; store error: {state.error}" if state.error else ""
        self.record("backfill", f"{why}{user}: {state.queued} scopes queued, run {run}{error}")

    def do_screen(self) -> None:
        from flows.demo import METRICS, demo_scopes

        alive = [t for t in self.screen_threads if t.is_alive()]
        if len(alive) >= MAX_SCREENS:
            self.record("screen", "skipped: two screens already open")
            return
        fingerprint = None
        if self.users and self.rng.random() < 0.6:
            user = self.rng.choice(self.users)
            scope = self.rng.choice(demo_scopes(user))
            key = (scope.kind, scope.subject)
            # Half the screens know their data's hash; the others queue the key
            # without one, and a later backfill's fingerprint makes it stale.
            fingerprint = scope.fingerprint if self.rng.random() < 0.5 else None
        else:
            day = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=self.rng.randint(1, 20))
            key = (self.rng.choice(sorted(METRICS)), day.isoformat())
            user = f"screen-{self.rng.randint(1, 5)}"
        wait = ScreenWait((user, *key), self.now(), fingerprint)
        self.screens.append(wait)
        thread = threading.Thread(target=self._screen, args=(wait,), daemon=True)
        self.screen_threads.append(thread)
        thread.start()
        self.record("screen", f"{user} {key[0]}:{key[1]}")

    def _screen(self, wait: ScreenWait) -> None:
        started = time.monotonic()
        while not self.stop_screens.is_set():
            state = self.triggers.request_insight(*wait.key, wait.fingerprint)
            wait.polls += 1
            wait.errors += state.error is not None
            wait.final = state.status
            if state.status in ("done", "failed"):
                wait.waited = round(time.monotonic() - started, 1)
                return
            self.stop_screens.wait(SCREEN_POLL_SECONDS)

    def do_kill(self) -> None:
        """SIGKILL the process holding the call in flight (serve, or a flow run draining)."""
        if self.stack.serve is None:
            self.record("kill", "skipped: serve is down, waiting to be started again")
            return
        if pending(self.store) == 0:
            self.do_backfill("work for the kill: ", new_user=True)
        calls_before = len(self.stack.sim.stats().requests)
        # Time spent starting Prefect or serve again (`tick`) does not count
        # against the wait: the kill looks for a call for the whole time.
        looked = 0.0
        while True:
            began = time.monotonic()
            target = self._holder_mid_call()
            if target is not None:
                break
            time.sleep(0.1)
            looked += time.monotonic() - began
            if looked >= KILL_WAIT_SECONDS:
                break
            self.tick()
        serve = self.stack.serve
        if target is None or serve is None or serve.pid is None:
            self.record("kill", f"skipped: {self._why_no_call(calls_before)}")
            return
        pid, worker, label = target
        if pid == serve.pid:
            pid, code, reaped = self.stack.kill_serve()
            self.serve_kills += 1
            self.serve_killed_at = time.monotonic()
            self.record(
                "kill",
                f"SIGKILL {pid} (serve, {worker}): it held {label}, its call in flight; "
                f"exit {code}, {reaped} process(es) of its group reaped; starting it again",
            )
            return
        # Checked again right before the signal: only a process in our serve's group.
        if process_group(pid) != serve.pid:
            self.record("kill", f"skipped: {pid} is no longer in serve's process group")
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.record(
            "kill",
            f"SIGKILL {pid} (flow run, {worker}): it held {label}, its call in flight; "
            "serve lives on",
        )

    def _why_no_call(self, calls_before: int) -> str:
        """What the gateway and the store said when a kill found no call to interrupt."""
        calls = len(self.stack.sim.stats().requests) - calls_before
        try:
            gate = self.store.gate_state()
            paused = f"{gate.pause_kind} pause" if gate.paused else "no pause"
            queued = f"{pending(self.store)} pending or running, {paused}"
        except Exception as exc:  # noqa: BLE001 - a description, whatever the store says
            queued = f"store unreadable ({type(exc).__name__})"
        return (
            f"no call in flight held by a process of ours within {KILL_WAIT_SECONDS:g} s "
            f"({calls} gateway request(s) meanwhile; {queued})"
        )

    def _holder_mid_call(self) -> tuple[int, str, str] | None:
        """(pid, worker, kind:subject) of the claim whose call is open at the gateway now."""
        serve = self.stack.serve
        if serve is None or serve.pid is None:
            return None
        open_calls = {
            r.job
            for r in self.stack.sim.stats().requests
            if r.started is not None and r.ended is None and r.job
        }
        if not open_calls:
            return None
        rows = self.database.rows(
            "SELECT kind, subject, worker FROM ai_jobs WHERE status = 'running'"
        )
        from deployments.serve import serve_worker

        ours = serve_worker(self.settings)
        for kind, subject, worker in rows:
            label = f"{kind}:{subject}"
            if label not in open_calls or not worker:
                continue
            if worker == ours:
                return serve.pid, worker, label
            pid = worker_pid(worker)
            if pid is not None and process_group(pid) == serve.pid and pid != serve.pid:
                return pid, worker, label
        return None

    def do_outage(self) -> None:
        sim = self.stack.sim
        if self.refusal is not None or sim.stats().fault is not None:
            self.record("outage", "skipped: one is already on")
            return
        kind = self.rng.choice(["refuse", "status", "hang"])
        if kind == "refuse":
            calls = self.rng.randint(1, 3)
            baseline = self.store.gate_state().outages_in_a_row
            sim.set_fault("refuse")
            self.refusal = Refusal(calls, baseline, time.monotonic())
            self.record("outage", f"refuse connections for {calls} refused call(s)")
        elif kind == "status":
            count = self.rng.randint(2, 6)
            sim.set_fault("status", status=503, requests=count)
            self.record("outage", f"503 for the next {count} calls")
        else:
            hold = round(self.rng.uniform(2, 12), 1)
            sim.set_fault("hang", requests=1, hold_seconds=hold)
            self.record("outage", f"hang for the next call, {hold} s")

    def _end_refusal(self, why: str) -> None:
        refusal, self.refusal = self.refusal, None
        assert refusal is not None
        self.stack.sim.clear_fault()
        self.record(
            "outage",
            f"listening again after {time.monotonic() - refusal.started:.1f} s ({why})",
        )

    def do_prefect(self) -> None:
        """Stop the Prefect server; trigger a backfill while it is down; start it in 2-8 s."""
        if not self.stack.prefect_up:
            self.record("prefect", "skipped: the server is already down")
            return
        down = round(self.rng.uniform(2, 8), 1)
        self.prefect_stopped_at = time.monotonic()
        self.stack.stop_prefect()
        self.record("prefect", f"server stopped, for {down} s")
        self.do_backfill("while Prefect is down: ", new_user=True)
        self.prefect_back_at = self.prefect_stopped_at + down

    # -- the end

    def settle(self, total: float) -> None:
        deadline = time.monotonic() + self.args.settle_timeout
        while time.monotonic() < deadline:
            self.tick()
            with contextlib.suppress(Exception):
                if pending(self.store) == 0 and all(not t.is_alive() for t in self.screen_threads):
                    break
            time.sleep(1)
        self.stop_screens.set()
        for thread in self.screen_threads:
            thread.join(30)
        self.record("settled", f"{self.now() - total:.0f} s after the planned end")

    def missing_scopes(self) -> dict[str, int]:
        """Backfilled users whose demo scopes are not all in the store, and how many lack."""
        from flows.demo import demo_scopes

        missing = {}
        for user in sorted(set(self.users)):
            present = {(e["kind"], e["subject"]) for e in listed_jobs(self.store, user, 1000)}
            lacking = [s for s in demo_scopes(user) if (s.kind, s.subject) not in present]
            if lacking:
                missing[user] = len(lacking)
        return missing

    def slots(self) -> dict[str, Any]:
        """The `gateway` slots Prefect counts, and those live holders hold.

        Waits (up to `SLOT_RELEASE_SECONDS`) for the leases of killed holders
        to lapse. Serve's consumer keeps its slot while idle: the leases it
        holds are in `serve.json`.
        """
        from deployments.prefect_api import ServeState
        from flows.limits import repair_gateway_slots

        deadline = time.monotonic() + SLOT_RELEASE_SECONDS
        started = time.monotonic()
        while True:
            check = repair_gateway_slots(repair=False)
            state = ServeState.read(self.settings)
            serve_leases = len(state.leases) if state is not None else 0
            held = serve_leases + check.live
            if check.counted <= held or time.monotonic() >= deadline:
                break
            time.sleep(2)
        return {
            "limit": check.limit,
            "counted": check.counted,
            "held_by_serve": serve_leases,
            "held_by_task_runs": check.live,
            "leaked": max(0, check.counted - held),
            "waited_seconds": round(time.monotonic() - started, 1),
        }

    def check(self) -> dict[str, Any]:
        stats = self.stack.sim.stats()
        jobs = self.database.rows(
            "SELECT id, user_id, kind, subject, status, attempts, error, holder FROM ai_jobs"
        )
        done_log = self.database.rows(
            "SELECT job_id, holder, attempts, fingerprint, at FROM soak_done_log ORDER BY at"
        )
        slots = self.slots()
        serve_alive = self.stack.serve is not None and self.stack.serve.alive()

        statuses = Counter(row.status for row in jobs)
        failed_without_reason = [r.id[:12] for r in jobs if r.status == "failed" and not r.error]
        unfinished = [f"{r.kind}:{r.subject}" for r in jobs if r.status in ("pending", "running")]
        # A job is done once per round. A new round starts when a newer
        # fingerprint makes the result stale (R6): e.g. a screen queued the key
        # without one, a backfill brought the data's. Twice with the same
        # fingerprint is the same round done twice.
        rounds = Counter((row.job_id, row.fingerprint) for row in done_log)
        by_id = {row.id: row for row in jobs}
        done_twice = {
            f"{by_id[job_id].user_id}/{by_id[job_id].kind}:{by_id[job_id].subject}": [
                f"{d.at} by {d.holder} (attempts {d.attempts}, fingerprint {d.fingerprint})"
                for d in done_log
                if d.job_id == job_id
            ]
            for (job_id, _), n in rounds.items()
            if n > 1
        }
        # Done again for a newer fingerprint: legitimate re-generations.
        new_rounds = len(rounds) - len({row.job_id for row in done_log})
        if done_twice:  # the simulator's view of those jobs, for the report
            labels = {k.split("/", 1)[1] for k in done_twice}
            self.evidence = [dataclasses.asdict(r) for r in stats.requests if r.job in labels]
        overlap = peak_from_records(stats.requests)
        answers = sum(1 for r in stats.requests if r.outcome in ("ok", "hung"))
        waits = [s.waited for s in self.screens if s.waited is not None]
        stuck_screens = [
            f"{s.key[1]}:{s.key[2]} ({s.final})" for s in self.screens if s.waited is None
        ]
        lost_backfills = self.missing_scopes()
        invariants = {
            "every job done or failed with a reason": not unfinished and not failed_without_reason,
            "never more than the limit in flight": max(stats.peak_in_flight, overlap)
            <= CONCURRENCY,
            "no job done twice in one round": not done_twice,
            "no leaked gateway slot": slots["leaked"] == 0,
            "no stuck running rows": statuses.get("running", 0) == 0,
            "serve never exited on its own": not self.serve_exits_unasked,
            "every killed serve was restarted and came back": (
                self.serve_restarts >= self.serve_kills
                and not self.stack.serve_start_failures
                and serve_alive
            ),
            "every screen got its job": not stuck_screens,
            "every backfilled user's scopes queued": not lost_backfills,
        }
        return {
            "seed": self.args.seed,
            "minutes": self.args.minutes,
            "store": "postgresql" if self.database.created else "sqlite",
            "elapsed_seconds": self.now(),
            "events": dict(Counter(e.kind for e in self.events)),
            "event_log": [dataclasses.asdict(e) for e in self.events],
            "users": len(self.users),
            "backfills": self.backfills,
            "backfills_without_a_run": self.unstarted_backfills,
            "backfills_lost": lost_backfills,
            "jobs": len(jobs),
            "outcomes": dict(statuses),
            "attempts": dict(Counter(row.attempts for row in jobs)),
            "failed": {f"{r.kind}:{r.subject}": r.error for r in jobs if r.status == "failed"},
            "unfinished": unfinished,
            "gateway_requests": len(stats.requests),
            "gateway_outcomes": dict(Counter(r.outcome for r in stats.requests)),
            # Answers no result was recorded for: a holder killed after its
            # call, or an answer that came back after its claim was taken over.
            "gateway_answers_unrecorded": answers - len(done_log),
            "peak_in_flight": stats.peak_in_flight,
            "peak_in_flight_from_records": overlap,
            "done_twice": done_twice,
            "done_again_for_a_newer_fingerprint": new_rounds,
            "done_twice_gateway_requests": self.evidence,
            "gateway_slot": slots,
            "serve_kills": self.serve_kills,
            "serve_restarts": self.serve_restarts,
            "serve_exits_unasked": self.serve_exits_unasked,
            "serve_start_failures": self.stack.serve_start_failures,
            "serve_pids": self.stack.serve_pids,
            "screens": len(self.screens),
            "screen_wait_p50": percentile(waits, 0.5) if waits else None,
            "screen_wait_p95": percentile(waits, 0.95) if waits else None,
            "screen_wait_max": max(waits) if waits else None,
            "screen_wait_median": statistics.median(waits) if waits else None,
            "screen_polls_with_error": sum(s.errors for s in self.screens),
            "stuck_screens": stuck_screens,
            "invariants": invariants,
            "ok": all(invariants.values()),
        }


def peak_from_records(records: Sequence[RequestRecord]) -> int:
    """Most requests the simulator's workers held at once, from their start and end times."""
    edges: list[tuple[float, int]] = []
    for r in records:
        if r.started is not None:
            edges.append((r.started, 1))
            edges.append((r.ended if r.ended is not None else float("inf"), -1))
    peak = current = 0
    for _, step in sorted(edges):  # at a tie, an end (-1) sorts before a start
        current += step
        peak = max(peak, current)
    return peak


def print_summary(summary: dict[str, Any]) -> None:
    print("\n== soak summary ==")
    print(
        f"seed {summary['seed']}, {summary['minutes']} min, store {summary['store']}, "
        f"{summary['elapsed_seconds']:.0f} s in all"
    )
    print(f"events: {summary['events']}")
    for event in summary["event_log"]:
        print(f"  t={event['at']:6.1f} {event['kind']:<9} {event['detail']}")
    print(
        f"jobs: {summary['jobs']} for {summary['users']} users, {summary['backfills']} "
        f"backfills; outcomes {summary['outcomes']}; attempts {summary['attempts']}"
    )
    if summary["backfills_without_a_run"]:
        print(f"backfills triggered while Prefect was down: {summary['backfills_without_a_run']}")
    if summary["failed"]:
        print(f"failed: {summary['failed']}")
    print(
        f"gateway: {summary['gateway_requests']} requests {summary['gateway_outcomes']}; "
        f"{summary['gateway_answers_unrecorded']} answers without a recorded result; "
        f"peak in flight "
        f"{summary['peak_in_flight']} (records: {summary['peak_in_flight_from_records']})"
    )
    print(
        f"backfilled users missing scopes (lost backfills): {summary['backfills_lost'] or 'none'}"
    )
    print(
        f"done again for a newer fingerprint: {summary['done_again_for_a_newer_fingerprint']}; "
        f"done twice in one round: {summary['done_twice'] or 'none'}"
    )
    print(f"gateway slot: {summary['gateway_slot']}")
    print(
        f"serve: killed {summary['serve_kills']}, restarted {summary['serve_restarts']}, "
        f"exited on its own {summary['serve_exits_unasked'] or 'never'}, failed starts "
        f"{summary['serve_start_failures'] or 'none'}, pids {summary['serve_pids']}"
    )
    print(
        f"screens: {summary['screens']}, waits p50 {summary['screen_wait_p50']} s, p95 "
        f"{summary['screen_wait_p95']} s, max {summary['screen_wait_max']} s; polls answered "
        f"with an error {summary['screen_polls_with_error']}"
    )
    for name, held in summary["invariants"].items():
        print(f"  [{'ok' if held else 'FAILED'}] {name}")
    print("soak passed" if summary["ok"] else "soak FAILED")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--postgres-url", default=None, help="run the store on this server")
    parser.add_argument("--quiet-seconds", type=float, default=None)
    parser.add_argument("--settle-timeout", type=float, default=240.0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep everything here")
    parser.add_argument("--json-out", type=Path, default=None, help="write the summary here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print events as they happen")
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="insight-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=workdir / "soak.log",
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    database = Database(workdir, args.postgres_url)
    stack = Stack(workdir, database.url, args.seed, postgres=bool(args.postgres_url))
    summary: dict[str, Any] | None = None
    # SIGTERM (a test's timeout), SIGHUP and Ctrl-C unwind through every `finally`.
    with processes.stop_signals():
        try:
            database.create()
            stack.start()
            soak = Soak(args, stack, database)
            try:
                soak.run()
                summary = soak.check()
            finally:
                soak.stop_screens.set()
                with contextlib.suppress(Exception):
                    soak.triggers.close()
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        finally:
            stack.stop()
            database.close()
            if summary is not None and not summary["ok"] and database.created:
                print(f"database {database.created} kept for inspection", file=sys.stderr)
            else:
                with contextlib.suppress(Exception):
                    database.drop()
            if args.workdir is None and summary is not None and summary["ok"]:
                shutil.rmtree(workdir, ignore_errors=True)
    assert summary is not None
    summary["serve_exit_at_the_end"] = stack.serve_exit
    print_summary(summary)
    print(f"serve's exit code when stopped at the end: {stack.serve_exit}")
    if not summary["ok"]:
        print(f"logs kept in {workdir}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
