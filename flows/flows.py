"""The Prefect flows: a backfill, a screen's run, the drain, a generation's record, retention.

Each attempt is a `generate` run of its own (`flows.history`), so a backfill and a screen's
run are about the people who asked: they follow their jobs and tell their story. When a warm
consumer stands by they only follow; when none does, they drain the queue themselves.

Prefect sees a user only as the pseudonym the store keeps for them (D4): runs take it as their
`user` parameter and look the user up in the store; a forgotten user's pseudonym stands for no
one, and such a run ends at once. Run names, parameters, logs and artifacts carry pseudonyms,
kinds and subjects, never a prompt, an answer or a user's id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)
from prefect.client.schemas.objects import State
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from flows.consumer import Consumer, worker_name
from flows.guard import PrefectSlotGuard
from flows.history import PrefectLedger, erase_runs, run_url
from flows.runtime import Runtime
from queue_store import INTERACTIVE, Job, Status, StoreError, job_id

# How often a following run looks at its jobs (a read-only query).
FOLLOW_POLL_SECONDS = 1.0
# A following run gives up after this long and says where its jobs stand.
FOLLOW_LIMIT_SECONDS = 24 * 3600.0


def _slug(text: str) -> str:
    """An artifact key from free text: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "x"


@contextlib.contextmanager
def _runtime() -> Iterator[Runtime]:
    """This run's runtime, from its environment, its secrets kept out of every log."""
    with Runtime.open() as rt:
        rt.redact_logs()
        yield rt


@contextlib.contextmanager
def _stop_on_signals(consumer: Consumer) -> Iterator[None]:
    """While a flow consumes, SIGTERM/SIGINT stop its calls cleanly (L4)."""
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        # Refused off the main thread: the caller's own handling applies.
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(signum, consumer.stop, f"signal {signum.name}")
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


@contextlib.asynccontextmanager
async def _consuming(rt: Runtime, *, role: str) -> AsyncIterator[Consumer | None]:
    """A draining consumer for this run, unless a warm one stands by (then None)."""
    try:
        warm = bool((await asyncio.to_thread(rt.store.gate_state)).standing_by)
    except StoreError:
        warm = False
    if warm:
        yield None
        return
    consumer, ledger = prefect_consumer(rt, role, parent=flow_run.get_id())
    with _stop_on_signals(consumer):
        yield consumer
    await ledger.flush()


def prefect_consumer(
    rt: Runtime,
    role: str,
    *,
    worker: str | None = None,
    parent: str | None = None,
    on_change: Callable[[frozenset[str]], None] | None = None,
    **options: Any,
) -> tuple[Consumer, PrefectLedger]:
    """A consumer that holds `gateway` slots and writes each attempt as a `generate` run
    (of the flow run `parent`, if any); `on_change` as `PrefectSlotGuard` takes it."""
    worker = worker or worker_name(role)
    ledger = PrefectLedger(worker, rt.redactor, generate, parent_flow_run_id=parent)
    guard = PrefectSlotGuard.for_settings(rt.settings, on_change=on_change)
    return rt.consumer(role=role, ledger=ledger, guard=guard, worker=worker, **options), ledger


@dataclasses.dataclass
class _Scope:
    kind: str
    subject: str
    job_id: str
    queued: str


FORGOTTEN = "this user was forgotten: nothing to do"


def _user_of(rt: Runtime, pseudonym: str) -> str | None:
    """The user a run's pseudonym stands for (None once forgotten)."""
    return rt.store.user_of(pseudonym)


@flow(name="backfill", flow_run_name="backfill:{user}", log_prints=False)
async def backfill(user: str) -> State[Any]:
    """After a data sync: queue the user's scopes at prefetch priority and see them through.
    `user` is the user's pseudonym."""
    with _runtime() as rt:
        user_id = await asyncio.to_thread(_user_of, rt, user)
        if user_id is None:
            return Completed(message=FORGOTTEN)
        return await _backfill(rt, user_id, user)


