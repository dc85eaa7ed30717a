"""The command line's text. Values from an app or a gateway show their control and bidirectional
characters as escapes, in tables and JSON alike."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable
from typing import Any

from queue_store.models import GateState, Hold, QueueView, UsageRow, iso

ERROR_COLUMN = 48  # characters of an error shown in a table row
CELL_WIDTH = 40  # widest other column
Columns = list[tuple[str, Callable[[dict[str, Any]], str]]]  # title, cell of a row


def render_jobs(listed: list[dict[str, Any]]) -> str:
    columns: Columns = [
        ("STATUS", lambda j: j["status"]),
        ("PRIO", lambda j: f"{j['priority']}{'*' if j['interactive'] else ''}"),
        ("KIND", lambda j: j["kind"]),
        ("SUBJECT", lambda j: j["subject"]),
        ("TRIES", lambda j: f"{j['attempts']}/{j['max_attempts']}"),
        ("AHEAD", lambda j: "" if j.get("ahead") is None else str(j["ahead"])),
        ("ETA", lambda j: "" if j.get("eta_seconds") is None else _duration(j["eta_seconds"])),
        ("UPDATED", lambda j: j["updated_at"] or ""),
        ("ERROR", lambda j: j["error"] or ""),
    ]
    return render_table(columns, listed, empty="(no jobs)")


def render_table(columns: Columns, rows: list[dict[str, Any]], *, empty: str) -> str:
    """A plain-text table; long cells end in an ellipsis, and the last column may be wider."""
    cells = [[printable(_one_line(render(row))) for _, render in columns] for row in rows]
    limits = [CELL_WIDTH] * (len(columns) - 1) + [ERROR_COLUMN]
    table = [[title for title, _ in columns]]
    table += [[_cut(v, w) for v, w in zip(row, limits, strict=True)] for row in cells]
    widths = [max(map(len, column)) for column in zip(*table, strict=True)]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]
    return "\n".join(lines if rows else [*lines, empty])


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the
# bidirectional controls (marks, embeddings, overrides, isolates).
_BEYOND_C0 = "\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
_CONTROL_BEYOND_C0 = re.compile(f"[{_BEYOND_C0}]")


def printable(text: str) -> str:
    """Control characters as escapes: a value never breaks a row or drives a terminal."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def describe_gate(gate: GateState) -> str:
    """One line about claiming: running, or paused until when, by what, why."""
    if not gate.paused:
        streak = f" (outages in a row: {gate.outages_in_a_row})" if gate.outages_in_a_row else ""
        return f"claiming: open{streak}"
    return (
        f"claiming: PAUSED ({gate.pause_kind}) for {_duration(gate.pause_seconds_left)}, "
        f"until {iso(gate.paused_until)}: {printable(_one_line(gate.pause_reason or ''))}"
    )


def describe_hold(hold: Hold, now: dt.datetime) -> str:
    """One line about a cut call that still holds the gateway (H1)."""
    until = hold.until.astimezone(dt.UTC).strftime("%H:%M:%S")
    job = f"; {printable(hold.job.run_name)} of {printable(hold.job.user_id)}" if hold.job else ""
    return (
        f"held by a cut call until {until} UTC ({hold.cause.described}; "
        f"{_duration(hold.seconds_left(now))} left{job})"
    )


def render_queue(view: QueueView) -> str:
    """The whole queue as text: claiming, consumers, calls in flight, the line, failures."""
    alive = ", ".join(f"{w.name} ({w.role})" for w in view.workers if w.alive) or "none alive"
    out = [
        f"{iso(view.now)}  concurrency {view.concurrency}",
        describe_gate(view.gate),
        *(describe_hold(hold, view.now) for hold in view.holds),
        f"consumers: {alive}",
        "",
        f"IN FLIGHT ({len(view.running)})",
    ]
    for e in view.running:
        j = e.job
        run = f"  run {j.flow_run_id[:8]}" if j.flow_run_id else ""
        out.append(
            f"  {printable(j.run_name)}  user {printable(j.user_id)} ({j.pseudonym or '-'})  "
            f"{j.priority_class}  "
            f"try {j.attempts}/{view.max_attempts}  for {_duration(e.running_seconds or 0)}  "
            f"by {j.worker or '?'}{run}"
        )
    if not view.running:
        out.append("  (none)")
    shown = f", first {len(view.waiting)}" if view.waiting_total > len(view.waiting) else ""
    out += ["", f"WAITING ({view.waiting_total}{shown}), in the order the worker takes them"]
    rows = [e.as_dict(view.max_attempts) for e in view.waiting]
    columns: Columns = [
        ("#", lambda r: str(r["place"])),
        ("USER", lambda r: r["user_id"]),
        ("IN PREFECT AS", lambda r: r["pseudonym"] or ""),
        ("KIND", lambda r: r["kind"]),
        ("SUBJECT", lambda r: r["subject"]),
        ("CLASS", lambda r: r["priority_class"]),
        ("TRIES", lambda r: f"{r['attempts']}/{r['max_attempts']}"),
        ("ETA", lambda r: _duration(r["eta_seconds"] or 0)),
        ("LAST ERROR", lambda r: r["error"] or ""),
    ]
    out.append(render_table(columns, rows, empty="(nothing waiting)"))
    out += ["", f"RECENT FAILURES ({view.failed_total})"]
    for e in view.recent_failures:
        j = e.job
        out.append(
            f"  {iso(j.finished_at)}  {printable(j.run_name)}  user {printable(j.user_id)}: "
            f"{_cut(printable(_one_line(j.error or '')), 120)}"
        )
    if not view.recent_failures:
        out.append("  (none)")
    if view.erasures_pending:
        oldest = iso(view.erasures_pending[0][1])
        out += [
            "",
            f"RUN HISTORY TO ERASE: {len(view.erasures_pending)} forgotten user(s), since "
            f"{oldest}: the next `forget` or scheduled prune deletes their runs from Prefect",
        ]
    out += ["", f"TOKENS: {view.usage_total.described()} in all, by user and kind:"]
    by_user: Columns = [
        ("USER", lambda u: u["user_id"]),
        ("KIND", lambda u: u["kind"]),
        ("ANSWERS", lambda u: str(u["answers"])),
        ("TOKENS", lambda u: UsageRow(**u).described()),
    ]
    out.append(render_table(by_user, [u.as_dict() for u in view.usage], empty="(no answer yet)"))
    return "\n".join(out)


def as_json(value: Any) -> str:
    """JSON for a terminal: non-ASCII readable, controls as `\\uXXXX` (json.dumps does C0)."""
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return _CONTROL_BEYOND_C0.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
