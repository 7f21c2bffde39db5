"""What an edge site's healing after its uplink's return costs meanwhile (review S28a wrote these;
each failed on ae68326): a site's edge asks the workers it knew before it answers a cloud
request locally or says unreachable (``CloudModels.live_now``), and its loops look for their
consumers beside each other (:mod:`edge_node.consumer_look`).

Real nats-server processes (the hub, the site's leaf over TLS, a TCP proxy as the uplink), as in
tests/test_site_heal.py; nothing mocked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time

from nats.aio.msg import Msg

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.base import Health
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, expected_text, paused
from protocol.subjects import ANSWERS_STREAM, REGISTRY_UPDATES
from tests.helpers import eventually, holds
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    topology,
)
from tests.test_security import TEST_ENV, certs, read_env  # noqa: F401 - a fixture
from tests.test_site_heal import HEAL_S, SITE, _ask, site_mesh, watching

LOCAL_GATE_S = 0.02
"""What the check before a local answer may cost when the cloud is out of reach (a lookup
before the site asked its workers; a look at the hub through the leaf now)."""


async def _gate_times(edge: EdgeNode, model: str, n: int = 12, gap: float = 0.12) -> list[float]:
    """How long the relay's gate (``cannot_serve``, awaited before every cloud request) takes,
    ``n`` times, ``gap`` apart (a site with a request every 0.12 s)."""
    took = []
    for _ in range(n):
        began = time.perf_counter()
        cannot = await edge.models.cannot_serve(model)
        took.append(time.perf_counter() - began)
        assert cannot is not None and cannot[1] == "no_worker", cannot
        await asyncio.sleep(gap)
    return took


async def test_a_cut_uplink_adds_no_wait_to_each_local_answer(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The uplink is down (reset, refused: the leaf says "no responders" at once) past the node
    ttl: the site answers cloud requests locally. The check before each local answer does not
    wait: a round first asks whether the hub answers at all, which the leaf refuses at once.
    Before, each question went twice, 0.05 s apart (``request_or_nobody``), and each request
    and readiness probe waited the round's 50 ms for as long as the cut lasted."""
    uplink = topology.uplinks[SITE]
    async with site_mesh(topology) as (_backend, edge, client):
        model = edge.settings.edge.cloud_model
        uplink.cut(3600)
        await eventually(
            lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="cloud gone"
        )
        await asyncio.sleep(0.3)
        gates = await _gate_times(edge, model)
        probes = []
        for _ in range(6):
            began = time.perf_counter()
            ready = await edge.readiness()
            probes.append(time.perf_counter() - began)
            assert ready["status"] == "degraded"
            await asyncio.sleep(0.12)
        ends, locals_ = [], []
        for i in range(6):
            began = time.perf_counter()
            answer = await client.complete(f"[tag:l{i}] x", route="local", max_tokens=1)
            locals_.append(time.perf_counter() - began)
            await asyncio.sleep(0.12)
        for i in range(6):
            began = time.perf_counter()
            answer = await client.complete(f"[tag:u{i}] x", route="cloud", max_tokens=1)
            ends.append(time.perf_counter() - began)
            assert answer.path == "local", answer.end
            await asyncio.sleep(0.12)
        print(
            f"\nuplink cut: the gate took {[round(g * 1000) for g in gates]} ms, /ready "
            f"{[round(p * 1000) for p in probes]} ms, local answers end to end "
            f"{[round(e * 1000) for e in ends]} ms (route=local: "
            f"{[round(e * 1000) for e in locals_]} ms)"
        )
        assert statistics.median(gates) < LOCAL_GATE_S, gates


def _hub_worker_env(topo: Topology) -> dict[str, str]:
    """Worker w1's minted .env (its node id is bound to its credentials), on the hub."""
    env = read_env(topo.minted.out / "worker-w1.env")
    return {
        **env,
        **TEST_ENV,
        "MESH_NATS_URL": topo.hub.url,
        "MESH_NATS_TLS_CA_FILE": str(topo.certs.ca),
    }


