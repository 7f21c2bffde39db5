"""A delivery lost in a leaf node's uplink as it went (:meth:`mesh.pull.Pull.redeliver`): the hub
counts it delivered and unacked, and would send it again only after the consumer's ack wait
(30 s, as on a site's consumers). The edge's own link to its leaf stays up, so no reconnect
tells: the pull itself must. Real nats-server processes: a hub with a JetStream domain, a leaf
dialling it through a proxy (plain TCP, so the proxy can tell the delivery by its payload), a
loop on the leaf pulling as a site's collector does (1 s pulls, 0.5 s heartbeats)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import nats.errors
from nats.aio.msg import Msg
from nats.js import api

from edge_node.site_links import COLLECT_PULL_S
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.pull import Pull, PullLost
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings
from tests.helpers import eventually, holds

MARKER = b"lost-in-the-uplink"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_delivery_lost_in_the_uplink_comes_again_at_once(tmp_path: Path) -> None:
    """Before, a 1 s pull that heard nothing ended as "expired" before two heartbeats could be
    missed: nothing was taken for lost, and the delivery came again after 30 s. (A pull left
    behind at the hub holds the redelivery back until it expires: one pull's time, so a site's
    collector pulls for 1 s.)"""
    pull_s = COLLECT_PULL_S
    leaf_port = _free_port()
    (tmp_path / "hub.conf").write_text(
        f'port: -1\nserver_name: hub\njetstream {{ store_dir: "{tmp_path / "hub"}", '
        f"domain: hub }}\nleafnodes {{ port: {leaf_port} }}\n"
    )
    async with NatsServer(config=str(tmp_path / "hub.conf")) as hub:
        uplink = await TcpProxy(leaf_port).start()
        (tmp_path / "leaf.conf").write_text(
            f'port: -1\nserver_name: leaf\njetstream {{ store_dir: "{tmp_path / "leaf"}", '
            f"domain: site }}\nleafnodes {{ remotes: [ {{ url: "
            f'"nats-leaf://127.0.0.1:{uplink.port}" }} ] }}\n'
        )
        try:
            async with (
                NatsServer(config=str(tmp_path / "leaf.conf")) as leaf,
                Connection(make_settings(hub.url).nats, "hub") as op,
            ):
                await op.jsm().add_stream(api.StreamConfig(name="ANS", subjects=["ans.>"]))
                await op.jsm().add_consumer(
                    "ANS",
                    api.ConsumerConfig(
                        durable_name="site", ack_policy=api.AckPolicy.EXPLICIT, ack_wait=30
                    ),
                )
                settings = make_settings(leaf.url)
                settings.nats.hub_domain = "hub"
                async with Connection(settings.nats, "edge") as conn:
                    took = await _lose_one(conn, op, uplink, pull_s)
        finally:
            await uplink.stop()
    print(f"\n{pull_s:g} s pulls: the delivery lost in the uplink came again {took:.2f} s later")
    assert took < 5.0, took  # 30 s before: the consumer's ack wait


async def _lose_one(conn: Connection, op: Connection, uplink: TcpProxy, pull_s: float) -> float:
    """The seconds from the delivery lost to the loop's getting it again."""
    pull = Pull(conn, "ANS", "site", prefix="$JS.hub.API", heartbeat=0.5)
    await pull.start()
    got: list[Msg] = []

    async def loop() -> None:  # the shape of a site loop (edge_node.site_links)
        while True:
            await pull.redeliver()
            try:
                msgs = await pull.fetch(16, pull_s)
            except PullLost:
                await asyncio.sleep(0.1)
                continue
            except nats.errors.Error:
                await asyncio.sleep(0.25)
                continue
            for msg in msgs:
                got.append(msg)
                await msg.ack()

    task = asyncio.ensure_future(loop())
    try:
        await op.js.publish("ans.warm", b"warm")  # the pull works through the uplink
        await eventually(lambda: holds(len(got) == 1), what="the first delivery")
        uplink.lose(MARKER, 0.3)
        await op.js.publish("ans.x", MARKER)
        await eventually(lambda: holds(uplink.lost == 1), what="the delivery lost")
        lost = time.monotonic()
        await eventually(lambda: holds(len(got) == 2), timeout=40, what="the delivery again")
        assert got[1].data == MARKER
        return time.monotonic() - lost
    finally:
        task.cancel()
        await pull.stop()
