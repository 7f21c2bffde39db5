"""One worker holding two deliveries of one request: the worker stood still past ``ack_wait``,
JetStream gave the request back to it, and it continues the answer as a second attempt while the
first, waking, sees the newer attempt and stops. The first attempt's end must not take the
second's place in the worker's books: before, it did, and the worker then answered "not held"
to a reader's "are you there?" while it was still streaming the answer, and ignored the
client's cancel, which it answered "not held" too, making the whole answer for nobody."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from protocol.errors import CancelledByClientError
from protocol.subjects import address_of, worker_alive_subject, worker_cancel_subject
from tests.conftest import make_settings
from tests.helpers import eventually, holds

KEY = "the-client-s-own-cancel-key"


async def test_the_end_of_a_superseded_delivery_leaves_the_running_one_in_place(
    nats_server: NatsServer,
) -> None:
    settings = make_settings(nats_server.url, stream__ack_wait=1.0)
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=2, token_delay_ms=50, faults=False)
    )
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "reader") as reader,
        Worker(settings, wconn, backend) as worker,
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        handler = worker.handler
        first_token = asyncio.Event()

        async def asking() -> object:
            async for _event in client.stream(
                "[tag:two] count", max_tokens=100, via="cloud", cancel_key=KEY
            ):
                first_token.set()
            return None

        answer = asyncio.ensure_future(asking())
        await eventually(lambda: holds(bool(handler.inflight)), what="the first delivery")
        address = next(iter(handler.inflight))
        scope, request_id = address_of(address)
        await asyncio.wait_for(first_token.wait(), 10)  # the answer is under way
        time.sleep(1.6)  # noqa: ASYNC251 - the whole worker stands still past ack_wait (GC, SIGSTOP)
        await eventually(
            lambda: holds(worker.counts.snapshot().get("superseded", 0) == 1),
            what="the first delivery superseded by the second",
        )
        assert backend.started == 2 and not answer.done()
        assert address in handler.inflight
        assert address in handler.publishers and address in handler.keepalives

        said = await reader.nc.request(
            worker_alive_subject(worker.node_id, scope, request_id), b"", timeout=2
        )
        assert json.loads(said.data)["held"] is True, said.data
        said = await reader.nc.request(
            worker_cancel_subject(worker.node_id, scope, request_id),
            json.dumps({"key": KEY}).encode(),
            timeout=2,
        )
        assert json.loads(said.data)["held"] is True, said.data
        with pytest.raises(CancelledByClientError):
            await asyncio.wait_for(answer, 10)
        await eventually(lambda: holds(not handler.inflight), what="the cancelled answer ended")
