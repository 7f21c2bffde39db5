"""A worker's look for a kept answer (``Keeper.exists``) is bounded like its other looks while
it holds a delivery (``store_look_timeout``), not by the 5 s request timeout: a JetStream that
does not answer (a stream without a leader, a link that swallows) held the delivery 5 s, past
a fifth of ``ack_wait``, when the answer is generated again safely (the site keeps one answer
per id)."""

from __future__ import annotations

import time

from cloud_node.delivery import store_look_timeout
from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings


async def test_a_look_for_a_kept_answer_that_gets_no_reply_ends_at_the_look_timeout(
    nats_server: NatsServer,
) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    settings = make_settings(proxy.url)
    look = store_look_timeout(settings)
    assert look < settings.nats.request_timeout / 2  # what the test tells apart
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=1))
    try:
        async with (
            Connection(settings.nats, "looking-worker") as conn,
            Worker(settings, conn, backend) as worker,
        ):
            proxy.swallow()  # what the worker asks goes nowhere: no reply, no error
            began = time.monotonic()
            kept = await worker.keeper.exists("site-k", "never-kept")
            took = time.monotonic() - began
            proxy.restore()
    finally:
        await proxy.stop()
    assert kept is False  # cannot be told: answering again is safe
    assert took < look + 1.0, f"looked for {took:.2f}s (the look's bound is {look:g}s)"
