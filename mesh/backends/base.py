"""The one interface every inference engine implements; edge and cloud code see only this."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mesh.tasks import raise_if_cancelled
from protocol.errors import ContextTooLongError
from protocol.messages import InferRequest, TokenLogprob, Usage


@dataclass(slots=True)
class Chunk:
    """A piece of a generation: text, or (last) the finish reason with usage. Not frozen: one is
    made per engine token, and a frozen dataclass takes 0.77 us to build against 0.22 us. Treat
    it as immutable (``dataclasses.replace`` for a changed copy)."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    n: int = 1
    """Engine tokens in ``text``."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per engine token, when the request asked for logprobs."""
    confidence: tuple[tuple[float, float], ...] | None = None
    """From :meth:`ScoringBackend.generate_scored`: for each token sampled since the previous
    chunk (one, usually; more when the engine held text back, such as half a character), the
    entropy (nats) and the top token's log-probability of the distribution it was drawn from."""


@dataclass(frozen=True)
class Capacity:
    total: int
    """Requests the engine can generate at once."""
    free: int
    """Of those, how many it can take now (may reflect engine load, e.g. KV-cache use)."""
    saturated: bool = False
    """The engine itself said it takes no more now (its load figures, a 429 or 503 with
    Retry-After), whatever its slots: a worker then pulls nothing beyond them either."""


ANSWER_ROOM = 256
"""The least room a prompt must leave in a local model's context for its answer (the whole
``max_tokens`` where it is less): an edge sends a prompt that would leave less to the cloud. A
client's generous ``max_tokens`` alone does not make a short prompt too long."""
ROOM_CHECKED: ContextVar[bool] = ContextVar("mesh_room_checked", default=False)
"""Set where the cloud would take a local answer the local model cannot give whole (an edge's
router kept it local, the client did not insist): the local model then counts the prompt and
refuses one that leaves less than :data:`ANSWER_ROOM` (or ``max_tokens``) with
``context_too_long``, nothing generated, rather than end the answer where its context ends (a
short answer that reads as one of ``max_tokens``). Elsewhere (no cloud to take it, a forced
local route) it answers what fits, as before."""


class NoRoomError(ContextTooLongError):
    """A prompt that fits the local context but leaves it too little room for its answer
    (:data:`ROOM_CHECKED`): unlike one that does not fit, the local model can still answer
    what fits, where nothing better can."""


KV_CACHE_FULL = 0.95
"""An engine whose KV cache is at least this full takes no new work."""


def engine_saturated(load: dict[str, float]) -> bool:
    """True when an engine's own figures say it cannot take more now: it already queues
    requests, or its KV cache is nearly full. The work then waits in JetStream, where any
    worker can take it, not in this engine's queue."""
    return load.get("waiting", 0.0) > 0 or load.get("kv_cache", 0.0) >= KV_CACHE_FULL


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str = ""
    slow: bool = False
    """No answer in time (:func:`health_within`): a busy engine, perhaps, not a dead one."""


@runtime_checkable
class Backend(Protocol):
    """An inference engine.

    ``generate`` is an async generator of :class:`Chunk`; the last chunk has ``finish_reason``.
    Closing or cancelling the generator aborts the generation in the engine. Engine failures
    raise :class:`protocol.errors.BackendError` (or a more specific ``MeshError``).

    ``prefix``: text the assistant already said (``prefix_tokens`` engine tokens of it): generate
    what follows it, as one answer, with at most ``max_tokens - prefix_tokens`` more tokens. Only
    backends whose ``continues`` is true accept a prefix; the others raise ``ValueError``.

    Requests may be ``raw`` (no chat template), ask for ``logprobs`` (chunks then carry one
    :class:`TokenLogprob` per token) and constrain output with ``response_format``; a backend
    that cannot do one of these raises :class:`protocol.errors.InvalidRequestError`.
    """

    model: str
    continues: bool
    """True when ``generate`` can continue an answer from a prefix (request migration)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def capacity(self) -> Capacity: ...

    async def health(self) -> Health: ...


SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate, half of a character outside the BMP."""


def whole(text: str) -> str:
    """``text`` with its surrogate pairs joined and a lone surrogate (half a character: a token
    may end inside one) as U+FFFD: no UTF-8 writer takes one, and an answer streamed with its
    logprobs failed."""
    if text.isascii() or not SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def openai_logprobs(found: dict[str, Any], *, chat: bool, top: int) -> list[TokenLogprob]:
    """Per-token logprobs of one streamed choice in OpenAI's wire formats (llama-cpp-python
    uses them too): chat's ``content`` entries, or the completions API's parallel lists."""
    if chat:
        return [
            TokenLogprob(
                token=whole(entry["token"]),
                logprob=float(entry["logprob"]),
                top=[
                    (whole(t["token"]), float(t["logprob"]))
                    for t in entry.get("top_logprobs") or []
                ]
                if top
                else None,
            )
            for entry in found.get("content") or []
        ]
    tokens = found.get("tokens") or []
    tops = found.get("top_logprobs") or [None] * len(tokens)
    return [
        TokenLogprob(
            token=whole(token),
            logprob=float(logprob),
            top=[(whole(t), float(lp)) for t, lp in (alts or {}).items()][:top] if top else None,
        )
        for token, logprob, alts in zip(
            tokens, found.get("token_logprobs") or [], tops, strict=False
        )
        if logprob is not None
    ]


@runtime_checkable
class ScoringBackend(Protocol):
    """A backend that can say how sure its model was of each token it generated (the edge's
    mid-answer escalation reads it). Scoring the first ``scored_tokens`` tokens costs about
    0.1 ms each; later chunks carry no confidence."""

    def generate_scored(
        self, request: InferRequest, *, scored_tokens: int
    ) -> AsyncGenerator[Chunk, None]: ...


MAX_ENGINE_PAUSE_S = 30.0
"""The longest an engine's ``Retry-After`` is believed: a worker waits no longer for it."""


def engine_pause(retry_after: float | None) -> float | None:
    """How long to wait before asking an engine that said ``Retry-After`` again: at least a
    second, at most :data:`MAX_ENGINE_PAUSE_S`; None when it said nothing."""
    return None if retry_after is None else max(1.0, min(retry_after, MAX_ENGINE_PAUSE_S))


HEALTH_WITHIN_S = 1.0
"""How long a health check is waited for (an engine that does not answer is not ok)."""


async def health_within(backend: Backend, timeout: float = HEALTH_WITHIN_S) -> Health:
    """``backend.health()``, bounded: one that does not answer in time, or fails, is not ok."""
    try:
        health = await asyncio.wait_for(backend.health(), timeout)
        raise_if_cancelled()  # a cancel that wait_for swallowed as it finished (Python 3.11)
        return health
    except asyncio.TimeoutError:
        raise_if_cancelled()  # a cancel that wait_for swallowed (Python 3.11)
        detail = f"no answer to a health check within {timeout:g}s"
        return Health(ok=False, detail=detail, slow=True)
    except Exception as exc:  # a health check must never take its caller down
        return Health(ok=False, detail=f"health check failed: {type(exc).__name__}: {exc}")
