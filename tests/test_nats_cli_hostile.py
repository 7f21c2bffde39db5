"""A `nats` CLI user (or a raw socket writing what nats-py refuses) against the edge's and
the cloud's request subjects. Each test says what an honest client sees.

Review S27b wrote these (and review S27c the short header blocks and the guesses on both
sides of a cancel). These failed before their fixes:

- one message whose subject, reply subject or header status is not UTF-8 stopped nats-py's
  read loop: the node heard nothing for 3 to 4 s, and what was sent to it meanwhile was lost
  (``mesh.safe_client``);
- eight cancels with guessed keys voided the sender's own cancel of a request still in the
  queue (``cloud_node.cancels``).

Real nats-server; the edge and the worker run the deterministic backend (``[tag:X]`` gives
``" X0 X1 ..."``), so every answer is checked exactly.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import pytest

from cloud_node.cancels import CancelBook
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text
from protocol.messages import InferRequest
from protocol.subjects import infer_subject, token_subject
from tests.helpers import eventually, queue_drained
from tests.nats_wire import RawNatsClient


@pytest.fixture
async def det_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    """An edge on the deterministic backend, 10 ms a token."""
    settings.edge.model.backend = "deterministic"
    settings.edge.model.token_delay_ms = 10.0
    backend = DeterministicBackend(settings.edge.model)
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as node:
        yield node


@contextlib.asynccontextmanager
async def _det_worker(
    settings: MeshSettings, conn: Connection, slots: int
) -> AsyncIterator[Worker]:
    """A worker on the deterministic backend, 10 ms a token."""
    settings.worker.model.backend = "deterministic"
    settings.worker.model.slots = slots
    settings.worker.model.token_delay_ms = 10.0
    backend = DeterministicBackend(settings.worker.model)
    async with Worker(settings, conn, backend) as running:
        yield running


@pytest.fixture
async def det_worker(settings: MeshSettings, conn: Connection) -> AsyncIterator[Worker]:
    async with _det_worker(settings, conn, 4) as running:
        yield running


def uid(name: str) -> str:
    """``name`` made unique: the answer store keeps an answer 120 s across tests, and another
    request's content under the same id would be ``duplicate``."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def raw_client(settings: MeshSettings) -> RawNatsClient:
    return await RawNatsClient().connect(settings.nats.url or "")


def raw_send(url: str, protocol: bytes) -> None:
    """What a client on a plain socket writes (bytes nats-py will not write: a subject or a
    header that is not UTF-8); returns once the server answered its PING (it has them)."""
    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=5) as sock:
        reader = sock.makefile("rb")
        reader.readline()  # INFO
        sock.sendall(b'CONNECT {"headers":true,"verbose":false}\r\n' + protocol + b"PING\r\n")
        while (line := reader.readline().strip()) != b"PONG":
            assert not line.startswith(b"-ERR"), line


def hpub(subject: bytes, head: bytes, payload: bytes, reply: bytes = b"") -> bytes:
    """An HPUB line with ``head`` as the raw header block (``NATS/1.0...\\r\\n\\r\\n``)."""
    tail = b" " + reply if reply else b""
    sizes = b" %d %d\r\n" % (len(head), len(head) + len(payload))
    return b"HPUB " + subject + tail + sizes + head + payload + b"\r\n"


