"""A site's held request while the hub's queue is full: the forwarder holds on, trying again
after 1 s, then 2, 4, up to 8 (:data:`edge_node.site_links.BUSY_MAX_S`), not four times a
second as while the uplink is down (the leaf refuses those at once, at no cost to the hub);
each try sends the whole request over the uplink to a hub that is overloaded already. Once the
queue has room, the request goes at the next try."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.provision import provision
from tests.helpers import eventually, holds
from tests.test_edge_site import Topology, topology  # noqa: F401 - a fixture
from tests.test_security import certs  # noqa: F401 - a fixture


async def test_a_site_tries_a_full_queue_less_and_less_often(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    site = "site-a"
    hub = topology.hub_settings("operator")
    hub.stream.max_msgs = 1  # one message fills it
    settings = topology.site_settings(site)
    model = settings.edge.cloud_model
    async with contextlib.AsyncExitStack() as stack:
        op = await stack.enter_async_context(Connection(hub.nats, "operator"))
        await provision(op.jsm(), hub.stream, [model])
        await op.js.publish(f"mesh.v1.infer.{model}.filler", b"{}")  # nobody takes it: full
        econn = await stack.enter_async_context(Connection(settings.nats, f"edge-{site}"))
        tries: list[float] = []
        publish = econn.publish_acked

        async def counted(subject: str, *args: Any, **kwargs: Any) -> Any:
            if subject.startswith("mesh.v1.infer."):
                tries.append(time.monotonic())
            return await publish(subject, *args, **kwargs)

        econn.publish_acked = counted  # type: ignore[method-assign]
        local = DeterministicBackend(settings.edge.model)
        await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        client = await stack.enter_async_context(
            MeshClient(settings=topology.site_settings(site, "client"))
        )
        asking = asyncio.ensure_future(
            client.complete(
                "[tag:f] x", route="cloud", max_tokens=3, deferrable=True, request_id="full-1"
            )
        )
        try:
            await eventually(lambda: holds(len(tries) >= 1), timeout=10, what="the first try")
            await asyncio.sleep(3.5)
            gaps = [round(b - a, 2) for a, b in itertools.pairwise(tries)]
            span = tries[-1] - tries[0]
            print(f"\nforward tries at a full queue over {span:.1f} s: gaps {gaps}")
            assert len(tries) <= 4, gaps  # 0, 1, 3 s: before, every 0.25 s (some 15)
            assert all(g >= 0.9 for g in gaps), gaps
            await op.jsm().purge_stream(hub.stream.name)  # room again
            await eventually(
                lambda: _queued(op, hub.stream.name), timeout=10, what="the request forwarded"
            )
        finally:
            asking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asking


async def _queued(op: Connection, stream: str) -> bool:
    return (await op.jsm().stream_info(stream)).state.messages >= 1
