"""The store's command-line verbs: `db upgrade`, `enqueue`, `status`, `jobs`, ...

Mounted into the `insight-queue` command by `deployments.cli`; usable on its
own because it needs nothing but the store. Store errors become one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import click

from queue_store import migrate
from queue_store.errors import InvalidArgument, SettingsError, StoreError
from queue_store.models import INTERACTIVE, PREFETCH
from queue_store.settings import FIELDS, Settings, redact_url
from queue_store.store import JobStore

P = ParamSpec("P")
R = TypeVar("R")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def fails_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """Turn the store's errors into a one-line message and an exit code."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (InvalidArgument, SettingsError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except StoreError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILURE)

    return wrapper


def settings_from(ctx: click.Context) -> Settings:
    url = ctx.find_root().params.get("database_url")
    overrides = {"database_url": url} if url else {}
    return Settings.from_env(**overrides)


@contextmanager
def open_store(ctx: click.Context) -> Iterator[JobStore]:
    settings = settings_from(ctx)
    store = JobStore(settings.database_url, settings=settings)
    try:
        yield store
    finally:
        store.close()


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def priority_option(command: Callable[P, R]) -> Callable[P, R]:
    command = click.option(
        "--priority",
        type=click.IntRange(0, 1_000_000),
        default=None,
        help=f"lower runs first (interactive {INTERACTIVE}, prefetch {PREFETCH})",
    )(command)
    return click.option(
        "--interactive",
        is_flag=True,
        help=f"a screen is waiting: priority {INTERACTIVE}",
    )(command)


@click.group("db")
def db_group() -> None:
    """The store's schema."""


@db_group.command("upgrade")
@click.pass_context
@fails_cleanly
def db_upgrade(ctx: click.Context) -> None:
    """Create the schema, or upgrade it (an original ai_jobs table is adopted in place)."""
    settings = settings_from(ctx)
    revision = migrate.upgrade(settings.database_url)
    click.echo(f"{redact_url(settings.database_url)} is at schema revision {revision}")


@db_group.command("status")
@click.pass_context
@fails_cleanly
def db_status(ctx: click.Context) -> None:
    """Say whether the schema is current."""
    settings = settings_from(ctx)
    with JobStore(settings.database_url, settings=settings, check_schema=False) as store:
        store.check_schema()
    click.echo(f"{redact_url(settings.database_url)}: schema is current")


@click.command("enqueue")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.option("--fingerprint", default=None, help="hash of the data the insight is made from")
@priority_option
@click.pass_context
@fails_cleanly
def enqueue_command(
    ctx: click.Context,
    user_id: str,
    kind: str,
    subject: str,
    fingerprint: str | None,
    priority: int | None,
    interactive: bool,
) -> None:
    """Queue one generation, or promote it; prints the job's status."""
    if interactive and priority is not None:
        raise InvalidArgument("priority", "give --interactive or --priority, not both")
    chosen = INTERACTIVE if interactive else PREFETCH if priority is None else priority
    with open_store(ctx) as store:
        click.echo(store.enqueue(user_id, kind, subject, fingerprint, chosen))


@click.command("status")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.pass_context
@fails_cleanly
def status_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """One job's status, place in line, ETA and latest result, as JSON."""
    with open_store(ctx) as store:
        status = store.status_of(user_id, kind, subject)
        if status is None:
            click.echo("no such job", err=True)
            sys.exit(EXIT_FAILURE)
        position = store.position(user_id, kind, subject)
        result = store.result_of(user_id, kind, subject)
    if position is not None:
        status.update(position.as_dict())
    status["result"] = result.as_dict() if result else None
    echo_json(status)


