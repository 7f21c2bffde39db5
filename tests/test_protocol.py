"""protocol/: codec, validation, subjects and error codes, with no I/O."""

from __future__ import annotations

import json

import msgpack
import pytest

from protocol.codec import (
    RequestLimits,
    WireFormat,
    compact_json,
    decode_event,
    decode_request,
    dump,
    dump_event,
    dump_token,
    error_event,
    load,
    reply_target,
    sniff,
    to_exception,
)
from protocol.errors import (
    BadPayloadError,
    ErrorCode,
    InvalidRequestError,
    MeshError,
    MeshTimeoutError,
    OverloadedError,
    PayloadTooLargeError,
)
from protocol.messages import (
    Answer,
    EndEvent,
    ErrorEvent,
    InferRequest,
    RouteDecision,
    StartEvent,
    TokenEvent,
    TokenLogprob,
    queued_request_id,
    route_decision,
    token_event,
)
from protocol.subjects import (
    address_of,
    cancel_subject,
    consumer_name,
    edge_infer_subject,
    infer_subject,
    is_subject,
    model_token,
    scope_of,
    token_subject,
)


def test_msgpack_request_round_trip() -> None:
    request = InferRequest(id="abc", model="smollm2", prompt="hi", max_tokens=7, stop="\n")
    data = dump(request, WireFormat.MSGPACK)
    decoded, fmt = decode_request(data)
    assert fmt is WireFormat.MSGPACK
    assert decoded == request
    assert decoded.stop == ["\n"]


def test_json_object_as_the_nats_cli_sends_it() -> None:
    decoded, fmt = decode_request(b'{"prompt": "What is NATS?", "max_tokens": 5}')
    assert fmt is WireFormat.JSON and fmt.reply_format is WireFormat.JSON
    assert decoded.prompt == "What is NATS?" and decoded.max_tokens == 5
    assert len(decoded.id) == 32  # an id is assigned when the sender gives none


def test_plain_text_is_a_prompt_and_is_answered_in_json() -> None:
    decoded, fmt = decode_request(b"Qu'est-ce que NATS ?")
    assert fmt is WireFormat.TEXT and fmt.reply_format is WireFormat.JSON
    assert decoded.prompt == "Qu'est-ce que NATS ?"
    assert decoded.chat() == [{"role": "user", "content": "Qu'est-ce que NATS ?"}]


def test_content_type_header_wins_over_sniffing() -> None:
    assert sniff(b'{"prompt": "x"}', {"Content-Type": "text/plain"}) is WireFormat.TEXT
    decoded, _ = decode_request(b'{"prompt": "x"}', {"Content-Type": "text/plain"})
    assert decoded.prompt == '{"prompt": "x"}'


@pytest.mark.parametrize(
    ("payload", "code", "fragment"),
    [
        (b"\x85\xa2id", ErrorCode.BAD_PAYLOAD, "malformed msgpack"),
        (b'{"prompt": "unterminated', ErrorCode.BAD_PAYLOAD, "invalid JSON"),
        (b"\xff\xfe\x00garbage", ErrorCode.BAD_PAYLOAD, "not UTF-8"),
        (b'{"max_tokens": 5}', ErrorCode.INVALID_REQUEST, "missing prompt"),
        (b"   ", ErrorCode.INVALID_REQUEST, "missing prompt"),
        (b'{"prompt": "x", "max_tokens": -3}', ErrorCode.INVALID_REQUEST, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 10000000}', ErrorCode.INVALID_REQUEST, "max_tokens"),
        (b'{"prompt": "x", "temperature": "hot"}', ErrorCode.INVALID_REQUEST, "temperature"),
        (
            b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
            ErrorCode.INVALID_REQUEST,
            "not both",
        ),
        (b'{"messages": []}', ErrorCode.INVALID_REQUEST, "empty"),
        (b'{"prompt": "x", "id": "has spaces"}', ErrorCode.INVALID_REQUEST, "id"),
        (b'{"prompt": "x", "reply": "mesh.v1.tok.*"}', ErrorCode.INVALID_REQUEST, "reply"),
        (b'{"prompt": "x", "route": "moon"}', ErrorCode.INVALID_REQUEST, "route"),
    ],
)
def test_bad_input_gets_a_typed_error(payload: bytes, code: ErrorCode, fragment: str) -> None:
    with pytest.raises(MeshError) as excinfo:
        decode_request(payload)
    assert excinfo.value.code is code
    assert fragment in str(excinfo.value)
    assert excinfo.value.retryable is False


