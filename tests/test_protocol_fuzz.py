"""The pure protocol layer (codec, messages, stream contract, fingerprint, subject parsers) and
the OpenAI backend's SSE parsing and StopText, under hostile bytes, property-based (review S18e).

Tests marked "Before the fix" failed on the code before it (what happened then is said beside
them); the others are guards: they passed there too."""

from __future__ import annotations

import contextlib
import json
import math

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from mesh.backends.base import Chunk
from mesh.backends.openai_http import OpenAIHTTPBackend, _Reading, _SseLines, parse_event
from mesh.backends.stop_text import StopText
from mesh.config import ModelSettings
from protocol.codec import (
    CONTENT_TYPE,
    WireFormat,
    compact_json,
    decode_event,
    decode_request,
    dump,
    dump_event,
    dump_token,
    message_token_fields,
    to_exception,
)
from protocol.errors import BackendError, MeshError
from protocol.fingerprint import Fingerprints, request_fingerprint
from protocol.messages import EndEvent, ErrorEvent, InferRequest, StartEvent, TokenEvent
from protocol.stream import AnswerState, digest_of
from protocol.subjects import (
    addressed,
    is_subject,
    is_token,
    model_token,
    scope_of,
    token_subject,
    worker_alive_subject,
    worker_of,
)
from tests.helpers import chat_server

FEW = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
MANY = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# -- hostile values ------------------------------------------------------------------------------
HOSTILE_TEXT = st.text(
    alphabet=st.sampled_from(
        [
            "a",
            "Z",
            "0",
            "-",
            "_",
            ".",
            "*",
            ">",
            " ",
            "\n",
            "\x00",
            "é",
            "😀",
            "\ud800",
            "\udfff",
            "ހ",
            '"',
            "\\",
        ]
    ),
    max_size=12,
)
HOSTILE_INT = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 10**400]),
)
HOSTILE_FLOAT = st.sampled_from([0.5, -1.0, 1e308, math.nan, math.inf, -math.inf, 1e-320])
LEAF = st.one_of(st.none(), st.booleans(), HOSTILE_INT, HOSTILE_FLOAT, HOSTILE_TEXT)


def _tree(leaf: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=3), st.dictionaries(HOSTILE_TEXT, kids, max_size=3)
        ),
        max_leaves=8,
    )


def _json_bytes(value: object) -> bytes:
    """JSON as a hostile client may write it (NaN, Infinity, lone surrogates escaped)."""
    return json.dumps(value, ensure_ascii=True).encode()


def _msgpack_bytes(value: object) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, UnicodeEncodeError, ValueError, TypeError):
        return None


REQUEST_FIELDS = st.sampled_from(
    [
        "v",
        "id",
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "deadline",
        "start_by",
        "reply",
        "origin",
        "route",
        "routing",
        "stream",
        "raw",
        "response_format",
        "logprobs",
        "top_logprobs",
        "deferrable",
        "cancel_key",
        "messages",
    ]
)


@st.composite
def hostile_requests(draw: st.DrawFn) -> dict:
    raw: dict = {"prompt": draw(st.sampled_from(["hi", " ", "x\ud800", "é"]))}
    for name in draw(st.lists(REQUEST_FIELDS, max_size=4, unique=True)):
        if name == "routing":
            raw[name] = {
                "decision": "local",
                "reason": draw(HOSTILE_TEXT),
                "budget": draw(st.dictionaries(HOSTILE_TEXT, LEAF, max_size=2)),
            }
        elif name == "response_format":
            raw[name] = {"type": "json_schema", "json_schema": {"schema": draw(_tree(LEAF))}}
        elif name == "messages":
            raw.pop("prompt", None)
            raw[name] = [{"role": "user", "content": draw(HOSTILE_TEXT)}]
        else:
            raw[name] = draw(LEAF)
    return raw


def _decoded_request(data: bytes, headers: dict | None = None) -> InferRequest | None:
    try:
        return decode_request(data, headers)[0]
    except MeshError:
        return None


