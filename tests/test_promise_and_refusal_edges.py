"""Peers promising free slots to a stopping worker, a hub's refusals and a site's stream limits
at their edges: silent peers, a new request in the promise's window, a hub's 429 burst, a small
site store. Review S19d wrote these; each failed on the code it reviewed (0a05968, 929492e; the
comment above each says what it showed, "Before the fix"). One is left open, strict xfail: a
new request can take a slot promised to a stopping worker's answer. Real nats-server, real
workers on the deterministic backend."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from nats.js.errors import APIError

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.js_refused import for_now as _for_now
from mesh.nats_server import NatsServer
from mesh.provision import provision
from mesh.queue import publish_request
from mesh.testing.chaos import Tally, ask
from protocol.errors import MeshError
from protocol.messages import ChatMessage, InferRequest
from protocol.subjects import model_token
from tests.conftest import make_settings
from tests.test_edge_site import Topology, topology  # noqa: F401 - topology is a fixture
from tests.test_security import certs  # noqa: F401 - a fixture
from tests.test_stop_promises import _cfg, _hung_peer, _worker

# -- shared bits -------------------------------------------------------------------------------


# -- 0a05968: promises -------------------------------------------------------------------------


# Before the fix (heal; the stop's bound). claim_room asks the peers one at a time, ASK_S (0.5 s)
# each, with no bound on the whole: every peer whose registry entry is still fresh but that does not
# answer (a host frozen or cut off less than node_ttl ago: its subscription still stands at the
# server, so the ask waits out its timeout rather than hearing "no responders") adds 0.5 s, and a
# silent peer that was idle sorts FIRST (its stale entry says the most room). Here 8 such peers: the
# claim alone takes ~4 s (its predecessor asked them all at once: 0.5 s), and the stop then still
# grants the drain its whole `drain_grace` after it. With the default grace (30 s) and compose's
# stop_grace_period (35 s), ~10 silent peers get the worker SIGKILLed mid-drain.
# Fix: mesh/registry.py:claim_room - bound the whole claim (e.g. one ASK_S for all: ask the
# peers concurrently but each for what is still wanted, or a deadline over the sequence, or
# count the claim's time against drain_grace in Worker.stop).
async def test_a_stop_beside_silent_peers_is_not_delayed_half_a_second_per_peer(
    own_server: NatsServer,
) -> None:
    url = own_server.url
    grace = 1.0
    model = make_settings(url).worker.model.name
    async with contextlib.AsyncExitStack() as stack:
        leaving, lconn = await _worker(stack, _cfg(url, "leave", worker__drain_grace=grace), 1)
        client = await stack.enter_async_context(
            MeshClient(settings=make_settings(url), first_event_timeout=20, idle_timeout=20)
        )
        started = asyncio.Event()
        answer = asyncio.ensure_future(ask(client, "a", 400, via="cloud", first_token=started))
        stack.callback(answer.cancel)
        await asyncio.wait_for(started.wait(), 10)
        asked: list[float] = []
        for i in range(8):
            sub = await _hung_peer(lconn, f"silent-{i}", model, 2, lambda: asked.append(1))
            stack.push_async_callback(sub.unsubscribe)
        began = time.monotonic()
        await asyncio.wait_for(leaving.stop(), 30)
        took = time.monotonic() - began
    print(f"stop took {took:.2f}s with grace {grace}s; silent peers asked: {len(asked)}")
    assert took < grace + 1.5, f"the stop took {took:.2f}s for a {grace}s drain grace"


# Before the fix (heal; the promise S19b made). A peer's promise is kept by ANY next delivery
# (Worker._accept -> Promises.kept). A new request that reaches the peer between its grant and the
# stopping worker's hand-back takes the promised slot; the handed-over answer then stands still in
# the queue until that new request's whole answer ends: the silence S19a/S19b removed, back under
# ordinary traffic (here the window is widened deterministically: the stopping worker, having one
# promise from the peer, asks a second, silent peer for its second answer, 0.5 s; any window works,
# a few ms under load). The client sees ~3 s of silence mid-answer (a whole answer of the other
# request; with an SDK idle_timeout under that, a timeout instead of its answer), where draining it
# here (no promise counted) had none.
# Fixed: a peer asks for its promises out as well as its free slots (Promises.to_pull, bounded
# in tests/test_promise_pulls.py and tests/test_promise_full_engine.py): the newcomer and the
# answer handed over are both served (b's silence 2.65 s before, 0.03 s).
async def test_a_new_request_does_not_take_the_slot_promised_to_a_stopping_worker(
    own_server: NatsServer,
) -> None:
    url = own_server.url
    model = make_settings(url).worker.model.name
    async with contextlib.AsyncExitStack() as stack:
        leaving, lconn = await _worker(stack, _cfg(url, "leave"), slots=2)
        client = await stack.enter_async_context(
            MeshClient(settings=make_settings(url), first_event_timeout=20, idle_timeout=20)
        )
        pending = []
        for tag in ("a", "b"):
            ev = asyncio.Event()
            task = asyncio.ensure_future(ask(client, tag, 150, via="cloud", first_token=ev))
            stack.callback(task.cancel)
            pending.append(task)
            await asyncio.wait_for(ev.wait(), 10)
        assert len(leaving.handler.inflight) == 2
        # The peer that stays: one free slot (its entry says 1; the silent one's says 0, so the
        # stopping worker asks the real peer first, then the silent one).
        stay, _pconn = await _worker(stack, _cfg(url, "stay"), slots=1)
        newcomer: list[asyncio.Future[Any]] = []

        def traffic() -> None:  # an ordinary new request, sent while the claim goes on
            newcomer.append(asyncio.ensure_future(ask(client, "n", 150, via="cloud")))

        sub = await _hung_peer(lconn, "silent", model, 0, traffic)
        stack.push_async_callback(sub.unsubscribe)
        await asyncio.wait_for(leaving.stop(), 30)
        assert newcomer, "the silent peer was never asked"
        stack.callback(newcomer[0].cancel)
        tally = Tally()
        for outcome in await asyncio.wait_for(asyncio.gather(*pending, newcomer[0]), 40):
            tally.add(outcome)
    rounded = [round(o.longest_silence or 0.0, 2) for o in tally.outcomes]
    silences = dict(zip("abn", rounded, strict=True))
    print(f"longest silence per answer: {silences}; the peer took {stay.counts.stats.fetched}")
    tally.assert_sound()
    assert all(o.kind == "correct" for o in tally.outcomes), tally.outcomes
    assert max(silences.values()) < 1.0, f"longest silence per answer: {silences}"


# -- 929492e: refusals -------------------------------------------------------------------------


async def _flooded_server(tmp_path: Path) -> NatsServer:
    conf = tmp_path / "ingest.conf"
    conf.write_text(
        f'listen: 127.0.0.1:-1\njetstream {{ store_dir: "{tmp_path / "js"}"\n'
        "  max_buffered_msgs: 1 }\n"  # a stream's ingest queue: past it, 429 Too Many Requests
    )
    return NatsServer(config=str(conf), ready_timeout=15)


# Before the fix (typed: a "for now" told "for good"). nats-server answers a publish that finds a
# stream's ingest queue full with code 429, err_code 10167, "too many requests" (a burst: the same
# publish succeeds a moment later; nats-server >= 2.10.25/2.11). 929492e made every 4xx that is not
# full/leaderless/too large `refused_for_good`: mesh.queue.publish_request now raises `unavailable`
# with retryable=False ("JetStream refused the request: too many requests") where it was retryable;
# and the site forwarder's _for_now says "for good", so a held request that meets the burst (a
# site's backlog forwarded as its uplink returns) is answered with that non-retryable error, kept
# for a week under its id. Here 1000 publishes at once, most refused.
# Fix: mesh/js_refused.py - treat err_code 10167 / code 429 as for now (e.g. in is_full, or a
# `for_now()` shared by mesh.queue and edge_node.site_links._for_now), as overloaded with a
# retry_after.
async def test_a_hub_ingest_burst_429_is_told_retryable_not_refused_for_good(
    tmp_path: Path,
) -> None:
    async with await _flooded_server(tmp_path) as server:
        settings = make_settings(server.url)
        async with Connection(settings.nats, "op") as conn:
            await provision(conn.jsm(), settings.stream, [settings.worker.model.name])
            model = settings.worker.model.name

            async def one() -> MeshError | None:
                req = InferRequest(model=model, messages=[ChatMessage(role="user", content="hi")])
                try:
                    await publish_request(conn, settings.stream, req, "anon")
                except MeshError as err:
                    return err
                return None

            errors = [e for e in await asyncio.gather(*(one() for _ in range(1000))) if e]
            # The same refusal as the site's forwarder meets it (a raw APIError).
            raw: list[APIError] = []
            js = conn.nc.jetstream()

            async def raw_one(i: int) -> None:
                try:
                    await js.publish(f"mesh.v1.infer.{model_token(model)}.raw", b"x")
                except APIError as exc:
                    raw.append(exc)

            await asyncio.gather(*(raw_one(i) for i in range(1000)))
    assert errors, "no publish was refused (the burst did not fill the ingest queue)"
    assert raw and raw[0].code == 429, raw[:1]
    told = {(e.code.value, e.retryable, e.message) for e in errors}
    print(f"told: {told}")
    # Both: the SDK/edge's publish, and the site's forwarder (which keeps the answer a week).
    assert (all(e.retryable for e in errors), _for_now(raw[0])) == (True, True), (told, raw[0])
    # And it says what it is: a burst, not a full queue (the full queue's retry_after is longer).
    assert all("too many at once" in e.message and "full" not in e.message for e in errors), told


# Before the fix (heal: an upgraded site cannot start). 929492e gave the site's streams byte limits:
# MESH_KEPT max_bytes = kept_max_bytes (1 GiB), MESH_OUTBOX 256 MiB, MESH_CLAIMS 128 MiB. A stream
# with max_bytes RESERVES that much of the server's JetStream store (nats-server checks
# js.storeReserved + max_bytes against max_file_store at create/update); without a limit it reserved
# nothing. A site's leaf with less than ~1.4 GiB of JetStream store (max_file_store, or by default
# 75% of the disk free when the leaf starts: a small edge box) now refuses MESH_KEPT: "insufficient
# storage resources available", and the edge does not start at all (before: it started; an existing
# site's stream update is refused the same way). Here the site's leaf has max_file_store 1G.
# Fix: edge_node/site.py:SiteStore._provision / mesh/kept.py - fit the limits to the site's store
# (read the account/server JetStream limits, e.g. `account_info().limits`/reserved, and cap
# each max_bytes to a share of what is free), or fall back to no byte limit with a warning when
# the reservation is refused; at least start the edge without its site's keeping rather than
# not at all.
async def test_an_edge_site_with_a_1g_jetstream_store_still_starts(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    site = "site-b"
    await topology.leaves[site].stop()
    conf = topology.tmp / f"leaf-{site}.small.conf"
    text = (
        topology.minted.leaf_confs[site]
        .read_text()
        .replace("port: 4222", "port: -1")
        .replace(
            'store_dir: "/data/jetstream"',
            f'store_dir: "{topology.tmp / (site + "-small")}"\n  max_file_store: 1G',
        )
    )
    conf.write_text(text)
    leaf = await NatsServer(config=str(conf)).start()
    topology.leaves[site] = leaf
    settings = topology.site_settings(site)
    settings.edge.http_port = -1
    started: MeshError | None = None
    async with Connection(settings.nats, f"edge-{site}") as econn:
        local = DeterministicBackend(settings.edge.model)
        edge = EdgeNode(settings, econn, local, HeuristicRouter())
        try:
            await asyncio.wait_for(edge.start(), 30)
        except MeshError as err:
            started = err
        finally:
            with contextlib.suppress(Exception):
                await edge.stop()
    assert started is None, f"the edge did not start: {started}"
