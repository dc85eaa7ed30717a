"""How long the `insight-queue` commands take to start and answer, and which import Prefect.

Runs each command `--runs` times (after one warm-up) on a fresh SQLite store
in a temporary data directory and prints the median and the slowest wall
time, and whether Prefect was imported (from `python -X importtime`).

    .venv/bin/python benchmarks/cli_startup.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
COMMANDS = [
    ["--help"],
    ["settings"],
    ["enqueue", "u1", "sleep", "2026-11-30"],
    ["status", "u1", "sleep", "2026-11-30"],
    ["jobs", "--user", "u1"],
    ["queue", "--json"],
]


def _imports_prefect(args: list[str], env: dict[str, str]) -> bool:
    code = "import sys; from deployments.cli import main; sys.argv[0] = 'insight-queue'; main()"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
    )
    return any(line.split("|")[-1].strip() == "prefect" for line in result.stderr.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="insight-queue-cli-") as directory:
        env = {**os.environ, "AI_JOB_DATA_DIR": directory}
        subprocess.run(
            [str(BIN / "insight-queue"), "db", "upgrade"], env=env, check=True, capture_output=True
        )
        print(f"{'command':<42} {'median s':>9} {'max s':>7}  prefect imported")
        for args in COMMANDS:
            times = []
            for run in range(options.runs + 1):
                started = time.perf_counter()
                subprocess.run(
                    [str(BIN / "insight-queue"), *args], env=env, check=True, capture_output=True
                )
                if run:
                    times.append(time.perf_counter() - started)
            name = "insight-queue " + " ".join(args)
            prefect = "yes" if _imports_prefect(args, env) else "no"
            print(f"{name:<42} {statistics.median(times):>9.3f} {max(times):>7.3f}  {prefect}")
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} (2 cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
