"""The edge's choice of where to answer, at its edges: a chat of many short turns that fits the
local context, a cloud engine failing after the first tokens of an escalated answer, a forced
local route naming a model no pool serves, and (left open) a prompt the estimate undercounts.
Each "Before the fix" test failed on the code before it (review S20c); each docstring says what
a client saw before the fix and sees now.

Real nats-server per test, the real SmolLM2 GGUF (a 256-token context, as test_routing_edges
loads it: prompts of a couple of hundred tokens reach its end) where the local model's own
token count matters, the deterministic backend elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import aiohttp

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.relay import estimate_prompt_tokens
from edge_node.router import HeuristicRouter
from edge_node.routing import create_router
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import ConfidenceSettings, MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.errors import MeshError
from protocol.messages import InferRequest
from tests.test_routing_edges import SMALL_CTX, small_llama  # noqa: F401 - a fixture


class LocalEngine(DeterministicBackend):
    """The edge's engine: tag ``L`` whatever the prompt says, fault directives ignored."""

    def __init__(self, slots: int = 1, name: str = "local-tiny") -> None:
        super().__init__(
            ModelSettings(backend="deterministic", name=name, slots=slots, faults=False)
        )

    def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if request.messages is None:
            update: dict[str, object] = {"prompt": f"{request.prompt} [tag:L]"}
        else:
            *head, last = request.chat()
            update = {"messages": [*head, {**last, "content": f"{last['content']} [tag:L]"}]}
        retagged = InferRequest.model_validate({**request.model_dump(), **update})
        return super().generate(retagged, prefix=prefix, prefix_tokens=prefix_tokens)


def det(name: str = "smollm2", faults: bool = True) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", name=name, slots=2, faults=faults)
    )


def cascade_settings(settings: MeshSettings, **confidence: object) -> MeshSettings:
    settings.edge.router.kind = "heuristic"
    settings.edge.router.threshold = 1.0  # the router keeps everything local
    settings.edge.router.confidence = ConfidenceSettings(enabled=True, **confidence)  # type: ignore[arg-type]
    return settings


def client_of(settings: MeshSettings, conn: Connection) -> MeshClient:
    return MeshClient(settings=settings, connection=conn, first_event_timeout=30, idle_timeout=30)


# -- 1. first rule (truncated): the prompt estimate is under, and the answer is cut short -------
# Before the fix. paths._not_routed keeps a prompt local only when the local context leaves
# room for its whole max_tokens (<= ANSWER_ROOM), but reads the prompt's size from
# relay.estimate_prompt_tokens (3 characters a token). Digits apart are 2 characters a token,
# and llama.cpp said so only for a prompt that did not fit at all: a prompt that fit but left
# less than max_tokens had its max_tokens silently shortened (llama-cpp-python trims it to the
# room left), and the client got a short answer ending `finish_reason: length`, as if it had
# asked for that many, while the cloud was there to answer. Now the local model counts the
# prompt and refuses it (context_too_long) when it leaves less than min(max_tokens,
# ANSWER_ROOM), and the edge escalates.
DIGITS = "Repeat: " + "7 " * 100  # estimated ~85 tokens; the bundled model counts 233