async def test_a_hung_worker_adds_no_wait_to_each_local_answer_at_a_site(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The pool's only worker hangs with its link up (SIGSTOP: a stuck engine call, a blocked
    loop, a host that froze): its heartbeats stop, the site's view ages it out after node_ttl
    and the site answers locally, uplink up all along. The hub keeps the worker's subscriptions
    until its pings give up (minutes), so the questions of live_now's rounds are neither
    answered nor refused. A round that learnt nothing is not waited on again: the next goes in
    the background a second later. Before, every cloud request of every site waited 50 ms before
    it was answered locally, for as long as the worker hung."""
    worker = await MeshProcess(
        "worker", "hung", _hub_worker_env(topology), topology.tmp / "w-hung.log"
    ).start()
    try:
        settings = topology.site_settings(SITE)

        async with (
            Connection(settings.nats, f"edge-{SITE}") as econn,
            EdgeNode(
                settings, econn, DeterministicBackend(settings.edge.model), HeuristicRouter()
            ) as edge,
            MeshClient(
                settings=topology.site_settings(SITE, "client"),
                first_event_timeout=30,
                idle_timeout=30,
            ) as client,
        ):
            model = settings.edge.cloud_model
            await eventually(
                lambda: holds(edge.nodes.serves(model) is True), 30, what="the worker seen"
            )
            answer = await client.complete("[tag:a] x", route="cloud", max_tokens=2)
            assert answer.path == "cloud"
            with paused(worker.pid):
                await eventually(
                    lambda: holds(edge.nodes.serves(model) is False),
                    timeout=15,
                    what="the hung worker out of the view",
                )
                gates = await _gate_times(edge, model)
                began = time.perf_counter()
                local = await client.complete("[tag:b] x", route="cloud", max_tokens=1)
                took = time.perf_counter() - began
                assert local.path == "local"
            print(
                f"\na hung worker: the gate took {[round(g * 1000) for g in gates]} ms; a "
                f"local answer end to end {took * 1000:.0f} ms"
            )
            assert statistics.median(gates) < LOCAL_GATE_S, gates
    finally:
        with contextlib.suppress(Exception):
            await worker.stop()


async def _kept_at_hub(topo: Topology) -> int:
    operator = topo.hub_settings("operator")
    async with Connection(operator.nats, "op-look") as op:
        info = await op.jsm().stream_info(ANSWERS_STREAM)
    return int(info.state.messages)


async def test_one_slow_look_does_not_undo_the_prompt_heal_of_the_next_silent_uplink(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The hub stalls for 2.5 s (SIGSTOP: a GC pause, a disk stall, a VM migration; shorter than
    the leaf's 3 pings, the link stays up). The collector's pull is lost and its looks for its
    consumer wait on the hub; when it resumes, the looks sent during the stall are answered,
    their round trips counting the stall, while the hub answers in milliseconds again. The
    looks' pace now takes the newest look's round trip, counted up to ``MAX_RTT_S``: the next
    silent uplink heals as promptly as the first. Before, the oldest look's (1.26 s) spaced the
    looks ~5 s apart, and an answer kept at the hub in the next silent
    uplink reached its client 2.22 to 3.02 s after the relink."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_mesh(topology, request_timeout=5.0) as (backend, edge, client):
        assert edge.site is not None
        links = edge.site.links
        warm = await asyncio.wait_for(_ask(client, "w", "rt-0"), 20)
        assert warm.path == "cloud"
        backend.settings.token_delay_ms = 60
        pull = links._pulls["collect"]
        before = pull.rtt
        with paused(topology.hub.pid):
            await asyncio.sleep(2.5)
        again = await asyncio.wait_for(_ask(client, "w2", "rt-2"), 20)  # collected: found
        assert again.path == "cloud"
        stalled_rtt = pull.rtt
        kept = await _kept_at_hub(topology)
        asking = _ask(client, "q", "rt-1", tokens=15)
        await eventually(lambda: holds(backend.started >= 3), what="generating")
        uplink.freeze()

        async def kept_more() -> bool:
            return await _kept_at_hub(topology) > kept

        await eventually(kept_more, timeout=15, what="kept at the hub")
        await asyncio.sleep(2.5)  # the pull is lost (heartbeats) and its look went unanswered
        async with watching(leaf) as relinked:
            uplink.restore()
            answer = await asyncio.wait_for(asking, 30)
            got = time.monotonic()
            linked = await relinked
        assert answer.path == "cloud" and answer.text == expected_text("q", 15)
        print(
            f"\npull.rtt {before:.3f} s before the hub's stall, {stalled_rtt:.2f} s after it; "
            f"a silent uplink then: the answer kept at the hub came {got - linked:.2f} s after "
            "the relink"
        )
        assert got - linked < HEAL_S, got - linked


async def test_a_pool_whose_engines_are_down_is_not_asked_ten_times_a_second_by_each_site(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The pool's worker announces its engine down (heartbeats on time, ``down`` set): the view
    shows no live worker serving the model, for sure, and the site answers locally. Asking that
    worker whether it is there cannot change that (an answer refreshes its entry, still down),
    so live_now asks only workers whose entries aged out. Before, it asked this one before every
    cloud request, up to ten rounds a second per site and pool through the uplink and the hub
    (18 questions in 2 s), and each request waited on the round."""
    async with site_mesh(topology) as (backend, edge, client):
        model = edge.settings.edge.cloud_model

        async def engine_down() -> Health:
            return Health(ok=False, detail="engine stopped")

        backend.health = engine_down  # type: ignore[method-assign] - the engine, not NATS
        await eventually(
            lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="engine down seen"
        )
        asked: list[str] = []

        async def on_question(msg: Msg) -> None:
            asked.append(msg.subject)

        operator = topology.hub_settings("operator")
        async with Connection(operator.nats, "op-spy") as op:
            await op.nc.subscribe("mesh.v1.worker.w1.alive.>", cb=on_question)
            await op.nc.flush()
            began = time.monotonic()
            while time.monotonic() - began < 2.0:  # a site with a user request each 50 ms
                answer = await client.complete("[tag:d] x", route="cloud", max_tokens=1)
                assert answer.path == "local", answer.end
                await asyncio.sleep(0.05)
            await op.nc.flush()
        print(f"\nengine down: the worker was asked {len(asked)} times in 2 s by one site")
        assert len(asked) <= 4, len(asked)


