"""The operator's queue page in a real headless Chromium, on SQLite and PostgreSQL.

The store holds a job in every state (running, pending interactive and
prefetch, failed with an error, done), a pause and a consumer; several
values are hostile (markup, a right-to-left override, terminal escapes).
Chromium loads the page with the operator's credentials, and the test reads
the DOM it built: what the operator sees, in the order the worker takes the
jobs, with nothing the app's values could have injected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from deployments.http import create_app
from deployments.http.credentials import Credentials
from deployments.processes import free_port
from deployments.triggers import Triggers
from devtools.stack import ApiServer
from flows.registry import Messages, Registry
from flows.runtime import Runtime
from queue_store import INTERACTIVE, PREFETCH, Failure, JobStore, Redactor, job_id
from tests.support import browser
from tests.support.factories import settings_for, store_for

TOKEN = "page-token-for-tests"
UI = "http://127.0.0.1:4200"
DAY = "2026-11-29"
RUN_ID = "3f2a9c1e-0b6d-4e8f-9a51-7c2d4e6f8a90"
FAILED_RUN_ID = "8d1e2f3a-4b5c-4d6e-8f70-1a2b3c4d5e6f"

HOSTILE_USER = '<img src=x onerror="document.title=1">'
HOSTILE_SUBJECT = "\u202eevil\x1b[31m"
HOSTILE_ERROR = "gateway answered HTTP 400: <script>document.title='owned'</script> & more"
HOSTILE_REASON = "maintenance <b>until</b> 19:00"

# In CI a missing browser fails the run (.ci/run installs Chromium); elsewhere it skips.
pytestmark = pytest.mark.skipif(
    not browser.available() and not os.environ.get("CI"), reason="no Chromium to load the page"
)


def _ask(user_id: str, subject: str) -> Messages:
    return [{"role": "user", "content": f"{user_id}/{subject}"}]


def _claim(store: JobStore, worker: str) -> tuple[str, str]:
    claim = store.claim_next(worker)
    assert claim.job is not None and claim.job.holder is not None
    return claim.job.id, claim.job.holder


def fill(store: JobStore) -> None:
    """One job in every state, a pause and a consumer that says it is alive."""
    store.enqueue("dana", "sleep", DAY, "fp", PREFETCH)
    store.finish(*_claim(store, "consumer-a"), result={"text": "slept well"}, duration_seconds=90)

    store.enqueue("erin", "hrv", DAY, None, PREFETCH)
    jid, holder = _claim(store, "consumer-a")
    store.fail(jid, holder, Failure.REJECTED, HOSTILE_ERROR, flow_run_id=FAILED_RUN_ID)

    store.enqueue(HOSTILE_USER, "steps", DAY, None, PREFETCH)
    jid, holder = _claim(store, "consumer-a")
    store.heartbeat(jid, holder, flow_run_id=RUN_ID)

    store.enqueue("gina", "trends", "2026-11-02..2026-11-29", None, PREFETCH)
    store.enqueue("frank", "sleep", HOSTILE_SUBJECT, None, INTERACTIVE)
    store.pause(900, HOSTILE_REASON)
    store.presence("consumer-a", "consumer", {"busy": [f"steps:{DAY}"]})


@contextlib.contextmanager
def served_page(database_url: str, tmp_path: Path) -> Iterator[str]:
    settings = settings_for(
        database_url=database_url,
        data_dir=tmp_path / "data",
        max_attempts=1,
        api={"operator_token": SecretStr(TOKEN)},
    )
    registry = Registry()
    for kind in ("sleep", "hrv", "steps", "trends"):
        registry.register_generator(kind, _ask)
    runtime = Runtime(
        settings,
        store_for(settings),
        registry,
        Redactor(settings.secrets()),
    )
    try:
        fill(runtime.store)
        triggers = Triggers(runtime, prefect_url=f"http://127.0.0.1:{free_port()}/api")
        app = create_app(triggers, Credentials.load(settings), ui_url=lambda: UI)
        with ApiServer(app) as server:
            yield server.url
    finally:
        runtime.close()


def cells(row: browser.Element) -> dict[str, str]:
    return {td.attributes["data-label"]: td.text for td in row.find_all("td")}


def test_the_queue_page_shows_every_state_and_escapes_every_value(
    database_url: str, tmp_path: Path
) -> None:
    with served_page(database_url, tmp_path) as url:
        authorised = url.replace("http://", f"http://operator:{TOKEN}@", 1)
        dom = browser.parse(browser.dump_dom(f"{authorised}/queue?refresh=0"))
        refreshing = browser.dump_dom(f"{authorised}/queue?refresh=7")
        refused = browser.dump_dom(f"{url}/queue")

    # Nothing from the app became markup: no script, no image, the title untouched.
    assert dom.find_all("script") == [] and dom.find_all("img") == []
    assert dom.find("title").text == "paused · 2 waiting · insight-queue"
    assert dom.find_all("meta", http_equiv="refresh") == []
    assert dom.find("meta", name="viewport").attributes["content"].startswith("width=device")

    banner = dom.find(data_claiming="paused")
    assert banner.attributes["data-pause-kind"] == "operator"
    assert "Claiming is paused" in banner.text and "by an operator" in banner.text
    assert dom.find(data_pause_reason=None).text == f"Reason: {HOSTILE_REASON}"

    tiles = {t.attributes["data-tile"]: t.text for t in dom.find_all(data_tile=None)}
    assert tiles == {
        "in-flight": "1 / 1 in flight / allowed",
        "waiting": "2 waiting",
        "failed": "1 failed",
        "consumers": "1 consumers alive",
    }

    in_flight = dom.find("section", data_section="in-flight").find_all("tr", data_job_id=None)
    assert [r.attributes["data-status"] for r in in_flight] == ["running"]
    running = cells(in_flight[0])
    assert running["User"] == HOSTILE_USER
    assert (running["Kind"], running["Subject"], running["Class"]) == ("steps", DAY, "prefetch")
    assert running["Attempt"] == "1 of 1" and running["Worker"] == "consumer-a"
    assert running["Running for"][0].isdigit() and running["Time left"][0].isdigit()
    link = in_flight[0].find("a")
    assert link.attributes["href"] == f"{UI}/runs/flow-run/{RUN_ID}"
    assert link.attributes["rel"] == "noopener noreferrer"

    waiting = dom.find("section", data_section="waiting").find_all("tr", data_job_id=None)
    assert [r.attributes["data-place"] for r in waiting] == ["1", "2"]
    first, second = (cells(r) for r in waiting)
    assert first["Place"] == "1" and second["Place"] == "2"
    assert (first["User"], first["Kind"], first["Class"]) == ("frank", "sleep", "interactive")
    assert first["Subject"] == "\\u202eevil\\x1b[31m", "controls are shown, not obeyed"
    assert (second["User"], second["Kind"], second["Class"]) == ("gina", "trends", "prefetch")
    assert second["Attempts"] == "0 of 1"
    assert all(c["ETA"][0].isdigit() for c in (first, second))
    assert waiting[0].attributes["data-job-id"] == job_id("frank", "sleep", HOSTILE_SUBJECT)

    failures = dom.find("section", data_section="failures").find_all("tr", data_job_id=None)
    assert [r.attributes["data-status"] for r in failures] == ["failed"]
    failed = cells(failures[0])
    assert (failed["User"], failed["Kind"], failed["Attempts"]) == ("erin", "hrv", "1 of 1")
    assert failed["Reason"] == HOSTILE_ERROR
    assert failures[0].find("a").attributes["href"] == f"{UI}/runs/flow-run/{FAILED_RUN_ID}"

    consumers = dom.find("section", data_section="consumers").find_all("tr", data_worker=None)
    assert [(r.attributes["data-worker"], r.attributes["data-alive"]) for r in consumers] == [
        ("consumer-a", "true")
    ]
    assert cells(consumers[0])["Busy with"] == f"steps:{DAY}"

    done = job_id("dana", "sleep", DAY)
    assert dom.find_all(data_job_id=done) == [], "a finished job is no longer in the queue"

    assert '<meta http-equiv="refresh" content="7">' in refreshing
    # Without credentials Chromium gets the 401 and its challenge: no queue is shown.
    assert "Claiming" not in refused and "consumer-a" not in refused
