"""The edge's NATS intake at its edges: a request sent twice on one inbox, a finished answer
given again to a new inbox whose reader then asks for what it missed, a resend asked in msgpack,
a plain-text prompt whose first byte a msgpack map could begin with. Each test failed on the
code before its fix (a review of nats_intake.py and records.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator

import msgpack
import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text
from protocol.subjects import edge_resend_subject
from tests.helpers import eventually
from tests.nats_wire import RawNatsClient


@pytest.fixture
async def det_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    settings.edge.model.backend = "deterministic"
    settings.edge.model.token_delay_ms = 10.0
    settings.edge.http_port = -1
    backend = DeterministicBackend(settings.edge.model)
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as node:
        yield node


async def _true(value: bool) -> bool:
    return value


def nuid_prefix() -> str:
    return f"_INBOX.{secrets.token_hex(11)}"  # 22 base62-ish characters: a connection's NUID


async def test_a_request_sent_twice_on_the_same_inbox_streams_each_event_once(
    det_edge: EdgeNode, conn: Connection
) -> None:
    """A client that sends its request again on the same inbox (a retry of a publish it is not
    sure went out) is one reader: each event of the answer must reach that inbox once."""
    inbox = f"{nuid_prefix()}.1"
    got: list[dict[str, object]] = []

    async def on(msg: object) -> None:
        got.append(json.loads(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(inbox, cb=on)
    body = json.dumps(
        {"id": "twice", "prompt": "[tag:d] x", "max_tokens": 40, "stream": True, "route": "local"}
    ).encode()
    await conn.nc.publish(det_edge.subject, body, reply=inbox)
    await eventually(lambda: _true(bool(got)), timeout=5, what="the start")
    await conn.nc.publish(det_edge.subject, body, reply=inbox)
    await eventually(
        lambda: _true(sum(1 for e in got if e["t"] in ("end", "err")) >= 1),
        timeout=10,
        what="the end",
    )
    await asyncio.sleep(0.3)
    seqs = [e["seq"] for e in got if e["t"] == "tok"]
    ends = [e for e in got if e["t"] in ("end", "err")]
    assert len(ends) == 1, f"{len(ends)} ends on one inbox"
    assert len(seqs) == len(set(seqs)) == 40, f"{len(seqs)} token events for 40 tokens"


async def test_a_plain_text_prompt_in_thaana_script_is_answered_not_taken_for_msgpack(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    """`nats req <edge> 'ދިވެހި [tag:th] ...'`: valid UTF-8 text whose first byte (0xDE, as
    for every Thaana letter; 0xDF for N'Ko) is also msgpack's map16/map32 marker."""
    cli = await RawNatsClient().connect(settings.nats.url or "")
    try:
        prompt = "ދިވެހި ބަހުން [tag:th] ޖަވާބު ދޭ".encode()
        assert prompt[0] == 0xDE
        reply = await cli.request(det_edge.subject, prompt, timeout=10)
    finally:
        await cli.close()
    try:
        event = json.loads(reply.data)
    except ValueError:
        raise AssertionError(
            f"not a JSON reply to a plain-text request: {msgpack.unpackb(reply.data)!r}"
        ) from None
    assert event["t"] == "answer", event


async def test_a_reply_subject_too_long_to_carry_hears_why_and_a_reserved_one_nothing(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    """A client whose inbox is longer than the mesh carries (512 characters) hears a typed
    error there (it waited in silence until its timeout); one that names a reserved subject
    as its reply gets nothing published there."""
    cli = await RawNatsClient().connect(settings.nats.url or "")
    try:
        inbox = "_INBOX." + "x" * 600
        await cli.subscribe(inbox)
        await cli.subscribe("mesh.v1.work.>")
        await cli.publish(det_edge.subject, b"[tag:l] hello", reply=inbox)
        got = await cli.next_msg(timeout=5)
        assert got.subject == inbox, got
        event = got.json()
        assert event["t"] == "err" and event["code"] == "invalid_request", event
        assert "512" in event["message"], event
        await cli.publish(det_edge.subject, b"[tag:l] hello", reply="mesh.v1.work.x")
        with pytest.raises(TimeoutError):  # nothing published into a reserved subject
            await cli.next_msg(timeout=0.5)
    finally:
        await cli.close()


async def test_a_msgpack_resend_is_served_from_the_position_it_names(
    det_edge: EdgeNode, conn: Connection
) -> None:
    """A resend asked in msgpack (as the SDK asks) is served from the position it names.
    Before, ``on_resend`` read ``attempt``/``seq`` with orjson only, and served it from 0."""
    inbox = f"{nuid_prefix()}.1"
    got: list[dict[str, object]] = []

    async def on(msg: object) -> None:
        got.append(msgpack.unpackb(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(inbox, cb=on)
    body = {"id": "mp", "prompt": "[tag:m] x", "max_tokens": 20, "stream": True, "route": "local"}
    await conn.nc.publish(
        det_edge.subject,
        msgpack.packb(body),
        reply=inbox,
        headers={"Content-Type": "application/msgpack"},
    )
    await eventually(lambda: _true(any(e["t"] == "end" for e in got)), timeout=10, what="end")
    ask = msgpack.packb({"id": "mp", "inbox": inbox, "attempt": 1, "seq": 20})
    reply = await conn.nc.request(
        edge_resend_subject(det_edge.edge_id),
        ask,
        timeout=5,
        headers={"Content-Type": "application/msgpack"},
    )
    said = json.loads(reply.data)
    assert said["known"] is True
    assert said["events"] == 1, (
        f"{said['events']} events sent again for a reader lacking only the end"
    )


async def test_a_reader_given_a_finished_answer_again_can_ask_for_what_it_missed(
    det_edge: EdgeNode, conn: Connection
) -> None:
    """The same request sent again (same id, same content, a new inbox of the same client)
    after its answer ended is replayed whole, and its inbox may ask for what it missed.
    Before, the inbox was not one of the record's readers: its resend got ``known: false``."""
    prefix = nuid_prefix()
    got: dict[str, list[dict[str, object]]] = {}

    async def on(msg: object) -> None:
        got.setdefault(msg.subject, []).append(json.loads(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(f"{prefix}.*", cb=on)
    body = json.dumps(
        {"id": "again", "prompt": "[tag:a] x", "max_tokens": 10, "stream": True, "route": "local"}
    ).encode()

    def ended(inbox: str) -> bool:
        return any(e["t"] == "end" for e in got.get(inbox, []))

    await conn.nc.publish(det_edge.subject, body, reply=f"{prefix}.1")
    await eventually(lambda: _true(ended(f"{prefix}.1")), timeout=10, what="the first answer")
    await conn.nc.publish(det_edge.subject, body, reply=f"{prefix}.2")
    await eventually(lambda: _true(ended(f"{prefix}.2")), timeout=10, what="the replay")
    ask = json.dumps({"id": "again", "inbox": f"{prefix}.2", "attempt": 1, "seq": 5}).encode()
    reply = await conn.nc.request(edge_resend_subject(det_edge.edge_id), ask, timeout=5)
    assert json.loads(reply.data)["known"] is True, reply.data


async def test_an_sdk_reader_that_drops_part_of_a_replay_still_gets_the_whole_answer(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    """The SDK asking again under an id whose answer ended: the replay comes in one burst; a
    reader with a small buffer drops part of it and asks for it again (``resend``), and gets it.
    Before, the edge said it did not know the request, and the SDK ended in ``incomplete``
    though the edge held the whole answer."""
    from mesh.client import MeshClient

    async with MeshClient(
        settings=settings, first_event_timeout=10, idle_timeout=10, pending_limit=16
    ) as sdk:
        first = await sdk.complete("[tag:r] x", route="local", max_tokens=200, request_id="rp-1")
        assert first.text == expected_text("r", 200)
        again = await sdk.complete("[tag:r] x", route="local", max_tokens=200, request_id="rp-1")
        assert again.text == expected_text("r", 200)
