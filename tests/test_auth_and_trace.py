"""NATS credentials from settings, and W3C trace context carried from a client to the worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from cloud_node.worker import Worker
from mesh.config import LogSettings, MeshSettings, NatsSettings
from mesh.connection import Connection
from mesh.logs import configure_logging, merge_bound
from mesh.nats_server import NatsServer
from protocol.errors import UnauthorizedError
from tests.helpers import stat_reaches
from tests.nats_wire import RawNatsClient

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_token_auth(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'authorization { token: "s3cret-token" }\n'
    )
    async with NatsServer(config=str(conf)) as server:
        async with Connection(NatsSettings(url=server.url, token="s3cret-token"), "ok") as conn:
            assert conn.nc.is_connected
        with pytest.raises(UnauthorizedError) as excinfo:
            await Connection(NatsSettings(url=server.url, connect_timeout=2), "no-auth").connect()
        assert "refused this process's credentials" in str(excinfo.value)


async def test_traceparent_reaches_the_worker(
    worker: Worker, edge: object, settings: MeshSettings
) -> None:
    from edge_node.node import EdgeNode

    assert isinstance(edge, EdgeNode)
    configure_logging(LogSettings(level="info"))
    cli = await RawNatsClient().connect(settings.nats.url or "")
    try:
        with structlog.testing.capture_logs([merge_bound]) as logs:
            reply = await cli.request(
                edge.subject,
                b'{"prompt": "Hi", "route": "cloud", "max_tokens": 4}',
                headers={"traceparent": TRACEPARENT},
            )
            await asyncio.sleep(0.2)  # the worker logs after its ack
    finally:
        configure_logging(LogSettings(level="warning"))
        await cli.close()
    assert reply.json()["path"] == "cloud"
    done = [e for e in logs if e["event"] == "request done"]
    assert done and done[0]["traceparent"] == TRACEPARENT
    trace = TRACEPARENT.split("-")[1]
    assert done[0]["trace_id"] == trace
    canonical = [e for e in logs if e["event"] == "request" and e.get("node_id") == edge.node_name]
    assert canonical and canonical[0]["trace_id"] == trace  # one line per request, traced


def test_library_logs_go_through_the_same_json_renderer() -> None:
    import io
    import json
    import logging

    out = io.StringIO()
    configure_logging(LogSettings(level="info", format="json"), stream=out)
    try:
        logging.getLogger("nats.aio.client").warning("nats said %s", "something")
        logging.getLogger("nats.aio.client").info("below the libraries' level")
        structlog.get_logger("mesh.test").info("ours", answer=42)
    finally:
        configure_logging(LogSettings(level="warning"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [
        ("nats said something", "warning"),
        ("ours", "info"),
    ]
    assert lines[0]["logger"] == "nats.aio.client" and lines[1]["answer"] == 42
    assert all("timestamp" in line for line in lines)


def test_a_json_line_carries_level_time_and_any_value_and_follows_a_reconfiguration() -> None:
    """What an operator's log shipper parses: UTC ISO 8601 time with microseconds, the level
    named as the method (warn and exception named as their levels), a value JSON has no form
    for shown as text; and a process that configures logging again (cached loggers, as the
    daemons run) writes to where it was configured last."""
    import io
    import json
    import re
    from datetime import datetime, timezone

    from mesh.logs import get_logger

    class Tagged:
        def __structlog__(self) -> str:
            return "tagged"

    first, second = io.StringIO(), io.StringIO()
    log = get_logger("mesh.test")
    configure_logging(LogSettings(level="info", format="json"), stream=first, cache=True)
    try:
        before = datetime.now(timezone.utc)
        log.info("ours", path=Path("/x"), tagged=Tagged(), n=1.5)
        log.warning("careful")
        configure_logging(LogSettings(level="info", format="json"), stream=second, cache=True)
        log.info("moved")
        after = datetime.now(timezone.utc)
    finally:
        configure_logging(LogSettings(level="warning"))
    lines = [json.loads(line) for line in first.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [
        ("ours", "info"),
        ("careful", "warning"),
    ]
    assert lines[0]["path"] == repr(Path("/x")) and lines[0]["tagged"] == "tagged"
    assert lines[0]["n"] == 1.5
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line["timestamp"])
        stamped = datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00"))
        assert before.replace(microsecond=0) <= stamped <= after
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == ["moved"]


def test_a_log_stream_that_cannot_be_written_never_fails_the_caller() -> None:
    """A broken stderr (a dead pipe, a full disk) loses log lines, not requests: every level,
    our lines and the libraries', returns normally (the standard library's handlers drop such
    lines too)."""
    import io
    import logging

    out = io.StringIO()
    configure_logging(LogSettings(level="info", format="json"), stream=out)
    try:
        log = structlog.get_logger("mesh.test")
        log.info("written")
        assert '"event": "written"' in out.getvalue()
        out.close()  # writing now raises ValueError
        log.info("lost")
        log.warning("lost")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("lost")
        logging.getLogger("nats.aio.client").warning("lost too")
        returned = True
    finally:
        configure_logging(LogSettings(level="warning"))
    assert returned  # every call above came back


async def test_with_otel_on_the_worker_span_is_a_child_of_the_edge_span(
    settings: MeshSettings, conn: object, worker_backend: object
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from edge_node.node import EdgeNode
    from edge_node.router import HeuristicRouter
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.config import ModelSettings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    settings.log.otel = True
    backend = DeterministicBackend(ModelSettings(backend="deterministic"))
    async with (
        Worker(settings, conn, backend) as worker,  # type: ignore[arg-type]
        EdgeNode(settings, conn, backend, HeuristicRouter()) as edge,  # type: ignore[arg-type]
    ):
        cli = await RawNatsClient().connect(settings.nats.url or "")
        try:
            reply = await cli.request(
                edge.subject,
                b'{"prompt": "Hi", "route": "cloud", "max_tokens": 4}',
                headers={"traceparent": TRACEPARENT},
            )
        finally:
            await cli.close()
        await stat_reaches(worker.stats, "completed", 1)
    assert reply.json()["path"] == "cloud"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    edge_span, worker_span = spans["mesh.edge.request"], spans["mesh.worker.request"]
    client_trace = int(TRACEPARENT.split("-")[1], 16)
    assert edge_span.context.trace_id == worker_span.context.trace_id == client_trace
    assert worker_span.parent is not None
    assert worker_span.parent.span_id == edge_span.context.span_id
    assert edge_span.attributes["mesh.path"] == "cloud"


async def test_bound_fields_reach_every_line_inside_and_its_tasks_and_go_after() -> None:
    """What a request binds (``mesh.logs.bound``) is on every line logged inside it, our own and
    the libraries', in tasks it starts too; an inner binding adds to the outer one; a field the
    line names itself wins; after the block, nothing of it is left."""
    import io
    import json
    import logging

    from mesh.logs import bound

    out = io.StringIO()
    configure_logging(LogSettings(level="info", format="json"), stream=out)
    try:
        log = structlog.get_logger("mesh.test")
        with bound(request_id="r1", node_id="edge:a"):
            log.info("outer")
            with bound(attempt=2, node_id="edge:b"):
                log.info("inner", request_id="mine")
                logging.getLogger("aiohttp.client").warning("library")

            async def in_a_task() -> None:
                log.info("task")

            await asyncio.create_task(in_a_task())
        log.info("after")
    finally:
        configure_logging(LogSettings(level="warning"))
    lines = {line["event"]: line for line in map(json.loads, out.getvalue().splitlines())}
    assert (lines["outer"]["request_id"], lines["outer"]["node_id"]) == ("r1", "edge:a")
    assert "attempt" not in lines["outer"]
    assert lines["inner"]["request_id"] == "mine"
    assert (lines["inner"]["node_id"], lines["inner"]["attempt"]) == ("edge:b", 2)
    assert (lines["library"]["node_id"], lines["library"]["attempt"]) == ("edge:b", 2)
    assert (lines["task"]["request_id"], lines["task"]["node_id"]) == ("r1", "edge:a")
    assert "request_id" not in lines["after"] and "node_id" not in lines["after"]
