"""What a route is given: its caller, checked, and the services it works through, from
`app.state` (never the raw store)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from deployments.http.access import Caller, Gatekeeper, Role, from_this_site
from deployments.http.errors import Refused
from deployments.http.middleware import ENCODED_SLASHES, SLASH
from deployments.triggers import Triggers
from queue_store import OperatorStore

JSON_TYPES = ("application/json",)


def path_text(request: Request, name: str) -> str:
    """A path parameter as the client meant it (an encoded slash is a slash)."""
    found = str(request.path_params[name])
    return found.replace(SLASH, "/") if request.scope.get(ENCODED_SLASHES) else found


def triggers(request: Request) -> Triggers:
    found: Triggers = request.app.state.triggers
    return found


def operations(request: Request) -> OperatorStore:
    """The operator's view of the store (`Triggers.operator`)."""
    return triggers(request).operator


def _gatekeeper(request: Request) -> Gatekeeper:
    found: Gatekeeper = request.app.state.gatekeeper
    return found


def _checked(request: Request, caller: Caller) -> Caller:
    _gatekeeper(request).admit(caller)
    return caller


def caller(request: Request) -> Caller:
    """Whoever calls, by their bearer token (401 without one), within their rate (429)."""
    return _checked(request, _gatekeeper(request).identify(request))


def for_user(request: Request) -> str:
    """The path's user, if the caller may act for them: the service, or a screen of that user
    (a screen's token on another user's path is 403)."""
    found = caller(request)
    user_id = path_text(request, "user_id")
    if not found.may_act_for(user_id):
        who = "this screen's token names another user" if found.role is Role.SCREEN else ""
        raise Refused(403, who or f"the {found.role} credential cannot act for a user", "user_id")
    return user_id


def service(request: Request) -> Caller:
    """The app's backend: the service token."""
    found = caller(request)
    if found.role is not Role.SERVICE:
        raise Refused(403, f"this route is the app's: the {found.role} credential cannot call it")
    return found


def operator(request: Request) -> Caller:
    """The operator: the operator token, as a bearer token."""
    found = caller(request)
    if found.role is not Role.OPERATOR:
        raise Refused(403, f"this route is the operator's: the {found.role} credential cannot")
    return found


def page_operator(request: Request) -> Caller:
    """The page: the operator token as a bearer token, or as Basic's password from the same
    site (a browser asks for it once and sends it by itself)."""
    found = _checked(request, _gatekeeper(request).identify(request, basic=True))
    if found.role is not Role.OPERATOR:
        raise Refused(403, f"the page is the operator's: the {found.role} credential cannot")
    return found


def same_site(request: Request) -> None:
    """A request that writes must not come from a page of another site, but the app's own
    origins (`AI_API_CORS_ORIGINS`)."""
    allowed: tuple[str, ...] = request.app.state.origins
    if not from_this_site(request, allowed):
        raise Refused(403, "cross-site requests are refused here", "origin")


def json_only(request: Request) -> None:
    """A body, if any, is JSON (415 otherwise); its size is held by `LimitedBodies`."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in (
        request.headers
    ):
        return
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media not in JSON_TYPES and not media.endswith("+json"):
        raise Refused(415, "body: send it as application/json", "content-type")


def single_values(request: Request) -> None:
    """A query parameter given twice is refused, not silently chosen from."""
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise Refused(422, f"{name}: given more than once; give it once", name)


TriggersDep = Annotated[Triggers, Depends(triggers)]
OperationsDep = Annotated[OperatorStore, Depends(operations)]
Writes = [Depends(json_only), Depends(same_site)]