async def _backfill(rt: Runtime, user_id: str, pseudonym: str) -> State[Any]:
    log = get_run_logger()
    scopes = rt.registry.scopes_for(user_id)
    requests = [s.request(user_id) for s in scopes]
    statuses = await asyncio.to_thread(rt.store.enqueue_many, requests)
    tracked = [
        _Scope(s.kind, s.subject, job_id(user_id, s.kind, s.subject), str(status))
        for s, status in zip(scopes, statuses, strict=True)
    ]
    log.info("queued %d scope(s) of %s: %s", len(tracked), pseudonym, _counts(statuses))
    key = f"backfill-{_slug(pseudonym)}"
    progress = await acreate_progress_artifact(
        0.0, key=f"{key}-progress", description=f"Scopes of {pseudonym} finished"
    )

    async def show(done: int) -> None:
        await aupdate_progress_artifact(progress, 100.0 * done / max(len(tracked), 1))

    async with _consuming(rt, role="backfill") as consumer:
        jobs = await _follow(rt, [t.job_id for t in tracked], show, consumer)
    rows, done, failed = _scope_rows(tracked, jobs, _ui_url())
    await acreate_table_artifact(rows, key=f"{key}-scopes", description=f"Scopes of {pseudonym}")
    summary = f"{done} done" + (f", {failed} failed" if failed else "")
    unfinished = len(tracked) - done - failed - sum(1 for r in rows if r["status"] == "superseded")
    if unfinished:
        summary += f", {unfinished} still queued"
    log.info("backfill of %s: %s", pseudonym, summary)
    return Failed(message=summary) if failed else Completed(message=summary)


@flow(name="interactive", flow_run_name="{kind}:{subject}", log_prints=False)
async def interactive(user: str, kind: str, subject: str) -> State[Any]:
    """A screen is open: put its insight at the front and tell the screen's story. `user` is
    the user's pseudonym."""
    with _runtime() as rt:
        user_id = await asyncio.to_thread(_user_of, rt, user)
        if user_id is None:
            return Completed(message=FORGOTTEN)
        return await _interactive(rt, user_id, user, kind, subject)


async def _interactive(
    rt: Runtime, user_id: str, pseudonym: str, kind: str, subject: str
) -> State[Any]:
    log = get_run_logger()
    asked = time.time()
    status = await asyncio.to_thread(rt.store.enqueue, user_id, kind, subject, None, INTERACTIVE)
    jid = job_id(user_id, kind, subject)
    if status == Status.DONE:
        job = (await asyncio.to_thread(rt.store.jobs, [jid])).get(jid)
        await _story(kind, f"Already generated for this data; nothing to do.{_made_by(job)}")
        return Completed(message="already done for this data")
    async with _consuming(rt, role="screen") as consumer:
        jobs = await _follow(rt, [jid], None, consumer)
    job = jobs.get(jid)
    waited = time.time() - asked
    state = await asyncio.to_thread(rt.store.poll, user_id, kind, subject, queue=False)
    result = state.result if state is not None else None
    ui = _ui_url()
    made_by = (result.flow_run_id if result else None) or (job.flow_run_id if job else None)
    link = f"[{kind}:{subject}]({run_url(ui, made_by)})" if made_by else "(no run recorded)"
    if job is not None and job.status == Status.DONE:
        asked_at = time.strftime("%H:%M:%S UTC", time.gmtime(asked))
        story = (
            f"**{kind}:{subject}** for user `{pseudonym}`\n\n"
            f"- generated by run {link}\n"
            f"- the screen asked at {asked_at}; the result was ready "
            f"after **{waited:.1f} s**\n"
            f"- attempts: {job.attempts}\n"
        )
        outcome: State[Any] = Completed(
            message=f"served in {waited:.1f} s by generation run {made_by or '?'}"
        )
    else:
        why = (job.error if job else None) or (f"still {job.status}" if job else "the job is gone")
        story = (
            f"**{kind}:{subject}** for user `{pseudonym}`\n\n"
            f"- not generated: {_shown(why)}\n- last attempt: {link}\n"
            f"- the screen waited {waited:.1f} s\n"
        )
        outcome = Failed(message=f"not served after {waited:.0f} s: {_shown(why)}"[:500])
    await _story(kind, story)
    log.info("%s:%s for %s: %s", kind, subject, pseudonym, outcome.message)
    return outcome


@flow(name="generate", flow_run_name="{kind}:{subject}", log_prints=False)
async def generate(
    user: str,
    kind: str,
    subject: str,
    attempt: int | None = None,
    worker: str | None = None,
) -> State[Any]:
    """One generation of an insight: the run history's record of each attempt.

    A consumer makes the call first and records the attempt as a run of this
    flow beside it (`flows.history`), with the user's pseudonym, the attempt and
    the worker as parameters. Run by hand, it asks for the insight as a screen
    does and sees it through.
    """
    return await interactive.fn(user, kind, subject)


@flow(name="drain", log_prints=False)
async def drain(max_jobs: int | None = None) -> dict[str, Any]:
    """Run what is runnable in priority order, then stop (the safety net of a work pool)."""
    with _runtime() as rt:
        return await _drain(rt, max_jobs)


async def _drain(rt: Runtime, max_jobs: int | None) -> dict[str, Any]:
    consumer, ledger = prefect_consumer(rt, "drain", parent=flow_run.get_id(), max_jobs=max_jobs)
    with _stop_on_signals(consumer):
        summary = await consumer.run()
    await ledger.flush()
    get_run_logger().info("drained: %s", summary.as_dict())
    return summary.as_dict()


