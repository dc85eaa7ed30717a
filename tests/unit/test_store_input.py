"""FIX8 as properties: bad input is refused by name, before the database.

For every public method and every one of its arguments, hypothesis draws
invalid values; each call must raise `InvalidArgument` (a `ValueError`) that
names the argument, run no SQL at all, and leave every table as it was. The
store under test is a SQLite file: validation never reaches a database, and
the check that no SQL ran proves it. (Valid hostile text round-trips on both
databases in `tests/integration/test_store_round_trips.py`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from queue_store import INTERACTIVE, Failure, InvalidArgument, JobStore, StoreError
from queue_store.models import (
    MAX_FINGERPRINT_LENGTH,
    MAX_HOLDER_LENGTH,
    MAX_ID_LENGTH,
    MAX_KIND_LENGTH,
    MAX_PRIORITY,
    MAX_SUBJECT_LENGTH,
    MAX_WORKER_LENGTH,
)
from tests.support.race_worker import dump_tables
from tests.support.reads import job_of

EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

U = "user-1"


@pytest.fixture
def backend() -> str:
    """Validation never reaches a database: one backend shows it (SQLite, in a file)."""
    return "sqlite"


MAX_LIST_LIMIT = 1000

# -- strategies ---------------------------------------------------------------------

# Text the store must accept: anything but NUL and lone surrogates.
SAFE_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")


def _safe_text(min_size: int, max_size: int) -> st.SearchStrategy[str]:
    return st.text(SAFE_CHARS, min_size=min_size, max_size=max_size)


NON_STRINGS: st.SearchStrategy[Any] = st.one_of(
    st.integers(),
    st.none(),
    st.binary(max_size=8),
    st.booleans(),
    st.floats(),
    st.lists(st.text(max_size=3), max_size=2),
    st.just(("a", "b")),
)


def _insert(text: str, position: int, char: str) -> str:
    position %= len(text) + 1
    return text[:position] + char + text[position:]


def _over_long(max_length: int) -> st.SearchStrategy[str]:
    return st.builds(
        lambda base, extra: (base * (max_length + extra))[: max_length + extra],
        _safe_text(1, 4),
        st.integers(1, 40),
    )


def bad_text(max_length: int, *, none_is_valid: bool = False) -> st.SearchStrategy[Any]:
    """Values a required text argument of at most `max_length` characters must refuse."""
    non_strings = NON_STRINGS.filter(lambda v: v is not None) if none_is_valid else NON_STRINGS
    body = _safe_text(0, 12)
    return st.one_of(
        non_strings,
        st.just(""),
        st.sampled_from([" ", "\t", " \n "]),
        _over_long(max_length),
        st.builds(_insert, body, st.integers(0, 20), st.just("\x00")),
        st.builds(
            _insert,
            body,
            st.integers(0, 20),
            st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        ),
    )


BAD_FINGERPRINT = st.one_of(
    # None and "" both mean "no fingerprint": valid.
    NON_STRINGS.filter(lambda v: v is not None),
    _over_long(MAX_FINGERPRINT_LENGTH),
    st.builds(_insert, _safe_text(0, 12), st.integers(0, 20), st.just("\x00")),
    st.builds(
        _insert,
        _safe_text(0, 12),
        st.integers(0, 20),
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    ),
)

BAD_PRIORITY = st.one_of(
    st.booleans(),
    st.integers(max_value=-1),
    st.integers(min_value=MAX_PRIORITY + 1),
    st.just(2**63),
    st.floats(),
    st.sampled_from([0.0, 10.0, "0", "10", None, b"1", [0]]),
)

BAD_LIMIT = st.one_of(
    st.booleans(),
    st.integers(max_value=0),
    st.integers(min_value=MAX_LIST_LIMIT + 1),
    st.floats(),
    st.sampled_from([None, "60", 60.0, b"60"]),
)

HEX = "0123456789abcdef"
BAD_JOB_ID = st.one_of(
    NON_STRINGS,
    st.just(""),
    st.text(HEX, min_size=1, max_size=63),
    st.text(HEX, min_size=65, max_size=80),
    st.text(HEX.upper(), min_size=64, max_size=64).filter(lambda t: t != t.lower()),
    st.builds(
        lambda base, pos, char: base[:pos] + char + base[pos + 1 :],
        st.text(HEX, min_size=64, max_size=64),
        st.integers(0, 63),
        st.sampled_from(list("gxzG -'\x00é🙂")),
    ),
)

BAD_RESULT = st.one_of(
    st.sampled_from(
        [
            {1, 2},
            b"bytes",
            bytearray(b"x"),
            float("nan"),
            float("inf"),
            -float("inf"),
            {"nested": [float("nan")]},
            {("tuple", "key"): 1},
            {"fn": print},
            object(),
            [1, 2, {3}],
        ]
    ),
)

BAD_SECONDS = st.one_of(
    st.floats(max_value=-1e-9),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), True, False, None, "5", b"5"]),
    st.integers(max_value=-1),
    # No pause can end past the year 9999; these are not "seconds" any clock can add.
    st.floats(min_value=1e12, max_value=1e308),
    st.integers(min_value=10**12, max_value=10**30),
    st.just(10**400),  # no float can hold it
)

BAD_DURATION = st.one_of(
    st.floats(max_value=-1e-9),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), True, False, "5", b"5", [1]]),
    st.integers(max_value=-1),
    st.just(10**400),
)

BAD_MESSAGE = st.one_of(
    NON_STRINGS.filter(lambda v: v is not None),
    st.text(" \t\r\n", max_size=5),
)


# -- the seeded database ---------------------------------------------------------


@dataclasses.dataclass
class Seeded:
    store: JobStore
    running_id: str
    running_holder: str


@pytest.fixture
def seeded(store: JobStore) -> Seeded:
    """A queue with a row in every state, a result, a gate update and a live claim.

    Every invalid call below targets these rows with its *other* arguments, so
    a check that let a bad value through would change something.
    """
    store.enqueue(U, "sleep", "done-day", "fp-done", priority=INTERACTIVE)
    claim = store.claim_next("seed-worker")
    assert claim.job is not None
    store.finish(claim.job.id, claim.job.holder or "", result={"text": "ok"})

    store.enqueue(U, "sleep", "failed-day", "fp-failed", priority=INTERACTIVE)
    for _ in range(3):
        claim = store.claim_next("seed-worker")
        assert claim.job is not None
        store.fail(claim.job.id, claim.job.holder or "", Failure.BUILD, "TimeoutError: slow")
    failed = job_of(store, U, "sleep", "failed-day")
    assert failed is not None and failed.status == "failed"

    store.enqueue(U, "sleep", "running-day", "fp-running", priority=INTERACTIVE)
    claim = store.claim_next("seed-worker")
    assert claim.job is not None and claim.job.subject == "running-day"
    store.enqueue(U, "sleep", "pending-day", "fp-pending")
    store.enqueue(U, "trends", "pending-week")
    return Seeded(store, claim.job.id, claim.job.holder or "")


@contextmanager
def no_sql(store: JobStore) -> Iterator[list[str]]:
    """Collect every statement the store's engine runs inside the block."""
    executed: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        executed.append(statement)

    event.listen(store._engine, "before_cursor_execute", record)
    try:
        yield executed
    finally:
        event.remove(store._engine, "before_cursor_execute", record)


