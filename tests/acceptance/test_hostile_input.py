"""Hostile input through the whole front door: the Python API and the command line.

User ids, kinds, subjects and fingerprints full of quotes, SQL, Unicode,
control characters, NUL bytes and 10 kB strings, and fingerprints of every
Python type. Each one must either be refused clearly (the store's
`InvalidArgument` naming the argument; on the command line exit code 2 and one
`error: <argument>: ...` line on stderr, no traceback) or be stored and read
back exactly. Whatever happens, the database stays intact: the same tables,
the expected row counts, nothing executed (a `'; DROP TABLE ai_jobs; --` user
id is a user id).

The API part runs on both backends (the `store` fixture) and goes through
`deployments.triggers.request_insight` with the Prefect server unreachable (a
closed 127.0.0.1 port): a screen's poll must still queue and report on the
store alone. The command-line part runs `insight-queue` as a subprocess on
SQLite, with what the OS lets argv carry (no NUL; invalid UTF-8 bytes, yes).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, inspect

from deployments.processes import free_port
from deployments.triggers import Triggers
from flows.registry import Registry
from flows.runtime import Runtime
from queue_store import (
    INTERACTIVE,
    EnqueueRequest,
    Failure,
    InvalidArgument,
    JobStore,
    Status,
    migrate,
)
from queue_store.engine import normalise_url
from queue_store.redact import Redactor
from queue_store.schema import VERSION_TABLE
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import dump_tables
from tests.support.reads import job_of, listed_jobs, pending, result_of, state_of
from tests.support.services import BIN, ROOT

STORE_TABLES = {"ai_jobs", "ai_job_results", "ai_job_gate", VERSION_TABLE}

# -- hostile values ------------------------------------------------------------------

# Valid everywhere (no "|", no NUL, no lone surrogate, short): stored exactly.
HOSTILE: dict[str, str] = {
    "single-quote": "o'brien",
    "double-quote": 'say "hi"',
    "drop-table": "'; DROP TABLE ai_jobs; --",
    "or-true": "x' OR '1'='1",
    "union": "' UNION SELECT id, user_id, kind FROM ai_jobs --",
    "stacked": "1; DELETE FROM ai_job_results; UPDATE ai_job_gate SET id = 2",
    "pg-dollar": "$$; DROP TABLE ai_job_gate; $$",
    "comment": "/* unclosed",
    "backslash": "C:\\new\\table\\'",
    "placeholders": "%s %(user_id)s {0} $1 ? :name %%",
    "like-wildcards": "%_%\\%",
    "emoji-zwj": "🙂👩‍👩‍👧‍👦🏳️‍🌈",
    "rtl-override": "\u202eevil\u202c.txt",
    "zero-width-bom": "a\u200bb\ufeffc\u2060",
    "combining": "e\u0301\u0308\u20dd",
    "cjk": "睡眠の質",
    "astral": "\U0001f600\U00010348\U000e0041",
    "line-breaks": "a\nb\r\nc\u2028d\u2029e\x85",
    "controls": "\x01\x07\x1b[31mred\x1b[0m\x7f\x9b",
    "padded": " padded\t",
    "html": "<script>alert(1)</script>",
    "json": '{"status": "done", "user_id": "other"}',
}

# The longest keys the store accepts, in 4-byte characters and quotes.
MAX_KEY = ("🙂" * 200, "'" * 100, "é|" * 250)
MAX_FINGERPRINT = "🙂" * 200

TEN_KB = "x" * 10_000
LONE_SURROGATE = "a\udcffb"

# Invalid values of a key part: (value, why) -> refused, naming the argument.
BAD_KEY_TEXT: dict[str, Any] = {
    "empty": "",
    "blank": "  \t ",
    "nul": "a\x00b",
    "nul-only": "\x00",
    "10kB": TEN_KB,
    "lone-surrogate": LONE_SURROGATE,
    "int": 1,
    "float": 1.5,
    "bytes": b"user",
    "list": ["user"],
    "dict": {"user": 1},
    "none": None,
    "bool": True,
}
# "|" joins the parts of the hashed id: refused in user_id and kind only.
BAD_JOINER = "alice|admin"

# Fingerprints of every type: None and "" mean "no fingerprint"; the rest must
# be a string of at most 200 characters without NUL or lone surrogates.
VALID_FINGERPRINTS: dict[str, str | None] = {
    "none": None,
    "empty": "",
    "hostile": "'; DROP TABLE ai_job_results; --",
    "unicode": "🙂\u202e\u0301",
    "max-length": MAX_FINGERPRINT,
}
BAD_FINGERPRINTS: dict[str, Any] = {
    "int": 12345,
    "zero": 0,
    "float": 1.5,
    "nan": float("nan"),
    "bytes": b"fp",
    "bytearray": bytearray(b"fp"),
    "list": ["fp"],
    "dict": {"fp": 1},
    "tuple": ("fp",),
    "true": True,
    "false": False,
    "201-chars": "f" * 201,
    "10kB": TEN_KB,
    "nul": "fp\x00",
    "lone-surrogate": LONE_SURROGATE,
    "object": object(),
}


def _sync_engine(url: str) -> Engine:
    return create_engine(normalise_url(url))


def _snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = _sync_engine(url)
    try:
        return dump_tables(engine)
    finally:
        engine.dispose()


def _assert_intact(url: str, jobs: int, results: int) -> None:
    """Every table of the store still there, with the row counts expected."""
    engine = _sync_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) >= STORE_TABLES
        tables = dump_tables(engine)
    finally:
        engine.dispose()
    assert len(tables["ai_jobs"]) == jobs
    assert len(tables["ai_job_results"]) == results
    assert len(tables["ai_job_gate"]) == 1
    assert len(tables[VERSION_TABLE]) == 1


# -- the API, on both backends --------------------------------------------------------


@pytest.fixture
def app(store: JobStore, database_url: str) -> Iterator[Triggers]:
    """The app's triggers on this store, with Prefect at a closed 127.0.0.1 port.

    No generator is registered, so any kind is accepted; the scopes of a
    backfill are the demo's.
    """
    from flows.demo import demo_scopes

    registry = Registry()
    registry.register_scopes(demo_scopes)
    settings = settings_for(database_url=database_url)
    runtime = Runtime(settings, store, registry, Redactor(settings.secrets()))
    yield Triggers(runtime, prefect_url=f"http://127.0.0.1:{free_port()}/api")


class _Records(logging.Handler):
    """Keeps the records of the logger it is added to (Prefect's logging
    setup keeps them from pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _keys() -> list[tuple[str, str, str]]:
    keys = [(f"u-{v}", v, f"s-{v}") for v in HOSTILE.values()]
    keys += [(v, f"k-{name}", v) for name, v in HOSTILE.items()]
    keys.append(MAX_KEY)
    assert len(set(keys)) == len(keys)
    return keys


def test_hostile_keys_and_fingerprints_round_trip_through_store_and_request_insight(
    store: JobStore,
    database_url: str,
    app: Triggers,
) -> None:
    keys = _keys()
    fingerprints = [*HOSTILE.values(), MAX_FINGERPRINT]
    fingerprint_of = {key: fingerprints[n % len(fingerprints)] for n, key in enumerate(keys)}
    logged = _Records()
    trigger_log = logging.getLogger("deployments.triggers")
    trigger_log.addHandler(logged)
    try:
        _round_trip(store, app, keys, fingerprint_of)
    finally:
        trigger_log.removeHandler(logged)
    outages = [r for r in logged.records if "queued work waits" in r.getMessage()]
    assert len(outages) == 1, "the Prefect outage is logged once, not once per poll"
    _assert_intact(database_url, jobs=len(keys), results=len(keys))


def _round_trip(
    store: JobStore,
    app: Triggers,
    keys: list[tuple[str, str, str]],
    fingerprint_of: dict[tuple[str, str, str], str],
) -> None:
    # The first screens: nothing is in flight, so each poll also tries (and
    # fails) to start a Prefect run; the state comes from the store alone.
    for key in keys[:3]:
        state = app.request_insight(*key, fingerprint_of[key])
        assert (state.status, state.error, state.flow_run_id) == ("pending", None, None)
        assert state.ahead is not None and state.result is None
    # The rest through the store, at prefetch priority.
    for key in keys[3:]:
        assert store.enqueue(*key, fingerprint_of[key]) == "pending"

    # While a call is in flight the screens do not start runs: quick polls.
    first = store.claim_next("hostile-worker")
    assert first.job is not None
    for key in keys:
        state = app.request_insight(*key, fingerprint_of[key])
        key_job = job_of(store, *key)
        assert key_job is not None
        expected = "running" if key_job.id == first.job.id else "pending"
        assert (state.status, state.error, state.flow_run_id) == (expected, None, None)
    # Polled by a screen: every job is interactive now.
    assert all(j.priority == INTERACTIVE for j in map(lambda k: job_of(store, *k), keys) if j)

    # Run every job; each result echoes the key the worker was handed.
    claim = first
    produced = 0
    while claim.job is not None:
        job = claim.job
        echo = {"key": [job.user_id, job.kind, job.subject], "fingerprint": job.fingerprint}
        assert store.finish(job.id, job.holder or "", result=echo) == Status.DONE
        produced += 1
        claim = store.claim_next("hostile-worker")
    assert produced == len(keys)

    for key in keys:
        user_id, kind, subject = key
        fingerprint = fingerprint_of[key]
        found = job_of(store, *key)
        assert found is not None
        assert (found.user_id, found.kind, found.subject) == key
        assert found.fingerprint == fingerprint
        shown = found.as_dict()
        assert shown["fingerprint"] == fingerprint
        assert shown["status"] == "done" and shown["attempts"] == 1
        listed = listed_jobs(store, user_id)
        assert (kind, subject) in [(e["kind"], e["subject"]) for e in listed]
        result = result_of(store, *key)
        assert result is not None
        assert result.output == {"key": list(key), "fingerprint": fingerprint}
        assert (result.user_id, result.kind, result.subject) == key

        state = app.request_insight(*key, fingerprint)
        assert (state.status, state.fresh, state.error) == ("done", True, None)
        assert state.result is not None and state.result["output"]["key"] == list(key)
        assert state.result["fingerprint"] == fingerprint


@pytest.mark.parametrize("part", ["user_id", "kind", "subject"])
@pytest.mark.parametrize("bad", list(BAD_KEY_TEXT), ids=list(BAD_KEY_TEXT))
def test_bad_key_text_is_refused_by_name_and_writes_nothing(
    store: JobStore, database_url: str, app: Triggers, part: str, bad: str
) -> None:
    store.enqueue("victim", "sleep", "d1", "fp")
    before = _snapshot(database_url)
    key = {"user_id": "u", "kind": "sleep", "subject": "d1", part: BAD_KEY_TEXT[bad]}
    args = (key["user_id"], key["kind"], key["subject"])

    calls: list[tuple[str, Any]] = [
        ("enqueue", lambda: store.enqueue(*args, "fp")),
        ("request_insight", lambda: app.request_insight(*args, "fp")),
        ("state", lambda: state_of(store, *args)),
        ("result_of", lambda: result_of(store, *args)),
        ("superseding", lambda: store.enqueue_many([EnqueueRequest(*args, supersede=True)])),
    ]
    if part == "user_id":
        calls += [
            ("list_jobs", lambda: listed_jobs(store, args[0])),
            ("retry_failed", lambda: store.retry_failed(args[0])),
        ]
        if args[0] is not None:  # pending_count(None) counts everyone's jobs
            calls.append(("pending_count", lambda: pending(store, args[0])))
    for name, call in calls:
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.argument == part, (name, str(refused.value))
        assert isinstance(refused.value, ValueError)
    assert _snapshot(database_url) == before


@pytest.mark.parametrize("part", ["user_id", "kind"])
def test_the_id_joiner_is_refused_where_it_would_merge_two_keys(
    store: JobStore, database_url: str, app: Triggers, part: str
) -> None:
    before = _snapshot(database_url)
    key = {"user_id": "u", "kind": "sleep", "subject": "d1", part: BAD_JOINER}
    args = (key["user_id"], key["kind"], key["subject"])
    for call in (
        lambda: store.enqueue(*args),
        lambda: app.request_insight(*args),
        lambda: result_of(store, *args),
    ):
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.argument == part
    assert _snapshot(database_url) == before


@pytest.mark.parametrize("bad", list(BAD_FINGERPRINTS), ids=list(BAD_FINGERPRINTS))
def test_fingerprints_of_every_wrong_type_are_refused_and_write_nothing(
    store: JobStore, database_url: str, app: Triggers, bad: str
) -> None:
    store.enqueue("u", "sleep", "d1", "fp-old")  # an existing row a bad poll must not touch
    before = _snapshot(database_url)
    value = BAD_FINGERPRINTS[bad]
    for call in (
        lambda: store.enqueue("u", "sleep", "d1", value),
        lambda: store.enqueue("u", "sleep", "new-day", value),
        lambda: app.request_insight("u", "sleep", "d1", value),
        lambda: app.request_insight("u", "sleep", "new-day", value),
    ):
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.argument == "fingerprint"
    assert _snapshot(database_url) == before


@pytest.mark.parametrize("name", list(VALID_FINGERPRINTS), ids=list(VALID_FINGERPRINTS))
def test_valid_fingerprints_round_trip_and_none_or_empty_keep_the_stored_one(
    store: JobStore, app: Triggers, name: str
) -> None:
    value = VALID_FINGERPRINTS[name]
    expected = value or None  # "" means "none given", as in the original
    store.enqueue("other", "sleep", "busy")
    assert store.claim_next("w").job is not None  # a call in flight: polls start no run
    assert store.enqueue("u", "sleep", "fresh", value) == "pending"
    fresh = job_of(store, "u", "sleep", "fresh")
    assert fresh is not None and fresh.fingerprint == expected

    # On an existing row, no fingerprint keeps the stored one; a new one replaces it.
    store.enqueue("u", "sleep", "kept", "fp-stored")
    state = app.request_insight("u", "sleep", "kept", value)
    assert state.status == "pending" and state.error is None
    kept = job_of(store, "u", "sleep", "kept")
    assert kept is not None and kept.fingerprint == (expected or "fp-stored")


def test_sql_in_a_user_id_reaches_no_other_user(
    store: JobStore, database_url: str, app: Triggers
) -> None:
    """Classic injections as user ids match only themselves: never everyone, never a drop."""
    store.enqueue("alice", "sleep", "d1", "fp-a", priority=INTERACTIVE)
    claim = store.claim_next("w")
    assert claim.job is not None
    store.finish(claim.job.id, claim.job.holder or "", result={"text": "alice's insight"})
    store.enqueue("alice", "sleep", "d2")
    store.enqueue("bob", "hrv", "d1")
    # A failed job of alice's, which a retry_failed injection must not revive.
    store.enqueue("alice", "steps", "d1", priority=INTERACTIVE)
    for _ in range(3):
        claim = store.claim_next("w")
        assert claim.job is not None and claim.job.kind == "steps"
        store.fail(claim.job.id, claim.job.holder or "", Failure.BUILD, "boom")
    before = _snapshot(database_url)

    for attack in (
        "x' OR '1'='1",
        "' OR 1=1 --",
        "alice' --",
        "alice'; --",
        "%",
        "alice%",
        "' UNION SELECT * FROM ai_jobs --",
    ):
        assert listed_jobs(store, attack) == []
        assert pending(store, attack) == 0
        assert store.retry_failed(attack).retried == 0
        assert job_of(store, attack, "sleep", "d1") is None
        assert result_of(store, attack, "sleep", "d1") is None
        assert state_of(store, attack, "sleep", "d2") is None
    assert _snapshot(database_url) == before

    # As a real user id: queued, listed, superseded, and nothing dropped.
    drop = "'; DROP TABLE ai_jobs; --"
    state = app.request_insight(drop, "sleep", "'; DROP TABLE ai_job_gate; --")
    assert state.status == "pending" and state.error is None
    store.enqueue_many([EnqueueRequest(drop, "sleep", "other-day", supersede=True)])
    assert [e["subject"] for e in listed_jobs(store, drop)] == ["other-day"]
    assert pending(store) == 3  # alice d2, bob d1, the drop user's job
    assert listed_jobs(store, "alice")[0]["subject"] == "d2"
    failed = job_of(store, "alice", "steps", "d1")
    assert failed is not None and failed.status == "failed"
    _assert_intact(database_url, jobs=5, results=1)


def test_trigger_backfill_with_prefect_unreachable_still_queues_in_the_store(
    store: JobStore, app: Triggers
) -> None:
    from flows.demo import demo_scopes

    user = HOSTILE["drop-table"]
    state = app.trigger_backfill(user, sync_id="sync-1")
    assert (state.queued, state.flow_run_id, state.error) == (len(demo_scopes(user)), None, None)
    assert state.run_note and "127.0.0.1" in state.run_note
    assert pending(store, user) == len(demo_scopes(user))


# -- the command line -----------------------------------------------------------------

Arg = str | bytes


def _cli_env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "AI_JOB_DATABASE_URL": f"sqlite:///{tmp_path / 'queue.db'}",
        "AI_JOB_DATA_DIR": str(tmp_path / "data"),
        "AI_JOB_GAP_SECONDS": "0",
        # A plugin that registers no generator: any kind is accepted.
        "AI_JOB_PLUGINS": "tests.support.no_generators",
        "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",
        "PREFECT_CLIENT_MAX_RETRIES": "0",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        "PYTHONPATH": str(ROOT),
        "DO_NOT_TRACK": "1",
    }


