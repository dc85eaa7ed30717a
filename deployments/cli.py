"""The `insight-queue` command. Each command is imported when it runs, so the store's verbs never
pay for Prefect or uvicorn; `--help` lists them from `COMMANDS` without importing any."""

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
    from flows.registry import Registry

P = ParamSpec("P")
R = TypeVar("R")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def fails_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """The store's errors as one line on stderr: exit 2 for what the caller or the operator must
    fix, 1 for what may pass (the database away)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except StoreError as exc:
            click.echo(f"error: {printable(str(exc))}", err=True)
            bad_input = isinstance(exc, InvalidArgument | Misconfigured)
            sys.exit(EXIT_BAD_INPUT if bad_input else EXIT_FAILURE)

    return wrapper


def command(
    name: str, context_settings: dict[str, Any] | None = None
) -> Callable[[Callable[..., None]], click.Command]:
    """A click command that is given its context first and fails cleanly."""

    def make(function: Callable[..., None]) -> click.Command:
        made = click.pass_context(fails_cleanly(function))
        return click.command(name, context_settings=context_settings)(made)

    return make


def key_arguments(command: Callable[P, R]) -> Callable[P, R]:
    """USER_ID KIND SUBJECT, one job's key."""
    for name in ("subject", "kind", "user_id"):
        command = click.argument(name)(command)
    return command


def settings_from(ctx: click.Context) -> Settings:
    url = ctx.find_root().params.get("database_url")
    return Settings(database_url=url) if url else Settings()


def open_store(ctx: click.Context, *, write: bool) -> JobStore:
    """The store, to use in a `with`; a read-only command never creates one."""
    settings = settings_from(ctx)
    return JobStore(settings.database_url, settings=settings, create=write)


def echo_json(value: Any) -> None:
    click.echo(as_json(value))


def json_option(command: Callable[P, R]) -> Callable[P, R]:
    return click.option("--json", "as_json", is_flag=True, help="print JSON")(command)


# name -> (module, one-line help); the command is the module's `<name>_command`.
_CLI, _CONSUMERS = "deployments.cli", "deployments.consumers"
_HTTP, _STORE = "deployments.http.serving", "deployments.store_commands"
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": (_CLI, "Run the embedded default: Prefect, the consumer, the deployments."),
    "api": (_HTTP, "Serve the HTTP API for screens and operators, and the queue page."),
    "token": (_HTTP, "Print a screen's token for a user."),
    "trigger-backfill": (_CLI, "What the post-sync hook calls."),
    "request-insight": (_CLI, "What a screen calls on every poll."),
    "deploy": (_CLI, "Scale-out: register the flows on a process work pool."),
    "worker": (_CONSUMERS, "One machine of a work pool: Prefect's worker and a warm consumer."),
    "consume": (_CONSUMERS, "Stand by and run queued jobs (beside Prefect workers)."),
    "drain": (_CONSUMERS, "Run what is runnable now, then stop."),
    "setup-limit": (_CONSUMERS, "Create or update the `gateway` tag limit."),
    "db": (_STORE, "The store's schema: `db upgrade`, `db status`."),
    "enqueue": (_STORE, "Queue one generation, or promote it."),
    "status": (_STORE, "One job: status, place, ETA, latest result (JSON)."),
    "result": (_STORE, "The latest result for a key (JSON)."),
    "jobs": (_STORE, "One user's queue in worker order."),
    "queue": (_STORE, "The whole queue at a glance (--json, --watch)."),
    "retry-failed": (_STORE, "Put a user's failed jobs back now."),
    "requeue": (_STORE, "Queue every finished job again (after a prompt change)."),
    "settings": (_STORE, "Every setting, and whether claiming is paused."),
    "pause": (_STORE, "Stop every worker from claiming for SECONDS."),
    "resume": (_STORE, "Lift a pause."),
    "recover": (_STORE, "Take back claims whose worker is gone."),
    "prune": (_STORE, "Delete what is past retention (--dry-run counts)."),
    "forget": (_CLI, "Erase a user from the store and the run history."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        found = getattr(module, f"{name.replace('-', '_')}_command")
        assert isinstance(found, click.Command)
        return found

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, text) in COMMANDS.items()])


def registry() -> Registry:
    """The plugins of AI_JOB_PLUGINS, loaded only by the commands that need them."""
    from flows.registry import Registry

    return Registry.from_plugins(Settings().plugin_modules)


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
def main(database_url: str | None, verbose: bool) -> None:
    """insight-queue: slow, scarce LLM work for an app's screens, in priority order."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)
    try:
        settings = Settings(database_url=database_url) if database_url else Settings()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    install_log_redaction(Redactor(settings.secrets()))


@command("serve")
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
def serve_command(ctx: click.Context, prefect_port: int, upgrade: bool, no_ui: bool) -> None:
    """Run the embedded default until SIGTERM, SIGINT or SIGHUP: a local Prefect server under the
    data directory (unless PREFECT_API_URL names one), the warm consumer, the deployments."""
    from deployments.serve import AlreadyServing, ServeOptions, serve

    code = 0
    try:
        serve(settings_from(ctx), ServeOptions(prefect_port, upgrade, not no_ui))
    except AlreadyServing as exc:
        click.echo(f"error: {exc}", err=True)
        code = 1
    # Prefect's client services would still try to flush to the server serve stopped, retrying
    # at interpreter exit for as long as their retries last: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@command("deploy")
@click.option(
    "--source",
    required=True,
    help="where workers get the code: a git URL, or this project's path on every machine",
)
@click.option("--pool", default="insight-queue", show_default=True, help="process work pool")
def deploy_command(ctx: click.Context, source: str, pool: str) -> None:
    """Scale-out: register the flows on a process work pool (interactive queue first); then run
    `insight-queue worker --pool POOL` on each machine, with the same settings."""
    from deployments.deploy import deploy

    for name, deployment_id in deploy(source, pool).items():
        click.echo(f"{name}  {deployment_id}  (pool {pool})")


def _triggers(ctx: click.Context) -> Triggers:
    """The triggers for one command; with the store unreachable, ones whose calls say so."""
    from deployments.triggers import Triggers
    from flows.runtime import Runtime

    settings = settings_from(ctx)
    try:
        return Triggers.open(settings)
    except DatabaseError:
        return Triggers(Runtime.open(settings, check_schema=False))


@command("trigger-backfill")
@click.argument("user_id")
@click.option("--sync-id", default=None, help="the sync this follows; one run per sync")
def trigger_backfill_command(ctx: click.Context, user_id: str, sync_id: str | None) -> None:
    """What the post-sync hook calls: queue the user's scopes, start the backfill run (JSON)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.trigger_backfill(user_id, sync_id).as_dict())


@command("request-insight")
@key_arguments
@click.option("--fingerprint", default=None, help="hash of the data the insight is made from")
def request_insight_command(
    ctx: click.Context, user_id: str, kind: str, subject: str, fingerprint: str | None
) -> None:
    """What a screen calls on every poll: status, place in line, ETA, latest result (JSON)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.request_insight(user_id, kind, subject, fingerprint).as_dict())


@command("forget")
@click.argument("user_id")
def forget_command(ctx: click.Context, user_id: str) -> None:
    """Erase USER: their rows from the store at once (a call of theirs in flight is cut), then
    their runs from Prefect, now or at the next forget or prune if it is away (JSON; idempotent)."""
    with _triggers(ctx) as triggers:
        echo_json(triggers.forget(user_id).as_dict())
