"""The local model counts the prompt where the cloud could take it (ROOM_CHECKED, 03d7023), and
an answer's end leaves in one write with the tokens the write batch held (WriteBatch.hand_over,
cb2d57a): review S21b of both.

Real nats-server, the real SmolLM2 GGUF at a 256-token context (test_routing_edges'
``small_llama``) where the local model's own count matters, the deterministic backend elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import nats
from nats.aio.msg import Msg

from cloud_node.publisher import AnswerPublisher
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from edge_node.routing import create_router
from mesh.answer_store import AnswerStore, ensure_answer_stream
from mesh.backends.base import ROOM_CHECKED, Chunk
from mesh.backends.deterministic import DeterministicBackend
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.codec import WireFormat, decode_event
from protocol.errors import BackendError, ContextTooLongError, MeshError
from protocol.messages import EndEvent, InferRequest, TokenEvent, Usage
from protocol.stream import AnswerWriter
from tests.test_route_choice_edges import DIGITS, cascade_settings, det
from tests.test_routing_edges import SMALL_CTX, small_llama  # noqa: F401 - a fixture


def client_of(settings: MeshSettings, conn: Connection) -> MeshClient:
    return MeshClient(settings=settings, connection=conn, first_event_timeout=30, idle_timeout=30)


class Refusing(DeterministicBackend):
    """A cloud engine that fails every request before its first token (not retryable)."""

    def __init__(self) -> None:
        super().__init__(ModelSettings(backend="deterministic", name="smollm2", slots=2))

    async def generate(  # type: ignore[override]
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        raise BackendError("the cloud engine is broken", retryable=False, request_id=request.id)
        yield  # pragma: no cover - a generator


async def _drain(backend: LlamaCppBackend, req: InferRequest) -> list[Chunk]:
    return [chunk async for chunk in backend.generate(req)]


# -- 03d7023: the backend ------------------------------------------------------------------
async def test_a_checked_refusal_leaves_no_room_on_the_pooled_instance(
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Instances are pooled: a request refused under ROOM_CHECKED must not leave its room on
    the instance for the next, unchecked, request (route=local gets what fits)."""
    req = InferRequest(prompt=DIGITS, max_tokens=40, temperature=0.0)
    token = ROOM_CHECKED.set(True)
    try:
        try:
            await asyncio.wait_for(_drain(small_llama, req), 30)
        except ContextTooLongError:
            pass
        else:
            raise AssertionError("the checked request was not refused")
    finally:
        ROOM_CHECKED.reset(token)
    chunks = await asyncio.wait_for(_drain(small_llama, req), 30)
    assert chunks[-1].finish_reason == "length" and "".join(c.text for c in chunks)
    assert small_llama._instances is not None
    held = [small_llama._instances.get_nowait() for _ in range(small_llama._instances.qsize())]
    for llama in held:
        small_llama._instances.put_nowait(llama)
    assert all(llama.room == (0, None) for llama in held)


