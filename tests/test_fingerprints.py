"""A request's fingerprint is what every node compares (an edge, the workers, the answer store,
nodes of other versions): computed once and given under another model (``Fingerprints``), it is
byte for byte the hash the one-dump definition gives, whatever the request holds."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from protocol.fingerprint import Fingerprints, request_fingerprint
from protocol.messages import InferRequest
from protocol.subjects import model_token


def _defined(request: InferRequest) -> str:
    """The fingerprint as defined: every field in one sorted JSON dump, hashed."""
    content = {
        "model": model_token(request.model) if request.model else None,
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
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


_SCHEMA = {
    "name": "raw",
    "schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},  # then ',"raw":' is inside the format too
            "raw": {"type": "string", "description": ',"raw":true,"model":"x"'},
        },
    },
}
REQUESTS: list[dict[str, Any]] = [
    {"prompt": "What is 2+2?"},
    {"prompt": "hi", "model": "smollm2"},
    {"prompt": "hi", "model": "Org/Some-Model:Q4"},
    {"prompt": 'quotes " and ,"raw":true and \\ and ünïcödé ✓ \U0001f600', "raw": True},
    {"prompt": "stops", "stop": [',"raw":false', '"', "\n"]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": '{"raw": true, "model": null}'},
            {"role": "assistant", "content": ""},
        ],
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 7,
        "max_tokens": 3,
    },
    {"prompt": "json", "response_format": {"type": "json_object"}},
    {"prompt": "schema", "response_format": {"type": "json_schema", "json_schema": _SCHEMA}},
    {"prompt": "lp", "logprobs": True, "top_logprobs": 3},
    {"prompt": "x" * 40_000},
]


@pytest.mark.parametrize("fields", REQUESTS)
def test_a_fingerprint_is_the_defined_hash_under_any_model(fields: dict[str, Any]) -> None:
    request = InferRequest.model_validate({"id": "r1", **fields})
    assert request_fingerprint(request) == _defined(request)
    prints = Fingerprints(request)
    for model in (None, "smollm2", "other/Model-7B", "模型"):
        queued = request.model_copy(update={"model": model})
        assert prints.of(model) == _defined(queued) == request_fingerprint(queued)


def test_what_a_request_asks_changes_its_fingerprint_and_who_sent_it_does_not() -> None:
    base = InferRequest(id="r1", prompt="hi")
    assert request_fingerprint(base) != request_fingerprint(base.model_copy(update={"seed": 1}))
    assert request_fingerprint(base) != request_fingerprint(base.model_copy(update={"raw": True}))
    assert request_fingerprint(base) != Fingerprints(base).of("smollm2")
    assert request_fingerprint(base) == request_fingerprint(
        base.model_copy(update={"id": "r2", "origin": "edge-7", "stream": False})
    )
