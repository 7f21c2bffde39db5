"""Wire messages of protocol v1, as pydantic models.

Every message is a map with a type tag ``t`` (events) or a version ``v`` (requests). Maps decode
tolerantly: unknown fields are ignored (the codec reports them), so a newer peer can add fields
without breaking an older one.

Events on a token subject or an edge reply inbox, in order: a ``start`` for each delivery attempt,
``tok`` events numbered by their position in the answer, then exactly one ``end`` or ``err``. A
later attempt's ``start`` either continues the answer from a position (``seq``, vouched for by
the digest of the text before it) or starts it over (``seq`` 0). :mod:`protocol.stream` holds the
rules every reader applies. A non-streaming edge request gets a single ``answer`` or ``err``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from protocol.subjects import TOKEN_PATTERN, is_subject

PROTOCOL_VERSION = 1
MAX_TOKENS_CEILING = 65_536
"""No request may ask for more tokens than this, whatever a node allows."""
MAX_MESSAGES = 512
MAX_STOP_SEQUENCES = 16

RouteChoice = Literal["auto", "local", "cloud"]
Path = Literal["local", "cloud"]


def new_request_id() -> str:
    """128 random bits as 32 hex digits, as ``uuid.uuid4().hex`` spells them (without its version
    digits, which nothing reads): a sixth of the time, with no UUID object made on the way."""
    return os.urandom(16).hex()


def queued_request_id(stream_seq: int) -> str:
    """The id of a request queued without one (``nats pub`` straight into the queue): taken from
    its queue message's stream sequence, the same at every delivery of it, and the ``seq`` of the
    publish ack that ``nats req`` prints."""
    return f"queued-{stream_seq}"


def unicode_text(value: Any) -> Any:
    """Refuse a string that is not Unicode text: one with a lone surrogate, which JSON can
    carry (``"\\ud800"``) but UTF-8 cannot. Accepted, it would fail seconds later in a
    tokenizer or in the msgpack encoder; refused here, every door (HTTP, the NATS endpoint, the
    SDK, a worker's queue intake) answers ``invalid_request`` at once, naming the field. It runs
    before pydantic's own checks, which catch it on length-limited fields only, less clearly."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate U+{ord(value[exc.start]):04X} at "
                f"character {exc.start} (send text as UTF-8)"
            ) from None
    return value


_JSON_LEAVES = (str, int, float, bool, type(None))


def unicode_tree(value: Any) -> Any:
    """:func:`unicode_text` for every key and string inside nested maps and lists, each leaf a
    value JSON holds: msgpack can carry bytes or an extension type there, which no JSON encoder
    (a request's fingerprint, an engine's HTTP body) takes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, _JSON_LEAVES):
            unicode_text(item)
        else:
            raise ValueError(f"JSON values only, not {type(item).__name__}")
    return value


Text = Annotated[str, BeforeValidator(unicode_text)]
"""A string that must be Unicode text: everything of a request that reaches a model, a log or
the wire."""
WIRE_INT_MAX = 2**63 - 1
Count = Annotated[int, Field(ge=0, le=WIRE_INT_MAX)]
"""A count or a position: what msgpack carries (JSON reads any integer; msgpack writes 64 bits)."""


def wire_tree(value: Any) -> Any:
    """:func:`unicode_tree`, and no integer beyond what msgpack writes: a map a node decoded
    from JSON that it could not encode again (it relays it, escalates it). One walk."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -(2**63) <= item <= 2**64 - 1:
                raise ValueError("an integer beyond 64 bits")
        elif isinstance(item, _JSON_LEAVES):
            unicode_text(item)
        else:
            raise ValueError(f"JSON values only, not {type(item).__name__}")
    return value


WireTree = BeforeValidator(wire_tree)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False, populate_by_name=True)


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant"]
    content: Text = Field(max_length=1_000_000)


class RouteDecision(_Wire):
    """Why a request went where it went; attached by the edge to what it sends and answers."""

    decision: Path
    score: float | None = Field(default=None, ge=0.0, le=1.0)
    """The router's calibrated probability that the request needs the cloud (higher means
    escalate); absent for forced routes."""
    reason: Text = ""
    """A short human-readable reason, e.g. ``score 0.81 >= 0.50: math, multi-step``."""
    forced: bool = False
    """True when the client's ``route`` override made the decision, not the router."""
    threshold: float | None = None
    """The score at or above which the router escalated this request."""
    budget: Annotated[dict[str, float | int | str | bool | None] | None, WireTree] = None
    """The edge's cloud budget when it decided: policy, target and realized share of
    router-decided escalations over its recent window, totals (forced routes counted apart) and
    the per-minute cap. Optional; older peers ignore it."""
    confidence: Annotated[dict[str, float | int | bool] | None, WireTree] = None
    """For a request the router kept local under mid-answer escalation: the local model's
    confidence over its first tokens (``tokens``, ``mean_entropy``, ``max_entropy``,
    ``mean_logprob``, ``min_logprob``) and whether it ``escalated`` (then ``decision`` is
    cloud and ``reason`` says why)."""


def route_decision(
    decision: Path,
    reason: str,
    budget: dict[str, float | int | str | bool | None] | None,
    *,
    forced: bool = False,
    score: float | None = None,
    threshold: float | None = None,
    confidence: dict[str, float | int | bool] | None = None,
) -> RouteDecision:
    """A decision from the edge's own values, not validated: ``RouteDecision.model_construct``
    with every field given, so that pydantic looks up no default (five calls a field left
    out, on every request an edge routes). ``tests/test_protocol.py`` checks that it equals a
    validated one."""
    return RouteDecision.model_construct(
        decision=decision,
        score=score,
        reason=reason,
        forced=forced,
        threshold=threshold,
        budget=budget,
        confidence=confidence,
    )


