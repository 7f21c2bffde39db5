"""Regressions an intermediate version of the edge's routing had (a0bf88e, found in review
S17x): a token estimate that took the local fallback from a prompt that fit, a generous
max_tokens that sent every short prompt to the cloud, an arithmetic pattern that missed
percentages. Each of those tests failed on that version; the last is a guard of the SDK's first
request sent while its link is down (passes on both)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import Script
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from protocol.errors import MeshError
from protocol.messages import InferRequest
from tests.test_routing_edges import SMALL_CTX, _det, small_llama  # noqa: F401 - a fixture


# -- 1. an edge with no cloud now refuses a non-Latin prompt its local model answers ----------
# Regression at a0bf88e (first rule: availability; relay.estimate_prompt_tokens):
# the estimate now adds a token per UTF-8 byte past the first of each non-ASCII character, so
# Cyrillic reads 1.33 tokens a character (this prompt: 145 real tokens, estimated ~265).
# paths._too_long() then says "too long for the local model" (> n_ctx - 64), which also sets
# _cloud_chain's local_fits=False: with no cloud to take it the client gets UNAVAILABLE "the
# cloud cannot serve this request ..., and it is too long for the local model". Before the
# change (estimate ~65) the local model answered it; route=local still does, on the same edge.
async def test_an_edge_without_cloud_answers_a_cyrillic_prompt_that_fits_its_context(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    settings.edge.model.n_ctx = SMALL_CTX
    prompt = "Привет, как дела? Расскажи мне о погоде сегодня. " * 4  # noqa: RUF001
    async with (
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        # It fits: forced local, the local model answers it in full.
        forced = await client.complete(prompt, route="local", max_tokens=8, temperature=0)
        assert forced.end.path == "local" and forced.end.usage.completion_tokens == 8
        assert forced.end.usage.prompt_tokens < SMALL_CTX - 64
        try:
            got = await client.complete(prompt, max_tokens=8, temperature=0)
        except MeshError as err:
            pytest.fail(
                f"route=auto on an edge with no cloud: {err.code.value}: {err.message} "
                f"(the prompt is {forced.end.usage.prompt_tokens} tokens of {SMALL_CTX})"
            )
    assert got.end.path == "local"
    assert got.text == forced.text


# -- 2. a large max_tokens sends a simple request to a busy cloud, and it waits there ---------
# Regression at a0bf88e (latency regression, a0bf88e paths._not_routed): "prompt tokens + max_tokens
# > n_ctx" forces the cloud for any client that asks a generous max_tokens (2048 = the default
# n_ctx; OpenAI clients often send 4096), however short the prompt and the answer. The router
# would keep "hi" local (threshold 1.0 here); now it is queued for the cloud, and with the
# cloud's workers busy the client waits cloud_start_timeout (10 s by default, 5 s in tests)
# before the local model answers it, which it did at once before. With a free cloud it is
# always the cloud's answer, outside the share and the per-minute cap.
async def test_a_large_max_tokens_does_not_queue_a_simple_request_behind_a_busy_cloud(
    settings: MeshSettings, conn: Connection
) -> None:
    async with (
        Worker(settings, conn, _det("smollm2", slots=1, token_ms=50)),
        EdgeNode(settings, conn, _det("local-tiny"), HeuristicRouter(threshold=1.0)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        # The only cloud slot is busy for ~6 s.
        busy = asyncio.ensure_future(client.complete("[tag:busy] q", route="cloud", max_tokens=120))
        await client.complete("[tag:w] warm", route="local", max_tokens=2)
        began = time.monotonic()
        got = await client.complete("[tag:h] hi [stop-after:3]", max_tokens=2048)
        took = time.monotonic() - began
        busy.cancel()
    assert got.text == Script(tag="h").answer(3)
    assert took < 2.0, (
        f"a simple request took {took:.1f}s: "
        f"routed {got.end.routing.reason if got.end.routing else None!r}, "
        f"path {got.end.path}, fallback {got.end.fallback!r}"
    )


# -- 3. the heuristic router's arithmetic signal changed on ordinary text ---------------------
# Regression at a0bf88e (minor, router._MATH): the rewrite was for speed (a number tried from
# its first digit), but it also changed what matches: '%' followed by a word character (every
# CJK percentage: "增长了15%是多少", "5%の") no longer matches (the unit group lost '%'), and a
# number written from its decimal point (".5 + 3", "Compute .25*4") no longer matches (the
# lookbehind refuses a digit after '.'). Those prompts lose the 1.2 "arithmetic" weight.
@pytest.mark.parametrize(
    "prompt", ["利润增长了15%是多少", "売上は5%の増加です", "What is .5 + 3?", "Compute .25*4"]
)
def test_the_arithmetic_signal_still_reads_percentages_and_leading_point_numbers(
    prompt: str,
) -> None:
    req = InferRequest(id="r1", prompt=prompt)
    _, reasons = HeuristicRouter().score(req)
    assert "arithmetic" in reasons, f"{prompt!r}: {reasons}"


# -- 4. GUARD (passes today): the SDK's first request sent while its link is down -------------
# 763c898 made MeshClient._via_edge's send() await Refusals.check_publish (a flush, 2 s timeout)
# after the first publish to an edge's subject and after every reconnect (clear() forgets what
# was checked). Checked: sent while the link is cut, the answer still comes as soon as the link
# is back (the flush's PING goes out with the reconnect), not 2 s later. Kept as a guard.
async def test_a_request_sent_during_a_reconnect_is_answered_as_the_link_is_back(
    settings: MeshSettings, conn: Connection, nats_server: object
) -> None:
    from mesh.testing.proxy import TcpProxy
    from tests.conftest import make_settings
    from tests.helpers import eventually

    proxy = await TcpProxy(nats_server.port).start()  # type: ignore[attr-defined]
    linked = make_settings(proxy.url)
    linked.edge.edge_id = settings.edge.edge_id
    linked.nats.reconnect_wait = 0.1
    try:
        async with (
            EdgeNode(settings, conn, _det("local-tiny"), HeuristicRouter(threshold=1.0)),
            MeshClient(settings=linked, first_event_timeout=20, idle_timeout=20) as client,
        ):
            proxy.cut(0.4)

            async def down() -> bool:
                return not client.conn.connected

            await eventually(down, 5, "the client's link cut")
            began = time.monotonic()
            got = await client.complete("[tag:r] hi", max_tokens=3)
            took = time.monotonic() - began
    finally:
        await proxy.stop()
    assert got.text == Script(tag="r").answer(3)
    assert took < 1.5, f"answered {took:.2f}s after it was sent (the link was cut for 0.4 s)"


class _OffScale(HeuristicRouter):
    """A router of one's own whose score is no probability (a bug in it)."""

    def __init__(self, score: float) -> None:
        super().__init__()
        self._score = score

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        return self._score, ["off the scale"]


@pytest.mark.parametrize("score", [1.5, float("nan")])
async def test_a_router_scoring_off_the_scale_is_told_at_the_edge_as_a_typed_error(
    settings: MeshSettings, conn: Connection, score: float
) -> None:
    """The edge builds its route decision without validating it (a80ec6f: its own values). A
    router's score is the one value that is not the edge's own: one off [0, 1] ends its
    request in the edge's typed ``internal`` error, as the decision's validation did before,
    and never reaches the client inside an answer its strict decoding would refuse (review
    S22)."""
    async with (
        EdgeNode(settings, conn, _det("local"), _OffScale(score)),
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        with pytest.raises(MeshError) as raised:
            await client.complete("hi", max_tokens=2)
        assert raised.value.code.value == "internal"
        got = await client.complete("hi again", max_tokens=2, route="local")
        assert got.text and got.end.path == "local"