def _iq(env: Mapping[str, str], *args: Arg) -> subprocess.CompletedProcess[str]:
    """Run `insight-queue` with raw argv (bytes allowed); UTF-8 output, no locale guess."""
    return subprocess.run(
        [str(BIN / "insight-queue"), *args],
        env=dict(env),
        capture_output=True,
        encoding="utf-8",
        errors="strict",
        timeout=120,
        cwd=ROOT,
    )


def _in_parallel(env: Mapping[str, str], calls: Sequence[Sequence[Arg]]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: _iq(env, *args), calls))


def _assert_clean_refusal(done: subprocess.CompletedProcess[str], argument: str) -> None:
    where = f"{done.args[1:]!r}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 2, where
    assert "Traceback" not in done.stderr + done.stdout, where
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {argument}: "), where
    assert done.stdout == "", where


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = _cli_env(tmp_path)
    migrate.upgrade(env["AI_JOB_DATABASE_URL"])
    return env


CLI_KEYS: list[tuple[str, str, str, str]] = [
    # (user_id, kind, subject, fingerprint)
    (HOSTILE["drop-table"], HOSTILE["or-true"], HOSTILE["stacked"], HOSTILE["pg-dollar"]),
    (HOSTILE["double-quote"], HOSTILE["placeholders"], HOSTILE["backslash"], "--"),
    (HOSTILE["emoji-zwj"], HOSTILE["rtl-override"], HOSTILE["combining"], HOSTILE["cjk"]),
    (HOSTILE["astral"], HOSTILE["zero-width-bom"], HOSTILE["line-breaks"], HOSTILE["controls"]),
    ("-leading-dash", HOSTILE["html"], HOSTILE["json"], HOSTILE["padded"]),
    (*MAX_KEY, MAX_FINGERPRINT),
]


