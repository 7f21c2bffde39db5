"""The stream contract (protocol.stream): every reader passes on one gap-free, duplicate-free
answer of one chain of attempts, or one typed error; never a shorter, gapped, doubled or mixed
answer. Unit tests of the pure state machine, including hostile and random event orders."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import WireFormat, decode_event, dump_event
from protocol.errors import ErrorCode, OverloadedError
from protocol.fingerprint import request_fingerprint
from protocol.messages import (
    EndEvent,
    ErrorEvent,
    InferRequest,
    StartEvent,
    TokenEvent,
    TokenLogprob,
    Usage,
    WireEvent,
)
from protocol.stream import AnswerState, AnswerWriter, Resume, digest_of

RID = "req1"


def attempt_events(
    texts: list[str], *, attempt: int = 1, resume: Resume | None = None, end: bool = True
) -> list:
    writer = AnswerWriter(RID, attempt=attempt, node=f"w{attempt}", resume=resume)
    events: list = [writer.start()]
    events += [writer.token(text) for text in texts]
    if end:
        events.append(writer.end(finish_reason="stop", usage=Usage(completion_tokens=len(texts))))
    return events


def passed_text(out: list) -> str:
    """The text a downstream reader ends with, feeding what this one passed on."""
    downstream = AnswerState(RID)
    downstream.feed_all(out)
    assert downstream.done, downstream.missing()
    return downstream.text()


def test_in_order_answer_passes_through_unchanged() -> None:
    events = attempt_events([" t0", " t1", " t2"])
    state = AnswerState(RID)
    step = state.feed_all(events)
    assert step.out == events
    assert not step.gap
    assert isinstance(state.outcome, EndEvent)
    assert state.text() == " t0 t1 t2"
    assert state.outcome.digest == digest_of(" t0 t1 t2")


def test_a_missing_token_is_a_gap_and_the_end_is_held_until_it_arrives() -> None:
    events = attempt_events([" a", " b", " c"])
    state = AnswerState(RID)
    out = []
    for event in [events[0], events[1], events[3], events[4]]:  # " b" (seq 1) is lost
        step = state.feed(event)
        out += step.out
    assert step.gap and not state.done
    assert "position 1" in state.missing()
    assert [e.seq for e in out if isinstance(e, TokenEvent)] == [0]
    repaired = state.feed(events[2])  # the repair brings it; held events follow in order
    assert [type(e).__name__ for e in repaired.out] == ["TokenEvent", "TokenEvent", "EndEvent"]
    assert state.text() == " a b c" and state.done and not repaired.gap


def test_duplicates_and_anything_after_the_end_are_dropped() -> None:
    events = attempt_events([" a", " b"])
    state = AnswerState(RID)
    out = []
    for event in [events[0], events[1], events[1], events[2], events[0], events[3], events[3]]:
        out += state.feed(event).out
    assert out == events
    assert state.feed(TokenEvent(id=RID, seq=2, text=" extra", attempt=1)).out == []
    assert state.feed(ErrorEvent(id=RID, code="internal", message="late")).out == []


def test_events_of_another_request_are_dropped() -> None:
    state = AnswerState(RID)
    foreign = AnswerWriter("other")
    assert state.feed(foreign.start()).out == []
    assert state.feed(foreign.token("x")).out == []
    assert not state.started


def test_an_end_that_does_not_vouch_for_the_text_is_an_incomplete_error_not_an_answer() -> None:
    writer = AnswerWriter(RID)
    state = AnswerState(RID)
    state.feed_all([writer.start(), writer.token(" a"), writer.token(" b")])
    bad = writer.end(finish_reason="stop", usage=Usage())
    bad.digest = digest_of(" a c")
    out = state.feed(bad).out
    assert len(out) == 1 and isinstance(out[0], ErrorEvent)
    assert out[0].code == ErrorCode.INCOMPLETE.value and out[0].retryable
    assert state.feed(writer.end(finish_reason="stop", usage=Usage())).out == []  # one outcome


def test_an_end_claiming_fewer_positions_than_arrived_is_incomplete() -> None:
    events = attempt_events([" a", " b"])
    short = events[-1].model_copy(update={"seq": 1})
    state = AnswerState(RID)
    out = state.feed_all([*events[:3], short]).out
    assert isinstance(out[-1], ErrorEvent) and out[-1].code == "incomplete"


def test_a_continuation_is_seamless_when_the_reader_has_exactly_the_kept_prefix() -> None:
    first = attempt_events([" t0", " t1", " t2", " t3"], end=False)
    state = AnswerState(RID)
    state.feed_all(first[:4])  # start + t0..t2; t3 never reached the reader or the store
    resume = state.resume()
    assert resume == Resume(seq=3, digest=digest_of(" t0 t1 t2"), text=" t0 t1 t2", tokens=3)
    second = attempt_events([" t3", " t4"], attempt=2, resume=resume)
    step = state.feed_all(second)
    assert step.out == second  # the new start passes on as it is: downstream checks it too
    assert state.text() == " t0 t1 t2 t3 t4" and state.done
    assert isinstance(state.outcome, EndEvent) and state.outcome.attempt == 2
    assert passed_text(first[:4] + step.out) == " t0 t1 t2 t3 t4"


def test_a_continuation_behind_what_was_passed_on_starts_over_once() -> None:
    first = attempt_events([" a0", " a1", " a2", " a3"], end=False)
    state = AnswerState(RID)
    out = state.feed_all(first).out  # passed on a0..a3
    kept = AnswerState(RID)
    kept.feed_all(first[:3])  # the store kept only a0, a1
    second = attempt_events([" b2", " b3"], attempt=2, resume=kept.resume())
    step = state.feed_all(second)
    starts = [e for e in step.out if isinstance(e, StartEvent)]
    assert [(s.attempt, s.seq) for s in starts] == [(2, 0)]  # start over, once
    assert [e.text for e in step.out if isinstance(e, TokenEvent)] == [" a0", " a1", " b2", " b3"]
    assert state.text() == " a0 a1 b2 b3"
    # A downstream reader (the SDK behind an edge) sees one restart and the same final text.
    assert passed_text(out + step.out) == " a0 a1 b2 b3"


def test_late_events_of_a_replaced_attempt_are_stale() -> None:
    first = attempt_events([" a0", " a1", " a2"])
    state = AnswerState(RID)
    state.feed_all(first[:2])
    second = attempt_events([" b1"], attempt=2, resume=state.resume())
    state.feed(second[0])
    assert state.feed(first[2]).out == []  # a1 of attempt 1 after attempt 2 began
    assert state.feed(first[-1]).out == []  # attempt 1's end
    stale_err = ErrorEvent(id=RID, code="backend_error", message="old", attempt=1)
    assert state.feed(stale_err).out == []
    state.feed_all(second[1:])
    assert state.text() == " a0 b1"


def test_a_start_whose_prefix_differs_is_held_until_a_repair_brings_the_right_prefix() -> None:
    one = attempt_events([" a0", " a1", " a2"], end=False)
    chain = AnswerState(RID)  # what the store holds: attempt 2 continued after a0
    chain.feed_all(one[:2])
    two = attempt_events([" b1", " b2"], attempt=2, resume=chain.resume(), end=False)
    chain.feed_all(two)
    three = attempt_events([" c3"], attempt=3, resume=chain.resume())
    reader = AnswerState(RID)
    reader.feed_all(one)  # saw all of attempt 1, none of attempt 2
    step = reader.feed_all(three)
    assert step.gap and not reader.done  # attempt 3's prefix is not ours
    step = reader.feed_all(one + two + three)  # the repair replays the store
    assert reader.done and reader.text() == " a0 b1 b2 c3"
    assert passed_text(one + step.out) == " a0 b1 b2 c3"


def test_an_error_ends_the_answer_once() -> None:
    writer = AnswerWriter(RID, attempt=2)
    state = AnswerState(RID)
    err = writer.error(OverloadedError("full", retry_after=2))
    out = state.feed(err).out
    assert out == [err] and state.done
    assert err.attempt == 2 and err.retry_after == 2


def test_another_requests_content_under_the_same_id_is_a_duplicate_error() -> None:
    mine = request_fingerprint(InferRequest(id=RID, prompt="mine", model="m"))
    theirs = request_fingerprint(InferRequest(id=RID, prompt="theirs", model="m"))
    assert mine != theirs
    assert mine == request_fingerprint(InferRequest(id="otherid", prompt="mine", model="m"))
    writer = AnswerWriter(RID, fingerprint=theirs)
    state = AnswerState(RID, fingerprint=mine)
    out = state.feed_all([writer.start(), writer.token("their text")]).out
    assert len(out) == 1 and isinstance(out[0], ErrorEvent) and out[0].code == "duplicate"


def test_a_fingerprint_given_as_a_function_is_worked_out_once_when_the_start_comes() -> None:
    """A reader's own fingerprint, given lazily (an edge's queued copy, the SDK via the cloud),
    is made when the answer's start comes, not before the request leaves, and only once."""
    asked: list[str] = []

    def mine() -> str:
        asked.append("mine")
        return request_fingerprint(InferRequest(id=RID, prompt="mine", model="m"))

    theirs = request_fingerprint(InferRequest(id=RID, prompt="theirs", model="m"))
    state = AnswerState(RID, fingerprint=mine)
    assert asked == []
    out = state.feed_all([AnswerWriter(RID, fingerprint=theirs).start()]).out
    assert asked == ["mine"]
    assert len(out) == 1 and isinstance(out[0], ErrorEvent) and out[0].code == "duplicate"

    writer = AnswerWriter(RID, fingerprint=mine())
    asked.clear()
    state = AnswerState(RID, fingerprint=mine)
    out = state.feed_all([writer.start(), writer.token("my text"), writer.token(" more")]).out
    assert [getattr(e, "text", None) for e in out] == [None, "my text", " more"]
    assert state.fingerprint == writer.fingerprint and asked == ["mine"]


