"""A reader that lost tokens while the answer store had no leader: the worker is asked for them
at once, not after the store's retries.

A 3-node hub with R3 streams; the node leading MESH_TOK is killed (-9, by PID) while a client's
link, through a proxy to another node, swallows what passes for a moment: its answers have gaps
that only the store (leaderless through its election) or the worker generating them can fill.
The workers connect to the two nodes that stay. Before the fix, a reader asked the worker only
once a store read succeeded, and the store was read again 0.2 s, then 0.4 s later: answers
stood still 0.2 s and more (`mesh bench failover`'s hub part: 0.23 and 0.635 s).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import (
    R3,
    JsCluster,
    MeshProcess,
    Tally,
    ask,
    wait_for_worker,
    worker_env,
)
from mesh.testing.proxy import TcpProxy
from tests.chaos.test_cluster import _js_ready, _replicas_current
from tests.helpers import eventually

pytestmark = pytest.mark.chaos

ANSWERS = 4
FROZEN_S = 0.06
"""The client's link swallows this long: about three tokens of each answer (20 ms apart)."""
STILL_S = 0.2
"""The store's first retry: an answer that stood still this long waited for it."""


async def test_tokens_lost_while_the_answer_store_elects_are_asked_of_the_worker_at_once(
    js_cluster: JsCluster, tmp_path: Path
) -> None:
    url = js_cluster.url
    settings = load_settings(
        {("nats", "url"): url, ("stream", "replicas"): 3, ("edge", "edge_id"): "sl"}, environ={}
    )
    procs: list[MeshProcess] = []
    async with Connection(settings.nats, "operator") as op:
        await eventually(lambda: _js_ready(op), timeout=30, what="the cluster's meta leader")
        from mesh.answer_store import ensure_answer_stream
        from mesh.provision import provision

        await provision(op.jsm(), settings.stream, ["smollm2"])
        await ensure_answer_stream(op.jsm(), settings.stream)
        info = await op.jsm().stream_info(settings.stream.answer_stream)
        assert info.cluster is not None and info.cluster.leader is not None
        leader = info.cluster.leader
        others = [n for n in js_cluster.ports if n != leader]
        stay_url = ",".join(f"nats://127.0.0.1:{js_cluster.ports[n][0]}" for n in others)
        try:
            for node_id in ("w1", "w2"):  # on the nodes that stay: their links never drop
                env = {**worker_env(stay_url, node_id, slots=ANSWERS), **R3}
                worker = MeshProcess("worker", node_id, env, tmp_path / f"{node_id}.log")
                procs.append(await worker.start())
                await wait_for_worker(op, node_id, timeout=60, process=worker)
            await eventually(lambda: _replicas_current(op), timeout=60, what="R3 replicas")
            proxy = await TcpProxy(js_cluster.ports[others[0]][0]).start()
            client_settings = settings.model_copy(deep=True)
            client_settings.nats.url = proxy.url
            async with MeshClient(
                settings=client_settings, first_event_timeout=30, idle_timeout=30
            ) as client:
                started = [asyncio.Event() for _ in range(ANSWERS)]
                asks = [
                    asyncio.ensure_future(
                        ask(client, f"sl{i}", 100, via="cloud", first_token=started[i])
                    )
                    for i in range(ANSWERS)
                ]
                for event in started:
                    await asyncio.wait_for(event.wait(), 20)
                await asyncio.sleep(0.3)  # mid-answer
                proxy.freeze()  # what the workers publish now never reaches the client
                killed = time.monotonic()
                await js_cluster.kill(leader)
                await asyncio.sleep(max(0.0, FROZEN_S - (time.monotonic() - killed)))
                proxy.restore()
                tally = Tally()
                for outcome in await asyncio.wait_for(asyncio.gather(*asks), 60):
                    tally.add(outcome)
            await proxy.stop()
        finally:
            await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
    tally.assert_sound()
    assert all(o.kind == "correct" for o in tally.outcomes), tally.outcomes
    said = "publishing again what a reader lacks"
    resent = sum(p.log_path.read_text().count(said) for p in procs)
    silences = [round(o.longest_silence or 0.0, 3) for o in tally.outcomes]
    print(f"\nlongest silence per answer: {silences}; resends by the workers: {resent}")
    assert resent, "no worker was asked for what a reader lacked: the test proves nothing"
    assert max(silences) < STILL_S, f"answers stood still {silences} s"