@pytest.mark.slow
def test_cli_hostile_arguments_round_trip_exactly(cli_env: dict[str, str]) -> None:
    url = cli_env["AI_JOB_DATABASE_URL"]

    def args(verb: str, key: tuple[str, ...]) -> list[str]:
        # "--" so a value starting with a dash is an argument, not an option.
        return [verb, "--", *key[:3]]

    enqueued = _in_parallel(
        cli_env, [["enqueue", "--fingerprint", k[3], "--", *k[:3]] for k in CLI_KEYS]
    )
    for done in enqueued:
        assert (done.returncode, done.stdout, done.stderr) == (0, "pending\n", ""), done

    statuses = _in_parallel(cli_env, [args("status", k) for k in CLI_KEYS])
    listed = _in_parallel(cli_env, [["jobs", "--json", "--user", k[0]] for k in CLI_KEYS])
    for key, status, jobs in zip(CLI_KEYS, statuses, listed, strict=True):
        assert status.returncode == 0 and "Traceback" not in status.stderr, status
        shown = json.loads(status.stdout)
        assert (shown["status"], shown["fingerprint"]) == ("pending", key[3])
        assert jobs.returncode == 0, jobs
        assert [(e["kind"], e["subject"]) for e in json.loads(jobs.stdout)] == [key[1:3]]

    # Results made by a worker, read back on the command line.
    with store_for(settings_for(url)) as store:
        while (claim := store.claim_next("cli-worker")).job is not None:
            job = claim.job
            store.finish(job.id, job.holder or "", result={"echo": [job.kind, job.subject]})
    results = _in_parallel(cli_env, [args("result", k) for k in CLI_KEYS])
    for key, done in zip(CLI_KEYS, results, strict=True):
        assert done.returncode == 0, done
        shown = json.loads(done.stdout)
        assert shown["output"] == {"echo": list(key[1:3])} and shown["fingerprint"] == key[3]

    # A screen's poll with Prefect unreachable: the state from the store, exit 0.
    polls = _in_parallel(
        cli_env, [["request-insight", "--fingerprint", k[3], "--", *k[:3]] for k in CLI_KEYS]
    )
    for key, done in zip(CLI_KEYS, polls, strict=True):
        assert done.returncode == 0 and "Traceback" not in done.stderr, done
        state = json.loads(done.stdout)
        assert (state["status"], state["fresh"], state["error"]) == ("done", True, None)
        assert state["result"]["output"] == {"echo": list(key[1:3])}
    _assert_intact(url, jobs=len(CLI_KEYS), results=len(CLI_KEYS))


