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

from protocol.errors import MeshError, OverloadedError, PayloadTooLargeError, UnavailableError

STORE_FAILED = 10077
"""JetStream's "storing the message failed", with the store's reason: a full stream says
"maximum messages exceeded", "maximum bytes exceeded" or "maximum messages per subject
exceeded"; a store in trouble says something else (and is a 503: :func:`for_now`)."""
STORAGE_EXCEEDED = 10047
"""The server's JetStream store (``max_file_store``) is used up: full for now."""
INSUFFICIENT_RESOURCES = 10023
"""The server has no room for more JetStream data now (a 503): full for now."""
ACCOUNT_RESOURCES = 10002
"""The account's JetStream storage is used up ("resource limits exceeded for account"): full
for now, as a full stream is (it was told for good: review S20e)."""
CLUSTER_UNAVAILABLE = 10008
"""JetStream's 503: no leader (an election, a lost quorum)."""
MESSAGE_TOO_LARGE = 10054
"""The message is over the stream's ``max_msg_size``."""
DUPLICATE_IN_PROCESS = 10158
"""A publish with the message id of one the stream is still storing (a leaderless stream, a
resend after a reconnect): for now, not for good."""
TOO_MANY_REQUESTS = 10167
"""JetStream's 429: the stream's ingest queue is over its limit for now (a burst)."""
BURST_RETRY_S = 1.0
"""When to publish again after a 429: a burst's ingest queue drains in milliseconds."""


def is_full(exc: APIError) -> bool:
    """The stream is full (its limit of messages or bytes, in all or per subject), or the
    server's store is. Read from the store's reason, not the code alone: 10077 is any failed
    store, and the codes an earlier list held beside it (10078, 10027, 10028) are a consumer's
    missing config, a limit of streams and of memory, none of them a full stream."""
    text = (exc.description or "").lower()
    by_limit = "maximum messages" in text or "maximum bytes" in text
    return by_limit or exc.err_code in (STORAGE_EXCEEDED, INSUFFICIENT_RESOURCES, ACCOUNT_RESOURCES)


def is_burst(exc: APIError) -> bool:
    """The stream takes no more for now: a burst over its ingest queue (a 429; review S19d saw
    it told "for good"). Not a full stream: the same publish goes through a moment later."""
    return exc.err_code == TOO_MANY_REQUESTS or exc.code == 429


def no_room(
    exc: APIError, where: str, retry_after: float, request_id: str | None, hint: str = ""
) -> OverloadedError | None:
    """A full stream or a burst, typed ``overloaded`` with when to try again (``retry_after``
    for a full one, :data:`BURST_RETRY_S` for a burst), else None. ``where``: "the cloud queue",
    "the site's outbox"; ``hint``: what the sender may want to know of a full one."""
    if is_full(exc):
        whose = "this sender's share of " if "per subject" in (exc.description or "") else ""
        return OverloadedError(
            f"{whose}{where} is full ({exc.description}){hint}",
            retry_after=retry_after,
            request_id=request_id,
        )
    if is_burst(exc):
        return OverloadedError(
            f"{where} takes no more for now: too many at once ({exc.description})",
            retry_after=BURST_RETRY_S,
            request_id=request_id,
        )
    return None


def in_process(exc: APIError) -> bool:
    """The stream is still storing a message with this id: the same publish may go again."""
    return exc.err_code == DUPLICATE_IN_PROCESS or "in process" in (exc.description or "")


def for_now(exc: APIError) -> bool:
    """The stream cannot take the message now, and the same publish may go again: it is full,
    in a burst, still storing the same id, has no leader (JetStream's 503, "temporarily
    unavailable": an election, a lost quorum), or failed on its side (a 5xx). Anything else
    refuses it for good (:func:`refused_for_good`)."""
    busy = is_full(exc) or is_burst(exc) or in_process(exc) or exc.err_code == CLUSTER_UNAVAILABLE
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
