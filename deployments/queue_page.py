"""The operator's queue page: `templates/queue.html` by Jinja2, styled by `static/queue.css`; no
script. Every value from the app or the gateway is autoescaped, with its control and bidirectional
characters as escapes (so "\\u202eevil" cannot read as "live")."""

from __future__ import annotations

import datetime as dt
import urllib.parse

import jinja2

from deployments.render import printable
from queue_store import QueueView
from queue_store.models import iso

PAUSE_CAUSES = {
    "operator": "by an operator",
    "outage": "the gateway was unreachable",
    "timeout": "a call timed out",
    "rate_limit": "the gateway asked to slow down",
    "refused": "the gateway refused our credentials",
}


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
    """The Prefect UI's address if it is http(s), without the credentials a URL may carry."""
    parts = urllib.parse.urlsplit(url or "")
    host = parts.netloc.rpartition("@")[2]
    if parts.scheme not in ("http", "https") or not host:
        return None
    if host != parts.netloc:
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return str(url).rstrip("/")


_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("deployments", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    undefined=jinja2.StrictUndefined,
)
_templates.filters.update(
    shown=lambda value: printable(str(value)),
    duration=duration,
    iso=iso,
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
        now=view.now if view is not None else dt.datetime.now(dt.UTC),
        ui_url=safe_ui_url(ui_url),
        refresh=refresh,
        title=title,
        stylesheet=stylesheet,
        pause_causes=PAUSE_CAUSES,
    )
