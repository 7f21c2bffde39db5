"""Bytes <-> messages: msgpack between nodes, JSON and plain text from people and the ``nats`` CLI.

The wire format of a payload is taken from its ``Content-Type`` header when present, else sniffed:
a msgpack map starts with a byte no UTF-8 text starts with, a JSON object starts with ``{``, and
anything else is a plain-text prompt. Replies go back in the format the request came in (JSON for
plain text), so a person using ``nats req`` reads JSON and the SDK reads msgpack.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from protocol.errors import (
    BadPayloadError,
    ErrorCode,
    InvalidRequestError,
    MeshError,
    PayloadTooLargeError,
    error_class,
)
from protocol.messages import (
    MAX_TOKENS_CEILING,
    WIRE_INT_MAX,
    ErrorEvent,
    Event,
    InferRequest,
    TokenEvent,
    token_event,
)
from protocol.subjects import is_subject, is_token

CONTENT_TYPE = "Content-Type"
_packers = threading.local()


def _pack(data: Any) -> bytes:
    """msgpack bytes, through this thread's own reused ``Packer``: ``msgpack.packb`` builds a
    packer per call, half of what a token event's encoding cost (0.61 -> 0.30 us)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(data)  # type: ignore[no-any-return]


class WireFormat(str, Enum):
    MSGPACK = "msgpack"
    JSON = "json"
    TEXT = "text"

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES[self]

    @property
    def reply_format(self) -> WireFormat:
        """The format to answer in: plain-text requests get JSON answers."""
        return WireFormat.JSON if self is WireFormat.TEXT else self


_CONTENT_TYPES = {
    WireFormat.MSGPACK: "application/msgpack",
    WireFormat.JSON: "application/json",
    WireFormat.TEXT: "text/plain",
}
_MSGPACK_MAP_FIRST_BYTES = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(Event)


@dataclass(frozen=True)
class RequestLimits:
    """What a node accepts; checked on entry, before any work is done."""

    max_payload_bytes: int = 256 * 1024
    max_tokens: int = 4096


NO_LIMITS = RequestLimits(max_payload_bytes=2**62, max_tokens=2**62)
"""No node's limits: a request read again only to keep or tell its refusal."""

UnknownFieldsHook = Callable[[str, frozenset[str]], None]
MAX_NESTING = 64
"""Deepest nesting of maps and lists a request may have (a JSON schema included): deeper ones
would make hashing or encoding the request recurse past Python's limit."""
LENIENT_OPENERS = 256
"""JSON is parsed by orjson; what it refuses is read again by Python's decoder (which takes a
lone surrogate, NaN or a number too big, for the checks to name the request's fault) only
with at most this many arrays and objects. Python's decoder recurses per level and stops only
at the interpreter's recursion limit, where a finalizer run then (the garbage collector's, at
any allocation) failed in turn: a process-wide "exception ignored" (a hostile-input test
failed so once); orjson refuses past 1,024 levels without recursing in Python."""


