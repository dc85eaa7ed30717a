"""The gateway token and the database password never show anywhere they could be read.

Both secrets are random per session, so finding one is never a coincidence.
A consumer runs as `insight-queue -v drain` processes with every log level
turned up, against the gateway simulator requiring the token and against an
"echo" gateway that quotes the Authorization header back in its 401/500/503
bodies and headers; the store is on PostgreSQL through a role whose password
is in `AI_JOB_DATABASE_URL`. Afterwards the secrets are searched for in:

- the consumers' stdout and stderr;
- what Prefect kept: every flow run (one per generation attempt, and the
  drains: names, parameters, tags, state messages), task run and log, read
  with the Prefect client, and the raw bytes of the Prefect server's
  database and log;
- every table of the store (errors, pause reason, results);
- the command line: `settings`, `settings --json`, `db upgrade`, `db status`,
  and the store's errors for unreachable or refused databases.

Each search has a positive control: a marker written the same way (a job's
subject) must be found where the secret is not, so a search that reads
nothing cannot pass.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
import traceback
import urllib.parse
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from sqlalchemy import create_engine, text

from devtools.simulator import GatewaySimulator
from flows.gateway import EXCERPT_CHARS, JOB_HEADER
from queue_store import INTERACTIVE, StoreError, migrate
from queue_store.engine import normalise_url
from queue_store.redact import REDACTED
from tests.support.databases import POSTGRES_URL
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import dump_tables
from tests.support.reads import job_of, pending
from tests.support.services import ROOT, PrefectServer, client_env, run_cli
from tests.support.settings import settings_from

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.postgres]

TOKEN = f"tok-{secrets.token_hex(16)}"
DB_PASSWORD = f"pw-{secrets.token_hex(12)}"
# A password with URL-special characters, percent-encoded in the URL.
ODD_PASSWORD = f"p@ss:w/d%{secrets.token_hex(6)}?#"


def needles(secret: str) -> list[str]:
    """The secret and pieces of it a cut-off excerpt could leave behind."""
    found = [secret, secret[:12], secret[-12:], urllib.parse.quote(secret, safe="")]
    return sorted(set(found))


def assert_absent(haystack: str | bytes, where: str, *secret_values: str) -> None:
    raw = haystack if isinstance(haystack, bytes) else haystack.encode("utf-8", "surrogatepass")
    for secret in secret_values:
        for needle in needles(secret):
            assert needle.encode() not in raw, f"{where} contains {needle!r} (from a secret)"


# -- PostgreSQL: a role with a password --------------------------------------------------


def _admin_url() -> str:
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests: set AI_JOB_TEST_POSTGRES_URL")
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    return POSTGRES_URL


def _role_url(admin: str, role: str, password: str, schema: str) -> str:
    parsed = normalise_url(admin)
    url = parsed.set(drivername="postgresql", username=role, password=password)
    rendered = url.render_as_string(hide_password=False)
    separator = "&" if "?" in rendered else "?"
    return f"{rendered}{separator}options=-csearch_path%3D{schema}"


@pytest.fixture
def role_url() -> Iterator[str]:
    """A login role with DB_PASSWORD owning a fresh schema; both dropped afterwards.

    With `trust` in pg_hba the password is not checked, which does not matter
    here: the test is whether it leaks, not whether it works.
    """
    admin = create_engine(normalise_url(_admin_url()))
    suffix = uuid.uuid4().hex[:10]
    role, schema = f"iq_secret_{suffix}", f"s_secret_{suffix}"
    with admin.begin() as connection:
        connection.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD '{DB_PASSWORD}'"))
        connection.execute(text(f"CREATE SCHEMA {schema} AUTHORIZATION {role}"))
    try:
        yield _role_url(_admin_url(), role, DB_PASSWORD, schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            connection.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"),
                {"r": role},
            )
            connection.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


# -- an echo gateway: quotes the Authorization header back in its errors ------------------


class EchoGateway:
    """Answers by job label: `echo-401`, `echo-500` (token at the excerpt's cut),
    `echo-503` (once, then fine); anything else gets a completion."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        self.answered: list[tuple[str, int]] = []
        self._unavailable_once: set[str] = set()
        self._lock = threading.Lock()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                auth = self.headers.get("Authorization", "")
                job = urllib.parse.unquote(self.headers.get(JOB_HEADER, ""))
                status, payload = gateway.answer(job, auth, body)
                data = payload.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                # A careless gateway echoes the header back too.
                self.send_header("X-Echo-Authorization", auth)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def answer(self, job: str, auth: str, body: bytes) -> tuple[int, str]:
        with self._lock:
            self.authorizations.append(auth)
            first_503 = "echo-503" in job and job not in self._unavailable_once
            if first_503:
                self._unavailable_once.add(job)
        if "echo-401" in job:
            status = 401
            payload = json.dumps({"error": {"message": f"invalid credentials: {auth}"}})
        elif "echo-500" in job:
            status = 500
            # The token straddles the excerpt's cut: redacted before cutting, or it leaks.
            payload = "E" * (EXCERPT_CHARS - 20) + f" {auth} for {job}"
        elif first_503:
            status = 503
            payload = f"upstream restarting; retry with the same header: {auth}"
        else:
            status = 200
            payload = json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": f"fine: {job}"}}]}
            )
        with self._lock:
            self.answered.append((job, status))
        return status, payload

    def __enter__(self) -> EchoGateway:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


