"""Headless Chromium for the page tests: the DOM after rendering, and a small DOM reader.

Each run is a Chromium process of its own, in its own session with a fresh
profile directory, stopped by its PID if it does not finish in time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

from deployments import processes

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
RUN_TIMEOUT_SECONDS = 60.0


def available() -> bool:
    return Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is not None


def run(*args: str, window: tuple[int, int] = (1280, 900)) -> str:
    """Run Chromium headless with these arguments; returns what it wrote on stdout."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        command = [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            *args,
        ]
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        try:
            out, _ = process.communicate(timeout=RUN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            processes.stop_group(process, grace_seconds=5)
            raise
        finally:
            if process.poll() is None:
                processes.stop_group(process, grace_seconds=5)
    if process.returncode != 0:
        raise RuntimeError(f"chromium exited {process.returncode}")
    return out


def dump_dom(url: str, window: tuple[int, int] = (1280, 900)) -> str:
    """The document as Chromium has it after loading `url`."""
    return run("--dump-dom", url, window=window)


@dataclasses.dataclass
class Element:
    tag: str
    attributes: dict[str, str]
    children: list[Element | str] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        """The text inside, whitespace collapsed."""
        parts: list[str] = []

        def walk(node: Element | str) -> None:
            if isinstance(node, str):
                parts.append(node)
            else:
                for child in node.children:
                    walk(child)

        walk(self)
        return " ".join("".join(parts).split())

    def iter(self) -> list[Element]:
        found: list[Element] = [self]
        for child in self.children:
            if isinstance(child, Element):
                found += child.iter()
        return found

    def find_all(self, tag: str | None = None, **attributes: str | None) -> list[Element]:
        """Elements with this tag (any if None) having these attributes (any value if None)."""
        wanted = {name.replace("_", "-"): value for name, value in attributes.items()}
        return [
            element
            for element in self.iter()
            if (tag is None or element.tag == tag)
            and all(
                name in element.attributes and (value is None or element.attributes[name] == value)
                for name, value in wanted.items()
            )
        ]

    def find(self, tag: str | None = None, **attributes: str | None) -> Element:
        found = self.find_all(tag, **attributes)
        assert len(found) == 1, f"expected one {tag} {attributes}, found {len(found)}"
        return found[0]


_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self._open = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {name: value or "" for name, value in attrs})
        self._open[-1].children.append(element)
        if tag not in _VOID:
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self._open) - 1, 0, -1):
            if self._open[depth].tag == tag:
                del self._open[depth:]
                return

    def handle_data(self, data: str) -> None:
        self._open[-1].children.append(data)


def parse(document: str) -> Element:
    builder = _Builder()
    builder.feed(document)
    builder.close()
    return builder.root
