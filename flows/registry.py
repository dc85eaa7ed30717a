"""What the host app plugs in: generators (kind -> prompt and result) and scope providers.

A *generator* turns a job's `(user_id, subject)` into the gateway request and
the answer into the stored result; a *scope provider* lists what a user's
backfill queues. The plugin modules named in `AI_JOB_PLUGINS` each have a
`register(registry)`, handed the registry being built: nothing is global.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flows.gateway import Completion
from queue_store import PREFETCH, EnqueueRequest, InvalidArgument, Misconfigured, validation

Messages = Sequence[Mapping[str, Any]]
BuildRequest = Callable[[str, str], Messages]
ParseAnswer = Callable[[Completion], Any]


class UnknownKind(LookupError):
    """No generator is registered for a job's kind."""


class PluginError(Misconfigured):
    """A module named in AI_JOB_PLUGINS could not be imported, or registers nothing."""


@dataclasses.dataclass(frozen=True)
class Generator:
    """How one kind of insight is made: `build(user_id, subject)` returns the chat messages,
    `parse(answer)` the JSON-serialisable result; `options` are extra request fields."""

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

    def request(self, user_id: str) -> EnqueueRequest:
        """What a backfill queues for this scope: at prefetch priority."""
        return EnqueueRequest(
            user_id, self.kind, self.subject, self.fingerprint, PREFETCH, self.single_subject
        )


ScopeProvider = Callable[[str], Iterable[Scope]]


def text_result(answer: Completion) -> Any:
    """The default result: the answer's text."""
    return {"text": answer.content}


class Registry:
    """Generators by kind, and scope providers."""

    def __init__(self) -> None:
        self._generators: dict[str, Generator] = {}
        self._providers: list[ScopeProvider] = []

    @classmethod
    def from_plugins(cls, modules: Iterable[str]) -> Registry:
        """A registry filled by each module's `register(registry)`, in order."""
        registry = cls()
        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception as exc:
                raise PluginError(
                    f"AI_JOB_PLUGINS: cannot import {name!r} ({type(exc).__name__}: {exc})"
                ) from exc
            register = getattr(module, "register", None)
            if not callable(register):
                raise PluginError(f"AI_JOB_PLUGINS: {name!r} has no register(registry) function")
            register(registry)
        return registry

    def register_generator(
        self, kind: str, build: BuildRequest, parse: ParseAnswer = text_result, **options: Any
    ) -> Generator:
        """Make `kind` known: `build` makes its prompt, `parse` its stored result."""
        generator = Generator(kind, build, parse, options)
        self._generators[kind] = generator
        return generator

    def register_scopes(self, provider: ScopeProvider) -> ScopeProvider:
        """Add a scope provider (usable as a decorator)."""
        if provider not in self._providers:
            self._providers.append(provider)
        return provider

    @property
    def kinds(self) -> list[str]:
        return sorted(self._generators)

    def check_kind(self, kind: str) -> str:
        """The kind, or `InvalidArgument` if no generator is registered for it."""
        kind = validation.kind(kind)
        if self._generators and kind not in self._generators:
            known = ", ".join(self.kinds)
            raise InvalidArgument(
                "kind", f"no generator is registered for {kind!r} (known: {known})"
            )
        return kind

    def generator_for(self, kind: str) -> Generator:
        found = self._generators.get(kind)
        if found is None:
            known = ", ".join(self.kinds) or "none"
            raise UnknownKind(f"no generator is registered for kind {kind!r} (known: {known})")
        return found

    def scopes_for(self, user_id: str) -> list[Scope]:
        return [scope for provider in self._providers for scope in provider(user_id)]