async def test_a_prompt_of_digits_the_estimate_undercounts_is_not_answered_cut_short(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Before the fix: path local, 23 of the 40 tokens asked for, finish_reason "length" (the
    context's end, not max_tokens). Now the cloud answers: the prompt leaves the local model
    too little room."""
    settings.edge.model.n_ctx = SMALL_CTX  # what the edge's check reads
    asked = 40
    assert estimate_prompt_tokens(InferRequest(prompt=DIGITS)) + asked + 64 < SMALL_CTX
    async with (
        Worker(settings, conn, det()),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        client_of(settings, conn) as client,
    ):
        got = await client.complete(DIGITS, max_tokens=asked, temperature=0.0)
    end = got.end
    cut = end.path == "local" and end.finish_reason == "length"
    assert not (cut and end.usage.completion_tokens < asked), (
        f"asked {asked} tokens; the local model gave {end.usage.completion_tokens} and said "
        f"'length' (prompt: {end.usage.prompt_tokens} tokens, context {SMALL_CTX}; routing: "
        f"{end.routing.reason if end.routing else None})"
    )


async def test_a_prompt_leaving_too_little_room_with_no_cloud_is_still_answered_locally(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """The local model's count sends such a prompt to the cloud only where the cloud can take
    it: with no pool serving, the edge still answers what fits (its end's `fallback` says why),
    and a client that insists on route=local gets what fits, not `context_too_long`."""
    settings.edge.model.n_ctx = SMALL_CTX
    async with (
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        client_of(settings, conn) as client,
    ):
        got = await client.complete(DIGITS, max_tokens=40, temperature=0.0)
        forced = await client.complete(DIGITS, max_tokens=40, temperature=0.0, route="local")
    assert got.end.path == "local" and got.end.fallback, got.end
    assert got.text and got.end.usage.completion_tokens > 0
    assert forced.end.path == "local" and forced.text


# -- 2. first rule (availability): many short turns, no cloud: refused though they fit --------
# Before the fix. estimate_prompt_tokens adds 16 tokens a turn for the chat template; the
# bundled model's template costs ~6 (<|im_start|>, role, newline, <|im_end|>, newline). A long
# conversation of short turns reads ~2.5x its size: past 2 * n_ctx, paths._clearly_too_long says
# the local model cannot take it, _cloud_chain sets local_fits=False, and with the cloud unable
# to serve the client gets `unavailable` "... and it is too long for the local model". At the
# default n_ctx 2048 that is any chat of ~241+ short turns (real ~1,550 tokens). The same edge
# answers the same request at once with route=local. (The same shape as
# test_routing_regressions' Cyrillic case, through the per-turn term instead of the bytes.)
TURNS = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(31)
]  # estimated 526 tokens (> 2 * 256); the bundled model counts 226


async def test_a_long_chat_of_short_turns_that_fits_is_answered_when_the_cloud_cannot(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Before the fix: no pool serves the cloud model, and the client got UNAVAILABLE "the
    cloud cannot serve this request (...), and it is too long for the local model". Now: the
    local model answers (it does, with route=local: the prompt is 226 tokens of a 256 context)."""
    settings.edge.model.n_ctx = SMALL_CTX
    assert estimate_prompt_tokens(InferRequest(messages=TURNS)) > 2 * SMALL_CTX
    async with (
        EdgeNode(settings, conn, small_llama, HeuristicRouter()),
        client_of(settings, conn) as client,
    ):
        forced = await client.complete(messages=TURNS, max_tokens=4, temperature=0.0, route="local")
        assert forced.end.path == "local" and forced.end.usage.prompt_tokens < SMALL_CTX - 4
        try:
            got = await client.complete(messages=TURNS, max_tokens=4, temperature=0.0)
        except MeshError as err:
            raise AssertionError(f"refused: {err.code.value}: {err.message}") from None
    assert got.end.path == "local" and got.text == forced.text


# -- 3. heal: an escalation whose cloud engine fails mid-answer ends in an error -------------
# Before the fix (heal). docs/router.md: "If the cloud cannot take it, the local
# model answers afresh". relay._follow turns a cloud ErrorEvent in FALLBACK_CODES
# (backend_error, max_deliveries, ...) into the local fallback only while no token went out
# (`positions == 0`); once the cloud's first tokens reached the client, the error is passed on.
# Yet the same relay falls back locally after tokens went out when the worker says its engine
# stands still (`stalled`), goes idle, or is not continued, with a restart that NATS clients and
# whole HTTP answers take. Here the router kept the request local, the local model began it
# (unsure: escalated), and the cloud's engine fails after 2 tokens on every delivery.
async def test_an_escalated_answer_whose_cloud_engine_fails_mid_answer_is_answered_locally(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before the fix: the SDK client (and an HTTP client, non-streaming: 502) got
    `max_deliveries` (retryable: false) after 3 deliveries, while the local model it started
    on sat idle. Now: the local answer, afresh, as for every other cloud failure (one restart
    over NATS; whole over HTTP)."""
    cascade_settings(settings, window_tokens=3)
    settings.edge.http_port = 0
    local = LocalEngine()
    prompt = "[unsure] [fail-after:2] q"
    async with (
        Worker(settings, conn, det()),
        EdgeNode(settings, conn, local, create_router(settings.edge.router)) as edge,
        client_of(settings, conn) as client,
    ):
        try:
            got = await client.complete(prompt, max_tokens=6)
        except MeshError as err:
            raise AssertionError(f"SDK: {err.code.value}: {err.message}") from None
        assert got.text == Script(tag="L").answer(6) and got.end.path == "local"
        assert edge.http is not None
        async with aiohttp.ClientSession(base_url=edge.http.url) as http:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6}
            async with http.post("/v1/chat/completions", json=body) as resp:
                answer = json.loads(await resp.text())
                assert resp.status == 200, answer
    assert answer["choices"][0]["message"]["content"] == Script(tag="L").answer(6)


# -- 4. minor (consistency): route=local naming a model nobody serves, NATS vs HTTP -----------
# Before the fix (minor). docs/http-api.md: "with `local` the edge's model answers under its own
# name, whatever `model` named", and over HTTP it does. Over NATS (SDK, `nats req`)
# paths.answer checks the named model first: a deployed one is answered locally (as over HTTP),
# one no pool serves is refused `unknown_model`: the same forced-local request answers or fails
# by the state of a cloud pool it does not use.
async def test_route_local_answers_whatever_model_is_named_over_nats_as_over_http(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before the fix: over HTTP 200 with the local answer; over NATS UNKNOWN_MODEL "no worker
    pool serves model 'nobody'". Now: the same answer both ways."""
    settings.edge.http_port = 0
    async with (
        EdgeNode(settings, conn, det("local-tiny", faults=False), HeuristicRouter()) as edge,
        client_of(settings, conn) as client,
    ):
        assert edge.http is not None
        async with aiohttp.ClientSession(base_url=edge.http.url) as http:
            body = {
                "model": "nobody",
                "route": "local",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            }
            async with http.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                over_http = (await resp.json())["choices"][0]["message"]["content"]
        try:
            got = await client.complete("hi", max_tokens=3, model="nobody", route="local")
        except MeshError as err:
            raise AssertionError(
                f"HTTP answered {over_http!r}; NATS: {err.code.value}: {err.message}"
            ) from None
    assert got.text == over_http and got.end.path == "local"
