"""A consumer in a process of its own, for the fault tests: `python -m tests.support.worker`.

Reads every setting from the environment (`AI_JOB_*`, `AI_GATEWAY_*`), runs one
consumer without Prefect (no run history, no second guard: the tests prove the
store and the self-fencing worker keep the limit on their own) and prints a
JSON summary when it stops. `--standby` keeps it running until SIGTERM/SIGINT;
otherwise it drains. The gateway side is measured elsewhere, never here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from flows.consumer import worker_name
from flows.runtime import Runtime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--standby", action="store_true")
    parser.add_argument("--name", default=None)
    options = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s"
    )
    runtime = Runtime.from_env()
    consumer = runtime.consumer(
        standby=options.standby, worker=options.name or worker_name("test"), role="consumer"
    )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, consumer.stop, signum.name)
        await consumer.run()

    asyncio.run(run())
    summary = consumer.summary
    print(
        json.dumps(
            {
                **summary.as_dict(),
                "worker": consumer.worker,
                "reports": [
                    {
                        "job": r.job.run_name,
                        "outcome": str(r.outcome),
                        "message": r.message,
                        "called": r.called,
                    }
                    for r in summary.reports
                ],
            }
        ),
        flush=True,
    )
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
