"""The store's command-line verbs: `db`, `enqueue`, `status`, `jobs`, `queue`, ...

Mounted into the `insight-queue` command by `deployments.cli`; they need nothing but the store,
so they start without importing Prefect. Every error becomes one line on stderr and a non-zero
exit, never a traceback. JSON output uses the store's one vocabulary (snake_case keys, ISO 8601
UTC times). Read-only commands never create a database or a directory.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import click

from queue_store import migrate
from queue_store.errors import InvalidArgument, Misconfigured, StoreError
from queue_store.models import INTERACTIVE, PREFETCH, GateState, Hold, QueueView, UsageRow, iso
from queue_store.redact import mask_url
from queue_store.settings import Settings
from queue_store.store import JobStore

P = ParamSpec("P")
R = TypeVar("R")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
ERROR_COLUMN = 48  # characters of an error shown in a table row
CELL_WIDTH = 40  # widest other column
ELLIPSIS = "…"


def fails_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """Turn the store's errors into a one-line message and an exit code."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (InvalidArgument, Misconfigured) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except StoreError as exc:
            click.echo(f"error: {exc}", err=True)
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
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


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
    click.echo(f"{mask_url(settings.database_url)} is at schema revision {revision}")


@db_group.command("status")
@click.pass_context
@fails_cleanly
def db_status(ctx: click.Context) -> None:
    """Say whether the schema is current (creates nothing)."""
    settings = settings_from(ctx)
    JobStore(settings.database_url, settings=settings, create=False).close()  # checks the schema
    click.echo(f"{mask_url(settings.database_url)}: schema is current")


@click.command("enqueue")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.option("--fingerprint", default=None, help="hash of the data the insight is made from")
@priority_option
@json_option
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
    as_json: bool,
) -> None:
    """Queue one generation, or promote it; prints the job's status."""
    if interactive and priority is not None:
        raise InvalidArgument("priority", "give --interactive or --priority, not both")
    # How the command that mounts these verbs checks a kind, once the plugins are loaded.
    if callable(check := (ctx.find_root().obj or {}).get("check_kind")):
        check(kind)
    chosen = INTERACTIVE if interactive else PREFETCH if priority is None else priority
    with open_store(ctx, write=True) as store:
        status = store.enqueue(user_id, kind, subject, fingerprint, chosen)
        job = store.job(user_id, kind, subject)
    if as_json:
        echo_json({"status": str(status), "job": job.as_dict() if job else None})
    else:
        click.echo(status)


@click.command("status")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.pass_context
@fails_cleanly
def status_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """One job's status, place in line, ETA and latest result, as JSON."""
    with open_store(ctx, write=False) as store:
        state = store.state(user_id, kind, subject)
    if state is None:
        click.echo(f"error: no job for {user_id!r} {kind}:{subject}", err=True)
        sys.exit(EXIT_FAILURE)
    echo_json(state.as_dict(store.settings.max_attempts))


@click.command("jobs")
@click.option("--user", "user_id", required=True, help="whose queue to show")
@click.option("--limit", type=click.IntRange(1, 1000), default=60, show_default=True)
@json_option
@click.pass_context
@fails_cleanly
def jobs_command(ctx: click.Context, user_id: str, limit: int, as_json: bool) -> None:
    """The user's queue in the order the worker will take it."""
    with open_store(ctx, write=False) as store:
        listed = store.list_jobs(user_id, limit)
    if as_json:
        echo_json(listed)
        return
    click.echo(render_jobs(listed))


def render_jobs(listed: list[dict[str, Any]]) -> str:
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("STATUS", lambda j: j["status"]),
        ("PRIO", lambda j: f"{j['priority']}{'*' if j['interactive'] else ''}"),
        ("KIND", lambda j: j["kind"]),
        ("SUBJECT", lambda j: j["subject"]),
        ("TRIES", lambda j: f"{j['attempts']}/{j['max_attempts']}"),
        ("AHEAD", lambda j: "" if j.get("ahead") is None else str(j["ahead"])),
        ("ETA", lambda j: "" if j.get("eta_seconds") is None else _duration(j["eta_seconds"])),
        ("UPDATED", lambda j: j["updated_at"] or ""),
        ("ERROR", lambda j: j["error"] or ""),
    ]
    return render_table(columns, listed, empty="(no jobs)")


