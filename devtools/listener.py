"""A server on a thread of its own: the life cycle the gateway's stand-ins share.

The gateway simulator and the gateway recorder are development tools that
tests, benchmarks and the demo run inside their own process. Each binds a
socket, serves it from one thread running its own event loop, reports a
failure to start to the caller of `start()`, and stops when asked from any
other thread. `ThreadedListener` is that life cycle; a subclass says what to
serve and how to end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from types import TracebackType
from typing import ClassVar, Self

logger = logging.getLogger(__name__)

START_TIMEOUT = 10.0  # seconds to wait for the thread to listen
STOP_JOIN_TIMEOUT = 10.0  # seconds to wait for the thread when stopping


class ThreadedListener:
    """Listens on `host:port` (0: a free port) and serves from one thread.

    A subclass implements `_serve(sock)`, which runs on the thread's loop,
    calls `_mark_ready()` once it accepts connections and returns when the
    server has ended, and `_request_stop()`, which runs on that loop and
    makes `_serve` return. Start with `start()` or a `with` block; `stop()`
    joins the thread.
    """

    what: ClassVar[str]  # what it is, in messages: "gateway recorder"

    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._started = False

    @property
    def url(self) -> str:
        """Base URL for a client."""
        if not self._started:
            raise RuntimeError(f"the {self.what} is not started")
        host = f"[{self._host}]" if self._family == socket.AF_INET6 else self._host
        return f"http://{host}:{self._port}"

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> Self:
        """Listen, serving from a background thread; OSError if the port is taken."""
        if self._started:
            raise RuntimeError(f"the {self.what} was already started")
        sock = self._bind()
        self._port = int(sock.getsockname()[1])
        self._started = True
        self._thread = threading.Thread(
            target=self._run, args=(sock,), name=f"{self.what.replace(' ', '-')}-{self._port}"
        )
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the {self.what} did not start") from self._failure
        return self

    def stop(self) -> None:
        """Ask the server to end, and join its thread."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(self._request_stop)
        thread.join(STOP_JOIN_TIMEOUT)
        if thread.is_alive():
            raise RuntimeError(f"the {self.what}'s thread did not stop")
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # --- for subclasses ------------------------------------------------------

    async def _serve(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def _request_stop(self) -> None:
        raise NotImplementedError

    def _served(self) -> None:
        """Runs on the thread once the server has ended, however it ended."""

    def _mark_ready(self) -> None:
        self._ready.set()

    def _bind(self) -> socket.socket:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            # Take the port back at once after a stop; two listeners on one
            # port are still refused.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        return sock

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as exc:  # handed to start(), or logged
            self._failure = exc
            logger.exception("%s: the server failed", self.what)
        finally:
            self._ready.set()
            self._served()
            _close_loop(loop)
            sock.close()


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what still runs on a loop whose main coroutine ended, and close it."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()

    async def settle() -> None:
        await asyncio.gather(*pending, return_exceptions=True)
        await loop.shutdown_asyncgens()

    loop.run_until_complete(settle())
    loop.close()