def test_non_map_payloads_are_rejected_and_bracketed_text_is_a_prompt() -> None:
    with pytest.raises(InvalidRequestError, match="map/object"):
        decode_request(msgpack.packb([1, 2]), {"Content-Type": "application/msgpack"})
    with pytest.raises(InvalidRequestError, match="map/object"):
        decode_request(b"[1, 2, 3]", {"Content-Type": "application/json"})
    decoded, fmt = decode_request(b"[1, 2, 3] sorted?")  # only a leading '{' means JSON
    assert fmt is WireFormat.TEXT and decoded.prompt == "[1, 2, 3] sorted?"


def test_node_limits_apply_after_protocol_validation() -> None:
    limits = RequestLimits(max_payload_bytes=2048, max_tokens=100)
    with pytest.raises(InvalidRequestError) as excinfo:
        decode_request(b'{"id": "r1", "prompt": "x", "max_tokens": 101}', limits=limits)
    assert "limit of 100" in str(excinfo.value)
    assert excinfo.value.request_id == "r1"  # the error can be routed to the sender
    with pytest.raises(PayloadTooLargeError) as too_big:
        decode_request(json.dumps({"prompt": "x" * 4096}).encode(), limits=limits)
    assert too_big.value.code is ErrorCode.PAYLOAD_TOO_LARGE


def test_validation_details_name_each_field() -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        decode_request(b'{"prompt": "x", "max_tokens": 0, "top_p": 0}')
    fields = {d["loc"] for d in excinfo.value.details or []}
    assert fields == {"max_tokens", "top_p"}


def test_unknown_fields_are_ignored_and_reported_or_rejected_when_strict() -> None:
    seen: list[frozenset[str]] = []
    decoded, _ = decode_request(
        b'{"prompt": "x", "colour": "blue"}', on_unknown=lambda _kind, fields: seen.append(fields)
    )
    assert decoded.prompt == "x"
    assert seen == [frozenset({"colour"})]
    with pytest.raises(InvalidRequestError, match="unknown field"):
        decode_request(b'{"prompt": "x", "colour": "blue"}', strict=True)


def test_reply_target_reads_what_it_can_from_an_invalid_request() -> None:
    assert reply_target(b'{"id": "r9", "reply": "my.inbox", "max_tokens": -1}') == (
        "r9",
        "my.inbox",
    )
    assert reply_target(b'{"id": "bad id", "reply": "a.*"}') == (None, None)
    assert reply_target(b"\x85\xa2") == (None, None)


def test_a_request_without_an_id_takes_the_one_it_is_given_and_no_other() -> None:
    """A queued request that names no id is answered under one the worker derives from its
    queue message, the same at every delivery; one that names an id keeps it."""
    given = queued_request_id(42)
    for payload in (b'{"prompt": "hi"}', b"hi", msgpack.packb({"prompt": "hi"})):
        assert decode_request(payload, missing_id=given)[0].id == given
        assert reply_target(payload, missing_id=given)[0] == given
    assert decode_request(b'{"id": "mine", "prompt": "hi"}', missing_id=given)[0].id == "mine"
    assert reply_target(b'{"id": "mine", "max_tokens": -1}', missing_id=given)[0] == "mine"
    assert decode_request(b'{"prompt": "hi"}')[0].id != decode_request(b'{"prompt": "hi"}')[0].id


def test_events_round_trip_in_both_formats() -> None:
    events = [
        TokenEvent(id="r", seq=0, text="Hel", attempt=2),
        EndEvent(id="r", seq=3, finish_reason="length", served_by="cloud:w1"),
        ErrorEvent(id="r", code="overloaded", message="full", retryable=True, retry_after=2),
        StartEvent(id="r", attempt=2, seq=3, digest=77, node="cloud:w2", req="ab12"),
        EndEvent(id="r", seq=3, attempt=2, digest=12345),
        Answer(id="r", text="Hello", path="local", digest=9),
    ]
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        for event in events:
            assert decode_event(dump(event, fmt)) == event


