"""The edge's OpenAI API, driven by the official `openai` client: chat and text completions,
streamed and not, logprobs, response_format (JSON, JSON schema) and stream usage, on the local
path and through the cloud (in-process and OpenAI-HTTP workers); bad bodies get OpenAI-shaped
400s. The deterministic backend makes every text and logprob exact."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend, Script, token_logprob
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection

PROMPT = "[tag:oa] say something"
WANT = Script(tag="oa").answer(6)


def deterministic(**kw: object) -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", slots=4, **kw))  # type: ignore[arg-type]


@pytest.fixture
async def api_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    settings.edge.http_port = 0
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, deterministic(), HeuristicRouter()) as edge,
    ):
        yield edge


@pytest.fixture
async def oai(api_edge: EdgeNode) -> AsyncIterator[openai.AsyncOpenAI]:
    assert api_edge.http is not None
    client = openai.AsyncOpenAI(base_url=f"{api_edge.http.url}/v1", api_key="unused")
    yield client
    await client.close()


@pytest.mark.parametrize("route", ["local", "cloud"])
async def test_chat_completions_streamed_and_not(oai: openai.AsyncOpenAI, route: str) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    answer = await oai.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=6,
        extra_body={"route": route},  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content == WANT
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    assert answer.model_extra and answer.model_extra["mesh"]["path"] == route
    stream = await oai.chat.completions.create(
        model="smollm2",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"route": route},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WANT
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("route", ["local", "cloud"])
async def test_text_completions_take_a_raw_prompt(oai: openai.AsyncOpenAI, route: str) -> None:
    answer = await oai.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, extra_body={"route": route}
    )
    assert answer.object == "text_completion" and answer.choices[0].text == WANT
    stream = await oai.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, stream=True, extra_body={"route": route}
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == WANT


@pytest.mark.parametrize("route", ["local", "cloud"])
async def test_logprobs_come_through_on_both_paths(oai: openai.AsyncOpenAI, route: str) -> None:
    want = [token_logprob(Script(tag="oa").token(i), i, 2) for i in range(6)]
    answer = await oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
        extra_body={"route": route},
    )
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(c.token, c.logprob) for c in content] == [(w.token, w.logprob) for w in want]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        w.top for w in want
    ]
    text = await oai.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, logprobs=2, extra_body={"route": route}
    )
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs == [w.logprob for w in want]
    assert logprobs.text_offset == [sum(len(w.token) for w in want[:i]) for i in range(6)]


async def test_bad_bodies_get_openai_shaped_400s(api_edge: EdgeNode) -> None:
    assert api_edge.http is not None
    url = api_edge.http.url
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
        ("/v1/chat/completions", {"messages": []}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
        ),
        ("/v1/completions", {"prompt": "x", "echo": True}),
        ("/v1/completions", {"prompt": ["a", "b"]}),
    ]
    async with aiohttp.ClientSession() as http:
        for path, body in cases:
            async with http.post(url + path, json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400, (body, error)
                assert error["code"] == "invalid_request" and error["message"], error
        async with http.post(url + "/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "bad_payload"


async def test_explicit_nulls_read_as_the_field_s_default(oai: openai.AsyncOpenAI) -> None:
    """OpenAI reads ``null`` in an optional field as absent, and clients and proxies send it;
    before, each of these was a 400 (``n: Input should be a valid integer``...)."""
    user = {"role": "user", "content": PROMPT}
    for nulls in ({"n": None}, {"logprobs": None}, {"stream": None}, {"top_logprobs": None}):
        answer = await oai.chat.completions.create(
            model="smollm2", messages=[user], max_tokens=6, **nulls
        )
        assert answer.choices[0].message.content == WANT, nulls
    turns = [user, {"role": "assistant", "content": None}, user]  # as after a tool call
    answer = await oai.chat.completions.create(model="smollm2", messages=turns, max_tokens=6)
    assert answer.choices[0].message.content == WANT
    text = await oai.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, echo=None, n=None, logprobs=None
    )
    assert text.choices[0].text == WANT


async def test_content_a_turn_cannot_have_is_named_in_its_400(api_edge: EdgeNode) -> None:
    assert api_edge.http is not None
    url = f"{api_edge.http.url}/v1/chat/completions"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases = [
        ([{"role": "user", "content": None}], "messages.0.content"),  # only an assistant's
        ([{"role": "user", "content": [image]}], "only text content parts are supported"),
    ]
    async with aiohttp.ClientSession() as http:
        for messages, named in cases:
            async with http.post(url, json={"messages": messages}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["code"] == "invalid_request", error
                assert named in json.dumps(error), error


async def test_a_400_names_the_field_the_client_set(api_edge: EdgeNode) -> None:
    """A length past the edge's limit set by ``max_completion_tokens`` was refused naming
    ``max_tokens``, a field the client never sent; ``top_logprobs`` without ``logprobs`` and
    ``stream_options`` without ``stream`` were ignored (OpenAI's API refuses both)."""
    assert api_edge.http is not None
    url = f"{api_edge.http.url}/v1/chat/completions"
    user = [{"role": "user", "content": PROMPT}]
    cases = [
        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
        ({"max_completion_tokens": 5_000}, "max_completion_tokens"),  # past the edge's 4,096
        ({"max_tokens": 5_000}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ]
    async with aiohttp.ClientSession() as http:
        for fields, named in cases:
            async with http.post(url, json={"messages": user, **fields}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["code"] == "invalid_request", (fields, error)
                assert named in error["message"], (fields, error)
                if named != "max_tokens":
                    assert "max_tokens" not in error["message"], (fields, error)


async def test_an_error_echoes_the_request_s_id_as_an_answer_does(api_edge: EdgeNode) -> None:
    """docs/http-api.md: the ``X-Request-Id`` sent is the response's; before, only answers had
    it, and a failed request could not be found in the edge's log by it."""
    assert api_edge.http is not None
    url = f"{api_edge.http.url}/v1/chat/completions"
    turn = [{"role": "user", "content": PROMPT}]
    cases = [
        ({"model": "smollm2", "messages": turn, "max_tokens": 2}, 200),
        ({"model": "nope", "messages": turn, "max_tokens": 2}, 404),
        ({"model": "nope", "messages": turn, "max_tokens": 2, "stream": True}, 404),
        ({"model": "smollm2", "messages": [], "max_tokens": 2}, 400),
    ]
    async with aiohttp.ClientSession() as http:
        for n, (body, status) in enumerate(cases):
            sent = f"my-id-{n}"
            async with http.post(url, json=body, headers={"X-Request-Id": sent}) as resp:
                assert resp.status == status, await resp.text()
                assert resp.headers.get("X-Request-Id") == sent, (body, dict(resp.headers))


async def test_logprobs_from_a_model_loaded_without_them_is_a_typed_400(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> None:
    settings.edge.http_port = 0
    async with EdgeNode(settings, conn, edge_backend, HeuristicRouter()) as edge:
        assert edge.http is not None
        client = openai.AsyncOpenAI(base_url=f"{edge.http.url}/v1", api_key="unused")
        with pytest.raises(openai.BadRequestError) as excinfo:
            await client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                logprobs=True,
                extra_body={"route": "local"},
            )
        await client.close()
    assert "loaded without logprobs" in str(excinfo.value)


async def test_json_from_the_real_model_follows_the_response_format(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> None:
    settings.edge.http_port = 0
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    async with EdgeNode(settings, conn, edge_backend, HeuristicRouter()) as edge:
        assert edge.http is not None
        client = openai.AsyncOpenAI(base_url=f"{edge.http.url}/v1", api_key="unused")
        ask = {
            "role": "user",
            "content": 'Is water wet? Reply only with {"answer": "yes"} or {"answer": "no"}.',
        }
        as_object = await client.chat.completions.create(
            model="smollm2",
            messages=[ask],  # type: ignore[list-item]
            max_tokens=64,
            temperature=0,
            response_format={"type": "json_object"},
            extra_body={"route": "local"},
        )
        as_schema = await client.chat.completions.create(
            model="smollm2",
            messages=[ask],  # type: ignore[list-item]
            max_tokens=48,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": schema},
            },
            extra_body={"route": "local"},
        )
        raw = await client.completions.create(
            model="smollm2",
            prompt="A JSON object saying whether water is wet:",
            max_tokens=48,
            temperature=0,
            extra_body={
                "route": "local",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "verdict", "schema": schema},
                },
            },
        )
        await client.close()
    assert as_object.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(as_object.choices[0].message.content or ""), dict)
    verdict = json.loads(as_schema.choices[0].message.content or "")
    assert isinstance(verdict["ok"], bool) and set(verdict) == {"ok"}
    assert set(json.loads(raw.choices[0].text)) == {"ok"}


