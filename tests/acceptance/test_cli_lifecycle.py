"""The command line as a user meets it: stopping, finding Prefect, and the first steps.

- `demo` and `serve` stop on SIGTERM, SIGINT and SIGHUP within seconds, and
  leave no process of theirs and no port behind, whatever order things die in;
- the app-side commands find the Prefect server `serve` started for the same
  data directory, never start a temporary one, and answer within 5 s with a
  one-line reason whatever Prefect's state;
- the README's first steps work from a fresh clone with nothing configured.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments import processes
from deployments.prefect_api import ServeState
from deployments.stack import DEFAULT_PORT
from tests.support.factories import settings_for
from tests.support.services import BIN, ROOT, PrefectServer, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

STOP_SECONDS = 20.0  # what "within seconds" is allowed to be on a loaded 2-core machine


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        for child in processes.children(frontier.pop()):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _isolated_env(home: Path) -> dict[str, str]:
    """A user with nothing configured: an empty home, no AI_* or PREFECT_* variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AI_", "PREFECT_")) and k not in ("HOME", "XDG_DATA_HOME")
    }
    env["HOME"] = str(home)
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return processes.start([str(BIN / "insight-queue"), *args], env=env, log=log, cwd=ROOT)


def _wait_for_line(
    log: Path, pattern: str, process: subprocess.Popen[bytes], timeout: float
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if re.search(pattern, text):
            return text
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {pattern!r}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout:g} s:\n{log.read_text()[-3000:]}")


def _stop_and_check(
    process: subprocess.Popen[bytes], sig: signal.Signals, ports: list[int]
) -> float:
    family = _descendants(process.pid)
    started = time.monotonic()
    process.send_signal(sig)
    process.wait(STOP_SECONDS + 10)
    took = time.monotonic() - started
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and [p for p in family if _alive(p)]:
        time.sleep(0.1)
    assert not [p for p in family if _alive(p)], f"left running after {sig.name}: {family}"
    for port in ports:
        assert processes.port_is_free(port), f"port {port} still held after {sig.name}"
    return took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_demo_stops_everything_it_started_on_a_signal(tmp_path: Path, sig: signal.Signals) -> None:
    if not processes.port_is_free(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} is busy on this machine")
    log = tmp_path / "demo.log"
    demo = processes.start(
        [str(BIN / "python"), "-m", "devtools.demo", "--keep-running"],
        env=_isolated_env(tmp_path),
        log=log,
        cwd=ROOT,
    )
    try:
        text = _wait_for_line(log, r"gateway call 2:", demo, timeout=240)
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text)]
        took = _stop_and_check(demo, sig, ports)
    finally:
        processes.stop_group(demo)
    assert took < STOP_SECONDS, f"demo took {took:.1f} s to stop on {sig.name}"
    assert "stopping everything the demo started" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_serve_stops_with_its_prefect_server_on_a_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    env = _isolated_env(tmp_path)
    port = processes.free_port()
    log = tmp_path / "serve.log"
    serve = _start(["serve", "--prefect-port", str(port), "--no-ui"], env, log)
    try:
        _wait_for_line(log, r"insight-queue serving", serve, timeout=240)
        state = ServeState.read(settings_for(data_dir=tmp_path / ".local/share/insight-queue"))
        assert state is not None and state.pid == serve.pid
        took = _stop_and_check(serve, sig, [port])
    finally:
        processes.stop_group(serve)
    assert took < STOP_SECONDS, f"serve took {took:.1f} s to stop on {sig.name}"
    assert serve.returncode == 0, log.read_text()[-3000:]
    assert not (tmp_path / ".local/share/insight-queue/serve.json").exists()


def test_serve_stops_even_when_its_prefect_server_died_first(tmp_path: Path) -> None:
    env = _isolated_env(tmp_path)
    port = processes.free_port()
    log = tmp_path / "serve.log"
    serve = _start(["serve", "--prefect-port", str(port), "--no-ui"], env, log)
    try:
        _wait_for_line(log, r"insight-queue serving", serve, timeout=240)
        server = [
            p
            for p in processes.children(serve.pid)
            if "prefect" in Path(f"/proc/{p}/cmdline").read_text()
        ]
        assert server, "no Prefect server under serve"
        os.killpg(server[0], signal.SIGKILL)
        took = _stop_and_check(serve, signal.SIGTERM, [port])
    finally:
        processes.stop_group(serve)
    assert took < STOP_SECONDS, f"serve took {took:.1f} s to stop without its Prefect server"


def _timed_request(env: dict[str, str]) -> tuple[float, dict[str, object]]:
    started = time.monotonic()
    result = run_cli("request-insight", "u1", "sleep", "2026-11-29", env=env, timeout=30)
    took = time.monotonic() - started
    state: dict[str, object] = json.loads(result.stdout)
    assert "Traceback" not in result.stderr
    return took, state


def test_a_screens_command_answers_within_five_seconds_whatever_prefects_state(
    tmp_path: Path, prefect_server: PrefectServer
) -> None:
    base = {**_isolated_env(tmp_path), "AI_JOB_DATA_DIR": str(tmp_path / "data")}

    took, state = _timed_request(base)  # no PREFECT_API_URL, no serve: never a temporary server
    assert took < 5 and state["status"] == "pending"
    assert "no Prefect server" in str(state["run_note"])

    dead = processes.free_port()
    took, state = _timed_request({**base, "PREFECT_API_URL": f"http://127.0.0.1:{dead}/api"})
    assert took < 5 and "Prefect unreachable" in str(state["run_note"])

    took, state = _timed_request({**base, "PREFECT_API_URL": prefect_server.api_url})
    assert took < 5 and "has no deployment interactive/insight-queue" in str(state["run_note"])


def test_the_readmes_first_steps_work_from_a_fresh_clone(tmp_path: Path) -> None:
    """Clone the repository and run the README's first steps as written, nothing configured."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    readme = (clone / "README.md").read_text()
    block = re.search(r"<!-- first-steps -->\s*```sh\n(.*?)```", readme, re.S)
    assert block, "the README has no first-steps block"
    env = {**_isolated_env(tmp_path), "PYTHONPATH": str(clone)}
    background: list[subprocess.Popen[bytes]] = []
    try:
        for line in block.group(1).splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            run_in_background = line.endswith("&")
            words = shlex.split(line.rstrip("&"))
            assert words[0] == ".venv/bin/insight-queue", line
            command = [str(BIN / "insight-queue"), *words[1:]]
            if run_in_background:
                log = tmp_path / f"background-{len(background)}.log"
                process = processes.start(command, env=env, log=log, cwd=clone)
                background.append(process)
                _wait_for_line(log, r"insight-queue serving", process, timeout=240)
                continue
            result = subprocess.run(
                command, env=env, cwd=clone, capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, (
                f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            )
            assert "Traceback" not in result.stderr, result.stderr
    finally:
        for process in background:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_SECONDS)
            finally:
                processes.stop_group(process)
    assert sys.executable  # the clone ran on this environment's interpreter and packages