def test_token_fast_path_matches_the_model_encoding() -> None:
    event = TokenEvent(id="r", seq=4, text="ü!", attempt=1)
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        assert decode_event(dump_token("r", 4, "ü!", 1, fmt)) == event
        assert dump_token("r", 4, "ü!", 1, fmt) == dump(event, fmt)


def test_a_token_for_a_json_client_is_spelled_as_json_spells_it() -> None:
    """compact_json (orjson) writes a token's event byte for byte as json.dumps did: control
    characters, quotes, backslashes, unicode, line and paragraph separators, a BOM, emoji."""
    awkward = "".join(chr(i) for i in range(0x80)) + 'é✓\u2028\u2029\ufeff😀"\\'
    for text in (awkward, "", " plain", "\x7f\x00"):
        data = {"t": "tok", "id": "r", "seq": 2**40, "text": text, "attempt": 1, "n": 0}
        spelled = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        assert compact_json(data) == spelled
        assert dump_token("r", 2**40, text, 1, WireFormat.JSON, 0) == spelled


def test_what_orjson_refuses_is_written_by_json() -> None:
    big = {"n": 2**70, 1: "a key that is not a string"}
    assert json.loads(compact_json(big)) == {"n": 2**70, "1": "a key that is not a string"}
    # A lone surrogate is written as JSON escapes it (it raised UnicodeEncodeError before
    # review S18e, though this function's docstring sent it to json): a JSON reader reads it.
    assert compact_json({"text": "\ud800"}) == b'{"text":"\\ud800"}'
    assert json.loads(compact_json({"text": "\ud800"})) == {"text": "\ud800"}


def test_errors_cross_the_wire_typed() -> None:
    sent = OverloadedError("queue full", retry_after=2.5, request_id="r1")
    received = to_exception(decode_event(dump(error_event(sent), WireFormat.MSGPACK)))
    assert isinstance(received, OverloadedError)
    assert received.retryable and received.retry_after == 2.5 and received.request_id == "r1"
    timeout = to_exception(ErrorEvent(code="timeout", message="slow"))
    assert isinstance(timeout, MeshTimeoutError) and isinstance(timeout, TimeoutError)
    unknown = to_exception(ErrorEvent(code="from_the_future", message="?"))
    assert type(unknown) is MeshError and unknown.code is ErrorCode.INTERNAL


def test_garbage_event_is_a_bad_payload() -> None:
    with pytest.raises(BadPayloadError):
        decode_event(b'{"t": "nope"}')


def test_expiry_uses_deadline_and_start_by() -> None:
    assert InferRequest(prompt="x", deadline=100.0).is_expired(now=100.0)
    assert InferRequest(prompt="x", start_by=50.0).is_expired(now=60.0)
    assert not InferRequest(prompt="x", deadline=100.0, start_by=90.0).is_expired(now=80.0)


def test_subject_names() -> None:
    assert infer_subject("Qwen/Qwen2.5-7B", "site1") == "mesh.v1.infer.Qwen_Qwen2_5-7B.site1"
    assert model_token("a.b*c>d e") == "a_b_c_d_e"
    assert consumer_name("smollm2") == "workers_smollm2"
    assert token_subject("site1", "abc") == "mesh.v1.tok.site1.abc"
    assert cancel_subject("site1", "abc") == "mesh.v1.cancel.site1.abc"
    assert address_of("mesh.v1.cancel.site1.abc") == ("site1", "abc")
    assert scope_of("mesh.v1.infer.smollm2.site1") == "site1"
    assert scope_of("mesh.v1.infer.smollm2") is None
    assert edge_infer_subject("jetson-1") == "mesh.v1.edge.jetson-1.infer"
    with pytest.raises(ValueError, match="subject token"):
        token_subject("site1", "a.b")
    with pytest.raises(ValueError, match="scope"):
        infer_subject("smollm2", "a.*")
    assert is_subject("_INBOX.abc.def") and not is_subject("a.>") and not is_subject("a..b")


