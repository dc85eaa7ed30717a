"""Registries the host app fills: generators (kind -> prompt and result) and scopes.

A *generator* turns a job's `(user_id, subject)` into the gateway request and
the gateway's answer into the stored result. A *scope provider* lists, for a
user, every `(kind, subject, fingerprint)` the backfill should queue.

The app registers its own in a module named by `AI_JOB_PLUGINS` (comma
separated, imported once per process); the project ships `flows.demo`, a small
demo set over synthetic data, used when nothing else is named.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flows.gateway import Completion

PLUGINS_ENV = "AI_JOB_PLUGINS"
DEFAULT_PLUGINS = "flows.demo"

Messages = Sequence[Mapping[str, Any]]
BuildRequest = Callable[[str, str], Messages]
ParseAnswer = Callable[[Completion], Any]


class UnknownKind(LookupError):
    """No generator is registered for a job's kind: that job fails, not the consumer."""


@dataclasses.dataclass(frozen=True)
class Generator:
    kind: str
    build: BuildRequest  # (user_id, subject) -> chat messages
    parse: ParseAnswer  # the gateway's answer -> the stored, JSON-serialisable result
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # extra request fields


@dataclasses.dataclass(frozen=True)
class Scope:
    kind: str
    subject: str
    fingerprint: str | None = None
    # A kind with one live subject (e.g. "trends over the last 28 days"):
    # queuing it drops queued work for the kind's older subjects.
    single_subject: bool = False


ScopeProvider = Callable[[str], Iterable[Scope]]


def text_result(answer: Completion) -> Any:
    """The default result: the answer's text."""
    return {"text": answer.content}


_generators: dict[str, Generator] = {}
_scope_providers: list[ScopeProvider] = []
_lock = threading.Lock()
_loaded = False


def register_generator(
    kind: str,
    build: BuildRequest,
    parse: ParseAnswer = text_result,
    **options: Any,
) -> Generator:
    generator = Generator(kind, build, parse, options)
    with _lock:
        _generators[kind] = generator
    return generator


def register_scopes(provider: ScopeProvider) -> ScopeProvider:
    with _lock:
        if provider not in _scope_providers:
            _scope_providers.append(provider)
    return provider


def load_plugins(names: str | None = None) -> None:
    """Import the modules that register generators and scopes (once per process)."""
    global _loaded
    with _lock:
        if _loaded and names is None:
            return
        _loaded = True
    spec = names if names is not None else os.environ.get(PLUGINS_ENV) or DEFAULT_PLUGINS
    for name in (part.strip() for part in spec.split(",")):
        if name:
            importlib.import_module(name)


def generator_for(kind: str) -> Generator:
    load_plugins()
    try:
        return _generators[kind]
    except KeyError:
        known = ", ".join(sorted(_generators)) or "none"
        raise UnknownKind(
            f"no generator is registered for kind {kind!r} (known: {known})"
        ) from None


def scopes_for(user_id: str) -> list[Scope]:
    load_plugins()
    with _lock:
        providers = list(_scope_providers)
    return [scope for provider in providers for scope in provider(user_id)]


def clear() -> None:
    """Forget every registration (tests)."""
    global _loaded
    with _lock:
        _generators.clear()
        _scope_providers.clear()
        _loaded = False
