"""The store is a pure library: it never imports Prefect, httpx, flows or deployments."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import queue_store

FORBIDDEN = ("prefect", "httpx", "flows", "deployments")


def test_queue_store_source_never_imports_the_outer_layers() -> None:
    package = Path(queue_store.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            offenders += [
                f"{path.name}: {name}" for name in names if name.split(".")[0] in FORBIDDEN
            ]
    assert offenders == []


def test_importing_the_store_loads_none_of_them() -> None:
    code = (
        "import sys, queue_store, queue_store.cli, queue_store.migrate;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
