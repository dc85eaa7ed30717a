"""The operator's queue page: one server-rendered HTML document, no script, no external assets.

What it shows, top to bottom: whether claiming is open or paused (by whom,
for how long, why), the counts at a glance, the calls in flight and for how
long, the queue in the order the worker takes it (place, user, kind,
subject, priority class, attempts, ETA), recent failures with their
reasons, and the consumers that said they are alive, with links to the
Prefect UI's runs where a job names one.

Every value that comes from the app or the gateway (user ids, kinds,
subjects, errors, worker names) is escaped, its control characters shown
as escapes, and isolated from the text around it (a right-to-left override
cannot reorder the rest of the row). The page refreshes itself with a meta
refresh; on a narrow screen each table row becomes a small card.
"""

from __future__ import annotations

import datetime as dt
import html
import re
import urllib.parse
from collections.abc import Iterable, Sequence

from queue_store import GateState, QueueEntry, QueueView, Worker

TITLE = "insight-queue"
NONE = '<span class="muted">–</span>'  # a value that is not there
ERROR_PREVIEW = 600  # characters of an error shown in a row; the whole text is in its tooltip

SHORT_VALUE = 24  # characters: a value this short, without spaces, is never wrapped

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the
# bidirectional controls (marks, embeddings, overrides, isolates): shown as
# escapes, so "\u202eevil" cannot read as "live".
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)

STYLE = """
:root {
  color-scheme: light dark;
  --bg: #f6f7f9; --panel: #ffffff; --text: #1d2330; --muted: #5d6678;
  --line: #e1e4ea; --accent: #2f6fde; --accent-bg: #e8f0fd;
  --ok: #1c7c54; --ok-bg: #e3f4ec; --warn: #8a5a00; --warn-bg: #fff3d6;
  --bad: #b3261e; --bad-bg: #fdecea; --bad-text: #8c2f28;
}
@media (prefers-color-scheme: dark) {
  :root {
    --bg: #14171c; --panel: #1c2027; --text: #e4e7ec; --muted: #9aa3b2;
    --line: #2c323c; --accent: #7fa8f5; --accent-bg: #1f2b42;
    --ok: #6fd3a3; --ok-bg: #173127; --warn: #f0c46a; --warn-bg: #372b12;
    --bad: #f3958f; --bad-bg: #3b1d1b; --bad-text: #eaa59f;
  }
}
* { box-sizing: border-box; }
body {
  margin: 0; background: var(--bg); color: var(--text);
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", sans-serif;
}
main { max-width: 1180px; margin: 0 auto; padding: 20px 20px 40px; }
header { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 16px; }
h1 { font-size: 20px; margin: 0; font-weight: 650; }
h2 { font-size: 16px; margin: 0; font-weight: 650; }
.muted, .meta { color: var(--muted); }
.meta { font-size: 13px; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
.banner {
  margin: 16px 0 0; padding: 12px 16px; border-radius: 10px;
  border: 1px solid var(--line); background: var(--panel);
}
.banner.open { border-color: transparent; background: var(--ok-bg); }
.banner.paused { border-color: transparent; background: var(--warn-bg); }
.banner strong { font-size: 16px; }
.banner.open strong { color: var(--ok); }
.banner.paused strong { color: var(--warn); }
.banner .why { display: block; margin-top: 2px; overflow-wrap: anywhere; }
.tiles {
  display: grid; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr));
  gap: 10px; margin: 12px 0 0;
}
.tile {
  background: var(--panel); border: 1px solid var(--line); border-radius: 10px;
  padding: 10px 14px;
}
.tile .n { display: block; font-size: 24px; font-weight: 650; font-variant-numeric: tabular-nums; }
.tile .label { color: var(--muted); font-size: 13px; }
section {
  margin: 18px 0 0; background: var(--panel); border: 1px solid var(--line);
  border-radius: 10px; overflow: hidden;
}
.head {
  display: flex; flex-wrap: wrap; align-items: baseline; gap: 2px 12px;
  padding: 12px 16px; border-bottom: 1px solid var(--line);
}
.head .meta { font-size: 13px; }
table { width: 100%; border-collapse: collapse; }
th, td { text-align: left; vertical-align: top; padding: 8px 16px; }
th {
  font-size: 12px; font-weight: 600; color: var(--muted); text-transform: uppercase;
  letter-spacing: .03em; border-bottom: 1px solid var(--line);
}
tbody tr + tr td { border-top: 1px solid var(--line); }
td { overflow-wrap: anywhere; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.empty { padding: 14px 16px; color: var(--muted); }
.v { unicode-bidi: isolate; }
.nw { white-space: nowrap; }
.pill {
  display: inline-block; padding: 1px 8px; border-radius: 999px; font-size: 12px;
  font-weight: 600; white-space: nowrap;
}
.pill.interactive { background: var(--accent-bg); color: var(--accent); }
.pill.prefetch { background: var(--bg); color: var(--muted); border: 1px solid var(--line); }
.pill.alive { background: var(--ok-bg); color: var(--ok); }
.pill.gone { background: var(--bad-bg); color: var(--bad); }
.err {
  color: var(--bad-text); display: -webkit-box; -webkit-line-clamp: 3; -webkit-box-orient: vertical;
  overflow: hidden; white-space: pre-wrap;
}
footer { margin-top: 18px; font-size: 13px; color: var(--muted); }
@media (max-width: 720px) {
  main { padding: 14px 12px 32px; }
  table, thead, tbody, th { display: block; }
  thead { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }
  tbody tr {
    display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 8px 14px;
    padding: 12px 16px;
  }
  tbody tr + tr { border-top: 1px solid var(--line); }
  tbody tr + tr td { border-top: 0; }
  td { display: block; padding: 0; }
  td::before {
    content: attr(data-label); display: block; color: var(--muted); font-size: 11px;
    font-weight: 600; text-transform: uppercase; letter-spacing: .03em;
  }
  td.wide { grid-column: 1 / -1; }
  td.blank { display: none; }
  td.num { white-space: normal; }
}
"""