# -- reading back what Prefect kept ---------------------------------------------------------


def prefect_records(api_url: str) -> dict[str, str]:
    """Every flow run, task run and log the server kept, as JSON text."""
    from prefect import get_client

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(limit=200)
        task_runs = client.read_task_runs(limit=200)
        logs: list[Any] = []
        while True:  # the API pages its answers
            page = client.read_logs(limit=200, offset=len(logs))
            logs += page
            if len(page) < 200:
                break
    return {
        "flow runs": "\n".join(r.model_dump_json() for r in flow_runs),
        "flow-run names": "\n".join(r.name for r in flow_runs),
        "flow-run parameters": json.dumps([r.parameters for r in flow_runs], default=str),
        "flow-run states": "\n".join(
            f"{r.state.name}: {r.state.message}" for r in flow_runs if r.state
        ),
        "task runs": "\n".join(r.model_dump_json() for r in task_runs),
        "logs": "\n".join(log.message for log in logs),
    }


def prefect_files(server: PrefectServer) -> dict[str, bytes]:
    """The Prefect server's database (with its WAL) and log, as raw bytes."""
    found = {}
    for path in sorted(server.home.iterdir()):
        if path.is_file() and (path.name.startswith("prefect.db") or path.suffix == ".log"):
            found[str(path)] = path.read_bytes()
    assert any(name.endswith("prefect.db") for name in found), found.keys()
    return found


def store_dump(url: str) -> str:
    engine = create_engine(normalise_url(url))
    try:
        return repr(dump_tables(engine))
    finally:
        engine.dispose()


def consumer_env(
    api_url: str, home: Path, database_url: str, gateway_url: str, token: str
) -> dict[str, str]:
    return {
        **client_env(api_url, home),
        "AI_JOB_DATABASE_URL": database_url,
        "AI_GATEWAY_URL": gateway_url,
        "AI_GATEWAY_TOKEN": token,
        "AI_JOB_PLUGINS": "flows.demo,tests.support.plugins",
        "PYTHONPATH": str(ROOT),
        "AI_JOB_GAP_SECONDS": "0",
        "AI_JOB_HEARTBEAT_SECONDS": "0.5",
        "AI_JOB_LEASE_SECONDS": "10",
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_BACKOFF_SECONDS": "1",
        "AI_JOB_BACKOFF_MAX_SECONDS": "2",
        # Everything turned up: a leak at any level shows.
        "PREFECT_LOGGING_LEVEL": "DEBUG",
        "PREFECT_LOGGING_ROOT_LEVEL": "DEBUG",
        "PREFECT_LOGGING_LOG_PRINTS": "true",
    }


# -- the consumer run ---------------------------------------------------------------------


