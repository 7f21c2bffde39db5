"""Which path answers a request the edge accepted, and each path's answer:

- local: the on-device model, in one of its slots (:class:`~edge_node.local_gate.LocalGate`);
- the cascade: local first, escalated mid-answer when the local model is unsure of its first
  tokens (:mod:`edge_node.cascade`);
- the site: a request that can wait, held at the edge's site until the cloud answers
  (:mod:`edge_node.site`);
- the cloud chain: the request's cloud pool (then, for a request naming no model, each fallback
  pool), each through a :class:`~edge_node.relay.CloudRelay`; past the last, local, saying why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Literal

from edge_node.cascade import Cascade, replay
from edge_node.confidence import ConfidenceGate
from edge_node.local_gate import LocalGate
from edge_node.parts import EdgeCounts
from edge_node.records import Record
from edge_node.relay import (
    TURN_TOKENS_LEAST,
    CloudRelay,
    Fallback,
    RelayParts,
    estimate_prompt_tokens,
)
from edge_node.router import CloudBudget, Router, budget_of, decide
from edge_node.served import CloudModels
from edge_node.site import SiteStore
from mesh.backends.base import (
    ANSWER_ROOM,
    ROOM_CHECKED,
    Backend,
    Chunk,
    NoRoomError,
    ScoringBackend,
)
from mesh.config import EdgeSettings, WorkerSettings
from mesh.generate import generate_into
from mesh.logs import get_logger
from mesh.tasks import raise_if_cancelled
from protocol.errors import (
    BackendError,
    ContextTooLongError,
    DeadlineExceededError,
    UnknownModelError,
)
from protocol.fingerprint import Fingerprints
from protocol.messages import InferRequest, RouteDecision, TokenEvent, route_decision
from protocol.stream import AnswerWriter

log = get_logger(__name__)

TEMPLATE_ROOM = 64
"""Tokens a prompt's chat template may add beyond the estimate: a prompt that leaves less room
than this in the local context does not fit it."""


@dataclass(frozen=True)
class PathParts:
    """What the paths use of the edge."""

    node_name: str
    backend: Backend
    """The on-device model."""
    router: Router
    edge: EdgeSettings
    worker: WorkerSettings
    counts: EdgeCounts
    models: CloudModels
    relay: RelayParts
    site: SiteStore | None


class Paths:
    def __init__(self, parts: PathParts) -> None:
        self.parts = parts
        self._es = parts.edge
        self.backend = parts.backend
        self.router = parts.router
        self.node_name = parts.node_name
        self.counts = parts.counts
        self.site = parts.site
        self._gate = LocalGate(parts.backend, parts.edge.local_queue)
        self._cascade = self._make_cascade()

    @property
    def budget(self) -> CloudBudget | None:
        return budget_of(self.router)

    def _make_cascade(self) -> Cascade | None:
        confidence = self._es.router.confidence
        if not confidence.enabled:
            return None
        if not isinstance(self.backend, ScoringBackend):
            log.warning(
                "mid-answer escalation needs a backend that scores tokens; it is off",
                backend=type(self.backend).__name__,
            )
            return None
        budget = self.budget
        return Cascade(
            self.backend,
            self._gate,
            ConfidenceGate(confidence),
            stall=self.parts.worker.stall_timeout,
            may_escalate=budget.mid_answer if budget is not None else lambda: True,
            min_budget=self._es.cloud_min_budget,
        )

    async def answer(
        self,
        req: InferRequest,
        record: Record,
        received: float,
        trace: Mapping[str, str] | None,
        fingerprints: Fingerprints | None = None,
    ) -> None:
        """Route ``req`` and answer it into ``record`` by its path (``fingerprints``: of
        ``req``, made already)."""
        if req.is_expired():
            raise DeadlineExceededError(
                "the request's deadline passed before it could start", request_id=req.id
            )
        if req.model is not None and req.model == self.backend.model:
            # Naming the local model lets the router choose, as over HTTP: escalated, the
            # request goes to the edge's cloud model, not to a pool named after the local one.
            req = req.model_copy(update={"model": None})
        # A client that names a model other than the local one gets that model or nothing;
        # with route "local" the local model answers whatever it named, as over HTTP (it was
        # refused here when no pool served the name: review S20c).
        named = req.model
        if (
            named is not None
            and req.route != "local"
            and not await self.parts.models.deployed(named)
        ):
            raise UnknownModelError(
                f"no worker pool serves model {req.model!r} and it is not this edge's "
                f"local model ({self.backend.model!r})",
                request_id=req.id,
                details=[{"loc": "model", "msg": "not served"}],
            )
        decision = self._not_routed(req) or decide(self.router, req)
        decision = self._busy_local(req, decision) or decision
        self.counts.inc(f"route.{decision.decision}" + (".forced" if decision.forced else ""))
        self.counts.metrics.decisions.labels(
            decision=decision.decision, forced=str(decision.forced).lower()
        ).inc()
        # The canonical line carries the decision; this one is for following a request live.
        log.debug(
            "routed", decision=decision.decision, score=decision.score, reason=decision.reason
        )
        fallback: str | None = None
        overflowed = False
        overflows = self._may_overflow(req, decision)
        counted = ROOM_CHECKED.set(overflows)  # the local model counts what the estimate let by
        try:
            if self._cascade_applies(req, decision):
                escalated = await self._local_first(req, decision, record, received)
                if escalated is None:
                    return  # answered locally
                decision = escalated
            elif decision.decision == "local" and overflows:
                await self._run_local(req, decision, record, received, None, first=True)
                return
        except ContextTooLongError as err:
            if not overflows:
                raise
            # The estimate let it through; the local model's count did not (nothing was sent).
            # One that fits but leaves too little room can still be answered what fits, after a
            # cloud that fails mid-answer too (review S21b); one that does not fit cannot.
            decision = self._overflowed(decision, err)
            overflowed = not isinstance(err, NoRoomError)
        finally:
            ROOM_CHECKED.reset(counted)
        if (
            decision.decision == "cloud"
            and req.deferrable
            and self.site is not None
            and decision.confidence is None  # the local model began it: it can still answer
        ):
            await self.site.relay(req, decision, record)
            return
        if decision.decision == "cloud":
            fallback = await self._cloud_chain(  # refused by the local model: no restart there
                req, decision, record, received, trace, fingerprints, restart=not overflowed
            )
            if fallback is None:
                return  # answered by the cloud
        await self._run_local(req, decision, record, received, fallback)

    async def _cloud_chain(  # noqa: PLR0917 - answer()'s parts, passed on
        self,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        trace: Mapping[str, str] | None,
        fingerprints: Fingerprints | None,
        *,
        restart: bool = True,
    ) -> str | None:
        """The cloud's answer: the request's pool, then (naming none) each fallback pool; None
        once one answered, else why none did (the local model answers then: one that found the
        prompt too long for its context says so again, ``context_too_long``)."""
        named = req.model
        # Named: no other pool, and not the local model (its answer would go out under the
        # named model's name).
        local_fits = named is None and not self._clearly_too_long(req)
        no_local = f"it names model {named!r}" if named else "it is too long for the local model"
        chain = [req.model or self._es.cloud_model]
        if req.model is None:
            chain += self._es.cloud_fallbacks
        failed: list[str] = []
        for step, model in enumerate(chain):
            last = step == len(chain) - 1
            try:
                relay = CloudRelay(
                    self.parts.relay,
                    req if step == 0 else req.model_copy(update={"model": model}),
                    decision,
                    record,
                    received,
                    trace,
                    local_fits=local_fits or not last,
                    no_local=no_local,
                    tried="; ".join(failed) or None,
                    fingerprints=fingerprints,
                    restart=restart or not last,
                )
                await relay.run()
                return None
            except Fallback as fb:
                failed.append(f"{model}: {fb.reason}" if len(chain) > 1 else fb.reason)
                self.counts.inc("fallback")
                self.counts.metrics.fallbacks.labels(reason=fb.kind).inc()
                if not last:
                    log.warning("trying the next cloud pool", failed=model, reason=fb.reason)
        fallback = "; ".join(failed)
        log.warning("answering locally instead of the cloud", reason=fallback)
        return fallback

    def _may_overflow(self, req: InferRequest, decision: RouteDecision) -> bool:
        """Whether a local answer whose prompt the local model finds too long for its context
        goes to the cloud instead: one the router (not the client) kept local, naming no
        model, with time left for the cloud."""
        if decision.decision != "local" or decision.forced or req.route != "auto" or req.model:
            return False
        return self._too_near(req) is None

    def _overflowed(self, decision: RouteDecision, err: ContextTooLongError) -> RouteDecision:
        budget = self.budget
        if budget is not None:  # not the router's choice: counted as forced, outside the share
            budget.record_forced("cloud")
        self.counts.inc("route.cloud.overflow")
        log.info("escalating: the prompt does not fit the local context", error=err.message)
        return decision.model_copy(
            update={
                "decision": "cloud",
                "reason": f"{decision.reason}; the prompt does not fit the local model's "
                f"context ({err.message})",
                "budget": budget.snapshot() if budget is not None else decision.budget,
            }
        )

    def _not_routed(self, req: InferRequest) -> RouteDecision | None:
        """The decision for a request whose route the router does not choose (unless the client
        insists on one): one naming a cloud model goes to it; one whose prompt leaves the local
        model's context too little room for its answer (``max_tokens``, or ``ANSWER_ROOM`` of a
        larger one) goes to the cloud (llama.cpp would end the answer where the context ends);
        one whose deadline the cloud cannot meet stays local. Not the router's choice: counted
        as forced, outside the share and the cloud cap."""
        if req.route != "auto":
            return None
        prompt, n_ctx = estimate_prompt_tokens(req), self._es.model.n_ctx
        room = n_ctx - prompt
        route: Literal["local", "cloud"] = "cloud"
        if req.model is not None:
            reason = f"it names model {req.model!r}"
        elif room < TEMPLATE_ROOM or room < min(req.max_tokens, ANSWER_ROOM):
            reason = (
                f"prompt too long for the local model (~{prompt} tokens, context {n_ctx}: "
                f"too little room for {min(req.max_tokens, ANSWER_ROOM)} more)"
            )
        elif (left := self._too_near(req)) is not None:
            route, reason = "local", f"deadline too near for the cloud ({left:.1f}s left)"
        else:
            return None
        budget = self.budget
        if budget is not None:
            budget.record_forced(route)
        return route_decision(route, reason, budget.snapshot() if budget is not None else None)

    def _busy_local(self, req: InferRequest, decision: RouteDecision) -> RouteDecision | None:
        """A request the router kept local while the local model has no room for it (every
        slot busy, its wait queue full) goes to the cloud rather than back to its client as
        ``overloaded``, within the budget's per-minute cap. Should the cloud not take it
        either, the local model's answer is still ``overloaded``."""
        if decision.decision != "local" or decision.forced or not self._gate.full:
            return None
        if (decision.budget or {}).get("capped"):
            return None  # the router found the cap full: asked again, it counts it twice
        if req.model is not None and req.model != self._es.cloud_model:
            return None  # a client that names its model gets that model or nothing
        if self._too_near(req) is not None:
            return None  # the cloud could not meet it: not worth a place under the cap
        budget = self.budget
        if budget is not None and not budget.local_busy():
            return None
        return decision.model_copy(
            update={
                "decision": "cloud",
                "reason": f"the local model is busy ({decision.reason})",
                "budget": budget.snapshot() if budget is not None else decision.budget,
            }
        )

    def _clearly_too_long(self, req: InferRequest) -> bool:
        """Too long for the local context even if the estimate is over by half: no local
        fallback is tried (one that may fit is: the local model says if it does not). Counted
        with the least a template adds a turn: at 16, a chat of 31 short turns that fits a 256
        context read as twice too long, and was refused when the cloud could not take it
        (review S20c)."""
        return estimate_prompt_tokens(req, TURN_TOKENS_LEAST) > 2 * self._es.model.n_ctx

    def _too_near(self, req: InferRequest) -> float | None:
        """The seconds left before ``req``'s deadline when they are too few for the cloud
        (``cloud_min_budget``); None when the cloud has time (or there is no deadline)."""
        if req.deadline is None:
            return None
        left = req.deadline - time.time()
        return left if left < self._es.cloud_min_budget else None

    async def _run_local(
        self,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        fallback: str | None,
        *,
        first: bool = False,
    ) -> None:
        """The local answer. ``first``: its generation's first chunk before anything is sent,
        so that a prompt too long for the local context raises
        :class:`~protocol.errors.ContextTooLongError` with nothing sent."""
        # One the local model began, escalated, and the cloud gave back held a slot already:
        # it waits for one again, not refused for a queue full of requests that came since.
        admitted = bool((decision.confidence or {}).get("escalated"))
        async with self._gate.slot(req.id, admitted=admitted):
            slot_at = time.perf_counter() if first else None
            chunks = await self._begun(req) if first else None
            try:
                await self._local_answer(
                    req, decision, record, received, fallback, chunks=chunks, slot_at=slot_at
                )
            finally:
                if chunks is not None:
                    await chunks.aclose()

    async def _begun(self, req: InferRequest) -> AsyncGenerator[Chunk, None]:
        """The local generation of ``req``, its first chunk read (the prompt evaluated)."""
        chunks = self.backend.generate(req)
        stall = self.parts.worker.stall_timeout
        try:
            first = await asyncio.wait_for(anext(chunks), stall)
            raise_if_cancelled()  # a cancel that wait_for swallowed as it finished (Python 3.11)
        except asyncio.TimeoutError:
            await chunks.aclose()
            raise BackendError(
                f"the engine produced nothing for {stall:g}s", retryable=True
            ) from None
        except BaseException:
            await chunks.aclose()
            raise
        return replay([first], chunks)

    async def _local_answer(
        self,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        fallback: str | None,
        *,
        chunks: AsyncIterator[Chunk] | None = None,
        slot_at: float | None = None,
    ) -> None:
        """The local answer, in the local slot the caller holds (``chunks``: a generation the
        caller started, e.g. with its first tokens held)."""
        writer = AnswerWriter(
            req.id,
            attempt=record.state.attempt + 1,
            node=self.node_name,
            reason=f"answering locally: {fallback}" if fallback else None,
        )
        await record.emit([writer.start()])

        async def emit(token: TokenEvent) -> None:
            await record.emit([token])

        gen = await generate_into(self.backend, req, writer, emit, self.parts.worker, chunks=chunks)
        waited = (slot_at if slot_at is not None else gen.started) - received
        await record.emit(
            [
                writer.end(
                    finish_reason=gen.finish_reason,
                    usage=gen.usage,
                    timings=gen.timings(since=received, queue_ms=waited * 1000),
                    served_by=self.node_name,
                    path="local",
                    routing=decision,
                    fallback=fallback,
                )
            ]
        )

    def _cascade_applies(self, req: InferRequest, decision: RouteDecision) -> bool:
        """Mid-answer escalation is for requests the router kept local, named no model, and
        leave the cloud time to answer."""
        if self._cascade is None or decision.decision != "local" or decision.forced:
            return False
        if req.model is not None:
            return False
        return self._too_near(req) is None

    async def _local_first(
        self, req: InferRequest, decision: RouteDecision, record: Record, received: float
    ) -> RouteDecision | None:
        """Mid-answer escalation: answer locally unless the local model is unsure of its first
        tokens; then the decision to escalate (nothing of the local answer was sent)."""

        async def answer_locally(
            chunks: AsyncIterator[Chunk], slot_at: float, kept: RouteDecision
        ) -> None:
            await self._local_answer(
                req, kept, record, received, None, chunks=chunks, slot_at=slot_at
            )

        assert self._cascade is not None
        escalated = await self._cascade.run(req, decision, answer_locally)
        if escalated is not None:
            budget = self.budget
            if budget is not None:  # as it stands now, the escalation counted
                escalated = escalated.model_copy(update={"budget": budget.snapshot()})
            self.counts.inc("route.cloud.mid_answer")
            self.counts.metrics.mid_answer.inc()  # the router's decision stays counted as local
        return escalated
