"""The edge's front door, as a newcomer meets it: every HTTP route answers OpenAI's error shape,
text that is not Unicode is refused at once as ``invalid_request`` (HTTP, ``nats req``, the
protocol models every door shares), ``service_tier: "flex"`` is refused where no site keeps its
answers, and ``X-Request-Id`` names an ordinary request without joining it to another."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from pydantic import ValidationError

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.codec import decode_request
from protocol.errors import InvalidRequestError
from protocol.messages import InferRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONE = "\ud800"
"""A lone surrogate: what JSON ``"\\ud800"`` decodes to; not Unicode text."""
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def deterministic(name: str = "smollm2") -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", name=name, slots=2))


@pytest.fixture
async def door(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    settings.edge.http_port = 0
    async with EdgeNode(settings, conn, deterministic(), HeuristicRouter()) as edge:
        yield edge


@pytest.fixture
async def web(door: EdgeNode) -> AsyncIterator[aiohttp.ClientSession]:
    assert door.http is not None
    async with aiohttp.ClientSession(
        base_url=door.http.url, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        yield session


def chat(content: str = "[tag:d] hi", **extra: object) -> dict[str, object]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **extra,
    }


async def openai_error(resp: aiohttp.ClientResponse) -> dict[str, object]:
    """The ``error`` object of an OpenAI-shaped error response (JSON, with OpenAI's keys)."""
    assert resp.content_type == "application/json", await resp.text()
    error = (await resp.json())["error"]
    assert set(error) >= OPENAI_ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


# -- every route answers OpenAI's error shape ------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/embeddings", 404),
        ("GET", "/v2/models", 404),
        ("GET", "/", 404),
        ("GET", CHAT, 405),
        ("PUT", COMPLETIONS, 405),
        ("DELETE", "/v1/models", 405),
    ],
)
async def test_unknown_routes_and_wrong_methods_answer_openai_errors(
    web: aiohttp.ClientSession, method: str, path: str, status: int
) -> None:
    async with web.request(method, path, json={"input": "hi"}) as resp:
        assert resp.status == status
        error = await openai_error(resp)
        if status == 405:
            assert resp.headers["Allow"]  # what the route does take
    assert error["code"] == error["type"] == "invalid_request"
    assert error["param"] is None
    assert method in str(error["message"]) and path in str(error["message"])


async def test_a_model_is_retrieved_as_openai_does(
    web: aiohttp.ClientSession, settings: MeshSettings, conn: Connection
) -> None:
    async with web.get("/v1/models") as resp:
        listed = {m["id"]: m for m in (await resp.json())["data"]}
    async with web.get("/v1/models/smollm2") as resp:
        assert resp.status == 200
        model = await resp.json()
    assert model == listed["smollm2"]
    assert model["object"] == "model" and isinstance(model["created"], int)
    async with web.get("/v1/models/gpt-9-ultra") as resp:
        assert resp.status == 404
        error = await openai_error(resp)
    assert error["code"] == "unknown_model" and error["param"] == "model"
    assert "gpt-9-ultra" in str(error["message"])
    # A model a worker pool serves is reachable through this edge: it is a model here too.
    async with (
        Worker(settings, conn, deterministic("cloudy")),
        web.get("/v1/models/cloudy") as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {**model, "id": "cloudy", "owned_by": "cloud"}


# -- text that is not Unicode is refused at the door ---------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat(f"hi {LONE}"), "messages.0.content"),
        (
            CHAT,
            chat(messages=[{"role": "system", "content": LONE}, {"role": "user", "content": "hi"}]),
            "messages.0.content",
        ),
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
            "messages.0.content",
        ),
        (CHAT, chat(stop=["ok", f"x{LONE}"]), "stop.1"),
        (COMPLETIONS, {"model": "smollm2", "prompt": f"{LONE}hi", "max_tokens": 4}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "stop": LONE, "max_tokens": 4}, "stop.0"),
    ],
    ids=["chat", "system", "content-part", "stop", "completion", "completion-stop"],
)
async def test_a_lone_surrogate_is_refused_at_once_over_http(
    web: aiohttp.ClientSession, path: str, body: dict[str, object], param: str | None
) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as JSON "\ud800"
    assert b"\\ud800" in raw
    began = time.monotonic()
    async with web.post(path, data=raw, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = await openai_error(resp)
    assert time.monotonic() - began < 2  # refused, not failed by the engine seconds later
    assert error["code"] == "invalid_request" and "Unicode" in str(error["message"])
    if param is not None:
        assert error["param"] == param


async def test_unicode_text_beyond_ascii_is_answered(web: aiohttp.ClientSession) -> None:
    async with web.post(CHAT, json=chat("[tag:d] héllo 世界 🙂")) as resp:
        assert resp.status == 200
        answer = await resp.json()
    assert answer["choices"][0]["message"]["content"] == Script(tag="d").answer(4)


def test_the_protocol_refuses_lone_surrogates_in_any_text_a_request_carries() -> None:
    """One rule in protocol.messages, shared by the HTTP API, the NATS endpoint, the SDK and the
    worker's queue intake: text that cannot be written as UTF-8 is not a request."""
    good = {"prompt": "hi"}
    bad_ones = {
        "prompt": {"prompt": LONE},
        "messages.0.content": {"messages": [{"role": "user", "content": f"a{LONE}"}]},
        "stop.0": {**good, "stop": LONE},
        "id": {**good, "id": LONE},
        "model": {**good, "model": f"m{LONE}"},
        "origin": {**good, "origin": LONE},
        "cancel_key": {**good, "cancel_key": f"12345678{LONE}"},
        "reply": {**good, "reply": f"_INBOX.{LONE}"},
        "response_format.json_schema": {
            **good,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {LONE: 1}}},
        },
    }
    for loc, fields in bad_ones.items():
        with pytest.raises(ValidationError) as excinfo:
            InferRequest.model_validate(fields)
        assert [".".join(map(str, e["loc"])) for e in excinfo.value.errors()] == [loc]
        assert "lone surrogate U+D800" in str(excinfo.value)
        with pytest.raises(InvalidRequestError) as refused:  # what a worker's intake decodes
            decode_request(json.dumps(fields).encode())
        assert refused.value.details and refused.value.details[0]["loc"] == loc
    assert InferRequest(prompt="héllo 世界 🙂", stop=["∎"]).prompt == "héllo 世界 🙂"


# -- flex needs a site -----------------------------------------------------------------------
async def test_flex_without_a_site_is_refused_saying_what_it_needs(
    web: aiohttp.ClientSession, door: EdgeNode
) -> None:
    assert door.site is None  # what `mesh up` runs
    headers = {"X-Request-Id": "flex-1"}
    async with web.post(CHAT, json=chat(service_tier="flex"), headers=headers) as resp:
        assert resp.status == 400
        error = await openai_error(resp)
    assert error["code"] == "invalid_request" and error["param"] == "service_tier"
    assert "MESH_NATS_HUB_DOMAIN" in str(error["message"])
    # Any other tier changes nothing, as before.
    async with web.post(CHAT, json=chat(service_tier="default"), headers=headers) as resp:
        assert resp.status == 200


async def test_x_request_id_names_an_ordinary_request_and_joins_nothing(
    web: aiohttp.ClientSession, door: EdgeNode
) -> None:
    """For an ordinary HTTP request, ``X-Request-Id`` (a token: letters, digits, ``_``, ``-``)
    becomes the request's id: the answer's ``id``, its ``X-Request-Id`` header, the logs. Each
    HTTP request is answered on its own: the same id again is generated again, other content
    under it is answered too (no ``duplicate``). Anything else in the header is replaced."""
    headers = {"X-Request-Id": "my-app-42"}
    for content in ("[tag:x] hi", "[tag:x] hi", "[tag:y] other"):
        async with web.post(CHAT, json=chat(content), headers=headers) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["id"] == "chatcmpl-my-app-42" and resp.headers["X-Request-Id"] == "my-app-42"
        assert answer["choices"][0]["message"]["content"] == Script(tag=content[5]).answer(4)
    async with web.post(CHAT, json=chat(), headers={"X-Request-Id": "not a token!"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] != "not a token!"
