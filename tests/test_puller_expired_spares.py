"""An expired pull request's inbox (its 408) serves the worker's next pull request
(cloud_node/puller.py, d4439c8; review S23b), as a filled one's does (tests/test_puller_spares.py).

The premise: JetStream sends nothing more to an expired request's inbox after its 408, so every
later message there belongs to the next request asked on it. These look for it failing at a
real nats-server (a partly filled request whose expiry races messages and redeliveries), and for
the puller's bookkeeping going wrong around it (back-pressure, the spares' bound and stop, link
cuts, the short expiries of promised slots). The review found none: these guard it. (Its check
of the premise at a 3-node cluster's leader changes, which also held, is not kept: minutes of
stepdowns for a guarantee of nats-server's own.)"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from cloud_node.puller import MAX_REQUESTS
from mesh.connection import Connection
from mesh.inline_sub import subscribe_inline
from mesh.nats_server import NatsServer
from tests.helpers import eventually, holds
from tests.test_puller import _cut_link, _puller
from tests.test_puller_spares import Answering, _ticked

pytestmark = pytest.mark.asyncio


async def _stream(conn: Connection, **consumer: object) -> tuple[str, str]:
    name = f"S23B{uuid.uuid4().hex[:8].upper()}"
    subject = f"s23b.{name}"
    jsm = conn.jsm()
    await jsm.add_stream(StreamConfig(name=name, subjects=[subject]))
    cfg = {"durable_name": "w", "ack_policy": AckPolicy.EXPLICIT, "ack_wait": 30, **consumer}
    await jsm.add_consumer(name, ConsumerConfig(**cfg))  # type: ignore[arg-type]
    return name, subject


# -- the premise at one server ------------------------------------------------------------------


async def test_a_partly_filled_expired_requests_inbox_hears_nothing_after_its_408(
    conn: Connection,
) -> None:
    """Requests of batch 3 whose 0.1 s expiry races messages published around it, on a consumer
    with max_ack_pending 2 and an ack_wait of 0.2 s (redeliveries racing expiries), messages
    left unacked: each request's inbox hears its messages, then its 408, and nothing after."""
    stream, subject = await _stream(conn, max_ack_pending=2, ack_wait=0.2)
    nc = conn.nc
    js = nc.jetstream()
    api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.w"
    after = 0
    shapes: dict[tuple[str | None, ...], int] = {}
    for i in range(24):
        heard: list[str | None] = []
        inbox = nc.new_inbox()
        sub = await subscribe_inline(
            nc, inbox, lambda m, h=heard: h.append((m.headers or {}).get("Status"))
        )
        req = {"batch": 3, "expires": 100_000_000}
        await nc.publish(api, json.dumps(req).encode(), reply=inbox)
        await nc.flush()
        await js.publish(subject, f"a{i}".encode())
        await asyncio.sleep(0.1 + random.uniform(-0.01, 0.01))
        await js.publish(subject, f"b{i}".encode())
        await asyncio.sleep(0.12)
        await sub.unsubscribe()
        shapes[tuple(heard)] = shapes.get(tuple(heard), 0) + 1
        if "408" in heard and heard.index("408") != len(heard) - 1:
            after += 1
    assert after == 0, shapes
    assert any("408" in s and None in s for s in shapes), f"no partly filled expiry: {shapes}"


# -- the puller's bookkeeping ------------------------------------------------------------------


async def test_expiring_partial_batches_with_redeliveries_keep_back_pressure(
    conn: Connection,
) -> None:
    """3 slots, requests of batch 2 expiring every 0.1 s (so expiries of partly filled requests
    and renewals on their inboxes race), max_ack_pending 2 and every 4th message left unacked
    (redelivered after 0.3 s): never more held than the slots; every message delivered."""
    stream, subject = await _stream(conn, max_ack_pending=2, ack_wait=0.3)
    slots = Answering(total=3)
    puller = _puller(conn, stream, slots, 0.1, batch=2)
    async with _ticked(puller, slots):
        js = conn.nc.jetstream()
        count = 60
        sent = 0
        while sent < count:
            for _ in range(min(random.choice([1, 2, 3]), count - sent)):
                await js.publish(subject, f"request {sent}".encode())
                sent += 1
            await asyncio.sleep(random.choice([0.0, 0.03, 0.09, 0.11]))

        async def all_in() -> bool:
            return {m.data for m in slots.delivered} >= {
                f"request {i}".encode() for i in range(count)
            }

        await eventually(all_in, 15, "every request delivered")
        await eventually(lambda: holds(slots.busy == 0), 5, "every answer ended")
    assert slots.most <= slots.total, f"{slots.most} held at once on {slots.total} slots"