# -- 1. decoders: a value or a typed MeshError, nothing else --------------------------------------
@MANY
@given(
    data=st.one_of(
        st.binary(max_size=64),
        _tree(LEAF).map(_json_bytes),
        _tree(LEAF).map(_msgpack_bytes).filter(lambda b: b is not None),
        st.builds(
            lambda n: b'{"prompt":"x","a":' + b"[" * n + b"]" * n + b"}", st.integers(0, 3000)
        ),
        st.builds(lambda n: b"\x81\xa1a" + b"\x91" * n + b"\xc0", st.integers(0, 3000)),
    ),
    headers=st.sampled_from(
        [
            None,
            {},
            {CONTENT_TYPE: "application/json"},
            {CONTENT_TYPE: "application/msgpack"},
            {CONTENT_TYPE: "text/plain"},
            {CONTENT_TYPE: "garbage; x"},
        ]
    ),
)
def test_guard_decoders_raise_only_typed_errors(data: bytes, headers: dict | None) -> None:
    """Guard (passes): any bytes into decode_request / decode_event give a value or a MeshError."""
    for decode in (decode_request, decode_event):
        with contextlib.suppress(MeshError):
            decode(data, headers)


# Before the fix (typed): decode_request accepts requests the node then cannot encode. An edge
# queues an escalated request with dump(request, MSGPACK) (mesh/queue.py) and answers a JSON
# client with dump(..., JSON): a client's {"prompt":"x","v":<a 400-digit integer>} passes the
# door (orjson refuses the number, Python's json reads it exactly, and ``v`` has no upper bound)
# and then dump raises a raw OverflowError; {"routing":{"reason":"\ud800"}} a raw
# UnicodeEncodeError. Either must be refused at the door as invalid_request.
@FEW
@given(raw=hostile_requests())
def test_every_request_decode_accepts_can_be_written_back_and_reads_the_same(raw: dict) -> None:
    data = _json_bytes(raw)
    request = _decoded_request(data)
    assume(request is not None)
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        again = decode_request(dump(request, fmt), {CONTENT_TYPE: fmt.content_type})[0]
        assert again.model_dump_json() == request.model_dump_json()


def test_a_request_with_a_huge_version_is_refused_at_the_door_not_when_queued() -> None:
    """Before the fix (typed): the minimal reproduction of the property above."""
    data = b'{"prompt":"hi","v":' + b"9" * 400 + b"}"
    try:
        request, _fmt = decode_request(data)
    except MeshError:
        return  # refused at the door: the fix
    dump(request, WireFormat.MSGPACK)  # what the edge does when it escalates: raw OverflowError


def test_a_request_whose_routing_reason_is_a_lone_surrogate_is_refused_or_encodable() -> None:
    """Before the fix (typed): ``routing.reason`` (and ``budget`` strings) are plain ``str``,
    not ``Text``: a lone surrogate passes the door and breaks every encoder."""
    data = b'{"prompt":"hi","routing":{"decision":"local","reason":"\\ud800"}}'
    try:
        request, _fmt = decode_request(data)
    except MeshError:
        return
    dump(request, WireFormat.JSON)  # a JSON reply, a log, the queue: raw UnicodeEncodeError


# Before the fix (typed): decode_event accepts events that dump_event / dump cannot write back:
# a lone surrogate in any str field (JSON), an integer beyond 64 bits (JSON, 400 digits), bytes or
# a msgpack Timestamp inside an error's details (msgpack). A relaying edge re-encodes every event
# it passes on (edge_node/records.py: dump_event(event, self.fmt)), so such an event turns into a
# raw UnicodeEncodeError / OverflowError / UnicodeDecodeError / PydanticSerializationError there.
EVENT_BYTES = st.one_of(
    st.builds(lambda t: _json_bytes({"t": "tok", "id": "r", "seq": 0, "text": t}), HOSTILE_TEXT),
    st.builds(lambda m: _json_bytes({"t": "err", "code": "x", "message": m}), HOSTILE_TEXT),
    st.builds(lambda s: _json_bytes({"t": "tok", "id": "r", "seq": s, "text": "a"}), HOSTILE_INT),
    st.builds(lambda a: _json_bytes({"t": "start", "id": "r", "attempt": a}), HOSTILE_INT),
    st.builds(
        lambda d: _msgpack_bytes({"t": "err", "code": "x", "message": "m", "details": [{"a": d}]}),
        st.one_of(LEAF, st.binary(max_size=3), st.just(msgpack.Timestamp(1, 0))),
    ).filter(lambda b: b is not None),
)


