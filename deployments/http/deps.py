"""What a route depends on: its caller, checked (who may call what: `access`), the form of its
request (P3), and the triggers it works through, from `app.state` (never the raw store)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict

from deployments.http.access import Caller, Gatekeeper, Role, from_this_site
from deployments.http.errors import Refused
from deployments.http.middleware import ENCODED_SLASHES, SLASH
from deployments.triggers import Triggers
from queue_store import OperatorStore


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def path_text(request: Request, name: str) -> str:
    """A path parameter as the client meant it (an encoded slash is a slash)."""
    found = str(request.path_params[name])
    return found.replace(SLASH, "/") if request.scope.get(ENCODED_SLASHES) else found


def _caller(request: Request, *, basic: bool = False) -> Caller:
    """Whoever calls, by their credential (401 without one), within their rate (429)."""
    gatekeeper: Gatekeeper = request.app.state.gatekeeper
    found = gatekeeper.identify(request, basic=basic)
    gatekeeper.admit(found)
    return found


def for_user(request: Request) -> str:
    """The path's user, if the caller may act for them: the service, or a screen of that user."""
    found = _caller(request)
    user_id = path_text(request, "user_id")
    if not found.may_act_for(user_id):
        who = "this screen's token names another user" if found.role is Role.SCREEN else ""
        raise Refused(403, who or f"the {found.role} credential cannot act for a user", "user_id")
    return user_id


def only(role: Role, refusal: str, *, basic: bool = False) -> Callable[[Request], Caller]:
    """The caller, if it has `role` (403 otherwise, `refusal` naming the caller's role)."""

    def check(request: Request) -> Caller:
        found = _caller(request, basic=basic)
        if found.role is not role:
            raise Refused(403, refusal.format(role=found.role))
        return found

    return check


service = only(Role.SERVICE, "this route is the app's: the {role} credential cannot call it")
operator = only(Role.OPERATOR, "this route is the operator's: the {role} credential cannot")
# The page also takes the operator token as Basic's password, from the same site: a browser
# asks for it once and sends it by itself.
page_operator = only(
    Role.OPERATOR, "the page is the operator's: the {role} credential cannot", basic=True
)


def same_site(request: Request) -> None:
    """A request that writes comes from no page of another site but the app's own origins."""
    allowed: tuple[str, ...] = request.app.state.origins
    if not from_this_site(request, allowed):
        raise Refused(403, "cross-site requests are refused here", "origin")


def json_only(request: Request) -> None:
    """A body, if any, is JSON (415 otherwise); its size is held by `LimitedBodies`."""
    headers = request.headers
    if headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
        return
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise Refused(415, "body: send it as application/json", "content-type")


def single_values(request: Request) -> None:
    """A query parameter given twice is refused, not silently chosen from."""
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise Refused(422, f"{name}: given more than once; give it once", name)


def triggers(request: Request) -> Triggers:
    found: Triggers = request.app.state.triggers
    return found


def operations(request: Request) -> OperatorStore:
    """The store as the operator's routes use it (`Triggers.operator`)."""
    return triggers(request).operator


TriggersDep = Annotated[Triggers, Depends(triggers)]
OperationsDep = Annotated[OperatorStore, Depends(operations)]
Writes = [Depends(json_only), Depends(same_site)]
