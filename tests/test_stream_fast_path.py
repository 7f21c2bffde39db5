"""The hot path for tokens (``AnswerState.take_token``, which ``feed`` takes first) decides
exactly as the full checks do: on random, hostile event orders (duplicates, gaps, late and
newer attempts, foreign ids, tokens after the end), a state with the fast path and one without
it pass on the same events and end in the same state."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import Usage, WireEvent, token_event
from protocol.stream import AnswerState, AnswerWriter, Resume

RID = "req1"


class _Slow(AnswerState):
    """The full checks only."""

    def take_token(self, request_id: str, attempt: int, seq: int, text: str, n: int) -> bool:
        return False


def _attempt(texts: list[str], attempt: int, resume: Resume | None = None) -> list[WireEvent]:
    writer = AnswerWriter(RID, attempt=attempt, node=f"w{attempt}", resume=resume)
    events: list[WireEvent] = [writer.start()]
    events += [writer.token(text) for text in texts]
    events.append(writer.end(finish_reason="stop", usage=Usage(completion_tokens=len(texts))))
    return events


def _hostile(seed: int) -> list[WireEvent]:
    rng = random.Random(seed)
    first = _attempt([f" a{i}" for i in range(12)], 1)
    second = _attempt([f" b{i}" for i in range(10)], 2, Resume(seq=0))
    pool = first + second
    events = [rng.choice(pool) for _ in range(60)] + first[:5]
    events += [token_event("someone-else", i, " x", 1) for i in range(3)]
    rng.shuffle(events)
    return first[:3] + events + first  # a plausible opening, the mess, then all of it again


def _state(state: AnswerState) -> tuple[object, ...]:
    return (
        state.texts,
        state.attempt,
        state.positions,
        state.digest_at(state.positions),
        [(e.t, e.attempt, getattr(e, "seq", None)) for e in state.held],
        state.outcome,
    )


def _run(events: list[WireEvent]) -> None:
    fast, slow = AnswerState(RID), _Slow(RID)
    for event in events:
        a, b = fast.feed(event), slow.feed(event)
        assert (a.out, a.gap) == (b.out, b.gap)
        assert _state(fast) == _state(slow)


@pytest.mark.parametrize("seed", range(40))
def test_hostile_orders_pass_on_the_same(seed: int) -> None:
    _run(_hostile(seed))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.booleans()), max_size=40))
def test_any_order_passes_on_the_same(picks: list[tuple[int, int, bool]]) -> None:
    attempts = {a: _attempt([f" {a}.{i}" for i in range(8)], a) for a in (1, 2, 3)}
    events: list[WireEvent] = []
    for attempt, index, foreign in picks:
        if attempt == 0 or foreign:
            events.append(token_event("other", index, " z", max(1, attempt)))
        else:
            chain = attempts[attempt]
            events.append(chain[min(index, len(chain) - 1)])
    _run(events)


def test_the_fast_path_refuses_what_is_not_the_next_token() -> None:
    state = AnswerState(RID)
    assert not state.take_token(RID, 1, 0, " t", 1)  # no start yet
    state.feed(_attempt([" t0"], 1)[0])
    assert not state.take_token("other", 1, 0, " t", 1)  # another request's
    assert not state.take_token(RID, 2, 0, " t", 1)  # a newer attempt, its start not seen
    assert not state.take_token(RID, 1, 1, " t", 1)  # past a gap
    assert state.take_token(RID, 1, 0, " t0", 1)
    assert not state.take_token(RID, 1, 0, " t0", 1)  # a duplicate
    assert state.texts == [" t0"]