@FEW
@given(data=EVENT_BYTES)
def test_every_event_decode_accepts_round_trips_through_dump_event(data: bytes) -> None:
    try:
        event = decode_event(data)
    except MeshError:
        return
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        again = decode_event(dump_event(event, fmt), {CONTENT_TYPE: fmt.content_type})
        assert type(again) is type(event)
        assert _finite(again.model_dump()) == _finite(event.model_dump())


def _finite(value: object) -> object:
    """JSON has no NaN or infinity: those read back as null, which is not a defect."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def test_a_token_event_with_a_lone_surrogate_is_refused_or_relayable() -> None:
    """Before the fix (typed): minimal case. ``compact_json``'s docstring says a lone surrogate
    goes to ``json``; it does, and ``.encode()`` then raises UnicodeEncodeError."""
    try:
        event = decode_event(b'{"t":"tok","id":"r","seq":0,"text":"\\ud83d"}')
    except MeshError:
        return  # refused at the door, typed: now (Text)
    dump_event(event, WireFormat.JSON)


def test_compact_json_writes_what_its_docstring_promises_for_a_lone_surrogate() -> None:
    """Before the fix (typed): compact_json({"a": "\\ud800"}) raises UnicodeEncodeError."""
    assert json.loads(compact_json({"a": "\ud800"})) == {"a": "\ud800"}


# -- 2. the token fast path agrees with the full decoder ------------------------------------------
TOKEN_MAPS = st.fixed_dictionaries(
    {},
    optional={
        "t": st.sampled_from(["tok", "start", "end", "TOK", b"tok"]),
        "id": st.one_of(HOSTILE_TEXT, HOSTILE_INT, st.binary(max_size=2)),
        "seq": st.one_of(HOSTILE_INT, st.booleans(), HOSTILE_FLOAT, st.just("1")),
        "text": st.one_of(HOSTILE_TEXT, st.binary(max_size=2), st.none()),
        "attempt": st.one_of(HOSTILE_INT, st.booleans(), st.just(1.0)),
        "n": st.one_of(HOSTILE_INT, st.booleans()),
        "logprobs": st.sampled_from([None, [], [{"token": "a", "logprob": -1.0}]]),
        "extra": st.integers(0, 2),
    },
)


@MANY
@given(raw=TOKEN_MAPS)
def test_guard_message_token_fields_never_reads_a_token_otherwise_than_decode_event(
    raw: dict,
) -> None:
    """Guard (passes): whatever the fast path accepts, the full validation reads the same."""
    data = _msgpack_bytes(raw)
    assume(data is not None)
    fields = message_token_fields(data)
    if fields is None:
        return
    event = TokenEvent.model_validate(raw)  # the slow path, on the same map
    assert (event.id, event.seq, event.text, event.attempt, event.n) == fields
    assert event.logprobs is None
    assert decode_event(data) == event


@FEW
@given(
    rid=st.from_regex(r"\A[A-Za-z0-9_-]{1,20}\Z"),
    seq=st.integers(0, 2**63 - 1),
    text=st.text(max_size=8).filter(lambda s: not any("\ud800" <= c <= "\udfff" for c in s)),
    attempt=st.integers(1, 2**63 - 1),
    n=st.integers(0, 2**32),
)
def test_guard_dump_token_is_dump_of_the_event_and_round_trips(
    rid: str, seq: int, text: str, attempt: int, n: int
) -> None:
    """Guard (passes): the fast encoder writes what the model's encoder writes, in both formats."""
    event = TokenEvent(id=rid, seq=seq, text=text, attempt=attempt, n=n)
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        data = dump_token(rid, seq, text, attempt, fmt, n)
        assert decode_event(data) == event
        if fmt is WireFormat.MSGPACK:
            assert data == dump(event, fmt)
            assert message_token_fields(data) == (rid, seq, text, attempt, n)


def test_guard_to_exception_keeps_the_code_and_fields() -> None:
    """Guard (passes): unknown codes become MeshError internal; known codes their class."""
    err = to_exception(ErrorEvent(id="r", code="nope", message="m", retryable=True))
    assert err.code.value == "internal" and err.retryable and err.request_id == "r"
    err = to_exception(ErrorEvent(id="r", code="overloaded", message="m", retry_after=2.0))
    assert err.code.value == "overloaded" and err.retry_after == 2.0


