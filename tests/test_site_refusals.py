"""An edge site's path for requests that can wait (``deferrable``) and kept answers, where it
refuses: a request the hub refuses for good, one sent to an edge without a site, a full outbox,
and the site's streams' byte limits. Review S19c wrote these; the first four failed on the code
it reviewed (each docstring says what it showed then, "Before the fix"). The last three are
guards that passed: a leaf killed and restarted while a request is held, a hub restarted (same
store) mid-answer, and hostile asks on the answer subject."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import msgpack
import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh import kept
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text
from protocol.errors import InvalidRequestError, MeshError, UnavailableError
from protocol.subjects import OUTBOX_STREAM, edge_answer_subject
from tests.helpers import eventually
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    _held,
    running_mesh,
    site_edge_and_worker,
    topology,
)
from tests.test_security import certs  # noqa: F401 - a fixture
from tests.test_site_answer_edges import SITE, _cloud_gone

# -- confirmed defects -------------------------------------------------------------------------


async def test_a_request_the_hub_refuses_for_good_is_not_told_to_retry(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Before the fix (typed). The hub refuses a held request for good (a 4xx: here its queue's
    max_msg_size). The forwarder keeps ``UnavailableError("the hub refused it: ...")`` as its
    answer: code ``unavailable``, ``retryable=True``. The client (live, by id, and sending the
    same request again) is told to retry, but every retry returns that same kept error at once,
    for the kept answers' age (7 days): the id can never succeed. It should be a non-retryable
    error (``payload_too_large`` here, or ``retryable=False``)."""
    async with running_mesh(topology):
        async with Connection(topology.hub_settings("operator").nats, "op") as op:
            config = (await op.jsm().stream_info("MESH_INFER")).config
            config.max_msg_size = 2048  # the hub refuses bigger requests, for good
            await op.jsm().update_stream(config)
        async with MeshClient(settings=topology.site_settings(SITE, "client")) as client:

            async def ask() -> MeshError:
                with pytest.raises(MeshError) as failed:
                    await client.complete(
                        "[tag:z] " + "x" * 4000,
                        route="cloud",
                        max_tokens=5,
                        deferrable=True,
                        request_id="too-big",
                    )
                return failed.value

            live = await ask()
            with pytest.raises(MeshError) as by_id:
                await client.answer("too-big")
            again = await ask()  # "retryable": sent again, the same kept error at once
            told = [(e.code.value, e.retryable, e.message) for e in (live, by_id.value, again)]
            assert not any(retryable for _, retryable, _ in told), told