def test_a_consumer_run_leaks_neither_the_token_nor_the_database_password(
    tmp_path: Path, prefect_server: PrefectServer, role_url: str
) -> None:
    assert DB_PASSWORD in role_url
    migrate.upgrade(role_url)
    marker = f"probe-{uuid.uuid4().hex[:12]}"
    user = f"secret-user-{marker}"
    settings = settings_for(database_url=role_url)
    outputs: dict[str, str] = {}

    with store_for(settings) as store:
        # 1. The simulator, requiring the token: good answers and a failing generator.
        with GatewaySimulator(latency=0.1, token=TOKEN) as sim:
            env = consumer_env(prefect_server.api_url, tmp_path / "c1", role_url, sim.url, TOKEN)
            store.enqueue(user, "ok", f"{marker}-a")
            store.enqueue(user, "broken", f"{marker}-b")
            store.enqueue(user, "ok", f"{marker}-c", priority=INTERACTIVE)
            done = run_cli("-v", "drain", env=env, timeout=240)
            outputs["drain 1 stdout"], outputs["drain 1 stderr"] = done.stdout, done.stderr
            served = sim.stats().requests
        assert {r.status for r in served} == {200}, served  # the token was sent, and right
        assert len(served) == 2  # ok a and ok c; the broken generator never calls

        # 2. A gateway quoting the token back in its 500/503/401 answers. The
        # 401 comes last: it stops all claiming until an operator resumes.
        with EchoGateway() as echo:
            env = consumer_env(prefect_server.api_url, tmp_path / "c2", role_url, echo.url, TOKEN)
            for subject in ("fine", "echo-500", "echo-503"):
                store.enqueue(user, "ok", f"{marker}-{subject}")
            for round_ in range(2, 6):  # a drain may end at the 503's pause; the next goes on
                done = run_cli("-v", "drain", env=env, timeout=240)
                outputs[f"drain {round_} stdout"] = done.stdout
                outputs[f"drain {round_} stderr"] = done.stderr
                if pending(store, user) == 0:
                    break
                time.sleep(2.5)  # past AI_JOB_BACKOFF_MAX_SECONDS
            # A refusal stops the line: the drain ends, the job keeps its attempts.
            store.enqueue(user, "ok", f"{marker}-echo-401")
            done = run_cli("-v", "drain", env=env, timeout=240)
            outputs["drain 401 stdout"], outputs["drain 401 stderr"] = done.stdout, done.stderr
            assert "refused" in done.stdout, done.stdout
        assert set(echo.authorizations) == {f"Bearer {TOKEN}"}
        statuses = [status for _, status in echo.answered]
        assert statuses.count(401) == 1, outputs["drain 401 stderr"][-6000:]
        assert statuses.count(500) == 3 and 503 in statuses

        subjects = ["a", "b", "c", "fine", "echo-500", "echo-503", "echo-401"]
        keys = [(user, "broken" if s == "b" else "ok", f"{marker}-{s}") for s in subjects]
        final = {key[2].removeprefix(f"{marker}-"): job_of(store, *key) for key in keys}
        assert {s: (j.status, j.attempts) for s, j in final.items() if j} == {
            "a": ("done", 1),
            "b": ("failed", 3),
            "c": ("done", 1),
            "fine": ("done", 1),
            "echo-500": ("failed", 3),
            "echo-503": ("done", 1),
            "echo-401": ("pending", 0),
        }
        # The quoted tokens reached the store's error column and the pause
        # reason, redacted.
        error = final["echo-500"].error  # type: ignore[union-attr]
        assert error is not None and REDACTED in error, error
        gate = store.gate_state()
        assert gate.pause_reason is not None and "401" in gate.pause_reason
        assert REDACTED in gate.pause_reason, gate.pause_reason
        outputs["pause reason"] = gate.pause_reason

    outputs.update(prefect_records(prefect_server.api_url))
    outputs["store"] = store_dump(role_url)
    # Positive controls: every source holds the marker the jobs carried.
    outputs["consumer output"] = "".join(outputs[k] for k in list(outputs) if " std" in k)
    # (The runs' logs name neither the user nor a subject: nothing to find there, D4.)
    for where in ("consumer output", "flow-run names", "flow runs", "store"):
        assert marker in outputs[where], f"{where} should mention {marker}"
    # The generations' runs end saying what the gateway answered, but not its words (D4):
    # those are in the store's error, redacted (above).
    assert "HTTP 500" in outputs["flow-run states"], outputs["flow-run states"]
    assert "its words are in the store's error" in outputs["flow-run states"]
    for where, found in outputs.items():
        assert_absent(found, where, TOKEN, DB_PASSWORD)

    files = prefect_files(prefect_server)
    assert any(marker.encode() in data for data in files.values())
    for where, data in files.items():
        assert_absent(data, where, TOKEN, DB_PASSWORD)


# -- the command line and the store's errors ----------------------------------------------


