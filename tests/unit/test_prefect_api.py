"""The triggers' Prefect client against a local server that answers 503 a given number of times."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from deployments import prefect_api
from deployments.prefect_api import PrefectApi, PrefectUnavailable

DEPLOYMENT_ID = "0b7d3c1e-0000-4000-8000-000000000001"
RUN_ID = "0b7d3c1e-0000-4000-8000-000000000002"


class BusyPrefect(http.server.ThreadingHTTPServer):
    """Answers 503 to the first `busy` run creations, then creates the run; counts them all."""

    def __init__(self, busy: int) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.busy = busy
        self.creations = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api"


class Handler(http.server.BaseHTTPRequestHandler):
    server: BusyPrefect

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200, {"id": DEPLOYMENT_ID})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.creations += 1
        if self.server.creations <= self.server.busy:
            self._answer(503, {"exception_message": "Service Unavailable"})
        else:
            self._answer(201, {"id": RUN_ID})


@pytest.fixture
def no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefect_api, "BUSY_RETRY_PAUSES", (0.0, 0.0, 0.0))


@contextlib.contextmanager
def serving(busy: int) -> Iterator[BusyPrefect]:
    server = BusyPrefect(busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def create(server: BusyPrefect) -> str:
    api = PrefectApi(server.url)
    try:
        return api.create_run(
            "insight-backfill/backfill", {}, name="n", tags=[], idempotency_key="k"
        )
    finally:
        api.close()


@pytest.mark.usefixtures("no_pauses")
def test_a_burst_of_503s_from_a_busy_prefect_is_retried_until_the_run_is_made() -> None:
    with serving(busy=len(prefect_api.BUSY_RETRY_PAUSES)) as server:
        assert create(server) == RUN_ID
        assert server.creations == len(prefect_api.BUSY_RETRY_PAUSES) + 1


@pytest.mark.usefixtures("no_pauses")
def test_a_prefect_that_stays_busy_is_reported_with_its_status() -> None:
    with serving(busy=100) as server:
        with pytest.raises(PrefectUnavailable, match=r"refused the run .*HTTP 503"):
            create(server)
        assert server.creations == len(prefect_api.BUSY_RETRY_PAUSES) + 1
