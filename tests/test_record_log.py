"""What an edge keeps of each answer for replays (``edge_node.records``): every event back, in
order, exactly as it was passed on; and its tokens out of the garbage collector's sight, so that
a full collection (which stops the event loop) does not grow with the answers kept."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest

from edge_node.records import Records
from protocol.errors import DuplicateRequestError
from protocol.messages import EndEvent, StartEvent, TokenEvent, TokenLogprob, Usage, token_event


class Collect:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def send(self, event: object) -> None:
        self.events.append(event)


def answer(request_id: str, tokens: int) -> list[object]:
    start = StartEvent(id=request_id, seq=0, attempt=1, node="w1")
    body = [token_event(request_id, i, f" t{i}") for i in range(tokens)]
    end = EndEvent(id=request_id, seq=tokens, attempt=1, usage=Usage(completion_tokens=tokens))
    return [start, *body, end]


async def test_a_kept_answer_replays_whole_and_its_tokens_are_not_tracked() -> None:
    records = Records(replay_window=60)
    record, new = records.open("scope", "r1", lambda: "fp")
    assert new
    events = answer("r1", 50)
    await record.emit(events[:20])
    record.emit_now(events[20:-1])  # the edge's fast path for tokens
    await record.emit(events[-1:])
    records.finished(record)

    late = Collect()
    await record.attach(late)
    assert late.events == events  # the same events, the same order, nothing twice
    assert record.lacking(1, 45) == events[46:]  # from position 45 on, and the end

    gc.collect()
    kept_tokens = [item for item in record.log if not isinstance(item, StartEvent | EndEvent)]
    assert len(kept_tokens) == 50
    assert not any(gc.is_tracked(item) for item in kept_tokens)


async def test_a_token_with_logprobs_is_kept_as_it_came() -> None:
    records = Records(replay_window=60)
    record, _ = records.open("scope", "r2", lambda: "fp")
    with_logprobs = TokenEvent(
        id="r2", seq=0, text=" a", attempt=1, logprobs=[TokenLogprob(token=" a", logprob=-0.1)]
    )
    await record.emit([StartEvent(id="r2", seq=0, attempt=1), with_logprobs])
    late = Collect()
    await record.attach(late)
    assert late.events[1] == with_logprobs
    assert late.events[1].logprobs[0].logprob == -0.1  # type: ignore[attr-defined]


def test_a_records_fingerprint_is_made_only_when_its_id_comes_again_or_it_ends() -> None:
    """An edge opens a record without its request's fingerprint (made on the way to the engine
    before); a request under the same id asks for both, and a finished record keeps its own."""
    made: list[str] = []

    def fingerprint(value: str) -> Callable[[], str]:
        def make() -> str:
            made.append(value)
            return value

        return make

    records = Records(replay_window=60)
    first, new = records.open("scope", "r3", fingerprint("a"))
    assert new and made == []
    same, new = records.open("scope", "r3", fingerprint("a"))
    assert same is first and not new and made == ["a", "a"]
    with pytest.raises(DuplicateRequestError):
        records.open("scope", "r3", fingerprint("b"))
    records.finished(first)
    made.clear()
    with pytest.raises(DuplicateRequestError):
        records.open("scope", "r3", fingerprint("c"))
    assert made == ["c"]  # the finished record's own was kept, not made again
