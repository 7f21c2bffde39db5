"""A delivery to a site's loop lost with a link as it went: the server counts it delivered and
unacked, and JetStream sends it again only after the consumer's ack wait (30 s on a site's
consumers). Before, a held request lost on its way to the forwarder stopped the site's whole
outbox for those 30 s (one at a time, in order), and an answer lost on its way to the collector
waited 30 s to be kept at the site. Now the loop, once it holds nothing after the link came back,
has the consumer send again what it counts unacked (:meth:`mesh.pull.Pull.redeliver`).

Real nats-server processes (the hub, the site's leaf over TLS with minted credentials); the
link goes through a proxy that throws away the piece carrying the delivery and cuts itself."""

from __future__ import annotations

import asyncio
import time

import pytest

from mesh.testing.proxy import TcpProxy
from tests.helpers import eventually
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    site_edge_and_worker,
    topology,
)
from tests.test_security import certs  # noqa: F401 - a fixture

CUT_S = 0.3
WITHIN_S = 10.0
"""Well under the 30 s the ack wait took, and above a slow machine's reconnect and look."""


async def _above(count: object, attr: str, n: int) -> bool:
    return int(getattr(count, attr)) > n


@pytest.mark.parametrize(
    ("loop", "marker", "count"),
    [
        ("forwarder", b"MESH_OUTBOX.forwarder.", "forwarded"),
        ("collector", b"MESH_ANSWERS.", "collected"),
    ],
)
async def test_a_delivery_lost_on_its_way_to_a_site_loop_comes_again_at_once(
    topology: Topology,  # noqa: F811 - the fixture
    loop: str,
    marker: bytes,
    count: str,
) -> None:
    """Lost between the leaf and the edge: the leaf counts a held request delivered to the
    forwarder, the hub an answer to the collector. (The uplink is TLS, so the proxy could not
    tell a delivery there; one lost in the uplink itself is ``tests/test_pull_uplink.py``'s.)"""
    site = "site-a"
    link = await TcpProxy(topology.leaves[site].port).start()
    try:
        async with site_edge_and_worker(topology, site, token_delay_ms=0, edge_via=link) as (
            _backend,
            edge,
            client,
        ):
            assert edge.site is not None
            links = edge.site.links
            link.lose(marker, CUT_S)
            asking = asyncio.ensure_future(
                client.complete(
                    "[tag:c] x", route="cloud", max_tokens=4, deferrable=True, request_id="lost-1"
                )
            )
            await eventually(lambda: _above(link, "lost", 0), what="the delivery lost")
            lost = time.monotonic()
            await eventually(lambda: _above(links, count, 0), timeout=WITHIN_S, what=count)
            took = time.monotonic() - lost
            answer = await asyncio.wait_for(asking, 30)
            assert answer.path == "cloud" and answer.text == " c0 c1 c2 c3"
            assert (await client.answer("lost-1")).text == " c0 c1 c2 c3"
            print(f"\na delivery lost on its way to the {loop}: {count} {took:.2f} s later")
    finally:
        await link.stop()
