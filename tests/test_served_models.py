"""Whether a pool serves a model (:class:`mesh.provision.ServedModels`), against a real
nats-server: remembered for a while, and on the edge a yes gone stale still answers at once
while a look in the background brings it up to date. Before, a request that came more than
30 s after the last waited for that look (a round trip to the hub, over a site's uplink)
before it was queued. The SDK, which has no registry, holds a stale yes while it hears
JetStream's word that a consumer was deleted, and forgets a yes the moment it does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

import mesh.stream_deleted
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import ensure_consumer, ensure_stream
from mesh.served_models import ServedModels
from mesh.stream_deleted import consumer_created, consumer_deleted, hear
from protocol.subjects import consumer_name
from tests.conftest import make_settings
from tests.helpers import eventually, holds
from tests.test_security import Hub
from tests.test_security import hub as hub_with_creds  # noqa: F401 - a fixture

MODEL = "served-test"


@pytest.fixture
async def hub(own_server: NatsServer) -> AsyncIterator[tuple[MeshSettings, Connection]]:
    settings = make_settings(own_server.url)  # a server of its own: the queue's subjects
    async with Connection(settings.nats, "served") as conn:
        await ensure_stream(conn.jsm(), settings.stream)
        await ensure_consumer(conn.jsm(), settings.stream, MODEL)
        yield settings, conn


def _slow_looks(
    conn: Connection, monkeypatch: pytest.MonkeyPatch, *, answered_first: bool = False
) -> tuple[list[str], asyncio.Event]:
    """Looks at a consumer from here on wait for the event (``answered_first``: with their
    answer in hand, as one whose answer is on its way back); the looks asked, by consumer."""
    jsm = conn.jsm()
    info = type(jsm).consumer_info
    looks: list[str] = []
    release = asyncio.Event()

    async def consumer_info(
        self: object, stream: str, consumer: str, *a: object, **k: object
    ) -> api.ConsumerInfo:
        looks.append(consumer)
        if answered_first:
            answer = await info(self, stream, consumer, *a, **k)  # type: ignore[arg-type]
            await release.wait()
            return answer
        await release.wait()
        return await info(self, stream, consumer, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(type(jsm), "consumer_info", consumer_info)
    return looks, release


async def test_a_stale_yes_answers_at_once_and_is_brought_up_to_date_behind(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, conn = hub
    served = ServedModels(conn.jsm, settings.stream, stale_yes=lambda model: model == MODEL)
    assert await served(MODEL)  # looked up: a pool serves it
    _stale(served)
    looks, release = _slow_looks(conn, monkeypatch)
    began = time.monotonic()
    assert await served(MODEL)  # at once, not after the look
    assert await served(MODEL)  # one look under way serves both
    assert time.monotonic() - began < 0.05
    await eventually(lambda: holds(looks == [consumer_name(MODEL)]), what="one look")
    await conn.jsm().delete_consumer(settings.stream.name, consumer_name(MODEL))
    release.set()  # the look finds the pool gone
    await eventually(lambda: _says(served, False), what="the pool's end seen")


async def test_without_stale_yes_a_request_waits_for_the_look(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's rule: it has no registry to tell it a pool's workers are gone, so an old yes
    is looked up again, waited for."""
    settings, conn = hub
    served = ServedModels(conn.jsm, settings.stream, no_for=0.0)
    assert await served(MODEL)
    _stale(served)
    looks, release = _slow_looks(conn, monkeypatch)
    asking = asyncio.ensure_future(served(MODEL))
    await eventually(lambda: holds(len(looks) == 1), what="the look asked")
    assert not asking.done()  # waits for it
    release.set()
    assert await asyncio.wait_for(asking, 5)


async def test_the_sdk_holds_a_stale_yes_while_it_hears_deletions(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, it waited for a look at every request 30 s after the last (a round trip to the
    hub), and a pool deleted went on reading as served until its yes ran out."""
    settings, conn = hub
    served = ServedModels(conn.jsm, settings.stream, no_for=0.0, hear=conn)
    try:
        await _heard_then_looked(served)
        _stale(served)
        looks, release = _slow_looks(conn, monkeypatch)
        assert await asyncio.wait_for(served(MODEL), 5)  # answered with the look held
        await eventually(lambda: holds(len(looks) == 1), what="a look behind")
        assert not release.is_set()
        release.set()
        await eventually(lambda: holds(MODEL in served._known and not served._looking))
        assert served._known[MODEL][1] > time.monotonic()  # the look behind renewed it
        await conn.jsm().delete_consumer(settings.stream.name, consumer_name(MODEL))
        await eventually(lambda: _says(served, False), what="the deletion heard")  # not in 30 s
        await ensure_consumer(conn.jsm(), settings.stream, MODEL)
        assert await served(MODEL)
        conn._lost()  # a loss on the connection (dropped messages): a word may have been missed
        assert MODEL not in served._known
    finally:
        await served.close()


async def test_a_look_under_way_when_the_pool_is_deleted_is_not_remembered(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look's yes was on its way back when the deletion's word came: before, it was
    written over the word, and the pool deleted read as served for 30 s more."""
    settings, conn = hub
    served = ServedModels(conn.jsm, settings.stream, no_for=0.0, hear=conn)
    try:
        await _heard_then_looked(served)
        _stale(served)
        looks, release = _slow_looks(conn, monkeypatch, answered_first=True)
        assert await served(MODEL)  # stale: a look behind, its answer held on its way
        await eventually(lambda: holds(len(looks) == 1), what="a look behind")
        await conn.jsm().delete_consumer(settings.stream.name, consumer_name(MODEL))
        await eventually(lambda: holds(MODEL not in served._known), what="the deletion heard")
        release.set()  # the look's yes, read before the deletion, arrives after its word
        await eventually(lambda: holds(not served._looking), what="the look done")
        monkeypatch.undo()
        assert not await served(MODEL)
    finally:
        await served.close()


async def test_a_yes_looked_up_before_the_word_could_be_heard_is_not_held_stale(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first look runs beside the subscription to the word: a deletion between the two was
    never heard. Before, once the subscription was taken, that yes answered stale at once too."""
    settings, conn = hub
    taken = asyncio.Event()
    real_hear = mesh.stream_deleted.hear

    async def slow_hear(*args: Any) -> Subscription | None:
        await taken.wait()
        return await real_hear(*args)

    monkeypatch.setattr(mesh.stream_deleted, "hear", slow_hear)
    served = ServedModels(conn.jsm, settings.stream, no_for=0.0, hear=conn)
    try:
        assert await served(MODEL)  # looked up while nothing listened
        taken.set()
        await eventually(lambda: holds(served._heard is not None), what="the word heard")
        _stale(served)
        looks, release = _slow_looks(conn, monkeypatch)
        asking = asyncio.ensure_future(served(MODEL))
        await eventually(lambda: holds(len(looks) == 1), what="the look asked")
        assert not asking.done()  # waits for it, as without the word
        release.set()
        assert await asyncio.wait_for(asking, 5)
        assert served._known[MODEL][2]  # this yes was looked up with the word heard
    finally:
        await served.close()


async def test_hearing_a_pool_come_and_go_needs_the_servers_yes(
    hub_with_creds: Hub,  # noqa: F811 - the fixture
) -> None:
    """Under ``mesh creds``, an edge's user (and an SDK given the edge's credentials) hears a
    consumer of the queue made and deleted, through its account's imports; a user that may not
    (an app of the edge) is told so, and its stale yeses are looked up again, waited for."""
    operator = hub_with_creds.settings("operator")
    stream = operator.stream
    async with (
        Connection(operator.nats, "operator") as op,
        Connection(hub_with_creds.settings("edge-site-a").nats, "edge") as edge,
        Connection(hub_with_creds.settings("client-site-a").nats, "app") as app,
    ):
        await ensure_stream(op.jsm(), stream)
        heard: list[str] = []

        async def word(msg: Msg) -> None:
            heard.append(msg.subject)

        made, deleted = consumer_created(stream.name, "*"), consumer_deleted(stream.name, "*")
        assert await hear(edge, made, word) is not None
        assert await hear(edge, deleted, word) is not None
        assert await hear(app, deleted, word) is None  # told by its credentials, ahead
        assert hub_with_creds.violations() == []
        await ensure_consumer(op.jsm(), stream, MODEL)
        await op.jsm().delete_consumer(stream.name, consumer_name(MODEL))
        name = consumer_name(MODEL)
        words = [consumer_created(stream.name, name), consumer_deleted(stream.name, name)]
        await eventually(lambda: holds(heard == words), what="both words at the edge")
        served = ServedModels(app.jsm, stream, no_for=0.0, hear=app)
        try:
            await served("nobody-serves-this")
            await eventually(
                lambda: holds(served._listening is not None and served._listening.done())
            )
            assert served._heard is None  # refused: a stale yes is waited for
        finally:
            await served.close()


async def _heard_then_looked(served: ServedModels) -> None:
    """A yes looked up once the word is sure to be heard (the first look runs beside the
    subscription)."""
    assert await served(MODEL)
    await eventually(lambda: holds(served._heard is not None), what="the word heard")
    served.forget(MODEL)
    assert await served(MODEL)


def _stale(served: ServedModels) -> None:
    """What it knows of the model, as if ``yes_for`` had passed."""
    answer, _until, heard = served._known[MODEL]
    served._known[MODEL] = (answer, time.monotonic() - 1, heard)


async def _says(served: ServedModels, answer: bool) -> bool:
    return await served(MODEL) is answer


async def test_what_is_known_stays_bounded_whatever_the_clients_name(
    hub: tuple[MeshSettings, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request names its model: a client naming a new one each time (a UUID, a hostile key
    holder) grew the edge's answers for ever, one per name, expired noes too."""
    monkeypatch.setattr("mesh.served_models.KNOWN_MAX", 50)
    settings, conn = hub
    served = ServedModels(conn.jsm, settings.stream, no_for=60.0)
    assert await served(MODEL)
    for n in range(120):
        assert not await served(f"nobody-serves-{n}")
    assert len(served._known) <= 50
    assert await served(MODEL)  # still right, looked up again if it had to go
    assert not await served("nobody-serves-119")  # the newest stay
