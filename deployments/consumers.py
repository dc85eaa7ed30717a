"""Commands that run consumers and flows in this process: `consume`, `drain`, `setup-limit`.

Prefect is imported inside the commands, never at module level, so the
store's verbs start without it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import click

from deployments.prefect_api import api_url
from queue_store import JobStore, Settings
from queue_store.cli import fails_cleanly, settings_from


def _echo(value: object) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


def _require_prefect(settings: Settings) -> None:
    url = api_url(settings)
    if url is None:
        raise click.ClickException(
            "no Prefect server: set PREFECT_API_URL, or run `insight-queue serve` "
            "for this data directory"
        )
    os.environ["PREFECT_API_URL"] = url
    os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "false")


@click.command("consume")
@click.pass_context
@fails_cleanly
def consume_command(ctx: click.Context) -> None:
    """Stand by and run queued jobs until stopped (a warm consumer beside Prefect workers).

    Every attempt goes to the run history of the Prefect server named by
    PREFECT_API_URL, and holds a `gateway` slot. SIGTERM, SIGINT or SIGHUP stop
    it: the call in flight is stopped and its job handed back.
    """
    from flows.consumer import worker_name
    from flows.flows import generate
    from flows.guard import PrefectSlotGuard
    from flows.history import PrefectLedger
    from flows.runtime import Runtime

    settings = settings_from(ctx)
    _require_prefect(settings)
    runtime = Runtime.open(settings)
    runtime.redact_logs()
    worker = worker_name("consumer")
    ledger = PrefectLedger(worker, runtime.redactor, generate)
    consumer = runtime.consumer(
        standby=True, ledger=ledger, guard=PrefectSlotGuard(), worker=worker
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, consumer.stop, signum.name)
        try:
            await consumer.run()
        finally:
            await ledger.flush(timeout=5.0)

    click.echo(f"{worker} standing by; Ctrl-C stops it", err=True)
    asyncio.run(main())
    click.echo(json.dumps(consumer.summary.as_dict()))


@click.command("drain")
@click.option("--max-jobs", type=click.IntRange(1), default=None, help="stop after this many")
@click.pass_context
@fails_cleanly
def drain_command(ctx: click.Context, max_jobs: int | None) -> None:
    """Run queued jobs in priority order until nothing is runnable (as a `drain` flow run)."""
    from flows.consumer import standing_by

    settings = settings_from(ctx)
    _require_prefect(settings)
    with JobStore(settings.database_url, settings=settings) as store:
        standing = standing_by(store)
    if standing:
        click.echo(f"a consumer is standing by ({', '.join(standing)}): it takes queued work")
        return
    from flows.flows import drain

    _echo(asyncio.run(drain(max_jobs)))


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
            alive = [w.name for w in store.workers() if w.alive]
        if alive:
            raise click.ClickException(
                f"consumers are alive ({', '.join(alive)}): their slots would be given back too"
            )
    check = repair_gateway_slots(repair=repair)
    state = "; repaired" if check.repaired else ""
    held = f"held by task runs {check.live}{state}"
    click.echo(f"gateway limit {limit}; slots counted {check.counted}, {held}")
