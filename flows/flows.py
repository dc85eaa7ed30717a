"""The Prefect flows: a backfill, a screen's run, the drain, a generation's record, retention.
A backfill and a screen's run follow their jobs and tell their story, draining the queue
themselves when no warm consumer stands by. They know a user only by a pseudonym (D4)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import signal
import time
import uuid
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
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
from prefect.states import Completed, Failed

from flows.consumer import Consumer, worker_name
from flows.guard import PrefectSlotGuard
from flows.history import PrefectLedger, erase_runs
from flows.ledger import QUOTED_ELSEWHERE
from flows.registry import Scope
from flows.runtime import Runtime
from queue_store import INTERACTIVE, Job, Status, StoreError, job_id

FOLLOW_POLL_SECONDS = 1.0  # how often a following run looks at its jobs (a read-only query)
FOLLOW_LIMIT_SECONDS = 24 * 3600.0  # then it gives up and says where its jobs stand
FORGOTTEN = "this user was forgotten: nothing to do"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "x"


@contextlib.contextmanager
def _runtime() -> Iterator[Runtime]:
    """This run's runtime, from its environment, its secrets kept out of every log."""
    with Runtime.open() as rt:
        rt.redact_logs()
        yield rt


@contextlib.asynccontextmanager
async def _draining(rt: Runtime, role: str, **options: Any) -> AsyncIterator[Consumer]:
    """A consumer for this run, which SIGTERM and SIGINT stop cleanly (L4)."""
    consumer, ledger = prefect_consumer(rt, role, parent=flow_run.get_id(), **options)
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as handlers:
        for signum in (signal.SIGTERM, signal.SIGINT):
            # Refused off the main thread: the caller's own handling applies.
            with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
                loop.add_signal_handler(signum, consumer.stop, f"signal {signum.name}")
                handlers.callback(loop.remove_signal_handler, signum)
        yield consumer
    await ledger.flush()


@contextlib.asynccontextmanager
async def _consuming(rt: Runtime, *, role: str) -> AsyncIterator[Consumer | None]:
    """A draining consumer for this run, unless a warm one stands by (then None)."""
    warm = False
    with contextlib.suppress(StoreError):
        warm = bool((await asyncio.to_thread(rt.store.gate_state)).standing_by)
    if warm:
        yield None
        return
    async with _draining(rt, role) as consumer:
        yield consumer


def prefect_consumer(
    rt: Runtime,
    role: str,
    *,
    worker: str | None = None,
    parent: str | None = None,
    on_change: Callable[[frozenset[str]], None] | None = None,
    **options: Any,
) -> tuple[Consumer, PrefectLedger]:
    """A consumer that holds `gateway` slots and writes each attempt as a `generate` run."""
    worker = worker or worker_name(role)
    ledger = PrefectLedger(worker, rt.redactor, generate, parent_flow_run_id=parent)
    guard = PrefectSlotGuard(rt.settings.lease_seconds, on_change=on_change)
    return rt.consumer(role=role, ledger=ledger, guard=guard, worker=worker, **options), ledger


@flow(name="backfill", flow_run_name="backfill:{user}", log_prints=False)
async def backfill(user: str) -> State[Any]:
    """After a data sync: queue the scopes of the user (`user`: a pseudonym), see them through."""
    with _runtime() as rt:
        user_id = await asyncio.to_thread(rt.store.user_of, user)
        if user_id is None:
            return Completed(message=FORGOTTEN)
        log = get_run_logger()
        scopes = rt.registry.scopes_for(user_id)
        requests = [s.request(user_id) for s in scopes]
        statuses = await asyncio.to_thread(rt.store.enqueue_many, requests)
        ids = [job_id(user_id, s.kind, s.subject) for s in scopes]
        queued = collections.Counter(str(s) for s in statuses)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(queued.items()))
        log.info("queued %d scope(s) of %s: %s", len(ids), user, counts)
        key = f"backfill-{_slug(user)}"
        progress = await acreate_progress_artifact(
            0.0, key=f"{key}-progress", description=f"Scopes of {user} finished"
        )
        async with _consuming(rt, role="backfill") as consumer:
            jobs = await _follow(rt, ids, progress, consumer)
        rows = [_scope_row(s, jobs.get(i)) for s, i in zip(scopes, ids, strict=True)]
        await acreate_table_artifact(rows, key=f"{key}-scopes", description=f"Scopes of {user}")
        ended = collections.Counter(row["status"] for row in rows)
        done, failed = ended["done"], ended["failed"]
        summary = f"{done} done" + (f", {failed} failed" if failed else "")
        if unfinished := len(rows) - done - failed - ended["superseded"]:
            summary += f", {unfinished} still queued"
        log.info("backfill of %s: %s", user, summary)
        return Failed(message=summary) if failed else Completed(message=summary)


