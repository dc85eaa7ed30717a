"""The `insight-queue` command: the store's verbs, serving, the triggers and tools.

Commands are imported when they run, not when the command starts: the store's verbs never pay
for Prefect or uvicorn, and `--help` lists everything from the table below.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import click

from deployments.render import as_json, printable
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    DatabaseError,
    InvalidArgument,
    JobStore,
    Misconfigured,
    Redactor,
    Settings,
    SettingsError,
    StoreError,
)
from queue_store.redact import install_log_redaction
from queue_store.settings import variables

if TYPE_CHECKING:
    from deployments.triggers import Triggers

P = ParamSpec("P")
R = TypeVar("R")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def fails_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """Turn the store's errors into a one-line message and an exit code: 2 for what the caller
    or the operator must fix, 1 for what may pass (the database away)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (InvalidArgument, Misconfigured) as exc:
            click.echo(f"error: {printable(str(exc))}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except StoreError as exc:
            click.echo(f"error: {printable(str(exc))}", err=True)
            sys.exit(EXIT_FAILURE)

    return wrapper


def settings_from(ctx: click.Context) -> Settings:
    url = ctx.find_root().params.get("database_url")
    return Settings(database_url=url) if url else Settings()


def open_store(ctx: click.Context, *, write: bool) -> JobStore:
    """The store, to use in a `with`; a read-only command never creates one."""
    settings = settings_from(ctx)
    return JobStore(settings.database_url, settings=settings, create=write)


def echo_json(value: Any) -> None:
    click.echo(as_json(value))


def priority_option(command: Callable[P, R]) -> Callable[P, R]:
    command = click.option(
        "--priority",
        type=click.IntRange(0, 1_000_000),
        default=None,
        help=f"lower runs first (interactive {INTERACTIVE}, prefetch {PREFETCH})",
    )(command)
    interactive = f"a screen is waiting: priority {INTERACTIVE}"
    return click.option("--interactive", is_flag=True, help=interactive)(command)


def json_option(command: Callable[P, R]) -> Callable[P, R]:
    return click.option("--json", "as_json", is_flag=True, help="print JSON")(command)


# name -> (module, attribute, one-line help); kept here so `--help` imports nothing.
_CLI, _CONSUMERS, _STORE = "deployments.cli", "deployments.consumers", "deployments.store_commands"
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": (
        _CLI,
        "serve_command",
        "Run the embedded default: Prefect, the consumer, the deployments.",
    ),
    "api": (
        "deployments.http.serving",
        "api_command",
        "Serve the HTTP API for screens and operators, and the queue page.",
    ),
    "token": ("deployments.http.serving", "token_command", "Print a screen's token for a user."),
    "trigger-backfill": (_CLI, "trigger_backfill_command", "What the post-sync hook calls."),
    "request-insight": (_CLI, "request_insight_command", "What a screen calls on every poll."),
    "deploy": (_CLI, "deploy_command", "Scale-out: register the flows on a process work pool."),
    "worker": (
        _CONSUMERS,
        "worker_command",
        "One machine of a work pool: Prefect's worker and a warm consumer.",
    ),
    "consume": (
        _CONSUMERS,
        "consume_command",
        "Stand by and run queued jobs (beside Prefect workers).",
    ),
    "drain": (_CONSUMERS, "drain_command", "Run what is runnable now, then stop."),
    "setup-limit": (_CONSUMERS, "setup_limit_command", "Create or update the `gateway` tag limit."),
    "db": (_STORE, "db_group", "The store's schema: `db upgrade`, `db status`."),
    "enqueue": (_STORE, "enqueue_command", "Queue one generation, or promote it."),
    "status": (_STORE, "status_command", "One job: status, place, ETA, latest result (JSON)."),
    "result": (_STORE, "result_command", "The latest result for a key (JSON)."),
    "jobs": (_STORE, "jobs_command", "One user's queue in worker order."),
    "queue": (_STORE, "queue_command", "The whole queue at a glance (--json, --watch)."),
    "retry-failed": (_STORE, "retry_failed_command", "Put a user's failed jobs back now."),
    "requeue": (
        _STORE,
        "requeue_command",
        "Queue every finished job again (after a prompt change).",
    ),
    "settings": (_STORE, "settings_command", "Every setting, and whether claiming is paused."),
    "pause": (_STORE, "pause_command", "Stop every worker from claiming for SECONDS."),
    "resume": (_STORE, "resume_command", "Lift a pause."),
    "recover": (_STORE, "recover_command", "Take back claims whose worker is gone."),
    "prune": (_STORE, "prune_command", "Delete what is past retention (--dry-run counts)."),
    "forget": (_CLI, "forget_command", "Erase a user from the store and the run history."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module, attribute, _ = entry
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, _, text) in COMMANDS.items()])