async def test_expiry_spares_stay_bounded_and_stop_leaves_no_subscription(
    conn: Connection,
) -> None:
    """8 slots covered by 8 requests of one message (batch 1), 0.1 s expiries, deliveries
    between them: spares never exceed MAX_REQUESTS, subscriptions never exceed 2 x
    MAX_REQUESTS, a stopped puller leaves none."""
    stream, subject = await _stream(conn)
    before = set(conn.nc._subs)
    slots = Answering(total=8, longest_s=0.05)
    puller = _puller(conn, stream, slots, 0.1, batch=1)
    slots.puller = puller
    await puller.start()
    js = conn.nc.jetstream()
    most_spares = most_subs = 0
    try:
        for i in range(20):
            await js.publish(subject, f"r{i}".encode())
            await asyncio.sleep(random.choice([0.0, 0.05, 0.11]))
            most_spares = max(most_spares, len(puller._spares))
            most_subs = max(most_subs, len(set(conn.nc._subs) - before))
        await slots.wait_for(20)
    finally:
        await puller.stop()
    assert most_spares <= MAX_REQUESTS
    assert most_subs <= 2 * MAX_REQUESTS
    assert set(conn.nc._subs) == before


async def test_cuts_while_requests_expire_deliver_once_within_slots(
    nats_server: NatsServer, conn: Connection
) -> None:
    """A 2-slot worker whose 0.2 s requests expire (their inboxes spares) through three
    link cuts of 0.3 s (expiries falling inside them, their 408s lost): each request after
    is delivered once, promptly, no more at once than the slots; stop leaves nothing."""
    stream, subject = await _stream(conn)
    slots = Answering(total=2, longest_s=0.0)
    async with _cut_link(nats_server) as (proxy, cut):
        before = set(cut.nc._subs)
        puller = _puller(cut, stream, slots, 0.2)
        async with _ticked(puller, slots):
            js = conn.nc.jetstream()
            n = 0
            for _ in range(3):
                await asyncio.sleep(random.uniform(0.25, 0.5))
                reconnects = cut.reconnects
                proxy.cut(0.3)
                await eventually(lambda r=reconnects: holds(cut.reconnects > r), 10, "link back")
                puller.forget()
                for _ in range(3):
                    data = f"m{n}".encode()
                    slots.sent_at[data] = time.monotonic()
                    await js.publish(subject, data)
                    n += 1
                await slots.wait_for(n, timeout=5)
        datas = [m.data for m in slots.delivered]
        assert len(datas) == len(set(datas)) == n
        assert slots.most <= 2
        assert max(slots.waited) < 3.0
        assert set(cut.nc._subs) == before


async def test_promise_short_expiries_cycle_on_spares_and_deliver_once(conn: Connection) -> None:
    """Requests asked with the promises' shortest expiry (10 ms, ``Promises.expiry``) expire
    and are renewed on their own inboxes about 100 times a second; 2 slots, messages
    published into that churn: each delivered once, never more held than the slots, and no
    subscription made per expiry."""
    stream, subject = await _stream(conn)
    slots = Answering(total=2, longest_s=0.03)
    puller = _puller(conn, stream, slots, 0.5, expiry=lambda: 0.01)
    slots.puller = puller
    await puller.start()
    await conn.nc.flush()
    made, asked = conn.nc._sid, puller._next
    js = conn.nc.jetstream()
    try:
        for i in range(30):
            await js.publish(subject, f"p{i}".encode())
            await asyncio.sleep(random.choice([0.0, 0.012, 0.03]))
        await slots.wait_for(30)
        await eventually(lambda: holds(slots.busy == 0), 5, "answers ended")
    finally:
        await puller.stop()
    datas = [m.data for m in slots.delivered]
    assert len(datas) == len(set(datas)) == 30
    assert slots.most <= 2
    assert puller._next - asked > 30, "the expiries were not run"
    assert conn.nc._sid - made <= MAX_REQUESTS
