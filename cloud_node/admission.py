"""What a worker checks of a decoded request before it serves it."""

from __future__ import annotations

from cloud_node.cancels import CancelBook
from protocol.errors import (
    CancelledByClientError,
    DeadlineExceededError,
    InvalidRequestError,
    UnknownModelError,
)
from protocol.messages import InferRequest
from protocol.subjects import model_token


def check(request: InferRequest, address: str, model: str, cancels: CancelBook) -> None:
    """Raise the typed error that refuses ``request`` (token subject ``address``) on a worker
    serving ``model``: another model, a reply subject other than its own token subject, a
    deadline already passed, or a cancel that came first."""
    if request.model is not None and model_token(request.model) != model_token(model):
        raise UnknownModelError(
            f"this worker serves {model!r}, not {request.model!r}", request_id=request.id
        )
    if request.reply is not None and request.reply != address:
        raise InvalidRequestError(
            f"reply must be absent or {address!r}: answers go only to the request's own "
            "token subject, in the scope it was queued under",
            request_id=request.id,
            details=[{"loc": "reply", "msg": "not this request's token subject"}],
        )
    if request.past_deadline():
        raise DeadlineExceededError(
            "the request's deadline passed before it could start", request_id=request.id
        )
    if cancels.cancels(address, request):
        raise CancelledByClientError("cancelled before it started", request_id=request.id)
