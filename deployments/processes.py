"""Processes we start, in a session of their own and (on Linux) sent SIGTERM if we die first, and
the signals that stop us."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

STOP_GRACE_SECONDS = 10.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every command's and server's
PR_SET_PDEATHSIG = 1

_libc: Any = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread dies (Linux only)."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    cwd: Path | None = None,
    umask: int = -1,
) -> subprocess.Popen[bytes]:
    """Start a command in its own session; `umask` is the child's (-1: this process's)."""
    handle = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(log, "ab")  # noqa: SIM115 - closed below, the child keeps its copy
        if umask != -1:
            os.chmod(log, 0o666 & ~umask)
    # PDEATHSIG fires when the *thread* that forked the child exits: only the main thread
    # outlives it.
    main_thread = threading.current_thread() is threading.main_thread()
    try:
        return subprocess.Popen(
            list(args),
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=handle,
            stderr=subprocess.STDOUT if handle is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            umask=umask,
            preexec_fn=_die_with_parent if main_thread else None,
        )
    finally:
        if handle is not None:
            handle.close()


def stop_group(process: subprocess.Popen[Any], grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Stop a process we started, with everything it started."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_seconds)
    # Whatever is left of the group then gets SIGKILL: its leader too, if the grace was not enough.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


def interrupt_group(process: subprocess.Popen[Any]) -> None:
    """SIGINT (twice), then as `stop_group`: Prefect's worker stops its runs on SIGINT only."""
    for _ in range(2):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_GRACE_SECONDS / 2)
    stop_group(process, grace_seconds=5)


def process_table() -> Iterator[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process, from /proc."""
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After the command name, which may hold spaces and parentheses.
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(entry.parent.name), int(fields[1]), int(fields[2])


def children(pid: int | None = None) -> list[int]:
    """PIDs whose parent is `pid` (default: this process)."""
    parent = os.getpid() if pid is None else pid
    return [found for found, ppid, _ in process_table() if ppid == parent]


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM, SIGHUP and SIGINT as `KeyboardInterrupt`, once: cleanup is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def export_to_children(
    settings: Any = None, overrides: Mapping[str, str] | None = None, **defaults: str
) -> None:
    """The one way a command hands its configuration to the processes it starts (uvicorn's
    workers, Prefect's runner and workers, flow runs): this process's environment, which they
    inherit. `settings`: the `AI_*` variables that reproduce them; `overrides` win over the
    environment; `defaults` are set only where it names nothing."""
    if settings is not None:
        os.environ.update(settings.to_env())
    os.environ.update(overrides or {})
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind the port (as a server would: TIME_WAIT does not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """`preferred` if it is free (0: any), else a free port the kernel picks."""
    if preferred and port_is_free(preferred, host):
        return preferred
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for(
    ready: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.2,
    alive: Callable[[], bool] | None = None,
) -> None:
    """Poll `ready()`; `TimeoutError` after `timeout` s, `RuntimeError` once `alive()` is false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if alive is not None and not alive():
            raise RuntimeError(f"{what}: the process exited while we waited")
        time.sleep(interval)
    raise TimeoutError(f"{what}: not ready within {timeout:g} s")