@pytest.mark.parametrize(
    "logprobs", [None, [TokenLogprob(token=" a", logprob=-0.5, top=[(" a", -0.5), (" b", -1.0)])]]
)
def test_the_fast_token_event_is_the_validated_one(logprobs: list[TokenLogprob] | None) -> None:
    fast = token_event("r-1", 4, " a", 2, 1, logprobs)
    slow = TokenEvent(id="r-1", seq=4, text=" a", attempt=2, n=1, logprobs=logprobs)
    assert fast == slow
    assert fast.model_dump() == slow.model_dump()
    assert fast.model_fields_set == slow.model_fields_set | {"t", "logprobs"}
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        assert dump_event(fast, fmt) == dump(slow, fmt)
        assert decode_event(dump_event(fast, fmt)) == slow
    copy = fast.model_copy(update={"id": "r-2"})
    assert copy.id == "r-2" and fast.id == "r-1"
    fast.attempt = 3  # events are mutable, as validated ones are
    assert fast.attempt == 3


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("cloud", "client asked for route=cloud", None), {"forced": True}),
        (("local", "deadline too near", {"policy": "share", "cap_used": None}), {}),
        (("cloud", "score 0.81 >= 0.50: math", None), {"score": 0.81, "threshold": 0.5}),
    ],
)
def test_the_fast_route_decision_is_the_validated_one(
    args: tuple[str, str, dict[str, object] | None], kwargs: dict[str, object]
) -> None:
    """An edge builds each request's decision without validation; it must be the decision a
    validated one is, on the wire too, and stay a model that copies as one does."""
    decision, reason, budget = args
    fast = route_decision(decision, reason, budget, **kwargs)  # type: ignore[arg-type]
    slow = RouteDecision.model_validate(
        {"decision": decision, "reason": reason, "budget": budget, **kwargs}
    )
    assert fast == slow
    assert fast.model_dump() == slow.model_dump()
    for fmt in (WireFormat.MSGPACK, WireFormat.JSON):
        assert dump(fast, fmt) == dump(slow, fmt)
    copy = fast.model_copy(update={"decision": "local"})
    assert copy.decision == "local" and fast.decision == decision


def test_json_nested_past_the_decoders_limit_is_a_bad_payload_without_recursion() -> None:
    """JSON nested past 1,024 levels is a bad payload, found without a Python recursion into
    the interpreter's limit (where a finalizer run then fails too); a payload nested less (200
    levels: too deep for a request, but readable, so its id can be told) still parses, and
    brackets inside strings are text."""
    with pytest.raises(BadPayloadError, match="invalid JSON: depth limit"):
        load(b"[" * 100_000, WireFormat.JSON)
    brackets = json.dumps({"prompt": "[" * 5000 + "{" * 5000, "id": "x"}).encode()
    assert load(brackets, WireFormat.JSON)["id"] == "x"
    deep = ('{"a":' * 200 + "1" + "}" * 200).encode()
    assert isinstance(load(deep, WireFormat.JSON), dict)


@pytest.mark.parametrize("engine_says", [float("-inf"), float("nan"), float("inf")])
def test_a_logprob_that_is_not_a_number_goes_out_as_strict_json(engine_says: float) -> None:
    """A token a grammar ruled out has a log probability of minus infinity (llama.cpp's, for
    one). JSON has none: Python wrote ``-Infinity``, which ``jq``, browsers and most JSON
    readers refuse, on the wire to a ``nats`` CLI user and in the OpenAI API's chunks. It reads
    as OpenAI's own -9999.0."""

    def refuse(constant: str) -> float:
        raise ValueError(f"not JSON: {constant}")

    token = TokenLogprob(token=" a", logprob=engine_says, top=[(" a", -0.5), (" b", engine_says)])
    event = TokenEvent(id="r-1", seq=0, text=" a", logprobs=[token])
    for fmt in (WireFormat.JSON, WireFormat.TEXT):
        wire = json.loads(dump_event(event, fmt), parse_constant=refuse)
        assert wire["logprobs"] == [
            {"token": " a", "logprob": -9999.0, "top": [[" a", -0.5], [" b", -9999.0]]}
        ]
    assert decode_event(dump_event(event, WireFormat.MSGPACK)).logprobs == [token]
    assert token.logprob == -9999.0
