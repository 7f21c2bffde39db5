"""A worker dies mid-answer: JetStream redelivers to another worker after ack_wait, the client is
told the stream restarted, and ends with one complete answer, never two interleaved ones."""

from __future__ import annotations

import asyncio

from cloud_node.worker import Worker
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.provision import provision
from protocol.messages import EndEvent, RestartEvent, TokenEvent
from tests.helpers import eventually, queue_drained


async def test_redelivery_after_a_worker_dies_restarts_the_stream_once(
    settings: MeshSettings, conn: Connection, worker_backend: LlamaCppBackend, client: MeshClient
) -> None:
    settings.stream.ack_wait = (
        2.0  # redeliver quickly once the dead worker stops reporting progress
    )
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    doomed_conn = await Connection(settings.nats, "doomed-worker").connect()
    doomed = Worker(settings.model_copy(deep=True), doomed_conn, worker_backend)
    doomed.node_id = "doomed"
    await doomed.start()

    events: list[TokenEvent | RestartEvent | EndEvent] = []
    survivor: Worker | None = None
    async for event in client.stream(
        "Count slowly from one to fifty.", via="cloud", max_tokens=40, temperature=0
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
    try:
        restarts = [i for i, e in enumerate(events) if isinstance(e, RestartEvent)]
        assert len(restarts) == 1, events
        before = events[: restarts[0]]
        after = events[restarts[0] + 1 :]
        assert all(isinstance(e, TokenEvent) and e.attempt == 1 for e in before)
        assert all(isinstance(e, TokenEvent) and e.attempt == 2 for e in after[:-1])
        end = after[-1]
        assert isinstance(end, EndEvent)
        assert end.served_by == "cloud:survivor" and end.attempt == 2
        assert end.usage.completion_tokens == 40  # one whole answer from the second attempt
        assert sum(len(e.text) for e in after[:-1]) > 0

        # complete() hides the restart: its text is the second attempt's alone.
        await eventually(lambda: queue_drained(conn, settings), what="redelivered request acked")
    finally:
        await survivor.stop()
        await doomed.stop()
        await doomed_conn.close()
        await asyncio.sleep(0)