BAD_CLI: list[tuple[str, list[Arg], str]] = [
    ("enqueue-10kB-user", ["enqueue", TEN_KB, "sleep", "d1"], "user_id"),
    ("enqueue-joiner-user", ["enqueue", BAD_JOINER, "sleep", "d1"], "user_id"),
    ("enqueue-empty-user", ["enqueue", "", "sleep", "d1"], "user_id"),
    ("enqueue-joiner-kind", ["enqueue", "u", "a|b", "d1"], "kind"),
    (
        "enqueue-10kB-fingerprint",
        ["enqueue", "--fingerprint", TEN_KB, "u", "k", "s"],
        "fingerprint",
    ),
    ("enqueue-invalid-utf8-user", ["enqueue", b"\xff\xfe'; DROP", "sleep", "d1"], "user_id"),
    ("status-10kB-kind", ["status", "u", TEN_KB, "d1"], "kind"),
    ("status-invalid-utf8-subject", ["status", "u", "k", b"\xed\xa0\x80"], "subject"),
    ("jobs-invalid-utf8-user", ["jobs", "--json", "--user", b"\x80"], "user_id"),
    ("result-empty-subject", ["result", "u", "k", ""], "subject"),
    ("request-insight-10kB-subject", ["request-insight", "u", "k", TEN_KB], "subject"),
    ("request-insight-joiner-user", ["request-insight", BAD_JOINER, "k", "s"], "user_id"),
    (
        "request-insight-invalid-utf8-fingerprint",
        ["request-insight", "--fingerprint", b"fp\xff", "u", "k", "s"],
        "fingerprint",
    ),
    ("retry-failed-10kB-user", ["retry-failed", TEN_KB], "user_id"),
    # click accepts NaN in a FloatRange; the store refuses it, in the same format.
    ("pause-nan", ["pause", "nan"], "seconds"),
]