# -- 3. the stream contract ---------------------------------------------------------------------
RID = "req1"
TOK_TEXT = st.text(alphabet=st.sampled_from(["a", "b", " ", "é", "😀"]), max_size=2)


@st.composite
def answers(draw: st.DrawFn) -> tuple[dict[int, list[str]], list, list]:
    """Attempts of one answer as workers produce them, each continuing the previous one's chain
    from some position (or starting over), the last one ending; and the store's copy of them."""
    chains: dict[int, list[str]] = {}
    published: list = []
    previous: list[str] = []
    attempts = draw(st.integers(1, 4))
    for attempt in range(1, attempts + 1):
        keep = 0 if attempt == 1 else draw(st.integers(0, len(previous)))
        chain = previous[:keep] + draw(st.lists(TOK_TEXT, max_size=4))
        chains[attempt] = chain
        published.append(
            StartEvent(
                id=RID,
                attempt=attempt,
                seq=keep,
                digest=digest_of("".join(chain[:keep])),
                node=f"cloud:w{attempt}",
            )
        )
        published += [
            TokenEvent(id=RID, seq=i, text=chain[i], attempt=attempt)
            for i in range(keep, len(chain))
        ]
        if attempt == attempts:
            published.append(
                EndEvent(id=RID, seq=len(chain), attempt=attempt, digest=digest_of("".join(chain)))
            )
        previous = chain
    hostile = list(published)
    hostile += draw(st.lists(st.sampled_from(published), max_size=4))  # duplicates
    hostile += [
        e.model_copy(update={"id": "other"})
        for e in draw(st.lists(st.sampled_from(published), max_size=3))
    ]  # foreign events
    hostile += [ErrorEvent(id="other", code="internal", message="not yours")] * draw(
        st.integers(0, 1)
    )
    last = published[-1]
    bogus = draw(st.sampled_from(["none", "long_end", "stale_err"]))
    if bogus == "long_end":  # an end that vouches for more than there is: never applies
        hostile.append(last.model_copy(update={"seq": last.seq + 1, "digest": 1}))
    elif bogus == "stale_err" and attempts > 1:  # an error of an attempt already replaced
        hostile.append(ErrorEvent(id=RID, attempt=1, code="backend_error", message="old"))
    order = draw(st.permutations(hostile))
    return chains, published, order


def _client(out: list, chains: dict[int, list[str]]) -> tuple[str, object]:
    """What a downstream client makes of what a reader passed on; checks each event as it goes."""
    text: list[str] = []
    attempt = 0
    outcome = None
    for event in out:
        assert outcome is None, f"{event!r} passed on after the outcome {outcome!r}"
        assert event.id == RID, f"foreign event passed on: {event!r}"
        if isinstance(event, StartEvent):
            if event.seq == 0:
                text = []
            assert event.seq == len(text), f"start at {event.seq} with {len(text)} positions"
            attempt = event.attempt
        elif isinstance(event, TokenEvent):
            assert event.attempt == attempt, f"token of attempt {event.attempt} under {attempt}"
            assert event.seq == len(text), f"token {event.seq} at position {len(text)}"
            text.append(event.text)
            assert "".join(chains[attempt]).startswith("".join(text)), "text of no attempt"
        else:
            outcome = event
            if isinstance(event, EndEvent):
                assert event.seq == len(text)
                assert "".join(text) == "".join(chains[event.attempt][: event.seq])
                assert event.digest == digest_of("".join(text))
    return "".join(text), outcome


