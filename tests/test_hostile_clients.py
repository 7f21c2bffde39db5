"""Hostile clients against real nodes: what a lying or abusive client can do to the nodes and to
other clients. Each test checks what every honest client got (its own whole answer, or one
typed error), and that the node still serves afterwards.

The edge here runs the deterministic backend (its answers follow from the prompt: ``[tag:X]``
gives ``" X0 X1 ..."``), so every answer can be checked exactly; NATS is a real nats-server.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.queue import MSG_ID_HEADER
from mesh.testing.chaos import expected_text
from protocol.codec import decode_event
from protocol.messages import ErrorEvent
from protocol.subjects import (
    edge_cancel_subject,
    edge_resend_subject,
    infer_subject,
    token_subject,
)
from tests.helpers import eventually, queue_drained
from tests.nats_wire import RawNatsClient, WireMsg

CHAT = "/v1/chat/completions"


def nested_json(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.fixture
async def det_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    """An edge on the deterministic backend, 10 ms a token, with its HTTP API on."""
    settings.edge.model.backend = "deterministic"
    settings.edge.model.token_delay_ms = 10.0
    settings.edge.http_port = 0
    backend = DeterministicBackend(settings.edge.model)
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as node:
        yield node


@pytest.fixture
async def det_worker(settings: MeshSettings, conn: Connection) -> AsyncIterator[Worker]:
    settings.worker.model.backend = "deterministic"
    settings.worker.model.slots = 4
    backend = DeterministicBackend(settings.worker.model)
    async with Worker(settings, conn, backend) as running:
        yield running


async def raw_client(settings: MeshSettings) -> RawNatsClient:
    return await RawNatsClient().connect(settings.nats.url or "")


async def ask_edge(
    settings: MeshSettings, edge: EdgeNode, body: dict[str, object], timeout: float = 10
) -> dict[str, object]:
    """``nats req <edge> '<json>'`` on a connection of its own: the one JSON reply."""
    cli = await raw_client(settings)
    try:
        reply = await cli.request(edge.subject, json.dumps(body).encode(), timeout=timeout)
        answer: dict[str, object] = reply.json()
        return answer
    finally:
        await cli.close()


async def answered_normally(settings: MeshSettings, edge: EdgeNode) -> None:
    body = {"prompt": "[tag:after] hi", "max_tokens": 5, "route": "local"}
    answer = await ask_edge(settings, edge, body)
    assert answer["t"] == "answer" and answer["text"] == expected_text("after", 5), answer


async def test_a_nats_req_whole_answer_carries_its_logprobs(
    settings: MeshSettings, det_edge: EdgeNode
) -> None:
    """``nats req`` with ``logprobs``, not streamed: the one ``answer`` came with the text
    alone (it had no field for them), and a site's kept answers the same."""
    body = {"prompt": "[tag:lp] hi", "max_tokens": 4, "route": "local", "logprobs": True}
    body["top_logprobs"] = 2
    answer = await ask_edge(settings, det_edge, body)
    assert answer["t"] == "answer" and answer["text"] == expected_text("lp", 4), answer
    logprobs = answer["logprobs"]
    assert isinstance(logprobs, list) and len(logprobs) == 4
    assert "".join(entry["token"] for entry in logprobs) == answer["text"]
    assert all(len(entry["top"]) == 2 for entry in logprobs)


# -- payloads that broke the decoder ---------------------------------------------------------

HOSTILE_JSON = [
    ("nested 100k deep", b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"}", "bad_payload"),
    (
        "nested 200 deep in response_format",
        (
            '{"prompt": "hi", "route": "local", "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "x", "schema": ' + nested_json(200) + "}}}"
        ).encode(),
        "invalid_request",
    ),
    (
        "a 5000-digit number",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "bad_payload",
    ),
]


@pytest.mark.parametrize(
    ("what", "payload", "code"), HOSTILE_JSON, ids=[h[0] for h in HOSTILE_JSON]
)
async def test_edge_answers_pathological_json_typed_not_silently(
    det_edge: EdgeNode, settings: MeshSettings, what: str, payload: bytes, code: str
) -> None:
    cli = await raw_client(settings)
    try:
        reply = await cli.request(det_edge.subject, payload, timeout=5)
    finally:
        await cli.close()
    error = reply.json()
    assert error["t"] == "err" and error["code"] == code, (what, error)
    assert reply.headers["Nats-Service-Error-Code"] == "400"
    await answered_normally(settings, det_edge)