# -- the invalid-argument cases ---------------------------------------------------

Call = Callable[[Seeded, Any], Any]


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    argument: str
    values: st.SearchStrategy[Any]
    call: Call

    @property
    def id(self) -> str:
        return f"{self.method}-{self.argument}"


def _key_cases(method: str, **options: Any) -> list[Case]:
    def at(index: int) -> Call:
        def call(s: Seeded, value: Any) -> Any:
            key: list[Any] = [U, "sleep", "pending-day"]
            key[index] = value
            return getattr(s.store, method)(*key, **options)

        return call

    name = method + "".join(f"[{k}={v}]" for k, v in options.items())
    return [
        Case(name, "user_id", bad_text(MAX_ID_LENGTH), at(0)),
        Case(name, "kind", bad_text(MAX_KIND_LENGTH), at(1)),
        Case(name, "subject", bad_text(MAX_SUBJECT_LENGTH), at(2)),
    ]


def _enqueue(**overrides: Any) -> Call:
    def call(s: Seeded, value: Any) -> Any:
        arguments: dict[str, Any] = {
            "user_id": U,
            "kind": "sleep",
            "subject": "pending-day",
            "fingerprint": "fp-new",
            "priority": INTERACTIVE,
        }
        (name,) = overrides
        arguments[name] = value
        return s.store.enqueue(**arguments)

    return call


HOLDER_MAX = MAX_HOLDER_LENGTH  # the worker's name plus "/" and its nonce
# A worker's name: text, and no "/" or whitespace (it is a prefix of its claim tokens).
BAD_WORKER = st.one_of(
    bad_text(MAX_WORKER_LENGTH),
    st.builds(
        _insert,
        _safe_text(1, 12).filter(str.strip),
        st.integers(0, 20),
        st.sampled_from(["/", " ", "%", "\t"]),
    ),
)


STOP = Failure.STOPPED

