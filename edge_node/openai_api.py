"""The OpenAI API's request bodies (pydantic) and response shapes, for the edge's HTTP API.

Chat completions and (legacy) text completions, streamed or not, with ``logprobs``,
``response_format`` and ``stream_options.include_usage``. Fields the mesh cannot honour
(``tools``, ``logit_bias``, ``n`` > 1, ``echo``, ``suffix``, a non-zero penalty, ``best_of`` > 1)
are refused with a 400 naming the field, never silently ignored, as is a value of the wrong JSON
type (``true`` for a count, ``"yes"`` for a boolean); fields that do not change the answer
(``user``, ``metadata``...) are accepted. Two mesh extensions: ``route``
(``auto|local|cloud``) and the ``mesh`` object in every answer.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_validator,
)

from protocol.codec import invalid_request_error
from protocol.errors import InvalidRequestError
from protocol.messages import (
    EndEvent,
    InferRequest,
    ResponseFormat,
    RouteChoice,
    TokenLogprob,
)

Kind = Literal["chat", "completion"]
# Fields that would change the answer in ways the mesh does not support.
_REFUSED = ("tools", "functions", "function_call", "logit_bias", "suffix")
_NO_OP = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "tool_choice": "none"}
"""Fields refused unless they ask for nothing (the engines are given no such setting)."""


def _null_is(default: object) -> BeforeValidator:
    """A JSON ``null`` read as the field's default, as OpenAI reads one (clients and proxies send
    explicit nulls for optional fields)."""
    return BeforeValidator(lambda value: default if value is None else value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @model_validator(mode="before")
    @classmethod
    def _content(cls, data: Any) -> Any:
        """An assistant turn may have no content (OpenAI's ``null``, as after a tool call);
        a content part other than text is named as such, not as a failed union."""
        if not isinstance(data, dict):
            return data
        content = data.get("content")
        if content is None and data.get("role") == "assistant":
            return {**data, "content": ""}
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, not {kind!r}")
        return data

    def text(self) -> str:
        return (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)  # not "0.5", not true
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: Annotated[StrictBool, _null_is(False)] = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, _null_is(1)] = Field(default=1, ge=1, le=1)
    response_format: ResponseFormat | None = None
    route: RouteChoice | None = None
    """Mesh extension: force the local model or the cloud."""
    service_tier: str | None = None
    """``flex``: the request can wait for the cloud (a ``deferrable`` mesh request: held at an
    offline site until the uplink returns, its answer kept there for a retry under the same
    ``X-Request-Id``); an edge without a site refuses it. Other tiers change nothing here."""


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: Annotated[StrictBool, _null_is(False)] = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: Annotated[StrictBool, _null_is(False)] = False


def parse(kind: Kind, raw: dict[str, Any]) -> ChatBody | CompletionBody:
    """Validate an OpenAI request body; :class:`InvalidRequestError` names the bad field."""
    for name in _REFUSED:
        if raw.get(name):
            raise InvalidRequestError(
                f"{name!r} is not supported by this edge",
                details=[{"loc": name, "msg": "not supported"}],
            )
    for name, nothing in _NO_OP.items():
        if raw.get(name, nothing) not in (None, nothing):
            raise InvalidRequestError(
                f"{name!r} is not supported by this edge (only {nothing}, or none)",
                details=[{"loc": name, "msg": f"only {nothing}"}],
            )
    try:
        body = (ChatBody if kind == "chat" else CompletionBody).model_validate(raw)
    except ValidationError as exc:
        raise invalid_request_error(exc, None) from None
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed with 'stream': true",
            details=[{"loc": "stream_options", "msg": "needs stream"}],
        )
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError(
            "'top_logprobs' needs 'logprobs': true",
            details=[{"loc": "top_logprobs", "msg": "needs logprobs"}],
        )
    if isinstance(body, CompletionBody):
        if body.echo:
            raise InvalidRequestError(
                "'echo' is not supported by this edge",
                details=[{"loc": "echo", "msg": "not supported"}],
            )
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise InvalidRequestError(
                "give exactly one prompt", details=[{"loc": "prompt", "msg": "one prompt"}]
            )
    return body


def tokens_field(body: ChatBody | CompletionBody) -> str:
    """The name of the field that set the answer's length: a chat's ``max_completion_tokens``
    when given (it wins over ``max_tokens``), else ``max_tokens``."""
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def to_request(
    body: ChatBody | CompletionBody,
    *,
    model: str | None,
    route: RouteChoice,
    request_id: str | None,
) -> InferRequest:
    """The mesh request an OpenAI body stands for."""
    fields: dict[str, Any] = {
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop,
        "seed": body.seed,
        "stream": body.stream,
        "route": route,
        "model": model,
        "origin": "http",
        "id": request_id,
        "response_format": body.response_format,
        "deferrable": body.service_tier == "flex" or None,
    }
    if isinstance(body, ChatBody):
        fields["messages"] = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        fields["max_tokens"] = body.max_completion_tokens or body.max_tokens
        fields["logprobs"] = body.logprobs
        fields["top_logprobs"] = body.top_logprobs if body.logprobs else None
    else:
        fields["prompt"] = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        fields["raw"] = True
        fields["logprobs"] = body.logprobs is not None
        fields["top_logprobs"] = body.logprobs or None
    try:
        return InferRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        err = invalid_request_error(exc, None)
        named = tokens_field(body)  # the field the client set, not the mesh's name for it
        for detail in err.details or []:
            if detail.get("loc") == "max_tokens":
                detail["loc"] = named
                err.message = err.message.replace("max_tokens", named)
            elif detail.get("loc") == "request":  # the request as a whole: its text is empty
                detail["loc"] = "messages" if isinstance(body, ChatBody) else "prompt"
        raise err from None


# -- responses ----------------------------------------------------------------------------
def usage_of(end: EndEvent) -> dict[str, int]:
    usage = end.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def mesh_fields(end: EndEvent) -> dict[str, Any]:
    return end.model_dump(
        mode="json",
        include={"path", "served_by", "routing", "fallback", "timings"},
        exclude_none=True,
    )


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8", "surrogatepass")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))}
                    for t, lp in e.top or []
                ],
            }
            for e in entries
        ]
    }


def text_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) if e.top else None for e in entries],
        "text_offset": offsets,
    }


class Shaper:
    """Builds one request's OpenAI objects (chunks and the whole answer), chat or text."""

    def __init__(self, kind: Kind, request_id: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self._offset = 0

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def chunk(
        self,
        text: str | None,
        *,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.kind == "chat":
            delta: dict[str, str] = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
            choice["logprobs"] = chat_logprobs(logprobs) if logprobs else None
        else:
            choice["text"] = text or ""
            choice["logprobs"] = text_logprobs(logprobs, self._offset) if logprobs else None
            self._offset += len(text or "")
        return {
            "id": self.id,
            "object": self._object(chunk=True),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_chunk(self, end: EndEvent) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self._object(chunk=True),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_of(end),
        }

    def answer(
        self, text: str, end: EndEvent, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": end.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = chat_logprobs(logprobs) if logprobs is not None else None
        else:
            choice["text"] = text
            choice["logprobs"] = text_logprobs(logprobs, 0) if logprobs is not None else None
        return {
            "id": self.id,
            "object": self._object(chunk=False),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_of(end),
            "mesh": mesh_fields(end),
        }