@pytest.mark.slow
def test_cli_bad_arguments_fail_with_one_line_and_exit_2(cli_env: dict[str, str]) -> None:
    url = cli_env["AI_JOB_DATABASE_URL"]
    assert _iq(cli_env, "enqueue", "victim", "sleep", "d1").returncode == 0
    before = _snapshot(url)
    outcomes = _in_parallel(cli_env, [args for _, args, _ in BAD_CLI])
    for (_, _, argument), done in zip(BAD_CLI, outcomes, strict=True):
        _assert_clean_refusal(done, argument)
    assert _snapshot(url) == before
    _assert_intact(url, jobs=1, results=0)


@pytest.mark.slow
def test_cli_option_values_click_refuses_exit_2_without_a_traceback(
    cli_env: dict[str, str],
) -> None:
    """Values click itself parses (priority, limit) get click's usage error, exit 2."""
    calls: list[list[Arg]] = [
        ["enqueue", "--priority", "'; DROP TABLE ai_jobs; --", "u", "k", "s"],
        ["enqueue", "--priority", "-1", "u", "k", "s"],
        ["enqueue", "--priority", "1e400", "u", "k", "s"],
        ["enqueue", "--priority", "9" * 5000, "u", "k", "s"],
        ["jobs", "--user", "u", "--limit", "0"],
        ["jobs", "--user", "u", "--limit", b"\xff"],
    ]
    for done in _in_parallel(cli_env, calls):
        where = f"{done.args[1:]!r}: {done.returncode}\n{done.stderr}"
        assert done.returncode == 2, where
        assert "Traceback" not in done.stderr and "Invalid value" in done.stderr, where
        assert done.stdout == ""
    _assert_intact(cli_env["AI_JOB_DATABASE_URL"], jobs=0, results=0)


