"""The operator's queue page: `templates/queue.html` by Jinja2, styled by `static/queue.css`.

No script and no external asset. Every value that comes from the app or the gateway (user ids,
kinds, subjects, errors, worker names) is autoescaped, its control and bidirectional characters
shown as escapes (so "\\u202eevil" cannot read as "live"), and isolated from the text around it.
The page refreshes itself with a meta refresh; on a narrow screen each table row becomes a card.
"""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse

import jinja2

from queue_store import QueueView

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the
# bidirectional controls (marks, embeddings, overrides, isolates).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
PAUSE_CAUSES = {
    "operator": "by an operator",
    "outage": "the gateway was unreachable",
    "timeout": "a call timed out",
    "rate_limit": "the gateway asked to slow down",
    "refused": "the gateway refused our credentials",
}


def shown(value: object) -> str:
    """A value from the app with its control characters as escapes (autoescaping follows)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


def duration(seconds: float | None) -> str:
    """Seconds for people: 42 s, 3 min 20 s, 2 h 05 min, 3 d 4 h."""
    if seconds is None:
        return "–"
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


def _clock_text(at: dt.datetime, now: dt.datetime) -> str:
    at = at.astimezone(dt.UTC)
    return at.strftime("%H:%M:%S") if at.date() == now.date() else at.strftime("%Y-%m-%d %H:%M")


def safe_ui_url(url: str | None) -> str | None:
    """The Prefect UI's address if it is a plain http(s) URL; anything else is not linked."""
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return str(url).rstrip("/")


_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("deployments", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    undefined=jinja2.StrictUndefined,
    trim_blocks=False,
)
_templates.filters.update(
    shown=shown,
    duration=duration,
    iso=lambda at: at.astimezone(dt.UTC).isoformat(timespec="seconds"),
    clock_text=_clock_text,
    has_space=lambda text: any(c.isspace() for c in text),
    plural=lambda count, noun: f"{count} {noun}" if count == 1 else f"{count} {noun}s",
)


def render(
    view: QueueView | None,
    *,
    ui_url: str | None,
    refresh: int,
    stylesheet: str,
    error: str | None = None,
    now: dt.datetime | None = None,
) -> str:
    """The page for one view of the queue, or, with `error`, the page saying it cannot be read."""
    if view is not None:
        paused = "paused · " if view.gate.paused else ""
        title = f"{paused}{view.waiting_total} waiting · insight-queue"
    else:
        title = "store unreachable · insight-queue"
    return _templates.get_template("queue.html").render(
        view=view,
        error=error,
        now=view.now if view is not None else now or dt.datetime.now(dt.UTC),
        ui_url=safe_ui_url(ui_url),
        refresh=refresh,
        title=title,
        stylesheet=stylesheet,
        pause_causes=PAUSE_CAUSES,
    )
