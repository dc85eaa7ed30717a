"""A forgotten user is in no byte of the data directory and no row of Prefect's database (D3, D4).

The embedded layout: the store (`queue.db` and its WAL) and a Prefect server whose home, and
so its database, is the data directory's `prefect/`. `serve` works through a backfill of two
users on the gateway simulator, which quotes the start of each prompt in its answer, so every
answer of the forgotten user carries their id: the canary. After `insight-queue forget`, with
`serve` and Prefect still running, the canary must be in no file of the data directory (read
as raw bytes) and in no row of Prefect's runs, logs and artifacts; the other user's insights
stay. Before the forget the same search finds the canary in the store's files, so a search
that reads nothing cannot pass.
"""

from __future__ import annotations

import json
import secrets
import signal
import sqlite3
from pathlib import Path

import pytest

from deployments import table
from deployments.prefect_api import PrefectApi
from deployments.processes import free_port
from devtools.stack import ServeProcess
from queue_store import Status
from tests.support import waiting
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of, result_of
from tests.support.services import ROOT, PrefectServer, client_env, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

SUBJECTS = ("day-1", "day-2", "day-3")


def data_bytes(directory: Path) -> dict[str, bytes]:
    """Every file under the data directory, as raw bytes (SQLite's WAL and -shm included)."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def files_with(found: dict[str, bytes], word: str) -> list[str]:
    return sorted(name for name, content in found.items() if word.encode() in content)


def prefect_rows_with(database: Path, word: str) -> dict[str, int]:
    """Rows of Prefect's runs, logs and artifacts (every column, as text) that contain `word`."""
    counts: dict[str, int] = {}
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
        for name in ("flow_run", "task_run", "log", "artifact", "artifact_collection"):
            columns = [row[1] for row in connection.execute(f"PRAGMA table_info({name})")]
            joined = " || ' ' || ".join(f"coalesce(CAST({c} AS TEXT), '')" for c in columns)
            query = f"SELECT count(*) FROM {name} WHERE instr({joined}, ?) > 0"
            counts[name] = int(connection.execute(query, (word,)).fetchone()[0])
    return {name: n for name, n in counts.items() if n}


def test_after_forget_the_user_is_in_no_file_of_the_data_directory_and_no_prefect_row(
    tmp_path: Path,
) -> None:
    canary = f"canary-{secrets.token_hex(8)}"
    keeper = f"keeper-{secrets.token_hex(8)}"
    data = tmp_path / "data"
    with Gateway(latency=0.2) as gateway:
        settings = settings_for(
            data_dir=data,
            gap_seconds=0.1,
            plugins="tests.support.plugins",
            gateway={"url": gateway.url},
        )
        prefect = PrefectServer(data / "prefect", free_port(), ui=False).start()
        serve = ServeProcess(
            settings, prefect.api_url, env={"PYTHONPATH": str(ROOT)}, log=tmp_path / "serve.log"
        )
        api = PrefectApi(prefect.api_url)
        store = store_for(settings)
        try:
            serve.start()
            for user in (canary, keeper):
                for subject in SUBJECTS:
                    store.enqueue(user, "ok", subject)
                who = next(e.job.pseudonym for e in store.list_jobs(user) if e.job.pseudonym)
                api.create_run(
                    table.BACKFILL.name,
                    {"user": who},
                    name=f"backfill:{who}",
                    tags=[f"user:{who}"],
                    idempotency_key=f"forget-{who}",
                )

            def all_done() -> bool:
                jobs = [job_of(store, u, "ok", s) for u in (canary, keeper) for s in SUBJECTS]
                return all(j is not None and j.status == Status.DONE for j in jobs)

            waiting.wait_for(all_done, 120, "every insight made")
            result = result_of(store, canary, "ok", "day-1")
            assert result is not None and canary in json.dumps(result.output)  # the canary
            assert files_with(data_bytes(data), canary)  # the search finds what is there

            env = {
                **settings.to_env(),
                **client_env(prefect.api_url, data / "prefect"),
                "PYTHONPATH": str(ROOT),
            }
            printed = run_cli("forget", canary, env=env).stdout
            forgotten = json.loads(printed)
            assert forgotten["jobs"] == len(SUBJECTS) and forgotten["history_pending"] == 0
            assert forgotten["history_note"] is None

            database = data / "prefect" / "prefect.db"
            # Prefect deletes a deleted run's logs in a task of its own, soon after.
            waiting.wait_for(
                lambda: not prefect_rows_with(database, str(forgotten["pseudonym"])),
                60,
                "the forgotten user's runs, logs and artifacts gone",
            )
            assert prefect_rows_with(database, canary) == {}
            assert files_with(data_bytes(data), canary) == []
            # The other user's insights, and their runs, stay.
            for subject in SUBJECTS:
                kept = result_of(store, keeper, "ok", subject)
                assert kept is not None and keeper in json.dumps(kept.output)
            who_else = next(e.job.pseudonym for e in store.list_jobs(keeper) if e.job.pseudonym)
            assert prefect_rows_with(database, str(who_else)).get("flow_run", 0) >= 1

            assert serve.process is not None
            serve.process.send_signal(signal.SIGTERM)
            serve.process.wait(30)
            serve.process = None
            # Stopped, with everything flushed: still nowhere.
            assert files_with(data_bytes(data), canary) == []
        finally:
            store.close()
            api.close()
            serve.stop()
            prefect.stop()
