"""What a person with the `nats` CLI does, spoken over the raw NATS protocol (JSON and text, no
msgpack). docs/protocol.md's commands are these."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from mesh.config import MeshSettings
from mesh.connection import Connection
from tests.helpers import eventually, queue_drained
from tests.nats_wire import RawNatsClient


@pytest.fixture
async def cli(settings: MeshSettings) -> AsyncIterator[RawNatsClient]:
    client = await RawNatsClient().connect(settings.nats.url or "")
    yield client
    await client.close()


async def test_nats_req_with_json_gets_one_json_answer(edge: EdgeNode, cli: RawNatsClient) -> None:
    # nats req mesh.v1.edge.<id>.infer '{"prompt": "Say hi", "max_tokens": 12}'
    reply = await cli.request(edge.subject, b'{"prompt": "Say hi", "max_tokens": 12}')
    answer = reply.json()
    assert answer["t"] == "answer"
    assert answer["text"].strip()
    assert answer["path"] == "local" and answer["routing"]["decision"] == "local"
    assert answer["served_by"] == f"edge:{edge.edge_id}"
    assert answer["usage"]["completion_tokens"] <= 12
    assert reply.headers.get("Content-Type") == "application/json"


async def test_nats_req_with_plain_text_gets_a_json_answer(
    edge: EdgeNode, cli: RawNatsClient
) -> None:
    # nats req mesh.v1.edge.<id>.infer 'What is the capital of France?'
    reply = await cli.request(edge.subject, b"What is the capital of France?")
    answer = reply.json()
    assert answer["t"] == "answer" and answer["text"].strip()


async def test_nats_req_with_headers_and_route_override(
    worker: Worker, edge: EdgeNode, cli: RawNatsClient
) -> None:
    # nats req -H traceparent:... mesh.v1.edge.<id>.infer '{"prompt": "...", "route": "cloud"}'
    reply = await cli.request(
        edge.subject,
        b'{"prompt": "Say hi", "route": "cloud", "max_tokens": 8}',
        headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
    )
    answer = reply.json()
    assert answer["path"] == "cloud"
    assert answer["routing"]["decision"] == "cloud"
    assert answer["routing"]["reason"] == "client asked for route=cloud"
    assert answer["routing"]["forced"] is True
    assert answer["served_by"] == f"cloud:{worker.node_id}"


async def test_nats_req_error_is_json_with_micro_error_headers(
    edge: EdgeNode, cli: RawNatsClient
) -> None:
    reply = await cli.request(edge.subject, b'{"prompt": "hi", "max_tokens": -1}')
    error = reply.json()
    assert error["t"] == "err" and error["code"] == "invalid_request"
    assert "max_tokens" in error["message"] and error["retryable"] is False
    assert reply.headers["Nats-Service-Error-Code"] == "400"
    assert reply.headers["Nats-Service-Error"].startswith("invalid_request:")


async def test_nats_pub_to_the_queue_and_nats_sub_on_the_token_subject(
    worker: Worker, cli: RawNatsClient, conn: Connection, settings: MeshSettings
) -> None:
    # nats sub 'mesh.v1.tok.ops.cli-42'  (in one terminal)
    # nats req mesh.v1.infer.smollm2.ops '{"id": "cli-42", "prompt": "Say hi", "max_tokens": 8}'
    await cli.subscribe("mesh.v1.tok.ops.cli-42")
    ack = await cli.request(
        "mesh.v1.infer.smollm2.ops",
        b'{"id": "cli-42", "prompt": "Say hi", "max_tokens": 8}',
        timeout=10,
    )
    assert ack.json()["stream"] == settings.stream.name  # JetStream's publish ack
    events, headers = [], []
    while not events or events[-1]["t"] not in ("end", "err"):
        msg = await cli.next_msg(timeout=30)
        assert msg.subject == "mesh.v1.tok.ops.cli-42"
        events.append(json.loads(msg.data))  # JSON in, JSON out: readable in a terminal
        headers.append(msg.headers)
    assert events[-1]["t"] == "end" and events[-1]["path"] == "cloud"
    # The start and the end say what they are; tokens, the hot path, carry no headers.
    for event, header in zip(events, headers, strict=True):
        if event["t"] == "tok":
            assert header == {}
        else:
            assert header.get("Content-Type") == "application/json"
    tokens = [e for e in events if e["t"] == "tok"]
    assert tokens and [e["seq"] for e in tokens] == list(range(len(tokens)))
    await eventually(lambda: queue_drained(conn, settings), what="acked")


async def test_nats_req_to_a_missing_edge_gets_no_responders(
    settings: MeshSettings, cli: RawNatsClient
) -> None:
    reply = await cli.request("mesh.v1.edge.nobody.infer", b"hello", timeout=5)
    assert reply.headers.get("Status") == "503"


@pytest.mark.parametrize(
    "payload",
    [
        b'{"prompt": "hi \\ud800"}',
        b'{"messages": [{"role": "system", "content": "\\ud800"},'
        b' {"role": "user", "content": "hi"}]}',
        b'{"prompt": "hi", "stop": ["\\ud800"]}',
    ],
    ids=["prompt", "system", "stop"],
)
async def test_nats_req_with_a_lone_surrogate_is_refused_at_once(
    edge: EdgeNode, cli: RawNatsClient, payload: bytes
) -> None:
    # nats req mesh.v1.edge.<id>.infer '{"prompt": "hi \ud800"}': JSON can say it, UTF-8 cannot
    began = time.monotonic()
    reply = await cli.request(edge.subject, payload, timeout=5)
    error = reply.json()
    assert time.monotonic() - began < 2  # not the engine failing on it seconds later
    assert error["t"] == "err" and error["code"] == "invalid_request", error
    assert "not valid Unicode" in error["message"] and error["retryable"] is False
    assert reply.headers["Nats-Service-Error-Code"] == "400"


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        (b'{"prompt": "hi", "\\ud800": 1}', "unknown field(s): \\ud800"),
        (b'{"id": "\\ud800", "prompt": "hi"}', "id: Value error, text is not valid Unicode"),
    ],
    ids=["field-name", "id"],
)
async def test_nats_req_with_a_lone_surrogate_outside_the_text_still_gets_its_error(
    edge: EdgeNode, cli: RawNatsClient, payload: bytes, said: str
) -> None:
    # The error names what was wrong, spelled out so that it can be sent (it used to be lost).
    reply = await cli.request(edge.subject, payload, timeout=5)
    error = reply.json()
    assert error["code"] == "invalid_request" and said in error["message"], error
    assert reply.headers["Nats-Service-Error-Code"] == "400"
