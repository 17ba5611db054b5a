"""The one error hierarchy. The API maps these to ``{"error": ..., "detail": ...}``.

Each class carries an HTTP status for the API and a short machine name.
"""

from __future__ import annotations

from typing import Any, Literal

#: why a ``Refused`` was refused, for code that acts on it (never read from the message's words).
#: ``not_running``: nothing of the model runs (its container is not running, no process of it is found).
#: ``already_running``: a start of a model whose container runs already (nothing to launch).
#: ``guarded``: a start or restart of a guarded container, which sparkd never launches (the operator does).
#: A start refused for these is no failed launch (``loop.unattended``'s relaunch tells them apart).
RefusedReason = Literal["not_running", "already_running", "guarded"]


class SparkdError(Exception):
    """Base of every error sparkd raises on purpose."""

    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, *, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_json(self) -> dict[str, Any]:
        """``{"error": code, "detail": ...}``; a dict detail always carries ``message`` too."""
        if isinstance(self.detail, dict):
            return {"error": self.code, "detail": {"message": self.message, **self.detail}}
        return {"error": self.code, "detail": self.detail if self.detail is not None else self.message}


class ConfigError(SparkdError):
    """A configuration value is invalid; the message names key, value and what is allowed."""

    status_code = 422
    code = "invalid_config"


class InvalidInput(SparkdError):
    """Bad input from a user (CLI or API): names the field and the allowed values."""

    status_code = 422
    code = "invalid_input"

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        # a missing value is "not set", not Python's None (a new user read "weights_gib: None is not allowed")
        msg = (
            f"{field}: not set; needed: {allowed}"
            if value is None
            else f"{field}: {value!r} is not allowed; allowed: {allowed}"
        )
        super().__init__(msg, detail={"field": field, "value": value, "allowed": allowed, "message": msg})
        self.field = field


class Conflict(SparkdError):
    """An action is already running for this container ("already stopping")."""

    status_code = 409
    code = "conflict"


class NotFound(SparkdError):
    status_code = 404
    code = "not_found"


class Refused(SparkdError):
    """A plan, preflight, resize or action was refused; nothing was changed.

    ``reason``: why, for code that acts on it (``RefusedReason``); None when no caller tells the cases apart. It is
    not in the API's body (``to_json``): the message says it to a person."""

    status_code = 422
    code = "refused"

    def __init__(self, message: str, *, detail: Any = None, reason: RefusedReason | None = None) -> None:
        super().__init__(message, detail=detail)
        self.reason = reason


class DockerUnavailable(SparkdError):
    """The Docker engine cannot be reached (or did not answer in time). Until it is back a stop (the guard's or an
    operator's) acts on the container's processes (``act.procstop``); start, restart and resize are refused with
    this, and a stop when the container's id is not known yet."""

    status_code = 503
    code = "docker_unavailable"


class EngineRefused(SparkdError):
    """The Docker engine answered and refused the call with an error of its own (HTTP 500 and the like, not 409
    Conflict nor 404): it may be unable to say anything of the container (containerd stuck). An emergency stop
    goes on by the container's processes, as when the engine does not answer."""


class StoreError(SparkdError):
    """The database cannot be opened or written."""

    status_code = 500
    code = "store_error"


class Unauthorized(SparkdError):
    """No valid bearer token or session (API, dashboard controls, archive downloads)."""

    status_code = 401
    code = "unauthorized"


class Forbidden(SparkdError):
    """A cross-site request, a foreign ``Origin`` or a missing CSRF token."""

    status_code = 403
    code = "forbidden"


class BadHost(SparkdError):
    """A ``Host`` header not in ``api.allowed_hosts`` (DNS rebinding) or not ``host[:port]``."""

    status_code = 400
    code = "bad_host"


class TooLarge(SparkdError):
    """A request body over ``api.max_body_bytes``: refused before it is read."""

    status_code = 413
    code = "too_large"


class MetricsUnavailable(SparkdError):
    """vLLM's ``/metrics`` could not be fetched or parsed (server down, not vLLM, bad text)."""

    status_code = 503
    code = "metrics_unavailable"


def one_line(e: BaseException) -> str:
    """An exception as one line for an event or a log (SQLAlchemy's ``orig`` when it wraps one), at most 300
    characters."""
    text = str(getattr(e, "orig", None) or e)
    return (text.splitlines() or [type(e).__name__])[0][:300]
