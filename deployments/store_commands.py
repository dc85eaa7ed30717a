"""The store's verbs on the command line, and `forget`. They never import Prefect (but to erase a
forgotten user's runs), and the read-only ones never create a database or a directory."""

from __future__ import annotations

import shutil
import sys
import time

import click

from deployments.cli import (
    EXIT_FAILURE,
    command,
    key_arguments,
    main,
    open_store,
    registry,
    settings_from,
    triggers_for,
)
from deployments.render import as_json as as_json_text
from deployments.render import describe_gate, printable, render_jobs, render_queue
from queue_store import GateState, InvalidArgument, StoreError, job_id, migrate
from queue_store.models import INTERACTIVE, PREFETCH, iso
from queue_store.redact import mask_url

json_option = click.option("--json", "as_json", is_flag=True, help="print JSON")


@main.group("db", short_help="The store's schema: `db upgrade`, `db status`.")
def db_command() -> None:
    """The store's schema."""


@command("upgrade", group=db_command)
def db_upgrade(ctx: click.Context) -> None:
    """Create the schema, or upgrade it (an original ai_jobs table is adopted in place)."""
    settings = settings_from(ctx)
    revision = migrate.upgrade(settings.database_url)
    click.echo(f"{mask_url(settings.database_url)} is at schema revision {revision}")


@command("status", group=db_command)
def db_status(ctx: click.Context) -> None:
    """Say whether the schema is current (creates nothing)."""
    open_store(ctx, write=False).close()  # opening checks the schema
    click.echo(f"{mask_url(settings_from(ctx).database_url)}: schema is current")


@command("enqueue", "Queue one generation, or promote it.")
@key_arguments
@click.option("--fingerprint", help="hash of the data the insight is made from")
@click.option("--interactive", is_flag=True, help=f"a screen is waiting: priority {INTERACTIVE}")
@click.option(
    "--priority",
    type=click.IntRange(0, 1_000_000),
    help=f"lower runs first (interactive {INTERACTIVE}, prefetch {PREFETCH})",
)
@json_option
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
    registry(ctx).check_kind(kind)
    chosen = INTERACTIVE if interactive else PREFETCH if priority is None else priority
    with open_store(ctx, write=True) as store:
        status = store.enqueue(user_id, kind, subject, fingerprint, chosen)
        jid = job_id(user_id, kind, subject)
        job = store.jobs([jid]).get(jid)
    shown = {"status": str(status), "job": job.as_dict() if job else None}
    click.echo(as_json_text(shown) if as_json else status)


@command("status", "One job: status, place, ETA, latest result (JSON).")
@key_arguments
def status_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """One job's status, place in line, ETA and latest result, as JSON."""
    with open_store(ctx, write=False) as store:
        state = store.poll(user_id, kind, subject, queue=False)
    if state is None:
        click.echo(f"error: no job for {user_id!r} {kind}:{subject}", err=True)
        sys.exit(EXIT_FAILURE)
    click.echo(as_json_text(state.as_dict(settings_from(ctx).max_attempts)))


@command("result", "The latest result for a key (JSON).")
@key_arguments
def result_command(ctx: click.Context, user_id: str, kind: str, subject: str) -> None:
    """The latest result for a key, as JSON (also while a newer one is being made)."""
    with open_store(ctx, write=False) as store:
        state = store.poll(user_id, kind, subject, queue=False)
    if state is None or state.result is None:
        click.echo(f"error: no result yet for {user_id!r} {kind}:{subject}", err=True)
        sys.exit(EXIT_FAILURE)
    click.echo(as_json_text(state.result.as_dict()))


@command("jobs", "One user's queue in worker order.")
@click.option("--user", "user_id", required=True, help="whose queue to show")
@click.option("--limit", type=click.IntRange(1, 1000), default=60)
@json_option
def jobs_command(ctx: click.Context, user_id: str, limit: int, as_json: bool) -> None:
    """The user's queue in the order the worker will take it."""
    with open_store(ctx, write=False) as store:
        found = store.list_jobs(user_id, limit)
    most = settings_from(ctx).max_attempts
    listed = [entry.as_dict(most) for entry in found]
    click.echo(as_json_text(listed) if as_json else render_jobs(listed))


@command("queue", "The whole queue at a glance (--json, --watch).")
@click.option("--limit", type=click.IntRange(1, 1000), default=30, help="waiting jobs shown")
@click.option(
    "--watch",
    type=click.FloatRange(0.5, 3600),
    is_flag=False,
    flag_value=2.0,
    metavar="[SECONDS]",
    help="refresh in place every SECONDS (default 2) until Ctrl-C",
)
@json_option
def queue_command(ctx: click.Context, limit: int, watch: float | None, as_json: bool) -> None:
    """The whole queue at a glance: every user, in the order the worker takes them."""
    with open_store(ctx, write=False) as store:
        if watch is None:
            view = store.queue_view(limit)
            click.echo(as_json_text(view.as_dict()) if as_json else render_queue(view))
            return
        try:
            while True:
                view = store.queue_view(limit)
                text = as_json_text(view.as_dict()) if as_json else render_queue(view)
                height = shutil.get_terminal_size((100, 40)).lines
                lines = text.splitlines()[: max(height - 1, 5)]
                # Home the cursor, draw, clear what is left of the old screen.
                click.echo(
                    "\x1b[H" + "\n".join(line + "\x1b[K" for line in lines) + "\x1b[J", nl=False
                )
                time.sleep(watch)
        except KeyboardInterrupt:
            click.echo()


