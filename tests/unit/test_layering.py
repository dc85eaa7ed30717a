"""The layers import downwards only: the store nothing of ours, flows not deployments, and
the product never the development tools."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import queue_store

FORBIDDEN = ("prefect", "httpx", "flows", "deployments")
ROOT = Path(queue_store.__file__).parents[1]
LAYERS = {
    "queue_store": (*FORBIDDEN, "devtools"),
    "flows": ("deployments", "devtools"),
    "deployments": ("devtools",),
}


@pytest.mark.parametrize("package", list(LAYERS))
def test_no_layer_imports_one_above_it(package: str) -> None:
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if name.split(".")[0] in LAYERS[package]
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
