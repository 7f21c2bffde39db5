"""A kept answer at an edge site: read from its message in the site's ``MESH_KEPT``, and
passed on to its client (:func:`emit_outcome`)."""

from __future__ import annotations

from edge_node.records import Record
from mesh import kept
from protocol.codec import decode_event, to_exception
from protocol.errors import MeshError
from protocol.messages import Answer, ErrorEvent, TokenLogprob, WireEvent
from protocol.stream import AnswerWriter

Found = tuple[Answer | ErrorEvent | None, str | None]
"""A kept answer's outcome (None: unreadable), and the fingerprint of the request it answers."""


def found_in(data: bytes, headers: dict[str, str] | None) -> Found:
    """A kept answer's message: the outcome, and the fingerprint of the request it answers."""
    return outcome_of(data), (headers or {}).get(kept.FINGERPRINT_HEADER)


def outcome_of(data: bytes) -> Answer | ErrorEvent | None:
    try:
        event = decode_event(data)
    except MeshError:
        return None
    return event if isinstance(event, (Answer, ErrorEvent)) else None


KEPT_PIECE_CHARS = 32_768
"""The most characters of a kept answer one event carries: at most 192 kB as JSON (six bytes a
character, escaped), well within one message."""
KEPT_PIECE_LOGPROBS = 256
"""The most logprobs entries one event carries (an entry with 20 alternatives takes about
0.5 kB)."""


def _pieces(
    text: str, logprobs: list[TokenLogprob] | None
) -> list[tuple[str, list[TokenLogprob] | None]]:
    """A kept answer's text and logprobs, cut in pieces that each fit one message: at its
    tokens' bounds when they spell the text (each piece's logprobs are its own text's), else
    evenly (the logprobs then come in order, but not with their text)."""
    if not logprobs:
        size = KEPT_PIECE_CHARS
        return [(text[at : at + size], logprobs) for at in range(0, len(text), size)]
    if "".join(entry.token for entry in logprobs) == text:
        cut: list[tuple[str, list[TokenLogprob] | None]] = []
        piece: list[TokenLogprob] = []
        chars = 0
        for entry in logprobs:
            if piece and (
                len(piece) == KEPT_PIECE_LOGPROBS or chars + len(entry.token) > KEPT_PIECE_CHARS
            ):
                cut.append(("".join(e.token for e in piece), piece))
                piece, chars = [], 0
            piece.append(entry)
            chars += len(entry.token)
        cut.append(("".join(e.token for e in piece), piece))
        return cut
    n = max(-(-len(text) // KEPT_PIECE_CHARS), -(-len(logprobs) // KEPT_PIECE_LOGPROBS))
    return [
        (
            text[i * len(text) // n : (i + 1) * len(text) // n],
            logprobs[i * len(logprobs) // n : (i + 1) * len(logprobs) // n],
        )
        for i in range(n)
    ]


async def emit_outcome(record: Record, outcome: Answer | ErrorEvent) -> None:
    """Pass a kept answer on as one attempt: start, its text (and logprobs) in pieces, end. A
    piece takes at most ``KEPT_PIECE_CHARS`` and ``KEPT_PIECE_LOGPROBS``: the whole text at one
    position could be larger than one message to a NATS client (JSON escapes it), and it would
    not reach it."""
    if isinstance(outcome, ErrorEvent):
        await record.fail(to_exception(outcome))
        return
    writer = AnswerWriter(outcome.id, attempt=record.state.attempt + 1, node=outcome.served_by)
    events: list[WireEvent] = [writer.start()]
    tokens = outcome.usage.completion_tokens or 1
    cut = _pieces(outcome.text, outcome.logprobs)
    for i, (piece, its) in enumerate(cut):  # the engine tokens go with the last
        events.append(writer.token(piece, n=tokens if i == len(cut) - 1 else 0, logprobs=its))
    events.append(
        writer.end(
            finish_reason=outcome.finish_reason,
            usage=outcome.usage,
            timings=outcome.timings,
            served_by=outcome.served_by,
            path=outcome.path,
            routing=outcome.routing,
            fallback=outcome.fallback,
        )
    )
    await record.emit(events)
