"""The HTTP edge: the standalone API (`create_app`, served by `insight-queue api`), and what a
host app mounts behind its own authentication (`insights_router`, with `add_error_handlers` and
`StrictPaths`)."""

from deployments.http.app import create_app
from deployments.http.errors import add_error_handlers
from deployments.http.middleware import StrictPaths
from deployments.http.screens import insights_router

__all__ = ["StrictPaths", "add_error_handlers", "create_app", "insights_router"]
