"""A worker started beside an engine that is not there yet, a link slow for over 2 s, and the
MESH_* names the project itself sets: regressions of three of this stop's commits (618a7de,
00e4fd8, a8759bb) found in review S17w. Each test marked "Confirms" failed on the commit it
names; the "Guard" passed there too and pins what was found sound."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cloud_node.puller import Puller
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from protocol.errors import InvalidRequestError
from tests.conftest import make_settings
from tests.test_puller import queue  # noqa: F401 - a fixture


# Confirms (heal; a8759bb): the worker's tick now measures the round trip every second with
# nats-py's `rtt(timeout=2)`. Over a link whose replies take more than 2 s for a while (a slow
# or congested uplink, a hub paused 2.5 s: connection.py says such a pause is not a dead link),
# the measurement times out and nats-py cancels its pong future but leaves it queued. The PONG
# that then arrives is matched to that cancelled future: `future.set_result` raises
# InvalidStateError inside nats-py's read loop, which logs "nats: encountered error" and STOPS
# READING. The connection then hears nothing at all (no deliveries, no cancels, no replies)
# until nats-py's stale-ping check reconnects it 3-4 s later (a drop: pull requests forgotten,
# a registry/epoch re-sync). Before a8759bb the round trip was measured only at start and after
# a reconnect, so a 2.5 s slow spell on a live link passed without a drop.
async def test_a_slow_spell_over_2s_does_not_stop_the_worker_connection_reading(
    nats_server: NatsServer,
    conn: Connection,
    queue: tuple[str, str],  # noqa: F811
) -> None:
    stream, _subject = queue
    proxy = await TcpProxy(nats_server.port).start()
    linked = make_settings(proxy.url)
    linked.nats.reconnect_wait = 0.1
    try:
        async with Connection(linked.nats, "s17w-worker") as worker_conn:
            puller = Puller(
                worker_conn,
                stream,
                "w",
                free_slots=lambda: 1,
                total_slots=lambda: 1,
                deliver=lambda _m: None,
                expires=60.0,
            )
            await puller.start()
            drops = worker_conn.drops
            got: asyncio.Queue[bytes] = asyncio.Queue()
            inbox = f"s17w.probe.{uuid.uuid4().hex}"

            async def on_probe(msg: object) -> None:
                await got.put(msg.data)  # type: ignore[attr-defined]

            await worker_conn.nc.subscribe(inbox, cb=on_probe)
            await worker_conn.nc.flush()
            await asyncio.sleep(1.05)  # the tick measures again once a second

            proxy.delay_down = 2.5  # the server's replies take 2.5 s for a while
            await puller.tick()  # its measurement times out after 2 s
            await asyncio.sleep(0.7)  # the delayed PONG comes in
            proxy.delay_down = 0.0  # the link is quick again

            # What a user checks: the worker's link still carries messages, promptly, and it
            # did not have to reconnect for a slow spell shorter than the stale-link check.
            await conn.nc.publish(inbox, b"after")
            await conn.nc.flush()
            data = await asyncio.wait_for(got.get(), 1.5)
            assert data == b"after"
            assert worker_conn.drops == drops
            await puller.stop()
    finally:
        await proxy.stop()


# Guard (sound, 618a7de): every MESH_* name the project itself sets (compose file, `mesh creds`
# env files, benchmarks, chaos tools) is a setting or an allowed non-setting; a misspelt one
# is refused with the setting meant.
def test_names_the_project_sets_are_accepted_and_a_misspelt_one_refused() -> None:
    environ = {
        "MESH_NATS_URL": "nats://x:4222",
        "MESH_WORKER_MODEL_SLOTS": "64",
        "MESH_WORKER_METRICS_PORT": "9464",
        "MESH_EDGE_HTTP_HOST": "0.0.0.0",
        "MESH_NATS_CREDS_FILE": "/x.creds",
        "MESH_NATS_HUB_DOMAIN": "hub",
        "MESH_NATS_INBOX_PREFIX": "_INBOX_edge_s1",
        "MESH_NATS_LEAST_PRIVILEGE": "true",
        "MESH_EDGE_API_KEYS_FILE": "/k",
        "MESH_STREAM_ANSWER_REPLICAS": "1",
        "MESH_BENCH_VLLM_MODEL": "m",
        "MESH_CHAOS_KILLS": "3",
        "MESH_HOP_PROBE_DIR": "/tmp",
        "MESH_STREAM_PLACEMENT_TAGS": "zone-a, ssd",
    }
    settings = load_settings(environ=environ)
    assert settings.worker.model.slots == 64
    assert settings.stream.placement_tags == ["zone-a", "ssd"]
    with pytest.raises(InvalidRequestError, match="MESH_WORKER_MODEL_SLOTS"):
        load_settings(environ={"MESH_WORKER_SLOTS": "64"})


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Confirms (first rule; 00e4fd8): an engine must now fail three health checks in a row (1 s
# apart) before the worker counts it down, and that includes a worker that STARTS with its
# engine down (compose starts the worker beside a vLLM still loading: connection refused).
# Meanwhile the worker covers its free slots and pulls: a request queued to the cloud in
# those first seconds is delivered, failed, redelivered... (about 1 s each), and the client
# gets max_deliveries / an error instead of waiting for the engine as it does once the watch
# says down. Before, the first refused check (milliseconds after start) said down.
async def test_a_request_sent_as_a_worker_starts_with_its_engine_down_waits_for_it(
    nats_server: NatsServer,
) -> None:
    import time

    from aiohttp import web

    from cloud_node.worker import Worker
    from mesh.backends.openai_http import OpenAIHTTPBackend
    from mesh.client import MeshClient
    from mesh.config import ModelSettings
    from mesh.testing.openai_server import DeterministicServer

    settings = make_settings(nats_server.url)
    port = _free_port()
    engine = OpenAIHTTPBackend(
        ModelSettings(backend="openai", base_url=f"http://127.0.0.1:{port}/v1", slots=2)
    )
    await engine.start()
    runner: web.AppRunner | None = None
    try:
        async with (
            Connection(settings.nats, "s17w-worker") as wconn,
            MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
            Worker(settings, wconn, engine) as worker,
        ):
            asking = asyncio.ensure_future(
                client.complete("[tag:b] x", via="cloud", max_tokens=3, deadline=time.time() + 20)
            )
            await asyncio.sleep(4.0)
            assert worker.engine.down is not None
            server = DeterministicServer(settings.worker.model.name, 0, 0)
            runner = web.AppRunner(server.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            answer = await asyncio.wait_for(asking, 10)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.close()
    assert answer.text == " b0 b1 b2"
