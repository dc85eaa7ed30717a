"""W3 (a run of a dead machine ends) against a real Prefect server of its own.

The automations `deploy` makes are put on the server with their 90 s window
cut to 10 s (Prefect's least), which is why the server is this test's alone.
The heartbeats are this test's events, sent as Prefect's engine sends them
(on the flow run, related to its tags), since the engine beats every 30 s at
the most often. A run that is killed as it starts has the server's Running
event and nothing after it: it must end as one that stopped beating does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.objects import StateType
from prefect.events.clients import EventsClient, get_events_client
from prefect.events.schemas.events import Event
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Pending, Running

from deployments import deploy
from deployments.processes import free_port
from flows.history import PROJECT_TAG
from tests.support.services import PrefectServer

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

WINDOW = 10.0  # the automations' window here: Prefect's least (90 s in `deploy`)
# Time for the window to pass, and for Prefect to see it pass (its proactive
# triggers are checked every 5 s), with room for a busy machine.
PATIENCE = 120.0


@flow(name="lost-run-probe")
def probe() -> None:
    """Never run: its runs are made and moved by hand."""


@pytest.fixture
def api_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(deploy, "CRASH_AFTER_SECONDS", WINDOW)
    server = PrefectServer(tmp_path / "prefect", free_port(), ui=False).start()
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            # No consumer event comes here: the drain automation's deployment is never run.
            deploy.ensure_automations(str(uuid.uuid4()))
            yield server.api_url
    finally:
        server.stop()


async def started(client: PrefectClient, tags: list[str]) -> uuid.UUID:
    run = await client.create_flow_run(probe, tags=tags, state=Pending())
    await client.set_flow_run_state(run.id, Running())
    return run.id


def heartbeat(run_id: uuid.UUID, tags: list[str]) -> Event:
    return Event.model_validate(
        {
            "event": "prefect.flow-run.heartbeat",
            "resource": {"prefect.resource.id": f"prefect.flow-run.{run_id}"},
            "related": [
                {"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}
                for tag in tags
            ],
        }
    )


def test_a_run_that_stops_beating_or_never_beat_is_crashed_and_a_beating_one_is_not(
    api_url: str,
) -> None:
    asyncio.run(_lose_runs())


async def _lose_runs() -> None:
    async with get_client() as client, get_events_client() as events:
        await _lose_runs_on(client, events)


async def _lose_runs_on(client: PrefectClient, events: EventsClient) -> None:
    ours = [PROJECT_TAG, "user:p-test"]
    silent = await started(client, ours)  # killed as it started: no heartbeat ever
    once = await started(client, ours)  # killed after its first heartbeat
    beating = await started(client, ours)  # alive all along
    foreign = await started(client, ["another-project"])  # not ours: never touched

    async def state(run_id: uuid.UUID) -> StateType | None:
        run = await client.read_flow_run(run_id)
        return None if run.state is None else run.state.type

    await events.emit(heartbeat(once, ours))
    deadline = time.monotonic() + PATIENCE
    crashed_at: float | None = None
    # Beat until both lost runs are crashed, then for a window and a check more.
    while crashed_at is None or time.monotonic() < crashed_at + WINDOW + 6:
        await events.emit(heartbeat(beating, ours))
        if crashed_at is None:
            lost = {"silent": await state(silent), "once": await state(once)}
            if set(lost.values()) == {StateType.CRASHED}:
                crashed_at = time.monotonic()
            assert crashed_at is not None or time.monotonic() < deadline, lost
        await asyncio.sleep(1)

    for run_id in (silent, once):
        run = await client.read_flow_run(run_id)
        assert run.state is not None and run.state.message is not None
        assert run.state.message.startswith("its machine was lost"), run.state.message
    assert await state(beating) == StateType.RUNNING
    assert await state(foreign) == StateType.RUNNING