def render_table(
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]],
    rows: list[dict[str, Any]],
    *,
    empty: str,
) -> str:
    """A plain-text table; long cells end in an ellipsis, and the last column may be wider."""
    cells = [[_printable(_one_line(render(row))) for _, render in columns] for row in rows]
    limits = [CELL_WIDTH] * (len(columns) - 1) + [ERROR_COLUMN]
    cells = [[_cut(v, w) for v, w in zip(row, limits, strict=True)] for row in cells]
    widths = [
        max([len(title)] + [len(row[i]) for row in cells]) for i, (title, _) in enumerate(columns)
    ]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    lines = [line([title for title, _ in columns])]
    lines += [line(row) for row in cells]
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + ELLIPSIS


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the
# bidirectional controls (marks, embeddings, overrides, isolates).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def _printable(text: str) -> str:
    """Control characters as escapes: a cell never breaks a table row or
    drives the operator's terminal (kind and subject come from the app)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def describe_gate(gate: GateState) -> str:
    """One line about claiming: running, or paused until when, by what, why."""
    if not gate.paused:
        streak = f" (outages in a row: {gate.outages_in_a_row})" if gate.outages_in_a_row else ""
        return f"claiming: open{streak}"
    return (
        f"claiming: PAUSED ({gate.pause_kind}) for {_duration(gate.pause_seconds_left)}, "
        f"until {iso(gate.paused_until)}: {_printable(_one_line(gate.pause_reason or ''))}"
    )


def describe_hold(hold: Hold, now: dt.datetime) -> str:
    """One line about a cut call that still holds the gateway (H1)."""
    until = hold.until.astimezone(dt.UTC).strftime("%H:%M:%S")
    job = f"; {_printable(hold.job.run_name)} of {_printable(hold.job.user_id)}" if hold.job else ""
    return (
        f"held by a cut call until {until} UTC ({hold.cause.described}; "
        f"{_duration(hold.seconds_left(now))} left{job})"
    )


def render_queue(view: QueueView) -> str:
    """The whole queue as text: claiming, consumers, calls in flight, the line, failures."""
    alive = ", ".join(f"{w.name} ({w.role})" for w in view.workers if w.alive) or "none alive"
    out = [
        f"{iso(view.now)}  concurrency {view.concurrency}",
        describe_gate(view.gate),
        *(describe_hold(hold, view.now) for hold in view.holds),
        f"consumers: {alive}",
        "",
        f"IN FLIGHT ({len(view.running)})",
    ]
    for e in view.running:
        j = e.job
        run = f"  run {j.flow_run_id[:8]}" if j.flow_run_id else ""
        out.append(
            f"  {_printable(j.run_name)}  user {_printable(j.user_id)}  {j.priority_class}  "
            f"try {j.attempts}/{view.max_attempts}  for {_duration(e.running_seconds or 0)}  "
            f"by {j.worker or '?'}{run}"
        )
    if not view.running:
        out.append("  (none)")
    shown = f", first {len(view.waiting)}" if view.waiting_total > len(view.waiting) else ""
    out += ["", f"WAITING ({view.waiting_total}{shown}), in the order the worker takes them"]
    rows = [e.as_dict(view.max_attempts) for e in view.waiting]
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("#", lambda r: str(r["place"])),
        ("USER", lambda r: r["user_id"]),
        ("KIND", lambda r: r["kind"]),
        ("SUBJECT", lambda r: r["subject"]),
        ("CLASS", lambda r: r["priority_class"]),
        ("TRIES", lambda r: f"{r['attempts']}/{r['max_attempts']}"),
        ("ETA", lambda r: _duration(r["eta_seconds"] or 0)),
        ("LAST ERROR", lambda r: r["error"] or ""),
    ]
    out.append(render_table(columns, rows, empty="(nothing waiting)"))
    out += ["", f"RECENT FAILURES ({view.failed_total})"]
    for e in view.recent_failures:
        j = e.job
        out.append(
            f"  {iso(j.finished_at)}  {_printable(j.run_name)}  user {_printable(j.user_id)}: "
            f"{_cut(_printable(_one_line(j.error or '')), 120)}"
        )
    if not view.recent_failures:
        out.append("  (none)")
    out += ["", f"TOKENS: {view.usage_total.described()} in all, by user and kind:"]
    by_user: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("USER", lambda u: u["user_id"]),
        ("KIND", lambda u: u["kind"]),
        ("ANSWERS", lambda u: str(u["answers"])),
        ("TOKENS", lambda u: UsageRow(**u).described()),
    ]
    out.append(render_table(by_user, [u.as_dict() for u in view.usage], empty="(no answer yet)"))
    return "\n".join(out)


@click.command("queue")
@click.option(
    "--limit",
    type=click.IntRange(1, 1000),
    default=30,
    show_default=True,
    help="waiting jobs shown",
)
@click.option(
    "--watch",
    "watch",
    type=click.FloatRange(0.5, 3600),
    default=None,
    is_flag=False,
    flag_value=2.0,
    metavar="[SECONDS]",
    help="refresh in place every SECONDS (default 2) until Ctrl-C",
)
@json_option
@click.pass_context
@fails_cleanly
def queue_command(ctx: click.Context, limit: int, watch: float | None, as_json: bool) -> None:
    """The whole queue at a glance: every user, in the order the worker takes them."""
    with open_store(ctx, write=False) as store:
        if watch is None:
            view = store.queue_view(limit)
            if as_json:
                echo_json(view.as_dict())
            else:
                click.echo(render_queue(view))
            return
        try:
            while True:
                view = store.queue_view(limit)
                text = json.dumps(view.as_dict(), indent=2) if as_json else render_queue(view)
                height = shutil.get_terminal_size((100, 40)).lines
                lines = text.splitlines()[: max(height - 1, 5)]
                # Home the cursor, draw, clear what is left of the old screen.
                click.echo(
                    "\x1b[H" + "\n".join(line + "\x1b[K" for line in lines) + "\x1b[J", nl=False
                )
                time.sleep(watch)
        except KeyboardInterrupt:
            click.echo()


@click.command("retry-failed")
@click.argument("user_id")
@click.pass_context
@fails_cleanly
def retry_failed_command(ctx: click.Context, user_id: str) -> None:
    """Put every failed job of the user back in the queue now."""
    with open_store(ctx, write=True) as store:
        retried = store.retry_failed(user_id)
        pending = store.pending_count(user_id)
    click.echo(f"retried {retried} failed job(s) of {user_id}; {pending} now pending or running")


@click.command("requeue")
@click.option("--kind", "kinds", multiple=True, help="only this kind (repeatable); default all")
@click.pass_context
@fails_cleanly
def requeue_command(ctx: click.Context, kinds: tuple[str, ...]) -> None:
    """Queue every finished job again, for every user: after a prompt change."""
    with open_store(ctx, write=True) as store:
        queued = store.requeue(list(kinds) or None)
    click.echo(f"queued {queued} finished job(s) again at prefetch priority")


@click.command("result")
@click.argument("user_id")
@click.argument("kind")
@click.argument("subject")
@click.pass_context
@fails_cleanly
def result_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """The latest result for a key, as JSON (also while a newer one is being made)."""
    with open_store(ctx, write=False) as store:
        result = store.result_of(user_id, kind, subject)
    if result is None:
        click.echo(f"error: no result yet for {user_id!r} {kind}:{subject}", err=True)
        sys.exit(EXIT_FAILURE)
    echo_json(result.as_dict())


@click.command("settings")
@json_option
@click.pass_context
@fails_cleanly
def settings_command(ctx: click.Context, as_json: bool) -> None:
    """Every setting with its environment variable and value (secrets masked), and claiming."""
    settings = settings_from(ctx)
    by_variable = settings.public()
    gate: GateState | None = None
    try:
        with JobStore(settings.database_url, settings=settings, create=False) as store:
            gate = store.gate_state()
    except StoreError as exc:
        gate_line = f"claiming: unknown ({exc})"
    else:
        gate_line = describe_gate(gate)
    if as_json:
        echo_json({"settings": by_variable, "gate": gate.as_dict() if gate else None})
        return
    width = max(len(name) for name in by_variable)
    for name, value in by_variable.items():
        click.echo(f"{name.ljust(width)}  {value}")
    click.echo(gate_line)


@click.command("pause", context_settings={"ignore_unknown_options": True})
@click.argument("seconds", type=click.FloatRange(0, 7 * 24 * 3600))
@click.option("--reason", default="paused by an operator", show_default=True)
@click.pass_context
@fails_cleanly
def pause_command(ctx: click.Context, seconds: float, reason: str) -> None:
    """Stop every worker from claiming for SECONDS (0 to 604800)."""
    with open_store(ctx, write=True) as store:
        until = store.pause(seconds, reason)
    click.echo(f"claiming paused until {iso(until)}")


@click.command("resume")
@click.pass_context
@fails_cleanly
def resume_command(ctx: click.Context) -> None:
    """Lift a pause (an operator's, or one the gateway's answers caused)."""
    with open_store(ctx, write=True) as store:
        store.resume()
    click.echo("claiming resumed")


@click.command("recover")
@click.option("--worker", default=None, help="also take back this worker's own claims")
@click.pass_context
@fails_cleanly
def recover_command(ctx: click.Context, worker: str | None) -> None:
    """Take back claims whose worker is gone (never a live one)."""
    with open_store(ctx, write=True) as store:
        taken = store.recover(worker)
    click.echo(f"took back {len(taken)} claim(s)")
    for job in taken:
        click.echo(f"  {job.run_name} (user {job.user_id}, worker {job.worker})")
