"""A filled pull request's subscription serves the worker's next pull request
(cloud_node/puller.py ``_spares``, mesh/inline_sub.py ``retarget``; 55ef90d, review S21c).

The premise: JetStream sends nothing more to a filled pull request's inbox, so every later
message there belongs to the next request asked on it. These tests look for the premise failing
at a real nats-server (an expiry racing the last message, a consumer leader change), and for the
puller's bookkeeping going wrong around it (back-pressure, every message delivered once and
promptly, link cuts while spares are held, stop). The review found none: these guard it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from cloud_node.puller import Puller
from mesh.connection import Connection
from mesh.inline_sub import subscribe_inline
from mesh.nats_server import NatsServer
from mesh.testing.chaos import JsCluster
from tests.conftest import make_settings
from tests.helpers import eventually, holds
from tests.test_puller import Slots, _cut_link, _puller, queue  # noqa: F401 (queue: a fixture)

pytestmark = pytest.mark.asyncio


@dataclass
class Answering(Slots):
    """Slots whose answers end by themselves after a short, random time, each end topping up
    as the worker's ``_handle`` does; notes the most held at once and how long each message
    waited in the queue."""

    puller: Puller | None = None
    most: int = 0
    waited: list[float] = field(default_factory=list)
    sent_at: dict[bytes, float] = field(default_factory=dict)
    answering: set[asyncio.Task[None]] = field(default_factory=set)
    longest_s: float = 0.02

    def deliver(self, msg: Msg) -> None:
        super().deliver(msg)
        self.most = max(self.most, self.busy)
        sent = self.sent_at.get(msg.data)
        if sent is not None:
            self.waited.append(time.monotonic() - sent)
        task = asyncio.get_running_loop().create_task(self._answer())
        self.answering.add(task)
        task.add_done_callback(self.answering.discard)

    async def _answer(self) -> None:
        await asyncio.sleep(random.uniform(0, self.longest_s))
        self.busy -= 1
        assert self.puller is not None
        await self.puller.top_up()


async def _ticking(puller: Puller) -> None:
    """The worker's tick (CAPACITY_POLL_S), a bit faster."""
    while True:
        await asyncio.sleep(0.1)
        await puller.tick()


@contextlib.asynccontextmanager
async def _ticked(puller: Puller, slots: Answering) -> AsyncIterator[Puller]:
    """``puller`` started over ``slots`` and ticked as the worker ticks it; stopped after."""
    slots.puller = puller
    await puller.start()
    tick = asyncio.get_running_loop().create_task(_ticking(puller))
    try:
        yield puller
    finally:
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick
        await puller.stop()


async def _ask_one(nc: Client, api: str, expires_s: float) -> tuple[Subscription, list[str | None]]:
    """A 1-message pull request at ``api`` on a fresh inline inbox; what its inbox hears, each
    message's Status header (None for a delivered message)."""
    heard: list[str | None] = []
    inbox = nc.new_inbox()
    sub = await subscribe_inline(
        nc, inbox, lambda m, h=heard: h.append((m.headers or {}).get("Status"))
    )
    request = {"batch": 1, "expires": int(expires_s * 1_000_000_000)}
    await nc.publish(api, json.dumps(request).encode(), reply=inbox)
    await nc.flush()
    return sub, heard


async def _take_left(nc: Client, api: str, timeout: float) -> None:
    """Ack the message an expired request left queued, if any."""
    with contextlib.suppress(Exception):
        left = await nc.request(api, json.dumps({"batch": 1, "no_wait": True}).encode(), timeout)
        if left.data:
            await left.ack()


# -- the premise, at the server -----------------------------------------------------------------


async def test_a_filled_requests_inbox_hears_nothing_more_when_its_expiry_races_the_last_message(
    conn: Connection,
    queue: tuple[str, str],  # noqa: F811
) -> None:
    """A 1-message pull request whose expiry (50 ms) races the message's arrival: the
    inbox gets the message or the 408, never the message and then a status (which, on a
    spare, would end the next request asked there)."""
    stream, subject = queue
    nc = conn.nc
    js = nc.jetstream()
    api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.w"
    filled_then_status = 0
    outcomes: dict[tuple[str | None, ...], int] = {}
    for i in range(40):
        sub, heard = await _ask_one(nc, api, 0.05)
        await asyncio.sleep(0.05 + random.uniform(-0.01, 0.01))
        await js.publish(subject, f"m{i}".encode())
        await asyncio.sleep(0.1)
        await sub.unsubscribe()
        outcomes[tuple(heard)] = outcomes.get(tuple(heard), 0) + 1
        if heard and heard[0] is None and len(heard) > 1:
            filled_then_status += 1
        await _take_left(nc, api, 0.2)
    assert filled_then_status == 0, outcomes
    assert outcomes.get((None,)) and outcomes.get(("408",)), f"the race was not run: {outcomes}"