@MANY
@given(case=answers(), fast=st.booleans(), max_held=st.sampled_from([2, 4096]))
def test_guard_answer_state_passes_on_one_whole_answer_whatever_the_order(
    case: tuple, fast: bool, max_held: int
) -> None:
    """Guard (passes): any interleaving (duplicates, foreign events, attempts, ends before their
    tokens, a bogus second end, a stale error) then the store's replay: one verified answer,
    gap-free, in order, never foreign or doubled, or a typed error."""
    chains, published, order = case
    state = AnswerState(RID, max_held=max_held)
    out: list = []
    for event in [*order, *published]:  # what arrived, then a repair replays the store
        if (
            fast
            and type(event) is TokenEvent
            and state.take_token(event.id, event.attempt, event.seq, event.text, event.n)
        ):
            out.append(event)
            continue
        out += state.feed(event).out
        assert state.digest_at(state.positions) == digest_of(state.text())
    assert state.done, state.missing()
    text, outcome = _client(out, chains)
    restarts = sum(isinstance(e, StartEvent) and e.seq == 0 for e in out) > 1
    note_event(f"outcome {type(outcome).__name__}, restarts {restarts}")
    assert outcome is state.outcome
    if isinstance(outcome, EndEvent):
        whole = state.whole()
        assert whole.text == text and whole.digest == digest_of(text)
    else:
        assert isinstance(outcome, ErrorEvent) and outcome.code in {"incomplete", "backend_error"}


# -- 4. SSE parsing ------------------------------------------------------------------------------
SSE_VALUE = st.text(alphabet=st.sampled_from(["a", " ", ":", "é", "✓", "😀", "{", '"']), max_size=6)


@st.composite
def sse_streams(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    lines: list[str] = []
    want: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["data", "data", "comment", "event", "blank"]))
        if kind == "blank":
            lines.append("")
            continue
        if kind == "comment":
            lines += [": keep-alive " + draw(SSE_VALUE), ""]
            continue
        values = draw(st.lists(SSE_VALUE, min_size=1, max_size=3))
        if kind == "event":
            lines.append("event: message")
        spaced = [draw(st.sampled_from(["", " "])) + v for v in values]
        lines += ["data:" + v for v in spaced] + [""]
        want.append("\n".join(v.removeprefix(" ") for v in spaced))
    out = b""
    previous = ""
    for line in lines:
        ends = ["\n", "\r\n", "\r"]
        if previous == "\r" and line == "":
            ends = ["\r\n", "\r"]  # CR then LF would be one CRLF: another stream
        end = draw(st.sampled_from(ends))
        out += (line + end).encode()
        previous = end
    return out, want


def _sse(pieces: list[bytes]) -> list[str]:
    parser = _SseLines()
    got: list[str] = []
    for piece in pieces:
        if piece:
            got += parser.feed(piece)
    return got + parser.close()


@MANY
@given(stream=sse_streams(), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_guard_sse_lines_give_the_same_events_however_the_stream_is_cut(
    stream: tuple[bytes, list[str]], cuts: list[int]
) -> None:
    """Guard (passes): random cuts, plus every single cut point, give the events a whole read
    gives (inside CRLF and inside multi-byte characters included)."""
    data, want = stream
    assert _sse([data]) == want
    at = sorted({c % (len(data) + 1) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *at], [*at, len(data)], strict=True)]
    assert _sse(pieces) == want
    for i in range(len(data) + 1):
        assert _sse([data[:i], data[i:]]) == want


# Before the fix (typed): parse_event's docstring says what orjson refuses goes to ``json``,
# "which reads it as before or raises its JSONDecodeError"; the backend catches only that (and
# UnicodeDecodeError) as "malformed event". A deeply nested event makes ``json`` raise
# RecursionError and an integer of over 4,300 digits a plain ValueError: both escape
# OpenAIHTTPBackend.generate untyped (the worker then answers "internal: worker failure:
# RecursionError" as if it were a bug, not backend_error).
@FEW
@given(
    data=st.one_of(
        _tree(LEAF).map(json.dumps),
        st.builds(lambda n: "[" * n + "]" * n, st.integers(0, 5000)),
        st.builds(lambda n: '{"a":' + "1" * n + "}", st.integers(1, 6000)),
        st.text(max_size=20),
    )
)
def test_parse_event_reads_json_or_raises_json_decode_error(data: str) -> None:
    with contextlib.suppress(json.JSONDecodeError):
        parse_event(data)


