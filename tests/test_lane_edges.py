"""Identity and permissions under the credentials `mesh creds` mints, at their edges.

A real hub in operator mode with the minted auth.conf, as in ``tests/test_security.py``; every
connection uses the .creds and .env minted for its role. Each test marked "Before the fix"
failed on the code before it (review S17b); the comment says what happened then.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.msg import Msg

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.kept import answers_config, site_consumer_config
from mesh.provision import provision
from protocol.errors import MeshError, UnauthorizedError
from protocol.subjects import consumer_name, site_consumer
from tests.helpers import eventually
from tests.test_security import (  # noqa: F401 - fixtures
    Denials,
    Hub,
    _ask,
    hub,
    mesh,
    read_env,
)

MODEL = "smollm2"
B_PROMPT = b'{"id": "b-secret", "prompt": "site-b private prompt", "max_tokens": 5}'
B_ANSWER = b'{"t": "answer", "id": "b-kept", "text": "site-b private answer"}'


class Theft:
    """Edge A's raw connection, and what reaches its own reply inbox."""

    def __init__(self, spy: Denials) -> None:
        assert spy.nc is not None
        self.spy, self.nc = spy, spy.nc
        self.got: list[Msg] = []

    async def listen(self, inbox: str) -> None:
        async def keep(msg: Msg) -> None:
            self.got.append(msg)

        await self.nc.subscribe(f"{inbox}.>", cb=keep)
        await self.nc.flush()

    def foreign(self) -> list[Msg]:
        """Messages of B's lane that reached A: B's queue subject or B's kept answers."""
        return [m for m in self.got if "site-b" in m.subject.split(".")]

    async def settled(self, subject: str) -> None:
        """Either the server refused A's publish (the promised outcome), or something of B's
        reached A: whichever comes first, within a few seconds."""

        async def decided() -> bool:
            refused = f'violation for publish to "{subject}"'.lower()
            return bool(self.foreign()) or any(refused in e.lower() for e in self.spy.errors)

        await eventually(decided, timeout=5, what=f"a refusal of {subject} or a theft")


@pytest.fixture
async def provisioned(hub: Hub) -> AsyncIterator[Hub]:  # noqa: F811
    """The hub's streams and consumers, as `mesh provision` and a worker make them: the work
    queue with its model's pull consumer, and the kept answers with B's site collector."""
    stream = load_settings(environ={}).stream
    async with Connection(hub.settings("operator").nats, "op") as op:
        jsm = op.jsm()
        await provision(jsm, stream, [MODEL])
        await jsm.add_stream(answers_config(stream))
        await jsm.add_consumer("MESH_ANSWERS", site_consumer_config("site-b"))
        yield hub


async def _edge_b_queues_a_request(secured: Hub) -> None:
    """Edge B puts a request in its own queue lane, exactly as its relay does (a JetStream
    publish under B's credentials); no worker has taken it yet."""
    env = read_env(secured.minted.out / "edge-site-b.env")
    b = await nats.connect(
        secured.server.url,
        user_credentials=env["MESH_NATS_CREDS_FILE"],
        inbox_prefix=env["MESH_NATS_INBOX_PREFIX"],
    )
    try:
        ack = await b.jetstream().publish(f"mesh.v1.infer.{MODEL}.site-b", B_PROMPT)
        assert ack.stream == "MESH_INFER"
    finally:
        await b.close()


# Before the fix (first rule / identity): edge A's permission and import
# `$JS.ACK.*.*.MESH_ANSWERS.site_site-a.>` (mesh_app/creds.py edge_permissions,
# mesh_app/accounts.py _lanes) also matches a 9-token v1 ack subject of ANY consumer:
# `$JS.ACK.<stream>.<consumer>.MESH_ANSWERS.site_site-a.<x>.<y>.<z>`. nats-server's consumer
# takes a `+NXT` sent to its ack subject as a pull request and delivers its next message to the
# publish's reply subject. So edge A pulls B's queued request (prompt and all) out of the work
# queue `workers_<model>`: B's request is held by A until ack_wait and counts a delivery.
async def test_an_edge_cannot_pull_another_edges_queued_request_through_an_ack_subject(
    provisioned: Hub,
) -> None:
    await _edge_b_queues_a_request(provisioned)
    spy = await Denials().connect(provisioned, "edge-site-a")
    try:
        theft = Theft(spy)
        inbox = "_INBOX.edge.site-a.steal"
        await theft.listen(inbox)
        subject = f"$JS.ACK.MESH_INFER.{consumer_name(MODEL)}.MESH_ANSWERS.site_site-a.1.1.1"
        await theft.nc.publish(subject, b'+NXT {"batch": 1}', reply=f"{inbox}.1")
        await theft.nc.flush()
        await theft.settled(subject)
        stolen = [(m.subject, m.data) for m in theft.foreign()]
        assert stolen == [], f"edge A read edge B's queued request: {stolen}"
        # And B's request still waits for a worker, not on a delivery A holds.
        async with Connection(provisioned.settings("operator").nats, "op") as op:
            info = await op.jsm().consumer_info("MESH_INFER", consumer_name(MODEL))
        assert info.num_ack_pending == 0 and info.num_pending == 1, info
    finally:
        await spy.close()