async def test_a_leader_change_sends_nothing_to_a_filled_requests_inbox(tmp_path: Path) -> None:
    """An R3 consumer whose leader steps down just after a 1-message pull request took
    its message: the inbox hears the message or a 409 (Leadership Change), never both."""
    cluster = JsCluster(tmp_path)
    await cluster.start()
    try:
        settings = make_settings(cluster.url)
        async with Connection(settings.nats, "r3") as c3:
            nc, jsm = c3.nc, c3.jsm()

            async def js_ready() -> bool:
                with contextlib.suppress(Exception):
                    await jsm.account_info()
                    return True
                return False

            await eventually(js_ready, 15, "JetStream in the cluster")
            name = f"R{uuid.uuid4().hex[:6].upper()}"
            await jsm.add_stream(StreamConfig(name=name, subjects=[f"r3.{name}"], num_replicas=3))
            await jsm.add_consumer(
                name,
                ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT, num_replicas=3),
            )
            api = f"$JS.API.CONSUMER.MSG.NEXT.{name}.w"
            both = 0
            for i in range(6):
                sub, heard = await _ask_one(nc, api, 1.0)
                published = asyncio.ensure_future(c3.js.publish(f"r3.{name}", f"m{i}".encode()))
                await asyncio.sleep(random.uniform(0, 0.003))
                with contextlib.suppress(Exception):
                    await nc.request(f"$JS.API.CONSUMER.LEADER.STEPDOWN.{name}.w", b"", 2)
                await published
                await asyncio.sleep(1.2)  # past the request's expiry
                await sub.unsubscribe()
                if None in heard and len(heard) > 1:
                    both += 1
                await _take_left(nc, api, 1.0)
            assert both == 0
    finally:
        await cluster.stop()


# -- the puller's bookkeeping -------------------------------------------------------------------


async def test_a_stream_of_requests_through_spares_keeps_back_pressure_and_loses_nothing(
    conn: Connection,
    queue: tuple[str, str],  # noqa: F811
) -> None:
    """3 slots, pull requests of 0.1 s expiry (so expiries, fills and renewals on
    spare inboxes race all the time), 150 requests in random bursts and gaps, answers of up to
    20 ms: never more held than the slots, every request delivered once, none waiting anywhere
    near ack_wait (30 s: a delivery sent to a request the puller no longer heard would)."""
    stream, subject = queue
    slots = Answering(total=3)
    puller = _puller(conn, stream, slots, 0.1)
    async with _ticked(puller, slots):
        js = conn.nc.jetstream()
        count = 150
        sent = 0
        while sent < count:
            for _ in range(min(random.choice([1, 1, 2, 3, 5]), count - sent)):
                data = f"request {sent}".encode()
                slots.sent_at[data] = time.monotonic()
                await js.publish(subject, data)
                sent += 1
            await asyncio.sleep(random.choice([0.0, 0.005, 0.03, 0.09, 0.11]))
        await slots.wait_for(count, timeout=15)
        await eventually(lambda: holds(slots.busy == 0), 5, "every answer ended")
    datas = [m.data for m in slots.delivered]
    assert len(datas) == len(set(datas)) == count, "a request delivered twice (redelivered)"
    assert slots.most <= slots.total, f"{slots.most} held at once on {slots.total} slots"
    assert max(slots.waited) < 3.0, f"a request waited {max(slots.waited):.1f}s in the queue"


async def test_spares_held_through_a_cut_serve_the_requests_after_it(
    nats_server: NatsServer,
    conn: Connection,
    queue: tuple[str, str],  # noqa: F811
) -> None:
    """A 2-slot worker whose filled requests left spares cuts its link (nats-py
    subscribes to them again on the new connection): requests after the reconnect come through
    them, promptly, no more at once than the slots, and no subscription is added for them; a
    stopped puller leaves none behind."""
    stream, subject = queue
    slots = Answering(total=2, longest_s=0.0)
    async with _cut_link(nats_server) as (proxy, cut):
        before = set(cut.nc._subs)
        puller = _puller(cut, stream, slots, 0.3)
        slots.puller = puller
        await puller.start()
        js = conn.nc.jetstream()
        for i in range(6):  # one after another: each fills a request, its inbox a spare
            await js.publish(subject, f"a{i}".encode())
            await slots.wait_for(i + 1)
        await eventually(lambda: holds(slots.busy == 0), 5, "answers ended")
        subs_then = len(cut.nc._subs)
        reconnects = cut.reconnects
        proxy.cut(0.4)
        await eventually(lambda: holds(cut.reconnects > reconnects), 10, "the link back")
        puller.forget()
        await puller.measure()
        await puller.top_up()
        for i in range(6):
            data = f"b{i}".encode()
            slots.sent_at[data] = time.monotonic()
            await js.publish(subject, data)
        await slots.wait_for(12, timeout=10)
        await eventually(lambda: holds(slots.busy == 0), 5, "answers ended")
        assert slots.most <= 2
        assert max(slots.waited) < 3.0
        assert len(cut.nc._subs) <= subs_then + 2  # lingering ones only, for a moment
        await puller.stop()
        assert set(cut.nc._subs) == before


async def test_a_delivery_during_stop_on_a_request_asked_on_a_spare_is_handed_back_at_once(
    conn: Connection,
    queue: tuple[str, str],  # noqa: F811
) -> None:
    """A request asked on a spare inbox is open when the puller stops; a message
    published then reaches it while it drains: it is handed back (nak) and another puller has
    it promptly, not after ack_wait (30 s)."""
    stream, subject = queue
    slots = Slots(total=1)
    puller = _puller(conn, stream, slots, 5.0)
    await puller.start()
    js = conn.nc.jetstream()
    await js.publish(subject, b"first")
    await slots.wait_for(1)
    slots.busy -= 1
    await puller.top_up()
    assert puller._subs and not getattr(puller, "_spares", [])  # asked on the spare's inbox
    await conn.nc.flush()
    stopping = asyncio.get_running_loop().create_task(puller.stop())
    await js.publish(subject, b"second")
    await stopping
    other = Slots(total=1)
    taker = _puller(conn, stream, other, 5.0)
    await taker.start()
    try:
        await other.wait_for(1, timeout=5)
    finally:
        await taker.stop()
    assert [m.data for m in slots.delivered] == [b"first"]
    assert [m.data for m in other.delivered] == [b"second"]