async def test_an_openai_http_worker_serves_raw_prompts_and_logprobs(
    settings: MeshSettings, conn: Connection
) -> None:
    """Through the worker's OpenAI-HTTP backend (the official client) to a server."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh.testing.openai_server", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        port = int((await asyncio.wait_for(proc.stdout.readline(), 30)).split()[-1])
        backend = OpenAIHTTPBackend(
            ModelSettings(backend="openai", base_url=f"http://127.0.0.1:{port}/v1", slots=2)
        )
        await backend.start()
        settings.edge.http_port = 0
        async with (
            Worker(settings, conn, backend),
            EdgeNode(settings, conn, deterministic(), HeuristicRouter()) as edge,
        ):
            assert edge.http is not None
            client = openai.AsyncOpenAI(base_url=f"{edge.http.url}/v1", api_key="unused")
            text = await client.completions.create(
                model="smollm2",
                prompt=PROMPT,
                max_tokens=6,
                logprobs=1,
                extra_body={"route": "cloud"},
            )
            chat = await client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=6,
                logprobs=True,
                extra_body={"route": "cloud"},
            )
            await client.close()
        await backend.close()
    finally:
        proc.kill()
        await proc.wait()
    assert text.choices[0].text == WANT
    assert text.choices[0].logprobs is not None
    assert text.choices[0].logprobs.token_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    assert chat.choices[0].message.content == WANT
    assert [c.logprob for c in chat.choices[0].logprobs.content] == [  # type: ignore[union-attr]
        -0.1,
        -0.2,
        -0.3,
        -0.4,
        -0.5,
        -0.6,
    ]


def test_flex_service_tier_is_a_request_that_can_wait() -> None:
    from edge_node.openai_api import parse, to_request

    body = {"messages": [{"role": "user", "content": "hi"}], "service_tier": "flex"}
    flex = to_request(parse("chat", body), model=None, route="cloud", request_id=None)
    assert flex.deferrable is True
    body["service_tier"] = "default"
    plain = to_request(parse("chat", body), model=None, route="cloud", request_id=None)
    assert plain.deferrable is False


async def test_the_openai_client_retrieves_models_and_reads_every_error(
    oai: openai.AsyncOpenAI,
) -> None:
    """``models.retrieve`` as OpenAI has it; an unknown model and an endpoint the edge lacks
    come back as the client's typed errors, with the mesh's code."""
    listed = [m.id for m in (await oai.models.list()).data]
    model = await oai.models.retrieve("smollm2")
    assert model.id in listed and model.object == "model" and model.created > 0
    with pytest.raises(openai.NotFoundError) as unknown:
        await oai.models.retrieve("gpt-9-ultra")
    assert unknown.value.code == "unknown_model" and "gpt-9-ultra" in unknown.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.embeddings.create(model="smollm2", input="hi")
    assert missing.value.code == "invalid_request"
    assert "POST /v1/embeddings" in missing.value.message