# Before the fix (first rule / identity): the same ack-subject `+NXT` on B's site collector
# `site_site-b` hands edge A edge B's kept answer (the docs promise A "cannot read ... another
# site's answers"), and B's site then waits the collector's ack wait for it.
async def test_an_edge_cannot_pull_another_edges_kept_answer_through_an_ack_subject(
    provisioned: Hub,
) -> None:
    async with Connection(provisioned.settings("operator").nats, "op") as op:
        # What a worker keeps for B's site (cloud_node/keeper.py publishes it the same way).
        await op.js.publish("mesh.v1.ans.site-b.b-kept", B_ANSWER)
    spy = await Denials().connect(provisioned, "edge-site-a")
    try:
        theft = Theft(spy)
        inbox = "_INBOX.edge.site-a.steal"
        await theft.listen(inbox)
        victim = site_consumer("site-b")
        subject = f"$JS.ACK.MESH_ANSWERS.{victim}.MESH_ANSWERS.site_site-a.1.1.1"
        await theft.nc.publish(subject, b'+NXT {"batch": 1}', reply=f"{inbox}.1")
        await theft.nc.flush()
        await theft.settled(subject)
        stolen = [(m.subject, m.data) for m in theft.foreign()]
        assert stolen == [], f"edge A read edge B's kept answer: {stolen}"
    finally:
        await spy.close()


# Before the fix (first rule, shown end to end): while edge A keeps `+NXT` pull requests
# waiting on the model's consumer through that ack subject, edge B's client's cloud request is
# delivered to A instead of the worker. B does not get its exact cloud answer promptly (it waits
# ack_wait per theft, and after max_deliver thefts the request fails for good), and A has read
# B's prompt.
async def test_an_edge_holding_pulls_on_the_work_queue_cannot_take_another_edges_requests(
    mesh: Hub,  # noqa: F811
) -> None:
    spy = await Denials().connect(mesh, "edge-site-a")
    try:
        theft = Theft(spy)
        inbox = "_INBOX.edge.site-a.steal"
        await theft.listen(inbox)
        model = mesh.settings("worker-w1").worker.model.name
        subject = f"$JS.ACK.MESH_INFER.{consumer_name(model)}.MESH_ANSWERS.site_site-a.1.1.1"
        pull = json.dumps({"batch": 1, "expires": 30_000_000_000}).encode()
        for n in range(8):  # waiting pull requests, older than the worker's next fetch
            await theft.nc.publish(subject, b"+NXT " + pull, reply=f"{inbox}.{n}")
        await theft.nc.flush()
        for n in range(3):  # B's client asks a few times; each answer exact and prompt
            began = time.monotonic()
            tag = f"v{n}"
            try:
                text = await asyncio.wait_for(_ask(mesh, "site-b", f"[tag:{tag}] mine", 20), 4)
            except asyncio.TimeoutError:
                stolen = [(m.subject, m.data[:60]) for m in theft.foreign()]
                pytest.fail(f"B's request {n} got no answer in 4 s; edge A took: {stolen}")
            assert text == "".join(f" {tag}{i}" for i in range(20))
            took = time.monotonic() - began
            assert took < 3, f"B's answer {n} took {took:.1f}s: it waited on a delivery A held"
        stolen = [(m.subject, m.data[:80]) for m in theft.foreign()]
        assert stolen == [], f"edge A took edge B's request: {stolen}"
    finally:
        await spy.close()


# Before the fix (typed): a client that asks an edge its credentials do not cover is refused
# at once by the server (`Permissions Violation for Publish to "mesh.v1.edge.site-b.infer"`),
# but the SDK waits out the whole request timeout (60 s by default) and then says "no event
# from edge 'site-b' within 60s (waiting for the start)": a timeout, not the refusal. It should
# be a prompt UnauthorizedError naming the subject and the credentials.
async def test_a_client_asking_an_edge_outside_its_credentials_is_told_so_promptly(
    mesh: Hub,  # noqa: F811
) -> None:
    settings = mesh.settings("client-site-a", MESH_EDGE_EDGE_ID="site-b")
    began = time.monotonic()
    error = await _outcome(MeshClient(settings=settings), via="edge")
    took = time.monotonic() - began
    assert isinstance(error, UnauthorizedError), (type(error).__name__, str(error))
    assert "site-b" in str(error) and took < 5, (took, str(error))