async def test_edge_answers_msgpack_nested_within_the_decoders_limit_typed(
    det_edge: EdgeNode, conn: Connection, settings: MeshSettings
) -> None:
    # msgpack's own decoder accepts ~1000 levels; hashing the request for its id then recursed
    # past Python's limit, and the client heard nothing.
    schema = b"\x81\xa1a" * 960 + b"\x80"
    payload = (
        b"\x82"
        + msgpack.packb("prompt")
        + msgpack.packb("hi")
        + msgpack.packb("response_format")
        + b"\x82"
        + msgpack.packb("type")
        + msgpack.packb("json_schema")
        + msgpack.packb("json_schema")
        + b"\x82"
        + msgpack.packb("name")
        + msgpack.packb("x")
        + msgpack.packb("schema")
        + schema
    )
    reply = await conn.nc.request(det_edge.subject, payload, timeout=5)
    event = decode_event(reply.data, reply.headers)
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
    await answered_normally(settings, det_edge)


@pytest.mark.parametrize(
    ("what", "payload"),
    [(what, payload) for what, payload, _code in HOSTILE_JSON],
    ids=[h[0] for h in HOSTILE_JSON],
)
async def test_http_answers_pathological_json_with_an_openai_shaped_400(
    det_edge: EdgeNode, settings: MeshSettings, what: str, payload: bytes
) -> None:
    assert det_edge.http is not None
    body = payload.replace(b'"prompt": "hi"', b'"messages": [{"role": "user", "content": "hi"}]')
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.post(
            det_edge.http.url + CHAT, data=body, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        assert resp.status == 400, (what, resp.status, await resp.text())
        error = (await resp.json())["error"]
    assert error["code"] in {"bad_payload", "invalid_request"} and error["message"], error
    await answered_normally(settings, det_edge)


async def test_worker_terminates_pathological_queued_json_and_keeps_serving(
    det_worker: Worker, conn: Connection, settings: MeshSettings
) -> None:
    # `nats pub mesh.v1.infer.smollm2.ops '<json>'`: a request with a readable id hears a typed
    # error on its own token subject; one nobody can read is terminated, not redelivered.
    sub = await conn.nc.subscribe(token_subject("ops", "deep-1"))
    deep = '{"id": "deep-1", "prompt": "hi", "x": ' + nested_json(200) + "}"
    unreadable = [
        b'{"id": "deep-2", "prompt": "hi", "x": ' + b"[" * 100_000 + b"}",
        b'{"id": "deep-3", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    ]
    for n, payload in enumerate([deep.encode(), *unreadable]):
        await conn.js.publish(
            infer_subject("smollm2", "ops"),
            payload,
            stream=settings.stream.name,
            headers={MSG_ID_HEADER: f"ops.hostile-{n}"},
        )
    event = decode_event((await sub.next_msg(timeout=5)).data)
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request", event
    # ack_wait is 10 s here: a message left unacked would still be pending after 5 s.
    await eventually(lambda: queue_drained(conn, settings), timeout=5, what="every one terminated")
    good = await conn.nc.subscribe(token_subject("ops", "good-1"))
    await conn.js.publish(
        infer_subject("smollm2", "ops"),
        b'{"id": "good-1", "prompt": "[tag:g] hi", "max_tokens": 4}',
        stream=settings.stream.name,
    )
    events: list[dict[str, str]] = []
    while not events or events[-1]["t"] not in ("end", "err"):
        events.append(json.loads((await good.next_msg(timeout=5)).data))
    assert events[-1]["t"] == "end"
    assert "".join(e["text"] for e in events if e["t"] == "tok") == expected_text("g", 4)


# -- one request id, several clients ---------------------------------------------------------


async def test_rejoins_of_one_request_are_bounded(
    det_edge: EdgeNode, conn: Connection, settings: MeshSettings
) -> None:
    # One client re-sends its in-flight request under many inboxes of its own scope: each used
    # to become another reader of the answer, for good, with every later token published to
    # each (no bound: memory and an amplifier). Beyond a few, a re-send gets a typed error.
    prefix = f"_INBOX.{secrets.token_hex(11)}"  # a connection's: named by a 22-character NUID
    got: dict[str, list[dict[str, object]]] = {}

    async def record(msg: object) -> None:
        got.setdefault(msg.subject, []).append(json.loads(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(f"{prefix}.>", cb=record)
    body = json.dumps(
        {"id": "amp", "prompt": "[tag:a] x", "max_tokens": 150, "stream": True, "route": "local"}
    ).encode()
    await conn.nc.publish(det_edge.subject, body, reply=f"{prefix}.first")
    await eventually(lambda: _async(f"{prefix}.first" in got), timeout=5, what="the first start")
    rejoins, batch = 200, 25
    for begin in range(0, rejoins, batch):  # paced, as the edge's concurrency limit would ask
        for n in range(begin, begin + batch):
            await conn.nc.publish(det_edge.subject, body, reply=f"{prefix}.{n}")
        batch_inboxes = [f"{prefix}.{n}" for n in range(begin, begin + batch)]
        await eventually(
            lambda inboxes=batch_inboxes: _async(all(i in got for i in inboxes)),  # type: ignore[misc]
            timeout=5,
            what="the batch heard back",
        )
    # An honest client of the same edge is answered meanwhile, whole.
    await answered_normally(settings, det_edge)

    def outcome(inbox: str) -> dict[str, object] | None:
        last = (got.get(inbox) or [{}])[-1]
        return last if last.get("t") in ("end", "err") else None

    async def all_ended() -> bool:
        return all(outcome(f"{prefix}.{n}") is not None for n in range(rejoins)) and (
            outcome(f"{prefix}.first") is not None
        )

    await eventually(all_ended, timeout=10, what="every re-send answered")
    first = got[f"{prefix}.first"]
    assert first[-1]["t"] == "end"
    assert "".join(str(e["text"]) for e in first if e["t"] == "tok") == expected_text("a", 150)
    ends = [n for n in range(rejoins) if outcome(f"{prefix}.{n}")["t"] == "end"]  # type: ignore[index]
    refused = [outcome(f"{prefix}.{n}") for n in range(rejoins) if n not in ends]
    assert len(ends) <= 16, len(ends)
    assert all(r is not None and r["code"] == "overloaded" for r in refused), refused[:3]
    assert all(len(got[f"{prefix}.{n}"]) == 1 for n in range(rejoins) if n not in ends)


async def _async(value: bool) -> bool:
    return value


async def test_a_second_sender_of_the_same_request_cannot_cancel_the_first(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    # Another connection replying under the first sender's inbox prefix (a server without
    # permissions lets it) sends the same request under the same id: it joins it. Its cancel
    # must end its own reading only, not the first sender's answer.
    victim, attacker = await raw_client(settings), await raw_client(settings)
    try:
        payload = {"id": "job-1", "prompt": "[tag:v] x", "max_tokens": 120, "route": "local"}
        prefix = f"_INBOX.{secrets.token_hex(11)}"  # the victim's connection's
        victim_inbox = f"{prefix}.v"
        await victim.subscribe(victim_inbox)
        await victim.publish(det_edge.subject, json.dumps(payload).encode(), reply=victim_inbox)
        attacker_inbox = f"{prefix}.a"
        await attacker.subscribe(attacker_inbox)
        joined = json.dumps({**payload, "stream": True}).encode()
        await attacker.publish(det_edge.subject, joined, reply=attacker_inbox)
        first = await attacker.next_msg(timeout=5)  # joined: the events so far
        assert first.json()["t"] == "start"
        cancel = json.dumps({"id": "job-1", "inbox": attacker_inbox}).encode()
        said = await attacker.request(edge_cancel_subject(det_edge.edge_id), cancel, timeout=5)
        while said.subject == attacker_inbox:  # stream events still arriving
            said = await attacker.next_msg(timeout=5)
        answer = (await victim.next_msg(timeout=10)).json()
        assert answer["t"] == "answer", answer
        assert answer["text"] == expected_text("v", 120)
    finally:
        await victim.close()
        await attacker.close()


async def test_two_http_clients_and_a_nats_client_with_one_request_id_get_their_own_answers(
    det_edge: EdgeNode, det_worker: Worker, settings: MeshSettings
) -> None:
    assert det_edge.http is not None
    url = det_edge.http.url + CHAT

    async def over_http(tag: str, route: str) -> str:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": f"[tag:{tag}] hi"}],
            "max_tokens": 30,
        }
        headers = {"X-Request-Id": "same-id", "X-Mesh-Route": route}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(url, json=body, headers=headers) as resp,
        ):
            answer = await resp.json()
        assert resp.status == 200, answer
        assert answer["mesh"]["path"] == route
        return str(answer["choices"][0]["message"]["content"])

    async def over_nats(tag: str) -> str:
        body = {"id": "same-id", "prompt": f"[tag:{tag}] hi", "max_tokens": 30, "route": "cloud"}
        answer = await ask_edge(settings, det_edge, body)
        assert answer["t"] == "answer" and answer["path"] == "cloud", answer
        return str(answer["text"])

    texts = await asyncio.gather(
        over_http("h1", "cloud"), over_http("h2", "cloud"), over_http("h3", "local"), over_nats("n")
    )
    assert list(texts) == [
        expected_text("h1", 30),
        expected_text("h2", 30),
        expected_text("h3", 30),
        expected_text("n", 30),
    ]


# -- headers and control messages that lie ---------------------------------------------------

LYING_HEADERS = [
    ("says msgpack, is JSON", "application/msgpack", b'{"prompt": "[tag:j] x"}', "bad_payload"),
    ("says JSON, is msgpack", "application/json", msgpack.packb({"prompt": "x"}), "bad_payload"),
    ("says JSON, is text", "application/json", b"[tag:t] hello", "bad_payload"),
    ("says text, is JSON", "text/plain", b'{"max_tokens": -1}', None),  # a prompt, answered
    ("unknown type", "application/x-evil", b'{"prompt": "[tag:u] x"}', None),
]


@pytest.mark.parametrize(
    ("what", "content_type", "payload", "code"), LYING_HEADERS, ids=[h[0] for h in LYING_HEADERS]
)
async def test_a_content_type_that_lies_gets_a_typed_error_or_an_answer(
    det_edge: EdgeNode,
    settings: MeshSettings,
    what: str,
    content_type: str,
    payload: bytes,
    code: str | None,
) -> None:
    cli = await raw_client(settings)
    try:
        reply = await cli.request(
            det_edge.subject, payload, timeout=5, headers={"Content-Type": content_type}
        )
    finally:
        await cli.close()
    event = decode_event(reply.data, reply.headers)
    if code is None:
        assert event.t == "answer" and event.text.strip(), (what, event)
    else:
        assert isinstance(event, ErrorEvent) and event.code == code, (what, event)


async def test_a_resend_with_an_absurd_position_is_answered_not_crashed(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    cli = await raw_client(settings)
    try:
        inbox = f"_INBOX.{secrets.token_hex(8)}.1"
        await cli.subscribe(inbox)
        body = {"id": "r-1", "prompt": "[tag:r] x", "max_tokens": 3, "stream": True}
        await cli.publish(det_edge.subject, json.dumps({**body, "route": "local"}).encode(), inbox)
        events: list[WireMsg] = []
        while not events or events[-1].json()["t"] not in ("end", "err"):
            events.append(await cli.next_msg(timeout=5))
            # A reply with no body is a status or a service error: say which (a CI run once
            # got one here, and JSON's "Expecting value" told nothing of it).
            assert events[-1].data, events[-1].headers
        for attempt in (b"1e999", b"-1e999", b"NaN", b'"x"', b"[1]"):
            payload = b'{"id": "r-1", "inbox": "%s", "attempt": %s, "seq": 0}' % (
                inbox.encode(),
                attempt,
            )
            began = time.monotonic()
            reply = await cli.request(edge_resend_subject(det_edge.edge_id), payload, timeout=5)
            while reply.subject == inbox:  # events sent again
                reply = await cli.next_msg(timeout=5)
            assert "Nats-Service-Error-Code" not in reply.headers, (attempt, reply)
            assert reply.data, (attempt, reply)  # a status (no responders?) would say so here
            assert reply.json()["known"] is True, (attempt, reply.data)
            assert time.monotonic() - began < 5
    finally:
        await cli.close()


async def test_a_seed_beyond_64_bits_is_an_invalid_request_on_every_path(
    det_edge: EdgeNode, settings: MeshSettings
) -> None:
    # It used to pass validation, answer locally, and fail only when queued for the cloud
    # (msgpack carries 64 bits): `internal: edge failure` instead of naming the field.
    for route in ("local", "cloud"):
        body = {"prompt": "[tag:s] x", "max_tokens": 3, "seed": 2**70, "route": route}
        error = await ask_edge(settings, det_edge, body)
        assert error["t"] == "err" and error["code"] == "invalid_request", (route, error)
    assert det_edge.http is not None
    body = {"messages": [{"role": "user", "content": "x"}], "seed": -(2**70)}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.post(det_edge.http.url + CHAT, json=body) as resp,
    ):
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_request"


async def test_a_whole_answer_too_large_for_one_message_is_a_typed_error(
    settings: MeshSettings, conn: Connection
) -> None:
    """``nats req`` without ``stream``: the answer comes as one message, and the server refuses
    one larger than its ``max_payload`` (1 MiB). The edge dropped it, and the requester heard
    nothing until its own timeout; it now hears why, and how to get the answer."""
    settings.edge.model.backend = "deterministic"
    settings.edge.model.token_delay_ms = 0.0
    tag = "x" * 300  # 4,096 tokens of over 300 bytes each: about 1.3 MB of text
    body = {"prompt": f"[tag:{tag}] go", "max_tokens": 4096, "route": "local"}
    backend = DeterministicBackend(settings.edge.model)
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as edge:
        began = time.monotonic()
        reply = await ask_edge(settings, edge, body, timeout=30)
        took = time.monotonic() - began
        assert reply["t"] == "err" and reply["code"] == "payload_too_large", reply
        assert "stream=true" in str(reply["message"])
        assert took < 15, f"told in {took:.1f}s"
        await answered_normally(settings, edge)
