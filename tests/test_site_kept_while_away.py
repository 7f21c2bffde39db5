"""A site edge waiting for a kept answer hears it as it is kept (a subscription to its subject).
Kept while the edge's own link was down (by another replica of the edge, whose collector took
it), the word came to nobody here: the edge now reads the site's store once its link is back.
Before, it waited on until the request's deadline, and its client was told the request was
still held, with the answer at the site all along."""

from __future__ import annotations

import asyncio
import time

from mesh.connection import Connection
from mesh.queue import MSG_ID_HEADER
from mesh.testing.chaos import expected_text
from mesh.testing.proxy import TcpProxy
from protocol.messages import Answer
from protocol.subjects import KEPT_STREAM, kept_subject
from tests.helpers import eventually, holds
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    site_edge_and_worker,
    topology,
)
from tests.test_security import certs  # noqa: F401 - a fixture


async def test_an_answer_kept_while_the_edges_link_was_down_is_found_once_it_is_back(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    site = "site-a"
    proxy = await TcpProxy(topology.leaves[site].port).start()
    try:
        async with site_edge_and_worker(topology, site, token_delay_ms=0, edge_via=proxy) as (
            _,
            edge,
            client,
        ):
            assert edge.site is not None
            # An answer kept at the site, as any would be: its stored message is the one a
            # replica's collector would keep for the request the edge waits for.
            first = await client.complete(
                "[tag:kw] x", route="cloud", max_tokens=6, deferrable=True, request_id="kw-1"
            )
            assert first.text == expected_text("kw", 6)
            jsm = edge.conn.site_jsm()
            stored = await jsm.get_last_msg(KEPT_STREAM, kept_subject("kw-1"))
            sub = await edge.conn.nc.subscribe(kept_subject("kw-2"))
            waiting = asyncio.ensure_future(edge.site._wait(sub, time.time() + 30, "kw-2"))
            await asyncio.sleep(0)  # waiting, on the subscription
            proxy.cut(0.5)  # the edge's link drops; kept meanwhile, by another connection:
            await eventually(lambda: holds(not edge.conn.connected), what="the edge cut off")
            async with Connection(topology.site_settings(site).nats, "replica") as replica:
                await replica.publish_acked(
                    kept_subject("kw-2"),
                    stored.data or b"",
                    stream=KEPT_STREAM,
                    headers={**(stored.headers or {}), MSG_ID_HEADER: "kw-2"},
                )
            found = await asyncio.wait_for(waiting, 10)  # before: the 30 s deadline
            assert found is not None
            outcome, _ = found
            assert isinstance(outcome, Answer) and outcome.text == expected_text("kw", 6)
            await sub.unsubscribe()
    finally:
        await proxy.stop()