async def _generate(body: bytes) -> list[Chunk]:
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        await response.write_eof()
        return response

    async with chat_server(chat) as base:
        backend = OpenAIHTTPBackend(ModelSettings(backend="openai", base_url=base, http_timeout=5))
        await backend.start()
        try:
            request = InferRequest(id="sse-deep", prompt="hi", max_tokens=8)
            return [chunk async for chunk in backend.generate(request)]
        finally:
            await backend.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "event",
    [b"[" * 5000 + b"]" * 5000, b'{"usage":{"prompt_tokens":' + b"1" * 5000 + b"}}"],
    ids=["deeply-nested", "huge-integer"],
)
async def test_a_backend_event_too_deep_or_too_long_to_read_is_a_backend_error(
    event: bytes,
) -> None:
    """Before the fix (typed): the user-visible form (a real HTTP server sending the bytes)."""
    body = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: ' + event + b"\n\n"
    with pytest.raises(BackendError, match="malformed"):
        await _generate(body)


# Before the fix (typed): the event -> chunk reader (_Reading.event) turns a malformed
# ``logprobs`` from the engine into KeyError / ValueError / TypeError / AttributeError
# (mesh/backends/base.py: openai_logprobs indexes and converts without checks), which
# OpenAIHTTPBackend.generate does not map: they escape the backend untyped, where every other
# malformed part of an event is "BackendError: ... sent a malformed event".
HOSTILE_LOGPROBS = st.one_of(
    _tree(LEAF),
    st.fixed_dictionaries(
        {},
        optional={
            "content": st.one_of(
                _tree(LEAF),
                st.lists(
                    st.dictionaries(
                        st.sampled_from(["token", "logprob", "top_logprobs"]),
                        _tree(LEAF),
                        max_size=3,
                    ),
                    max_size=2,
                ),
            ),
            "tokens": _tree(LEAF),
            "token_logprobs": _tree(LEAF),
            "top_logprobs": _tree(LEAF),
        },
    ),
)


@FEW
@given(logprobs=HOSTILE_LOGPROBS, raw=st.booleans())
def test_an_engine_event_with_malformed_logprobs_is_a_backend_error(
    logprobs: object, raw: bool
) -> None:
    request = InferRequest(prompt="x", logprobs=True, top_logprobs=2, raw=raw)
    reading = _Reading("http://engine", request, budget=100)
    event = {
        "choices": [{"index": 0, "delta": {"content": "a"}, "text": "a", "logprobs": logprobs}]
    }
    with contextlib.suppress(BackendError, json.JSONDecodeError, UnicodeDecodeError):
        reading.event(json.dumps(event))  # else an exception generate does not type


@pytest.mark.parametrize(
    "logprobs",
    [
        {"content": [{"tok": "a"}]},
        {"content": [{"token": "a", "logprob": "x"}]},
        {"content": [{"token": 5, "logprob": 1}]},
        {"content": "abc"},
    ],
)
def test_malformed_chat_logprobs_are_a_backend_error(logprobs: dict) -> None:
    """Before the fix (typed): minimal reproductions of the property above."""
    reading = _Reading("http://engine", InferRequest(prompt="x", logprobs=True), budget=100)
    event = {"choices": [{"delta": {"content": "a"}, "logprobs": logprobs}]}
    with pytest.raises(BackendError):
        reading.event(json.dumps(event))


# -- 5. StopText ---------------------------------------------------------------------------------
STOP_ALPHABET = st.sampled_from(["a", "b", "é", "😀"])


@MANY
@given(
    chunks=st.lists(st.text(alphabet=STOP_ALPHABET, max_size=4), max_size=8),
    stops=st.lists(st.text(alphabet=STOP_ALPHABET, max_size=3), max_size=3),
)
def test_guard_stop_text_cuts_at_the_first_stop_and_never_leaks_or_drops(
    chunks: list[str], stops: list[str]
) -> None:
    """Guard (passes): streamed through StopText as llama_cpp.py does, the output is the text
    up to the earliest stop string (all of it when none comes), and no part of a stop string
    ever goes out first."""
    full = "".join(chunks)
    found = [full.find(s) for s in stops if s and s in full]
    want = full[: min(found)] if found else full
    matcher = StopText(stops)
    out = ""
    for chunk in chunks:
        out += matcher.feed(chunk)
        assert want.startswith(out), (out, want)
        if matcher.hit:
            break
    else:
        out += matcher.flush()
    assert out == want
    assert matcher.hit == bool(found)


# -- 6. subjects and fingerprints ----------------------------------------------------------------
SUBJECT_TOKEN = st.text(
    alphabet=st.sampled_from(["a", "Z", "9", "-", "_", "*", ">", " ", "\n", "\t", "é", "$", ":"]),
    max_size=5,
)