def test_argv_cannot_carry_a_nul_byte(cli_env: dict[str, str]) -> None:
    """The OS refuses NUL in argv before our code runs: nothing to test past it."""
    for value in ("a\x00b", b"a\x00b"):
        with pytest.raises(ValueError, match="null byte"):
            _iq(cli_env, "enqueue", value, "sleep", "d1")
    _assert_intact(cli_env["AI_JOB_DATABASE_URL"], jobs=0, results=0)


@pytest.mark.slow
def test_cli_sql_in_a_user_id_is_just_a_user_id(cli_env: dict[str, str]) -> None:
    url = cli_env["AI_JOB_DATABASE_URL"]
    for user in ("alice", "bob"):
        assert _iq(cli_env, "enqueue", user, "sleep", "d1").returncode == 0
    drop = "'; DROP TABLE ai_jobs; --"
    done = _iq(cli_env, "enqueue", drop, "sleep", "'; DROP TABLE ai_job_results; --")
    assert (done.returncode, done.stdout) == (0, "pending\n"), done

    everyone = _iq(cli_env, "jobs", "--json", "--user", "x' OR '1'='1")
    assert everyone.returncode == 0 and json.loads(everyone.stdout) == []
    table = _iq(cli_env, "jobs", "--user", "' OR 1=1 --")
    assert table.returncode == 0 and "(no jobs)" in table.stdout
    missing = _iq(cli_env, "status", "alice' --", "sleep", "d1")
    assert (missing.returncode, missing.stderr.strip()) == (
        1,
        'error: no job for "alice\' --" sleep:d1',
    )
    retried = _iq(cli_env, "retry-failed", "' OR 1=1 --")
    assert (retried.returncode, retried.stdout.strip()) == (
        0,
        "retried 0 failed job(s) of ' OR 1=1 --; 0 now pending or running",
    )
    mine = json.loads(_iq(cli_env, "jobs", "--json", "--user", drop).stdout)
    assert [(e["kind"], e["subject"]) for e in mine] == [
        ("sleep", "'; DROP TABLE ai_job_results; --")
    ]
    _assert_intact(url, jobs=3, results=0)


