"""Mid-answer escalation: an answer the local model starts unsure of is finished by the cloud,
and the client sees one answer, with the reason; a sure one goes on locally, whole."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

import pytest

from cloud_node.worker import Worker
from edge_node.confidence import ConfidenceGate, summarise
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import ConfidenceSettings, MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.messages import InferRequest, RestartEvent
from tests.helpers import eventually, queue_drained


def deterministic(name: str = "smollm2") -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", name=name, slots=2))


class LocalEngine(DeterministicBackend):
    """The edge's deterministic engine, answering with tag ``L`` whatever the prompt says: a
    local token that reached the client would show in the text."""

    def __init__(self) -> None:
        super().__init__(ModelSettings(backend="deterministic", name="local-tiny", slots=2))

    def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        retagged = request.model_copy(update={"prompt": f"{request.prompt} [tag:L]"})
        return super().generate(retagged, prefix=prefix, prefix_tokens=prefix_tokens)


def cascade_settings(settings: MeshSettings, **confidence: object) -> MeshSettings:
    settings.edge.router.threshold = 1.0  # the router keeps everything local
    settings.edge.router.confidence = ConfidenceSettings(enabled=True, **confidence)  # type: ignore[arg-type]
    return settings


def test_confidence_summary_and_gate_by_hand() -> None:
    conf = summarise([(1.0, -0.5), (3.0, -1.5), (2.0, -0.1)])
    assert conf is not None
    assert conf.tokens == 3 and conf.mean_entropy == pytest.approx(2.0)
    assert conf.max_entropy == 3.0 and conf.min_logprob == -1.5
    assert conf.mean_logprob == pytest.approx(-0.7)
    assert summarise([]) is None
    gate = ConfidenceGate(ConfidenceSettings(enabled=True, max_mean_entropy=1.9))
    low, why = gate.escalate(conf)
    assert low and "2.00 > 1.9" in why and "first 3 tokens" in why
    assert not ConfidenceGate(ConfidenceSettings(max_mean_entropy=2.0)).escalate(conf)[0]


async def test_an_unsure_local_start_is_finished_by_the_cloud_as_one_answer(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=4, max_mean_entropy=2.5)
    local = LocalEngine()
    prompt = "[unsure] [tag:u] what is the airspeed of a swallow?"
    async with (
        Worker(settings, conn, deterministic()) as worker,
        EdgeNode(settings, conn, local, create_router(settings.edge.router)) as edge,
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete(prompt, max_tokens=12)
        await eventually(lambda: queue_drained(conn, settings), what="the queue to drain")
    assert got.text == Script(tag="u").answer(12)  # the cloud's, whole, once: no " L0"
    assert not any(isinstance(e, RestartEvent) for e in got.events)
    assert got.end.usage.completion_tokens == 12
    assert got.end.path == "cloud" and got.end.served_by == f"cloud:{worker.node_id}"
    routing = got.end.routing
    assert routing is not None and routing.decision == "cloud" and not routing.forced
    assert routing.reason.startswith("local confidence low")
    assert routing.confidence is not None and routing.confidence["escalated"] is True
    assert routing.confidence["tokens"] == 4 and routing.confidence["mean_entropy"] == 4.0
    assert routing.budget is not None and routing.budget["mid_answer"] == 1
    assert local.started == 1  # it started locally, and was stopped
    assert edge.stats.get("route.cloud.mid_answer") == 1
    assert edge.metrics.mid_answer._value.get() == 1


async def test_a_sure_local_start_goes_on_locally_with_its_held_tokens(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=4, max_mean_entropy=2.5)
    local = LocalEngine()
    async with (
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete("[tag:s] hello there", max_tokens=10)
        short = await client.complete("[tag:z] [stop-after:2] hi", max_tokens=10)
    assert got.text == Script(tag="L").answer(10) and got.end.path == "local"
    assert got.end.usage.completion_tokens == 10
    routing = got.end.routing
    assert routing is not None and routing.decision == "local"
    assert routing.confidence is not None and routing.confidence["escalated"] is False
    assert "local confidence ok" in routing.reason
    # An answer shorter than the window is decided on what there is, and sent whole.
    assert short.text == Script(tag="L").answer(2) and short.end.path == "local"
    assert short.end.routing is not None and short.end.routing.confidence is not None
    assert short.end.routing.confidence["tokens"] == 2


async def test_mid_answer_escalation_respects_the_cloud_cap(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=3)
    settings.edge.router.cloud_cap_per_minute = 0
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, deterministic("local-tiny"), create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete("[unsure] [tag:c] hmm", max_tokens=6)
    assert got.text == Script(tag="c").answer(6) and got.end.path == "local"
    assert got.end.routing is not None and "cap per minute is reached" in got.end.routing.reason


async def test_forced_routes_are_not_second_guessed(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=3)
    local = deterministic("local-tiny")
    async with (
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete("[unsure] [tag:f] hmm", route="local", max_tokens=6)
    assert got.end.path == "local" and got.end.routing is not None
    assert got.end.routing.forced and got.end.routing.confidence is None


async def test_the_real_model_held_then_released_gives_its_own_answer(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> None:
    """The bundled GGUF: with the window held and released, the client gets exactly what the
    model says (greedy) when asked directly; its confidence is read from its logits."""
    cascade_settings(settings, window_tokens=6, max_mean_entropy=100.0)
    question = "Name three colours of the rainbow."
    direct = ""
    async for chunk in edge_backend.generate(
        InferRequest(id="direct1", prompt=question, max_tokens=24, temperature=0.0)
    ):
        direct += chunk.text
    async with (
        EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete(question, max_tokens=24, temperature=0.0)
    assert got.text == direct and got.end.path == "local"
    confidence = got.end.routing.confidence if got.end.routing else None
    assert confidence is not None and confidence["tokens"] == 6
    assert confidence["mean_entropy"] > 0.0 and confidence["mean_logprob"] < 0.0


async def test_the_real_model_unsure_escalates_to_the_cloud(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> None:
    cascade_settings(settings, window_tokens=4, max_mean_entropy=0.0)  # never sure enough
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete("[tag:r] Why is the sky blue?", max_tokens=8)
    assert got.end.path == "cloud" and got.text == Script(tag="r").answer(8)
    assert got.end.routing is not None and got.end.routing.confidence is not None
    assert got.end.routing.confidence["escalated"] is True


async def test_a_client_giving_up_during_the_hold_frees_the_local_model(
    settings: MeshSettings, conn: Connection
) -> None:
    from protocol.errors import MeshTimeoutError

    cascade_settings(settings, window_tokens=4)
    local = deterministic("local-tiny")
    async with EdgeNode(settings, conn, local, create_router(settings.edge.router)) as edge:
        impatient = MeshClient(settings=settings, connection=conn, first_event_timeout=0.3)
        with pytest.raises(MeshTimeoutError):  # the engine hangs inside the held window
            await impatient.complete("[tag:h] [hang-after:2] go", max_tokens=8)

        async def freed() -> bool:
            return edge.records.in_flight() == 0 and local.capacity().free == 2

        await eventually(freed, timeout=5, what="the held generation to be dropped")
        assert edge.stats.get("cancelled") == 1


async def test_an_escalation_the_cloud_cannot_take_is_answered_locally_afresh(
    settings: MeshSettings, conn: Connection
) -> None:
    """No pool serves the cloud model: the unsure start was dropped, so the local model answers
    again from the beginning, and the end says why."""
    cascade_settings(settings, window_tokens=3)
    local = LocalEngine()
    async with (
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        # (It sent deferrable=True too, which this edge without a site ignored then; refused
        # now, as over HTTP: a site's request that can wait takes the same branch when the local
        # model began it, `decision.confidence` set.)
        got = await client.complete("[unsure] hmm", max_tokens=6)
    assert got.text == Script(tag="L").answer(6) and got.end.path == "local"
    assert got.end.fallback and local.started == 2
    assert got.end.routing is not None and got.end.routing.confidence is not None


async def test_no_mid_answer_escalation_too_near_the_deadline_or_for_a_named_model(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=3)
    settings.edge.cloud_min_budget = 30.0  # a deadline 20 s off is too near for the cloud
    local = LocalEngine()
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        near = await client.complete(
            "[unsure] quick",
            max_tokens=4,
            deadline=time.time() + 20,
        )
        # Naming the cloud model: the cloud's answer, the local model never asked. (Naming the
        # local model lets the router choose, as naming none does, over NATS as over HTTP.)
        named = await client.complete(
            "[unsure] mine", max_tokens=4, model=settings.edge.cloud_model
        )
    assert near.end.path == "local" and near.text == Script(tag="L").answer(4)
    assert near.end.routing is not None and near.end.routing.confidence is None
    assert named.end.path == "cloud" and named.text == Script().answer(4)
    assert named.end.routing is not None and named.end.routing.confidence is None
    assert local.started == 1  # the near one, once: nothing held and thrown away


async def test_the_real_model_reads_one_confidence_per_sampled_token() -> None:
    """Readings follow sampled tokens, not text chunks: a character made of several tokens
    still counts each (the bundled model, asked for katakana)."""
    from mesh.config import load_settings

    backend = LlamaCppBackend(load_settings(environ={}).edge.model)
    await backend.start()
    try:
        request = InferRequest(
            id="kana1",
            prompt="Write the word 'computer' in Japanese katakana.",
            max_tokens=12,
            temperature=0.0,
        )
        readings = texts = 0
        text = ""
        async for chunk in backend.generate_scored(request, scored_tokens=100):
            readings += len(chunk.confidence or ())
            texts += bool(chunk.text)
            text += chunk.text
    finally:
        await backend.close()
    assert any(ord(c) > 0x7FF for c in text), text  # characters of three UTF-8 bytes
    assert readings > texts > 0  # some chunks stood for several sampled tokens
