"""The bare route `benchmarks/api_load.py` compares the API's poll with.

A Starlette app with one route, `GET /job/{job_id}`: it reads that one row of
`ai_jobs` by primary key through SQLAlchemy (an engine made by
`queue_store.engine.create_store_engine`, the read in the threadpool as the
API's store calls are) and answers it as JSON (404 if there is no such row).
No validation, no middleware, no queue logic: what serving one indexed row
costs on this machine, served by uvicorn with the options `insight-queue api`
uses (no log config, no access log, no server header, the same keep-alive).

The store is `$AI_JOB_DATABASE_URL`, as for the API:

    AI_JOB_DATABASE_URL=sqlite:///... .venv/bin/python benchmarks/bare_route.py --port 8001
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread
import uvicorn
from sqlalchemy import select
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if not __package__:  # run as a script: the project's packages are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deployments.http.serving import (
    GRACEFUL_STOP_SECONDS,
    KEEP_ALIVE_SECONDS,
    STORE_THREADS,
    GuardedH11Protocol,
)
from queue_store import schema
from queue_store.engine import create_store_engine


def shown(value: Any) -> Any:
    """A column's value as JSON can carry it."""
    return value.isoformat() if isinstance(value, dt.datetime) else value


def create_app(url: str) -> Starlette:
    engine = create_store_engine(url)
    jobs = schema.jobs

    def read(jid: str) -> dict[str, Any] | None:
        with engine.connect() as connection, connection.begin():
            row = connection.execute(select(jobs).where(jobs.c.id == jid)).one_or_none()
        return None if row is None else {k: shown(v) for k, v in row._mapping.items()}

    async def job(request: Request) -> Response:
        found = await run_in_threadpool(read, request.path_params["job_id"])
        if found is None:
            return JSONResponse({"error": "no such job"}, 404)
        return JSONResponse(found)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # As many reads at once as the API allows store calls.
        anyio.to_thread.current_default_thread_limiter().total_tokens = STORE_THREADS
        try:
            yield
        finally:
            engine.dispose()

    return Starlette(routes=[Route("/job/{job_id}", job)], lifespan=lifespan)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    url = os.environ.get("AI_JOB_DATABASE_URL", "")
    if not url:
        parser.error("set AI_JOB_DATABASE_URL to the store's URL")
    uvicorn.run(
        create_app(url),
        host=args.host,
        port=args.port,
        http=GuardedH11Protocol,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
