"""A request's fingerprint: a short hash of what it asks (model, conversation, sampling), which
every node compares (an edge, the workers, the answer store, and nodes of other versions) to
tell the same question under the same id from another one."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from protocol.messages import InferRequest
from protocol.subjects import model_token


def request_fingerprint(request: InferRequest) -> str:
    """A short hash of what a request asks (model, conversation, sampling), not of who sent it or
    how it travels: the same question under the same id has the same fingerprint."""
    content = _asks(request)
    content["model"] = model_token(request.model) if request.model else None
    return hashlib.blake2b(_utf8(_json(content)), digest_size=8).hexdigest()


def _asks(request: InferRequest) -> dict[str, Any]:
    """What a request asks, but its model: what its fingerprint hashes."""
    return {
        "chat": request.chat(),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": request.stop,
        "seed": request.seed,
        "raw": request.raw,
        "format": request.response_format.model_dump() if request.response_format else None,
        "logprobs": [request.logprobs, request.top_logprobs],
    }


class Fingerprints:
    """:func:`request_fingerprint` of one request under any model, from one serialization and
    one hash of the rest of what it asks. An edge needs two: the client's request and the copy
    it queues, which names the pool's model where the client named none. With a long
    conversation the dump and the hash are nearly all the cost (32 KB of prompt: about
    175 us a fingerprint here); for one fingerprint :func:`request_fingerprint` is the faster."""

    def __init__(self, request: InferRequest) -> None:
        self._request: InferRequest | None = request
        self._head = hashlib.blake2b(digest_size=8)
        self._tail = b""
        self._of: dict[str | None, str] = {}

    def of(self, model: str | None) -> str:
        """The fingerprint of the request under ``model`` (None: under none). The first call
        serializes and hashes the request; each model's fingerprint is kept."""
        found = self._of.get(model)
        if found is not None:
            return found
        if self._request is not None:
            blob = _json(_asks(self._request))
            # The keys are sorted: "model" goes right before "raw". The last ',"raw":' is that
            # key: only strings (quotes escaped), numbers and nulls follow it.
            at = blob.rindex(',"raw":')
            self._head = hashlib.blake2b(_utf8(blob[:at] + ',"model":'), digest_size=8)
            self._tail = _utf8(blob[at:])
            self._request = None  # hashed: the request itself is not kept
        hashed = self._head.copy()  # the conversation is hashed once, whatever the model
        hashed.update(_utf8(_json(model_token(model) if model else None)))
        hashed.update(self._tail)
        fingerprint: str = hashed.hexdigest()
        self._of[model] = fingerprint
        return fingerprint

    def lazily(self, model: str | None) -> Callable[[], str]:
        """:meth:`of` ``model``, worked out when first called: a fingerprint that is compared
        only when something else turns up under the same id (an edge's record) or when the
        answer's ``start`` comes (``AnswerState``) is then not made on the way to the engine."""
        return functools.partial(self.of, model)


_ENCODER = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))
"""What ``json.dumps`` with these options builds on every call, built once."""


def _json(value: Any) -> str:
    """The one JSON spelling every fingerprint hashes (its parts too: they must join up)."""
    return _ENCODER.encode(value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")
