"""`GET /metrics`: the queue in Prometheus' text format, read from the store at every scrape on a
registry of its own, so every API process reports the same figures (M1)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from queue_store import OperatorStore, PauseKind, Tally, tallies

PREFIX = "insight_queue"


class StoreCollector(Collector):
    def __init__(self, store: OperatorStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        seen = self._store.queue_view(0)
        gate = seen.gate
        waiting = GaugeMetricFamily(f"{PREFIX}_waiting_jobs", "Jobs waiting", labels=["class"])
        oldest = GaugeMetricFamily(
            f"{PREFIX}_oldest_waiting_seconds", "Age of the oldest waiting job", labels=["class"]
        )
        for name, (count, since) in seen.waiting_by_class.items():
            waiting.add_metric([name], count)
            oldest.add_metric([name], (gate.now - since).total_seconds() if since else 0.0)
        yield from (waiting, oldest)
        hold_left = max((h.seconds_left(gate.now) for h in seen.holds), default=0.0)
        for name, text, value in (
            ("calls_in_flight", "Calls at the gateway now", seen.in_flight),
            ("calls_held", "Calls cut on our side that still hold the gateway", len(seen.holds)),
            ("hold_seconds_left", "Seconds until the last hold of a cut call ends", hold_left),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)
        paused = GaugeMetricFamily(
            f"{PREFIX}_paused", "1 while claiming is paused, by its cause", labels=["cause"]
        )
        for cause in PauseKind:
            paused.add_metric([cause.value], float(gate.paused and gate.pause_kind is cause))
        yield paused
        yield GaugeMetricFamily(
            f"{PREFIX}_pause_seconds_left",
            "Seconds until claiming resumes",
            value=gate.pause_seconds_left,
        )
        yield from _tallies(seen.tallies)
        used = CounterMetricFamily(
            f"{PREFIX}_tokens",
            "Tokens the gateway's answers said they used",
            labels=["kind", "type"],
        )
        unknown = CounterMetricFamily(
            f"{PREFIX}_answers_without_usage",
            "Answers that did not say their tokens",
            labels=["kind"],
        )
        for row in seen.usage_by_kind:
            used.add_metric([row.kind, "prompt"], row.prompt_tokens)
            used.add_metric([row.kind, "completion"], row.completion_tokens)
            unknown.add_metric([row.kind], row.unknown)
        yield from (used, unknown)


def _tallies(kept: list[Tally]) -> Iterator[Metric]:
    attempts = CounterMetricFamily(
        f"{PREFIX}_attempts", "Settled attempts, by kind and outcome", labels=["kind", "outcome"]
    )
    calls = HistogramMetricFamily(
        f"{PREFIX}_call_duration_seconds",
        "How long calls to the gateway took, by kind and outcome",
        labels=["kind", "outcome"],
    )
    waits = HistogramMetricFamily(
        f"{PREFIX}_screen_wait_seconds",
        "A screen's wait, from asking to its call's start",
        labels=["kind"],
    )
    for tally in kept:
        if tally.name == tallies.ATTEMPTS:
            attempts.add_metric([tally.kind, tally.outcome], tally.count)
            continue
        bounds = tallies.BOUNDS[tally.name]
        buckets = [(f"{b:g}", n) for b, n in zip(bounds, tally.buckets, strict=True)]
        buckets.append(("+Inf", tally.count))
        if tally.name == tallies.CALL_SECONDS:
            calls.add_metric([tally.kind, tally.outcome], buckets, tally.total)
        else:
            waits.add_metric([tally.kind], buckets, tally.total)
    yield from (attempts, calls, waits)


def registry_for(store: OperatorStore) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry
