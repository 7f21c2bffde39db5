"""A worker dies mid-answer: JetStream redelivers the request after ack_wait, and the next worker
continues the answer from what the answer store kept. The client sees one seamless answer: no
restart, positions numbered without a gap, and an end that vouches for all of it."""

from __future__ import annotations

import asyncio

import pytest

from cloud_node.worker import Worker
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.provision import provision
from protocol.messages import EndEvent, RestartEvent, TokenEvent
from protocol.stream import digest_of
from tests.helpers import eventually, queue_drained

pytestmark = pytest.mark.chaos  # a worker dies mid-answer


async def test_a_worker_that_dies_mid_answer_is_continued_by_another(
    settings: MeshSettings, conn: Connection, worker_backend: LlamaCppBackend, client: MeshClient
) -> None:
    settings.stream.ack_wait = 2.0  # redeliver quickly once the dead worker stops reporting
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    doomed_conn = await Connection(settings.nats, "doomed-worker").connect()
    doomed_settings = settings.model_copy(deep=True)
    doomed_settings.worker.node_id = "doomed"
    doomed = Worker(doomed_settings, doomed_conn, worker_backend)
    await doomed.start()

    events: list[TokenEvent | RestartEvent | EndEvent] = []
    survivor: Worker | None = None
    try:
        async for event in client.stream(
            "Write a long story about a cat who learns to sail.",
            via="cloud",
            max_tokens=40,
            temperature=0,
        ):
            events.append(event)
            if survivor is None and isinstance(event, TokenEvent) and len(events) == 3:
                # Crash: the connection drops mid-generation, nothing is acked or nak'd.
                await doomed_conn.nc.close()
                survivor_settings = settings.model_copy(deep=True)
                survivor_settings.worker.node_id = "survivor"
                survivor = Worker(survivor_settings, conn, worker_backend)
                await survivor.start()
        assert survivor is not None
        assert not any(isinstance(e, RestartEvent) for e in events), events
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        end = events[-1]
        assert isinstance(end, EndEvent)
        assert [t.seq for t in tokens] == list(range(len(tokens)))  # no gap, no duplicate
        assert {t.attempt for t in tokens[:3]} == {1} and tokens[-1].attempt == 2
        assert end.served_by == "cloud:survivor" and end.attempt == 2
        assert end.seq == len(tokens)
        assert end.digest == digest_of("".join(t.text for t in tokens))
        assert end.usage.completion_tokens == 40  # one answer's worth of tokens, not two
        assert end.finish_reason == "length"
        assert survivor.stats.continued == 1 and survivor.stats.restarted == 0
        await eventually(lambda: queue_drained(conn, settings), what="redelivered request acked")
    finally:  # no worker may outlive its test
        if survivor is not None:
            await survivor.stop()
        await doomed.stop()
        await doomed_conn.close()
        await asyncio.sleep(0)
