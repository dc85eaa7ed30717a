"""The edge's middleware: exact paths, bounded headers and bodies, known hosts only (DNS
rebinding gets a 400 from Starlette's `TrustedHostMiddleware`), CORS for the app's own origins."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.http.errors import MAX_BODY_BYTES, TOO_LARGE, problem

MAX_HEADER_BYTES = 16 * 1024
HEADERS_TOO_LARGE = f"headers: larger than {MAX_HEADER_BYTES} bytes in all"

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
# What a screen's page may send and read across origins.
CORS_HEADERS = ["Authorization", "Content-Type", "If-None-Match"]
CORS_EXPOSED = ["ETag", "Retry-After", "Server-Timing"]
CORS_MAX_AGE_SECONDS = 600
# Starlette decodes the path before routing, so `%2F` would split a value in
# two: `StrictPaths` routes with each encoded slash kept in its segment as NUL
# (which no key may hold) and marks the scope, and `path_text` turns it back.
SLASH = "\x00"
ENCODED_SLASHES = "insight_queue.encoded_slashes"


def add_edges(app: FastAPI, hosts: Sequence[str], origins: Sequence[str]) -> None:
    """The standalone app's middleware, outermost last: hosts, CORS, then paths and bodies."""
    app.add_middleware(StrictPaths)
    app.add_middleware(LimitedBodies)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED,
            max_age=CORS_MAX_AGE_SECONDS,
        )
    allowed = [*LOOPBACK_HOSTS, *hosts]
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed, www_redirect=False)


class StrictPaths:
    """Paths and queries as exact text: invalid UTF-8 is refused, `%2F` stays in its value."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        part = "path"
        try:
            segments = [urllib.parse.unquote_to_bytes(s).decode("utf-8") for s in raw.split(b"/")]
            part = "query"
            urllib.parse.parse_qsl(query, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            refusal = problem(400, f"{part}: not valid UTF-8 once percent-decoded", part)
            await refusal(scope, receive, send)
            return
        if any("/" in s for s in segments) and not any(SLASH in s for s in segments):
            scope = {
                **scope,
                "path": "/".join(s.replace("/", SLASH) for s in segments),
                ENCODED_SLASHES: True,
            }
        await self.app(scope, receive, send)


class LimitedBodies:
    """Headers (431) and bodies (413, before all is read) within bounds; nosniff on answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        headers = sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))
        if headers > MAX_HEADER_BYTES:
            refusal = problem(431, HEADERS_TOO_LARGE, "headers", {"Connection": "close"})
            await refusal(scope, receive, send)
            return

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise HTTPException(413, TOO_LARGE)
            return message

        async def nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-content-type-options", b"nosniff"))
            await send(message)

        declared = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await problem(413, TOO_LARGE, "body")(scope, receive, nosniff)
            return
        await self.app(scope, limited, nosniff)