async def _outcome(client: MeshClient, via: str) -> BaseException:
    """What a request out of the sender's lane ends in within 6 s (the lane's refusal by the
    server is immediate): the error raised, or the test's own TimeoutError when none came."""
    try:
        async with client:
            await asyncio.wait_for(
                client.complete("[tag:x] hi", via=via, route="cloud", max_tokens=5), timeout=6
            )
    except (MeshError, asyncio.TimeoutError) as exc:
        return exc
    pytest.fail("a request out of the sender's lane was answered")


# Before the fix (typed): a sender queueing directly (via="cloud") in a scope its credentials
# do not cover (here: edge A's credentials with MESH_NATS_SCOPE=site-b, a misconfiguration) is
# refused by the server at once, but the SDK reports "JetStream did not ack the request within
# 2s", a timeout that sends the operator looking at JetStream, not at the credentials.
async def test_queueing_outside_ones_scope_is_an_unauthorized_error_not_a_jetstream_timeout(
    mesh: Hub,  # noqa: F811
) -> None:
    settings = mesh.settings("edge-site-a", MESH_NATS_SCOPE="site-b")
    error = await _outcome(MeshClient(settings=settings), via="cloud")
    assert isinstance(error, UnauthorizedError), (type(error).__name__, str(error))
    assert "mesh.v1.infer" in str(error) or "permission" in str(error).lower(), str(error)


# Guard (passes): the ack-subject trick does nothing through the other ack form an edge holds,
# and a client's credentials reach no ack subject at all.
async def test_clients_cannot_reach_ack_subjects_and_edges_not_through_their_own_form(
    provisioned: Hub,
) -> None:
    await _edge_b_queues_a_request(provisioned)
    client = await Denials().connect(provisioned, "client-site-a")
    spy = await Denials().connect(provisioned, "edge-site-a")
    try:
        assert client.nc is not None
        subject = f"$JS.ACK.MESH_INFER.{consumer_name(MODEL)}.1.1.1.1.1"
        await client.nc.publish(subject, b'+NXT {"batch": 1}', reply="_INBOX.client.x.y")
        await client.refused("Publish", subject)
        theft = Theft(spy)
        inbox = "_INBOX.edge.site-a.steal"
        await theft.listen(inbox)
        # Tokens 3 and 4 of the v1 form are pinned to A's own collector.
        with contextlib.suppress(Exception):
            await spy.nc.publish(subject, b'+NXT {"batch": 1}', reply=f"{inbox}.1")  # type: ignore[union-attr]
        await spy.refused("Publish", subject)
        assert theft.foreign() == []
    finally:
        await client.close()
        await spy.close()


def test_no_ack_subject_an_edge_may_publish_reaches_another_consumer() -> None:
    """Read off the permissions and the account's lanes, no server: every ``$JS.ACK`` subject an
    edge may publish to, or imports, overlaps no other consumer's ack subjects (either form).
    Before the fix, the domain form's ``>`` overlapped every consumer's 9-token form."""
    from mesh.config import StreamSettings
    from mesh.credentials import _overlaps
    from mesh_app.accounts import _lanes
    from mesh_app.creds import edge_permissions

    stream = StreamSettings()
    own = site_consumer("site-a")
    others = [
        f"$JS.ACK.{stream.name}.{consumer_name(MODEL)}.*.*.*.*.*",
        f"$JS.ACK.MESH_ANSWERS.{site_consumer('site-b')}.*.*.*.*.*",
        f"$JS.ACK.*.*.MESH_ANSWERS.{site_consumer('site-b')}.*.*.*.*.*.*",
        f"$JS.ACK.*.*.{stream.name}.{consumer_name(MODEL)}.*.*.*.*.*.*",
    ]
    acks = [s for s in edge_permissions("site-a", stream=stream).pub_allow if "$JS.ACK" in s]
    acks += [s.replace("{site}", own) for _, s, _ in _lanes(stream) if s.startswith("$JS.ACK")]
    assert len(acks) == 4, acks
    for ack in acks:
        for other in others:
            assert not _overlaps(ack, other), (ack, other)
        assert _overlaps(ack, f"$JS.ACK.MESH_ANSWERS.{own}.1.2.3.4.5") or _overlaps(
            ack, f"$JS.ACK.hub.hash.MESH_ANSWERS.{own}.1.2.3.4.5.tok"
        ), ack
