"""The stream contract of one request: how its events are numbered, and what a reader accepts.

Every answer is a list of *positions*, one per ``tok`` event, numbered from 0. Producers
(:class:`AnswerWriter`: the worker, the edge's local path) send, for each delivery attempt:

- ``start(attempt, seq=k, digest=d)``: the attempt keeps the first k positions, whose text has
  CRC-32 d, and continues after them. k = 0 starts the answer (over).
- ``tok(attempt, seq=i, text, n)``: position i, carrying n engine tokens.
- ``end(attempt, seq=N, digest=D)``: the answer has N positions and its whole text has CRC-32 D.
- or ``err(attempt)``: the request ends in this typed error.

Every reader (the edge relaying a worker, the SDK, the HTTP API) feeds what arrives into one
:class:`AnswerState`, which passes on only a gap-free, duplicate-free answer of one chain of
attempts, and says when something is missing:

- an event of a request other than its own is dropped;
- an event of an attempt older than the current one is stale and dropped;
- a ``tok`` below the next position is a duplicate and dropped; above it, or of an attempt whose
  ``start`` has not arrived, it is held and the step reports a gap (the reader then fetches what
  it missed and feeds it; held events apply once the gap closes);
- a ``start`` of a newer attempt applies once the reader has the k positions it keeps, and only
  if their digest matches. If the reader already passed on positions beyond k, it cannot take
  them back: it passes on ``start(seq=0)`` (start over) and the k kept positions again;
- an ``end`` applies only when it vouches for exactly the positions and text passed on;
  otherwise the answer ends in a typed ``incomplete`` error, never in a shorter answer;
- after an ``end`` or ``err``, everything is dropped: one outcome per request.

Pure: no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from protocol.codec import error_event
from protocol.errors import DuplicateRequestError, IncompleteAnswerError, MeshError
from protocol.messages import (
    Answer,
    EndEvent,
    ErrorEvent,
    RouteDecision,
    StartEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
    WireEvent,
    token_event,
)

MAX_HELD = 4096
"""Events a reader holds while it waits for a gap to close; older ones are dropped (a repair
fetches them again)."""


def digest_of(text: str, previous: int = 0) -> int:
    """CRC-32 of ``text`` (UTF-8) continuing from ``previous``: the digest of a longer text."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"), previous)


def starts_over(event: WireEvent, passed_on: int) -> bool:
    """Whether ``event`` begins the answer again before what a reader already passed on: a
    start at a position below the ``passed_on`` positions its client has. The SDK then yields a
    ``RestartEvent``, an SSE stream ends in ``incomplete``, and the edge counts a restart."""
    return isinstance(event, StartEvent) and event.seq < passed_on


@dataclass(frozen=True)
class Resume:
    """Where a new attempt continues: the kept positions, their text, digest and token count."""

    seq: int = 0
    digest: int = 0
    text: str = ""
    tokens: int = 0