def check_nesting(value: Any, limit: int = MAX_NESTING, request_id: str | None = None) -> None:
    """Raise :class:`InvalidRequestError` when ``value`` nests maps/lists deeper than ``limit``."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            raise InvalidRequestError(
                f"the request nests deeper than {limit} levels", request_id=request_id
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def sniff(data: bytes, headers: Mapping[str, str] | None = None) -> WireFormat:
    """The wire format of ``data``: from the Content-Type header if given, else from its bytes."""
    if headers:
        declared = (headers.get(CONTENT_TYPE) or "").split(";")[0].strip().lower()
        for fmt, content_type in _CONTENT_TYPES.items():
            if declared == content_type:
                return fmt
    if data and data[0] in _MSGPACK_MAP_FIRST_BYTES and not _text_too(data):
        return WireFormat.MSGPACK
    if data.lstrip()[:1] == b"{":
        return WireFormat.JSON
    return WireFormat.TEXT


def _text_too(data: bytes) -> bool:
    """Whether ``data``, which begins as a msgpack map does, is UTF-8 text: 0xDE and 0xDF
    (map16, map32) also begin a character (Thaana, N'Ko). A map the SDK writes is not text:
    its length's first byte (0x00 below 256 entries) cannot follow them in UTF-8."""
    if data[0] < 0xDE:
        return False  # a fixmap's byte continues a character: it begins no text
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load(data: bytes, fmt: WireFormat) -> Any:
    """Parse bytes in ``fmt`` into Python values; :class:`BadPayloadError` if they don't parse."""
    if fmt is WireFormat.MSGPACK:
        try:
            return msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise BadPayloadError(f"malformed msgpack: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadPayloadError(
            f"payload is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None
    if fmt is WireFormat.TEXT:
        return text
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if text.count("[") + text.count("{") > LENIENT_OPENERS:
            raise _invalid_json(exc) from None
    try:  # what orjson refuses and Python reads: a lone surrogate, NaN, a number too big
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid_json(exc) from None
    except (RecursionError, ValueError) as exc:  # a number too long to read
        raise BadPayloadError(f"unreadable JSON: {str(exc)[:120]}") from None


def _invalid_json(exc: json.JSONDecodeError) -> BadPayloadError:
    return BadPayloadError(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")


def dump(message: BaseModel, fmt: WireFormat) -> bytes:
    """Encode a message; plain text is answered in JSON."""
    data = message.model_dump(mode="json", exclude_none=True)
    if fmt is WireFormat.MSGPACK:
        return _pack(data)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def dump_token(  # noqa: PLR0917 - the hot path takes plain values, not a model
    request_id: str, seq: int, text: str, attempt: int, fmt: WireFormat, n: int = 1
) -> bytes:
    """Fast path for the hottest message: same bytes as ``dump(TokenEvent(...))``, no pydantic."""
    data = {"t": "tok", "id": request_id, "seq": seq, "text": text, "attempt": attempt, "n": n}
    if fmt is WireFormat.MSGPACK:
        return _pack(data)
    return compact_json(data)


def compact_json(data: Any) -> bytes:
    """``json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()``, through orjson
    (a token's event for a JSON client: 0.13 against 2.6 us). The same bytes for strings,
    integers, booleans, None, lists and maps with string keys; a float may be spelled otherwise
    (``1e-5`` for ``1e-05``), and NaN and infinities are null. What orjson refuses (a lone
    surrogate, an integer beyond 64 bits, a key that is not a string) goes to ``json``; a lone
    surrogate is written as JSON escapes it (``\\ud800``)."""
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:  # a lone surrogate: as JSON escapes it, backslash-u
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace"
        )


def dump_event(event: BaseModel, fmt: WireFormat) -> bytes:
    """Encode any event, token events through the fast path."""
    if isinstance(event, TokenEvent) and event.logprobs is None:
        return dump_token(event.id, event.seq, event.text, event.attempt, fmt, event.n)
    return dump(event, fmt)


def decode_request(
    data: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    limits: RequestLimits = RequestLimits(),
    strict: bool = False,
    on_unknown: UnknownFieldsHook | None = None,
    missing_id: str | None = None,
) -> tuple[InferRequest, WireFormat]:
    """Decode and validate a request from any accepted format (``missing_id``: the id of one
    that names none, where a fresh one each time would not do: a queued message's).

    Raises :class:`PayloadTooLargeError`, :class:`BadPayloadError` or
    :class:`InvalidRequestError`; the error's ``request_id`` is set when the id could be read.
    """
    fmt = sniff(data, headers)
    if len(data) > limits.max_payload_bytes:
        raise PayloadTooLargeError(
            f"payload is {len(data)} bytes; this node accepts at most {limits.max_payload_bytes}"
        )
    raw = load(data, fmt)
    if isinstance(raw, str):
        raw = {"prompt": raw}
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            f"a request must be a map/object or a text prompt, not {type(raw).__name__}"
        )
    if missing_id is not None and "id" not in raw:
        raw["id"] = missing_id
    # The id and names as they can be written back in an error or a log (a lone surrogate
    # spelled out as \ud800): the error must reach its client even then.
    request_id = _printable(raw["id"]) if isinstance(raw.get("id"), str) else None
    check_nesting(raw, request_id=request_id)
    # The usual request names known fields only: one set comparison, no name spelled out.
    unknown = (
        frozenset()
        if raw.keys() <= _REQUEST_FIELDS
        else frozenset(_printable(str(k)) for k in raw) - _REQUEST_FIELDS
    )
    if unknown:
        if strict:
            raise InvalidRequestError(
                f"unknown field(s): {', '.join(sorted(unknown))}", request_id=request_id
            )
        if on_unknown is not None:
            on_unknown("InferRequest", unknown)
    try:
        request = InferRequest.model_validate(raw)
    except ValidationError as exc:
        raise invalid_request_error(exc, request_id) from None
    if request.max_tokens > limits.max_tokens:
        raise InvalidRequestError(
            f"max_tokens {request.max_tokens} is over this node's limit of {limits.max_tokens}",
            request_id=request.id,
            details=[{"loc": "max_tokens", "msg": f"must be <= {limits.max_tokens}"}],
        )
    return request, fmt


def reply_target(
    data: bytes, headers: Mapping[str, str] | None = None, missing_id: str | None = None
) -> tuple[str | None, str | None]:
    """Best effort ``(request_id, reply_subject)`` from a payload that failed to decode
    (``missing_id``: as :func:`decode_request` takes it).

    Lets a worker answer a request it cannot validate on the subject its sender listens on.
    """
    try:
        raw = load(data, sniff(data, headers))
    except MeshError:
        return None, None
    if isinstance(raw, str):
        return missing_id, None
    if not isinstance(raw, dict):
        return None, None
    rid = raw.get("id", missing_id)
    reply = raw.get("reply")
    request_id = rid if isinstance(rid, str) and is_token(rid) else None
    reply_subject = reply if isinstance(reply, str) and is_subject(reply) else None
    return request_id, reply_subject


def decode_event(data: bytes, headers: Mapping[str, str] | None = None) -> Any:
    """Decode a start / tok / end / err / answer event; :class:`BadPayloadError` if malformed."""
    raw = load(data, sniff(data, headers))
    token = _token_fast(raw)
    if token is not None:
        return token
    try:
        return _EVENT_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise BadPayloadError(f"not a mesh event: {_summary(exc)}") from None


def _token_fast(raw: Any) -> TokenEvent | None:
    """A well-formed token event without pydantic's validation (the hot path); None when the map
    is anything else or anything looks off, so the full validation decides."""
    fields = token_fields(raw)
    if fields is None or not _writable(fields):
        return None
    return token_event(*fields)


def _writable(fields: tuple[str, int, str, int, int]) -> bool:
    """Whether a token's fields can be written again (a node relays it): its text Unicode (JSON
    can carry a lone surrogate, msgpack cannot), its numbers within what msgpack writes."""
    _rid, seq, text, attempt, n = fields
    if max(seq, attempt, n) > WIRE_INT_MAX:
        return False
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def token_fields(raw: Any) -> tuple[str, int, str, int, int] | None:
    """A decoded map's token fields (id, seq, text, attempt, n) when it is a well-formed token
    event without logprobs; None for anything else (the full validation decides). For a
    reader that needs no event object for an in-order token."""
    if not isinstance(raw, dict) or raw.get("t") != "tok" or len(raw) > 6:
        return None  # logprobs (a 7th field) take the validated path
    rid, seq, text = raw.get("id"), raw.get("seq"), raw.get("text")
    attempt, n = raw.get("attempt", 1), raw.get("n", 1)
    if (
        type(rid) is str
        and type(seq) is int
        and type(text) is str
        and type(attempt) is int
        and type(n) is int
        and seq >= 0
        and attempt >= 1
        and n >= 0
        and set(raw) <= _TOKEN_FIELDS
    ):
        return rid, seq, text, attempt, n
    return None


_TOKEN_FIELDS = frozenset({"t", "id", "seq", "text", "attempt", "n"})


def message_token_fields(data: bytes) -> tuple[str, int, str, int, int] | None:
    """:func:`token_fields` of a msgpack message without headers, read from its bytes; None for
    anything else, a payload that does not parse and JSON included (the full decoding then
    decides, and says why). Nodes send tokens in msgpack: this is every token's way in, so it
    unpacks them itself rather than through :func:`sniff` and :func:`load`."""
    if not data or data[0] not in _MSGPACK_MAP_FIRST_BYTES:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated exception types
        return None
    return token_fields(raw)


def error_event(error: MeshError, request_id: str | None = None) -> ErrorEvent:
    """``error`` as the event that says it; its text as it can be encoded (an engine's error
    text may hold a lone surrogate), its details left out if they cannot be (not JSON)."""
    fields: dict[str, Any] = {
        "id": request_id or error.request_id,
        "code": error.code.value,
        "message": _printable(error.message),
        "retryable": error.retryable,
        "retry_after": error.retry_after,
        "details": error.details,
    }
    try:
        return ErrorEvent(**fields)
    except ValidationError:
        return ErrorEvent(**{**fields, "details": None})


def to_exception(event: ErrorEvent) -> MeshError:
    """Rebuild the typed exception an error event stands for."""
    cls = error_class(event.code)
    error = cls(
        event.message,
        retryable=event.retryable,
        retry_after=event.retry_after,
        details=event.details,
        request_id=event.id,
    )
    if cls is MeshError:
        try:
            error.code = ErrorCode(event.code)
        except ValueError:
            error.code = ErrorCode.INTERNAL
    return error


_REQUEST_FIELDS = frozenset(InferRequest.model_fields)


def _printable(text: str) -> str:
    """``text`` as it can be encoded (a lone surrogate spelled out); ASCII, the usual case, as
    it is, without a round trip through UTF-8 on every request's every field name."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _summary(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        parts.append(f"{loc}: {err['msg']}")
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def invalid_request_error(exc: ValidationError, request_id: str | None) -> InvalidRequestError:
    """A pydantic validation failure as a typed error, with one detail per bad field."""
    details = [
        {"loc": _printable(".".join(str(p) for p in err["loc"])) or "request", "msg": err["msg"]}
        for err in exc.errors()
    ]
    return InvalidRequestError(_printable(_summary(exc)), details=details, request_id=request_id)


__all__ = [
    "CONTENT_TYPE",
    "MAX_TOKENS_CEILING",
    "MAX_NESTING",
    "RequestLimits",
    "WireFormat",
    "check_nesting",
    "decode_event",
    "decode_request",
    "dump",
    "dump_event",
    "dump_token",
    "error_event",
    "invalid_request_error",
    "load",
    "reply_target",
    "sniff",
    "to_exception",
]
