"""The kube boundary maps every failure to the small error tree."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gpualloc.kube import errors


def status_error(status: int, reason: str, message: str = "boom", http_reason: str = "X") -> errors.KubeError:
    """The error for an answer with this HTTP status and the API server's ``Status`` body."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return errors.from_response(status, json.dumps({**body, "code": status}), http_reason)


@pytest.mark.parametrize(
    ("status", "reason", "expected"),
    [
        (400, "BadRequest", errors.BadRequest),
        (401, "Unauthorized", errors.Unauthorized),
        (403, "Forbidden", errors.Forbidden),
        (404, "NotFound", errors.NotFound),
        (409, "AlreadyExists", errors.AlreadyExists),
        (409, "Conflict", errors.Conflict),
        (410, "Expired", errors.Gone),
        (410, "Gone", errors.Gone),
        (422, "Invalid", errors.Invalid),
        (429, "TooManyRequests", errors.Unavailable),
        (500, "InternalError", errors.Unavailable),
        (503, "ServiceUnavailable", errors.Unavailable),
        (504, "Timeout", errors.Unavailable),
    ],
)
def test_translate_maps_status_and_reason_to_the_tree(status: int, reason: str, expected: type) -> None:
    err = status_error(status, reason, message="the message")
    assert type(err) is expected
    assert err.status == status
    assert err.reason == reason
    assert err.message == "the message"


def test_409_tells_already_exists_from_conflict_by_the_body_reason() -> None:
    exists = status_error(409, "AlreadyExists", http_reason="Conflict")
    conflict = status_error(409, "Conflict", http_reason="Conflict")
    assert isinstance(exists, errors.AlreadyExists)
    assert not isinstance(exists, errors.Conflict)
    assert isinstance(conflict, errors.Conflict)
    assert not isinstance(conflict, errors.AlreadyExists)


def test_unknown_status_is_a_plain_kube_error() -> None:
    err = status_error(418, "Teapot")
    assert type(err) is errors.KubeError
    assert err.status == 418


def test_body_that_is_not_a_status_keeps_the_http_reason_and_is_truncated() -> None:
    err = errors.from_response(502, "<html>" + "x" * 5000 + "</html>", "Bad Gateway")
    assert isinstance(err, errors.Unavailable)
    assert err.reason == "Bad Gateway"
    assert len(err.message) < errors.MAX_BODY + 40
    assert err.message.startswith("<html>xxx")


def test_long_status_message_is_truncated() -> None:
    err = status_error(422, "Invalid", message="y" * 10_000)
    assert isinstance(err, errors.Invalid)
    assert len(err.message) < errors.MAX_BODY + 40
    assert len(str(err)) < errors.MAX_BODY + 80


def test_bytes_body_is_decoded() -> None:
    body = json.dumps({"kind": "Status", "reason": "NotFound", "message": "gone", "code": 404}).encode()
    err = errors.from_response(404, body, "Not Found")
    assert isinstance(err, errors.NotFound)
    assert err.message == "gone"


def test_http_status_wins_over_a_status_body_with_another_code() -> None:
    body = json.dumps({"kind": "Status", "reason": "NotFound", "message": "x", "code": 404})
    assert isinstance(errors.from_response(500, body), errors.Unavailable)


def test_watch_error_event_status_object_maps_to_gone() -> None:
    status = {"kind": "Status", "status": "Failure", "reason": "Expired", "message": "too old", "code": 410}
    err = errors.from_status(status)
    assert isinstance(err, errors.Gone)
    assert err.message == "too old"


@pytest.mark.parametrize(
    "exc",
    [
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientConnectionError("connection refused"),
        aiohttp.ClientPayloadError("payload"),
        TimeoutError(),
        ConnectionResetError("reset by peer"),
        ConnectionRefusedError(111, "refused"),
    ],
)
def test_transport_errors_are_unavailable_with_status_zero(exc: BaseException) -> None:
    err = errors.translate(exc)
    assert isinstance(err, errors.Unavailable)
    assert err.status == 0


def test_mapped_maps_transport_errors() -> None:
    original = aiohttp.ServerDisconnectedError()
    with pytest.raises(errors.Unavailable) as info, errors.mapped():
        raise original
    assert info.value.__cause__ is original


def test_mapped_leaves_other_exceptions_and_cancellation_alone() -> None:
    with pytest.raises(KeyError), errors.mapped():
        raise KeyError("x")
    with pytest.raises(asyncio.CancelledError), errors.mapped():
        raise asyncio.CancelledError()


def test_translate_of_a_kube_error_is_itself() -> None:
    err = errors.Conflict(409, "Conflict", "stale")
    assert errors.translate(err) is err


def test_every_error_is_a_kube_error_with_status_reason_message() -> None:
    err = errors.from_response(404, b'{"kind":"Status","reason":"NotFound","message":"nope","code":404}')
    assert isinstance(err, errors.KubeError)
    assert (err.status, err.reason, err.message) == (404, "NotFound", "nope")
    assert "404" in str(err) and "nope" in str(err)


def test_errors_built_by_hand_get_their_class_status_and_reason() -> None:
    # What a fake client in another component's unit test raises.
    err = errors.AlreadyExists(message="held by uid-1")
    assert (err.status, err.reason, err.message) == (409, "AlreadyExists", "held by uid-1")
    assert (errors.NotFound().status, errors.Gone().status, errors.Invalid().status) == (404, 410, 422)
    assert errors.Unavailable(0, "ServerDisconnectedError").status == 0
    assert str(errors.Conflict(message="stale")) == "409 Conflict: stale"