CASES: list[Case] = [
    Case("enqueue", "user_id", bad_text(MAX_ID_LENGTH), _enqueue(user_id=None)),
    Case("enqueue", "kind", bad_text(MAX_KIND_LENGTH), _enqueue(kind=None)),
    Case("enqueue", "subject", bad_text(MAX_SUBJECT_LENGTH), _enqueue(subject=None)),
    Case("enqueue", "fingerprint", BAD_FINGERPRINT, _enqueue(fingerprint=None)),
    Case("enqueue", "priority", BAD_PRIORITY, _enqueue(priority=None)),
    *_key_cases("poll"),
    *_key_cases("poll", queue=False),
    Case("list_jobs", "user_id", bad_text(MAX_ID_LENGTH), lambda s, v: s.store.list_jobs(v)),
    Case("list_jobs", "limit", BAD_LIMIT, lambda s, v: s.store.list_jobs(U, v)),
    Case("retry_failed", "user_id", bad_text(MAX_ID_LENGTH), lambda s, v: s.store.retry_failed(v)),
    Case("jobs", "job_id", BAD_JOB_ID, lambda s, v: s.store.jobs([v])),
    Case("claim_next", "worker", BAD_WORKER, lambda s, v: s.store.claim_next(v)),
    Case("heartbeat", "job_id", BAD_JOB_ID, lambda s, v: s.store.heartbeat(v, s.running_holder)),
    Case(
        "heartbeat",
        "holder",
        bad_text(HOLDER_MAX),
        lambda s, v: s.store.heartbeat(s.running_id, v),
    ),
    Case(
        "heartbeat",
        "flow_run_id",
        bad_text(64).filter(lambda v: v is not None),
        lambda s, v: s.store.heartbeat(s.running_id, s.running_holder, flow_run_id=v),
    ),
    Case(
        "finish",
        "job_id",
        BAD_JOB_ID,
        lambda s, v: s.store.finish(v, s.running_holder, result={"text": "x"}),
    ),
    Case(
        "finish",
        "holder",
        bad_text(HOLDER_MAX),
        lambda s, v: s.store.finish(s.running_id, v, result={"text": "x"}),
    ),
    Case(
        "finish",
        "result",
        BAD_RESULT,
        lambda s, v: s.store.finish(s.running_id, s.running_holder, result=v),
    ),
    Case(
        "finish",
        "duration_seconds",
        BAD_DURATION,
        lambda s, v: s.store.finish(
            s.running_id, s.running_holder, result={"text": "x"}, duration_seconds=v
        ),
    ),
    Case("fail", "job_id", BAD_JOB_ID, lambda s, v: s.store.fail(v, s.running_holder, STOP, "x")),
    Case(
        "fail",
        "holder",
        bad_text(HOLDER_MAX),
        lambda s, v: s.store.fail(s.running_id, v, STOP, "x"),
    ),
    Case(
        "fail",
        "error",
        BAD_MESSAGE,
        lambda s, v: s.store.fail(s.running_id, s.running_holder, STOP, v),
    ),
    Case("pause", "seconds", BAD_SECONDS, lambda s, v: s.store.pause(v, "gateway down")),
    Case("pause", "reason", BAD_MESSAGE, lambda s, v: s.store.pause(30, v)),
    Case(
        "recover",
        "worker",
        BAD_WORKER.filter(lambda v: v is not None),
        lambda s, v: s.store.recover(v),
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_invalid_argument_is_refused_by_name_before_the_database(
    seeded: Seeded, case: Case
) -> None:
    store = seeded.store
    start = dump_tables(store._engine)

    @EXAMPLES
    @given(value=case.values)
    def refused(value: Any) -> None:
        before = dump_tables(store._engine)
        with no_sql(store) as executed, pytest.raises(InvalidArgument) as info:
            case.call(seeded, value)
        error = info.value
        assert isinstance(error, ValueError)
        assert isinstance(error, StoreError)
        assert error.argument == case.argument, f"{case.id}: {value!r} blamed {error.argument}"
        assert str(error).startswith(f"{case.argument}:"), str(error)
        assert executed == [], f"{case.id}: {value!r} reached the database first"
        assert dump_tables(store._engine) == before

    refused()
    assert dump_tables(store._engine) == start


@pytest.mark.parametrize(
    "seconds",
    [1e12, 1e300, 10**12, 10**400],
    ids=["1e12", "1e300", "int-1e12", "int-1e400"],
)
def test_a_pause_no_clock_can_reach_is_refused_before_the_database(
    seeded: Seeded, seconds: float
) -> None:
    """`seconds` finite but past the year 9999 (or past any float) is bad input too."""
    store = seeded.store
    before = dump_tables(store._engine)
    with no_sql(store) as executed, pytest.raises(InvalidArgument) as info:
        store.pause(seconds, "gateway down")
    assert info.value.argument == "seconds"
    assert executed == []
    assert dump_tables(store._engine) == before