@MANY
@given(tokens=st.lists(SUBJECT_TOKEN, min_size=1, max_size=8), head=st.booleans())
def test_guard_subject_parsers_read_only_what_the_subject_holds(
    tokens: list[str], head: bool
) -> None:
    """Guard (passes): scope_of and addressed never raise and return the subject's own last
    tokens, each a valid token (modulo the trailing-newline defect tested below)."""
    if head:
        tokens = ["mesh", "v1", *tokens]
    subject = ".".join(tokens)
    scope = scope_of(subject)
    if scope is not None:
        assert subject.split(".")[:3] == ["mesh", "v1", "infer"]
        assert subject.split(".")[4] == scope
    found = addressed(subject)
    if found is not None:
        assert list(found) == subject.split(".")[-2:]


@pytest.mark.parametrize("value", ["abc\n", "req-1\n"])
def test_a_token_with_a_trailing_newline_is_not_a_token(value: str) -> None:
    """Before the fix (minor): ``is_token`` and ``is_subject`` use ``re.match`` with ``$``,
    which also matches before a trailing newline: "abc\\n" is a "valid subject token", so
    token_subject("s", "abc\\n") builds "mesh.v1.tok.s.abc\\n" instead of raising, a queued
    request with id "abc\\n" gets its rejection published there by the worker
    (cloud_node/outcomes.py: reply_target -> AnswerPublisher), and InferRequest.reply takes
    "x.y\\n" (only the NATS client's own subject check stops the publish)."""
    assert not is_token(value)
    assert not is_subject("inbox." + value)
    with pytest.raises(ValueError):
        token_subject("s", value)
    with pytest.raises(MeshError):
        decode_request(json.dumps({"prompt": "x", "reply": "x." + value}).encode())


def test_a_start_naming_an_empty_worker_names_no_worker() -> None:
    """Before the fix (minor/typed): worker_of("cloud:") is "" (a start event whose node is
    "cloud:"); every caller then builds worker_alive_subject("", ...) / worker_cancel_subject,
    where model_token("") raises a raw ValueError (mesh/queue.py: watch_worker,
    resend_missing, withdraw; cloud_node/orphans.py)."""
    node = worker_of("cloud:")
    assert node is None or worker_alive_subject(node, "s", "r")


@FEW
@given(raw=hostile_requests(), model=st.one_of(st.none(), HOSTILE_TEXT.filter(bool)))
def test_guard_fingerprints_agree_with_request_fingerprint(raw: dict, model: str | None) -> None:
    """Guard (passes): Fingerprints.of (one hash, spliced) is request_fingerprint for any
    request and any model name."""
    request = _decoded_request(_json_bytes(raw))
    assume(request is not None)
    request = request.model_copy(update={"model": model})
    assert Fingerprints(request).of(model) == request_fingerprint(request)
    assert is_token(model_token(model)) if model else True


def test_a_json_schema_with_an_integer_beyond_64_bits_is_refused_at_the_door() -> None:
    """Before the fix (typed): ``response_format.json_schema`` was checked as Unicode text only
    (``unicode_tree``), not as what msgpack can write (``wire_tree``): a schema's ``maximum`` of
    2**70 passed the door, and the edge's escalation, which queues the request as msgpack,
    failed on it with a raw OverflowError. orjson reads such a number as a float; Python's json,
    which reads what orjson refuses (here a lone surrogate in a field nobody reads), keeps it
    exact. Now it is ``invalid_request``."""
    schema = {"type": "integer", "maximum": 2**70}
    raw = {
        "prompt": "hi",
        "note": "\ud800",
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
    }
    with pytest.raises(MeshError) as refused:
        decode_request(json.dumps(raw).encode())
    assert refused.value.code == "invalid_request"
    assert "64 bits" in str(refused.value)
    # the same schema within 64 bits passes and is written back as it came
    schema["maximum"] = 2**63
    request, _fmt = decode_request(json.dumps(raw).encode())
    again = decode_request(dump(request, WireFormat.MSGPACK), {CONTENT_TYPE: "application/msgpack"})
    assert again[0].response_format.json_schema_of() == schema
