"""What the host app plugs in: generators (kind -> prompt and result) and scope providers.

A *generator* turns a job's `(user_id, subject)` into the gateway request and
the gateway's answer into the stored result. A *scope provider* lists, for a
user, every `(kind, subject, fingerprint)` the backfill should queue.

The app registers its own in a module named by `AI_JOB_PLUGINS` (comma
separated); the project ships `flows.demo`, a demo set over synthetic data,
used when nothing else is named. `register_generator` and `register_scopes`
fill the process's default `Registry`, which `load` fills by importing those
modules once; tests build registries of their own.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flows.gateway import Completion
from queue_store import SettingsError

Messages = Sequence[Mapping[str, Any]]
BuildRequest = Callable[[str, str], Messages]
ParseAnswer = Callable[[Completion], Any]


class UnknownKind(LookupError):
    """No generator is registered for a job's kind."""


class PluginError(SettingsError):
    """A module named in AI_JOB_PLUGINS could not be imported."""


@dataclasses.dataclass(frozen=True)
class Generator:
    """How one kind of insight is made.

    `build(user_id, subject)` returns the chat messages; `parse(answer)`
    returns the JSON-serialisable result to store; `options` are extra
    request fields (e.g. `temperature`).
    """

    kind: str
    build: BuildRequest
    parse: ParseAnswer
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scope:
    """One insight the backfill queues for a user."""

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


class Registry:
    """Generators by kind and scope providers, filled by plugin modules."""

    def __init__(self) -> None:
        self._generators: dict[str, Generator] = {}
        self._providers: list[ScopeProvider] = []
        self._loaded: set[str] = set()
        self._lock = threading.Lock()

    def register_generator(
        self, kind: str, build: BuildRequest, parse: ParseAnswer = text_result, **options: Any
    ) -> Generator:
        """Make `kind` known: `build` makes its prompt, `parse` its stored result."""
        generator = Generator(kind, build, parse, options)
        with self._lock:
            self._generators[kind] = generator
        return generator

    def register_scopes(self, provider: ScopeProvider) -> ScopeProvider:
        """Add a scope provider (usable as a decorator)."""
        with self._lock:
            if provider not in self._providers:
                self._providers.append(provider)
        return provider

    def load(self, modules: Iterable[str]) -> None:
        """Import the plugin modules not imported yet (they register into `default`)."""
        for name in modules:
            with self._lock:
                if name in self._loaded:
                    continue
            try:
                importlib.import_module(name)
            except Exception as exc:
                raise PluginError(
                    f"AI_JOB_PLUGINS: cannot import {name!r} ({type(exc).__name__}: {exc})"
                ) from exc
            with self._lock:
                self._loaded.add(name)

    @property
    def kinds(self) -> list[str]:
        with self._lock:
            return sorted(self._generators)

    def knows(self, kind: str) -> bool:
        with self._lock:
            return kind in self._generators

    def generator_for(self, kind: str) -> Generator:
        with self._lock:
            found = self._generators.get(kind)
        if found is None:
            known = ", ".join(self.kinds) or "none"
            raise UnknownKind(f"no generator is registered for kind {kind!r} (known: {known})")
        return found

    def scopes_for(self, user_id: str) -> list[Scope]:
        with self._lock:
            providers = list(self._providers)
        return [scope for provider in providers for scope in provider(user_id)]


# The registry plugin modules fill when they are imported.
default = Registry()


def register_generator(
    kind: str, build: BuildRequest, parse: ParseAnswer = text_result, **options: Any
) -> Generator:
    """Register a generator in the default registry (what plugin modules call)."""
    return default.register_generator(kind, build, parse, **options)


def register_scopes(provider: ScopeProvider) -> ScopeProvider:
    """Register a scope provider in the default registry (usable as a decorator)."""
    return default.register_scopes(provider)
