"""Mid-answer escalation: an answer the local model starts unsure of is finished by the cloud,
and the client sees one answer, with the reason; a sure one goes on locally, whole."""

from __future__ import annotations

import pytest

from cloud_node.worker import Worker
from edge_node.confidence import ConfidenceGate, summarise
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import ConfidenceSettings, MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.messages import InferRequest, RestartEvent, TokenEvent
from tests.helpers import eventually, queue_drained


def deterministic(name: str = "smollm2") -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", name=name, slots=2))


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
    local = deterministic("local-tiny")
    prompt = "[unsure] [tag:u] what is the airspeed of a swallow?"
    async with (
        Worker(settings, conn, deterministic()) as worker,
        EdgeNode(settings, conn, local, create_router(settings.edge.router)) as edge,
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete(prompt, max_tokens=12)
        await eventually(lambda: queue_drained(conn, settings), what="the queue to drain")
    expected = Script(tag="u").answer(12)
    assert got.text == expected  # whole, once: no held local token leaked into it
    assert sum(isinstance(e, TokenEvent) for e in got.events) >= 1
    assert not any(isinstance(e, RestartEvent) for e in got.events)
    assert got.end.path == "cloud" and got.end.served_by == f"cloud:{worker.node_id}"
    routing = got.end.routing
    assert routing is not None and routing.decision == "cloud" and not routing.forced
    assert routing.reason.startswith("local confidence low")
    assert routing.confidence is not None and routing.confidence["escalated"] is True
    assert routing.confidence["tokens"] == 4 and routing.confidence["mean_entropy"] == 4.0
    assert routing.budget is not None and routing.budget["mid_answer"] == 1
    assert local.started == 1  # it started locally, and was stopped
    assert edge.metrics.get("route.cloud.mid_answer") == 1


async def test_a_sure_local_start_goes_on_locally_with_its_held_tokens(
    settings: MeshSettings, conn: Connection
) -> None:
    cascade_settings(settings, window_tokens=4, max_mean_entropy=2.5)
    local = deterministic("local-tiny")
    async with (
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        got = await client.complete("[tag:s] hello there", max_tokens=10)
        short = await client.complete("[tag:z] [stop-after:2] hi", max_tokens=10)
    assert got.text == Script(tag="s").answer(10) and got.end.path == "local"
    assert got.end.usage.completion_tokens == 10
    routing = got.end.routing
    assert routing is not None and routing.decision == "local"
    assert routing.confidence is not None and routing.confidence["escalated"] is False
    assert "local confidence ok" in routing.reason
    # An answer shorter than the window is decided on what there is, and sent whole.
    assert short.text == Script(tag="z").answer(2) and short.end.path == "local"
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
    assert 0.0 < confidence["mean_entropy"] < 12.0  # nats; ln(49152) ~ 10.8 at most
    assert confidence["min_logprob"] <= confidence["mean_logprob"] <= 0.0


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
        assert edge.metrics.get("cancelled") == 1