async def test_an_engine_that_went_down_during_a_cut_is_not_taken_for_a_live_worker_at_relink(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The uplink is down past the node ttl; meanwhile the pool's only worker's engine goes down
    (the worker announces ``down`` at the hub; the site hears none of it). When the uplink
    links again, the site's recheck asks the aged-out worker whether it is there. Were its
    answer taken as a heartbeat, it would refresh the view's stale entry, which still says the
    engine is up: /ready would say "ready" (cloud reachable) and a cloud request would be
    escalated to a pool that pulls nothing, until the
    worker's next heartbeat (``down``) reaches the site. Without the recheck the site said
    "degraded" and answered locally at once. So a worker's answer now says when its engine is
    down, and such an answer does not count it in (review S28b: the request went local only
    after 1.77 s, and /ready said ready)."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_mesh(topology, heartbeat=2.0) as (backend, edge, client):
        model = edge.settings.edge.cloud_model
        down_beat = asyncio.Event()
        operator = topology.hub_settings("operator")
        async with Connection(operator.nats, "op-beats") as op:

            async def on_beat(msg: object) -> None:
                try:
                    info = json.loads(msg.data)  # type: ignore[attr-defined]
                except ValueError:
                    return
                if isinstance(info, dict) and info.get("down"):
                    down_beat.set()

            await op.nc.subscribe(f"{REGISTRY_UPDATES}.worker.>", cb=on_beat)
            uplink.cut(3600)
            await eventually(
                lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="cloud gone"
            )

            async def engine_down() -> Health:
                return Health(ok=False, detail="engine stopped")

            backend.health = engine_down  # type: ignore[method-assign] - the engine, not NATS
            await asyncio.wait_for(down_beat.wait(), 10)  # the hub knows: engine down
            down_beat.clear()
            await asyncio.wait_for(down_beat.wait(), 5)  # just after a heartbeat: ~2 s to the next
            async with watching(leaf) as relinked:
                uplink.restore()
                linked = await relinked
        await asyncio.sleep(0.3)
        ready = await edge.readiness()
        began = time.monotonic()
        answer = await client.complete("[tag:e] x", route="cloud", max_tokens=2)
        took = time.monotonic() - began
        print(
            f"\nengine down during the cut: /ready {ready['status']} ({ready.get('checks')}) "
            f"{time.monotonic() - linked:.2f} s after the relink; a cloud request went "
            f"{answer.path} in {took:.2f} s ({answer.end.fallback})"
        )
        assert ready["status"] == "degraded", ready
        assert answer.path == "local" and took < 0.5, (answer.path, took, answer.end.fallback)
