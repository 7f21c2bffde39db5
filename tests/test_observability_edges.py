"""Observability under hostile input and faults (review S18b): trace headers, what the edge
remembers of what clients send, the counters ``mesh status`` shows, the metrics page. Each test
marked "Before the fix" failed on the code before it (its comment says what happened then); the
guards passed there too and keep what was found sound.

Real nats-server, real edge and worker (deterministic backend: every answer is known exactly).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import generate_latest

import mesh.logs
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.status import collect_status
from mesh.tracing import trace_headers
from protocol.errors import MeshError
from tests.nats_wire import RawNatsClient

CLOUD_MODEL = "org/big-model.v1"
"""A model only the worker serves (not the edge's local one), with characters a subject token
cannot hold (``/`` and ``.``: its token is ``org_big-model_v1``)."""


def sample(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        match = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


@pytest.fixture
async def mesh_pair(
    settings: MeshSettings, conn: Connection
) -> AsyncIterator[tuple[EdgeNode, Worker]]:
    """An edge (HTTP on, lenient decoding as by default) and a worker serving CLOUD_MODEL, both
    deterministic."""
    settings.strict_decode = False  # the default of a deployed edge
    settings.edge.http_port = 0
    settings.edge.model.backend = "deterministic"
    settings.edge.model.faults = False
    settings.worker.model.backend = "deterministic"
    settings.worker.model.name = CLOUD_MODEL
    settings.worker.model.slots = 8
    settings.stream.max_deliver = 2
    async with (
        Worker(settings, conn, DeterministicBackend(settings.worker.model)) as worker,
        EdgeNode(
            settings, conn, DeterministicBackend(settings.edge.model), HeuristicRouter()
        ) as edge,
    ):
        # The worker's consumer exists once it started: the edge may route to its pool.
        assert await edge.models.deployed(CLOUD_MODEL)
        yield edge, worker


async def _raw_http(port: int, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (header bytes no client library would send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n" % len(body) + head + b"\r\n" + body
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


# Before the fix (first rule / typed): a trace header carrying bytes that are not UTF-8 (any
# HTTP client or proxy may send obs-text) makes a cloud-routed request crash in nats-py's
# header encoding (UnicodeEncodeError at publish): the client gets HTTP 500 "edge failure"
# instead of its answer. A trace header the edge cannot forward must be dropped, never fail
# the request.
async def test_a_trace_header_that_is_not_utf8_does_not_fail_the_request(
    mesh_pair: tuple[EdgeNode, Worker],
) -> None:
    edge, _worker = mesh_pair
    assert edge.http is not None
    body = json.dumps(
        {
            "model": CLOUD_MODEL,
            "messages": [{"role": "user", "content": "[tag:u] hi"}],
            "max_tokens": 4,
        }
    ).encode()
    status, answer = await _raw_http(edge.http.port, b"traceparent: 00-\xff\xfe\xe9-01\r\n", body)
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["message"]["content"] == " u0 u1 u2 u3"


# Before the fix (first rule / error text): the edge forwarded the client's trace headers to
# the queue unchecked. A traceparent over 64 KiB (W3C's is 55 characters) makes the server
# refuse the queued message ("header size exceeds maximum allowed of 64k"), which
# mesh/queue.py:publish_request files as "overloaded: the cloud queue is full": a request for a
# cloud-only model gets a *retryable* "unavailable ... the cloud queue is full" although the
# queue is empty, and every retry fails the same way (a forced-cloud request falls back to the
# local model under the same false reason). An invalid trace context should be dropped.
async def test_an_oversized_trace_header_is_not_a_full_queue(
    mesh_pair: tuple[EdgeNode, Worker], settings: MeshSettings
) -> None:
    edge, _worker = mesh_pair
    raw = await RawNatsClient().connect(settings.nats.url)
    try:
        body = json.dumps({"prompt": "[tag:q] hi", "max_tokens": 2, "model": CLOUD_MODEL})
        reply = await raw.request(
            edge.subject, body.encode(), timeout=10, headers={"traceparent": "00-" + "a" * 70_000}
        )
    finally:
        await raw.close()
    said = reply.json()
    assert "queue is full" not in said.get("message", ""), said
    assert said.get("t") == "answer" and said["text"] == " q0 q1", said


# Before the fix (memory under hostile input): mesh/logs.py:log_unknown_fields kept
# every (kind, set of unknown field names) it ever saw in a module-level set, never pruned, and
# logs one line for each new one. A client that puts one random extra field in each request
# (``nats req ... '{"prompt":"hi","x<random>":1}'``) grows the edge by one entry and one log
# line per request, for ever.
async def test_random_unknown_fields_do_not_grow_the_edge_per_request(
    mesh_pair: tuple[EdgeNode, Worker], conn: Connection
) -> None:
    edge, _worker = mesh_pair
    before = len(mesh.logs._seen_unknown)

    async def one() -> None:
        body = {
            "prompt": "[tag:k] hi",
            "max_tokens": 1,
            "model": CLOUD_MODEL,
            f"x{secrets.token_hex(8)}": 1,
        }
        reply = await conn.nc.request(edge.subject, json.dumps(body).encode(), timeout=10)
        answer = json.loads(reply.data)
        assert answer.get("text") == " k0", answer

    for _ in range(25):
        await asyncio.gather(*(one() for _ in range(20)))
    grown = len(mesh.logs._seen_unknown) - before
    assert len(mesh.logs._seen_unknown) <= mesh.logs.SEEN_UNKNOWN_MAX, f"{grown} entries behind"


# Before the fix (memory under hostile input): edge_node/served.py:CloudModels._seen
# ("a bounded set, as the edge's pools") keeps every model *name* a pool was found for. Model
# names map to subject tokens many-to-one (every character outside [A-Za-z0-9_-] becomes "_"),
# so "org/big-model.v1", "org\u4e00big-model\u4e01v1", ... all reach the same pool: a client
# naming a fresh alias per request (each answered, correctly, by the pool) grows the set by one
# name per request, for ever.
async def test_aliases_of_a_served_model_do_not_grow_the_edge_per_request(
    mesh_pair: tuple[EdgeNode, Worker], conn: Connection
) -> None:
    edge, _worker = mesh_pair
    before = len(edge.models._seen)

    async def one() -> None:
        cjk = [chr(random.randint(0x4E00, 0x9FFF)) for _ in range(2)]
        alias = f"org{cjk[0]}big-model{cjk[1]}v1"
        body = {"prompt": "[tag:a] hi", "max_tokens": 1, "model": alias}
        reply = await conn.nc.request(edge.subject, json.dumps(body).encode(), timeout=10)
        answer = json.loads(reply.data)
        assert answer.get("text") == " a0" and answer["path"] == "cloud", answer

    for _ in range(25):
        await asyncio.gather(*(one() for _ in range(20)))
    grown = len(edge.models._seen) - before
    assert grown <= 100, f"500 requests left {grown} model names behind (one per request)"


# Before the fix (counters that disagree): an error that comes from the cloud (here
# max_deliveries: the engine failed on both deliveries) is counted in Prometheus
# (mesh_edge_errors_total{code="max_deliveries"}) but not in the edge's STATS counters that
# `mesh status --json` and `nats micro stats mesh-edge` show (no "error.max_deliveries"): the
# edge's "error.<code>" counters are only bumped for errors raised at the edge itself
# (edge_node/node.py:serve), not for an outcome relayed from a worker. test_operations says
# refused requests are "counted in Prometheus as in mesh status"; served ones are not.
async def test_an_error_relayed_from_the_cloud_is_counted_in_mesh_status_as_in_prometheus(
    mesh_pair: tuple[EdgeNode, Worker], conn: Connection, settings: MeshSettings
) -> None:
    edge, _worker = mesh_pair
    async with MeshClient(settings=settings, connection=conn, first_event_timeout=10) as client:
        with pytest.raises(MeshError) as failed:
            await client.complete("[tag:f] hi [fail-after:1]", model=CLOUD_MODEL, max_tokens=4)
    assert failed.value.code.value == "max_deliveries"
    page = generate_latest(edge.metrics.registry).decode()
    assert sample(page, "mesh_edge_errors_total", code="max_deliveries") == 1
    status = await collect_status(conn, settings)
    counters = next(e["counters"] for e in status["edges"] if e["edge_id"] == edge.edge_id)
    assert counters.get("error.max_deliveries") == 1, counters


# GUARD (passes): the metrics page does not grow with what clients choose. 600 requests over
# NATS and HTTP with random model names, request ids, trace headers and unknown fields leave
# the page as it was after the first few (every label takes a few known values).
async def test_the_metrics_page_does_not_grow_with_client_chosen_values(
    mesh_pair: tuple[EdgeNode, Worker], conn: Connection
) -> None:
    edge, _worker = mesh_pair
    assert edge.http is not None

    async with aiohttp.ClientSession(base_url=edge.http.url) as web:

        async def page() -> str:
            async with web.get("/metrics") as resp:
                return await resp.text()

        async def burst(count: int) -> None:
            async def over_nats() -> None:
                body = {"prompt": "hi", "max_tokens": 1, "model": f"m{secrets.token_hex(6)}"}
                await conn.nc.request(edge.subject, json.dumps(body).encode(), timeout=10)

            async def over_http() -> None:
                headers = {
                    "X-Request-Id": secrets.token_hex(8),
                    "traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01",
                    "tracestate": f"v{secrets.token_hex(4)}=x",
                }
                body = {
                    "model": f"m{secrets.token_hex(6)}",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                }
                async with web.post("/v1/chat/completions", json=body, headers=headers) as resp:
                    assert resp.status == 404  # unknown_model, typed
                    await resp.read()

            for _ in range(count // 20):
                nats_ones, http_ones = (
                    (over_nats() for _ in range(10)),
                    (over_http() for _ in range(10)),
                )
                await asyncio.gather(*nats_ones, *http_ones)

        await burst(40)
        first = await page()
        await burst(600)
        after = await page()
    assert _names(after) == _names(first)
    assert abs(len(after) - len(first)) < 200


def _names(page: str) -> set[str]:
    return {line.split(" ")[0] for line in page.splitlines() if not line.startswith("#")}


def test_trace_context_in_w3c_form_is_passed_on_and_any_other_dropped() -> None:
    """GUARD of the fix: a W3C ``traceparent`` and ``tracestate`` go on unchanged; a value in
    another form (not W3C's, not ASCII, over 512 characters) is dropped, and other headers are
    never trace context."""
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_headers({"traceparent": parent, "tracestate": "congo=t61rcWkgMzE"}) == {
        "traceparent": parent,
        "tracestate": "congo=t61rcWkgMzE",
    }
    assert trace_headers({"TraceParent": f" {parent} "}) == {"traceparent": parent}
    for bad in ("00-\udcff-01", "00-" + "a" * 70_000, parent.upper(), parent[:-1]):
        assert trace_headers({"traceparent": bad}) == {}
    assert trace_headers({"tracestate": "x" * 513}) == {}
    assert trace_headers({"tracestate": "k=\u00e9"}) == {}
    assert trace_headers({"x-other": parent}) == {}
