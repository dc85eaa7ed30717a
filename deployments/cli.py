"""The `insight-queue` command: the store's verbs plus serving, triggers and tools."""

from __future__ import annotations

import json
import logging

import click

from deployments.embedded import DEFAULT_PORT
from flows.cli import COMMANDS as FLOW_COMMANDS
from queue_store import Settings
from queue_store.cli import COMMANDS, fails_cleanly, settings_help


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="\b\nSettings (environment variables):\n" + settings_help(),
)
@click.option(
    "--database-url",
    default=None,
    metavar="URL",
    help="store URL (overrides AI_JOB_DATABASE_URL; default: SQLite in the data dir)",
)
@click.option("-v", "--verbose", is_flag=True, help="log at INFO level")
def main(database_url: str | None, verbose: bool) -> None:
    """insight-queue: slow, scarce LLM work for an app's screens, in priority order."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _settings(ctx: click.Context) -> Settings:
    url = ctx.find_root().params.get("database_url")
    return Settings.from_env(**({"database_url": url} if url else {}))


@main.command("serve")
@click.option(
    "--prefect-port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="port of the embedded Prefect server",
)
@click.option("--no-upgrade", is_flag=True, help="do not migrate the store at start-up")
@click.option(
    "--safety-net",
    type=click.IntRange(5),
    default=60,
    show_default=True,
    help="seconds between safety-net consumer runs",
)
@click.pass_context
@fails_cleanly
def serve_command(ctx: click.Context, prefect_port: int, no_upgrade: bool, safety_net: int) -> None:
    """Serve the backfill, interactive and safety-net deployments (Ctrl-C stops all).

    Starts a local Prefect server under the data directory unless PREFECT_API_URL
    names one.
    """
    from deployments.serve import ServeOptions, serve

    serve(_settings(ctx), ServeOptions(prefect_port, not no_upgrade, safety_net))


@main.command("deploy")
@click.option(
    "--source",
    required=True,
    help="where workers get the code: a git URL, or this project's path on every machine",
)
@click.option("--pool", default="insight-queue", show_default=True, help="process work pool")
@click.option(
    "--safety-net",
    type=click.IntRange(5),
    default=60,
    show_default=True,
    help="seconds between safety-net consumer runs",
)
def deploy_command(source: str, pool: str, safety_net: int) -> None:
    """Scale-out: register the flows on a process work pool (interactive queue first).

    Then run `prefect worker start --pool POOL` on each machine, with the same
    PREFECT_API_URL and AI_JOB_* settings (the store on PostgreSQL).
    """
    from deployments.deploy import deploy

    deployed = deploy(source, pool=pool, safety_net_seconds=safety_net)
    for name, deployment_id in deployed.deployments.items():
        click.echo(f"{name}  {deployment_id}  (pool {deployed.pool})")


@main.command("trigger-backfill")
@click.argument("user_id")
@click.option("--sync-id", default=None, help="the sync this follows; one run per sync")
@fails_cleanly
def trigger_backfill_command(user_id: str, sync_id: str | None) -> None:
    """What the post-sync hook calls: start the backfill run and return at once."""
    from deployments.triggers import trigger_backfill

    run_id = trigger_backfill(user_id, sync_id)
    click.echo(run_id or "Prefect unreachable: scopes queued; the safety net will drain")


@main.command("request-insight")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.option("--fingerprint", default=None)
@fails_cleanly
def request_insight_command(user_id: str, kind: str, subject: str, fingerprint: str | None) -> None:
    """What a screen calls on every poll: status, place in line, ETA, latest result."""
    from deployments.triggers import request_insight

    state = request_insight(user_id, kind, subject, fingerprint)
    click.echo(json.dumps(state.as_dict(), indent=2, ensure_ascii=False))


from deployments.demo import demo_command  # noqa: E402 - after the group it joins

for command in [*COMMANDS, *FLOW_COMMANDS, demo_command]:
    main.add_command(command)
