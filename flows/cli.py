"""Commands that run the flows in this process: `drain`, `backfill`, `interactive`.

Each run is reported to the Prefect server named by `PREFECT_API_URL` and
shows in its UI. Prefect is imported inside the commands so the store's
verbs stay quick.
"""

from __future__ import annotations

import json

import click

from flows.simulator import gateway_sim_command


def _echo(value: object) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


@click.command("drain")
@click.option("--max-jobs", type=click.IntRange(1), default=None, help="stop after this many")
@click.option(
    "--standby",
    type=click.FloatRange(0),
    default=0.0,
    help="then stand by this many seconds for new work",
)
def drain_command(max_jobs: int | None, standby: float) -> None:
    """Run queued jobs in priority order until nothing is runnable."""
    from flows.flows import drain

    _echo(drain(max_jobs, standby))


@click.command("backfill")
@click.argument("user_id")
@click.option("--no-drain", is_flag=True, help="only queue the scopes")
def backfill_command(user_id: str, no_drain: bool) -> None:
    """Queue every scope of USER_ID at prefetch priority, then drain (in this process)."""
    from flows.flows import backfill

    _echo(backfill(user_id, drain_after=not no_drain))


@click.command("interactive")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.option("--fingerprint", default=None)
def interactive_command(user_id: str, kind: str, subject: str, fingerprint: str | None) -> None:
    """Promote one insight to the front, then drain (in this process)."""
    from flows.flows import interactive

    _echo(interactive(user_id, kind, subject, fingerprint))


@click.command("setup-limit")
def setup_limit_command() -> None:
    """Create or update the `gateway` tag concurrency limit to AI_JOB_CONCURRENCY."""
    from flows.limits import ensure_gateway_limit, repair_gateway_slots
    from queue_store import Settings

    limit = ensure_gateway_limit(Settings.from_env().concurrency)
    check = repair_gateway_slots()
    click.echo(f"gateway limit {limit}; slots counted {check.counted}, live {check.live}")


COMMANDS: list[click.Command] = [
    drain_command,
    backfill_command,
    interactive_command,
    setup_limit_command,
    gateway_sim_command,
]
