"""The flows against a real Prefect server (the session's) and the simulator behind the recorder.

The backfill and screen flows run in this process on a runtime the test
installs; `drain` runs as `insight-queue drain` processes. What they leave in
Prefect (runs, states, artifacts, logs) is read back over its REST API. The
recorder, not the store, says how many calls were open at the gateway at once.

- With no consumer standing by, a flow drains the queue itself: a backfill
  queues the user's scopes in one transaction, sees them through, and leaves
  a progress artifact and a table of its scopes; a screen's run ends with its
  story, linking to the generation run.
- With a consumer standing by, the flows only follow: the consumer does the
  work, and the flows write no generation of their own.
- Each generation attempt is a flow run of `generate`, named `kind:subject`,
  tagged with the user, kind, priority class and attempt, ending in an honest
  state: Completed, or Failed with a one-line message and no traceback.
- A takeover ends the lost attempt's run Crashed, found by its record in
  Prefect, though the lost worker never wrote the run's id to the job row.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import uuid
from collections.abc import Coroutine, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast
from unittest import mock

import httpx
import pytest
from prefect.client.schemas.objects import State
from prefect.settings import PREFECT_API_URL, temporary_settings

from devtools.simulator import HUNG, OK
from flows.demo import demo_scopes
from flows.flows import backfill, drain, generate, interactive
from flows.history import PrefectLedger
from flows.limits import ensure_gateway_limit
from flows.runtime import Runtime
from queue_store import INTERACTIVE, Job, Redactor, Settings, Status
from tests.conftest import StoreFactory
from tests.support import waiting
from tests.support.databases import FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway, Workers
from tests.support.reads import job_of, pending, standing_by
from tests.support.services import ROOT, PrefectServer, cli, run_cli, running

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

GAP = 0.3  # AI_JOB_GAP_SECONDS for these tests
T = TypeVar("T")


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway(latency=0.2) as started:
        yield started


@pytest.fixture
def settings(tmp_path: Path, gateway: Gateway) -> Settings:
    return settings_for(
        data_dir=tmp_path / "data",
        gap_seconds=GAP,
        lease_seconds=10.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.5,
        backoff_seconds=0.5,
        backoff_max_seconds=2.0,
        plugins="flows.demo,tests.support.plugins",
        gateway={"url": gateway.url},
    )


@pytest.fixture
def prefect(prefect_server: PrefectServer) -> Iterator[PrefectReader]:
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        ensure_gateway_limit(1)
        reader = PrefectReader(prefect_server.api_url)
        try:
            yield reader
        finally:
            reader.close()


@pytest.fixture
def rt(settings: Settings) -> Iterator[Runtime]:
    made = Runtime.open(settings)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


class PrefectReader:
    """What a flow left in Prefect, read over the REST API."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self._http = httpx.Client(base_url=api_url, timeout=30)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        response = self._http.post(path, json={"limit": 200, **body})
        response.raise_for_status()
        found: list[dict[str, Any]] = response.json()
        return found

    def runs_tagged(self, *tags: str) -> list[dict[str, Any]]:
        return self._post("/flow_runs/filter", {"flow_runs": {"tags": {"all_": list(tags)}}})

    def run(self, run_id: str) -> dict[str, Any]:
        response = self._http.get(f"/flow_runs/{run_id}")
        response.raise_for_status()
        found: dict[str, Any] = response.json()
        return found

    def flow_name(self, run: dict[str, Any]) -> str:
        response = self._http.get(f"/flows/{run['flow_id']}")
        response.raise_for_status()
        return str(response.json()["name"])

    def artifacts(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The artifacts of a flow run, by key."""
        found = self._post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
        return {str(a["key"]): a for a in found}

    def logs(self, run_id: str) -> list[str]:
        found = self._post("/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}})
        return [str(line["message"]) for line in found]


def table_rows(artifact: dict[str, Any]) -> list[dict[str, Any]]:
    data = artifact["data"]
    rows: list[dict[str, Any]] = json.loads(data) if isinstance(data, str) else data
    return rows


def state_of(run: dict[str, Any]) -> tuple[str, str]:
    return str(run["state"]["type"]), str(run["state"]["message"] or "")


def run_flow(rt: Runtime, flow_call: Coroutine[Any, Any, T]) -> T:
    """Run a flow (a coroutine) in this process, with the test's settings as its environment."""
    with mock.patch.dict(os.environ, rt.settings.to_env()):
        return asyncio.run(flow_call)


def pseudonym(rt: Runtime, user_id: str) -> str:
    """What the run history knows the user as (D4)."""
    found = {e.job.pseudonym for e in rt.store.list_jobs(user_id)}
    assert len(found) == 1 and None not in found, found
    return str(found.pop())


async def backfilled(rt: Runtime, user_id: str, *, tagged: bool = False) -> State[Any]:
    """The backfill flow's final state, started as the post-sync hook starts it: the scopes
    queued first, the run given the user's pseudonym (`tagged`: and its tag, as the triggers
    tag it)."""
    from prefect import tags

    await asyncio.to_thread(
        rt.store.enqueue_many, [s.request(user_id) for s in rt.registry.scopes_for(user_id)]
    )
    who = await asyncio.to_thread(pseudonym, rt, user_id)
    with tags(*([f"user:{who}"] if tagged else [])):
        return cast(State[Any], await backfill(who, return_state=True))


async def screened(
    rt: Runtime, user_id: str, kind: str, subject: str, fingerprint: str | None = None
) -> State[Any]:
    """A screen's run's final state, started as a screen's poll starts it: the job queued at
    the front first, the run given the user's pseudonym."""
    await asyncio.to_thread(rt.store.poll, user_id, kind, subject, fingerprint)
    who = await asyncio.to_thread(pseudonym, rt, user_id)
    return cast(State[Any], await interactive(who, kind, subject, return_state=True))


async def drained() -> dict[str, Any]:
    return await drain()


def run_id_of(state: State[Any]) -> str:
    run_id = state.state_details.flow_run_id
    assert run_id is not None
    return str(run_id)


wait_for = partial(waiting.wait_for, every=0.1)


def answers(gateway: Gateway, label: str) -> int:
    return sum(
        1 for r in gateway.simulator.stats().requests if r.job == label and r.outcome in (OK, HUNG)
    )


def generation_runs(prefect: PrefectReader, who: str, *, settled: int) -> list[dict[str, Any]]:
    """The generation runs of the user whose pseudonym is `who`, once `settled` of them have a
    final state."""
    found: list[dict[str, Any]] = []

    def enough() -> bool:
        nonlocal found
        found = prefect.runs_tagged("generation", f"user:{who}")
        return sum(1 for r in found if r["state"]["type"] != "RUNNING") >= settled

    wait_for(enough, 30, f"{settled} generation runs of {who} ended")
    return found


def test_a_backfill_with_no_consumer_drains_its_scopes_itself_and_reports_them(
    rt: Runtime, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    state = run_flow(rt, backfilled(rt, user))
    assert (state.type.value, state.message) == ("COMPLETED", "8 done")
    run_id = run_id_of(state)
    who = pseudonym(rt, user)

    scopes = demo_scopes(user)
    jobs = [job_of(rt.store, user, s.kind, s.subject) for s in scopes]
    assert all(j is not None and (j.status, j.attempts) == (Status.DONE, 1) for j in jobs), jobs
    # Queued in one transaction: one reading of the store's clock, a
    # microsecond apart in the order given.
    created = [j.created_at for j in jobs if j is not None]
    assert [(t - created[0]) for t in created] == [
        dt.timedelta(microseconds=n) for n in range(len(scopes))
    ]
    # It drained them itself, one call at a time, each answered once.
    assert sorted(gateway.served()) == sorted(f"{s.kind}:{s.subject}" for s in scopes)
    assert all(answers(gateway, f"{s.kind}:{s.subject}") == 1 for s in scopes)
    gateway.assert_kept(concurrency=1, gap=GAP)

    artifacts = prefect.artifacts(run_id)
    key = f"backfill-{who}"
    progress = artifacts[f"{key}-progress"]
    assert progress["type"] == "progress" and float(progress["data"]) == 100.0
    table = artifacts[f"{key}-scopes"]
    assert table["type"] == "table"
    rows = table_rows(table)
    assert [(r["kind"], r["subject"], r["status"]) for r in rows] == [
        (s.kind, s.subject, "done") for s in scopes
    ]
    for row, job in zip(rows, jobs, strict=True):
        assert job is not None and job.flow_run_id
        assert row["generated_by"].endswith(f"/runs/flow-run/{job.flow_run_id}"), row

    runs = generation_runs(prefect, who, settled=len(scopes))
    assert len(runs) == len(scopes)
    by_name = {r["name"]: r for r in runs}
    for scope, job in zip(scopes, jobs, strict=True):
        assert job is not None
        generation = by_name[f"{scope.kind}:{scope.subject}"]
        assert generation["id"] == job.flow_run_id
        assert prefect.flow_name(generation) == "generate"
        assert set(generation["tags"]) == {
            "insight-queue",  # what the automations that end a lost machine's runs match
            "generation",
            f"user:{who}",  # the pseudonym: Prefect never sees the user's id (D4)
            f"kind:{scope.kind}",
            "priority:prefetch",
            "attempt:1",
        }
        assert state_of(generation)[0] == "COMPLETED"
        assert generation["parameters"]["user"] == who
        assert user not in json.dumps(generation)


def test_a_backfill_with_a_broken_scope_fails_naming_it_and_its_attempts_fail_honestly(
    settings: Settings, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    # Users named `seven-and-one-*` have seven scopes that work and one that never can.
    user = f"seven-and-one-{user}"
    with Runtime.open(
        settings_for(**{**settings.model_dump(), "plugins": "tests.support.plugins"})
    ) as rt:
        state = run_flow(rt, backfilled(rt, user))
        broken = job_of(rt.store, user, "broken", "day-8")
        who = pseudonym(rt, user)
    assert (state.type.value, state.message) == ("FAILED", "7 done, 1 failed")
    assert broken is not None and (broken.status, broken.attempts) == (Status.FAILED, 3)
    assert broken.error is not None and "no data for day-8" in broken.error
    # Its prompt could never be built: the gateway never heard of it.
    assert gateway.calls_for("broken:day-8") == 0
    assert len(gateway.served()) == 7

    rows = table_rows(prefect.artifacts(run_id_of(state))[f"backfill-{who}-scopes"])
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["subject"] == "day-8" and failed[0]["attempts"] == 3
    # The generator's own words may quote a person's data: the store keeps them (D4).
    assert "generator 'broken' failed building the prompt" in failed[0]["error"]
    assert "no data for day-8" not in failed[0]["error"]

    runs = generation_runs(prefect, who, settled=10)
    attempts = sorted((r for r in runs if r["name"] == "broken:day-8"), key=lambda r: r["tags"])
    assert [t for r in attempts for t in r["tags"] if t.startswith("attempt:")] == [
        "attempt:1",
        "attempt:2",
        "attempt:3",
    ]
    for attempt in attempts:
        kind, message = state_of(attempt)
        assert kind == "FAILED" and "\n" not in message and "RuntimeError" in message
        assert "no data for day-8" not in message
        assert {"generation", f"user:{who}", "kind:broken", "priority:prefetch"} <= set(
            attempt["tags"]
        )
        logs = prefect.logs(attempt["id"])
        assert logs and not [line for line in logs if "Traceback" in line], logs
        assert not [line for line in logs if "no data for day-8" in line], logs
    assert state_of(attempts[-1])[1].startswith("failed, attempts spent")

    # The operator's view of the user's queue names the failure too.
    listed = json.loads(run_cli("jobs", "--user", user, "--json", env=settings.to_env()).stdout)
    assert (listed[0]["kind"], listed[0]["status"]) == ("broken", "failed")
    assert "no data for day-8" in listed[0]["error"]


def test_a_screen_s_run_ends_with_its_story_linking_to_the_generation_run(
    rt: Runtime, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    scope = demo_scopes(user)[0]
    state = run_flow(rt, screened(rt, user, scope.kind, scope.subject, scope.fingerprint))
    job = job_of(rt.store, user, scope.kind, scope.subject)
    assert job is not None and job.status == Status.DONE and job.flow_run_id
    assert state.type.value == "COMPLETED"
    message = state.message or ""
    assert re.fullmatch(rf"served in [0-9.]+ s by generation run {job.flow_run_id}", message)
    story = prefect.artifacts(run_id_of(state))[f"screen-{scope.kind.replace('_', '-')}"]
    assert story["type"] == "markdown"
    assert f"/runs/flow-run/{job.flow_run_id}" in story["data"]
    assert f"[{scope.kind}:{scope.subject}]" in story["data"]

    (generation,) = generation_runs(prefect, pseudonym(rt, user), settled=1)
    assert generation["id"] == job.flow_run_id
    assert generation["name"] == f"{scope.kind}:{scope.subject}"
    assert "priority:interactive" in generation["tags"]
    assert state_of(generation)[0] == "COMPLETED"
    assert answers(gateway, f"{scope.kind}:{scope.subject}") == 1


def test_a_screen_s_job_is_the_next_call_while_a_backfill_drains(
    rt: Runtime, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    recorder = gateway.recorder
    assert recorder is not None
    scopes = demo_scopes(user)
    target = next(s for s in scopes if s.kind == "recovery")  # queued sixth of eight
    # The backfill's first call is held at the gateway until the screen has asked.
    gateway.simulator.set_fault("hang", requests=1)

    async def both() -> tuple[State[Any], State[Any]]:
        filling = asyncio.create_task(backfilled(rt, user))
        await asyncio.to_thread(recorder.wait_until, lambda s: s.in_flight == 1, 60, "a call")
        screen = asyncio.create_task(
            screened(rt, user, target.kind, target.subject, target.fingerprint)
        )

        def promoted() -> bool:
            job = job_of(rt.store, user, target.kind, target.subject)
            return job is not None and job.priority == INTERACTIVE

        await asyncio.to_thread(wait_for, promoted, 60, "the screen's job at the front")
        gateway.simulator.clear_fault()
        return await filling, await screen

    filled, screen = run_flow(rt, both())
    assert filled.type.value == "COMPLETED" and screen.type.value == "COMPLETED"
    order = gateway.served()
    assert order[1] == f"{target.kind}:{target.subject}", order
    assert all(answers(gateway, f"{s.kind}:{s.subject}") == 1 for s in scopes)
    gateway.assert_kept(concurrency=1, gap=GAP)


def test_with_a_consumer_standing_by_the_flows_only_follow(
    rt: Runtime,
    settings: Settings,
    gateway: Gateway,
    prefect: PrefectReader,
    user: str,
    tmp_path: Path,
) -> None:
    with Workers(settings, tmp_path).running() as workers:
        workers.start("standby")
        wait_for(lambda: bool(standing_by(rt.store)), 30, "the consumer standing by")
        filled = run_flow(rt, backfilled(rt, user))
        screen = run_flow(rt, screened(rt, user, "ok", "on-screen"))
        summary = workers.stop("standby")

    assert (filled.type.value, filled.message) == ("COMPLETED", "8 done")
    assert screen.type.value == "COMPLETED"
    assert summary["outcomes"] == {"done": 9}, summary
    # The consumer made every call; the flows wrote no generation of their
    # own (a flow that drains records each attempt as a run).
    who = pseudonym(rt, user)
    assert prefect.runs_tagged("generation", f"user:{who}") == []
    rows = table_rows(prefect.artifacts(run_id_of(filled))[f"backfill-{who}-scopes"])
    assert [r["status"] for r in rows] == ["done"] * 8
    assert len(gateway.served()) == 9
    gateway.assert_kept(concurrency=1, gap=GAP)


def test_an_outage_spends_no_attempt_and_the_drain_recovers(
    rt: Runtime, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    for n in range(3):
        rt.store.enqueue(user, "ok", f"s{n}")
    gateway.simulator.set_fault("status", status=503, requests=3)
    summary = run_flow(rt, drained())

    statuses = [
        r.status for r in sorted(gateway.simulator.stats().requests, key=lambda r: r.received)
    ]
    assert statuses == [503, 503, 503, 200, 200, 200], statuses
    for n in range(3):
        job = job_of(rt.store, user, "ok", f"s{n}")
        assert job is not None and (job.status, job.attempts) == (Status.DONE, 1), job
    assert rt.store.gate_state().outages_in_a_row == 0
    assert summary["outcomes"] == {"released": 3, "done": 3}, summary
    gateway.assert_kept(concurrency=1, gap=GAP)


def test_three_drains_at_once_never_overlap_at_the_gateway(
    settings: Settings, gateway: Gateway, prefect: PrefectReader, tmp_path: Path
) -> None:
    with store_for(settings) as store:
        for n in range(12):
            store.enqueue(f"user-{n % 4}", "ok", f"s{n:02d}")
        env = {
            **settings.to_env(),
            "PYTHONPATH": str(ROOT),
            "PREFECT_API_URL": prefect.api_url,
            "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        }
        logs = [tmp_path / f"drain-{n}.log" for n in range(3)]
        with (
            running(cli("drain"), env, logs[0]) as first,
            running(cli("drain"), env, logs[1]) as second,
            running(cli("drain"), env, logs[2]) as third,
        ):
            for process in (first, second, third):
                assert process.wait(180) == 0
        # A drain that found another holding the gateway leaves; whoever was
        # last may have left work for the next one.
        if pending(store):
            run_cli("drain", env=env, timeout=180)
        jobs = [job_of(store, f"user-{n % 4}", "ok", f"s{n:02d}") for n in range(12)]
    assert all(j is not None and (j.status, j.attempts) == (Status.DONE, 1) for j in jobs), jobs
    assert sorted(gateway.served()) == sorted(f"ok:s{n:02d}" for n in range(12))
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    assert seen.count == 12


def test_a_takeover_ends_the_lost_attempt_s_run_though_its_worker_never_wrote_the_run_s_id(
    make_store: StoreFactory, clock: FakeClock, prefect: PrefectReader, user: str
) -> None:
    """W3: a worker killed after its attempt's run was recorded, before the job row named it.
    The takeover's claim is attempt 1 again (H2) with no run id in the row; the lost claim the
    store counted is what sends the new attempt's writer to end the old run."""
    store = make_store(lease_seconds=10, gateway={"cut_hold_seconds": 0})
    store.enqueue(user, "sleep", "d1")
    lost = store.claim_next("w1").job
    assert lost is not None and lost.holder and store.heartbeat(lost.id, lost.holder, calling=True)
    redactor = Redactor([])  # nothing secret in these settings

    async def record(worker: str, job: Job) -> str | None:
        ledger = PrefectLedger(worker, redactor, generate)
        entry = ledger.open(job)
        await ledger.flush()
        return await entry.run_id()

    first = asyncio.run(record("w1", lost))  # then w1 dies: no close, no set_flow_run
    assert first is not None
    clock.advance(11)  # past the lease: the next claim takes the job back
    taken = store.claim_next("w2").job
    assert taken is not None and taken.id == lost.id, taken
    assert (taken.attempts, taken.flow_run_id, taken.losses) == (1, None, 1), taken
    second = asyncio.run(record("w2", taken))
    assert second is not None and second != first
    state, message = state_of(prefect.run(first))
    assert (state, message) == (
        "CRASHED",
        "its worker stopped while this attempt was in flight; the job was taken over",
    )
    assert state_of(prefect.run(second))[0] == "RUNNING"


def test_setup_limit_updates_the_gateway_limit(settings: Settings, prefect: PrefectReader) -> None:
    """`setup-limit` sets the `gateway` tag limit (the fixture made it 1) to AI_JOB_CONCURRENCY."""
    env = {**settings.to_env(), "PREFECT_API_URL": prefect.api_url, "AI_JOB_CONCURRENCY": "2"}
    shown = run_cli("setup-limit", env=env).stdout
    assert shown.startswith("gateway limit 2; slots counted 0, held by task runs 0"), shown
    response = httpx.get(f"{prefect.api_url}/concurrency_limits/tag/gateway", timeout=10)
    response.raise_for_status()
    assert response.json()["concurrency_limit"] == 2


def test_d3_forget_with_prefect_away_erases_the_store_at_once_and_the_history_once_it_is_back(
    rt: Runtime, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    from deployments.processes import free_port
    from deployments.triggers import Triggers

    other = f"{user}-other"
    run_flow(rt, backfilled(rt, user, tagged=True))
    run_flow(rt, backfilled(rt, other, tagged=True))
    who, who_else = pseudonym(rt, user), pseudonym(rt, other)
    generation_runs(prefect, who, settled=8)
    runs = prefect.runs_tagged(f"user:{who}")
    assert len(runs) == 9  # the backfill and its 8 generations
    backfill_run = next(str(r["id"]) for r in runs if str(r["name"]).startswith("backfill"))
    assert prefect.artifacts(backfill_run)
    assert prefect.logs(backfill_run)

    away = Triggers(rt, prefect_url=f"http://127.0.0.1:{free_port()}/api").forget(user)

    # The store's part at once; the history's waits, and says so.
    assert away.forgotten.jobs == 8 and away.forgotten.results == 8
    assert away.forgotten.history_pending == (who,)
    assert away.history_note and "could not be erased now" in away.history_note
    assert rt.store.list_jobs(user) == []
    assert [p for p, _ in rt.store.queue_view(0).erasures_pending] == [who]
    assert len(prefect.runs_tagged(f"user:{who}")) == 9

    back = Triggers(rt, prefect_url=prefect.api_url).forget(user)  # again, Prefect back

    assert (back.forgotten.jobs, back.history_note, back.forgotten.history_pending) == (
        0,
        None,
        (),
    )
    assert prefect.runs_tagged(f"user:{who}") == []
    assert prefect.artifacts(backfill_run) == {}
    # Prefect deletes a deleted run's logs in a background task of its own.
    wait_for(lambda: prefect.logs(backfill_run) == [], 30, "the erased run's logs gone")
    assert rt.store.queue_view(0).erasures_pending == []
    # The other user's history and store are what they were.
    assert len(prefect.runs_tagged(f"user:{who_else}")) == 9
    assert len(rt.store.list_jobs(other)) == 8


def test_d2_the_prune_run_deletes_what_is_past_retention_and_finishes_a_forget_prefect_missed(
    settings: Settings, gateway: Gateway, prefect: PrefectReader, user: str
) -> None:
    """The scheduled prune (its flow, run here): the store's part of retention with its counts
    as the run's result, and the run history's part of a forget made while Prefect was away."""
    from deployments.processes import free_port
    from deployments.triggers import Triggers
    from flows.flows import prune

    short = settings.model_copy(update={"retention_days": 1e-6})  # a tenth of a second
    with Runtime.open(short) as rt:
        run_flow(rt, backfilled(rt, user, tagged=True))
        forgotten = f"{user}-gone"
        run_flow(rt, backfilled(rt, forgotten, tagged=True))
        gone = pseudonym(rt, forgotten)
        generation_runs(prefect, gone, settled=8)
        away = Triggers(rt, prefect_url=f"http://127.0.0.1:{free_port()}/api").forget(forgotten)
        assert away.forgotten.history_pending == (gone,)
        assert len(prefect.runs_tagged(f"user:{gone}")) == 9

        state = run_flow(rt, cast(Coroutine[Any, Any, State[Any]], prune(return_state=True)))

        assert state.type.value == "COMPLETED"
        shown = state.result()
        # Usage is kept by the day: today's stays, and with it the user is still known.
        assert (shown["jobs"], shown["results"], shown["people"]) == (8, 8, 0)
        assert (shown["forgotten_users_erased"], shown["erasures_left"]) == (1, 0)
        assert rt.store.list_jobs(user) == []
        assert prefect.runs_tagged(f"user:{gone}") == []
        wait_for(
            lambda: any("retention:" in line for line in prefect.logs(run_id_of(state))),
            30,
            "the prune run's log line with its counts",
        )
