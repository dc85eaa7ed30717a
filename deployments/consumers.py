"""The commands of a machine beside Prefect: `worker`, `consume`, `drain`, `setup-limit`. They
import Prefect when they run, never at module level."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable

import click

from deployments import processes, table
from deployments.cli import command, open_store, settings_from
from deployments.prefect_api import api_url
from deployments.stack import executable
from queue_store import Settings

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
    # The processes this command starts inherit it.
    os.environ["PREFECT_API_URL"] = url
    os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "false")


def _stand_by(settings: Settings, beside: Callable[[], None] | None = None) -> None:
    """A warm consumer until SIGTERM, SIGINT or SIGHUP; `beside` runs once it stands by."""
    from flows.flows import prefect_consumer
    from flows.runtime import Runtime

    _require_prefect(settings)
    runtime = Runtime.open(settings)
    runtime.redact_logs()
    consumer, ledger = prefect_consumer(runtime, "consumer", standby=True)

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


@command("consume")
def consume_command(ctx: click.Context) -> None:
    """Stand by and run queued jobs until SIGTERM, SIGINT or SIGHUP (a warm consumer beside
    Prefect workers, reporting to PREFECT_API_URL); a stop hands the job in flight back."""
    _stand_by(settings_from(ctx))


@command("worker")
@click.option("--pool", default=table.POOL, show_default=True, help="the process work pool")
@click.option(
    "--limit", type=click.IntRange(1), default=None, help="flow runs of the pool at once here"
)
def worker_command(ctx: click.Context, pool: str, limit: int | None) -> None:
    """One machine of a work pool: Prefect's process worker for the pool's runs, and a warm
    consumer beside it. SIGTERM, SIGINT or SIGHUP stop both, the job in flight handed back."""
    started: list[subprocess.Popen[bytes]] = []

    def start_worker() -> None:
        args = [executable("prefect"), "worker", "start", "--pool", pool, "--type", "process"]
        env = {"PREFECT_WORKER_QUERY_SECONDS": WORKER_QUERY_SECONDS, **os.environ}
        started.append(
            processes.start([*args, *(["--limit", str(limit)] if limit else [])], env=env)
        )

    try:
        _stand_by(settings_from(ctx), beside=start_worker)
    finally:
        for process in started:
            processes.interrupt_group(process)


@command("drain")
@click.option("--max-jobs", type=click.IntRange(1), default=None, help="stop after this many")
def drain_command(ctx: click.Context, max_jobs: int | None) -> None:
    """Run queued jobs in priority order until nothing is runnable (as a `drain` flow run)."""
    _require_prefect(settings_from(ctx))
    with open_store(ctx, write=True) as store:
        standing = store.gate_state().standing_by
    if standing:
        click.echo(f"a consumer is standing by ({', '.join(standing)}): it takes queued work")
        return
    from flows.flows import drain

    click.echo(json.dumps(asyncio.run(drain(max_jobs)), indent=2, default=str))


@command("setup-limit")
@click.option(
    "--repair",
    is_flag=True,
    help="give back slots counted as taken but held by no task run (only with no consumer alive)",
)
def setup_limit_command(ctx: click.Context, repair: bool) -> None:
    """Create or update the `gateway` tag concurrency limit to AI_JOB_CONCURRENCY.

    A Prefect server with in-memory leases forgets who holds slots when it restarts, but not
    that they are taken: `--repair` sets the count back. It refuses while a consumer is alive:
    a consumer's slot has no task run, so Prefect cannot tell it from such a leak.
    """
    from flows.limits import ensure_gateway_limit, repair_gateway_slots

    settings = settings_from(ctx)
    _require_prefect(settings)
    limit = ensure_gateway_limit(settings.concurrency)
    if repair:
        with open_store(ctx, write=True) as store:
            alive = list(store.gate_state().workers)
        if alive:
            raise click.ClickException(
                f"consumers are alive ({', '.join(alive)}): their slots would be given back too"
            )
    check = repair_gateway_slots(repair=repair)
    state = "; repaired" if check.repaired else ""
    held = f"held by task runs {check.live}{state}"
    click.echo(f"gateway limit {limit}; slots counted {check.counted}, {held}")