class AnswerWriter:
    """Numbers one attempt's events: positions, running digest, engine-token count."""

    def __init__(
        self,
        request_id: str,
        *,
        attempt: int = 1,
        node: str = "",
        fingerprint: str | None = None,
        resume: Resume | None = None,
        reason: str | None = None,
    ) -> None:
        resume = resume or Resume()
        self.request_id = request_id
        self.attempt = attempt
        self.node = node
        self.fingerprint = fingerprint
        self.reason = reason
        self.resume = resume
        self.seq = resume.seq
        self.tokens = resume.tokens
        self.delivery: str | None = None
        """The queue delivery this attempt holds (a worker's; see ``StartEvent.delivery``)."""
        self._texts: list[str] = []  # this attempt's positions, for the digest
        self._digested = (0, resume.digest)  # (of _texts, digest): where ``digest`` left off

    @property
    def digest(self) -> int:
        """CRC-32 of the text so far: worked out when the end asks, not per token (the hot
        path, on every worker and every local answer)."""
        done, digest = self._digested
        if done < len(self._texts):
            digest = digest_of("".join(self._texts[done:]), digest)
            self._digested = (len(self._texts), digest)
        return digest

    def start(self) -> StartEvent:
        return StartEvent(
            id=self.request_id,
            attempt=self.attempt,
            seq=self.resume.seq,
            digest=self.resume.digest,
            node=self.node,
            req=self.fingerprint,
            reason=self.reason,
            delivery=self.delivery,
        )

    def token(
        self, text: str, n: int = 1, logprobs: list[TokenLogprob] | None = None
    ) -> TokenEvent:
        """The next position; ``n`` is how many engine tokens ``text`` holds."""
        event = token_event(self.request_id, self.seq, text, self.attempt, n, logprobs)
        self.seq += 1
        self._texts.append(text)
        self.tokens += n
        return event

    def end(
        self,
        *,
        finish_reason: str,
        usage: Usage,
        timings: Timings | None = None,
        served_by: str = "",
        path: Literal["local", "cloud"] = "cloud",
        routing: RouteDecision | None = None,
        fallback: str | None = None,
    ) -> EndEvent:
        return EndEvent(
            id=self.request_id,
            seq=self.seq,
            attempt=self.attempt,
            digest=self.digest,
            finish_reason=finish_reason,
            usage=usage,
            timings=timings or Timings(),
            served_by=served_by,
            path=path,
            routing=routing,
            fallback=fallback,
        )

    def error(self, error: MeshError) -> ErrorEvent:
        event = error_event(error, self.request_id)
        event.attempt = self.attempt
        return event


@dataclass
class Step:
    """What feeding one event produced: events to pass on, in order, and whether something is
    missing (the reader should fetch what it missed)."""

    out: list[WireEvent] = field(default_factory=list)
    gap: bool = False


_Verdict = Literal["apply", "hold", "drop"]