# -- regression tests for defects these tests found -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "user_id",
    ["", TEN_KB, BAD_JOINER, b"\xff\xfe"],
    ids=["empty", "10kB", "joiner", "invalid-utf8"],
)
def test_cli_trigger_backfill_refuses_bad_user_ids_like_the_store(
    cli_env: dict[str, str], user_id: Arg
) -> None:
    _assert_clean_refusal(_iq(cli_env, "trigger-backfill", user_id), "user_id")


def test_cli_an_unusable_sqlite_path_is_one_error_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {**_cli_env(tmp_path), "AI_JOB_DATABASE_URL": f"sqlite:///{blocker}/sub/queue.db"}
    done = _iq(env, "enqueue", "u", "sleep", "d1")
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 1 and done.stderr.startswith("error: "), done.stderr


@pytest.mark.slow
def test_cli_jobs_table_cannot_be_forged_by_control_characters(cli_env: dict[str, str]) -> None:
    forged = "d1\npending  0*    admin  everything-is-fine"
    for kind, subject in (("sleep", forged), ("\x1b]0;pwned\x07\x1b[2J", "d2")):
        assert _iq(cli_env, "enqueue", "u", kind, subject).returncode == 0
    table = _iq(cli_env, "jobs", "--user", "u")
    assert table.returncode == 0
    lines = table.stdout.rstrip("\n").split("\n")
    assert len(lines) == 1 + 2, lines  # the header and one line per job
    assert not any(c < " " or "\x7f" <= c <= "\x9f" for c in table.stdout.replace("\n", ""))
