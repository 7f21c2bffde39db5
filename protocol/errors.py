"""Stable error codes and the project's one error root.

Errors cross NATS as an :class:`protocol.messages.ErrorEvent` carrying ``code``, ``message`` and
``retryable``; never as a Python traceback. Each code below is part of the wire contract: add new
ones, never rename or reuse them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class ErrorCode(str, Enum):
    """Stable, machine-readable error codes (the ``code`` field of an error message)."""

    BAD_PAYLOAD = "bad_payload"
    """The bytes could not be decoded: malformed msgpack, invalid JSON, or non-UTF-8 text."""
    INVALID_REQUEST = "invalid_request"
    """The payload decoded but a field is missing or out of range."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The payload is larger than the node's configured limit."""
    UNKNOWN_MODEL = "unknown_model"
    """No worker pool serves the requested model."""
    CONTEXT_TOO_LONG = "context_too_long"
    """The prompt plus ``max_tokens`` does not fit the model's context window."""
    OVERLOADED = "overloaded"
    """The queue or the node is full; retry after ``retry_after`` seconds."""
    UNAVAILABLE = "unavailable"
    """The target (edge, cloud pool, NATS) cannot be reached right now."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The request's deadline passed before it could start or finish."""
    CANCELLED = "cancelled"
    """The client or the edge cancelled the request."""
    TIMEOUT = "timeout"
    """A network wait ran past its time limit."""
    BACKEND_ERROR = "backend_error"
    """The inference backend failed while generating."""
    MAX_DELIVERIES = "max_deliveries"
    """Workers failed this request as many times as the consumer allows."""
    DUPLICATE = "duplicate"
    """The request id is in use by a different request of the same sender, or its answer is no
    longer kept."""
    INCOMPLETE = "incomplete"
    """Part of the answer was lost on the way and could not be recovered; retry."""
    UNAUTHORIZED = "unauthorized"
    """The NATS server refused the process's credentials (wrong, expired or revoked), or an edge's
    HTTP API a request's API key (missing or not valid there)."""
    INTERNAL = "internal"
    """A bug: an unexpected failure inside a node."""


# Codes whose condition is transient: the same request may succeed later.
RETRYABLE_CODES = frozenset(
    {
        ErrorCode.OVERLOADED,
        ErrorCode.UNAVAILABLE,
        ErrorCode.TIMEOUT,
        ErrorCode.BACKEND_ERROR,
        ErrorCode.INCOMPLETE,
    }
)


class MeshError(Exception):
    """Root of every error this project raises on purpose.

    ``code`` is stable; ``retryable`` says whether the same request may succeed later;
    ``retry_after`` (seconds) is a hint for overload; ``details`` carries field-level
    information (for example pydantic validation errors) safe to show to a caller.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | None = None,
        retryable: bool | None = None,
        retry_after: float | None = None,
        details: list[dict[str, Any]] | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.retryable = self.code in RETRYABLE_CODES if retryable is None else retryable
        self.retry_after = retry_after
        self.details = details
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class BadPayloadError(MeshError):
    code = ErrorCode.BAD_PAYLOAD


class InvalidRequestError(MeshError):
    code = ErrorCode.INVALID_REQUEST


class PayloadTooLargeError(MeshError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class UnknownModelError(MeshError):
    code = ErrorCode.UNKNOWN_MODEL


class ContextTooLongError(MeshError):
    code = ErrorCode.CONTEXT_TOO_LONG


class OverloadedError(MeshError):
    code = ErrorCode.OVERLOADED


class UnavailableError(MeshError):
    code = ErrorCode.UNAVAILABLE


class UnauthorizedError(MeshError):
    code = ErrorCode.UNAUTHORIZED


class DeadlineExceededError(MeshError):
    code = ErrorCode.DEADLINE_EXCEEDED


class CancelledByClientError(MeshError):
    code = ErrorCode.CANCELLED


class MeshTimeoutError(MeshError, TimeoutError):
    """A network wait ran out; also a builtin ``TimeoutError`` so callers may catch either."""

    code = ErrorCode.TIMEOUT


class BackendError(MeshError):
    code = ErrorCode.BACKEND_ERROR


class MaxDeliveriesError(MeshError):
    code = ErrorCode.MAX_DELIVERIES


class DuplicateRequestError(MeshError):
    code = ErrorCode.DUPLICATE


class IncompleteAnswerError(MeshError):
    code = ErrorCode.INCOMPLETE


_BY_CODE: dict[ErrorCode, type[MeshError]] = {
    cls.code: cls
    for cls in (
        BadPayloadError,
        InvalidRequestError,
        PayloadTooLargeError,
        UnknownModelError,
        ContextTooLongError,
        OverloadedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledByClientError,
        MeshTimeoutError,
        BackendError,
        MaxDeliveriesError,
        DuplicateRequestError,
        IncompleteAnswerError,
        UnauthorizedError,
    )
}


def error_class(code: ErrorCode | str) -> type[MeshError]:
    """The exception class for a wire code; unknown codes map to :class:`MeshError`."""
    try:
        return _BY_CODE.get(ErrorCode(code), MeshError)
    except ValueError:
        return MeshError


_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_PAYLOAD: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_TOO_LONG: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.UNKNOWN_MODEL: 404,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.DUPLICATE: 409,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.BACKEND_ERROR: 502,
    ErrorCode.MAX_DELIVERIES: 502,
    ErrorCode.INCOMPLETE: 502,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}


def status_of(code: ErrorCode) -> int:
    """An HTTP-like status for a code: the ``Nats-Service-Error-Code`` header of NATS micro."""
    return _STATUS.get(code, 500)