class AnswerState:
    """A reader's view of one request's answer (see the module docstring for the rules).

    ``fingerprint``: the fingerprint of the request this reader sent, when it knows it; a
    ``start`` for another request under the same id ends the answer in a ``duplicate`` error.
    Given as a function, it is worked out when the first ``start`` comes: while the engine
    prefills, not on the way to it.
    """

    def __init__(
        self,
        request_id: str,
        *,
        fingerprint: str | Callable[[], str] | None = None,
        max_held: int = MAX_HELD,
    ) -> None:
        self.request_id = request_id
        self._fingerprint = fingerprint
        self.attempt = 0
        """The current attempt; 0 until the first ``start``."""
        self.node = ""
        self.delivery: str | None = None
        """The queue delivery the current attempt's start names (a worker's ack subject)."""
        self.texts: list[str] = []
        """Each position's text. A token appends its text and nothing else (the hot path):
        the rest is kept sparse, or worked out when asked for."""
        self._counts: dict[int, int] = {}
        """Engine tokens per position, where not 1."""
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        """Logprobs per position, where a token carried them."""
        self._digested = (0, 0)
        """(positions, digest of their text): where :meth:`digest_at` left off."""
        self.outcome: EndEvent | ErrorEvent | None = None
        self.held: list[WireEvent] = []
        self._max_held = max_held

    # -- what the reader has ---------------------------------------------------------------
    @property
    def positions(self) -> int:
        return len(self.texts)

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def started(self) -> bool:
        return self.attempt > 0

    def text(self) -> str:
        return "".join(self.texts)

    def whole(self) -> Answer | ErrorEvent | None:
        """The outcome as one message: the whole verified answer (what a non-streaming client
        gets), the typed error, or None while there is no outcome yet."""
        if isinstance(self.outcome, EndEvent):
            fields = self.outcome.model_dump(exclude={"t", "seq", "attempt", "digest"})
            logprobs = self.logprobs() or None  # asked for: every token's, in order
            return Answer(**fields, text=self.text(), digest=self.outcome.digest, logprobs=logprobs)
        return self.outcome

    def logprobs(self) -> list[TokenLogprob]:
        """The answer's per-token logprobs (empty when none were asked for)."""
        kept = self._logprobs
        return [entry for seq in sorted(kept) for entry in kept[seq]]

    def digest_at(self, seq: int) -> int:
        """Digest of the text of the first ``seq`` positions. Worked out when asked (an end, a
        continuation's start: once or twice an answer), on from where the last call left off,
        not kept per token: CRC-32 continues over concatenated text."""
        done, digest = self._digested
        if seq < done:
            done, digest = 0, 0
        if seq > done:
            digest = digest_of("".join(self.texts[done:seq]), digest)
        self._digested = (seq, digest)
        return digest

    def resume(self) -> Resume:
        """Where a new attempt can continue this answer from."""
        return Resume(
            seq=self.positions,
            digest=self.digest_at(self.positions),
            text=self.text(),
            tokens=self.positions + sum(n - 1 for n in self._counts.values()),
        )

    def missing(self) -> str:
        """What the reader waits for, in words (for logs and error messages)."""
        if self.outcome is not None:
            return "nothing"
        where = f"position {self.positions} of attempt {self.attempt}"
        if not self.held:
            return f"{where} or the end" if self.started else "the start"
        first = min(self.held, key=_order)
        return (
            f"{where}; holding {len(self.held)} later event(s) from "
            f"{first.t} seq {getattr(first, 'seq', 0)} of attempt {first.attempt}"
        )

    # -- feeding ---------------------------------------------------------------------------
    def feed(self, event: WireEvent) -> Step:
        if (
            type(event) is TokenEvent
            and event.logprobs is None
            and self.take_token(event.id, event.attempt, event.seq, event.text, event.n)
        ):
            return Step(out=[event])
        step = Step()
        if self.outcome is not None or (
            event.id != self.request_id and not (isinstance(event, ErrorEvent) and event.id is None)
        ):
            return step
        verdict = self._verdict(event)
        if verdict == "drop":
            return step
        if verdict == "hold":
            self._hold(event)
            step.gap = True
            return step
        self._apply(event, step.out)
        self._drain(step.out)
        step.gap = bool(self.held) and self.outcome is None
        return step

    def take_token(self, request_id: str, attempt: int, seq: int, text: str, n: int) -> bool:
        """The next token of the current attempt (no logprobs), taken from its fields alone:
        what :meth:`feed` does with it, without the checks that only other events need (the
        hot path: every token of every answer, on every hop). False, with nothing changed,
        when it is anything else: then :meth:`feed` decides."""
        texts = self.texts
        if (
            seq != len(texts)
            or attempt != self.attempt
            or self.held
            or self.outcome is not None
            or request_id != self.request_id
        ):
            return False
        texts.append(text)
        if n != 1:
            self._counts[seq] = n
        return True

    def feed_token(self, attempt: int, seq: int, text: str, n: int) -> None:
        """Feed this request's token given by its fields (no logprobs): taken as it is when it
        is the next one, else built into an event and fed."""
        if not self.take_token(self.request_id, attempt, seq, text, n):
            self.feed(token_event(self.request_id, seq, text, attempt, n))

    def feed_all(self, events: list[WireEvent]) -> Step:
        """Feed events in order (a replay of what a store kept); one combined step."""
        combined = Step()
        for event in events:
            step = self.feed(event)
            combined.out.extend(step.out)
        combined.gap = bool(self.held) and self.outcome is None
        return combined

    def fail(self, error: MeshError) -> Step:
        """End the answer in ``error`` (the reader gave up): the one outcome it passes on."""
        if self.outcome is not None:
            return Step()
        event = error_event(error, self.request_id)
        self.outcome = event
        return Step(out=[event])

    def _verdict(self, event: WireEvent) -> _Verdict:
        if isinstance(event, ErrorEvent):
            stale = event.attempt is not None and event.attempt < self.attempt
            return "drop" if stale else "apply"
        if event.attempt < self.attempt:
            return "drop"
        if isinstance(event, StartEvent):
            if event.attempt == self.attempt:
                # Another request's start at this attempt (an id reused at once): its tokens
                # would mix into this answer, so it ends it as a duplicate (review S20b).
                foreign = event.req and self._fingerprint and event.req != self.fingerprint
                return "apply" if foreign else "drop"
            if event.seq > self.positions:
                return "hold"
            if event.seq > 0 and self.digest_at(event.seq) != event.digest:
                return "hold"  # our prefix is not the one it continues: a repair may fix it
            return "apply"
        if event.attempt > self.attempt:
            return "hold"  # its start has not arrived
        if isinstance(event, TokenEvent):
            if event.seq < self.positions:
                return "drop"
            return "hold" if event.seq > self.positions else "apply"
        return "hold" if event.seq > self.positions else "apply"  # EndEvent

    def _apply(self, event: WireEvent, out: list[WireEvent]) -> None:
        if isinstance(event, TokenEvent):
            self._append(event.text, event.n, event.logprobs)
            out.append(event)
        elif isinstance(event, StartEvent):
            self._start(event, out)
        elif isinstance(event, EndEvent):
            self._end(event, out)
        else:
            self.outcome = event
            out.append(event)

    def _append(self, text: str, n: int, logprobs: list[TokenLogprob] | None) -> None:
        position = len(self.texts)
        self.texts.append(text)
        if n != 1:
            self._counts[position] = n
        if logprobs is not None:
            self._logprobs[position] = logprobs

    @property
    def fingerprint(self) -> str | None:
        fingerprint = self._fingerprint
        if callable(fingerprint):
            fingerprint = self._fingerprint = fingerprint()
        return fingerprint

    def _start(self, event: StartEvent, out: list[WireEvent]) -> None:
        if event.req and self._fingerprint and event.req != self.fingerprint:
            out.extend(
                self.fail(
                    DuplicateRequestError(
                        f"request id {self.request_id!r} is in use by a different request",
                        request_id=self.request_id,
                    )
                ).out
            )
            return
        keep = event.seq
        passed_on_beyond = self.positions > keep
        del self.texts[keep:]
        for sparse in (self._counts, self._logprobs):
            for position in [p for p in sparse if p >= keep]:
                del sparse[position]
        if self._digested[0] > keep:
            self._digested = (0, 0)
        self.attempt = event.attempt
        self.node = event.node
        self.delivery = event.delivery
        if not passed_on_beyond:
            out.append(event)
            return
        # Positions beyond ``keep`` were passed on and cannot be taken back: start over,
        # then pass on the kept positions again under the new attempt.
        out.append(
            StartEvent(
                id=self.request_id,
                attempt=event.attempt,
                seq=0,
                node=event.node,
                req=event.req,
                reason=event.reason,
            )
        )
        counts, logprobs = self._counts, self._logprobs
        for seq, text in enumerate(self.texts):
            out.append(
                token_event(
                    self.request_id, seq, text, event.attempt, counts.get(seq, 1), logprobs.get(seq)
                )
            )

    def _end(self, event: EndEvent, out: list[WireEvent]) -> None:
        expected = self.digest_at(self.positions)
        if event.seq != self.positions or (event.digest is not None and event.digest != expected):
            out.extend(
                self.fail(
                    IncompleteAnswerError(
                        f"the end vouches for {event.seq} positions (digest {event.digest}) but "
                        f"{self.positions} arrived (digest {expected}): not passed on as complete",
                        request_id=self.request_id,
                    )
                ).out
            )
            return
        self.outcome = event
        out.append(event)

    def _hold(self, event: WireEvent) -> None:
        self.held.append(event)
        if len(self.held) > self._max_held:
            del self.held[0]

    def _drain(self, out: list[WireEvent]) -> None:
        progressed = True
        while progressed and self.held and self.outcome is None:
            progressed = False
            for index, event in enumerate(self.held):
                verdict = self._verdict(event)
                if verdict == "hold":
                    continue
                del self.held[index]
                if verdict == "apply":
                    self._apply(event, out)
                progressed = True
                break
        if self.outcome is not None:
            self.held.clear()


def _order(event: WireEvent) -> tuple[int, int]:
    return (event.attempt or 0, getattr(event, "seq", 0))
