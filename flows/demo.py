"""DEMO generators and scopes over synthetic data, not health advice: eight kinds of insight for
any user id, from numbers hashed from the user id and the day. A host app replaces this module
with its own (`AI_JOB_PLUGINS`)."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
from typing import Any

from flows.gateway import Completion
from flows.registry import Messages, Registry, Scope, iso_dates, periods

DEMO_DAYS = 28
SYSTEM = (
    "You are a careful health-data coach. Give one short, concrete insight "
    "about the data below. This is synthetic demo data."
)

# kind -> (what it measures, unit, typical range)
METRICS: dict[str, tuple[str, str, tuple[float, float]]] = {
    "sleep": ("sleep duration", "h", (5.5, 8.5)),
    "resting_heart_rate": ("resting heart rate", "bpm", (48, 68)),
    "hrv": ("heart-rate variability", "ms", (35, 95)),
    "steps": ("daily steps", "steps", (3000, 15000)),
    "training_load": ("training load", "TRIMP", (0, 180)),
    "recovery": ("recovery score", "%", (30, 95)),
    "weight": ("body weight", "kg", (68, 74)),
}
# One live subject each: the trailing window ending today.
TRENDS = "trends"


def synthetic_series(user_id: str, kind: str, end: dt.date, days: int = DEMO_DAYS) -> list[float]:
    """Deterministic pseudo-measurements for one user and metric."""
    low, high = METRICS[kind][2]
    values = []
    for offset in range(days):
        day = end - dt.timedelta(days=days - 1 - offset)
        digest = hashlib.sha256(f"{user_id}|{kind}|{day.isoformat()}".encode()).digest()
        fraction = int.from_bytes(digest[:4], "big") / 2**32
        values.append(round(low + (high - low) * fraction, 1))
    return values


def fingerprint(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


def demo_scopes(user_id: str) -> list[Scope]:
    end = dt.datetime.now(dt.UTC).date()
    series = {kind: synthetic_series(user_id, kind, end) for kind in METRICS}
    scopes = [Scope(kind, end.isoformat(), fingerprint(values)) for kind, values in series.items()]
    window = f"{(end - dt.timedelta(days=DEMO_DAYS - 1)).isoformat()}..{end.isoformat()}"
    scopes.append(Scope(TRENDS, window, fingerprint(series), single_subject=True))
    return scopes


def _metric_request(kind: str, user_id: str, subject: str) -> Messages:
    name, unit, _ = METRICS[kind]
    series = synthetic_series(user_id, kind, dt.date.fromisoformat(subject), days=7)
    return _chat(f"{name} ({unit}), last 7 days to {subject}: {series}")


def _trends_request(user_id: str, subject: str) -> Messages:
    end = dt.date.fromisoformat(subject.split("..")[-1])
    series = {kind: synthetic_series(user_id, kind, end) for kind in METRICS}
    summary = {kind: round(sum(values) / len(values), 1) for kind, values in series.items()}
    return _chat(f"28-day averages to {end.isoformat()}: {summary}")


def _chat(question: str) -> Messages:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _with_model(answer: Completion) -> Any:
    return {"text": answer.content, "model": answer.raw.get("model")}


def register(registry: Registry) -> None:
    for kind in METRICS:
        build = functools.partial(_metric_request, kind)
        registry.register_generator(kind, build, _with_model, subjects=iso_dates())
    registry.register_generator(TRENDS, _trends_request, _with_model, subjects=periods(DEMO_DAYS))
    registry.register_scopes(demo_scopes)