def test_held_events_are_bounded() -> None:
    writer = AnswerWriter(RID)
    state = AnswerState(RID, max_held=8)
    state.feed(writer.start())
    writer.token("lost")
    for i in range(100):
        state.feed(writer.token(f" {i}"))
    assert len(state.held) == 8


def test_token_events_survive_the_fast_codec_path_in_both_formats() -> None:
    writer = AnswerWriter(RID, attempt=3)
    event = writer.token(" héllo \u2028", n=4)
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        back = decode_event(dump_event(event, fmt))
        assert back == event and back.n == 4 and back.attempt == 3
    start = decode_event(dump_event(writer.start(), WireFormat.JSON))
    assert isinstance(start, StartEvent) and start.attempt == 3


# -- random histories ----------------------------------------------------------------------
def history(rng: random.Random) -> tuple[list, str]:
    """A request's true history as the store keeps it: 1-4 attempts, each continuing from a
    random point of the previous one (or starting over), the last one ending. Returns the
    stored event order and the final answer text."""
    chain = AnswerState(RID)
    stored: list = []
    attempts = rng.randint(1, 4)
    for attempt in range(1, attempts + 1):
        resume = chain.resume()
        if attempt > 1:
            # The store may have kept less than the previous attempt published.
            keep = rng.randint(0, chain.positions)
            prefix = AnswerState(RID)
            prefix.feed_all([e for e in stored if not isinstance(e, EndEvent)])
            prefix_texts = prefix.texts[:keep]
            resume = Resume(
                seq=keep,
                digest=prefix.digest_at(keep),
                text="".join(prefix_texts),
                tokens=keep,
            )
        n = rng.randint(0, 6)
        last = attempt == attempts
        events = attempt_events(
            [f" {attempt}.{i}" for i in range(n)], attempt=attempt, resume=resume, end=last
        )
        if not last:
            events = events[: rng.randint(1, len(events))]  # a worker died mid-answer
        stored += events
        chain.feed_all(events)
    assert chain.done
    return stored, chain.text()


