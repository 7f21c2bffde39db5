"""A kept answer passed on to a client (:func:`edge_node.site.emit_outcome`) goes in pieces,
each well within one NATS message as JSON, and reads back whole and checked (its end's digest
vouches for the text the pieces carry). At one position, an answer that was kept in msgpack
could be too large for one JSON message to a streaming ``nats`` client, and never reach it."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_node.site_answers import KEPT_PIECE_CHARS, emit_outcome
from protocol.codec import WireFormat, dump_event
from protocol.messages import Answer, EndEvent, TokenEvent, TokenLogprob, Usage, WireEvent
from protocol.stream import AnswerState


@dataclass
class _Record:
    """What ``emit_outcome`` uses of a record: its state, and where its events go."""

    state: AnswerState = field(default_factory=lambda: AnswerState("kept-1"))
    sent: list[WireEvent] = field(default_factory=list)

    async def emit(self, events: list[WireEvent]) -> None:
        self.sent += events
        self.state.feed_all(events)


async def test_a_kept_answer_goes_on_in_pieces_that_each_fit_a_message() -> None:
    text = '{"k": "v\\u00e9"}\n' * 80_000  # 1.2 MB, larger again as JSON
    usage = Usage(prompt_tokens=3, completion_tokens=4_000, total_tokens=4_003)
    record = _Record()
    await emit_outcome(record, Answer(id="kept-1", text=text, usage=usage))  # type: ignore[arg-type]
    tokens = [e for e in record.sent if isinstance(e, TokenEvent)]
    assert len(tokens) > 1
    assert max(len(dump_event(t, WireFormat.JSON)) for t in tokens) < 256 * 1024
    assert all(len(t.text) <= KEPT_PIECE_CHARS for t in tokens)
    assert sum(t.n for t in tokens) == 4_000  # the engine's tokens, once
    assert isinstance(record.sent[-1], EndEvent)
    assert record.state.done and record.state.text() == text
    whole = record.state.whole()
    assert isinstance(whole, Answer) and whole.text == text
    assert whole.logprobs is None  # none were asked for: none come


async def test_a_kept_answer_s_logprobs_go_on_with_it_in_pieces() -> None:
    """The logprobs of a request that could wait were dropped where its outcome was kept (one
    ``answer``, which had no field for them): its client got the text alone."""
    scored = [
        TokenLogprob(token=f" t{i}", logprob=-0.5, top=[(f" t{i}", -0.5)]) for i in range(700)
    ]
    text = "".join(entry.token for entry in scored)
    usage = Usage(prompt_tokens=3, completion_tokens=702, total_tokens=705)
    record = _Record()
    await emit_outcome(record, Answer(id="kept-1", text=text, usage=usage, logprobs=scored))  # type: ignore[arg-type]
    tokens = [e for e in record.sent if isinstance(e, TokenEvent)]
    assert len(tokens) == 3  # 256 entries at most each
    for token in tokens:  # each piece with its own text's logprobs (an SSE chunk's, offsets)
        assert token.logprobs is not None
        assert "".join(entry.token for entry in token.logprobs) == token.text
    assert record.state.logprobs() == scored
    whole = record.state.whole()
    assert isinstance(whole, Answer) and whole.text == text and whole.logprobs == scored