@command("retry-failed", "Put a user's failed jobs back now.")
@click.argument("user_id")
def retry_failed_command(ctx: click.Context, user_id: str) -> None:
    """Put every failed job of the user back in the queue now."""
    with open_store(ctx, write=True) as store:
        done = store.retry_failed(user_id)
    click.echo(
        f"retried {done.retried} failed job(s) of {printable(user_id)}; "
        f"{done.pending} now pending or running"
    )


@command("requeue", "Queue every finished job again (after a prompt change).")
@click.option("--kind", "kinds", multiple=True, help="only this kind (repeatable); default all")
def requeue_command(ctx: click.Context, kinds: tuple[str, ...]) -> None:
    """Queue every finished job again, for every user: after a prompt change."""
    with open_store(ctx, write=True) as store:
        queued = store.requeue(list(kinds) or None)
    click.echo(f"queued {queued} finished job(s) again at prefetch priority")


@command("settings", "Every setting, and whether claiming is paused.")
@json_option
def settings_command(ctx: click.Context, as_json: bool) -> None:
    """Every setting with its environment variable and value (secrets masked), and claiming."""
    public = settings_from(ctx).public()
    gate: GateState | None = None
    try:
        with open_store(ctx, write=False) as store:
            gate = store.gate_state()
    except StoreError as exc:
        gate_line = f"claiming: unknown ({exc})"
    else:
        gate_line = describe_gate(gate)
    if as_json:
        click.echo(as_json_text({"settings": public, "gate": gate.as_dict() if gate else None}))
        return
    width = max(len(name) for name in public)
    for name, value in public.items():
        click.echo(f"{name.ljust(width)}  {value}")
    click.echo(gate_line)


@command(
    "pause",
    "Stop every worker from claiming for SECONDS.",
    context_settings={"ignore_unknown_options": True},
)
@click.argument("seconds", type=click.FloatRange(0, 7 * 24 * 3600))
@click.option("--reason", default="paused by an operator")
def pause_command(ctx: click.Context, seconds: float, reason: str) -> None:
    """Stop every worker from claiming for SECONDS (0 to 604800)."""
    with open_store(ctx, write=True) as store:
        gate = store.pause(seconds, reason)
    click.echo(f"claiming paused until {iso(gate.paused_until)}")


@command("resume", "Lift a pause.")
def resume_command(ctx: click.Context) -> None:
    """Lift a pause (an operator's, or one the gateway's answers caused)."""
    with open_store(ctx, write=True) as store:
        store.resume()
    click.echo("claiming resumed")


@command("recover", "Take back claims whose worker is gone.")
@click.option("--worker", help="also take back this worker's own claims")
def recover_command(ctx: click.Context, worker: str | None) -> None:
    """Take back claims whose worker is gone (never a live one)."""
    with open_store(ctx, write=True) as store:
        taken = store.recover(worker)
    click.echo(f"took back {len(taken)} claim(s)")
    for job in taken:
        who = f"user {printable(job.user_id)}, worker {job.worker}"
        click.echo(f"  {printable(job.run_name)} ({who})")


@command("prune", "Delete what is past retention (--dry-run counts).")
@click.option("--dry-run", is_flag=True, help="count what would be deleted, delete nothing")
@click.option(
    "--days",
    type=click.FloatRange(min=0, min_open=True),
    help="keep this many days (default AI_JOB_RETENTION_DAYS)",
)
def prune_command(ctx: click.Context, dry_run: bool, days: float | None) -> None:
    """Delete what is past retention: finished jobs and their results, who used tokens (kept as
    daily totals), people with nothing left (JSON). Also an hourly run of `serve` and `deploy`,
    which erases the run history of forgotten users too."""
    by_kind = registry(ctx).retention()
    with open_store(ctx, write=not dry_run) as store:
        pruned = store.prune(retention_days=days, by_kind=by_kind, dry_run=dry_run)
    kept = days or settings_from(ctx).retention_days
    click.echo(as_json_text(pruned.as_dict() | {"retention_days": kept}))


@command("forget", "Erase a user from the store and the run history.")
@click.argument("user_id")
def forget_command(ctx: click.Context, user_id: str) -> None:
    """Erase USER: their rows from the store at once (a call of theirs in flight is cut), then
    their runs from Prefect, now or at the next forget or prune if it is away (JSON; idempotent)."""
    with triggers_for(ctx) as triggers:
        click.echo(as_json_text(triggers.forget(user_id).as_dict()))
