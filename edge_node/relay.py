"""Relaying an escalated request: queue it, pass the worker's events on, watch over it.

The edge queues the request under an id of its own (so clients' ids never collide in the queue)
with a cancel key only it knows, reads the answer through the stream contract (repairing from
the answer store), and passes every accepted event on with the client's id, faithfully: same
positions, same attempts.

It also decides, on its own clock, when the cloud cannot serve the request and the edge should
answer locally instead (``Fallback``), withdrawing the escalation so no worker spends time on
it:

- queued: nobody started it within ``cloud_start_timeout``, or the registry shows no live worker
  for the model: within ``node_ttl`` of the last one dying, or sooner, once the server says
  nobody listens for the workers it shows (:meth:`CloudModels.ask_workers`, from a quarter
  second unstarted);
- started: no first token within ``cloud_first_token_timeout`` (a hung engine), plus the prompt
  (and for a continuation the answer kept so far) at ``cloud_prefill_rate``;
- the serving worker is gone (the server says nobody listens for it, or the registry lost it
  and it has not said lately that it holds the request): at once if it had passed on nothing
  yet; else after waiting for another worker to continue the answer (``ack_wait`` plus a
  margin);
- nothing at all from a live worker for ``cloud_idle_timeout``.

None of it while the answer moves: tokens that came within the last quarter second outweigh
the registry and any verdict from before. A quiet answer brings the reader's watch, which asks
the worker itself and wakes the relay with what it heard.

While the edge's own link is down it judges nothing (it cannot see the cloud); after it comes
back, the reader first catches up on what it missed. The request's deadline bounds all of it:
past it, the answer ends in ``deadline_exceeded``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from edge_node.parts import EdgeCounts
from edge_node.records import Record
from edge_node.served import CloudModels, RegistryView
from mesh.config import EdgeSettings, StreamSettings, WorkerSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.queue import ALIVE_WAIT_S, CloudCall, new_cancel_key
from mesh.reader import WATCH_QUIET_S, AnswerReader
from mesh.tasks import TaskSet, raise_if_cancelled
from mesh.tracing import Tracing
from protocol.errors import (
    DeadlineExceededError,
    ErrorCode,
    MeshError,
    MeshTimeoutError,
    UnavailableError,
)
from protocol.fingerprint import Fingerprints
from protocol.messages import (
    EndEvent,
    ErrorEvent,
    InferRequest,
    RouteDecision,
    StartEvent,
    TokenEvent,
    WireEvent,
    new_request_id,
    route_decision,
    token_event,
)
from protocol.subjects import worker_of

log = get_logger(__name__)

# Cloud errors after which the edge answers locally (when the local model can).
FALLBACK_CODES = {
    ErrorCode.OVERLOADED.value,
    ErrorCode.UNAVAILABLE.value,
    ErrorCode.TIMEOUT.value,
    ErrorCode.DEADLINE_EXCEEDED.value,
    ErrorCode.BACKEND_ERROR.value,
    ErrorCode.MAX_DELIVERIES.value,
    ErrorCode.INCOMPLETE.value,
}
_TICK_S = 0.25
"""How often a relay looks at its answer's worker while the answer waits (queued, before its
first token, quiet): the registry's word on it, the deadlines."""
_FLOWING_TICK_S = 1.0
"""The same while tokens flow: nothing is due then (see :meth:`CloudRelay._follow`)."""
_HELD_WORD_S = 2 * WATCH_QUIET_S + ALIVE_WAIT_S
"""How long a worker's word that it holds the request stands: the watch asks again each
quarter second of quiet, and waits ALIVE_WAIT_S for it."""


