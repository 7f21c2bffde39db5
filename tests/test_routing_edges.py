"""The edge's routing at its edges (router.py, paths.py, relay.py's estimate): what decides a
request's path when the router does not, and what the router costs. Each test failed on the
code before its fix (review S17c); each docstring says what a client saw then ("Before:")."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings, load_settings
from mesh.connection import Connection
from protocol.errors import MeshError

SMALL_CTX = 256


def _det(name: str, slots: int = 2, token_ms: int = 0) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(
            backend="deterministic", name=name, slots=slots, token_delay_ms=token_ms, faults=False
        )
    )


@pytest.fixture(scope="module")
async def small_llama() -> AsyncIterator[LlamaCppBackend]:
    """The bundled GGUF loaded with a 256-token context, as a small edge device would run it
    (cheap: prompts of a couple of hundred tokens are enough to reach its end)."""
    model = load_settings(environ={}).edge.model.model_copy(update={"n_ctx": SMALL_CTX})
    backend = LlamaCppBackend(model)
    await backend.start()
    yield backend
    await backend.close()


# -- 1. a request naming a cloud model is answered by the local model (NATS/SDK entry) --------
async def test_a_request_naming_a_cloud_model_is_not_answered_by_the_local_model(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (first rule: foreign answer). Over NATS (SDK, `nats req`) a request that names a
    cloud model other than the edge's own, with route auto, goes wherever the router says: a
    simple prompt is answered by the edge's local model. paths.py says "A client that names a
    model other than the local one gets that model or nothing" (and refuses it the local
    fallback and the cascade for that reason); docs/http-api.md promises the same over HTTP,
    where it holds. Here the client asked for 'big-cloud' and got the local model's answer."""
    settings.edge.cloud_model = "smollm2"
    local = _det("local-tiny")
    async with (
        Worker(settings, conn, _det("big-cloud")) as worker,
        EdgeNode(settings, conn, local, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        got = await client.complete("[tag:n] hi", model="big-cloud", max_tokens=4)
    assert got.text == Script(tag="n").answer(4)
    assert got.end.path == "cloud", (
        f"named 'big-cloud', answered by {got.end.served_by} on path {got.end.path} "
        f"(routing: {got.end.routing.reason if got.end.routing else None})"
    )
    assert got.end.served_by == f"cloud:{worker.node_id}"
    assert local.started == 0


# -- 2. the local-context check ignores max_tokens: the answer is cut short -------------------
async def test_a_request_whose_answer_cannot_fit_the_local_context_is_not_cut_short(
    settings: MeshSettings, conn: Connection, small_llama: LlamaCppBackend
) -> None:
    """Before (first rule: truncated). The router's "too long for the local model" check
    (paths.py ``_too_long``) counts the prompt only, against ``n_ctx - 64``. A prompt of ~165
    tokens with ``max_tokens=150`` on a 256-token local context passes it, and llama.cpp
    silently shortens max_tokens to what the context has left: the client gets ~90 tokens with
    ``finish_reason: length``, as if it had asked for 90. The cloud (its own context) would have
    given all 150. Expected: routed to the cloud (as a too-long prompt is), or the whole
    answer."""
    settings.edge.model.n_ctx = SMALL_CTX  # what the edge's check reads
    prompt = "Tell me a long story about a dragon. " + "The sky is blue. " * 25
    async with (
        Worker(settings, conn, _det("smollm2")),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        got = await client.complete(prompt, max_tokens=150, temperature=0)
    end = got.end
    if end.path == "local" and end.finish_reason == "length":
        assert end.usage.completion_tokens >= 140, (
            f"asked 150 tokens, the local model gave {end.usage.completion_tokens} and said "
            f"'length' (routing: {end.routing.reason if end.routing else None})"
        )


# -- 3. a non-Latin prompt over the local context is refused instead of going to the cloud ----
async def test_a_non_latin_prompt_over_the_local_context_goes_to_the_cloud(
    settings: MeshSettings, conn: Connection, small_llama: LlamaCppBackend
) -> None:
    """Before (first rule / routing). docs/router.md: "a prompt too long for the local model's
    context always goes to the cloud". The check estimates tokens as characters / 3
    (relay.py ``estimate_prompt_tokens``), which is far below the real count for CJK, emoji
    and most non-Latin scripts (one character: one to four tokens). 180 CJK characters read
    as ~76 tokens, really ~270 > 256: routed local, and the client gets
    ``context_too_long`` while a worker was there to answer."""
    settings.edge.model.n_ctx = SMALL_CTX
    prompt = "中文字符测试" * 30
    async with (
        Worker(settings, conn, _det("smollm2")),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        try:
            got = await client.complete(prompt, max_tokens=8, temperature=0)
        except MeshError as err:
            pytest.fail(f"the client got {err.code.value}: {err.message}")
    assert got.end.path == "cloud"
    assert got.end.routing is not None
    assert got.end.routing.reason.startswith("prompt too long for the local model")


# -- 4. a request naming the edge's own model, escalated, looks for a pool of that name ------
async def test_a_request_naming_the_local_model_escalates_to_the_edge_s_cloud_model(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (routing / report). Naming the edge's local model lets the router decide
    (docs/http-api.md; over HTTP the edge then drops the name). Over NATS the name stays: the
    router escalates, and paths.py builds the cloud chain from ``req.model``, i.e. a pool named
    after the *local* model, which does not exist. The answer comes from the local model with
    ``routing.decision: cloud`` and ``fallback: no worker pool serves 'local-tiny'`` while the
    edge's cloud pool ('smollm2') sat idle; the escalation was counted in the budget all the
    same. Expected, as over HTTP: the cloud model answers."""
    settings.edge.cloud_model = "smollm2"
    local = _det("local-tiny")
    async with (
        Worker(settings, conn, _det("smollm2")) as worker,
        EdgeNode(settings, conn, local, HeuristicRouter(threshold=0.0)),
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        got = await client.complete("[tag:h] hard", model="local-tiny", max_tokens=4)
    assert got.text == Script(tag="h").answer(4)
    assert got.end.fallback is None and got.end.path == "cloud", (
        f"path {got.end.path}, fallback {got.end.fallback!r}"
    )
    assert got.end.served_by == f"cloud:{worker.node_id}"


# -- 5. a request the cloud cannot meet by its deadline takes a place under the cloud cap ----
async def test_a_deadline_too_near_for_the_cloud_does_not_use_up_the_cloud_cap(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (budget accounting; minor). The router escalates a request whose deadline is
    nearer than ``cloud_min_budget``; the relay then refuses it the cloud at once ("deadline too
    near for the cloud") and the local model answers. Nothing went to the cloud, but the
    decision took a place under ``cloud_cap_per_minute`` (and counts as a cloud escalation in
    the share and as a ``fallback``). With a cap of 1, the next request, which the cloud could
    serve, is kept local for the rest of the minute: "the cloud cap of 1 escalations per
    minute is reached". The cascade already checks the deadline first (docs/router.md "Not
    applied: ... a deadline too near for the cloud"); the router's decision does not."""
    import time

    from edge_node.router import CloudBudget

    settings.edge.cloud_min_budget = 2.0
    budget = CloudBudget(0.3, threshold=0.0, cap_per_minute=1)
    async with (
        Worker(settings, conn, _det("smollm2")) as worker,
        EdgeNode(settings, conn, _det("local-tiny"), HeuristicRouter(0.0, budget)),
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        near = await client.complete("[tag:a] q", max_tokens=4, deadline=time.time() + 1.5)
        assert near.end.path == "local"  # the cloud could not have met it: fine
        later = await client.complete("[tag:b] q", max_tokens=4)
    assert later.end.path == "cloud", (
        f"kept local: {later.end.routing.reason if later.end.routing else None}"
    )
    assert later.end.served_by == f"cloud:{worker.node_id}"


# -- 6. the heuristic router's regexes are quadratic: one prompt of digits stalls the edge ----
async def test_a_prompt_of_digits_does_not_stall_the_edge_in_the_heuristic_router(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (first rule + heal: every request on the edge). ``MESH_EDGE_ROUTER_KIND=heuristic``
    scores a prompt with ``_MATH`` (router.py: ``\\d+\\s*[-+*/^=%]\\s*\\d+`` and
    ``\\b\\d+(\\.\\d+)?\\s*(%|...)``) on the event loop. On a run of n digits it backtracks in
    O(n^2): 20,000 digits take ~3 s, 40,000 ~12 s (measured here; 100,000 would be ~75 s),
    during which the edge answers nobody: every other client's request, even one forced
    local, waits or misses its deadline.
    A prompt of that size fits a local context of 16k (``MESH_EDGE_MODEL_N_CTX``), so it is
    routed, not sent to the cloud as too long. Expected: routing costs well under a second
    whatever the text (the learned router takes 1 ms on the same prompt)."""
    import asyncio
    import time

    settings.edge.model.n_ctx = 16384  # the check reads it; the deterministic engine has no limit
    async with (
        EdgeNode(settings, conn, _det("local-tiny"), HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        await client.complete("[tag:w] warm", route="local", max_tokens=2)
        # Both sent at once, the digits first: the other arrives while the first is routed.
        digits = asyncio.ensure_future(client.complete("1" * 20_000, max_tokens=2))
        began = time.monotonic()
        try:
            other = await client.complete(
                "[tag:o] hi", route="local", max_tokens=2, deadline=time.time() + 1.5
            )
        except MeshError as err:
            pytest.fail(
                f"another client's short local request got {err.code.value} after "
                f"{time.monotonic() - began:.1f}s: the edge's loop was held by the router"
            )
        finally:
            await asyncio.wait_for(digits, 60)
        assert other.end.path == "local"
        assert time.monotonic() - began < 1.0


# -- 7. a prompt the estimate let through and the local model found too long -----------------
async def test_a_prompt_the_local_model_finds_too_long_goes_to_the_cloud(
    settings: MeshSettings, conn: Connection, small_llama: LlamaCppBackend
) -> None:
    """The estimate (about 3 characters a token) is no bound for every text: digits apart make a
    token of 2 characters. A prompt the router kept local, which the local model then finds too
    long for its context, goes to the cloud (nothing of it was sent). Before: the client got
    ``context_too_long`` while a worker was there to answer."""
    settings.edge.model.n_ctx = SMALL_CTX
    prompt = "1 " * 260  # estimated ~189 tokens with the turn's 16; really over 256
    async with (
        Worker(settings, conn, _det("smollm2")) as worker,
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        try:
            got = await client.complete(prompt, max_tokens=8, temperature=0)
        except MeshError as err:
            pytest.fail(f"the client got {err.code.value}: {err.message}")
        # A prompt that fits is still the local model's.
        short = await client.complete("Say hi.", max_tokens=4, temperature=0)
    assert got.end.path == "cloud" and got.end.served_by == f"cloud:{worker.node_id}"
    assert got.end.routing is not None
    assert "does not fit the local model's context" in got.end.routing.reason
    assert short.end.path == "local"