class ResponseFormat(_Wire):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: Annotated[dict[str, Any] | None, WireTree] = None
    """For ``json_schema``: ``{"name": ..., "schema": {...}, "strict": ...}`` as OpenAI has it."""

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and not (self.json_schema or {}).get("schema"):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self

    def json_schema_of(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (None: any JSON object, or free text)."""
        if self.type != "json_schema" or self.json_schema is None:
            return None
        schema = self.json_schema.get("schema")
        return schema if isinstance(schema, dict) else None


class InferRequest(_Wire):
    """An inference request: what a client sends to an edge and what an edge queues for workers."""

    v: int = Field(default=PROTOCOL_VERSION, ge=1, le=2**31)
    id: Text = Field(default_factory=new_request_id, pattern=TOKEN_PATTERN)
    model: Text | None = Field(default=None, min_length=1, max_length=256)
    """Cloud model to escalate to; the edge's configured default when absent."""
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    prompt: Text | None = None
    """A single user turn; shorthand for ``messages=[{"role": "user", "content": prompt}]``."""
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_CEILING)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[Text] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    """Within 64 bits: what msgpack carries to a worker."""
    deadline: float | None = Field(default=None, gt=0)
    """Absolute time (Unix seconds) by which the answer must be complete."""
    start_by: float | None = Field(default=None, gt=0)
    """Absolute time (Unix seconds) after which a worker must not start this request."""
    reply: Text | None = None
    """Subject for token events. Workers publish only on ``mesh.v1.tok.<scope>.<id>``, the scope
    being the one the request was queued under: a queued request may leave this out or name
    exactly that subject, and is refused otherwise."""
    origin: Text | None = None
    """The edge id (or client name) that sent the request."""
    route: RouteChoice = "auto"
    """Client override: let the edge's router decide, or force local / cloud."""
    routing: RouteDecision | None = None
    """The edge's decision, carried to the worker for its logs."""
    stream: bool = False
    """Edge entry only: stream events to the reply inbox instead of one complete answer."""
    raw: bool = False
    """``prompt`` is the model's whole input, with no chat template (``/v1/completions``)."""
    response_format: ResponseFormat | None = None
    """Constrain the answer to JSON (``json_object``) or to a JSON schema (``json_schema``)."""
    logprobs: bool = False
    """Return each token's log probability."""
    top_logprobs: int = Field(default=0, ge=0, le=20)
    """With ``logprobs``: this many most likely alternatives per token."""
    deferrable: bool = False
    """The request can wait (until its ``deadline``, which may be hours away) rather than be
    answered locally when the cloud is out of reach. An edge whose site runs its own JetStream
    holds it durably while the uplink is down and forwards it when the link returns; its answer
    is kept at the site, where the client can fetch it again by id."""
    cancel_key: Text | None = Field(default=None, min_length=8, max_length=128)
    """A secret of the sender's. When set, a cancel acts on this request only if it carries the
    same key, so only the sender can cancel. The SDK and the edge always set one."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("reply")
    @classmethod
    def _reply_is_subject(cls, value: str | None) -> str | None:
        if value is not None and not is_subject(value):
            raise ValueError("reply must be a literal NATS subject (no wildcards or spaces)")
        return value

    @model_validator(mode="after")
    def _has_prompt(self) -> InferRequest:
        if self.prompt is not None and self.messages is not None:
            raise ValueError("give either prompt or messages, not both")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("messages is empty")
            if not any(m.content.strip() for m in self.messages):
                raise ValueError("every message is empty")
        elif self.prompt is None or not self.prompt.strip():
            raise ValueError("missing prompt: give a non-empty prompt or messages")
        return self

    def chat(self) -> list[dict[str, str]]:
        """The conversation as OpenAI-style role/content dicts."""
        if self.messages is not None:
            return [{"role": m.role, "content": m.content} for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def text(self) -> str:
        """All user-visible text of the request, for routing and logging."""
        if self.messages is not None:
            return "\n".join(m.content for m in self.messages)
        return self.prompt or ""

    def turns(self) -> int:
        return len(self.messages) if self.messages is not None else 1

    def past_deadline(self, now: float | None = None) -> bool:
        """The deadline passed: nobody should work on the request any more."""
        now = time.time() if now is None else now
        return self.deadline is not None and now >= self.deadline

    def past_start_by(self, now: float | None = None) -> bool:
        """Its ``start_by`` passed: nobody may begin it now (an attempt that began in time may
        still be continued: the worker decides that)."""
        now = time.time() if now is None else now
        return self.start_by is not None and now >= self.start_by

    def is_expired(self, now: float | None = None) -> bool:
        """Too late to begin: the deadline or ``start_by`` passed."""
        return self.past_deadline(now) or self.past_start_by(now)


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Timings(_Wire):
    """Milliseconds, measured by whoever sends the message."""

    queue_ms: float | None = None
    """From publish to the start of generation (cloud only)."""
    ttft_ms: float | None = None
    """From the start of handling to the first token."""
    gen_ms: float | None = None
    """From the first token to the last."""
    total_ms: float | None = None
    tokens_per_s: float | None = None


LOGPROB_FLOOR = -9999.0
"""What a log probability that is not a finite number reads as (a token an engine's grammar
ruled out has minus infinity): JSON has no infinities, and OpenAI's API writes -9999.0 for a
token of no probability."""


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenLogprob(_Wire):
    """One engine token with its log probability and, if asked, the likeliest alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] | None = None

    @field_validator("logprob")
    @classmethod
    def _finite(cls, value: float) -> float:
        return finite_logprob(value)

    @field_validator("top")
    @classmethod
    def _finite_top(cls, top: list[tuple[str, float]] | None) -> list[tuple[str, float]] | None:
        if top is None or all(math.isfinite(p) for _t, p in top):
            return top
        return [(t, finite_logprob(p)) for t, p in top]


class TokenEvent(_Wire):
    t: Literal["tok"] = "tok"
    id: str
    seq: Count
    """Per-request message sequence, from 0; the end message continues it."""
    text: Text
    """One or several coalesced tokens."""
    attempt: int = Field(default=1, ge=1, le=WIRE_INT_MAX)
    """The attempt that produced this text: its delivery count (JetStream ``num_delivered``),
    or a number above any other attempt's (microseconds since the epoch) when another attempt
    may have been generating it unseen (see :mod:`protocol.stream`)."""
    n: Count = 1
    """Engine tokens in ``text`` (a continuation subtracts them from ``max_tokens``)."""
    logprobs: list[TokenLogprob] | None = None
    """One entry per engine token in ``text``, when the request asked for logprobs."""


_TOKEN_FIELDS_SET = frozenset(TokenEvent.model_fields)
_new = object.__new__
_set = object.__setattr__


