"""`insight-queue api` as a real process: its credentials, its logs, and clients that misbehave.

Each test starts the command (stopped by its PID at the end) on a SQLite store of its own, with
`PREFECT_API_URL` on a closed loopback port, and talks to it over loopback only:

- the credentials it makes and keeps, those it refuses, and `insight-queue token`'s;
- a Prefect URL's password in no answer and no log line, with two worker processes;
- a 20 MB header is 431; a request whose headers stop coming is closed at the deadline (the
  test waits for the close, and checks the connection was open for seconds before it);
- 300 idle connections do not keep a poll from its answer, and past the cap on connections
  the idle one waiting longest is the one closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import secrets
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments import processes
from deployments.http.credentials import CREDENTIALS_FILE, Credentials, InvalidToken
from deployments.http.serving import HEADER_SECONDS, MAX_CONNECTIONS
from deployments.processes import free_port
from tests.support.api import assert_challenged, assert_refused, bearer, insight_path
from tests.support.secrets import exposures
from tests.support.services import cli, run_cli, running
from tests.support.settings import settings_from
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

DAY = dt.datetime.now(dt.UTC).date().isoformat()
START_SECONDS = 120.0  # for the API to answer its first /healthz on a loaded machine
# What "closed at the deadline" allows: the wait for the close, and the least time the
# connection must have stayed open before it.
CLOSE_WAIT_SECONDS = HEADER_SECONDS * 6
OPEN_AT_LEAST_SECONDS = HEADER_SECONDS / 2
POLLS_FOR_BOTH_WORKERS = 3000


@dataclasses.dataclass
class RunningApi:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def credentials(self) -> dict[str, str]:
        kept: dict[str, str] = json.loads((self.data_dir / CREDENTIALS_FILE).read_text())
        return kept

    def client(self, token: str | None = None) -> httpx.Client:
        headers = bearer(token) if token is not None else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def api_env(tmp_path: Path, **more: str) -> dict[str, str]:
    data = tmp_path / "data"
    return {
        "AI_JOB_DATA_DIR": str(data),
        "AI_JOB_DATABASE_URL": f"sqlite:///{data / 'queue.db'}",
        "AI_JOB_PLUGINS": "flows.demo",
        "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",
        **more,
    }


@contextlib.contextmanager
def api_process(
    tmp_path: Path, env: dict[str, str], *options: str, name: str = "api", verbose: bool = False
) -> Iterator[RunningApi]:
    """`insight-queue api` on a free loopback port until the block ends, stopped by its PID."""
    port = free_port()
    log = tmp_path / f"{name}.log"
    args = cli(*(["-v"] if verbose else []), "api", "--port", str(port), *options)
    with running(args, env, log) as process:

        def answers() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the API exited {process.returncode}:\n{log.read_text()}")
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200

        wait_for(answers, START_SECONDS, "the API's /healthz", log=log, tolerate=(httpx.HTTPError,))
        yield RunningApi(process, port, log, Path(env["AI_JOB_DATA_DIR"]))


def first_line(log: Path) -> str:
    return log.read_text().splitlines()[0]


# -- credentials ------------------------------------------------------------------------------


def test_without_tokens_set_the_api_makes_them_once_keeps_them_and_asks_for_them(
    tmp_path: Path,
) -> None:
    env = api_env(tmp_path)
    kept = tmp_path / "data" / CREDENTIALS_FILE
    with api_process(tmp_path, env) as api:
        assert first_line(api.log).endswith(f"are made now and kept in {kept} (this account only)")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
        made = api.credentials()
        assert set(made) == {"operator_token", "service_token", "screen_secret"}
        with api.client() as anonymous:
            assert_challenged(anonymous.get(insight_path("alice", "sleep", DAY)))
            assert_challenged(anonymous.get("/v1/queue"))
        with api.client(made["service_token"]) as service:
            assert service.get(insight_path("alice", "sleep", DAY)).status_code == 200
        with api.client(made["operator_token"]) as operator:
            view = operator.get("/v1/queue")
            assert view.status_code == 200 and view.json()["waiting_total"] == 1

    # Started again: nothing made, the same credentials.
    with api_process(tmp_path, env, name="again") as again:
        line = first_line(again.log)
        assert "made now" not in line and line.endswith(f"are kept in {kept} (this account only)")
        assert again.credentials() == made
        with again.client(made["service_token"]) as service:
            polled = service.get(insight_path("alice", "sleep", DAY))
            assert polled.status_code == 200 and polled.json()["status"] == "pending"


def test_the_api_refuses_to_start_with_a_blank_or_short_token_or_an_unreadable_key(
    tmp_path: Path,
) -> None:
    port = free_port()
    missing = tmp_path / "no-such-key.pem"
    for more, error in [
        (
            {"AI_API_TOKEN": " \t "},
            "error: AI_API_OPERATOR_TOKEN: is blank: set a real token, or unset it\n",
        ),
        (
            {"AI_API_SERVICE_TOKEN": "short-token"},
            "error: AI_API_SERVICE_TOKEN: is shorter than 16 characters: too easy to guess\n",
        ),
        (
            {"AI_API_SCREEN_PUBLIC_KEY": str(missing)},
            f"error: AI_API_SCREEN_PUBLIC_KEY: cannot read {missing} (No such file or directory)\n",
        ),
    ]:
        refused = run_cli("api", "--port", str(port), env=api_env(tmp_path, **more), check=False)
        assert refused.returncode == 2, (more, refused.stderr)
        assert refused.stderr == error
        assert "short-token" not in refused.stdout + refused.stderr
        assert processes.port_is_free(port)
    # --require-token is gone: every route needs a credential on every address.
    gone = run_cli(
        "api", "--require-token", "--port", str(port), env=api_env(tmp_path), check=False
    )
    assert gone.returncode == 2 and "No such option '--require-token'" in gone.stderr
    assert processes.port_is_free(port)


def test_the_token_command_prints_a_token_the_api_takes_for_that_user_only(
    tmp_path: Path,
) -> None:
    env = api_env(tmp_path)
    printed = run_cli("token", "alice", "--ttl", "1h", env=env)
    token = printed.stdout.strip().splitlines()[-1]
    assert printed.stderr.startswith("a screen token for alice, valid 3600 s")
    kept = tmp_path / "data" / CREDENTIALS_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600, "the secret it signed with is kept"

    with api_process(tmp_path, env) as api:
        assert "made now" not in first_line(api.log), "the API signs with the same secret"
        with api.client(token) as alice:
            own = alice.get(insight_path("alice", "sleep", DAY))
            assert own.status_code == 200, own.text
            assert own.json()["status"] == "pending"
            assert_refused(alice.get(insight_path("bob", "sleep", DAY)), 403, "user_id")
            assert_refused(alice.post("/v1/users/alice/backfills", json={}), 403, None)
            assert_refused(alice.get("/v1/queue"), 403, None)
        tail = "AAAA" if not token.endswith("AAAA") else "BBBB"
        with api.client(token[:-4] + tail) as forged:
            assert_challenged(forged.get(insight_path("alice", "sleep", DAY)))
        with api.client(api.credentials()["operator_token"]) as operator:
            waiting = operator.get("/v1/queue").json()["waiting"]
        assert [(j["user_id"], j["priority_class"]) for j in waiting] == [("alice", "interactive")]

    # With the app's secret set, the token is signed with it, and checks only with it.
    secret = secrets.token_urlsafe(32)
    with_secret = {**env, "AI_API_SCREEN_SECRET": secret}
    signed = run_cli("token", "carol", "--ttl", "15m", env=with_secret).stdout.splitlines()[-1]
    assert secret not in signed
    assert Credentials.load(settings_from(with_secret)).screens.user_of(signed) == "carol"
    with pytest.raises(InvalidToken):
        Credentials.load(settings_from(env)).screens.user_of(signed)
    for ttl in ("0", "31d", "soon"):
        refused = run_cli("token", "carol", "--ttl", ttl, env=env, check=False)
        assert refused.returncode == 2 and refused.stdout == "", ttl


# -- secrets in answers and logs -----------------------------------------------------------------


def test_no_password_of_prefect_api_url_in_any_answer_or_log_line_with_two_workers(
    tmp_path: Path,
) -> None:
    password = f"pw-{secrets.token_hex(12)}"
    closed = free_port()
    prefect = f"http://svc:{password}@127.0.0.1:{closed}/api"
    env = api_env(tmp_path, PREFECT_API_URL=prefect)
    outage = "queued work waits for a consumer"  # each worker logs it once, at its first poll
    seen: list[str] = []

    def shown(response: httpx.Response) -> httpx.Response:
        seen.append(f"{response.status_code} {dict(response.headers)} {response.text}")
        return response

    with api_process(tmp_path, env, "--workers", "2", verbose=True) as api:
        made = api.credentials()
        # A new connection per poll, until both workers have answered one: which worker takes
        # a connection is the kernel's choice, so as many polls as it takes, up to a count.
        for n in range(POLLS_FOR_BOTH_WORKERS):
            with api.client(made["service_token"]) as service:
                polled = shown(service.get(insight_path(f"user-{n % 50}", "sleep", DAY)))
            assert polled.status_code == 200, polled.text
            assert polled.json()["run_note"].startswith("Prefect unreachable at http://")
            assert f"127.0.0.1:{closed}/api" in polled.json()["run_note"], "the server is named"
            if api.log.read_text().count(outage) == 2:
                break
        assert api.log.read_text().count(outage) == 2, "both workers answered and logged"
        with api.client(made["service_token"]) as service:
            backfill = shown(service.post("/v1/users/user-0/backfills", json={"sync_id": "s"}))
            assert backfill.status_code == 202 and backfill.json()["run_note"]
        with api.client(made["operator_token"]) as operator:
            for path in ("/v1/queue", "/queue", "/metrics", "/healthz"):
                assert shown(operator.get(path)).status_code == 200, path
    log = api.log.read_text()
    assert "Prefect unreachable at http://" in log and "Uvicorn running on" in log
    assert exposures(log, password) == [], log
    for answer in seen:
        assert exposures(answer, password) == [], (exposures(answer, password), answer[:300])


# -- clients that misbehave ---------------------------------------------------------------------


def request_head(port: int, path: str = "/healthz") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def until_closed(sock: socket.socket, timeout: float) -> bytes | None:
    """Everything the server sends until it closes the connection; None if it did not close
    it within `timeout`."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


