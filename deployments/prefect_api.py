"""The app side's way to Prefect: `PREFECT_API_URL`, else this data directory's `serve`, over its
REST API with httpx, fast whatever Prefect's state (importing Prefect takes about 2 s)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from queue_store import Settings
from queue_store.redact import mask_url

SERVE_STATE = "serve.json"
TIMEOUT_SECONDS = 1.0  # per request; a trigger makes at most two
BUSY_RETRY_PAUSES = (0.2, 0.5, 1.0)  # seconds before each retry of a 503


class PrefectUnavailable(Exception):
    """No run could be started; the message says why, in one line."""


@dataclasses.dataclass(frozen=True)
class ServeState:
    """What a running `serve` tells other processes of the same data directory."""

    api_url: str
    ui_url: str
    pid: int
    worker: str
    leases: tuple[str, ...] = ()  # `gateway` slot leases held now, given back after a crash

    @classmethod
    def path(cls, settings: Settings) -> Path:
        return settings.data_dir / SERVE_STATE

    @classmethod
    def read(cls, settings: Settings) -> ServeState | None:
        """The state of a live `serve`, or None."""
        if (state := cls.read_left(settings)) is None:
            return None
        try:
            with contextlib.suppress(PermissionError):  # alive, another account's
                os.kill(state.pid, 0)
        except ProcessLookupError:
            return None
        return state

    @classmethod
    def read_left(cls, settings: Settings) -> ServeState | None:
        """What the file says, whether that serve still runs or not."""
        try:
            data = json.loads(cls.path(settings).read_text())
            leases = tuple(str(lease) for lease in data.get("leases", ()))
            api, ui, worker = str(data["api_url"]), str(data["ui_url"]), str(data["worker"])
            return cls(api, ui, int(data["pid"]), worker, leases)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, settings: Settings) -> None:
        path = self.path(settings)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(dataclasses.asdict(self)))
        temporary.replace(path)

    def remove(self, settings: Settings) -> None:
        left = self.read_left(settings)
        if left is not None and left.pid == self.pid:
            self.path(settings).unlink(missing_ok=True)


def api_url(settings: Settings) -> str | None:
    """The Prefect API the app side uses: PREFECT_API_URL, else this data dir's `serve`."""
    if configured := os.environ.get("PREFECT_API_URL", "").strip():
        return configured.rstrip("/")
    state = ServeState.read(settings)
    return state.api_url.rstrip("/") if state else None


def ui_url(settings: Settings) -> str | None:
    if configured := os.environ.get("PREFECT_UI_URL", "").strip():
        return configured.rstrip("/")
    api = api_url(settings)
    return api.removesuffix("/api") if api else None


class PrefectApi:
    """Just what the triggers need of Prefect's REST API: short timeouts, no retries but 503's."""

    def __init__(self, base_url: str, *, timeout: float = TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        # What answers and logs say of the server: never its credentials (G5).
        self.shown_url = mask_url(self.base_url)
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get("PREFECT_API_KEY"):
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        self._deployments: dict[str, str] = {}  # name -> id; single dict operations, no lock

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for pause in (*BUSY_RETRY_PAUSES, None):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.HTTPError as exc:
                raise PrefectUnavailable(
                    f"Prefect unreachable at {self.shown_url} ({type(exc).__name__})"
                ) from None
            # The embedded server's SQLite answers 503 now and then ("database is
            # locked"), in bursts while serve starts: a few spaced retries get through.
            if response.status_code != 503 or pause is None:
                return response
            time.sleep(pause)
        raise AssertionError("unreachable")

    def deployment_id(self, name: str) -> str:
        if known := self._deployments.get(name):
            return known
        response = self._request("GET", f"/deployments/name/{name}")
        if response.status_code == 404:
            raise PrefectUnavailable(
                f"Prefect at {self.shown_url} has no deployment {name}: "
                "is `insight-queue serve` (or `deploy`) running for this data directory?"
            )
        if response.status_code >= 400:
            raise PrefectUnavailable(
                f"Prefect at {self.shown_url} answered HTTP {response.status_code} "
                f"reading deployment {name}"
            )
        found = self._deployments[name] = str(response.json()["id"])
        return found

    def create_run(
        self,
        deployment: str,
        parameters: dict[str, Any],
        *,
        name: str,
        tags: list[str],
        idempotency_key: str,
    ) -> str:
        """Start a run of `deployment`; the same key returns the same run."""
        deployment_id = self.deployment_id(deployment)
        body = dict(name=name, parameters=parameters, tags=tags, idempotency_key=idempotency_key)
        response = self._request("POST", f"/deployments/{deployment_id}/create_flow_run", json=body)
        if response.status_code == 404:
            self._deployments.pop(deployment, None)  # redeployed: look it up again
        if response.status_code >= 400:
            detail = " ".join(response.text.split())[:200]
            raise PrefectUnavailable(
                f"Prefect at {self.shown_url} refused the run of {deployment} "
                f"(HTTP {response.status_code}): {detail}"
            )
        return str(response.json()["id"])