def token_event(  # noqa: PLR0917 - the hot path takes plain values
    request_id: str,
    seq: int,
    text: str,
    attempt: int = 1,
    n: int = 1,
    logprobs: list[TokenLogprob] | None = None,
) -> TokenEvent:
    """A token event from values already known to be valid, without validation: what
    ``TokenEvent.model_construct`` makes, in a third of its time (0.75 against 2.4 us). One is
    made per message on each side of the relay. ``tests/test_protocol.py`` checks that the two
    are the same."""
    event = _new(TokenEvent)
    _set(
        event,
        "__dict__",
        {
            "t": "tok",
            "id": request_id,
            "seq": seq,
            "text": text,
            "attempt": attempt,
            "n": n,
            "logprobs": logprobs,
        },
    )
    _set(event, "__pydantic_fields_set__", set(_TOKEN_FIELDS_SET))
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    return event


class StartEvent(_Wire):
    """A delivery attempt begins. ``seq`` 0 starts the answer (over); ``seq`` k > 0 continues it
    after its first k positions, whose text has CRC-32 ``digest`` (see :mod:`protocol.stream`)."""

    t: Literal["start"] = "start"
    id: str
    attempt: int = Field(default=1, ge=1, le=WIRE_INT_MAX)
    seq: Count = 0
    digest: Count = 0
    node: Text = ""
    """Who generates this attempt (``cloud:<worker>`` or ``edge:<edge>``)."""
    req: str | None = None
    """Fingerprint of the request's content: a reader that sent other content under the same id
    learns it is not its answer."""
    reason: Text | None = None
    """Why this attempt began (``redelivered``, ``continued after a worker stopped``...)."""
    delivery: str | None = None
    """The queue delivery this attempt holds (its JetStream ack subject), set by a worker: when
    that worker dies, another reads it from the answer store to hand the delivery back at once
    rather than after ``ack_wait``. An edge does not pass it on to its clients."""


class _Outcome(_Wire):
    id: str
    finish_reason: str = "stop"
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    served_by: str = ""
    """Node id of whoever generated the text (``edge:<id>`` or ``cloud:<id>``)."""
    path: Path = "cloud"
    routing: RouteDecision | None = None
    fallback: str | None = None
    """Set when the router chose the cloud but the edge answered locally, and why."""


class EndEvent(_Outcome):
    t: Literal["end"] = "end"
    seq: Count
    """Positions in the answer: the end follows tok events 0 .. seq-1."""
    attempt: int = Field(default=1, ge=1, le=WIRE_INT_MAX)
    digest: Count | None = None
    """CRC-32 of the whole answer text (UTF-8): what a reader checks before it trusts the end."""


class Answer(_Outcome):
    """The single reply to a non-streaming edge request (what ``nats req`` prints)."""

    t: Literal["answer"] = "answer"
    text: Text
    digest: Count | None = None
    logprobs: list[TokenLogprob] | None = None
    """One entry per engine token of the answer, when the request asked for logprobs."""


class RestartEvent(_Wire):
    """What the SDK yields when an answer starts over: discard the text received so far.

    Not a wire event: on the wire, a ``start`` with ``seq`` 0 after text was passed on means it.
    """

    t: Literal["restart"] = "restart"
    id: str
    attempt: int = Field(ge=1)
    reason: str = "redelivered"


class ErrorEvent(_Wire):
    t: Literal["err"] = "err"
    id: str | None = None
    attempt: int | None = Field(default=None, ge=1, le=WIRE_INT_MAX)
    """The attempt that failed, when a worker failed it: readers ignore errors of attempts they
    have already seen replaced."""
    code: Text
    """A stable :class:`protocol.errors.ErrorCode` value (unknown codes are kept as strings)."""
    message: Text
    retryable: bool = False
    retry_after: float | None = None
    details: Annotated[list[dict[str, Any]] | None, WireTree] = None


Event = Annotated[
    StartEvent | TokenEvent | EndEvent | ErrorEvent | Answer,
    Field(discriminator="t"),
]
WireEvent = StartEvent | TokenEvent | EndEvent | ErrorEvent
"""What travels on a token subject or a streaming reply inbox."""
