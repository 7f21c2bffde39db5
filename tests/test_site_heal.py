"""An edge site healing after its uplink comes back, the hub restarts on its store, or its leaf
restarts; held requests and kept answers across short cuts, long cuts and flaps. Review S27d
wrote these; the two left open then (strict xfails) were fixed after.

Real nats-server processes (the hub, the site's leaf over TLS with minted credentials), a TCP
proxy as the uplink; nothing mocked. Times are measured from the moment the cause ended as the
leaf's own log tells it (its uplink linked again) or the hub's server said it was ready."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import expected_text
from protocol import EndEvent, RestartEvent, TokenEvent
from protocol.subjects import ANSWERS_STREAM, REGISTRY_UPDATES
from tests.helpers import eventually, holds
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    _held,
    running_mesh,
    site_edge_and_worker,
    topology,
)
from tests.test_security import certs  # noqa: F401 - a fixture

SITE = "site-a"
HEAL_S = 1.0
"""What "heals fast" allows: a recovery step back well under a second after its cause ended."""


class LinkWatch:
    """Notes, on the monotonic clock, when the leaf's uplink is up again: its log says the domains
    were agreed (a "Leafnode connection created" line comes for failed dials too)."""

    LINE = "JetStream using domains"

    def __init__(self, leaf: NatsServer) -> None:
        assert leaf.log_path is not None
        self.path: Path = leaf.log_path
        self.base = self._count()

    def _count(self) -> int:
        return self.path.read_text(errors="replace").count(self.LINE)

    async def next_link(self, timeout: float = 15.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._count() > self.base:
                self.base = self._count()
                return time.monotonic()
            await asyncio.sleep(0.01)
        raise AssertionError("the leaf never linked again")


@contextlib.asynccontextmanager
async def watching(leaf: NatsServer) -> AsyncIterator[asyncio.Future[float]]:
    watch = LinkWatch(leaf)
    task = asyncio.ensure_future(watch.next_link(20))
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, AssertionError):
                await task


async def _answers_at_hub(topo: Topology, n: int) -> bool:
    operator = topo.hub_settings("operator")
    async with Connection(operator.nats, "op-look") as op:
        info = await op.jsm().stream_info(ANSWERS_STREAM)
    return info.state.messages >= n


def _ask(
    client: MeshClient, tag: str, rid: str, tokens: int = 6, deadline_s: float = 40
) -> asyncio.Future[Completion]:
    return asyncio.ensure_future(
        client.complete(
            f"[tag:{tag}] x",
            route="cloud",
            max_tokens=tokens,
            deferrable=True,
            request_id=rid,
            deadline=time.time() + deadline_s,
        )
    )


# -- a long uplink cut: the answer waits at the hub ---------------------------------------------


async def test_an_answer_kept_at_the_hub_during_a_long_cut_reaches_its_client_soon_after_relink(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """A user's request that can wait is forwarded and generated; the uplink drops for a while
    (longer than the pull's heartbeats, so the collector is looking for its consumer); the
    worker finishes and keeps the answer at the hub meanwhile. Nothing else is held at the site.
    When the uplink links again, the waiting client should have its answer well under a second
    later: the collector's pull is the only recovery step between it and the answer."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=60) as (backend, edge, client):
        assert edge.site is not None
        waits = []
        for i in range(3):  # three rounds: the collector's pause has no fixed phase
            rid = f"long-{i}"
            asking = _ask(client, f"l{i}", rid, tokens=15)
            await eventually(lambda i=i: holds(backend.started > i), what="generating")
            uplink.cut(3600)
            await eventually(lambda i=i: _answers_at_hub(topology, i + 1), what="kept at the hub")
            await asyncio.sleep(3.0)  # a long cut: the pull is lost and the leaf refuses the looks
            async with watching(leaf) as relinked:
                uplink.restore()
                answer = await asyncio.wait_for(asking, 30)
                got = time.monotonic()
                linked = await relinked
            assert answer.path == "cloud" and answer.text == expected_text(f"l{i}", 15)
            waits.append(got - linked)
        print(f"\nlong cut, answer kept at the hub: client had it {waits} s after relink")
        assert backend.started == 3
        # The collector looks for its consumer each 0.25 s at most while the leaf refuses the
        # looks at once (edge_node.consumer_look): 0.01 to 0.02 s measured; 0.45 to 0.70 s
        # when the looks were a second apart by then.
        assert max(waits) < HEAL_S / 2, waits


async def test_a_site_edge_sends_to_the_cloud_again_as_soon_as_its_uplink_is_back(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Workers announce themselves every 2 s here (``MESH_STREAM_HEARTBEAT``; 1 s by default).
    The uplink is down past the node ttl: the site answers locally, /ready says degraded. The
    uplink comes back just after a heartbeat went by at the hub. A user's request for the cloud
    0.3 s after the leaf linked again, and /ready, should find the cloud back: the edge asks
    the workers it saw before it answers locally (a round each 0.1 s at most, waited on 50 ms),
    as it does after its own reconnect. Before, the request went local and /ready said degraded
    until their next heartbeat (1.99 s after the relink). During the cut, a request for the
    cloud still goes local: the leaf says "no responders" to the question at once."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_mesh(topology, heartbeat=2.0) as (_backend, edge, client):
        model = edge.settings.edge.cloud_model
        beat = asyncio.Event()
        operator = topology.hub_settings("operator")
        async with Connection(operator.nats, "op-beats") as op:

            async def on_beat(_msg: object) -> None:
                beat.set()

            await op.nc.subscribe(f"{REGISTRY_UPDATES}.worker.>", cb=on_beat)
            uplink.cut(3600)
            await eventually(
                lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="cloud gone"
            )
            assert (await edge.readiness())["status"] == "degraded"
            cut_off = await client.complete("[tag:d] x", route="cloud", max_tokens=4)
            assert cut_off.path == "local", cut_off.end.fallback
            beat.clear()
            await asyncio.wait_for(beat.wait(), 5)  # a heartbeat the site did not hear
            async with watching(leaf) as relinked:
                uplink.restore()
                linked = await relinked
        await asyncio.sleep(0.3)
        sent = await client.complete("[tag:c] x", route="cloud", max_tokens=4)
        ready = await edge.readiness()
        await eventually(lambda: holds(edge.nodes.serves(model) is True), timeout=15)
        seen = time.monotonic() - linked
        print(
            f"\nuplink back: a cloud request 0.3 s after went {sent.path} "
            f"({sent.end.fallback}); /ready {ready['status']}; workers seen {seen:.2f} s after"
        )
        assert sent.path == "cloud", sent.end.fallback
        assert ready["status"] == "ready", ready
        assert seen < HEAL_S, seen


async def test_an_answer_kept_at_the_hub_in_a_silent_uplink_reaches_its_client_soon_after_relink(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """As the long cut above, but silent (no reset, bytes thrown away: a partition): the
    collector's pull is taken for lost by its heartbeats and its looks for its consumer go
    unanswered, with nothing forwarded to outrun them. The client should have its answer well
    under a second after the leaf links again. Before, the look sent into the silence was
    waited out for the whole request timeout (5 s here): 0.31 and 1.66 s after the relink."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_mesh(topology, request_timeout=5.0) as (backend, _edge, client):
        backend.settings.token_delay_ms = 60
        waits = []
        for i in range(2):  # two rounds: the looks have no fixed phase
            asking = _ask(client, f"q{i}", f"quiet-{i}", tokens=15)
            await eventually(lambda i=i: holds(backend.started > i), what="generating")
            uplink.freeze()
            await eventually(lambda i=i: _answers_at_hub(topology, i + 1), what="kept at the hub")
            await asyncio.sleep(2.5)  # the pull is lost (heartbeats) and looks went unanswered
            async with watching(leaf) as relinked:
                uplink.restore()
                answer = await asyncio.wait_for(asking, 30)
                got = time.monotonic()
                linked = await relinked
            assert answer.path == "cloud" and answer.text == expected_text(f"q{i}", 15)
            waits.append(got - linked)
        print(f"\nsilent uplink, answer kept at the hub: client had it {waits} s after relink")
        assert backend.started == 2
        assert max(waits) < HEAL_S, waits


# -- short cuts and flaps ------------------------------------------------------------------------


async def test_a_short_2s_cut_mid_answer_gives_one_whole_answer_promptly(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """A request that can wait is being generated when the uplink drops for 2 s. The client
    gets one whole, exact answer, generated once, soon after the link is back; asked again by id,
    the same."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=50) as (backend, _e, client):
        asking = _ask(client, "s", "short-1", tokens=30)
        await eventually(lambda: holds(backend.started >= 1), what="generating")
        await asyncio.sleep(0.3)
        async with watching(leaf) as relinked:
            uplink.cut(2.0)
            answer = await asyncio.wait_for(asking, 30)
            got = time.monotonic()
            linked = await relinked
        assert answer.path == "cloud" and answer.text == expected_text("s", 30)
        assert (await client.answer("short-1")).text == expected_text("s", 30)
        assert backend.started == 1
        print(f"\n2 s cut mid answer: answered {got - linked:.2f} s after relink")
        assert got - linked < HEAL_S + 0.5  # the rest of the generation may still be running


async def test_a_2s_cut_mid_interactive_cloud_answer_ends_in_one_whole_answer(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """An interactive answer streams from the cloud through the site's edge when the uplink
    drops for 2 s; the worker generates the rest meanwhile. The user reads one whole, exact
    answer (the cloud's continued, or the edge's own from the start, said so), never a truncated
    or doubled one, and it ends well under a second after the link is back."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=40) as (_b, _e, client):
        events: list[object] = []

        async def read() -> None:
            async for event in client.stream("[tag:z] x", route="cloud", max_tokens=40):
                events.append(event)

        reading = asyncio.ensure_future(read())
        await eventually(lambda: holds(len(events) >= 10), what="the answer streaming")
        async with watching(leaf) as relinked:
            uplink.cut(2.0)
            await asyncio.wait_for(reading, 30)
            done = time.monotonic()
            linked = await relinked
        end = events[-1]
        assert isinstance(end, EndEvent), end
        restarts = [e for e in events if isinstance(e, RestartEvent)]
        text = "".join(e.text for e in events if isinstance(e, TokenEvent))
        if restarts:  # started over: the text after the last restart is the answer
            last = max(i for i, e in enumerate(events) if isinstance(e, RestartEvent))
            text = "".join(e.text for e in events[last:] if isinstance(e, TokenEvent))
        assert text == expected_text("z", 40), (end.path, len(restarts))
        print(
            f"\n2 s cut mid interactive answer: path {end.path}, restarts {len(restarts)}, "
            f"ended {done - linked:+.2f} s from relink"
        )
        assert done - linked < HEAL_S  # generated whole during the cut: only the catch-up left


async def test_a_flapping_uplink_loses_and_doubles_nothing(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Eight requests that can wait are held during a cut; the uplink then flaps (0.4 s up,
    0.6 s down, five times) while they are forwarded and answered. Each client gets exactly its
    own whole answer, each generated once, each forwarded once; asked again by id, the same."""
    uplink = topology.uplinks[SITE]
    async with running_mesh(topology):
        edge = topology.edges[SITE]
        assert edge.site is not None and topology.backend is not None
        model = edge.settings.edge.cloud_model
        async with MeshClient(settings=topology.site_settings(SITE, "client")) as client:
            warm = await client.complete("[tag:w] x", route="cloud", max_tokens=3, deferrable=True)
            assert warm.path == "cloud"
            uplink.cut(3600)
            await eventually(
                lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="cloud gone"
            )
            started = topology.backend.started
            ids = [f"flap-{i}" for i in range(8)]
            asks = []
            for i, rid in enumerate(ids):
                asks.append(_ask(client, f"f{i}", rid, tokens=8, deadline_s=60))
                await eventually(functools.partial(_held, edge, i + 1), timeout=10)
            for _ in range(5):
                uplink.restore()
                await asyncio.sleep(0.4)
                uplink.cut(0.6)
                await asyncio.sleep(0.6)
            uplink.restore()
            answers = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 60)
            for i, answer in enumerate(answers):
                assert not isinstance(answer, BaseException), (i, answer)
                assert answer.text == expected_text(f"f{i}", 8), (i, answer.text)
            for i, rid in enumerate(ids):
                assert (await client.answer(rid)).text == expected_text(f"f{i}", 8)
        forwarded = Counter(edge.site.links.forward_order)
        print(
            f"\nflaps: generated {topology.backend.started - started}, "
            f"forwarded {sum(forwarded[r] for r in ids)}"
        )
        assert topology.backend.started - started == len(ids)
        assert all(forwarded[r] == 1 for r in ids), forwarded


# -- the hub restarted on its store --------------------------------------------------------------


async def _restart_hub(topo: Topology, down_s: float) -> None:
    conf = topo.tmp / "hub.conf"
    text = conf.read_text()
    if "port: -1" in text:
        conf.write_text(text.replace("port: -1", f"port: {topo.hub.port}", 1))
    await topo.hub.kill()
    await asyncio.sleep(down_s)
    await topo.hub.restart()


async def test_a_request_held_while_the_hub_restarts_is_answered_soon_after_it_is_back(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The hub's nats-server is killed (-9) and restarted on its store 3 s later. A request that
    can wait, sent while the hub is down, is held at the site. Once the leaf links to the
    restarted hub, the request should be answered well under a second later (the worker
    reconnects, the forwarder sends it, the collector brings the answer), generated once."""
    leaf = topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=0) as (backend, edge, client):
        assert edge.site is not None
        warm = _ask(client, "w", "warm-1")
        assert (await asyncio.wait_for(warm, 20)).path == "cloud"
        async with watching(leaf) as relinked:
            conf = topology.tmp / "hub.conf"
            conf.write_text(conf.read_text().replace("port: -1", f"port: {topology.hub.port}", 1))
            await topology.hub.kill()
            asking = _ask(client, "h", "hub-1")
            await eventually(functools.partial(_held, edge, 1), timeout=10, what="held")
            await asyncio.sleep(3.0)
            await topology.hub.restart()
            hub_back = time.monotonic()
            answer = await asyncio.wait_for(asking, 30)
            got = time.monotonic()
            linked = await relinked
        assert answer.text == expected_text("h", 6)
        assert backend.started == 2
        print(
            f"\nhub restarted: leaf linked {linked - hub_back:.2f} s after the hub was ready, "
            f"the held request answered {got - linked:.2f} s after that"
        )
        assert got - linked < HEAL_S, got - linked


async def test_an_answer_kept_at_the_hub_across_its_restart_reaches_its_client_promptly(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """A request that can wait is answered and kept at the hub while the site's uplink is cut;
    then the hub restarts on its store. When the leaf links to the restarted hub, the waiting
    client should have its answer well under a second later, exactly once."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=60) as (backend, _e, client):
        asking = _ask(client, "k", "kept-1", tokens=15)
        await eventually(lambda: holds(backend.started >= 1), what="generating")
        uplink.cut(3600)
        await eventually(lambda: _answers_at_hub(topology, 1), what="kept at the hub")
        await _restart_hub(topology, 1.0)
        await asyncio.sleep(1.0)
        async with watching(leaf) as relinked:
            uplink.restore()
            answer = await asyncio.wait_for(asking, 30)
            got = time.monotonic()
            linked = await relinked
        assert answer.text == expected_text("k", 15)
        assert (await client.answer("kept-1")).text == expected_text("k", 15)
        assert backend.started == 1
        print(
            f"\nanswer kept across a hub restart: client had it {got - linked:.2f} s after relink"
        )
        assert got - linked < HEAL_S, got - linked


# -- the site's leaf restarted -------------------------------------------------------------------


async def test_a_leaf_restart_mid_answer_gives_one_whole_answer_and_heals_promptly(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The site's leaf nats-server is killed (-9) while a request that can wait is generated at
    the hub, and restarted on its store 1 s later. The client gets one whole answer, generated
    once; /ready says ready again, and a new request that can wait is answered, well under a
    second after the leaf links to the hub again."""
    leaf = topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=60) as (backend, edge, client):
        asking = _ask(client, "r", "leaf-1", tokens=20)
        await eventually(lambda: holds(backend.started >= 1), what="generating")
        async with watching(leaf) as relinked:
            await leaf.kill()
            await asyncio.sleep(1.0)
            await leaf.restart()
            linked = await relinked
        answer = await asyncio.wait_for(asking, 30)
        assert answer.text == expected_text("r", 20)

        async def status_ready() -> bool:
            return (await edge.readiness())["status"] == "ready"

        await eventually(status_ready, timeout=15, what="/ready ready")
        ready_at = time.monotonic()
        began = time.monotonic()
        nxt = await asyncio.wait_for(_ask(client, "n", "leaf-2"), 30)
        took = time.monotonic() - began
        assert nxt.text == expected_text("n", 6)
        assert (await client.answer("leaf-1")).text == expected_text("r", 20)
        assert backend.started == 2
        print(
            f"\nleaf restarted: /ready ready {ready_at - linked:.2f} s after relink; "
            f"a new request answered in {took:.2f} s"
        )
        assert ready_at - linked < HEAL_S
        assert took < HEAL_S


async def test_requests_held_across_a_leaf_restart_are_answered_promptly_after_relink(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Three requests that can wait are held (uplink down); the leaf is killed (-9) and
    restarted on its store; then the uplink comes back. Each client gets its own whole answer,
    generated once, and well under a second after the leaf links to the hub again."""
    uplink, leaf = topology.uplinks[SITE], topology.leaves[SITE]
    async with running_mesh(topology):
        edge = topology.edges[SITE]
        assert topology.backend is not None
        model = edge.settings.edge.cloud_model
        uplink.cut(3600)
        await eventually(
            lambda: holds(edge.nodes.serves(model) is False), timeout=15, what="cloud gone"
        )
        async with MeshClient(settings=topology.site_settings(SITE, "client")) as client:
            asks = []
            for i in range(3):
                asks.append(_ask(client, f"q{i}", f"lr-{i}", tokens=4))
                await eventually(functools.partial(_held, edge, i + 1), timeout=10)
            started = topology.backend.started
            await leaf.kill()
            await asyncio.sleep(0.5)
            await leaf.restart()
            await eventually(lambda: holds(edge.conn.connected), timeout=10, what="edge back")
            await asyncio.sleep(1.0)
            async with watching(leaf) as relinked:
                uplink.restore()
                answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
                got = time.monotonic()
                linked = await relinked
            for i, answer in enumerate(answers):
                assert answer.text == expected_text(f"q{i}", 4)
        assert topology.backend.started - started == 3
        # three answers of 150 ms prefill each on a one-slot worker: 0.45 s of the wait
        print(f"\nheld across a leaf restart: all answered {got - linked:.2f} s after relink")
        assert got - linked < HEAL_S + 0.45, got - linked


# -- a forward's publish lost in a silent uplink -------------------------------------------------


@contextlib.asynccontextmanager
async def site_mesh(
    topo: Topology, *, request_timeout: float | None = None, heartbeat: float | None = None
) -> AsyncIterator[tuple[DeterministicBackend, EdgeNode, MeshClient]]:
    """A hub worker (announcing itself each ``heartbeat`` s, its ttl 2.5 heartbeats), site-a's
    edge (with ``request_timeout``: the default is 5 s, the minted test env says 2) once it sees
    the worker, and a client of that edge."""
    extra = {}
    if heartbeat is not None:
        extra = {
            "MESH_STREAM_HEARTBEAT": str(heartbeat),
            "MESH_STREAM_NODE_TTL": str(2.5 * heartbeat),
        }
    worker_settings = topo.hub_settings("worker-w1", **extra)
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        settings = topo.site_settings(SITE)
        if request_timeout is not None:
            settings.nats.request_timeout = request_timeout
        if heartbeat is not None:
            settings.stream.heartbeat = heartbeat
            settings.stream.node_ttl = 2.5 * heartbeat
        econn = await stack.enter_async_context(Connection(settings.nats, f"edge-{SITE}"))
        local = DeterministicBackend(settings.edge.model)
        edge = await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        model = settings.edge.cloud_model
        await eventually(lambda: holds(edge.nodes.serves(model) is True), what="worker seen")
        client = await stack.enter_async_context(
            MeshClient(
                settings=topo.site_settings(SITE, "client"), first_event_timeout=30, idle_timeout=30
            )
        )
        yield backend, edge, client


async def test_a_forward_lost_in_a_silent_uplink_is_sent_again_once_the_hub_answers(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The uplink goes silent for 1.5 s (no reset) just as the site forwards a held request: the
    forward is lost on its way to the hub, while a local user keeps the site busy. The forward
    carries a message id, so it is sent again each second it is not acked, and the hub takes
    it as soon as the uplink carries (here the leaf also relinks, about 1.4 s). Before, the
    site's edge heard its leaf all along (the local user's traffic, heartbeats, registry
    updates), which counted as "the link is alive": the forward was not sent again and waited
    out its whole timeout (5 s)."""
    async with site_mesh(topology, request_timeout=5.0) as (backend, edge, client):
        assert edge.site is not None
        warm = await asyncio.wait_for(_ask(client, "w", "sf-0"), 20)
        assert warm.path == "cloud" and backend.started == 1

        async def busy_site() -> None:  # a local user at the site all along
            while True:
                await client.complete("[tag:l] x", route="local", max_tokens=2)
                await asyncio.sleep(0.1)

        local = asyncio.ensure_future(busy_site())
        try:
            uplink = topology.uplinks[SITE]
            uplink.freeze()
            first = _ask(client, "a", "sf-1")
            await eventually(functools.partial(_held, edge, 1), 10, "the request held")
            await asyncio.sleep(1.5)
            uplink.restore()
            back = time.monotonic()
            await eventually(lambda: holds(backend.started == 2), 10, "the forward at the hub")
            began = time.monotonic() - back
        finally:
            local.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await local
        print(f"\nsilent uplink, busy site: the worker began the forward {began:.2f} s after")
        assert began < 2.0, began
        answer = await asyncio.wait_for(first, 30)
        assert answer.text == expected_text("a", 6)


async def test_held_requests_go_on_promptly_after_a_silent_uplink_swallowed_a_forward(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The uplink goes silent for 1.5 s (a NAT's drop, a partition: no reset, shorter than the
    leaf's 3 pings) just as the site forwards a held request: the forward is lost on its way to
    the hub. A second request that can wait is held behind it (one at a time). Once the uplink
    links again (the proxy threw bytes away mid-stream, which breaks the leaf's TLS: it
    relinks), both clients should have their answers well under a second later: the forward
    carries a message id, so sending it again is safe, and the collector's look for its
    consumer, lost in the silence, is sent again once a forward reaches the hub (it waited out
    the whole request timeout, 5 s here: answers came 4.64 s after the uplink carried again)."""
    async with site_mesh(topology, request_timeout=5.0) as (backend, edge, client):
        assert edge.site is not None
        warm = await asyncio.wait_for(_ask(client, "w", "sw-0"), 20)
        assert warm.path == "cloud"
        uplink = topology.uplinks[SITE]
        uplink.freeze()
        first = _ask(client, "a", "sw-1")
        await eventually(functools.partial(_held, edge, 1), timeout=10, what="the first held")
        second = _ask(client, "b", "sw-2")
        await eventually(functools.partial(_held, edge, 2), timeout=10, what="both held")
        await asyncio.sleep(1.5)
        async with watching(topology.leaves[SITE]) as relinked:
            uplink.restore()  # the bytes it threw away broke the TLS stream: the leaf relinks
            back = time.monotonic()
            a = await asyncio.wait_for(first, 30)
            a_at = time.monotonic()
            b = await asyncio.wait_for(second, 30)
            b_at = time.monotonic()
            linked = await relinked
        assert a.text == expected_text("a", 6) and b.text == expected_text("b", 6)
        a_at, b_at = a_at - linked, b_at - linked
        print(
            f"\nsilent uplink: the leaf linked again {linked - back:.2f} s after it carried again; "
            f"answered {a_at:.2f} and {b_at:.2f} s after that"
        )
        assert backend.started == 3
        assert max(a_at, b_at) < HEAL_S, (a_at, b_at)


async def test_answers_kept_at_the_hub_while_the_leaf_is_down_all_come_once_it_is_back(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Four requests that can wait are forwarded; the site's leaf is killed (-9) as the worker
    answers them, and restarted on its store once the hub keeps all four (and a second more). Every
    client gets its own whole answer once, each generated once, well under a second after the
    leaf is back (the edge redials its leaf every 0.5 s by default, counted in)."""
    leaf = topology.leaves[SITE]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=30) as (backend, edge, client):
        assert edge.site is not None
        asks = [_ask(client, f"d{i}", f"down-{i}", tokens=8) for i in range(4)]
        await eventually(lambda: holds(edge.site.links.forwarded >= 4), what="all forwarded")  # type: ignore[union-attr]
        await leaf.kill()
        await eventually(lambda: _answers_at_hub(topology, 4), what="all kept at the hub")
        await asyncio.sleep(1.0)
        await leaf.restart()
        back = time.monotonic()
        answers = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 30)
        took = time.monotonic() - back
        for i, answer in enumerate(answers):
            assert not isinstance(answer, BaseException), (i, answer)
            assert answer.text == expected_text(f"d{i}", 8)
            assert (await client.answer(f"down-{i}")).text == expected_text(f"d{i}", 8)
        assert backend.started == 4
        assert edge.site.links.collected == 4, edge.site.links.collected
        print(f"\nleaf down while answers were kept at the hub: all four {took:.2f} s after")
        assert took < HEAL_S + 0.5, took
