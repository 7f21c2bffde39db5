"""What JetStream's refusal of a request's publish to the queue says to its sender: full or
leaderless for now (the request may go again), or refused for good.

A refusal for good is typed as what it is and never retryable: the same request meets the same
limit again. A message over the queue stream's ``max_msg_size`` read "the cloud queue is full"
(a retryable ``overloaded``: its "message size exceeds maximum allowed" has the word "maximum"
that a full stream's refusal has) where the SDK or an edge published it, and a retryable
``unavailable`` kept for the request's id for a week where a site forwarded it (review S19c).
"""

from __future__ import annotations

from nats.js.errors import APIError

from protocol.errors import MeshError, PayloadTooLargeError, UnavailableError

STORE_FULL_CODES = frozenset({10077, 10078, 10027, 10028})
"""JetStream's refusals of a full stream: maximum messages, bytes, or per subject."""
CLUSTER_UNAVAILABLE = 10008
"""JetStream's 503: no leader (an election, a lost quorum)."""
MESSAGE_TOO_LARGE = 10054
"""The message is over the stream's ``max_msg_size``."""
DUPLICATE_IN_PROCESS = 10158
"""A publish with the message id of one the stream is still storing (a leaderless stream, a
resend after a reconnect): for now, not for good."""
TOO_MANY_REQUESTS = 10167
"""JetStream's 429: the stream's ingest queue is over its limit for now (a burst)."""


def is_full(exc: APIError) -> bool:
    """The stream is full (its limit of messages or bytes, in all or per subject), or takes no
    more for now (a burst over its ingest queue, a 429: review S19d saw it told "for good")."""
    text = (exc.description or "").lower()
    full = exc.err_code in STORE_FULL_CODES or "maximum messages" in text or "maximum bytes" in text
    return full or exc.err_code == TOO_MANY_REQUESTS or exc.code == 429


def in_process(exc: APIError) -> bool:
    """The stream is still storing a message with this id: the same publish may go again."""
    return exc.err_code == DUPLICATE_IN_PROCESS or "in process" in (exc.description or "")


def for_now(exc: APIError) -> bool:
    """The stream cannot take the message now, and the same publish may go again: it is full,
    still storing the same id, has no leader (JetStream's 503, "temporarily unavailable": an
    election, a lost quorum), or failed on its side (a 5xx). Anything else refuses it for good
    (:func:`refused_for_good`)."""
    busy = is_full(exc) or in_process(exc) or exc.err_code == CLUSTER_UNAVAILABLE
    return busy or (exc.code or 0) >= 500


def refused_for_good(exc: APIError, what: str, request_id: str | None = None) -> MeshError:
    """A refusal not :func:`for_now` (the caller tells those apart first), typed:
    ``payload_too_large`` for a message over the stream's size limit, else ``unavailable``
    that says not to retry."""
    if exc.err_code == MESSAGE_TOO_LARGE or "message size exceeds" in (exc.description or ""):
        return PayloadTooLargeError(
            f"{what}: the request is over the queue's message size limit ({exc.description})",
            request_id=request_id,
        )
    return UnavailableError(f"{what}: {exc.description}", retryable=False, request_id=request_id)
