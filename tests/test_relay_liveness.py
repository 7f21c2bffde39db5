"""An edge relaying a cloud answer judges its worker by the answer itself while it flows: the
registry's word (a worker not seen within ``node_ttl``) counts only once the answer goes quiet.
Workers and the edge run in this process on the deterministic backend, against a real
nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import nats.errors
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.provision import provision
from mesh.queue import CloudCall
from mesh.reader import AnswerReader
from protocol.messages import EndEvent, InferRequest, RestartEvent, TokenEvent
from tests.helpers import eventually

PROMPT = "[tag:lv] count"
TOKENS = 200


def deterministic(token_ms: float) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=token_ms)
    )


async def test_an_answer_that_flows_is_not_given_up_when_the_registry_loses_its_worker(
    settings: MeshSettings, conn: Connection, client: MeshClient
) -> None:
    # The edge gives a worker the registry no longer shows ack_wait + fetch_timeout +
    # cloud_first_token_timeout (2.5 s here) for another to continue its answer. This worker's
    # announcements stop mid-answer (its registry entry deleted, as when its heartbeats cannot
    # get through), but its tokens keep coming for 4 s: the answer is continuing, and it must
    # end as the cloud's, whole, not be given up and answered again locally.
    settings.stream.ack_wait = 1.0
    settings.edge.cloud_first_token_timeout = 1.0
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    wsettings = settings.model_copy(deep=True)
    wsettings.worker.node_id = "lv-worker"
    wconn = await Connection(wsettings.nats, "lv-worker").connect()
    worker = Worker(wsettings, wconn, deterministic(token_ms=20))
    await worker.start()
    edge = EdgeNode(settings, conn, deterministic(token_ms=1), HeuristicRouter())
    await edge.start()
    try:

        async def seen(live: bool) -> bool:
            return edge.nodes.is_live("lv-worker", "smollm2") is live

        await eventually(lambda: seen(True), what="the edge sees the worker")
        events: list[TokenEvent | RestartEvent | EndEvent] = []
        async for event in client.stream(PROMPT, route="cloud", max_tokens=TOKENS):
            events.append(event)
            if len(events) == 3:
                await worker._heartbeat.stop()  # its registry entry goes; its answer goes on
                await eventually(lambda: seen(False), what="the edge's view loses the worker")
        end = events[-1]
        assert isinstance(end, EndEvent)
        assert end.path == "cloud" and end.fallback is None, end
        assert end.served_by == "cloud:lv-worker"
        assert not any(isinstance(e, RestartEvent) for e in events)
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        assert text == Script(tag="lv").answer(TOKENS)
    finally:
        await edge.stop()
        await worker.stop()
        await wconn.close()


async def test_a_relay_does_not_look_at_its_worker_while_the_answer_flows(
    settings: MeshSettings, conn: Connection, client: MeshClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each look (the relay's reader waking it) is CPU an edge spends per answer in flight, 32 or
    # 128 at a time. While tokens flow nothing is due; a 3-second answer is looked at a few times
    # (its start, its end, a backstop each second), not every quarter second.
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    looks: list[float] = []
    read = AnswerReader.next

    async def counted(reader: AnswerReader, timeout: float) -> list[object]:
        if reader.what == "the cloud":
            looks.append(time.monotonic())
        return await read(reader, timeout)  # type: ignore[return-value]

    monkeypatch.setattr(AnswerReader, "next", counted)
    async with (
        Worker(settings, conn, deterministic(token_ms=20)),
        EdgeNode(settings, conn, deterministic(token_ms=1), HeuristicRouter()),
    ):
        began = time.monotonic()
        answer = await client.complete(PROMPT, route="cloud", max_tokens=150)
        took = time.monotonic() - began
    assert answer.path == "cloud" and answer.text == Script(tag="lv").answer(150)
    assert took >= 2.9  # 150 tokens, 20 ms apart
    assert len(looks) <= 8, [round(t - began, 2) for t in looks]  # every 0.25 s: 13 or more


class SlowToContinue(DeterministicBackend):
    """Reads what it continues at 20 ms a kept token before its next one, as an engine reads a
    long prompt."""

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if prefix_tokens:
            await asyncio.sleep(prefix_tokens * 0.02)
        async for chunk in super().generate(request, prefix=prefix, prefix_tokens=prefix_tokens):
            yield chunk


async def test_a_continued_answer_is_given_the_time_to_read_what_it_continues(
    settings: MeshSettings, conn: Connection, client: MeshClient
) -> None:
    # An edge waits for a worker's first token for cloud_first_token_timeout plus the prompt's
    # tokens at cloud_prefill_rate. A worker that continues an answer another one began reads
    # the prompt and the answer so far: 60 kept tokens at 50 a second take 1.2 s here, past the
    # 0.9 s a fresh start of this prompt gets. The continuation must not be given up for a
    # local answer that starts over.
    settings.stream.ack_wait = 1.0
    settings.edge.cloud_first_token_timeout = 0.5
    settings.edge.cloud_prefill_rate = 50.0
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    workers: list[tuple[Worker, Connection]] = []

    async def start_worker(name: str) -> None:
        own = settings.model_copy(deep=True)
        own.worker.node_id = name
        wconn = await Connection(own.nats, name).connect()
        worker = Worker(own, wconn, SlowToContinue(deterministic(token_ms=10).settings))
        await worker.start()
        workers.append((worker, wconn))

    await start_worker("doomed")
    edge = EdgeNode(settings, conn, deterministic(token_ms=1), HeuristicRouter())
    await edge.start()
    try:
        events: list[TokenEvent | RestartEvent | EndEvent] = []
        async for event in client.stream(PROMPT, route="cloud", max_tokens=120):
            events.append(event)
            if len(events) == 60 and len(workers) == 1:
                await start_worker("survivor")  # up before the watch asks who can continue
                await workers[0][1].nc.close()  # dies mid-answer
        end = events[-1]
        assert isinstance(end, EndEvent)
        assert end.path == "cloud" and end.fallback is None, end
        # Continued (attempt 2; a loaded machine may hand it on once more, to the survivor too).
        assert end.served_by == "cloud:survivor" and end.attempt >= 2
        assert not any(isinstance(e, RestartEvent) for e in events)
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        assert text == Script(tag="lv").answer(120)
    finally:
        await edge.stop()
        for worker, wconn in workers:
            await worker.stop()
            await wconn.close()


class PausesOnce(DeterministicBackend):
    """Stands still for 0.6 s after its 20th token, then goes on, as an engine does while it
    takes in other work."""

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        produced = 0
        async for chunk in super().generate(request, prefix=prefix, prefix_tokens=prefix_tokens):
            yield chunk
            produced += 1
            if produced == 20:
                await asyncio.sleep(0.6)


async def test_an_answer_that_flows_again_outlives_a_verdict_from_its_quiet_spell(
    settings: MeshSettings, conn: Connection, client: MeshClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the engine stands still, the reader's watch asks the worker whether it is there,
    # and hears "no responders" once (its link dropped for a moment, as when its server
    # restarts). The worker is back at once and the answer flows again: the verdict from the
    # quiet spell must not outlive it, and give the answer up after the takeover wait (2.5 s
    # here) while its tokens still come.
    settings.stream.ack_wait = 1.0
    settings.edge.cloud_first_token_timeout = 1.0
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    asked = CloudCall._ask_alive
    calls: list[str] = []

    async def unreachable_once(call: CloudCall, node: str, state: object) -> object:
        calls.append(node)
        if len(calls) == 1:
            raise nats.errors.NoRespondersError
        return await asked(call, node, state)  # type: ignore[arg-type]

    monkeypatch.setattr(CloudCall, "_ask_alive", unreachable_once)
    async with (
        Worker(settings, conn, PausesOnce(deterministic(token_ms=20).settings)),
        EdgeNode(settings, conn, deterministic(token_ms=1), HeuristicRouter()),
    ):
        events = [e async for e in client.stream(PROMPT, route="cloud", max_tokens=TOKENS)]
    assert calls, "the answer never went quiet: nothing was asked"
    end = events[-1]
    assert isinstance(end, EndEvent)
    assert end.path == "cloud" and end.fallback is None and end.attempt == 1, end
    assert not any(isinstance(e, RestartEvent) for e in events)
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text == Script(tag="lv").answer(TOKENS)


async def test_a_worker_that_says_it_holds_the_request_is_waited_for_over_the_registry(
    settings: MeshSettings, conn: Connection, client: MeshClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker reads a long prompt (1.5 s before its first token); its registry entry goes
    # (as when it leaves the registry first on its way out, or its announcements are late)
    # while it tells the reader's watch that it holds the request. The edge must wait for its
    # answer, not fall back at once to a local one for a worker that "stopped".
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    said: list[str] = []
    answered = CloudCall._answered

    def spied(call: CloudCall, node: str, word: object) -> None:
        said.append(node)
        answered(call, node, word)  # type: ignore[arg-type]

    monkeypatch.setattr(CloudCall, "_answered", spied)
    slow = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, prefill_delay_ms=1500, token_delay_ms=5)
    )
    worker = Worker(settings, conn, slow)
    await worker.start()
    try:
        async with EdgeNode(settings, conn, deterministic(token_ms=1), HeuristicRouter()):
            answer = asyncio.create_task(client.complete(PROMPT, route="cloud", max_tokens=20))

            async def asked() -> bool:
                return bool(said)

            await eventually(asked, what="the watch asks the worker during its prefill")
            await worker._heartbeat.stop()  # its registry entry goes
            done = await answer
    finally:
        await worker.stop()
    assert done.path == "cloud" and done.end.fallback is None, done.end
    assert done.text == Script(tag="lv").answer(20)


pytestmark = pytest.mark.timeout(60)
