"""The `insight-queue` command, and its commands beside Prefect and the API's. Prefect and uvicorn
load only when a command needs them, so the store's verbs never pay for them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import click

from deployments import processes, table
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


def key_arguments(command: Callable[P, R]) -> Callable[P, R]:
    """USER_ID KIND SUBJECT, one job's key."""
    for name in ("subject", "kind", "user_id"):
        command = click.argument(name)(command)
    return command


def settings_from(ctx: click.Context) -> Settings:
    """The settings `main` read, once, for the whole command."""
    settings: Settings = ctx.find_root().obj
    return settings


def open_store(ctx: click.Context, *, write: bool) -> JobStore:
    """The store, to use in a `with`; a read-only command never creates one."""
    return JobStore(settings=settings_from(ctx), create=write)


def registry(ctx: click.Context) -> Registry:
    """The plugins of AI_JOB_PLUGINS, loaded only by the commands that need them."""
    from flows.registry import Registry

    return Registry.from_plugins(settings_from(ctx).plugin_modules)


class Commands(click.Group):
    """`--help` lists the commands as they are defined: this module's, then the store's verbs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        import deployments.store_commands  # noqa: F401 - the store's verbs join this group

        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


@click.group(
    cls=Commands,
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 110,
        "show_default": True,
    },
    epilog="\b\nSettings (environment variables):\n"
    + "\n".join(f"  {name:<30} {text}" for name, text in variables().items()),
)
@click.option(
    "--database-url",
    metavar="URL",
    help="store URL (overrides AI_JOB_DATABASE_URL; default: SQLite in the data dir)",
)
@click.option("-v", "--verbose", is_flag=True, help="log at INFO level")
@click.pass_context
def main(ctx: click.Context, database_url: str | None, verbose: bool) -> None:
    """insight-queue: slow, scarce LLM work for an app's screens, in priority order."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format=processes.LOG_FORMAT
    )
    try:
        settings = Settings(database_url=database_url) if database_url else Settings()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    install_log_redaction(Redactor(settings.secrets()))
    ctx.obj = settings


def command(
    name: str,
    short_help: str | None = None,
    context_settings: dict[str, Any] | None = None,
    group: click.Group | None = None,
) -> Callable[[Callable[..., None]], click.Command]:
    """A command of `main` (or `group`) given its context first; the store's errors become one line
    on stderr, exit 2 for what the caller or the operator must fix, 1 for what may pass."""

    def make(function: Callable[..., None]) -> click.Command:
        @(group or main).command(name, short_help=short_help, context_settings=context_settings)
        @click.pass_context
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                function(*args, **kwargs)
            except StoreError as exc:
                click.echo(f"error: {printable(str(exc))}", err=True)
                bad_input = isinstance(exc, InvalidArgument | Misconfigured)
                sys.exit(EXIT_BAD_INPUT if bad_input else EXIT_FAILURE)

        return run

    return make


@command("serve", "Run the embedded default: Prefect, the consumer, the deployments.")
@click.option(
    "--prefect-port",
    type=click.IntRange(1, 65535),
    default=4200,
    help="port of the embedded Prefect server (another is used if it is taken)",
)
@click.option(
    "--upgrade", is_flag=True, help="migrate a PostgreSQL store at start-up (SQLite always is)"
)
@click.option("--no-ui", is_flag=True, help="run the embedded Prefect server without its UI")
def serve_command(ctx: click.Context, prefect_port: int, upgrade: bool, no_ui: bool) -> None:
    """Run the embedded default until SIGTERM, SIGINT or SIGHUP: a local Prefect server under the
    data directory (unless PREFECT_API_URL names one), the warm consumer, the deployments."""
    from deployments.serve import AlreadyServing, serve

    code = 0
    try:
        serve(settings_from(ctx), prefect_port, upgrade=upgrade, ui=not no_ui)
    except AlreadyServing as exc:
        click.echo(f"error: {exc}", err=True)
        code = 1
    # Prefect's client services would still try to flush to the server serve stopped, retrying
    # at interpreter exit for as long as their retries last: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@command("api", "Serve the HTTP API for screens and operators, and the queue page.")
@click.option("--host", default="127.0.0.1", help="address to bind")
@click.option("--port", type=click.IntRange(0, 65535), default=8000)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    help="server processes (uvicorn's); one core serves about a few hundred polls a second",
)
def api_command(ctx: click.Context, host: str, port: int, workers: int) -> None:
    """Serve the HTTP API and the queue page until SIGTERM or SIGINT. Every route needs a
    credential; those not set are made once and kept in the data directory, as this prints."""
    from deployments.http.serving import serve_api

    verbose = bool(ctx.find_root().params.get("verbose"))
    serve_api(settings_from(ctx), host, port, workers, verbose=verbose)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TOKEN_SECONDS = 30 * 86400


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """A duration such as 30s, 15m, 1h or 2d (a bare number is seconds)."""
    text = value.strip().lower()
    unit = DURATION_UNITS.get(text[-1:])
    try:
        seconds = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        message = f"{value!r} is not a duration such as 30s, 15m, 1h or 2d"
        raise click.BadParameter(message) from None
    if not 0 < seconds <= MAX_TOKEN_SECONDS:
        raise click.BadParameter(f"{value!r}: between 1 s and {MAX_TOKEN_SECONDS // 86400} days")
    return seconds


@command("token", "Print a screen's token for a user.")
@click.argument("user_id")
@click.option(
    "--ttl",
    default="1h",
    metavar="DURATION",
    callback=_duration,
    help="how long it holds",
)
def token_command(ctx: click.Context, user_id: str, ttl: float) -> None:
    """Print a screen's token for USER, on its last line (for tests and small deployments),
    signed with AI_API_SCREEN_SECRET or the secret `insight-queue api` keeps."""
    from deployments.http.credentials import Credentials

    token = Credentials.load(settings_from(ctx)).screens.issue(user_id, ttl)
    click.echo(f"a screen token for {printable(user_id)}, valid {ttl:g} s:", err=True)
    click.echo(token)