@flow(name="interactive", flow_run_name="{kind}:{subject}", log_prints=False)
async def interactive(user: str, kind: str, subject: str) -> State[Any]:
    """A screen is open: put its insight at the front and tell the screen's story."""
    with _runtime() as rt:
        user_id = await asyncio.to_thread(rt.store.user_of, user)
        if user_id is None:
            return Completed(message=FORGOTTEN)
        asked = time.time()
        status = await asyncio.to_thread(
            rt.store.enqueue, user_id, kind, subject, None, INTERACTIVE
        )
        jid = job_id(user_id, kind, subject)
        if status == Status.DONE:
            job = (await asyncio.to_thread(rt.store.jobs, [jid])).get(jid)
            made = ""
            if job is not None and job.flow_run_id:
                made = f" Generated by run [{job.run_name}]({_run_url(job.flow_run_id)})."
            await _story(kind, f"Already generated for this data; nothing to do.{made}")
            return Completed(message="already done for this data")
        async with _consuming(rt, role="screen") as consumer:
            job = (await _follow(rt, [jid], None, consumer)).get(jid)
        waited = time.time() - asked
        state = await asyncio.to_thread(rt.store.poll, user_id, kind, subject, queue=False)
        result = state.result if state is not None else None
        made_by = (result.flow_run_id if result else None) or (job.flow_run_id if job else None)
        link = f"[{kind}:{subject}]({_run_url(made_by)})" if made_by else "(no run recorded)"
        story = f"**{kind}:{subject}** for user `{user}`\n\n"
        if job is not None and job.status == Status.DONE:
            asked_at = time.strftime("%H:%M:%S UTC", time.gmtime(asked))
            story += (
                f"- generated by run {link}\n"
                f"- the screen asked at {asked_at}; the result was ready after **{waited:.1f} s**\n"
                f"- attempts: {job.attempts}\n"
            )
            served = f"served in {waited:.1f} s by generation run {made_by or '?'}"
            outcome: State[Any] = Completed(message=served)
        else:
            why = _shown("the job is gone" if job is None else job.error or f"still {job.status}")
            story += f"- not generated: {why}\n- last attempt: {link}\n"
            story += f"- the screen waited {waited:.1f} s\n"
            outcome = Failed(message=f"not served after {waited:.0f} s: {why}"[:500])
        await _story(kind, story)
        get_run_logger().info("%s:%s for %s: %s", kind, subject, user, outcome.message)
        return outcome


@flow(name="generate", flow_run_name="{kind}:{subject}", log_prints=False)
async def generate(
    user: str, kind: str, subject: str, attempt: int | None = None, worker: str | None = None
) -> State[Any]:
    """An attempt's record, written by its consumer; run by hand, it asks as a screen does."""
    return await interactive.fn(user, kind, subject)


@flow(name="drain", log_prints=False)
async def drain(max_jobs: int | None = None) -> dict[str, Any]:
    """Run what is runnable in priority order, then stop (the safety net of a work pool)."""
    with _runtime() as rt:
        async with _draining(rt, "drain", max_jobs=max_jobs) as consumer:
            summary = await consumer.run()
        get_run_logger().info("drained: %s", summary.as_dict())
        return summary.as_dict()


@flow(name="prune", log_prints=False)
async def prune(dry_run: bool = False) -> dict[str, Any]:
    """Retention (D2), and the erasure of runs left while the run history was away (D3)."""
    with _runtime() as rt:
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
    rt: Runtime, ids: list[str], progress: uuid.UUID | None, consumer: Consumer | None
) -> dict[str, Job]:
    """Watch these jobs until each is done, failed or gone (counted on `progress`); returns their
    last rows. A `consumer` drains meanwhile (what it cannot run now, a warm consumer or a retry
    will); once they are settled it takes nothing new, and ends with its call."""
    drain = asyncio.create_task(consumer.run()) if consumer is not None else None
    deadline = time.monotonic() + FOLLOW_LIMIT_SECONDS
    latest: dict[str, Job] = {}
    shown = -1
    settled = False
    try:
        while time.monotonic() < deadline:
            try:
                latest = await asyncio.to_thread(rt.store.jobs, ids)
            except StoreError:
                await asyncio.sleep(FOLLOW_POLL_SECONDS)
                continue
            ended = (Status.DONE, Status.FAILED)
            finished = sum(1 for i in ids if i not in latest or latest[i].status in ended)
            if progress is not None and finished != shown:
                shown = finished
                with contextlib.suppress(Exception):
                    await aupdate_progress_artifact(progress, 100.0 * finished / max(len(ids), 1))
            if settled := finished == len(ids):
                break
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


def _scope_row(scope: Scope, job: Job | None) -> dict[str, Any]:
    """A row of a backfill's table: a scope, and its job (None: superseded, gone)."""
    return {
        "kind": scope.kind,
        "subject": scope.subject,
        "status": str(job.status) if job is not None else "superseded",
        "attempts": job.attempts if job is not None else 0,
        "generated_by": _run_url(job.flow_run_id) if job and job.flow_run_id else "",
        "error": _shown(job.error or "")[:200] if job is not None else "",
    }


async def _story(kind: str, story: str) -> None:
    await acreate_markdown_artifact(
        story, key=f"screen-{_slug(kind)}", description="The screen's story"
    )


# Where a job's error starts quoting the gateway's body or a generator's exception.
_QUOTING = re.compile(r"^(.*?\(HTTP \d{3}\)|generator '[^']*' failed [a-z ]+: \w+)(: .*)$", re.S)


def _shown(error: str) -> str:
    """A job's error, a gateway's or a generator's own words left in the store (D4)."""
    quoting = _QUOTING.match(error)
    return f"{quoting.group(1)} {QUOTED_ELSEWHERE}" if quoting else error


def _run_url(run_id: str) -> str:
    """Where a flow run is in the UI of the Prefect API this process reports to."""
    api = PREFECT_API_URL.value()
    ui = str(PREFECT_UI_URL.value() or (str(api).removesuffix("/api") if api else ""))
    return f"{ui.rstrip('/')}/runs/flow-run/{run_id}"