# -- formatting ------------------------------------------------------------------------


def text(value: object) -> str:
    """A value from the app as safe HTML text: control characters as escapes, then escaped."""
    shown = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))
    return html.escape(shown, quote=True)


def value(value: object) -> str:
    """A value from the app, isolated from the text around it (short ones kept on one line)."""
    shown = str(value)
    short = len(shown) <= SHORT_VALUE and not any(c.isspace() for c in shown)
    return f'<span class="v{" nw" if short else ""}">{text(shown)}</span>'


def duration(seconds: float | None) -> str:
    """Seconds for people: 42 s, 3 min 20 s, 2 h 05 min, 3 d 4 h."""
    if seconds is None:
        return NONE
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def clock_time(at: dt.datetime | None, now: dt.datetime) -> str:
    """A time as `<time>`: hh:mm:ss UTC today, else with its date; ISO 8601 in the attribute."""
    if at is None:
        return NONE
    at = at.astimezone(dt.UTC)
    iso = at.isoformat(timespec="seconds")
    shown = at.strftime("%H:%M:%S") if at.date() == now.date() else at.strftime("%Y-%m-%d %H:%M")
    return f'<time datetime="{iso}" title="{iso}">{shown} UTC</time>'


def ago(at: dt.datetime | None, now: dt.datetime) -> str:
    if at is None:
        return NONE
    return f'<span title="{at.astimezone(dt.UTC).isoformat(timespec="seconds")}">{duration((now - at).total_seconds())} ago</span>'  # noqa: E501


def run_link(ui_url: str | None, flow_run_id: str | None) -> str:
    """A link to the flow run in the Prefect UI, or the id alone when there is no UI to link."""
    if not flow_run_id:
        return NONE
    if ui_url is None:
        return f'<span class="muted v nw">{text(flow_run_id[:8])}</span>'
    href = f"{ui_url}/runs/flow-run/{urllib.parse.quote(flow_run_id, safe='')}"
    return (
        f'<a class="nw" href="{html.escape(href, quote=True)}" rel="noopener noreferrer" '
        f'target="_blank" title="{text(flow_run_id)}">run {text(flow_run_id[:8])} ↗</a>'
    )


def safe_ui_url(url: str | None) -> str | None:
    """The Prefect UI's address if it is a plain http(s) URL; anything else is not linked."""
    if not url:
        return None
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return url.rstrip("/")


def pill(priority_class: str) -> str:
    kind = "interactive" if priority_class == "interactive" else "prefetch"
    return f'<span class="pill {kind}">{text(priority_class)}</span>'


def error_cell(error: str | None) -> str:
    if not error:
        return NONE
    preview = error if len(error) <= ERROR_PREVIEW else error[: ERROR_PREVIEW - 1] + "…"
    return f'<span class="err v" title="{text(error)}">{text(preview)}</span>'


def _cells(cells: Iterable[tuple[str, str, str]]) -> str:
    """`<td>`s from (label, css classes, html); a cell with no value is marked `blank`."""
    shown = []
    for label, css, body in cells:
        classes = " ".join(c for c in (css, "blank" if body == NONE else "") if c)
        attribute = f' class="{classes}"' if classes else ""
        shown.append(f'<td data-label="{label}"{attribute}>{body}</td>')
    return "".join(shown)


def _busy(worker: Worker) -> str:
    busy = worker.info.get("busy")
    if not isinstance(busy, list) or not busy:
        return NONE
    return value(", ".join(map(str, busy)))


