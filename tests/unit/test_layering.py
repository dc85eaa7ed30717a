"""The layers import downwards only: the store nothing of ours (nor click: it is a library),
flows not deployments, and the product never the development tools; no module imports itself
back through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import queue_store

FORBIDDEN = ("prefect", "httpx", "click", "flows", "deployments")
ROOT = Path(queue_store.__file__).parents[1]
PACKAGES = ("queue_store", "flows", "deployments")
LAYERS = {
    "queue_store": (*FORBIDDEN, "devtools"),
    "flows": ("deployments", "devtools"),
    "deployments": ("devtools",),
}


def imported(path: Path, *, top_level_only: bool = False) -> list[str]:
    """The modules a file imports (with `top_level_only`, only those its import runs)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


@pytest.mark.parametrize("package", list(LAYERS))
def test_no_layer_imports_one_above_it(package: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / package).rglob("*.py")
        for name in imported(path)
        if name.split(".")[0] in LAYERS[package]
    ]
    assert offenders == []


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle() -> None:
    """Module-level imports of the product form no cycle (an import inside a function, made
    when it runs, does not count)."""
    paths = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    modules = {_module(p): p for p in paths}
    graph = {
        name: {m for m in imported(path, top_level_only=True) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package imports its own modules as it starts: only edges between siblings count.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if target.startswith(f"{name}.") or name.startswith(f"{target}."):
                continue
            if state.get(target) == 1:
                cycles.append([*trail[trail.index(target) :], target])
            elif target not in state:
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_importing_the_store_loads_none_of_them() -> None:
    code = (
        "import sys, queue_store, queue_store.migrate;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# -- rooms with one job each -------------------------------------------------------------

MAX_STORE_NAMES = 22
MAX_PRODUCT_FILE_LINES = 600


def test_the_store_has_a_small_surface_and_satisfies_every_role() -> None:
    from queue_store import JobStore, OperatorStore, ScreenStore, WorkerStore

    public = [name for name in dir(JobStore) if not name.startswith("_")]
    assert len(public) <= MAX_STORE_NAMES, public
    for role in (WorkerStore, ScreenStore, OperatorStore):
        assert issubclass(JobStore, role), role.__name__
        missing = [name for name in _members(role) if name not in public]
        assert missing == [], (role.__name__, missing)


def _members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def test_no_product_file_is_longer_than_a_reader_can_hold() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_PRODUCT_FILE_LINES
    }
    assert long == {}


def test_the_http_edge_keeps_its_functions_small() -> None:
    """C90 at 10 in the HTTP package (15 elsewhere, pyproject.toml)."""
    ruff = Path(sys.executable).parent / "ruff"
    found = subprocess.run(
        [
            str(ruff),
            "check",
            "--select",
            "C90",
            "--config",
            "lint.mccabe.max-complexity = 10",
            "--output-format",
            "concise",
            str(ROOT / "deployments" / "http"),
        ],
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout
