"""The worker's pull consumer (cloud_node.puller) against a real JetStream: which free slots it
keeps covered by pull requests, and so how fast a burst of requests reaches the worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from cloud_node.puller import Puller
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings
from tests.helpers import ThreadWatcher, eventually

pytestmark = pytest.mark.asyncio

SLOTS = 8
LONG = 60.0
"""Pull requests that outlive the test: a message can only come through a request open now,
never through one issued again after an expiry."""


@dataclass
class Slots:
    """A worker's slots as the puller sees them: a delivery takes one, an answer's end frees
    it and tops up, as the worker does."""

    total: int = SLOTS
    busy: int = 0
    delivered: list[Msg] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def free(self) -> int:
        return self.total - self.busy

    acks: set[asyncio.Task[None]] = field(default_factory=set)

    def deliver(self, msg: Msg) -> None:
        self.busy += 1
        self.delivered.append(msg)
        ack = asyncio.get_running_loop().create_task(msg.ack())
        self.acks.add(ack)
        ack.add_done_callback(self.acks.discard)
        self.arrived.set()

    async def wait_for(self, count: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.delivered) < count:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def queue(conn: Connection) -> AsyncIterator[tuple[str, str]]:
    name = f"PULL{uuid.uuid4().hex[:8].upper()}"
    subject = f"pulltest.{name}"
    jsm = conn.jsm()
    await jsm.add_stream(StreamConfig(name=name, subjects=[subject]))
    await jsm.add_consumer(
        name, ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    )
    try:
        yield name, subject
    finally:
        with contextlib.suppress(NotFoundError):
            await jsm.delete_stream(name)


@dataclass
class Pulling:
    """A puller over its slots, on ``subject``'s queue."""

    puller: Puller
    slots: Slots
    subject: str


def _puller(
    conn: Connection,
    stream: str,
    slots: Slots,
    expires: float,
    batch: int = 1_000_000,
    expiry: Callable[[], float] | None = None,
) -> Puller:
    """A puller of consumer ``w`` over ``slots``, ``batch`` messages a pull request at most
    (``expiry``: the puller's, a new request's shorter expiry)."""
    return Puller(
        conn,
        stream,
        "w",
        free_slots=slots.free,
        total_slots=lambda: slots.total,
        deliver=slots.deliver,
        expires=expires,
        batch=batch,
        expiry=expiry,
    )


@pytest.fixture
async def worker(conn: Connection, queue: tuple[str, str]) -> AsyncIterator[Pulling]:
    stream, subject = queue
    slots = Slots()
    puller = _puller(conn, stream, slots, LONG)
    await puller.start()
    await conn.nc.flush()
    try:
        yield Pulling(puller, slots, subject)
    finally:
        await puller.stop()


async def _burst(conn: Connection, subject: str, count: int) -> None:
    js = conn.nc.jetstream()
    for i in range(count):
        await js.publish(subject, f"request {i}".encode())


async def _end_answers(puller: Puller, slots: Slots, count: int) -> None:
    """Answers end one at a time, each freeing its slot (the worker's ``_handle``)."""
    for _ in range(count):
        slots.busy -= 1
        await puller.top_up()


async def test_an_idle_worker_covers_every_slot_and_takes_a_whole_burst_at_once(
    conn: Connection, worker: Pulling
) -> None:
    puller, slots, subject = worker.puller, worker.slots, worker.subject
    assert puller.outstanding == SLOTS
    await _burst(conn, subject, SLOTS)
    await slots.wait_for(SLOTS)
    # The answers end one by one: while others are in flight, freed slots are asked for in
    # chunks; once none is in flight, every slot is asked for again.
    await _end_answers(puller, slots, SLOTS)
    assert slots.busy == 0
    assert puller.outstanding == SLOTS, "an idle worker left slots uncovered"
    # A second burst of the slots' size comes through the requests already open.
    await _burst(conn, subject, SLOTS)
    await slots.wait_for(2 * SLOTS)
    assert [m.data for m in slots.delivered[SLOTS:]] == [
        f"request {i}".encode() for i in range(SLOTS)
    ]


async def test_while_answers_are_in_flight_freed_slots_go_in_chunks_and_the_tick_covers_the_rest(
    conn: Connection, worker: Pulling
) -> None:
    puller, slots, subject = worker.puller, worker.slots, worker.subject
    await _burst(conn, subject, SLOTS)
    await slots.wait_for(SLOTS)
    await _end_answers(puller, slots, 2)  # a chunk is 2 of 8; the first end asks for 1
    assert slots.busy == SLOTS - 2
    assert puller.outstanding == 1, "one request per freed slot while answers are in flight"
    await puller.top_up(whole=True)  # the worker's tick
    assert puller.outstanding == slots.free() == 2
    # Never more than the free slots: back-pressure holds.
    await puller.top_up(whole=True)
    assert puller.outstanding == 2
    await _burst(conn, subject, 3)
    await slots.wait_for(SLOTS + 2)
    assert puller.outstanding == 0
    with pytest.raises(TimeoutError):  # the third stays queued: no slot was free for it
        await slots.wait_for(SLOTS + 3, timeout=0.5)


async def test_a_request_that_expires_while_the_loop_is_busy_is_renewed_at_the_loops_next_read(
    conn: Connection, queue: tuple[str, str], nats_server: NatsServer
) -> None:
    """A pull request's expiry can fall inside a burst, the worker busy with its first requests
    and the rest of the burst waiting in the stream for a new pull request. The renewal leaves
    from the read loop that took the expiry, not turns of the loop later."""
    stream, _ = queue
    api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.w"
    watcher = ThreadWatcher(nats_server.url, api, "_INBOX.>")  # pull requests and their ends
    puller = _puller(conn, stream, Slots(), expires=0.3)
    try:
        # The watcher subscribed just now: a round trip on this connection before its first pull
        # request, or the watcher can miss it (see docs/performance.md, the subscription window).
        await conn.nc.flush()
        await puller.start()

        async def asked() -> bool:
            return any(subject == api for subject, _ in watcher.seen)

        await eventually(asked, 5, "the first pull request at the server")
        # The loop is then held by a chain of callbacks, each 0.1 s long and queueing the next
        # (a burst's handlers), from before the request expires to well after.
        loop = asyncio.get_running_loop()
        links: list[float] = []
        chain_done = loop.create_future()

        def link(left: int) -> None:
            links.append(time.monotonic())
            time.sleep(0.1)
            if left:
                loop.call_soon(link, left - 1)
            else:
                chain_done.set_result(None)

        loop.call_soon(link, 12)
        await chain_done
        await puller.stop()
        expired = next(at for subject, at in watcher.seen if subject.startswith("_INBOX."))
        renewed = [at for subject, at in watcher.seen if subject == api and at > expired]
        assert renewed, "no pull request after the expiry"
        assert expired < links[-1] - 0.3, "the chain did not go on long after the expiry"
        # Links begun between the expiry and the renewal at the server: the expiry is read at
        # the loop's next turn, the read loop takes it at the one after and writes the renewal,
        # which the server has as the next link begins: three. Through the subscription's own
        # task and nats-py's flusher it was five.
        waited = [at for at in links if expired < at < renewed[0]]
        assert len(waited) <= 3, f"the renewal waited {len(waited)} turns of the busy loop"
    finally:
        await puller.stop()
        watcher.close()


@contextlib.asynccontextmanager
async def _cut_link(nats_server: NatsServer) -> AsyncIterator[tuple[TcpProxy, Connection]]:
    """A worker's connection through a link that can be cut; it reconnects in 0.1 s."""
    proxy = await TcpProxy(nats_server.port).start()
    linked = make_settings(proxy.url)
    linked.nats.reconnect_wait = 0.1
    try:
        async with Connection(linked.nats, "cut-worker") as cut:
            yield proxy, cut
    finally:
        await proxy.stop()


async def _cut_and_back(proxy: TcpProxy, cut: Connection, puller: Puller, seconds: float) -> None:
    """Cut the link for ``seconds``; once it is back, the worker's reconnect step."""
    before = cut.reconnects
    proxy.cut(seconds)

    async def back() -> bool:
        return cut.reconnects > before

    await eventually(back, what="the link back")
    puller.forget()
    await puller.top_up()
    await cut.nc.flush()


async def test_a_pull_request_that_outlives_a_short_cut_is_not_asked_for_twice(
    nats_server: NatsServer, conn: Connection, queue: tuple[str, str]
) -> None:
    """A cut shorter than the pull requests' expiry: the server still holds them when the link
    is back, and nats-py subscribed to them again. They still count, so a burst after the
    reconnect fills the free slots only, not twice as many (before: 16 of 16 to 8 slots), and
    the rest waits in the stream for the slots that free up."""
    stream, subject = queue
    slots = Slots()
    async with _cut_link(nats_server) as (proxy, cut):
        puller = _puller(cut, stream, slots, LONG)
        await puller.start()
        await cut.nc.flush()
        await _cut_and_back(proxy, cut, puller, 0.5)
        await _burst(conn, subject, 2 * SLOTS)
        jsm = conn.jsm()

        async def slots_filled_and_the_rest_waiting() -> bool:
            info = await jsm.consumer_info(stream, "w")
            return len(slots.delivered) == SLOTS and info.num_pending == SLOTS

        await eventually(slots_filled_and_the_rest_waiting, what="8 delivered, 8 waiting")
        await _end_answers(puller, slots, SLOTS)
        await slots.wait_for(2 * SLOTS)
        await puller.stop()


async def test_pull_requests_that_expired_during_a_cut_are_asked_for_again_at_once(
    nats_server: NatsServer, conn: Connection, queue: tuple[str, str]
) -> None:
    """A cut longer than the pull requests' expiry: the status that ended them was lost with
    the link, and they are counted over once the link is back, so the free slots are covered
    again at once, not left empty."""
    stream, subject = queue
    slots = Slots()
    async with _cut_link(nats_server) as (proxy, cut):
        puller = _puller(cut, stream, slots, 0.3)
        await puller.start()
        await cut.nc.flush()
        await _cut_and_back(proxy, cut, puller, 0.8)
        assert puller.outstanding == SLOTS  # asked again, all of them
        await _burst(conn, subject, SLOTS)
        await slots.wait_for(SLOTS, timeout=5)
        await puller.stop()


async def test_a_consumer_made_anew_gives_up_only_the_requests_asked_before_it_was_seen(
    worker: Pulling,
) -> None:
    """The worker's look that found its consumer made anew began at some moment: requests asked
    before it may be of the consumer before, and are given up (their slots asked for again); one
    asked after is of the new one, and still counts (asked again, its slots would be served
    twice)."""
    puller = worker.puller
    loop = asyncio.get_running_loop()
    assert puller.outstanding == SLOTS
    puller.forget(asked_before=loop.time() - 60)  # the look began before the request
    assert puller.outstanding == SLOTS
    puller.forget(asked_before=loop.time())
    assert puller.outstanding == 0
    await puller.top_up()  # the worker's restore, its tick
    assert puller.outstanding == SLOTS


async def test_answers_one_after_another_ask_without_a_subscription_each(
    conn: Connection, queue: tuple[str, str]
) -> None:
    """A filled pull request's subscription serves the next request: a 1-slot worker answering
    20 requests one after another makes no subscription and no unsubscription for them (before:
    a SUB and an UNSUB each, the UNSUB written alone between a delivery's engine call and its
    first event), every request comes, and the server holds one pull request, for the one slot."""
    stream, subject = queue
    jsm = conn.jsm()
    await jsm.consumer_info(stream, "w")  # nats-py's inbox for its requests, made now
    before = set(conn.nc._subs)
    slots = Slots(total=1)
    puller = _puller(conn, stream, slots, LONG)
    await puller.start()
    await conn.nc.flush()
    made = conn.nc._sid  # the connection's subscription ids so far
    try:
        for i in range(20):
            await _burst(conn, subject, 1)
            await slots.wait_for(i + 1)
            await _end_answers(puller, slots, 1)
        assert [m.data for m in slots.delivered] == [b"request 0"] * 20
        assert conn.nc._sid == made, f"{conn.nc._sid - made} subscriptions for 20 requests"
        assert puller.outstanding == 1

        async def one_waiting() -> bool:  # the server takes pull requests in their own time
            info = await jsm.consumer_info(stream, "w")
            return info.num_waiting == 1 and info.num_pending == 0

        await eventually(one_waiting, what="one pull request, for the one slot")
    finally:
        await puller.stop()
    assert set(conn.nc._subs) == before  # a stopped puller leaves no subscription behind


async def test_an_idle_workers_expiring_requests_ask_again_without_a_subscription_each(
    conn: Connection, queue: tuple[str, str]
) -> None:
    """Pull requests expire every ``expires`` (0.5 s for a worker) while nothing comes; each
    expired one's inbox serves the request asked in its place: ten expiries cost no SUB and no
    UNSUB (before: one of each per expiry, and an interest change at the server), and a request
    published after them is still delivered, once."""
    stream, subject = queue
    slots = Slots(total=2)
    puller = _puller(conn, stream, slots, 0.1)
    await puller.start()
    await conn.nc.flush()
    made = conn.nc._sid  # the connection's subscription ids so far
    asked = puller._next  # pull requests asked so far

    async def expired_ten_times() -> bool:
        return puller._next >= asked + 10

    try:
        await eventually(expired_ten_times, timeout=10, what="ten expiries and renewals")
        assert conn.nc._sid == made, f"{conn.nc._sid - made} subscriptions for 10 expiries"
        await _burst(conn, subject, 1)
        await slots.wait_for(1)
        assert [m.data for m in slots.delivered] == [b"request 0"]
    finally:
        await puller.stop()
