"""Every kind of bad input gets a typed error with a stable code; edge and worker keep serving;
requests accepted before and after the bad ones all complete."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.queue import MSG_ID_HEADER
from protocol.codec import decode_event
from protocol.errors import InvalidRequestError
from protocol.messages import ErrorEvent, StartEvent, TokenEvent
from protocol.subjects import infer_subject, token_subject
from tests.helpers import eventually, queue_drained, stat_reaches

BAD_EDGE_INPUTS = [
    ("malformed msgpack", b"\x83\xa6prompt\xa2hi\xa2id", "bad_payload"),
    ("invalid JSON", b'{"prompt": "hi",,}', "bad_payload"),
    ("missing prompt", b'{"max_tokens": 10}', "invalid_request"),
    ("negative max_tokens", b'{"prompt": "hi", "max_tokens": -5}', "invalid_request"),
    ("max_tokens over the node limit", b'{"prompt": "hi", "max_tokens": 5000}', "invalid_request"),
    (
        "max_tokens over the protocol ceiling",
        b'{"prompt": "hi", "max_tokens": 99999999}',
        "invalid_request",
    ),
    ("unknown model", b'{"prompt": "hi", "model": "gpt-9-ultra"}', "unknown_model"),
    ("payload over the limit", json.dumps({"prompt": "x" * 300_000}).encode(), "payload_too_large"),
    (
        # msgpack carries bytes where JSON cannot: the request's fingerprint (worked out when
        # the same id comes again) raised on them, and that request was never answered.
        "bytes in a JSON schema",
        msgpack.packb(
            {
                "id": "bin-schema",
                "prompt": "hi",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "x": b"\x00"}},
                },
            }
        ),
        "invalid_request",
    ),
]


@pytest.mark.parametrize(
    ("what", "payload", "code"), BAD_EDGE_INPUTS, ids=[b[0] for b in BAD_EDGE_INPUTS]
)
async def test_edge_answers_bad_input_with_a_typed_error(
    edge: EdgeNode, conn: Connection, what: str, payload: bytes, code: str
) -> None:
    reply = await conn.nc.request(edge.subject, payload, timeout=10)
    event = decode_event(reply.data, reply.headers)
    assert isinstance(event, ErrorEvent), what
    assert event.code == code, (what, event.message)
    assert event.message and event.retryable is False
    assert reply.headers is not None and reply.headers["Nats-Service-Error-Code"] in {
        "400",
        "404",
        "413",
    }


async def test_edge_and_worker_keep_serving_through_bad_input(
    worker: Worker, edge: EdgeNode, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    # A long cloud request is in flight while every bad input hits the edge at once.
    in_flight = asyncio.create_task(
        client.complete(
            "Explain step by step why the sky is blue.", route="cloud", max_tokens=48, temperature=0
        )
    )
    replies = await asyncio.gather(
        *(conn.nc.request(edge.subject, payload, timeout=15) for _w, payload, _c in BAD_EDGE_INPUTS)
    )
    codes = [decode_event(r.data, r.headers).code for r in replies]
    assert codes == [c for _w, _p, c in BAD_EDGE_INPUTS]
    accepted = await in_flight
    assert accepted.path == "cloud", accepted.end.fallback
    assert accepted.end.usage.completion_tokens > 0
    after = await client.complete("Say hi.", max_tokens=8, temperature=0)
    assert after.text.strip()
    await eventually(lambda: queue_drained(conn, settings), what="empty queue")


async def _publish_raw(
    conn: Connection, settings: MeshSettings, payload: bytes, msg_id: str
) -> None:
    await conn.js.publish(
        infer_subject("smollm2", "tests"),
        payload,
        stream=settings.stream.name,
        headers={MSG_ID_HEADER: msg_id},
    )


async def test_worker_rejects_bad_queued_requests_typed_and_keeps_the_good_ones(
    worker: Worker, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    cases = {
        "w-neg": ({"id": "w-neg", "prompt": "hi", "max_tokens": -1}, "invalid_request"),
        "w-empty": ({"id": "w-empty", "prompt": "   "}, "invalid_request"),
        "w-model": ({"id": "w-model", "prompt": "hi", "model": "other"}, "unknown_model"),
        "w-late": (
            {"id": "w-late", "prompt": "hi", "start_by": time.time() - 1},
            "deadline_exceeded",
        ),
        "w-huge": ({"id": "w-huge", "prompt": "y" * 300_000}, "payload_too_large"),
        "w-unknown-field": (
            {"id": "w-unknown-field", "prompt": "hi", "bogus": 1},
            "invalid_request",
        ),
    }
    subs = {rid: await conn.nc.subscribe(token_subject("tests", rid)) for rid in cases}
    # A good request queued before the bad ones, one after: both must complete.
    before = asyncio.create_task(
        client.complete("Name a fruit.", via="cloud", max_tokens=8, temperature=0)
    )
    await _publish_raw(conn, settings, b"\x83\xa6prompt\xa2", "w-garbage")  # no reply readable
    await _publish_raw(conn, settings, msgpack.packb(["not", "a", "map"]), "w-list")
    for rid, (body, _code) in cases.items():
        await _publish_raw(conn, settings, json.dumps(body).encode(), rid)
    after = await client.complete("Name a color.", via="cloud", max_tokens=8, temperature=0)
    assert (await before).text and after.text
    for rid, (_body, code) in cases.items():
        msg = await subs[rid].next_msg(timeout=15)
        event = decode_event(msg.data, msg.headers)
        assert isinstance(event, ErrorEvent) and event.code == code, (rid, event)
        assert event.id == rid
    await stat_reaches(worker.stats, "rejected", len(cases) + 2)
    await stat_reaches(worker.stats, "completed", 2)
    await eventually(lambda: queue_drained(conn, settings), what="bad requests terminated")


async def test_context_too_long_is_typed_not_retried(
    worker: Worker, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    from protocol.errors import ContextTooLongError

    with pytest.raises(ContextTooLongError) as excinfo:
        await client.complete("word " * 3000, via="cloud", max_tokens=8)
    assert excinfo.value.code.value == "context_too_long" and not excinfo.value.retryable
    await stat_reaches(worker.stats, "failed", 1)
    await eventually(lambda: queue_drained(conn, settings), what="terminated, not redelivered")


async def test_sdk_validates_before_sending(client: MeshClient) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        await client.complete("hi", max_tokens=0)
    assert excinfo.value.details and excinfo.value.details[0]["loc"] == "max_tokens"


async def test_sdk_refuses_a_misspelt_via(client: MeshClient) -> None:
    """``via="clouds"`` went to an edge, as if ``via`` had been left out."""
    with pytest.raises(InvalidRequestError, match="'clouds'"):
        await client.complete("hi", via="clouds", max_tokens=4)  # type: ignore[arg-type]


async def test_msgpack_client_gets_msgpack_tokens(edge: EdgeNode, conn: Connection) -> None:
    inbox = conn.nc.new_inbox()
    sub = await conn.nc.subscribe(inbox)
    await conn.nc.publish(
        edge.subject, msgpack.packb({"prompt": "hi", "stream": True, "max_tokens": 4}), reply=inbox
    )
    first = await sub.next_msg(timeout=15)
    assert first.data[0] in range(0x80, 0x90)  # a msgpack map
    assert isinstance(decode_event(first.data), StartEvent)
    second = await sub.next_msg(timeout=15)
    assert second.data[0] in range(0x80, 0x90)
    assert isinstance(decode_event(second.data), TokenEvent)


async def test_worker_refuses_a_queued_lone_surrogate_at_once(
    worker: Worker, conn: Connection, settings: MeshSettings
) -> None:
    """A request queued straight onto the work queue (``nats req mesh.v1.infer.<model>...``)
    meets the same rule as one sent to an edge: text that is not Unicode is ``invalid_request``,
    rejected once, never given to the engine or redelivered."""
    sub = await conn.nc.subscribe(token_subject("tests", "w-surrogate"))
    payload = b'{"id": "w-surrogate", "prompt": "hi \\ud800", "max_tokens": 4}'
    await _publish_raw(conn, settings, payload, "w-surrogate")
    msg = await sub.next_msg(timeout=5)
    event = decode_event(msg.data, msg.headers)
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
    assert event.id == "w-surrogate" and "not valid Unicode" in event.message
    await stat_reaches(worker.stats, "rejected", 1)
    await eventually(lambda: queue_drained(conn, settings), what="terminated, not redelivered")


async def test_a_request_whose_record_cannot_be_opened_is_answered(
    edge: EdgeNode, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails before the request begins at the edge, its client hears of it, typed: the
    task that served it used to die with it, and the client waited out its own timeout."""

    def broken(*_args: object) -> None:
        raise TypeError("a fingerprint that cannot be made")

    monkeypatch.setattr(edge.records, "open", broken)
    reply = await conn.nc.request(edge.subject, b'{"prompt": "hi"}', timeout=10)
    event = decode_event(reply.data, reply.headers)
    assert isinstance(event, ErrorEvent) and event.code == "internal"
