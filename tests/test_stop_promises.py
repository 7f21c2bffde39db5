"""Workers stopping at once hand over no more answers than their peers have free slots, each
slot promised once by the peer itself (``cloud_node.promises``, ``mesh.registry.claim_room``),
whatever the registry's heartbeats do meanwhile. Review S19b wrote these against the slot
reservations in the registry bucket (f53932e, 6fb2abc), where the first failed. Real
nats-server, real workers on the deterministic backend."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.registry import NodeInfo, node_key, open_bucket
from mesh.testing.chaos import Tally, ask
from protocol.subjects import REGISTRY_UPDATES, model_token, worker_reserve_subject
from tests.conftest import make_settings


def _engine(slots: int, delay_ms: int = 20) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=slots, token_delay_ms=delay_ms, faults=False)
    )


def _cfg(url: str, node: str, **overrides: object) -> MeshSettings:
    settings = make_settings(url, **{"worker__drain_grace": 10.0, **overrides})
    settings.worker.node_id = node
    return settings


async def _worker(
    stack: contextlib.AsyncExitStack, settings: MeshSettings, slots: int
) -> tuple[Worker, Connection]:
    conn = await stack.enter_async_context(Connection(settings.nats, settings.worker.node_id))
    worker = Worker(settings, conn, _engine(slots))
    await worker.start()
    stack.push_async_callback(worker.stop)
    return worker, conn


async def _hung_peer(
    conn: Connection, node: str, model: str, free: int, asked: Callable[[], None] = lambda: None
) -> Any:
    """A registry entry in ``model``'s pool saying ``free`` slots, whose reserve endpoint hears
    the ask and never answers (a peer frozen or cut off less than the entry's TTL ago): every
    claim that asks it waits ASK_S (0.5 s) on it."""
    kv = await open_bucket(conn, 30.0)
    info = NodeInfo(node_id=node, role="worker", models=[model], slots=max(free, 1), free=free)
    await kv.put(node_key("worker", node, model_token(model)), info.model_dump_json().encode())

    async def heard(_msg: Any) -> None:
        asked()

    return await conn.nc.subscribe(worker_reserve_subject(node), cb=heard)


# Before the fix (heal; the promise of f53932e): a reservation key named the peer's registry entry
# by its stream sequence (handback.=room.<pool>.<peer>.<seq>.<n>), and every heartbeat is a new
# sequence. Two workers stopping at once whose registry reads fall on either side of one of the
# peer's heartbeats reserve differently named keys for the SAME free slot: both win, and the peer's
# live status says the slot is still free to both (neither has handed its answer over yet). Each
# hands one answer to a peer with one free slot; the second stands still in the queue until the
# first ends (here ~2 s of silence; the promise is none over ~1 s). The window is the claim's
# length: a few ms when every peer answers its status ask at once (likely with many peers, each
# heartbeating every second), 0.5 s when one peer is hung (used here to place the heartbeat
# deterministically). Now the peer promises its slots in its own event loop, and the hung peer hears
# the reserve ask instead (naming by the deliveries a peer took, tried first, still promised a slot
# twice when one stop read the peer after another stop's answer reached it).
async def test_two_stops_straddling_a_peer_heartbeat_reserve_its_one_slot_once(
    own_server: NatsServer,
) -> None:
    url = own_server.url
    model = make_settings(url).worker.model.name
    async with contextlib.AsyncExitStack() as stack:
        w1, _c1 = await _worker(stack, _cfg(url, "leave-1"), slots=1)
        client = await stack.enter_async_context(
            MeshClient(settings=make_settings(url), first_event_timeout=20, idle_timeout=20)
        )
        started = [asyncio.Event(), asyncio.Event()]
        a = asyncio.ensure_future(ask(client, "a", 120, via="cloud", first_token=started[0]))
        stack.callback(a.cancel)
        await asyncio.wait_for(started[0].wait(), 10)
        w2, _c2 = await _worker(stack, _cfg(url, "leave-2"), slots=1)
        b = asyncio.ensure_future(ask(client, "b", 120, via="cloud", first_token=started[1]))
        stack.callback(b.cancel)
        await asyncio.wait_for(started[1].wait(), 10)
        assert len(w1.handler.inflight) == 1 and len(w2.handler.inflight) == 1
        # The peer that stays: ONE free slot, heartbeating every 0.2 s.
        _p, pconn = await _worker(stack, _cfg(url, "stay", stream__heartbeat=0.2), slots=1)
        asks = asyncio.Queue[None]()
        sub = await _hung_peer(pconn, "hung", model, 2, lambda: asks.put_nowait(None))
        stack.push_async_callback(sub.unsubscribe)
        beats = await pconn.nc.subscribe(
            f"{REGISTRY_UPDATES}.{node_key('worker', 'stay', model_token(model))}"
        )
        stack.push_async_callback(beats.unsubscribe)

        stop1 = asyncio.ensure_future(w1.stop())
        await asyncio.wait_for(asks.get(), 5)  # leave-1 read the registry, asks its peers
        while True:  # drop beats queued before; wait for the peer's next one
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(beats.next_msg(timeout=0), 0.01)
                continue
            break
        await beats.next_msg(timeout=2)
        assert not stop1.done()  # leave-1 still in its claim
        stop2 = asyncio.ensure_future(w2.stop())
        await asyncio.wait_for(asyncio.gather(stop1, stop2), 20)
        tally = Tally()
        for outcome in await asyncio.wait_for(asyncio.gather(a, b), 30):
            tally.add(outcome)
    silences = sorted(round(o.longest_silence or 0.0, 2) for o in tally.outcomes)
    print(f"longest silence per answer: {silences}")
    tally.assert_sound()
    assert all(o.kind == "correct" for o in tally.outcomes), tally.outcomes
    # One answer continued on the peer's free slot, the other drained where it was.
    assert max(silences) < 1.0, f"longest silence per answer: {silences}"


# Guard (passes): ten workers, one answer each, stopped at once beside one peer with 3 free slots:
# exactly 3 reservations, every answer whole with no silence over 1 s, the stops bounded (~3 s:
# the 7 that drain).
async def test_many_workers_stopping_at_once_hand_over_exactly_the_peers_free_slots(
    own_server: NatsServer,
) -> None:
    url = own_server.url
    n = 10
    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            MeshClient(settings=make_settings(url), first_event_timeout=20, idle_timeout=20)
        )
        leaving = []
        pending = []
        for i in range(n):
            w, _c = await _worker(stack, _cfg(url, f"leave-{i}"), slots=1)
            leaving.append(w)
            ev = asyncio.Event()
            task = asyncio.ensure_future(ask(client, f"m{i}", 150, via="cloud", first_token=ev))
            stack.callback(task.cancel)
            pending.append(task)
            await asyncio.wait_for(ev.wait(), 10)
        assert all(len(w.handler.inflight) == 1 for w in leaving)
        stay, _pconn = await _worker(stack, _cfg(url, "stay"), slots=3)
        began = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(w.stop() for w in leaving)), 30)
        took = time.monotonic() - began
        held = stay.counts.stats.fetched  # every delivery it took was an answer handed over
        tally = Tally()
        for outcome in await asyncio.wait_for(asyncio.gather(*pending), 40):
            tally.add(outcome)
    silences = sorted(round(o.longest_silence or 0.0, 2) for o in tally.outcomes)
    print(f"stops took {took:.2f}s; silences {silences}; handed over {held}")
    tally.assert_sound()
    assert all(o.kind == "correct" for o in tally.outcomes), tally.outcomes
    assert held == 3, held
    assert max(silences) < 1.0, silences
    assert took < 6.0, took