async def test_a_deferrable_request_to_an_edge_without_a_site_is_refused_not_answered_locally(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before the fix (contract / typed). An edge with no site (no JetStream of its own), the cloud
    not there. Over HTTP, ``service_tier: flex`` is refused 400 ``invalid_request`` "rather than
    ignore it" (docs/http-api.md). Over NATS/SDK, ``deferrable=True`` (whose docstring says "can
    wait for the cloud ... instead of being answered locally") is silently ignored: the local
    model answers (``path=local``, fallback "no worker pool serves"), and ``answer(id)`` then
    says ``unavailable`` (retryable, no retry_after) for an edge that will never keep an answer."""
    local = DeterministicBackend(ModelSettings(backend="deterministic", faults=False))
    async with (
        EdgeNode(settings, conn, local, HeuristicRouter()) as edge,
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        assert edge.site is None
        outcome: object
        try:
            got = await client.complete(
                "[tag:d] x",
                route="cloud",
                max_tokens=5,
                deferrable=True,
                request_id="nosite-1",
                deadline=time.time() + 30,
            )
            outcome = f"answered: path={got.end.path} fallback={got.end.fallback!r}"
        except MeshError as err:
            outcome = err
        assert isinstance(outcome, InvalidRequestError), outcome
        with pytest.raises(MeshError) as by_id:
            await client.answer("nosite-1")
        assert not by_id.value.retryable, by_id.value  # it will never keep one: not "retry"


async def test_a_full_outbox_says_it_is_full_and_when_to_try_again(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Before the fix (typed / error text). The site's outbox is full (its ``max_msgs``, the queue's
    10,000 by default, all held while the uplink is down). A new request that can wait is told
    ``unavailable: the site could not hold the request: ServiceUnavailableError``: the
    exception's class name, not JetStream's "maximum messages exceeded", and no retry_after.
    The hub's full queue says ``overloaded: the cloud queue is full (...)`` with a retry_after;
    the claim refusal just before it in ``SiteStore.hold`` also passes the description on."""
    async with running_mesh(topology):
        edge = topology.edges[SITE]
        topology.uplinks[SITE].cut(3600)
        await _cloud_gone(topology)
        jsm = edge.conn.site_jsm()
        config = (await jsm.stream_info(OUTBOX_STREAM)).config
        config.max_msgs = 1  # stands for 10,000 held
        await jsm.update_stream(config)
        async with MeshClient(settings=topology.site_settings(SITE, "client")) as client:
            first = asyncio.ensure_future(
                client.complete(
                    "[tag:f] x",
                    route="cloud",
                    max_tokens=5,
                    deferrable=True,
                    request_id="full-1",
                    deadline=time.time() + 30,
                )
            )
            try:
                await eventually(functools.partial(_held, edge, 1), timeout=10, what="held")
                with pytest.raises(MeshError) as refused:
                    await client.complete(
                        "[tag:g] x",
                        route="cloud",
                        max_tokens=5,
                        deferrable=True,
                        request_id="full-2",
                        deadline=time.time() + 30,
                    )
            finally:
                first.cancel()
            err = refused.value
            said = (err.code.value, err.message, err.retry_after)
            assert "maximum" in err.message or "full" in err.message, said
            assert err.retry_after is not None, said


def test_the_sites_own_streams_are_bounded_in_bytes(settings: MeshSettings) -> None:
    """Before the fix (minor: unbounded storage). The hub's ``MESH_ANSWERS`` is bounded by
    ``kept_max_bytes`` (1 GiB, oldest dropped first). The site's ``MESH_KEPT`` (whole answers,
    up to 1 MiB each, 7 days) and ``MESH_CLAIMS`` (one per hold attempt, refused holds too,
    21 days) have only an age; ``MESH_OUTBOX`` only a message count (10,000 requests of up to
    1 MiB). A busy site (a Jetson's small disk) fills its leaf's JetStream store, and then every
    hold and every collect fails until answers age out: broken for days."""
    stream = settings.stream
    unbounded = [
        config.name
        for config in (
            kept.kept_config(stream),
            kept.claims_config(stream),
            kept.outbox_config(stream),
        )
        if not (config.max_bytes and config.max_bytes > 0)
    ]
    assert not unbounded, f"no byte limit on {unbounded}"


# -- guards (pass) -----------------------------------------------------------------------------


async def test_guard_a_leaf_killed_and_restarted_while_a_request_is_held(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Guard (passes): the site's leaf is killed (-9) and restarted on its store while a request
    that can wait is held (uplink down); the uplink returns: the waiting client gets the whole
    answer, and by id too."""
    async with running_mesh(topology):
        edge = topology.edges[SITE]
        topology.uplinks[SITE].cut(3600)
        await _cloud_gone(topology)
        async with MeshClient(settings=topology.site_settings(SITE, "client")) as client:
            waiting = asyncio.ensure_future(
                client.complete(
                    "[tag:l] x",
                    route="cloud",
                    max_tokens=5,
                    deferrable=True,
                    request_id="lr-1",
                    deadline=time.time() + 40,
                )
            )
            await eventually(functools.partial(_held, edge, 1), timeout=10, what="held")
            leaf = topology.leaves[SITE]
            await leaf.kill()
            await leaf.restart()
            topology.uplinks[SITE].restore()
            got = await asyncio.wait_for(waiting, 30)
            assert got.text == expected_text("l", 5)
            assert (await client.answer("lr-1")).text == expected_text("l", 5)


async def test_guard_a_hub_restarted_mid_answer_loses_nothing(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Guard (passes): the hub's nats-server is killed (-9) and restarted on its store (same client
    port) while a worker generates a request that can wait: the site's client gets the whole
    answer, generated once."""
    conf = topology.tmp / "hub.conf"
    async with site_edge_and_worker(topology, SITE, token_delay_ms=100) as (backend, _e, client):
        waiting = asyncio.ensure_future(
            client.complete(
                "[tag:h] x",
                route="cloud",
                max_tokens=15,
                deferrable=True,
                request_id="hr-1",
                deadline=time.time() + 40,
            )
        )
        await eventually(lambda: _started(backend), timeout=10, what="generating")
        await asyncio.sleep(0.4)
        conf.write_text(conf.read_text().replace("port: -1", f"port: {topology.hub.port}", 1))
        await topology.hub.kill()
        await asyncio.sleep(0.5)
        await topology.hub.restart()
        got = await asyncio.wait_for(waiting, 30)
        assert got.text == expected_text("h", 15)
        assert backend.started == 1


async def _started(backend: DeterministicBackend) -> bool:
    return backend.started >= 1


async def test_guard_hostile_asks_on_the_answer_subject_are_answered_typed(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """Guard (passes): malformed, mistyped and huge asks on ``mesh.v1.edge.<edge>.answer`` each get
    one typed error reply (never ``internal``, never silence)."""
    asks = [
        b"",
        b"\xc1",
        b"[1,2]",
        b'{"id": 5}',
        b'{"id": "a.b"}',
        b'{"id": "' + b"x" * 200 + b'"}',
        msgpack.packb({"id": ["x"]}),
        b'{"id":"ok-1","key":5}',
        b'{"id": "' + b"y" * 900_000 + b'"}',
        b"{" * 5000,
        b'"just-a-string"',
        b"job-1",
        msgpack.packb({"id": "ok-1", "key": b"\x00\xff"}),
        msgpack.packb([1] * 10),
        b'{"id": "ok-1", "key": "' + b"k" * 500_000 + b'"}',
        b'{"id": "\\ud800"}',
    ]
    async with site_edge_and_worker(topology, SITE, token_delay_ms=0) as (_b, edge, client):
        async with Connection(topology.site_settings(SITE).nats, "hostile") as hostile:
            subject = edge_answer_subject(edge.edge_id)
            for ask in asks:
                reply = await hostile.nc.request(subject, ask, timeout=5)
                try:
                    event = json.loads(reply.data)
                except ValueError:
                    event = msgpack.unpackb(reply.data)
                assert event["t"] == "err", (ask[:40], event)
                assert event["code"] in ("invalid_request", "bad_payload", "unavailable"), (
                    ask[:40],
                    event,
                )
        with pytest.raises(UnavailableError, match="no answer kept"):
            await client.answer("ok-1")