def _check_kind(kind: str) -> None:
    """Refuse a kind no generator is registered for (the plugins of AI_JOB_PLUGINS)."""
    from flows.registry import Registry

    Registry.from_plugins(Settings().plugin_modules).check_kind(kind)


def _retention() -> dict[str, float]:
    """The kinds the plugins keep for a time of their own."""
    from flows.registry import Registry

    return Registry.from_plugins(Settings().plugin_modules).retention()


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog="\b\nSettings (environment variables):\n"
    + "\n".join(f"  {name:<30} {text}" for name, text in variables().items()),
)
@click.option(
    "--database-url",
    default=None,
    metavar="URL",
    help="store URL (overrides AI_JOB_DATABASE_URL; default: SQLite in the data dir)",
)
@click.option("-v", "--verbose", is_flag=True, help="log at INFO level")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, verbose: bool) -> None:
    """insight-queue: slow, scarce LLM work for an app's screens, in priority order."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = Settings(database_url=database_url) if database_url else Settings()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    install_log_redaction(Redactor(settings.secrets()))
    ctx.obj = {"check_kind": _check_kind, "retention": _retention}


@click.command("serve")
@click.option(
    "--prefect-port",
    type=click.IntRange(1, 65535),
    default=4200,
    show_default=True,
    help="port of the embedded Prefect server (another is used if it is taken)",
)
@click.option(
    "--upgrade", is_flag=True, help="migrate a PostgreSQL store at start-up (SQLite always is)"
)
@click.option("--no-ui", is_flag=True, help="run the embedded Prefect server without its UI")
@click.pass_context
@fails_cleanly
def serve_command(ctx: click.Context, prefect_port: int, upgrade: bool, no_ui: bool) -> None:
    """Run the embedded default until stopped (SIGTERM, SIGINT or SIGHUP).

    Starts a local Prefect server under the data directory unless
    PREFECT_API_URL names one, the warm consumer, and the deployments.
    """
    from deployments.serve import AlreadyServing, ServeOptions, serve

    code = 0
    try:
        serve(settings_from(ctx), ServeOptions(prefect_port, upgrade, not no_ui))
    except AlreadyServing as exc:
        click.echo(f"error: {exc}", err=True)
        code = 1
    # Everything serve started has stopped, its Prefect server included.
    # Prefect's client services would still try to flush to that server at
    # interpreter exit, retrying for as long as their retries last: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@click.command("deploy")
@click.option(
    "--source",
    required=True,
    help="where workers get the code: a git URL, or this project's path on every machine",
)
@click.option("--pool", default="insight-queue", show_default=True, help="process work pool")
@fails_cleanly
def deploy_command(source: str, pool: str) -> None:
    """Scale-out: register the flows on a process work pool (interactive queue first).

    Then run `prefect worker start --pool POOL` on each machine, with the same
    PREFECT_API_URL and AI_JOB_* settings (the store on PostgreSQL), and
    optionally `insight-queue consume` for a warm consumer.
    """
    from deployments.deploy import deploy

    deployed = deploy(source, pool=pool)
    for name, deployment_id in deployed.deployments.items():
        click.echo(f"{name}  {deployment_id}  (pool {deployed.pool})")


def _triggers(ctx: click.Context) -> Triggers:
    """The triggers for one command; with the store unreachable, ones whose calls say so."""
    from deployments.triggers import Triggers
    from flows.runtime import Runtime

    settings = settings_from(ctx)
    try:
        return Triggers.open(settings)
    except DatabaseError:
        return Triggers(Runtime.open(settings, check_schema=False))


@click.command("trigger-backfill")
@click.argument("user_id")
@click.option("--sync-id", default=None, help="the sync this follows; one run per sync")
@click.pass_context
@fails_cleanly
def trigger_backfill_command(ctx: click.Context, user_id: str, sync_id: str | None) -> None:
    """What the post-sync hook calls: queue the user's scopes, start the backfill run (JSON)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.trigger_backfill(user_id, sync_id).as_dict())


@click.command("request-insight")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.option("--fingerprint", default=None, help="hash of the data the insight is made from")
@click.pass_context
@fails_cleanly
def request_insight_command(
    ctx: click.Context, user_id: str, kind: str, subject: str, fingerprint: str | None
) -> None:
    """What a screen calls on every poll: status, place in line, ETA, latest result (JSON)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.request_insight(user_id, kind, subject, fingerprint).as_dict())


@click.command("forget")
@click.argument("user_id")
@click.pass_context
@fails_cleanly
def forget_command(ctx: click.Context, user_id: str) -> None:
    """Erase USER: every row of theirs from the store at once (a call of theirs in flight is
    cut, and its answer never written), then their runs from Prefect, now or, if Prefect is
    away, at the next forget or scheduled prune (JSON; idempotent)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.forget(user_id).as_dict())