async def ask(
    settings: MeshSettings,
    subject: str,
    body: bytes,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> dict:  # type: ignore[type-arg]
    """``nats req SUBJECT BODY --timeout [-H ...]`` on a connection of its own: the one JSON
    reply (a JetStream publish ack for the queue)."""
    cli = await raw_client(settings)
    try:
        reply = await cli.request(subject, body, timeout=timeout, headers=headers)
        answer: dict = reply.json()  # type: ignore[type-arg]
        return answer
    finally:
        await cli.close()


# -- bytes nats-py cannot decode stop a node's connection from reading -----------------------

NOT_UTF8 = [
    # `PUB <edge infer> <reply> n`: a reply subject with bytes that are not UTF-8
    ("reply subject", lambda subject: b"PUB %s _INBOX.\xff\xfe.x 2\r\nhi\r\n" % subject),
    # an HPUB whose header block's status is not UTF-8 (nats-py decodes it outside its try)
    ("header status", lambda subject: hpub(subject, b"NATS/1.0 \xff\xfe\xfd\r\n\r\n", b"hi")),
    ("status text", lambda subject: hpub(subject, b"NATS/1.0 503 \xff\xfe\r\n\r\n", b"hi")),
    # a header block nats-py indexes past (`NATS/1.0` alone) or that is none (review S27c)
    ("version line only", lambda subject: hpub(subject, b"NATS/1.0", b"hi", b"_INBOX.x")),
    ("not a version line", lambda subject: hpub(subject, b"XXXX", b"hi", b"_INBOX.x")),
]


@pytest.mark.parametrize("make", [n[1] for n in NOT_UTF8], ids=[n[0] for n in NOT_UTF8])
async def test_one_message_with_bytes_that_are_not_utf8_does_not_deafen_the_edge(
    det_edge: EdgeNode, settings: MeshSettings, make: object
) -> None:
    """A user sends one message to the edge's infer subject whose reply subject (or header
    status) is not UTF-8. The next user's `nats req` must be answered as always; it got
    nothing at all: nats-py's read loop raised UnicodeDecodeError, logged it and stopped
    reading, so the edge heard nothing until its pings went stale (3 to 4 s) and every message
    sent to it meanwhile was lost with the old socket."""
    assert callable(make)
    raw_send(settings.nats.url or "", make(det_edge.subject.encode()))
    body = b'{"prompt": "[tag:next] hi", "max_tokens": 4, "route": "local"}'
    answer = await ask(settings, det_edge.subject, body, timeout=3)
    assert answer["t"] == "answer" and answer["text"] == expected_text("next", 4), answer


@pytest.mark.parametrize(
    "cancel",
    [b"PUB mesh.v1.cancel.\xff.x 2\r\nhi\r\n", hpub(b"mesh.v1.cancel.ops.x", b"NATS/1.0", b"hi")],
    ids=["subject not utf8", "header block version line only"],
)
async def test_one_cancel_with_a_subject_that_is_not_utf8_does_not_stall_every_worker(
    det_worker: Worker, settings: MeshSettings, cancel: bytes
) -> None:
    """Every worker subscribes to ``mesh.v1.cancel.>``. A user publishes one `cancel` there
    whose subject token is not UTF-8 (``mesh.v1.cancel.\\xff.x``, no reply). A request queued
    right after (`nats req mesh.v1.infer.smollm2.ops '{...}'`) must start streaming within a
    second, as it does otherwise; every worker's read loop stopped instead, and nothing was
    pulled or cancelled, and no answer in flight moved, until its pings went stale."""
    url = settings.nats.url or ""
    raw_send(url, cancel)
    cli = await raw_client(settings)
    try:
        name = uid("after")
        await cli.subscribe(token_subject("ops", name))
        began = time.monotonic()
        body = b'{"id": "%s", "prompt": "[tag:w] hi", "max_tokens": 4}' % name.encode()
        ack = await ask(settings, infer_subject("smollm2", "ops"), body, timeout=5)
        assert ack.get("stream") == settings.stream.name, ack
        events = []
        while not events or events[-1]["t"] not in ("end", "err"):
            events.append((await cli.next_msg(timeout=10)).json())
            if len(events) == 1:
                first = time.monotonic() - began
        assert events[-1]["t"] == "end", events[-1]
        assert "".join(e["text"] for e in events if e["t"] == "tok") == expected_text("w", 4)
        assert first < 1.5, f"the first event came {first:.2f}s after the request was queued"
    finally:
        await cli.close()


# -- cancels for ids that are not yours ------------------------------------------------------


@pytest.fixture
async def one_slot_worker(settings: MeshSettings, conn: Connection) -> AsyncIterator[Worker]:
    async with _det_worker(settings, conn, 1) as running:
        yield running


async def read_answer(cli: RawNatsClient, subject: str, timeout: float) -> list[dict]:  # type: ignore[type-arg]
    """The JSON events on ``subject`` up to its end or error."""
    events: list[dict] = []  # type: ignore[type-arg]
    while not events or events[-1]["t"] not in ("end", "err"):
        msg = await cli.next_msg(timeout=timeout)
        if msg.subject == subject:
            events.append(msg.json())
    return events


@pytest.mark.parametrize(("before", "after"), [(8, 0), (4, 4)])
async def test_cancels_with_wrong_keys_do_not_void_the_senders_own_cancel(
    one_slot_worker: Worker, settings: MeshSettings, before: int, after: int
) -> None:
    """A `nats` CLI user queues ``victim-1`` in scope ``ops`` with a ``cancel_key``; it waits
    in the queue behind a busy worker. Someone else publishes cancels for the same subject
    with keys they guessed (`nats pub mesh.v1.cancel.ops.victim-1 '{"key": "guess-N"}'`),
    before and after the user's own cancel with the right key. The user must get
    ``cancelled`` and no tokens. The worker kept at most 8 keys per cancelled id (the first 8:
    review S27b), then the first 4 and the latest 4 (review S27c): the user's own key was
    pushed out, and the answer was generated whole."""
    queue = infer_subject("smollm2", "ops")
    cli = await raw_client(settings)
    try:
        busy_id, victim_id = uid("busy"), uid("victim")
        busy = token_subject("ops", busy_id)
        victim = token_subject("ops", victim_id)
        await cli.subscribe(busy)
        await cli.subscribe(victim)
        body = {"id": busy_id, "prompt": "[tag:b] x", "max_tokens": 120}
        await ask(settings, queue, json.dumps(body).encode(), timeout=5)
        await read_answer_start(cli, busy)  # the worker's one slot is taken
        body = {"id": victim_id, "prompt": "[tag:v] x", "max_tokens": 8}
        body["cancel_key"] = "victim-key-1"
        await ask(settings, queue, json.dumps(body).encode(), timeout=5)
        cancel = f"mesh.v1.cancel.ops.{victim_id}"
        for n in range(before):
            await cli.publish(cancel, b'{"key": "guess-%d-xx"}' % n)
        await cli.publish(cancel, b'{"key": "victim-key-1"}')
        for n in range(after):
            await cli.publish(cancel, b'{"key": "late-%d-xxx"}' % n)
        events = await read_answer(cli, victim, timeout=10)
    finally:
        await cli.close()
    assert [e["t"] for e in events if e["t"] == "tok"] == [], events
    assert events[-1]["t"] == "err" and events[-1]["code"] == "cancelled", events[-1]


async def read_answer_start(cli: RawNatsClient, subject: str) -> None:
    """Wait for the first token on ``subject``: its worker holds the request."""
    while True:
        msg = await cli.next_msg(timeout=5)
        if msg.subject == subject and msg.json()["t"] == "tok":
            return


# -- a queued message that looks like a pull request's status -------------------------------


@pytest.mark.parametrize("status", ["408", "503"])
async def test_a_queued_message_with_a_status_header_is_not_taken_for_the_pulls_end(
    one_slot_worker: Worker, settings: MeshSettings, status: str
) -> None:
    """`nats pub mesh.v1.infer.smollm2.ops '' -H 'Status:STATUS'`: JetStream keeps the
    message with its header and delivers it to a worker's pull inbox, where it reads like
    the server's own status for that pull request. Requests queued next must be answered
    whole, each once, and the worker must stay at its one slot; the message itself is settled
    as any unreadable request is (an error on its token subject), not redelivered every
    ``ack_wait``, and no restore runs for it. Before, a 503 read as "no consumer" made the
    worker put its queue back for nothing, and the message came back until ``max_deliver``."""
    queue = infer_subject("smollm2", "ops")
    cli = await raw_client(settings)
    restores: list[str] = []
    again = one_slot_worker.conn.recovery.again
    one_slot_worker.conn.recovery.again = lambda name, why: restores.append(why) or again(name, why)  # type: ignore[method-assign]
    try:
        await cli.subscribe("mesh.v1.tok.ops.*")
        ack = await ask(settings, queue, b"", timeout=5, headers={"Status": status})
        assert ack.get("stream") == settings.stream.name, ack
        told = (await cli.next_msg(timeout=5)).json()  # its error, under the id it was given
        assert told["t"] == "err" and told["id"] == f"queued-{ack['seq']}", told
        names = [uid(f"st{n}") for n in range(3)]  # their answers on the same subscription
        began = time.monotonic()
        for name in names:
            body = {"id": name, "prompt": f"[tag:{name}] x", "max_tokens": 20}
            await ask(settings, queue, json.dumps(body).encode(), timeout=5)
        texts: dict[str, str] = {}
        ended: dict[str, int] = dict.fromkeys(names, 0)
        while not all(ended.values()):
            msg = await cli.next_msg(timeout=10)
            event = msg.json()
            name = msg.subject.rpartition(".")[2]
            if event["t"] == "tok":
                texts[name] = texts.get(name, "") + event["text"]
            elif event["t"] in ("end", "err"):
                ended[name] += 1
                assert event["t"] == "end", event
        took = time.monotonic() - began
        for name in names:
            assert texts[name] == expected_text(name, 20), (name, texts[name])
        assert took < 5, f"three 20-token answers took {took:.1f}s"
        assert one_slot_worker.backend.capacity().total == 1
        await eventually(lambda: queue_drained(one_slot_worker.conn, settings), 3, "settled")
        assert restores == [], restores
    finally:
        await cli.close()


# -- deadlines far away ------------------------------------------------------------------------

FAR = [("1e308", b"1e308"), ("Infinity", b"Infinity"), ("2**70", b"%d" % 2**70)]


@pytest.mark.parametrize("route", ["local", "cloud"])
@pytest.mark.parametrize("deadline", [f[1] for f in FAR], ids=[f[0] for f in FAR])
async def test_an_absurd_deadline_at_the_edge_is_answered_or_refused_typed(
    det_edge: EdgeNode, det_worker: Worker, settings: MeshSettings, deadline: bytes, route: str
) -> None:
    """`nats req <edge> '{"prompt": ..., "deadline": 1e308}'` (or ``Infinity``, which
    Python's JSON reads): one reply, the answer or a typed ``invalid_request``, within a
    few seconds, and the edge answers the next request."""
    body = b'{"prompt": "[tag:d] x", "max_tokens": 4, "route": "%s", "deadline": %s}' % (
        route.encode(),
        deadline,
    )
    reply = await ask(settings, det_edge.subject, body, timeout=8)
    if reply["t"] == "err":
        assert reply["code"] == "invalid_request", reply
    else:
        assert reply["t"] == "answer" and reply["text"] == expected_text("d", 4), reply
    after = b'{"prompt": "[tag:n] x", "max_tokens": 4, "route": "%s"}' % route.encode()
    answer = await ask(settings, det_edge.subject, after, timeout=8)
    assert answer["t"] == "answer" and answer["text"] == expected_text("n", 4), answer


@pytest.mark.parametrize("deadline", [f[1] for f in FAR], ids=[f[0] for f in FAR])
async def test_an_absurd_deadline_queued_by_hand_is_answered_or_refused_typed(
    det_worker: Worker, settings: MeshSettings, deadline: bytes
) -> None:
    """`nats req mesh.v1.infer.smollm2.ops '{"id": ..., "deadline": 1e308}'`: the token
    subject carries one whole answer or one typed error, and the worker serves on."""
    queue = infer_subject("smollm2", "ops")
    cli = await raw_client(settings)
    try:
        far = uid("far")
        for name, extra in ((far, b', "deadline": ' + deadline), (uid("near"), b"")):
            subject = token_subject("ops", name)
            await cli.subscribe(subject)
            body = b'{"id": "%s", "prompt": "[tag:q] x", "max_tokens": 4%s}' % (
                name.encode(),
                extra,
            )
            await ask(settings, queue, body, timeout=5)
            events = await read_answer(cli, subject, timeout=8)
            if events[-1]["t"] == "err":
                assert name == far and events[-1]["code"] == "invalid_request", events[-1]
            else:
                text = "".join(e["text"] for e in events if e["t"] == "tok")
                assert text == expected_text("q", 4), (name, events)
    finally:
        await cli.close()


def test_a_cancel_book_keeps_every_key_within_its_scopes_budget() -> None:
    """Keys count one by one against their scope's budget, not a few per id: the sender's key
    acts whatever number of guesses came before it or after it, within the scope's budget (8
    before it voided it once, review S27b; 4 on each side after that, review S27c). Guesses
    never cancel, and what a flood makes a worker hold stays bounded."""
    request = InferRequest(id="v-1", prompt="x", cancel_key="right-key-1")
    address = token_subject("ops", "v-1")
    for before, after in ((8, 0), (0, 8), (4, 4), (40, 40)):
        book = CancelBook(ttl=60, per_scope=100)
        for n in range(before):
            book.add(address, f"guess-{n}")
        book.add(address, "right-key-1")
        for n in range(after):
            book.add(address, f"late-{n}")
        assert book.cancels(address, request), (before, after)
    flooded = CancelBook(ttl=60, max_size=300, per_scope=100)
    for n in range(1000):
        flooded.add(address, f"guess-{n}")
        flooded.add(token_subject(f"s{n % 7}", f"r{n}"), "k")
    assert not flooded.cancels(address, request)  # guesses never act
    assert len(flooded._heard) <= 300 and len(flooded._scopes["ops"]) <= 100
    other = CancelBook(ttl=60, per_scope=100)
    other.add(token_subject("mine", "v-1"), "right-key-1")
    for n in range(1000):  # a flood in another scope leaves this one's cancel
        other.add(token_subject("ops", f"r{n}"), "k")
    assert other.cancels(token_subject("mine", "v-1"), request)