@click.command("jobs")
@click.option("--user", "user_id", required=True, help="whose queue to show")
@click.option("--limit", type=click.IntRange(1, 1000), default=60, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.pass_context
@fails_cleanly
def jobs_command(ctx: click.Context, user_id: str, limit: int, as_json: bool) -> None:
    """The user's queue in the order the worker will take it."""
    with open_store(ctx) as store:
        listed = store.list_jobs(user_id, limit)
    if as_json:
        echo_json(listed)
        return
    click.echo(render_table(listed))


def render_table(listed: list[dict[str, Any]]) -> str:
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("STATUS", lambda j: j["status"]),
        ("PRIO", lambda j: f"{j['priority']}{'*' if j['interactive'] else ''}"),
        ("KIND", lambda j: j["kind"]),
        ("SUBJECT", lambda j: j["subject"]),
        ("TRIES", lambda j: f"{j['attempts']}/{j['maxAttempts']}"),
        ("AHEAD", lambda j: str(j["ahead"]) if "ahead" in j else ""),
        ("ETA", lambda j: f"{j['etaSeconds']:.0f}s" if "etaSeconds" in j else ""),
        ("UPDATED", lambda j: j["updatedAt"] or ""),
        ("ERROR", lambda j: _one_line(j["error"] or "")),
    ]
    cells = [[_printable(render(job)) for _, render in columns] for job in listed]
    widths = [
        min(max([len(title)] + [len(row[i]) for row in cells]), 60)
        for i, (title, _) in enumerate(columns)
    ]

    def line(values: list[str]) -> str:
        return "  ".join(v[:w].ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    lines = [line([title for title, _ in columns])]
    lines += [line(row) for row in cells]
    if not listed:
        lines.append("(no jobs)")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _printable(text: str) -> str:
    """Control characters as escapes: a cell never breaks a table row or
    drives the operator's terminal (kind and subject come from the app)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


@click.command("retry-failed")
@click.argument("user_id")
@click.pass_context
@fails_cleanly
def retry_failed_command(ctx: click.Context, user_id: str) -> None:
    """Put every failed job of the user back in the queue now; prints the pending count."""
    with open_store(ctx) as store:
        click.echo(store.retry_failed(user_id))


@click.command("result")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.pass_context
@fails_cleanly
def result_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """The latest result for a key, as JSON (also while a newer one is being made)."""
    with open_store(ctx) as store:
        result = store.result_of(user_id, kind, subject)
    if result is None:
        click.echo("no result yet", err=True)
        sys.exit(EXIT_FAILURE)
    echo_json(result.as_dict())


@click.command("settings")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.pass_context
@fails_cleanly
def settings_command(ctx: click.Context, as_json: bool) -> None:
    """Every setting with its environment variable and value (secrets masked)."""
    shown = settings_from(ctx).public()
    if as_json:
        echo_json(shown)
        return
    width = max(len(field.env) for field in FIELDS.values())
    for name, value in shown.items():
        click.echo(f"{FIELDS[name].env.ljust(width)}  {value}")


@click.command("pause")
@click.argument("seconds", type=click.FloatRange(0, 7 * 24 * 3600))
@click.option("--reason", default="paused by an operator", show_default=True)
@click.pass_context
@fails_cleanly
def pause_command(ctx: click.Context, seconds: float, reason: str) -> None:
    """Stop every worker from claiming for SECONDS."""
    with open_store(ctx) as store:
        until = store.pause(seconds, reason)
    click.echo(f"claiming paused until {until.isoformat(timespec='seconds')}")


@click.command("resume")
@click.pass_context
@fails_cleanly
def resume_command(ctx: click.Context) -> None:
    """Lift a pause (operator's or the circuit breaker's)."""
    with open_store(ctx) as store:
        store.resume()
    click.echo("claiming resumed")


@click.command("recover")
@click.option("--worker", default=None, help="also release this worker's own claims")
@click.pass_context
@fails_cleanly
def recover_command(ctx: click.Context, worker: str | None) -> None:
    """Release claims whose worker is gone (never a live one)."""
    with open_store(ctx) as store:
        click.echo(f"released {store.recover(worker)} claim(s)")


COMMANDS: list[click.Command] = [
    db_group,
    enqueue_command,
    status_command,
    jobs_command,
    retry_failed_command,
    result_command,
    settings_command,
    pause_command,
    resume_command,
    recover_command,
]


def settings_help() -> str:
    return "\n".join(f"  {f.env:<28} {f.help}" for f in FIELDS.values())