@settings(max_examples=400, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_any_loss_duplication_or_reordering_then_a_replay_gives_the_true_answer(seed: int) -> None:
    rng = random.Random(seed)
    stored, truth = history(rng)
    live = []
    for event in stored:  # what reached the reader live: lost, doubled, late
        roll = rng.random()
        if roll < 0.2:
            continue
        live.append(event)
        if roll > 0.9:
            live.insert(rng.randint(0, len(live)), event)
    reader = AnswerState(RID)
    out = reader.feed_all(live).out
    # Before any repair: whatever was passed on is a consistent prefix of one answer.
    if reader.done:
        assert isinstance(reader.outcome, EndEvent)
        assert reader.text() == truth
    out += reader.feed_all(stored).out  # the repair: replay what the store kept
    assert reader.done and isinstance(reader.outcome, EndEvent)
    assert reader.text() == truth
    assert passed_text(out) == truth
    ends = [e for e in out if isinstance(e, (EndEvent, ErrorEvent))]
    assert len(ends) == 1


def test_what_a_state_keeps_sparse_or_works_out_later_reads_as_if_kept_per_token() -> None:
    """Per token a state keeps only the text; engine-token counts and logprobs are kept where a
    token has them, and digests are worked out when asked. Across a restart that keeps a prefix,
    every digest, the count a continuation resumes from, and the logprobs read as they would
    had each been kept per position."""
    lp = [TokenLogprob(token="x", logprob=-0.5)]
    texts = [" a0", " a1", " ü2", " a3", " a4"]
    counts = [1, 3, 1, 2, 1]
    state = AnswerState(RID)
    writer = AnswerWriter(RID, attempt=1, node="w1")
    state.feed(writer.start())
    for i, (text, n) in enumerate(zip(texts, counts, strict=True)):
        state.feed(writer.token(text, n=n, logprobs=lp if i in (1, 4) else None))
    for k in range(len(texts) + 1):
        assert state.digest_at(k) == digest_of("".join(texts[:k]))
    assert state.digest_at(2) == digest_of(" a0 a1")  # asked again, lower: still right
    assert state.resume().tokens == sum(counts)
    assert state.logprobs() == lp + lp
    kept = AnswerState(RID)  # a continuation that keeps 3 positions
    kept.feed_all([writer.start(), *state_events(texts[:3], counts[:3], lp)])
    second = AnswerWriter(RID, attempt=2, node="w2", resume=kept.resume())
    step = state.feed(second.start())  # behind what was passed on: start over with 3 kept
    assert [e.t for e in step.out] == ["start", "tok", "tok", "tok"]
    assert [e.n for e in step.out if isinstance(e, TokenEvent)] == counts[:3]
    assert [e.logprobs for e in step.out if isinstance(e, TokenEvent)] == [None, lp, None]
    assert state.resume() == Resume(
        seq=3, digest=digest_of(" a0 a1 ü2"), text=" a0 a1 ü2", tokens=sum(counts[:3])
    )
    assert state.logprobs() == lp
    state.feed(second.token(" b3"))
    state.feed(second.end(finish_reason="stop", usage=Usage()))
    assert state.done and state.text() == " a0 a1 ü2 b3"
    assert isinstance(state.outcome, EndEvent)


def state_events(texts: list[str], counts: list[int], lp: list[TokenLogprob]) -> list[WireEvent]:
    """Attempt 1's tokens with these texts and counts (logprobs on the second)."""
    writer = AnswerWriter(RID, attempt=1, node="w1")
    writer.start()
    return [
        writer.token(t, n=n, logprobs=lp if i == 1 else None)
        for i, (t, n) in enumerate(zip(texts, counts, strict=True))
    ]