def _table(name: str, columns: Sequence[str], rows: Sequence[tuple[str, str]], empty: str) -> str:
    """A table; `rows` are (attributes of the `<tr>`, its cells)."""
    if not rows:
        return f'<p class="empty" data-empty="{name}">{empty}</p>'
    head = "".join(f'<th scope="col">{c}</th>' for c in columns)
    body = "".join(f"<tr {attributes}>{cells}</tr>" for attributes, cells in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _job_attributes(entry: QueueEntry) -> str:
    job = entry.job
    return f'data-job-id="{text(job.id)}" data-status="{text(job.status)}"'


# -- sections ----------------------------------------------------------------------------


def _banner(gate: GateState, now: dt.datetime) -> str:
    answered = (
        f" · the gateway last answered {ago(gate.last_answer_at, now)}"
        if gate.last_answer_at
        else ""
    )
    if not gate.paused:
        streak = (
            f" · {plural(gate.outages_in_a_row, 'outage')} in a row"
            if gate.outages_in_a_row
            else ""
        )
        return (
            f'<div class="banner open" data-claiming="open"><strong>Claiming is open</strong>'
            f'<span class="meta">{streak}{answered}</span></div>'
        )
    by = {
        "operator": "by an operator",
        "outage": "the gateway was unreachable",
        "timeout": "a call timed out",
        "rate_limit": "the gateway asked to slow down",
        "refused": "the gateway refused our credentials",
    }.get(str(gate.pause_kind), str(gate.pause_kind or "paused"))
    return (
        f'<div class="banner paused" data-claiming="paused" data-pause-kind="{text(gate.pause_kind or "")}">'  # noqa: E501
        f"<strong>Claiming is paused</strong> <span>— {text(by)}, "
        f"{duration(gate.pause_seconds_left)} left (until {clock_time(gate.paused_until, now)})"
        f"</span>"
        f'<span class="why" data-pause-reason>Reason: {value(gate.pause_reason or "none given")}'
        f"</span>"
        f'<span class="meta">{answered.removeprefix(" · ")}</span></div>'
    )


def _tiles(view: QueueView) -> str:
    alive = sum(1 for w in view.workers if w.alive)
    tiles = [
        ("in-flight", f"{len(view.running)} / {view.concurrency}", "in flight / allowed"),
        ("waiting", str(view.waiting_total), "waiting"),
        ("failed", str(view.failed_total), "failed"),
        ("consumers", str(alive), "consumers alive"),
    ]
    return (
        '<div class="tiles">'
        + "".join(
            f'<div class="tile" data-tile="{name}"><span class="n">{number}</span> '
            f'<span class="label">{label}</span></div>'
            for name, number, label in tiles
        )
        + "</div>"
    )


def _in_flight(view: QueueView, ui_url: str | None) -> str:
    rows = [
        (
            _job_attributes(e),
            _cells(
                [
                    ("User", "", value(e.job.user_id)),
                    ("Kind", "", value(e.job.kind)),
                    ("Subject", "", value(e.job.subject)),
                    ("Class", "", pill(e.job.priority_class)),
                    ("Attempt", "num", f"{e.job.attempts} of {view.max_attempts}"),
                    ("Running for", "num", duration(e.running_seconds)),
                    ("Time left", "num", duration(e.eta_seconds)),
                    ("Worker", "wide", value(e.job.worker) if e.job.worker else NONE),
                    ("Run", "", run_link(ui_url, e.job.flow_run_id)),
                ]
            ),
        )
        for e in view.running
    ]
    columns = [
        "User", "Kind", "Subject", "Class", "Attempt", "Running for", "Time left",
        "Worker", "Run",
    ]  # fmt: skip
    return (
        '<section data-section="in-flight"><div class="head"><h2>In flight</h2>'
        f'<span class="meta">calls at the gateway now, at most {view.concurrency}</span></div>'
        + _table("in-flight", columns, rows, "No call in flight.")
        + "</section>"
    )


def _waiting(view: QueueView, ui_url: str | None) -> str:
    rows = [
        (
            _job_attributes(e) + f' data-place="{e.place}"',
            _cells(
                [
                    ("Place", "num", str(e.place)),
                    ("User", "", value(e.job.user_id)),
                    ("Kind", "", value(e.job.kind)),
                    ("Subject", "", value(e.job.subject)),
                    ("Class", "", pill(e.job.priority_class)),
                    ("Attempts", "num", f"{e.job.attempts} of {view.max_attempts}"),
                    ("ETA", "num", duration(e.eta_seconds)),
                    ("Last error", "wide", error_cell(e.job.error)),
                    ("Run", "", run_link(ui_url, e.job.flow_run_id)),
                ]
            ),
        )
        for e in view.waiting
    ]
    shown = (
        f", showing the first {len(view.waiting)}" if view.waiting_total > len(view.waiting) else ""
    )
    columns = ["#", "User", "Kind", "Subject", "Class", "Attempts", "ETA", "Last error", "Run"]
    return (
        '<section data-section="waiting"><div class="head"><h2>Waiting</h2>'
        f'<span class="meta">{plural(view.waiting_total, "job")}{shown}, in the order the worker '
        "takes them</span></div>"
        + _table("waiting", columns, rows, "Nothing is waiting.")
        + "</section>"
    )


def _failures(view: QueueView, ui_url: str | None, now: dt.datetime) -> str:
    rows = [
        (
            _job_attributes(e),
            _cells(
                [
                    ("Failed", "num", clock_time(e.job.finished_at, now)),
                    ("User", "", value(e.job.user_id)),
                    ("Kind", "", value(e.job.kind)),
                    ("Subject", "", value(e.job.subject)),
                    ("Attempts", "num", f"{e.job.attempts} of {view.max_attempts}"),
                    ("Reason", "wide", error_cell(e.job.error)),
                    ("Run", "", run_link(ui_url, e.job.flow_run_id)),
                ]
            ),
        )
        for e in view.recent_failures
    ]
    shown = (
        f", the latest {len(view.recent_failures)} shown"
        if view.failed_total > len(view.recent_failures)
        else ""
    )
    columns = ["Failed", "User", "Kind", "Subject", "Attempts", "Reason", "Run"]
    return (
        '<section data-section="failures"><div class="head"><h2>Recent failures</h2>'
        f'<span class="meta">{view.failed_total} failed{shown}; '
        "<code>retry-failed</code> puts a user's back</span></div>"
        + _table("failures", columns, rows, "No failures.")
        + "</section>"
    )


def _consumers(workers: Sequence[Worker], now: dt.datetime) -> str:
    rows = [
        (
            f'data-worker="{text(w.name)}" data-alive="{str(w.alive).lower()}"',
            _cells(
                [
                    ("Name", "wide", value(w.name)),
                    ("Role", "", value(w.role)),
                    ("Host", "", f"{value(w.host)} <span class=muted>pid {w.pid}</span>"),
                    ("Busy with", "wide", _busy(w)),
                    ("Last seen", "num", ago(w.seen_at, now)),
                    (
                        "State",
                        "",
                        '<span class="pill alive">alive</span>'
                        if w.alive
                        else '<span class="pill gone">silent</span>',
                    ),
                ]
            ),
        )
        for w in workers
    ]
    columns = ["Name", "Role", "Host", "Busy with", "Last seen", "State"]
    return (
        '<section data-section="consumers"><div class="head"><h2>Consumers</h2>'
        '<span class="meta">processes that said they are alive</span></div>'
        + _table("consumers", columns, rows, "No consumer has said it is alive.")
        + "</section>"
    )


def _document(title: str, body: str, refresh: int) -> str:
    meta_refresh = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{meta_refresh}<title>{text(title)}</title><style>{STYLE}</style></head>"
        f"<body><main>{body}</main></body></html>\n"
    )