def triggers_for(ctx: click.Context) -> Triggers:
    """The triggers for one command; with the store unreachable, ones whose calls say so."""
    from deployments.triggers import Triggers
    from flows.runtime import Runtime

    settings = settings_from(ctx)
    try:
        return Triggers.open(settings)
    except DatabaseError:
        return Triggers(Runtime.open(settings, check_schema=False))


@command("trigger-backfill", "What the post-sync hook calls.")
@click.argument("user_id")
@click.option("--sync-id", help="the sync this follows; one run per sync")
def trigger_backfill_command(ctx: click.Context, user_id: str, sync_id: str | None) -> None:
    """What the post-sync hook calls: queue the user's scopes, start the backfill run (JSON)."""
    with triggers_for(ctx) as triggers:
        click.echo(as_json(triggers.trigger_backfill(user_id, sync_id).as_dict()))


@command("request-insight", "What a screen calls on every poll.")
@key_arguments
@click.option("--fingerprint", help="hash of the data the insight is made from")
def request_insight_command(
    ctx: click.Context, user_id: str, kind: str, subject: str, fingerprint: str | None
) -> None:
    """What a screen calls on every poll: status, place in line, ETA, latest result (JSON)."""
    with triggers_for(ctx) as triggers:
        click.echo(as_json(triggers.request_insight(user_id, kind, subject, fingerprint).as_dict()))


@command("deploy", "Scale-out: register the flows on a process work pool.")
@click.option(
    "--source",
    required=True,
    help="where workers get the code: a git URL, or this project's path on every machine",
)
@click.option("--pool", default=table.POOL, help="process work pool")
def deploy_command(ctx: click.Context, source: str, pool: str) -> None:
    """Scale-out: register the flows on a process work pool (interactive queue first); then run
    `insight-queue worker --pool POOL` on each machine, with the same settings."""
    from deployments.deploy import deploy

    for name, deployment_id in deploy(settings_from(ctx), source, pool).items():
        click.echo(f"{name}  {deployment_id}  (pool {pool})")


# How often a machine's worker looks for flow runs (Prefect's default is 10 s):
# a drain that a lost machine's work needs starts within seconds.
WORKER_QUERY_SECONDS = "2"


def _require_prefect(settings: Settings) -> None:
    from deployments.prefect_api import api_url

    if (url := api_url(settings)) is None:
        raise click.ClickException(
            "no Prefect server: set PREFECT_API_URL, or run `insight-queue serve` "
            "for this data directory"
        )
    processes.export_to_children(
        overrides={"PREFECT_API_URL": url}, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false"
    )


def _stand_by(settings: Settings, beside: list[str] | None = None) -> None:
    """A warm consumer until SIGTERM, SIGINT or SIGHUP; `beside`, a command started once it
    stands by and interrupted once it has stopped."""
    from flows.flows import prefect_consumer
    from flows.runtime import Runtime

    _require_prefect(settings)
    runtime = Runtime.open(settings)
    runtime.redact_logs()
    consumer, ledger = prefect_consumer(runtime, "consumer", standby=True)

    async def main() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            asyncio.get_running_loop().add_signal_handler(signum, consumer.stop, signum.name)
        try:
            await consumer.run()
        finally:
            await ledger.flush(timeout=5.0)

    click.echo(f"{consumer.worker} standing by; Ctrl-C stops it", err=True)
    with contextlib.ExitStack() as started:
        try:
            if beside is not None:
                started.callback(processes.interrupt_group, processes.start(beside))
            asyncio.run(main())
        finally:
            runtime.close()
        click.echo(json.dumps(consumer.summary.as_dict()))


@command("worker", "One machine of a work pool: Prefect's worker and a warm consumer.")
@click.option("--pool", default=table.POOL, help="the process work pool")
@click.option("--limit", type=click.IntRange(1), help="flow runs of the pool at once here")
def worker_command(ctx: click.Context, pool: str, limit: int | None) -> None:
    """One machine of a work pool: Prefect's process worker for the pool's runs, and a warm
    consumer beside it. SIGTERM, SIGINT or SIGHUP stop both, the job in flight handed back."""
    from deployments.stack import executable

    args = [executable("prefect"), "worker", "start", "--pool", pool, "--type", "process"]
    processes.export_to_children(PREFECT_WORKER_QUERY_SECONDS=WORKER_QUERY_SECONDS)
    _stand_by(settings_from(ctx), beside=[*args, *(["--limit", str(limit)] if limit else [])])


@command("consume", "Stand by and run queued jobs (beside Prefect workers).")
def consume_command(ctx: click.Context) -> None:
    """Stand by and run queued jobs until SIGTERM, SIGINT or SIGHUP (a warm consumer beside
    Prefect workers, reporting to PREFECT_API_URL); a stop hands the job in flight back."""
    _stand_by(settings_from(ctx))


@command("drain", "Run what is runnable now, then stop.")
@click.option("--max-jobs", type=click.IntRange(1), help="stop after this many")
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


@command("setup-limit", "Create or update the `gateway` tag limit.")
@click.option(
    "--repair",
    is_flag=True,
    help="give back slots counted as taken but held by no task run (only with no consumer alive)",
)
def setup_limit_command(ctx: click.Context, repair: bool) -> None:
    """Create or update the `gateway` tag concurrency limit to AI_JOB_CONCURRENCY. `--repair`
    sets back the count a restarted Prefect server with in-memory leases keeps; it refuses while
    a consumer is alive, since a consumer's slot has no task run."""
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
