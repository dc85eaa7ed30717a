"""Plain Prefect for the latency baseline: a served flow whose one task calls the gateway.

`python -m benchmarks.baseline_flow` serves it; the gateway's address comes
from `BASELINE_GATEWAY_URL`.
"""

from __future__ import annotations

import os
from collections.abc import Coroutine

import httpx
from prefect import flow, serve, task


@task(name="call-gateway")
def call(subject: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": subject}]}
    url = os.environ["BASELINE_GATEWAY_URL"].rstrip("/") + "/v1/chat/completions"
    return httpx.post(url, json=body, timeout=60).status_code


@flow(name="baseline-call")
def baseline_call(subject: str) -> int:
    return call(subject)


if __name__ == "__main__":
    deployment = baseline_call.to_deployment(name="baseline")
    assert not isinstance(deployment, Coroutine)
    serve(deployment, print_starting_message=False)
