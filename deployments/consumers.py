"""The commands of a machine beside Prefect: `worker`, `consume`, `drain`, `setup-limit`.

Prefect is imported inside the commands, never at module level, so the
store's verbs start without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable

import click

from deployments import processes, table
from deployments.cli import fails_cleanly, settings_from
from deployments.prefect_api import api_url
from deployments.stack import executable
from queue_store import JobStore, Settings

# How often a machine's worker looks for flow runs (Prefect's default is 10 s):
# a drain that a lost machine's work needs starts within seconds.
WORKER_QUERY_SECONDS = "2"


def _require_prefect(settings: Settings) -> None:
    url = api_url(settings)
    if url is None:
        raise click.ClickException(
            "no Prefect server: set PREFECT_API_URL, or run `insight-queue serve` "
            "for this data directory"
        )
    processes.export_to_children(
        overrides={"PREFECT_API_URL": url}, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false"
    )


def _stand_by(settings: Settings, role: str, beside: Callable[[], None] | None = None) -> None:
    """A warm consumer in this process until SIGTERM, SIGINT or SIGHUP; `beside` runs
    once it stands by (in a thread of its own, stopped by the caller's own means)."""
    from flows.flows import prefect_consumer
    from flows.runtime import Runtime

    _require_prefect(settings)
    runtime = Runtime.open(settings)
    runtime.redact_logs()
    consumer, ledger = prefect_consumer(runtime, role, standby=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, consumer.stop, signum.name)
        try:
            await consumer.run()
        finally:
            await ledger.flush(timeout=5.0)

    click.echo(f"{consumer.worker} standing by; Ctrl-C stops it", err=True)
    try:
        if beside is not None:
            beside()
        asyncio.run(main())
    finally:
        runtime.close()
    click.echo(json.dumps(consumer.summary.as_dict()))


@click.command("consume")
@click.pass_context
@fails_cleanly
def consume_command(ctx: click.Context) -> None:
    """Stand by and run queued jobs until stopped (a warm consumer beside Prefect workers).

    Every attempt goes to the run history of the Prefect server named by
    PREFECT_API_URL, and holds a `gateway` slot. SIGTERM, SIGINT or SIGHUP stop
    it: the call in flight is stopped and its job handed back.
    """
    _stand_by(settings_from(ctx), "consumer")


@click.command("worker")
@click.option("--pool", default=table.POOL, show_default=True, help="the process work pool")
@click.option(
    "--limit", type=click.IntRange(1), default=None, help="flow runs of the pool at once here"
)
@click.pass_context
@fails_cleanly
def worker_command(ctx: click.Context, pool: str, limit: int | None) -> None:
    """One machine of a work pool: Prefect's process worker, and a warm consumer beside it.

    The consumer takes a screen's job within a fraction of a second, and the
    jobs a lost machine left once their lease runs out; the worker runs the
    pool's flow runs (backfills following their jobs, drains). SIGTERM, SIGINT
    or SIGHUP stop both: the call in flight is stopped and its job handed
    back, and the worker stops with its runs.
    """
    settings = settings_from(ctx)
    started: list[subprocess.Popen[bytes]] = []

    def start_worker() -> None:
        command = [executable("prefect"), "worker", "start", "--pool", pool, "--type", "process"]
        env = {"PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS, **os.environ}
        started.append(
            processes.start([*command, *(["--limit", str(limit)] if limit else [])], env=env)
        )

    try:
        _stand_by(settings, "consumer", beside=start_worker)
    finally:
        for process in started:
            processes.interrupt_group(process)


@click.command("drain")
@click.option("--max-jobs", type=click.IntRange(1), default=None, help="stop after this many")
@click.pass_context
@fails_cleanly
def drain_command(ctx: click.Context, max_jobs: int | None) -> None:
    """Run queued jobs in priority order until nothing is runnable (as a `drain` flow run)."""
    settings = settings_from(ctx)
    _require_prefect(settings)
    with JobStore(settings.database_url, settings=settings) as store:
        standing = store.gate_state().standing_by
    if standing:
        click.echo(f"a consumer is standing by ({', '.join(standing)}): it takes queued work")
        return
    from flows.flows import drain

    click.echo(json.dumps(asyncio.run(drain(max_jobs)), indent=2, default=str))


@click.command("setup-limit")
@click.option(
    "--repair",
    is_flag=True,
    help="give back slots counted as taken but held by no task run (only with no consumer alive)",
)
@click.pass_context
@fails_cleanly
def setup_limit_command(ctx: click.Context, repair: bool) -> None:
    """Create or update the `gateway` tag concurrency limit to AI_JOB_CONCURRENCY.

    A Prefect server with in-memory leases forgets who holds slots when it
    restarts, but not that they are taken: `--repair` sets the count back.
    A consumer's slot has no task run, so Prefect cannot tell it from such a
    leak: `--repair` refuses while any consumer says it is alive.
    """
    from flows.limits import ensure_gateway_limit, repair_gateway_slots

    settings = settings_from(ctx)
    _require_prefect(settings)
    limit = ensure_gateway_limit(settings.concurrency)
    if repair:
        with JobStore(settings.database_url, settings=settings) as store:
            alive = list(store.gate_state().workers)
        if alive:
            raise click.ClickException(
                f"consumers are alive ({', '.join(alive)}): their slots would be given back too"
            )
    check = repair_gateway_slots(repair=repair)
    state = "; repaired" if check.repaired else ""
    held = f"held by task runs {check.live}{state}"
    click.echo(f"gateway limit {limit}; slots counted {check.counted}, {held}")