def test_a_20_mb_header_is_431_and_the_server_answers_on(tmp_path: Path) -> None:
    with api_process(tmp_path, api_env(tmp_path)) as api:
        sock = socket.create_connection(("127.0.0.1", api.port))
        sent: list[BaseException] = []

        def send() -> None:
            try:
                sock.sendall(request_head(api.port) + b"X-Huge: ")
                chunk = b"h" * (1 << 20)
                for _ in range(20):
                    sock.sendall(chunk)
                sock.sendall(b"\r\n\r\n")
            except OSError as exc:  # the server closed it: what we wait for
                sent.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            answer = until_closed(sock, CLOSE_WAIT_SECONDS)
        finally:
            sender.join(CLOSE_WAIT_SECONDS)
            sock.close()
        assert answer is not None, "the connection was left open"
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"connection: close" in answer.lower()
        with api.client(api.credentials()["service_token"]) as service:
            polled = service.get(insight_path("alice", "sleep", DAY))
            assert polled.status_code == 200 and polled.json()["status"] == "pending"


def test_a_request_whose_headers_stop_coming_is_closed_at_the_deadline_not_before(
    tmp_path: Path,
) -> None:
    with api_process(tmp_path, api_env(tmp_path)) as api:
        port = api.port
        half = request_head(port) + b"X-Slow: still com"
        first = socket.create_connection(("127.0.0.1", port))  # a new connection
        kept = socket.create_connection(("127.0.0.1", port))  # the next request of one
        kept.sendall(request_head(port) + b"\r\n")
        assert read_answer(kept).startswith(b"HTTP/1.1 200 ")
        silent = socket.create_connection(("127.0.0.1", port))  # sends nothing at all
        first.sendall(half)
        kept.sendall(half)
        quiet_since = time.monotonic()
        closed: dict[str, tuple[bytes | None, float]] = {}

        def wait(name: str, sock: socket.socket) -> None:
            answer = until_closed(sock, CLOSE_WAIT_SECONDS)
            closed[name] = (answer, time.monotonic() - quiet_since)

        waiting = [
            threading.Thread(target=wait, args=(name, sock), daemon=True)
            for name, sock in (("first", first), ("kept", kept), ("silent", silent))
        ]
        for thread in waiting:
            thread.start()
        # Meanwhile, and as long as it takes, a screen's poll is answered.
        with api.client(api.credentials()["service_token"]) as service:
            assert service.get(insight_path("alice", "sleep", DAY)).status_code == 200
        # A client that trickles its headers a byte a second gains nothing by it.
        trickle = socket.create_connection(("127.0.0.1", port))
        trickled = 0
        try:
            for byte in (half + b"x" * int(CLOSE_WAIT_SECONDS)).decode():
                trickle.sendall(byte.encode())
                trickled += 1
                trickle.settimeout(1.0)
                try:
                    if trickle.recv(1) == b"":
                        break
                except TimeoutError:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            trickle.close()
        for thread in waiting:
            thread.join(CLOSE_WAIT_SECONDS + 5)
        for sock in (first, kept, silent):
            sock.close()

    assert trickled < len(half) + int(CLOSE_WAIT_SECONDS), "the trickle was never cut off"
    assert set(closed) == {"first", "kept", "silent"}
    for name, (answer, after) in closed.items():
        assert answer is not None, f"{name}: still open after {CLOSE_WAIT_SECONDS:g} s"
        assert answer == b"", f"{name}: closed without an answer, got {answer[:100]!r}"
        assert after >= OPEN_AT_LEAST_SECONDS, f"{name}: closed after only {after:.1f} s"


