"""An edge withdraws an escalation it will not relay, whenever that is decided, and its client's
answer does not wait on the withdrawal.

- Cancelled while the queue's ack is on its way (the client's cancel, its deadline, a stop),
  the request is queued all the same: a worker took it and generated the whole answer for
  nobody, as no cancel went out. Now the worker hears the cancel and stops.
- A fallback to the local model waited for the withdrawal first: a cancel addressed to a frozen
  worker waits out its 0.5 s for a reply, and the queue's delete its own. The local answer now
  starts at once.

Real nats-server; the edge, the worker and the client in-process, each on its own connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.queue import ADDRESSED_CANCEL_WAIT_S
from mesh.testing.chaos import expected_text
from mesh.testing.proxy import TcpProxy
from protocol.codec import decode_event
from protocol.messages import StartEvent
from tests.helpers import eventually, holds, queue_drained

TOKENS = 60  # 1.2 s of answer at 20 ms a token


def _backend(token_ms: int) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=2, token_delay_ms=token_ms, faults=False)
    )


@contextlib.asynccontextmanager
async def _mesh(
    settings: MeshSettings, worker_backend: DeterministicBackend, worker_url: str | None = None
) -> AsyncIterator[tuple[Worker, EdgeNode, MeshClient]]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = "withdrawn"
    own.worker.drain_grace = 0.2
    own.nats.url = worker_url or settings.nats.url
    async with (
        Connection(own.nats, "worker") as worker_conn,
        Connection(settings.nats, "edge") as edge_conn,
        Worker(own, worker_conn, worker_backend) as worker,
        EdgeNode(settings, edge_conn, _backend(5), HeuristicRouter()) as edge,
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        yield worker, edge, client


async def test_a_request_cancelled_while_it_was_being_queued_is_withdrawn(
    settings: MeshSettings, conn: Connection
) -> None:
    worker_backend = _backend(20)
    async with _mesh(settings, worker_backend) as (worker, edge, client):
        acked = edge.conn.publish_acked
        queued = asyncio.Event()

        async def late_ack(*args: Any, **kwargs: Any) -> Any:
            ack = await acked(*args, **kwargs)  # stored in the queue, and acked...
            queued.set()
            await asyncio.sleep(5.0)  # ...but the ack reaches the edge late (a slow link)
            return ack

        edge.conn.publish_acked = late_ack  # type: ignore[method-assign]
        asking = asyncio.ensure_future(
            client.complete("[tag:wd] count", route="cloud", max_tokens=TOKENS)
        )
        await asyncio.wait_for(queued.wait(), 10)
        await eventually(lambda: holds(worker_backend.started == 1), what="the worker at it")
        asking.cancel()  # the client gives up: the SDK cancels at the edge
        await asyncio.gather(asking, return_exceptions=True)
        began = time.monotonic()
        await eventually(
            lambda: holds(worker.stats.cancelled == 1), 5, "the worker told of the cancel"
        )
        took = time.monotonic() - began
        assert worker.stats.completed == 0, "the answer was generated whole for nobody"
        assert took < 1.0, f"cancelled at the worker {took:.2f}s after the client gave up"
        await eventually(lambda: queue_drained(conn, settings), 10, "the queue drained")


async def test_a_fallback_does_not_wait_on_the_withdrawal(
    settings: MeshSettings, conn: Connection, nats_server: NatsServer
) -> None:
    """The worker's engine hangs once the request is started, and its link freezes (a frozen
    process): no first token comes, and the edge falls back to its local model. The
    withdrawal's cancel addressed to that worker gets no reply."""
    settings.edge.cloud_first_token_timeout = 0.5
    worker_backend = _backend(20)
    hung = asyncio.Event()

    async def hangs(*_args: Any, **_kwargs: Any) -> AsyncIterator[Any]:
        hung.set()
        await asyncio.sleep(60)  # an engine that never yields a token
        yield  # pragma: no cover

    worker_backend.generate = hangs  # type: ignore[method-assign]
    proxy = await TcpProxy(nats_server.port).start()
    try:
        async with _mesh(settings, worker_backend, proxy.url) as (_worker, _edge, client):
            started = asyncio.Event()
            at: list[float] = []

            async def seen(msg: Any) -> None:
                if isinstance(decode_event(msg.data), StartEvent) and not started.is_set():
                    started.set()
                    at.append(time.monotonic())  # the fallback's clock runs from here

            await conn.nc.subscribe("mesh.v1.tok.>", cb=seen)
            await conn.subscribed()
            asking = asyncio.ensure_future(
                client.complete("[tag:fb] count", route="cloud", max_tokens=8)
            )
            await asyncio.wait_for(hung.wait(), 10)
            await asyncio.wait_for(started.wait(), 10)  # the edge has it too
            proxy.freeze()
            answer = await asyncio.wait_for(asking, 20)
            took = time.monotonic() - at[0]
            proxy.restore()  # the worker stops as it would
    finally:
        await proxy.stop()
    assert answer.end.path == "local"
    assert answer.text == expected_text("fb", 8)
    # The fallback's own wait, then the local answer (8 tokens at 5 ms): the unanswered
    # cancel added ADDRESSED_CANCEL_WAIT_S before it.
    fallback = settings.edge.cloud_first_token_timeout
    assert took < fallback + ADDRESSED_CANCEL_WAIT_S, f"answered {took:.2f}s after the start"
