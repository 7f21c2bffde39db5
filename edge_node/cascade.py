"""Mid-answer escalation: start on the local model, escalate when it is unsure of itself.

A request the router keeps local starts generating at once. The edge holds its first
``window_tokens`` tokens, reading the model's confidence in each (entropy of its next-token
distribution). If the model was sure enough, the held tokens go out and the answer continues
locally, in one stream. If not, the local generation stops, nothing of it has reached the
client, and the request goes to the cloud: the client sees one coherent answer either way.

Holding costs the local path ``window_tokens - 1`` token times of TTFT; the alternative (the
cloud continuing from the local prefix) would keep the local TTFT but let the answer start
with text the cloud was called in to replace. The README's router section has the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from edge_node.confidence import Confidence, ConfidenceGate, summarise
from edge_node.local_gate import LocalGate
from mesh.backends.base import Chunk, ScoringBackend
from mesh.logs import get_logger
from mesh.tasks import raise_if_cancelled
from protocol.errors import BackendError
from protocol.messages import InferRequest, RouteDecision

log = get_logger(__name__)

AnswerLocally = Callable[[AsyncIterator[Chunk], float, RouteDecision], Awaitable[None]]
"""Give the answer locally from these chunks (the local slot taken at the given
``perf_counter`` time), its end explained by the decision."""


class Cascade:
    def __init__(
        self,
        backend: ScoringBackend,
        gate: LocalGate,
        confidence: ConfidenceGate,
        *,
        stall: float | None,
        may_escalate: Callable[[], bool] = lambda: True,
        min_budget: float = 0.0,
    ) -> None:
        self.backend = backend
        self.gate = gate
        self.confidence = confidence
        self.stall = stall
        self.may_escalate = may_escalate
        """Asked once per low-confidence answer (the cloud budget's per-minute cap)."""
        self.min_budget = min_budget
        """The least time before its deadline a request is escalated with (the cloud's)."""

    async def run(
        self, req: InferRequest, decision: RouteDecision, answer_locally: AnswerLocally
    ) -> RouteDecision | None:
        """Answer ``req`` locally, or return the decision to escalate it (nothing sent yet)."""
        async with self.gate.slot(req.id):
            slot_at = time.perf_counter()
            chunks = self.backend.generate_scored(req, scored_tokens=self.confidence.window)
            try:
                held, confidence = await self._hold(chunks)
            except BaseException:
                await chunks.aclose()
                raise
            escalate, why = (
                (False, "") if confidence is None else self.confidence.escalate(confidence)
            )
            capped = bool((decision.budget or {}).get("capped"))
            late = req.deadline is not None and req.deadline - time.time() < self.min_budget
            if escalate and late:  # the cloud would refuse it: the answer under way is kept
                escalate, why = False, f"{why}; kept local: the deadline is too near for the cloud"
            elif escalate and (capped or not self.may_escalate()):
                escalate, why = False, f"{why}; kept local: the cloud cap per minute is reached"
            if escalate and confidence is not None:
                await chunks.aclose()  # the engine stops; none of it reached the client
                log.info("escalating mid-answer", reason=why, **confidence.as_dict())
                return _explained(decision, confidence, why, escalated=True)
            kept = decision
            if confidence is not None:
                reason = f"{decision.reason}; {why}" if decision.reason else why
                kept = _explained(decision, confidence, reason, escalated=False)
            replayed = replay(held, chunks)
            try:
                await answer_locally(replayed, slot_at, kept)
            finally:  # cancelled before the replay ran: its engine thread must stop too
                await replayed.aclose()
                await chunks.aclose()
            return None

    async def _hold(
        self, chunks: AsyncGenerator[Chunk, None]
    ) -> tuple[list[Chunk], Confidence | None]:
        """The first window's chunks (or the whole answer, if shorter) and their confidence."""
        held: list[Chunk] = []
        readings: list[tuple[float, float]] = []
        window, texts = self.confidence.window, 0
        # Counted in sampled tokens (a text chunk may stand for several), or in chunks should
        # the engine give no readings at all.
        while len(readings) < window and not (texts >= window and not readings):
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), self.stall)
                raise_if_cancelled()  # one wait_for swallowed as the chunk came (Python 3.11)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise BackendError(
                    f"the engine produced nothing for {self.stall:g}s", retryable=True
                ) from None
            held.append(chunk)
            if chunk.finish_reason is not None:
                break
            texts += 1
            readings.extend(chunk.confidence or ())
        return held, summarise(readings[:window])


async def replay(
    held: list[Chunk], rest: AsyncGenerator[Chunk, None]
) -> AsyncGenerator[Chunk, None]:
    async with contextlib.aclosing(rest):
        for chunk in held:
            yield chunk
            if chunk.finish_reason is not None:
                return
        async for chunk in rest:
            yield chunk


def _explained(
    decision: RouteDecision, confidence: Confidence, reason: str, *, escalated: bool
) -> RouteDecision:
    """``decision`` with the confidence that settled it; escalated: now a cloud decision."""
    update: dict[str, object] = {
        "reason": reason,
        "confidence": {**confidence.as_dict(), "escalated": escalated},
    }
    if escalated:
        update["decision"] = "cloud"
    return decision.model_copy(update=update)