class Fallback(Exception):
    """The cloud could not serve this request; answer locally, saying why. ``kind`` is one of a
    few words (for metrics): no_pool, no_worker, queue, deadline, not_started, no_first_token,
    worker_stopped, not_continued, stalled, idle, cloud_error."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def _quiet(reader: AnswerReader, now: float) -> bool:
    """Whether nothing of the answer came for the watch's quiet spell (``WATCH_QUIET_S``) up to
    ``now`` (``time.monotonic()``): the spell after which the reader asks its worker."""
    return now - reader.last_event >= WATCH_QUIET_S


def with_id(event: WireEvent, request_id: str) -> WireEvent:
    """``event`` under another request id (the client's instead of the queue's)."""
    if isinstance(event, TokenEvent):
        return token_as(event, request_id)
    if isinstance(event, StartEvent):  # the hub's queue delivery is none of the client's
        return event.model_copy(update={"id": request_id, "delivery": None})
    return event.model_copy(update={"id": request_id})


def token_as(event: TokenEvent, request_id: str) -> TokenEvent:
    """:func:`with_id` for a token."""
    return token_event(request_id, event.seq, event.text, event.attempt, event.n, event.logprobs)


TURN_TOKENS = 16
"""What a chat template adds a turn, at most, for the estimate that must not undercount."""
TURN_TOKENS_LEAST = 4
"""What it adds at least (SmolLM2's adds about 6): for the estimate that must not overcount
(:meth:`edge_node.paths.Paths._clearly_too_long`)."""


def estimate_prompt_tokens(req: InferRequest, turn_tokens: int = TURN_TOKENS) -> int:
    """A quick estimate of a request's prompt tokens: about 3 characters a token, each UTF-8
    byte past a character's first counted twice as a character. A Cyrillic letter (2 bytes)
    reads 1 token, a CJK character (3 bytes) 1.7, an emoji (4 bytes) 2.3; at 3 characters a
    token, 180 CJK characters read 60 where the bundled model counts 180 to 270. It may be
    under (digits apart are 2 characters a token): the local model says so
    (:class:`~protocol.errors.ContextTooLongError`), and the edge escalates then."""
    text = req.text()
    extra = 0 if text.isascii() else len(text.encode("utf-8", "surrogatepass")) - len(text)
    return (len(text) + 2 * extra) // 3 + turn_tokens * req.turns()


@dataclass(frozen=True)
class RelayParts:
    """What a relay uses of the edge (one for all its relays)."""

    conn: Connection
    edge_id: str
    scope: str
    """The scope the edge queues its requests under."""
    edge: EdgeSettings
    stream: StreamSettings
    worker: WorkerSettings
    models: CloudModels
    """Whether the cloud serves a model (a pool, a live worker)."""
    nodes: RegistryView
    """Whether the worker serving a request is live."""
    tracing: Tracing
    counts: EdgeCounts
    withdrawals: TaskSet
    """Where a relay's escalation is withdrawn, while its client is answered."""


class CloudRelay:
    """``local_fits``: whether the local model may answer this request at all (``no_local``
    says why not). When it may not, giving up on the cloud means a typed error, and a slow
    cloud is waited for (deadline)."""

    def __init__(  # noqa: PLR0917 - built in one place, by the paths
        self,
        parts: RelayParts,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        trace: Mapping[str, str] | None,
        *,
        local_fits: bool = True,
        no_local: str = "it is too long for the local model",
        tried: str | None = None,
        fingerprints: Fingerprints | None = None,
        restart: bool = True,
    ) -> None:
        """``restart``: whether a cloud error after tokens went out may start the answer over
        elsewhere (not once the local model refused the prompt, and it is the last pool)."""
        self.parts = parts
        self.fingerprints = fingerprints
        self.req = req
        self.decision = decision
        self.record = record
        self.received = received
        self.trace = trace
        self.local_fits, self.no_local = local_fits, no_local
        self.restart = restart and local_fits
        self.tried = tried
        """Earlier cloud pools of the edge's fallback chain that could not serve it, and why."""
        self.after = record.state.attempt
        """The attempts the record holds already (an earlier pool's): this pool's worker
        numbers its own from 1, so each is passed on numbered above them. Its start is then the
        answer starting over, not the earlier pool's answer going on with another's text."""
        self.first_token: float | None = None

    def ready(self) -> bool:
        """Whether the reader may pass tokens straight on (:meth:`take`): every client of the
        request takes them without waiting (NATS clients do; an SSE stream does not)."""
        return self.record.can_emit_now()

    def take(self, tokens: list[TokenEvent]) -> None:
        """In-order tokens, from the reader's subscription callback, while :meth:`_follow`
        waits: on to the clients at once (``mesh.reader.Passer``)."""
        self.first_token = self.first_token or time.perf_counter()
        if self.after:
            tokens = [t.model_copy(update={"attempt": t.attempt + self.after}) for t in tokens]
        self.record.emit_now(tokens)  # under the client's id

    def take_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        """:meth:`take` for the answer's next token, from its fields."""
        self.first_token = self.first_token or time.perf_counter()
        self.record.emit_token_now(seq, text, attempt + self.after, n)

    def _give_up(self, reason: str, kind: str) -> Fallback:
        if self.local_fits:
            return Fallback(reason, kind)
        raise UnavailableError(
            f"the cloud cannot serve this request ({reason}), and {self.no_local}",
            request_id=self.req.id,
        )

    async def run(self) -> None:
        parts, req, es = self.parts, self.req, self.parts.edge
        model = req.model or es.cloud_model
        cannot = await parts.models.cannot_serve(model)
        if cannot is not None:
            raise self._give_up(*cannot)
        now = time.time()
        deadline = req.deadline if req.deadline is not None else now + es.request_timeout
        if req.deadline is not None and deadline - now < es.cloud_min_budget and self.local_fits:
            raise Fallback(
                f"deadline too near for the cloud ({deadline - now:.1f}s left)", "deadline"
            )
        # With no local answer to fall back on, the request may wait in the queue all along.
        start_timeout = min(es.cloud_start_timeout if self.local_fits else 1e9, deadline - now)
        queued = req.model_copy(
            update={
                "id": new_request_id(),
                "model": model,
                "origin": parts.edge_id,
                "routing": _for_the_worker(self.decision),
                "start_by": now + start_timeout,
                "deadline": deadline,
                "reply": None,
                "cancel_key": new_cancel_key(),  # a fresh one only this edge knows
                "stream": True,
            }
        )
        # The worker's span continues this edge's (when tracing is on), else the client's.
        call = CloudCall(
            parts.conn,
            parts.stream,
            queued,
            scope=parts.scope,
            headers=parts.tracing.inject(self.trace),
            fingerprints=self.fingerprints,
        )
        maybe_queued = True  # unless the queue said it took nothing
        try:
            try:
                await call.open()
            except MeshError as err:  # queued all the same only if its ack was lost
                maybe_queued = isinstance(err, MeshTimeoutError)
                raise self._give_up(f"cloud queue unavailable: {err}", "queue") from None
            await self._follow(call, model, start_timeout, deadline)
        except BaseException:
            # Not answered from the cloud (a fallback, an error, a cancel or the deadline, as
            # it was queued too): no worker is to answer it for nobody. The client's answer
            # does not wait on that (a frozen worker's cancel takes its whole wait).
            if maybe_queued:
                parts.withdrawals.spawn(call.withdraw(), name="withdraw")
            raise
        finally:
            parts.counts.metrics.repairs.inc(call.reader.repaired_events)
            await call.close()

    async def _follow(
        self, call: CloudCall, model: str, start_timeout: float, deadline: float
    ) -> None:
        parts = self.parts
        es = parts.edge
        reader = call.reader
        state = reader.state
        clock = time.monotonic
        start_by = clock() + start_timeout
        hard_end = clock() + (deadline - time.time())
        first_token_wait = es.cloud_first_token_timeout + (
            estimate_prompt_tokens(self.req) / es.cloud_prefill_rate
        )
        first_token_by: float | None = None
        worker = ""
        gone_since: float | None = None
        # How long a dead worker's answer may take to be picked up and continued.
        takeover = parts.stream.ack_wait + parts.worker.fetch_timeout + es.cloud_first_token_timeout
        reader.pass_tokens(self)
        taken = reader.passed
        while True:
            raise_if_cancelled()
            now = clock()
            if now >= hard_end:
                raise DeadlineExceededError(
                    "the request's deadline passed before the cloud finished",
                    request_id=self.req.id,
                )
            moving = False  # a token came this turn: the worker is there and generating
            # While the answer flows nothing here is due: when it goes quiet, the reader's watch
            # asks the worker and wakes this loop with the verdict. The tick is a backstop then.
            flowing = state.positions > 0 and not _quiet(reader, now)
            events = await reader.next(min(_FLOWING_TICK_S if flowing else _TICK_S, hard_end - now))
            if reader.passed != taken:  # tokens went on meanwhile, from the callback (take)
                # Not "moving": the reader may have learned, later in the same wait, that the
                # worker stopped or stalled; the checks below see it this turn, not next.
                taken = reader.passed
                first_token_by = None
            for event in events:
                if isinstance(event, StartEvent):
                    worker = worker_of(event.node) or event.node
                    # A worker that continues the answer reads what it keeps of it too (about
                    # three characters a token, as the prompt's estimate counts).
                    kept = len(state.text()) // 3 / es.cloud_prefill_rate if event.seq else 0.0
                    first_token_by = clock() + first_token_wait + kept if self.local_fits else None
                    gone_since = None
                elif isinstance(event, TokenEvent):
                    first_token_by = None
                    moving = True
                    self.first_token = self.first_token or time.perf_counter()
                elif (
                    isinstance(event, ErrorEvent)
                    and event.code in FALLBACK_CODES
                    # Mid-answer too when the local model can answer and every client can
                    # take text back, as for a stalled or idle worker: a cloud engine failing
                    # after its first tokens ended in its error while the local model sat idle
                    # (review S20c). An SSE stream cannot: it keeps the cloud's error, not an
                    # "incomplete, retry" (review S20e).
                    and (
                        self.record.state.positions == 0
                        or (self.restart and self.record.takes_back())
                    )
                ):
                    raise self._give_up(
                        f"the cloud failed: {event.code}: {event.message}", "cloud_error"
                    )
                await self.record.emit([self._ours(event)])
            if state.done:  # after the whole batch: a repair brings many events at once
                return
            if moving:  # what follows asks whether the worker went quiet, stopped or stalled
                continue
            now = clock()
            if not parts.conn.connected:
                continue  # cut off, we cannot tell what the cloud does: only the deadline counts
            if not state.started:
                if now > start_by:
                    raise self._give_up(
                        f"no worker started it within {start_timeout:g}s", "not_started"
                    )
                if _quiet(reader, now):
                    parts.models.ask_workers(model)  # is the fleet the registry shows there?
                no_worker = parts.models.no_live_worker(model)
                if no_worker is not None:
                    raise self._give_up(*no_worker)
                continue
            if first_token_by is not None and now > first_token_by:
                raise self._give_up(
                    f"worker {worker} produced no token within {first_token_wait:.1f}s",
                    "no_first_token",
                )
            if state.positions > 0 and not _quiet(reader, now):
                # The answer moved within the last quarter second: its worker is at work,
                # whatever the registry (late, or cut off from its announcements) or a verdict
                # from before (a link that dropped and came back, an engine that paused) says.
                # Once it goes quiet, the reader's watch asks the worker again.
                gone_since = None
                continue
            live = parts.nodes.is_live(worker, model)
            lost = call.lost_worker == worker  # the server says its connection is gone
            if live is False and not lost and call.held_by(worker, _HELD_WORD_S):
                # It said just now that it holds the request (in its prefill, or finishing
                # it as it stops): the registry (it left it, or its announcements are late)
                # does not count over the worker's own word.
                live, gone_since = None, None
            if live is False or lost:
                if gone_since is None:
                    gone_since = now
                    log.warning("the worker serving the request stopped", worker=worker)
                if call.no_worker_left and lost:
                    raise self._give_up(
                        f"worker {worker} stopped and no live worker can continue the answer",
                        "worker_stopped" if state.positions == 0 else "not_continued",
                    )
                if live is False and state.positions == 0 and self.local_fits:
                    raise Fallback(
                        f"worker {worker} stopped before its first token", "worker_stopped"
                    )
                if now - gone_since > takeover:
                    raise self._give_up(
                        f"no worker continued the answer after {worker} stopped", "not_continued"
                    )
            elif call.stalled_worker == worker and state.positions > 0:
                raise self._give_up(
                    f"worker {worker} says its engine stands still mid-answer", "stalled"
                )
            elif now - reader.last_event > es.cloud_idle_timeout and state.positions > 0:
                raise self._give_up(
                    f"nothing from worker {worker} for {es.cloud_idle_timeout:g}s", "idle"
                )

    def _ours(self, event: WireEvent) -> WireEvent:
        """The worker's event as the edge's client gets it: under the client's id, numbered
        above an earlier pool's attempts (:attr:`after`)."""
        passed = (
            self._edge_end(event) if isinstance(event, EndEvent) else with_id(event, self.req.id)
        )
        attempt = getattr(passed, "attempt", None)
        if not self.after or attempt is None:
            return passed
        update: dict[str, object] = {"attempt": attempt + self.after}
        if isinstance(passed, StartEvent) and passed.reason is None:
            update["reason"] = f"answering from the {self.req.model!r} pool after {self.tried}"
        return passed.model_copy(update=update)

    def _edge_end(self, end: EndEvent) -> EndEvent:
        """The worker's end under the client's id (:func:`with_id`, in the same copy), with
        timings as the edge's client sees them."""
        timings = end.timings.model_copy(
            update={
                "ttft_ms": round((self.first_token - self.received) * 1000, 2)
                if self.first_token
                else None,
                "total_ms": round((time.perf_counter() - self.received) * 1000, 2),
            }
        )
        update: dict[str, object] = {
            "id": self.req.id,
            "timings": timings,
            "routing": self.decision,
            "path": "cloud",
        }
        if self.tried:
            update["fallback"] = f"served by the {self.req.model!r} pool after {self.tried}"
        return end.model_copy(update=update)


def _for_the_worker(decision: RouteDecision) -> RouteDecision:
    """The decision as the queued copy carries it: without the edge's budget (14 figures the
    worker would validate one by one, and the client's end carries it from the edge anyway:
    :meth:`CloudRelay` puts the edge's own decision on it)."""
    if decision.budget is None:
        return decision
    d = decision
    return route_decision(
        d.decision,
        d.reason,
        None,
        forced=d.forced,
        score=d.score,
        threshold=d.threshold,
        confidence=d.confidence,
    )