def _header(now: dt.datetime, refresh: int) -> str:
    every = f"refreshes every {duration(refresh)}" if refresh else "does not refresh"
    return (
        f"<header><h1>{TITLE} · queue</h1>"
        f'<span class="meta">as of {clock_time(now, now)} · {every}</span></header>'
    )


def render(view: QueueView, *, ui_url: str | None, refresh: int) -> str:
    """The whole page for one view of the queue."""
    ui = safe_ui_url(ui_url)
    now = view.now
    footer = (
        f'<footer>Run history: <a href="{html.escape(ui, quote=True)}/runs" rel="noopener '
        f'noreferrer" target="_blank">Prefect UI ↗</a> · the same data as JSON: '
        "<code>GET /v1/queue</code></footer>"
        if ui
        else "<footer>The same data as JSON: <code>GET /v1/queue</code></footer>"
    )
    paused = "paused · " if view.gate.paused else ""
    title = f"{paused}{view.waiting_total} waiting · {TITLE}"
    body = (
        _header(now, refresh)
        + _banner(view.gate, now)
        + _tiles(view)
        + _in_flight(view, ui)
        + _waiting(view, ui)
        + _failures(view, ui, now)
        + _consumers(view.workers, now)
        + footer
    )
    return _document(title, body, refresh)


def render_unavailable(error: str, refresh: int, now: dt.datetime) -> str:
    """The page when the store cannot be read: say so, and keep refreshing."""
    body = (
        _header(now, refresh)
        + '<div class="banner paused" data-store="unknown"><strong>The store cannot be read'
        f'</strong><span class="why">{value(error)}</span>'
        '<span class="meta">Status unknown; this page tries again on its next refresh.</span>'
        "</div>"
    )
    return _document(f"store unreachable · {TITLE}", body, refresh)
