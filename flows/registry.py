"""What the host app plugs in: generators by kind and scope providers, registered by each
`AI_JOB_PLUGINS` module's `register(registry)` on the registry being built, never globally."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flows.gateway import Completion
from queue_store import PREFETCH, EnqueueRequest, InvalidArgument, Misconfigured, validation
from queue_store.models import MAX_SUBJECT_LENGTH

Messages = Sequence[Mapping[str, Any]]
BuildRequest = Callable[[str, str], Messages]
ParseAnswer = Callable[[Completion], Any]
# Says why a subject is not one the generator makes insights for (raises ValueError).
CheckSubject = Callable[[str], None]


class UnknownKind(LookupError):
    """No generator is registered for a job's kind."""


class PluginError(Misconfigured):
    """A module named in AI_JOB_PLUGINS could not be imported, or registers nothing."""


@dataclasses.dataclass(frozen=True)
class Generator:
    """`build(user_id, subject)` makes the chat messages, `parse(answer)` the stored result."""

    kind: str
    build: BuildRequest
    parse: ParseAnswer
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # request fields
    subjects: CheckSubject | None = None  # None: any subject
    retention_days: float | None = None  # None: AI_JOB_RETENTION_DAYS (D2)


@dataclasses.dataclass(frozen=True)
class Scope:
    """One insight a backfill queues for a user, at prefetch priority."""

    kind: str
    subject: str
    fingerprint: str | None = None
    # One live subject of its kind ("the last 28 days"): queuing it drops the older ones' jobs.
    single_subject: bool = False

    def request(self, user_id: str) -> EnqueueRequest:
        return EnqueueRequest(
            user_id, self.kind, self.subject, self.fingerprint, PREFETCH, self.single_subject
        )


ScopeProvider = Callable[[str], Iterable[Scope]]


def text_result(answer: Completion) -> Any:
    return {"text": answer.content}


def iso_dates(days_back: int = 3650, days_ahead: int = 1) -> CheckSubject:
    """Subjects that are one day, `YYYY-MM-DD`, within `days_back` of today and `days_ahead`."""

    def check(subject: str) -> None:
        day = _day(subject)
        today = dt.datetime.now(dt.UTC).date()
        if not today - dt.timedelta(days=days_back) <= day <= today + dt.timedelta(days_ahead):
            raise ValueError(f"{subject} is not within {days_back} days back to {days_ahead} on")

    return check


def periods(days: int, days_ahead: int = 1) -> CheckSubject:
    """Windows of `days` days, `YYYY-MM-DD..YYYY-MM-DD`, ending by `days_ahead` from today."""

    def check(subject: str) -> None:
        first, dots, last = subject.partition("..")
        start, end = _day(first), _day(last)
        if not dots or (end - start).days != days - 1:
            raise ValueError(f"expected a window of {days} days, FIRST..LAST")
        if end > dt.datetime.now(dt.UTC).date() + dt.timedelta(days_ahead):
            raise ValueError(f"{subject} ends too far ahead")

    return check


def _day(text: str) -> dt.date:
    if len(text) == len("YYYY-MM-DD"):
        with contextlib.suppress(ValueError):
            return dt.date.fromisoformat(text)
    raise ValueError(f"{text[:40]!r} is not a date (YYYY-MM-DD)")


class Registry:
    def __init__(self) -> None:
        self._generators: dict[str, Generator] = {}
        self._providers: list[ScopeProvider] = []

    @classmethod
    def from_plugins(cls, modules: Iterable[str]) -> Registry:
        registry = cls()
        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception as exc:
                cause = f"{type(exc).__name__}: {exc}"
                raise PluginError(f"AI_JOB_PLUGINS: cannot import {name!r} ({cause})") from exc
            register = getattr(module, "register", None)
            if not callable(register):
                raise PluginError(f"AI_JOB_PLUGINS: {name!r} has no register(registry) function")
            register(registry)
        return registry

    def register_generator(
        self,
        kind: str,
        build: BuildRequest,
        parse: ParseAnswer = text_result,
        *,
        subjects: CheckSubject | None = None,
        retention_days: float | None = None,
        **options: Any,
    ) -> Generator:
        """`subjects` refuses others before anything is written (A3); `retention_days`: D2."""
        if retention_days is not None and not retention_days > 0:
            raise PluginError(f"{kind}: retention_days must be more than 0")
        self._generators[kind] = Generator(kind, build, parse, options, subjects, retention_days)
        return self._generators[kind]

    def register_scopes(self, provider: ScopeProvider) -> ScopeProvider:
        """Add a scope provider (usable as a decorator)."""
        if provider not in self._providers:
            self._providers.append(provider)
        return provider

    @property
    def kinds(self) -> list[str]:
        return sorted(self._generators)

    def check_kind(self, kind: str) -> str:
        kind = validation.kind(kind)
        if self._generators and kind not in self._generators:
            known = ", ".join(self.kinds)
            raise InvalidArgument(
                "kind", f"no generator is registered for {kind!r} (known: {known})"
            )
        return kind

    def check(self, kind: str, subject: str) -> tuple[str, str]:
        """The kind and subject, or `InvalidArgument` naming the one no generator accepts."""
        kind = self.check_kind(kind)
        subject = validation.text("subject", subject, MAX_SUBJECT_LENGTH)
        found = self._generators.get(kind)
        if found is not None and found.subjects is not None:
            try:
                found.subjects(subject)
            except ValueError as exc:
                raise InvalidArgument("subject", f"not a subject of {kind!r}: {exc}") from None
        return kind, subject

    def retention(self) -> dict[str, float]:
        """The kinds kept for a time of their own, in days."""
        return {
            kind: found.retention_days
            for kind, found in self._generators.items()
            if found.retention_days is not None
        }

    def generator_for(self, kind: str) -> Generator:
        found = self._generators.get(kind)
        if found is None:
            known = ", ".join(self.kinds) or "none"
            raise UnknownKind(f"no generator is registered for kind {kind!r} (known: {known})")
        return found

    def scopes_for(self, user_id: str) -> list[Scope]:
        return [scope for provider in self._providers for scope in provider(user_id)]