def test_300_idle_connections_do_not_keep_a_poll_from_its_answer(tmp_path: Path) -> None:
    with api_process(tmp_path, api_env(tmp_path)) as api:
        idle = [socket.create_connection(("127.0.0.1", api.port)) for _ in range(300)]
        try:
            for sock in idle[::2]:  # half of them start a request and stop
                sock.sendall(request_head(api.port) + b"X-Slow: ")
            with api.client(api.credentials()["service_token"]) as service:
                polled = service.get(insight_path("alice", "sleep", DAY))
                assert polled.status_code == 200, polled.text
                assert polled.json()["status"] == "pending"
                assert service.get("/healthz").status_code == 200
            # They were all still open while it was answered.
            for sock in idle:
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
        finally:
            for sock in idle:
                sock.close()


def test_past_the_cap_on_connections_the_longest_idle_is_closed(tmp_path: Path) -> None:
    with api_process(tmp_path, api_env(tmp_path)) as api:
        idle: list[socket.socket] = []
        try:
            for _ in range(MAX_CONNECTIONS):
                idle.append(socket.create_connection(("127.0.0.1", api.port)))
            # The first is answered within the cap, and is idle only since its answer.
            idle[0].sendall(request_head(api.port) + b"\r\n")
            assert read_answer(idle[0]).startswith(b"HTTP/1.1 200 ")
            # One past the cap: the connection idle longest, the second, is closed; not the
            # first, nor the ones that came after the second.
            idle.append(socket.create_connection(("127.0.0.1", api.port)))
            assert until_closed(idle[1], CLOSE_WAIT_SECONDS) == b""
            for sock in (idle[0], *idle[2:]):
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
            with api.client(api.credentials()["service_token"]) as service:
                polled = service.get(insight_path("alice", "sleep", DAY))
                assert polled.status_code == 200, polled.text
        finally:
            for sock in idle:
                sock.close()
