"""Nothing stays broken: an edge's registry view after a reconnect while the hub has no
JetStream quorum follows the registry again once quorum is back, with no further reconnect, and
never claims a worker serves meanwhile. Before, its watch was tried once: the edge then answered
every cloud request locally for good, saying no worker served the model, while workers heartbeat.

The view creates no consumer (it reads the bucket with direct gets, which a replica may answer
without quorum, and hears republished updates): its read after the reconnect may succeed
without quorum, or fail and be retried ("restoring") while the stream has no leader.

Real 3-node nats-server cluster, a TCP proxy in front of the node the edge uses."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.node_view import NodeView
from mesh.provision import provision
from mesh.queue import publish_request
from mesh.registry import Heartbeat, NodeInfo
from mesh.served_models import model_is_served
from mesh.testing.chaos import JsCluster
from mesh.testing.proxy import TcpProxy
from protocol.errors import MeshError
from protocol.messages import InferRequest
from tests.conftest import make_settings
from tests.helpers import eventually

pytestmark = pytest.mark.chaos


async def test_registry_watch_is_restored_after_quorum_returns_without_a_reconnect(
    js_cluster: JsCluster,
) -> None:
    n1 = f"nats://127.0.0.1:{js_cluster.ports['n1'][0]}"
    proxy = await TcpProxy(js_cluster.ports["n1"][0]).start()
    edge_settings = make_settings(proxy.url)
    edge_settings.nats.reconnect_wait = 0.1
    worker_settings = make_settings(n1)
    stream = StreamSettings(replicas=3)
    info = NodeInfo(node_id="w1", role="worker", models=["smollm2"], slots=1, free=1)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(proxy.stop)
        worker_conn = await stack.enter_async_context(Connection(worker_settings.nats, "worker"))
        beat = Heartbeat(worker_conn, lambda: info, 0.5, 3.0, stream)
        await beat.start()
        stack.push_async_callback(beat.stop)
        edge_conn = await stack.enter_async_context(Connection(edge_settings.nats, "edge"))
        view = NodeView(edge_conn, 3.0, pool="smollm2")
        await view.start()
        stack.push_async_callback(view.stop)

        async def serves() -> bool:
            return view.serves("smollm2") is True

        await eventually(serves, timeout=20, what="the edge to see the worker")
        await provision(worker_conn.jsm(), stream, ["smollm2"])  # the queue and its pool
        assert await model_is_served(edge_conn.jsm(), edge_settings.stream, "smollm2") is True

        # No quorum: JetStream cannot answer, core NATS still does.
        await js_cluster.kill("n2")
        await js_cluster.kill("n3")
        before = edge_conn.reconnects
        proxy.cut(0.3)  # the edge's link drops and comes back while JetStream is down

        async def reconnected() -> bool:
            return edge_conn.reconnects > before

        await eventually(reconnected, timeout=20, what="the edge to reconnect")
        # No worker can announce itself without quorum. The view either cannot read the
        # registry yet (its step is retried, and it cannot tell), or read what a replica still
        # had and saw the worker age out: either way it never says the worker serves.
        await asyncio.sleep(3.5)  # the ttl, and a little
        if edge_conn.restoring == ["registry watch"]:
            assert view.serves("smollm2") is None  # it cannot tell, and does not pretend
        assert view.serves("smollm2") is not True

        # Meanwhile every JetStream call a client makes fails typed, saying what happened, and
        # a pool that exists is never called gone.
        assert await model_is_served(edge_conn.jsm(), edge_settings.stream, "smollm2") is not False
        request = InferRequest(id="q1", model="smollm2", prompt="hi", max_tokens=4)
        with pytest.raises(MeshError) as refused:
            await publish_request(edge_conn, edge_settings.stream, request, "scope-a")
        print("publish without quorum:", type(refused.value).__name__, refused.value.message)
        assert refused.value.retryable

        await js_cluster.start("n2")
        await js_cluster.start("n3")

        async def restored() -> bool:
            return edge_conn.restoring == [] and view.serves("smollm2") is True

        await eventually(restored, timeout=60, what="the watch restored once quorum returned")
        assert edge_conn.reconnects == before + 1, "restored by retrying, not by a new reconnect"