@flow(name="prune", log_prints=False)
async def prune(dry_run: bool = False) -> dict[str, Any]:
    """Retention (D2, D3): delete from the store what is past its time, in short chunks, and
    from the run history the runs of users forgotten while it was away. Its result and log say
    how many of each; with `dry_run`, what would go."""
    with _runtime() as rt:
        return await _prune(rt, dry_run)


async def _prune(rt: Runtime, dry_run: bool) -> dict[str, Any]:
    log = get_run_logger()
    pruned = await asyncio.to_thread(
        rt.store.prune, by_kind=rt.registry.retention(), dry_run=dry_run
    )
    shown = pruned.as_dict()
    if not dry_run:
        pending = (await asyncio.to_thread(rt.store.forget)).history_pending
        erased, why = await erase_runs(list(pending))
        if erased:
            await asyncio.to_thread(rt.store.forget, erased=erased)
        shown |= {
            "forgotten_users_erased": len(erased),
            "erasures_left": len(pending) - len(erased),
        }
        if why:
            log.warning("%s", why)
    log.info("retention: %s", shown)
    return shown


async def _follow(
    rt: Runtime, ids: list[str], show: Any, consumer: Consumer | None
) -> dict[str, Job]:
    """Watch these jobs until each is done, failed or gone; returns their last rows.

    With `consumer`, this run drains the queue meanwhile; once its own jobs are settled it
    takes nothing new, and a call it has in flight for another job ends before the run does."""
    drain = asyncio.create_task(consumer.run()) if consumer is not None else None
    deadline = time.monotonic() + FOLLOW_LIMIT_SECONDS
    latest: dict[str, Job] = {}
    shown = -1
    settled = False
    try:
        while time.monotonic() < deadline:
            try:
                found = await asyncio.to_thread(rt.store.jobs, ids)
            except StoreError:
                await asyncio.sleep(FOLLOW_POLL_SECONDS)
                continue
            latest = found
            finished = sum(
                1 for i in ids if i not in found or found[i].status in (Status.DONE, Status.FAILED)
            )
            if show is not None and finished != shown:
                shown = finished
                with contextlib.suppress(Exception):
                    await show(finished)
            if finished == len(ids):
                settled = True
                break
            if drain is not None and drain.done():
                drain = None  # nothing more it can run now; a warm consumer or a retry will
            await asyncio.sleep(FOLLOW_POLL_SECONDS)
    finally:
        if drain is not None and not drain.done():
            assert consumer is not None
            if settled:
                consumer.finish_current("this run's jobs are settled")
            else:
                drain.cancel()
            await asyncio.gather(drain, return_exceptions=True)
    return latest


def _scope_rows(
    tracked: list[_Scope], jobs: dict[str, Job], ui: str | None
) -> tuple[list[dict[str, Any]], int, int]:
    rows, done, failed = [], 0, 0
    for t in tracked:
        job = jobs.get(t.job_id)
        if job is None:
            status, run, error, attempts = "superseded", "", "", 0
        else:
            status, error, attempts = str(job.status), job.error or "", job.attempts
            run = run_url(ui, job.flow_run_id) if job.flow_run_id else ""
            done += job.status == Status.DONE
            failed += job.status == Status.FAILED
        rows.append(
            {
                "kind": t.kind,
                "subject": t.subject,
                "status": status,
                "attempts": attempts,
                "generated_by": run,
                "error": _shown(error)[:200],
            }
        )
    return rows, done, failed


def _counts(statuses: list[Status]) -> str:
    counts = collections.Counter(str(s) for s in statuses)
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


async def _story(kind: str, story: str) -> None:
    await acreate_markdown_artifact(
        story, key=f"screen-{_slug(kind)}", description="The screen's story"
    )


# Where a job's error starts quoting the gateway's body or a generator's exception.
_QUOTING = re.compile(r"^(.*?\(HTTP \d{3}\)|generator '[^']*' failed [a-z ]+: \w+)(: .*)$", re.S)


def _shown(error: str) -> str:
    """A job's error as a run may show it: a gateway's or a generator's own words stay in the
    store (they may quote a prompt or an answer, D4)."""
    quoting = _QUOTING.match(error)
    return f"{quoting.group(1)} (its words are in the store's error)" if quoting else error


def _made_by(job: Job | None) -> str:
    if job is None or not job.flow_run_id:
        return ""
    return f" Generated by run [{job.run_name}]({run_url(_ui_url(), job.flow_run_id)})."


def _ui_url() -> str | None:
    """The Prefect UI's address, from the API this process reports to."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    if ui:
        return str(ui)
    api = PREFECT_API_URL.value()
    return str(api).removesuffix("/api") if api else None
