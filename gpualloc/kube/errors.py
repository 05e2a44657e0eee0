"""The small exception tree every Kubernetes call raises, mapped at the boundary.

An answer other than 2xx becomes one of these classes (``from_response``, from
the ``Status`` body the API server writes), and so do aiohttp's own errors when
the API server cannot be reached (``mapped``). Callers branch on these classes::

    try:
        await leases.create(api, namespace, body)
    except errors.AlreadyExists:
        ...

``AlreadyExists`` and ``Conflict`` share the status 409; the reason in the
response's ``Status`` body tells them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp

MAX_BODY = 300


class KubeError(Exception):
    """A failed Kubernetes API call: HTTP ``status`` (0 when none came back), ``reason``, ``message``.

    Each subclass has a default status and reason, so a fake in a test can raise
    ``errors.AlreadyExists(message="held by uid-1")``.
    """

    default_status = 0
    default_reason = "Unknown"

    def __init__(self, status: int | None = None, reason: str | None = None, message: str = "") -> None:
        self.status = self.default_status if status is None else status
        self.reason = self.default_reason if reason is None else reason
        self.message = message
        head = f"{self.status} {self.reason}" if self.status else self.reason
        super().__init__(f"{head}: {message}" if message else head)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.status, self.reason, self.message))


class BadRequest(KubeError):
    """400: the request itself is malformed (e.g. a patch that does not apply)."""

    default_status = 400
    default_reason = "BadRequest"


class Unauthorized(KubeError):
    """401: the credentials were not accepted."""

    default_status = 401
    default_reason = "Unauthorized"


class Forbidden(KubeError):
    """403: RBAC (or an admission policy) denied the request."""

    default_status = 403
    default_reason = "Forbidden"


class NotFound(KubeError):
    """404: the object (or its kind) does not exist."""

    default_status = 404
    default_reason = "NotFound"


class AlreadyExists(KubeError):
    """409 with reason AlreadyExists: a create hit an existing name."""

    default_status = 409
    default_reason = "AlreadyExists"


class Conflict(KubeError):
    """409 otherwise: a stale resourceVersion or a failed precondition."""

    default_status = 409
    default_reason = "Conflict"


class Gone(KubeError):
    """410: the resourceVersion is too old (compacted); re-list."""

    default_status = 410
    default_reason = "Expired"


class Invalid(KubeError):
    """422: the object failed validation (the CRD schema, a field's rules)."""

    default_status = 422
    default_reason = "Invalid"


class Unavailable(KubeError):
    """5xx, 429, or no answer at all: the API server is down, restarting or overloaded. Retry."""

    default_status = 503
    default_reason = "ServiceUnavailable"


_BY_STATUS: dict[int, type[KubeError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    410: Gone,
    422: Invalid,
    429: Unavailable,
}

# What aiohttp (and the OS) raise when the API server cannot be reached or goes away mid-request.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)

# What ``mapped`` translates.
_MAPPED_ERRORS: tuple[type[BaseException], ...] = TRANSPORT_ERRORS


def truncate(text: str, limit: int = MAX_BODY) -> str:
    """``text`` cut to ``limit`` characters, marked when cut."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more)"


def _class_for(status: int, reason: str) -> type[KubeError]:
    if status == 409:
        return AlreadyExists if reason == "AlreadyExists" else Conflict
    if status >= 500:
        return Unavailable
    return _BY_STATUS.get(status, KubeError)


def from_status(status: Mapping[str, Any]) -> KubeError:
    """The error a ``Status`` object describes (a response body, or a watch ERROR event's object)."""
    code = status.get("code")
    code = code if isinstance(code, int) else 0
    reason = str(status.get("reason") or "")
    message = truncate(str(status.get("message") or ""))
    return _class_for(code, reason)(code, reason or "Unknown", message)


def from_response(status: int, body: bytes | str | None, http_reason: str = "") -> KubeError:
    """The error for an HTTP status and its body (a JSON ``Status`` when the API server wrote it)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    parsed: Any = None
    if text:
        with contextlib.suppress(ValueError):
            parsed = json.loads(text)
    if isinstance(parsed, dict) and parsed.get("kind") == "Status":
        # The HTTP status is what happened; the body only explains it.
        return from_status({**parsed, "code": status})
    reason = http_reason or "Unknown"
    return _class_for(status, reason)(status, reason, truncate(text))


def translate(exc: BaseException) -> KubeError:
    """The tree's error for any exception a Kubernetes call raised."""
    if isinstance(exc, KubeError):
        return exc
    if isinstance(exc, TRANSPORT_ERRORS):
        detail = str(exc) or type(exc).__name__
        return Unavailable(0, type(exc).__name__, truncate(detail))
    return KubeError(0, type(exc).__name__, truncate(str(exc)))


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """Re-raise transport errors as the tree, chained with ``from``."""
    try:
        yield
    except _MAPPED_ERRORS as exc:
        raise translate(exc) from exc
