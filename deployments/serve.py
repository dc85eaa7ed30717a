"""`insight-queue serve`: the embedded default, from one laptop to one server.

Starts (or reuses) a local Prefect server, prepares the store and the
`gateway` limit, and serves three deployments from this process:

- `backfill/insight-queue`: what the post-sync hook triggers;
- `interactive/insight-queue`: what a screen triggers;
- `drain/insight-queue`: the safety net, on a schedule: picks up whatever is
  runnable when no trigger will (a cooldown ran out, a trigger was lost while
  Prefect was down, a consumer died).

Prefect must be configured through the environment before it is imported,
so this module imports it only inside `serve`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deployments.embedded import DEFAULT_PORT, EmbeddedServer, is_healthy
from deployments.triggers import DEPLOYMENT
from queue_store import JobStore, Settings, migrate

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

logger = logging.getLogger(__name__)

SAFETY_NET_SECONDS = 60
# The runner looks for new flow runs this often (Prefect's default is 10 s,
# which would be most of a screen's wait).
RUNNER_POLL_SECONDS = 1
# Flow runs this process may run at once: a backfill draining, a few
# interactive runs that find the gateway busy and leave, the safety net.
RUN_LIMIT = 10


@dataclass(frozen=True)
class ServeOptions:
    prefect_port: int = DEFAULT_PORT
    upgrade: bool = True
    safety_net_seconds: int = SAFETY_NET_SECONDS
    ui: bool = True


def prefect_home(settings: Settings) -> Path:
    return settings.data_dir / "prefect"


def configure_client(api_url: str, home: Path) -> None:
    """Point this process, and the flow runs it starts, at one Prefect server."""
    os.environ["PREFECT_API_URL"] = api_url
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", str(RUNNER_POLL_SECONDS))


def prepare(settings: Settings, upgrade: bool) -> None:
    """The store's schema, the `gateway` limit, leaked slots and dead claims."""
    from flows.limits import ensure_gateway_limit, repair_gateway_slots

    if upgrade:
        migrate.upgrade(settings.database_url)
    ensure_gateway_limit(settings.concurrency)
    check = repair_gateway_slots()
    if check.repaired:
        logger.warning("gateway slots: %d counted, %d live; repaired", check.counted, check.live)
    with JobStore(settings.database_url, settings=settings) as store:
        released = store.recover()
    if released:
        logger.warning("released %d claim(s) left by dead workers", released)


def runner_deployments(options: ServeOptions) -> list[RunnerDeployment]:
    from prefect.deployments.runner import RunnerDeployment

    from flows.flows import backfill, drain, interactive

    return [
        RunnerDeployment.from_flow(
            backfill, name=DEPLOYMENT, tags=["insight-queue"], description=backfill.description
        ),
        RunnerDeployment.from_flow(
            interactive,
            name=DEPLOYMENT,
            tags=["insight-queue"],
            description=interactive.description,
        ),
        RunnerDeployment.from_flow(
            drain,
            name=DEPLOYMENT,
            tags=["insight-queue", "safety-net"],
            interval=options.safety_net_seconds,
            # Each safety-net run stands by until the next one starts, so a
            # consumer is running when a screen opens: its job is claimed
            # within a fraction of a second instead of after a new flow run's
            # process has started.
            parameters={"standby_seconds": options.safety_net_seconds},
            description=drain.description,
        ),
    ]


def serve(settings: Settings, options: ServeOptions) -> None:
    """Run until interrupted; stops the Prefect server if it started one."""
    server: EmbeddedServer | None = None
    api_url = os.environ.get("PREFECT_API_URL")
    if not api_url:
        server = EmbeddedServer(prefect_home(settings), options.prefect_port, ui=options.ui)
        server.start()
        api_url = server.api_url
    elif not is_healthy(api_url):
        raise RuntimeError(f"PREFECT_API_URL={api_url} does not answer")
    configure_client(api_url, prefect_home(settings))
    try:
        prepare(settings, options.upgrade)
        from prefect import serve as prefect_serve

        print(f"insight-queue serving; Prefect UI at {api_url.removesuffix('/api')}", flush=True)
        prefect_serve(*runner_deployments(options), limit=RUN_LIMIT, print_starting_message=False)
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()
