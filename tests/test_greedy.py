"""Repeatable requests on the real model (issue 22): ``temperature: 0``, or a seed, gives the
same text every time, whatever the model instance answered in between.

llama-cpp-python keeps the previous request's KV cache; the same prompt again was evaluated
differently (its last token alone), and "List the days of the week, numbered." came back
"...in order:\\n\\n1. Monday" fresh and "...week:\\nMonday, Monday" on each repeat. Every test
here repeats a request right after itself (the cache's exact-prompt case) and after another
request (its shared-prefix case).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from protocol.messages import InferRequest

DAYS = "List the days of the week, numbered."
OTHERS = ("Name three fruits.", "List the days of the week")  # the second: a shared prefix

pytestmark = pytest.mark.slow  # the real model, generating the same answers again and again


async def _text(backend: LlamaCppBackend, request: InferRequest) -> str:
    return "".join([chunk.text async for chunk in backend.generate(request)])


async def _repeated(backend: LlamaCppBackend, request: InferRequest) -> list[str]:
    """``request`` answered twice in a row, then once after each of the other prompts."""
    texts = [await _text(backend, request), await _text(backend, request)]
    for other in OTHERS:
        await _text(backend, request.model_copy(update={"prompt": other}))
        texts.append(await _text(backend, request))
    return texts


@pytest.fixture(params=["edge", "worker"])
def llama(
    request: pytest.FixtureRequest,
    edge_backend: LlamaCppBackend,
    worker_backend: LlamaCppBackend,
) -> LlamaCppBackend:
    """The edge's model, then the cloud worker's (each its own instance, as in the mesh)."""
    return edge_backend if request.param == "edge" else worker_backend


async def test_a_greedy_chat_answer_is_the_same_every_time(llama: LlamaCppBackend) -> None:
    texts = await _repeated(llama, InferRequest(prompt=DAYS, max_tokens=48, temperature=0))
    assert texts[0].strip()
    assert texts == [texts[0]] * len(texts)


async def test_a_greedy_raw_completion_is_the_same_every_time(
    edge_backend: LlamaCppBackend,
) -> None:
    request = InferRequest(
        prompt="The days of the week are", raw=True, max_tokens=32, temperature=0
    )
    texts = await _repeated(edge_backend, request)
    assert texts == [texts[0]] * len(texts)


async def test_a_seeded_sample_is_the_same_every_time(edge_backend: LlamaCppBackend) -> None:
    request = InferRequest(prompt=DAYS, max_tokens=32, temperature=0.8, seed=7)
    texts = await _repeated(edge_backend, request)
    assert texts == [texts[0]] * len(texts)


async def test_unrepeatable_requests_between_do_not_break_repeatability(
    edge_backend: LlamaCppBackend,
) -> None:
    """A sampled request reuses and rewrites the cache its own way; the greedy one after it
    must not build on what it left."""
    greedy = InferRequest(prompt=DAYS, max_tokens=48, temperature=0)
    first = await _text(edge_backend, greedy)
    await _text(edge_backend, greedy.model_copy(update={"temperature": 1.0}))
    assert await _text(edge_backend, greedy) == first
    await _text(edge_backend, greedy.model_copy(update={"prompt": DAYS[:-1], "temperature": 1}))
    assert await _text(edge_backend, greedy) == first


@pytest.fixture
async def api(
    settings: MeshSettings,
    conn: Connection,
    edge_backend: LlamaCppBackend,
    worker_backend: LlamaCppBackend,
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The edge's OpenAI API, the edge's own model local and a llama.cpp worker in the cloud."""
    settings.edge.http_port = 0
    async with (
        Worker(settings, conn, worker_backend),
        EdgeNode(settings, conn, edge_backend, HeuristicRouter()) as edge,
    ):
        assert edge.http is not None
        client = openai.AsyncOpenAI(base_url=f"{edge.http.url}/v1", api_key="unused")
        yield client
        await client.close()


@pytest.mark.parametrize("route", ["local", "cloud"])
async def test_greedy_answers_through_the_http_api_are_the_same_every_time(
    api: openai.AsyncOpenAI, route: str
) -> None:
    async def ask(content: str) -> str:
        answer = await api.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": content}],
            max_tokens=48,
            temperature=0,
            extra_body={"route": route},
        )
        assert answer.model_extra and answer.model_extra["mesh"]["path"] == route
        return answer.choices[0].message.content or ""

    texts = [await ask(DAYS), await ask(DAYS)]
    await ask(OTHERS[0])
    texts.append(await ask(DAYS))
    assert texts[0].strip()
    assert texts == [texts[0]] * len(texts)
