"""A request's fingerprint: a short hash of what it asks (model, conversation, sampling), which
every node compares (an edge, the workers, the answer store, and nodes of other versions) to
tell the same question under the same id from another one."""

from __future__ import annotations

import hashlib
import json
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
        blob = _json(_asks(request))
        # The keys are sorted: "model" goes right before "raw". The last ',"raw":' is that key:
        # only strings (quotes escaped), numbers and nulls follow it.
        at = blob.rindex(',"raw":')
        self._head = hashlib.blake2b(_utf8(blob[:at] + ',"model":'), digest_size=8)
        self._tail = _utf8(blob[at:])

    def of(self, model: str | None) -> str:
        """The fingerprint of the request under ``model`` (None: under none)."""
        hashed = self._head.copy()  # the conversation is hashed once, whatever the model
        hashed.update(_utf8(_json(model_token(model) if model else None)))
        hashed.update(self._tail)
        return hashed.hexdigest()


_ENCODER = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))
"""What ``json.dumps`` with these options builds on every call, built once."""


def _json(value: Any) -> str:
    """The one JSON spelling every fingerprint hashes (its parts too: they must join up)."""
    return _ENCODER.encode(value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")