def test_cli_settings_and_db_commands_mask_both_secrets(tmp_path: Path, role_url: str) -> None:
    env = {
        "AI_JOB_DATABASE_URL": role_url,
        "AI_GATEWAY_TOKEN": TOKEN,
        "AI_JOB_DATA_DIR": str(tmp_path / "data"),
    }
    table = run_cli("settings", env=env)
    shown = run_cli("settings", "--json", env=env)
    outdated = run_cli("db", "status", env=env, check=False)  # nothing created yet
    upgraded = run_cli("db", "upgrade", env=env)
    current = run_cli("db", "status", env=env)
    # The same through --database-url instead of the environment.
    flagged = run_cli("--database-url", role_url, "db", "status", env={"AI_JOB_DATABASE_URL": ""})

    settings = json.loads(shown.stdout)["settings"]
    assert settings["AI_GATEWAY_TOKEN"] == "(set)"
    assert ":***@" in settings["AI_JOB_DATABASE_URL"]
    assert "(set)" in table.stdout and ":***@" in table.stdout
    assert outdated.returncode == 1 and "db upgrade" in outdated.stderr
    assert "schema revision" in upgraded.stdout and "current" in current.stdout
    for name, done in (
        ("settings", table),
        ("settings --json", shown),
        ("db status (outdated)", outdated),
        ("db upgrade", upgraded),
        ("db status", current),
        ("--database-url db status", flagged),
    ):
        assert_absent(done.stdout + done.stderr, name, TOKEN, DB_PASSWORD)


@pytest.mark.parametrize(
    "case",
    ["refused-port", "unknown-database", "unknown-role", "odd-password", "bad-option"],
)
def test_database_errors_never_quote_the_password(case: str, tmp_path: Path) -> None:
    admin = normalise_url(_admin_url())
    host, port = admin.host or "127.0.0.1", admin.port or 5432
    password = ODD_PASSWORD if case == "odd-password" else DB_PASSWORD
    quoted = urllib.parse.quote(password, safe="")
    url = {
        "refused-port": f"postgresql://iq_nobody:{quoted}@127.0.0.1:1/x",
        "unknown-database": f"postgresql://postgres:{quoted}@{host}:{port}/iq_no_such_db",
        "unknown-role": f"postgresql://iq_no_such_role:{quoted}@{host}:{port}/test",
        "odd-password": f"postgresql://iq_no_such_role:{quoted}@{host}:{port}/test",
        "bad-option": f"postgresql://postgres:{quoted}@{host}:{port}/test?sslmode=bogus",
    }[case]

    with pytest.raises(StoreError) as raised:
        store_for(settings_for(url))
    # The whole chain, as a log line with exc_info would print it.
    chain = "".join(traceback.format_exception(raised.value))
    assert "OperationalError" in chain or "ProgrammingError" in chain, chain
    assert_absent(chain, "the error and its cause", password)
    assert_absent(repr(raised.value), "the error's repr", password)

    env = {"AI_JOB_DATABASE_URL": url, "AI_JOB_PLUGINS": "flows.demo"}
    done = run_cli("enqueue", "u", "sleep", "s", env=env, check=False)
    assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    assert_absent(done.stdout + done.stderr, "insight-queue enqueue", password)


# -- regression tests for defects these tests found -----------------------------------


def test_a_password_given_as_a_query_parameter_is_masked_too(tmp_path: Path, role_url: str) -> None:
    url = role_url.replace(f":{DB_PASSWORD}@", "@") + f"&password={DB_PASSWORD}"
    env = {"AI_JOB_DATABASE_URL": url, "AI_JOB_DATA_DIR": str(tmp_path / "data")}
    outputs = [
        run_cli("settings", "--json", env=env),
        run_cli("db", "status", env=env, check=False),  # SchemaOutdated names the URL
        run_cli("db", "upgrade", env=env, check=False),
    ]
    for done in outputs:
        assert_absent(done.stdout + done.stderr, " ".join(done.args[1:]), DB_PASSWORD)


def test_the_settings_object_repr_hides_the_database_password() -> None:
    settings = settings_from(
        {
            "AI_JOB_DATABASE_URL": f"postgresql://u:{DB_PASSWORD}@127.0.0.1:1/x",
            "AI_GATEWAY_TOKEN": TOKEN,
        }
    )
    assert_absent(repr(settings) + str(settings), "repr(Settings)", DB_PASSWORD, TOKEN)