async def test_a_checked_prompt_that_leaves_room_is_answered_whole(
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """The count refuses only a prompt that leaves less than max_tokens: a short one checked
    gets all it asked for; the scoring path (the cascade's) refuses the same as generate."""
    token = ROOM_CHECKED.set(True)
    try:
        short = InferRequest(prompt="Count: 1 2 3", max_tokens=8, temperature=0.0)
        chunks = await asyncio.wait_for(_drain(small_llama, short), 30)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens <= 8
        scored = small_llama.generate_scored(
            InferRequest(prompt=DIGITS, max_tokens=40, temperature=0.0), scored_tokens=3
        )
        try:
            await asyncio.wait_for(anext(scored), 30)
        except ContextTooLongError:
            pass
        else:
            raise AssertionError("the scored (cascade) generation was not refused")
        finally:
            await scored.aclose()
    finally:
        ROOM_CHECKED.reset(token)


# -- 03d7023: through an edge ---------------------------------------------------------------
async def test_an_overflow_whose_cloud_fails_first_is_answered_what_fits(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Overflowed (the local model refused the checked prompt), the cloud fails before its
    first token: the local model answers what fits, not context_too_long."""
    settings.edge.model.n_ctx = SMALL_CTX
    async with (
        Worker(settings, conn, Refusing()),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)) as edge,
        client_of(settings, conn) as client,
    ):
        got = await asyncio.wait_for(client.complete(DIGITS, max_tokens=40, temperature=0.0), 30)
        stats = edge.counts.stats
        assert stats.get("route.cloud.overflow") == 1
    assert got.end.path == "local" and got.end.fallback, got.end
    assert got.text and got.end.usage.completion_tokens > 0


async def test_an_overflow_under_the_cascade_goes_to_the_cloud_or_answers_what_fits(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Mid-answer escalation on (the scoring path): the checked prompt overflows to the cloud,
    which answers all 40 tokens; a forced route=local, right after, gets what fits."""
    cascade_settings(settings, window_tokens=3)
    settings.edge.model.n_ctx = SMALL_CTX
    async with (
        Worker(settings, conn, det()),
        EdgeNode(settings, conn, small_llama, create_router(settings.edge.router)) as edge,
        client_of(settings, conn) as client,
    ):
        got = await asyncio.wait_for(client.complete(DIGITS, max_tokens=40, temperature=0.0), 30)
        forced = await asyncio.wait_for(
            client.complete(DIGITS, max_tokens=40, temperature=0.0, route="local"), 30
        )
        assert edge.counts.stats.get("route.cloud.overflow") == 1
    assert got.end.path != "local" and got.end.usage.completion_tokens == 40, got.end
    assert forced.end.path == "local" and forced.text


async def test_concurrent_checked_and_forced_requests_on_one_slot(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """One local slot, two requests at once: the auto one (checked) goes to the cloud, the
    route=local one (not checked) gets what fits: the check belongs to its own request."""
    settings.edge.model.n_ctx = SMALL_CTX
    async with (
        Worker(settings, conn, det()),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)),
        client_of(settings, conn) as client,
    ):
        auto, forced = await asyncio.wait_for(
            asyncio.gather(
                client.complete(DIGITS, max_tokens=40, temperature=0.0),
                client.complete(DIGITS, max_tokens=40, temperature=0.0, route="local"),
            ),
            40,
        )
    assert auto.end.path != "local" and auto.end.usage.completion_tokens == 40, auto.end
    assert forced.end.path == "local" and forced.text


async def test_an_overflow_whose_cloud_fails_mid_answer_is_answered_what_fits(
    settings: MeshSettings,
    conn: Connection,
    small_llama: LlamaCppBackend,  # noqa: F811
) -> None:
    """Overflowed (the prompt fits the local context, but leaves less than max_tokens), and
    the cloud engine fails after its first 2 tokens on every delivery. Before the fix (review
    S21b of 03d7023): the local model, which answered such a prompt before 03d7023 (what fits),
    sat idle, and the client got the cloud's max_deliveries error: relay `restart=False` for an
    overflowed request (written when an overflow meant the prompt did not fit at all) passed
    it on. Now (NoRoomError: it fits, too little room), as for an escalation whose cloud fails
    mid-answer (test_route_choice_edges #3), the local model answers afresh what fits."""
    settings.edge.model.n_ctx = SMALL_CTX
    prompt = DIGITS + " [fail-after:2]"
    async with (
        Worker(settings, conn, det()),
        EdgeNode(settings, conn, small_llama, HeuristicRouter(threshold=1.0)) as edge,
        client_of(settings, conn) as client,
    ):
        try:
            got = await asyncio.wait_for(
                client.complete(prompt, max_tokens=40, temperature=0.0), 40
            )
        except MeshError as err:
            overflowed = edge.counts.stats.get("route.cloud.overflow")
            raise AssertionError(
                f"overflowed {overflowed}x, then: {err.code.value}: {err.message}"
            ) from None
    assert got.end.path == "local" and got.text, got.end


# -- cb2d57a: the end hands the write batch's tokens to nats-py -----------------------------
async def _finish_with_held_tokens(
    conn: Connection, settings: MeshSettings, scope: str, *, store_on: bool
) -> tuple[list[object], float]:
    await ensure_answer_stream(conn.jsm(), settings.stream)
    store = AnswerStore(conn, settings.stream, filtered=False)
    if not store_on:
        store.enabled = False
    publisher = AnswerPublisher(conn, store, scope, "req-1", WireFormat.MSGPACK, timeout=5)
    writer = AnswerWriter("req-1", attempt=1, node="cloud:test")
    reader = await nats.connect(settings.nats.url)
    got: list[object] = []
    changed = asyncio.Event()

    def on_msg(msg: Msg) -> None:
        got.append(decode_event(msg.data, msg.headers))
        changed.set()

    async def cb(msg: Msg) -> None:
        on_msg(msg)

    await reader.subscribe(publisher.subject, cb=cb)
    await reader.flush()
    try:
        conn.write_batch.gap = 30.0  # tokens wait for the gap: only the end takes them out
        await publisher.send(writer.start())
        await publisher.send(writer.token("a"))
        for text in ("b", "c", "d"):
            await publisher.send(writer.token(text))
        loop = asyncio.get_running_loop()
        began = loop.time()
        await publisher.finish(writer.end(finish_reason="stop", usage=Usage()))

        async def whole() -> None:
            while not any(isinstance(e, EndEvent) for e in got) or len(got) < 6:
                changed.clear()
                await changed.wait()

        await asyncio.wait_for(whole(), 3)
        return got, loop.time() - began
    finally:
        await reader.close()


async def test_held_tokens_and_the_end_reach_a_reader_in_order_with_the_store(
    conn: Connection, settings: MeshSettings
) -> None:
    got, took = await _finish_with_held_tokens(conn, settings, "s21bon", store_on=True)
    tokens = [e.text for e in got if isinstance(e, TokenEvent)]
    assert tokens == ["a", "b", "c", "d"] and isinstance(got[-1], EndEvent), got
    assert took < 1.0


async def test_held_tokens_and_the_end_reach_a_reader_in_order_without_the_store(
    conn: Connection, settings: MeshSettings
) -> None:
    """The store-off branch of _publish_stored (a plain publish and a flush)."""
    got, took = await _finish_with_held_tokens(conn, settings, "s21boff", store_on=False)
    tokens = [e.text for e in got if isinstance(e, TokenEvent)]
    assert tokens == ["a", "b", "c", "d"] and isinstance(got[-1], EndEvent), got
    assert took < 1.0
