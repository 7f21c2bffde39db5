"""One sender cannot fill the shared cloud queue: each <scope> holds at most
``max_msgs_per_scope`` queued requests per model (JetStream's own per-subject limit, discard new
per subject). Past that its next request is a typed, retryable 'overloaded'; other senders still
get in, and what was queued stays queued."""

from __future__ import annotations

import pytest

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.provision import ensure_stream, provision
from mesh.queue import publish_request
from mesh.status import collect_status, render
from protocol.errors import OverloadedError
from protocol.messages import InferRequest
from tests.helpers import queue_state


def _request(n: int) -> InferRequest:
    return InferRequest(id=f"r{n}", prompt=f"question {n}", model="smollm2", max_tokens=4)


async def test_a_sender_past_its_share_is_overloaded_while_others_get_in(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.stream.max_msgs_per_scope = 3
    await provision(conn.jsm(), settings.stream, ["smollm2"])  # no worker: requests stay queued
    for n in range(3):
        await publish_request(conn, settings.stream, _request(n), scope="alice")
    with pytest.raises(OverloadedError) as refused:
        await publish_request(conn, settings.stream, _request(3), scope="alice")
    assert refused.value.retryable and refused.value.retry_after == settings.stream.retry_after
    assert "this sender's share" in str(refused.value)
    await publish_request(conn, settings.stream, _request(4), scope="bob")
    # The SDK raises the same typed error, with its retry-after.
    settings.nats.scope = "alice"
    async with MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as sdk:
        with pytest.raises(OverloadedError) as sdk_refused:
            await sdk.complete("one more", via="cloud", max_tokens=4)
    assert sdk_refused.value.retry_after == settings.stream.retry_after
    assert (await queue_state(conn, settings))["messages"] == 4  # alice's 3 and bob's 1
    # An operator sees who holds the queue, beside the share.
    status = await collect_status(conn, settings)
    assert status["queue"]["share"] == 3
    assert status["queue"]["top_senders"] == [
        {"model": "smollm2", "scope": "alice", "waiting": 3},
        {"model": "smollm2", "scope": "bob", "waiting": 1},
    ]
    text = "\n".join(render(status))
    assert "at most 3 per sender and model" in text and "alice (smollm2) 3" in text


async def test_the_share_can_be_lifted_on_a_live_queue(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.stream.max_msgs_per_scope = 1
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    await publish_request(conn, settings.stream, _request(0), scope="alice")
    with pytest.raises(OverloadedError):
        await publish_request(conn, settings.stream, _request(1), scope="alice")
    settings.stream.max_msgs_per_scope = -1  # provisioning again updates the stream in place
    info = await ensure_stream(conn.jsm(), settings.stream)
    assert info.config.max_msgs_per_subject == -1
    for n in range(1, 5):
        await publish_request(conn, settings.stream, _request(n), scope="alice")
    assert (await queue_state(conn, settings))["messages"] == 5


async def test_a_share_lowered_on_a_live_queue_drops_nothing_queued(
    settings: MeshSettings, conn: Connection
) -> None:
    """JetStream drops the oldest messages of every subject above a lowered per-subject limit.
    Provisioning keeps the limit at what a sender holds instead, until those have drained."""
    settings.stream.max_msgs_per_scope = -1
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    for n in range(5):
        await publish_request(conn, settings.stream, _request(n), scope="alice")
    settings.stream.max_msgs_per_scope = 3
    info = await ensure_stream(conn.jsm(), settings.stream)
    assert info.config.max_msgs_per_subject == 5 and info.config.discard_new_per_subject
    assert (await queue_state(conn, settings))["messages"] == 5  # all of alice's requests
    with pytest.raises(OverloadedError):
        await publish_request(conn, settings.stream, _request(5), scope="alice")
    await publish_request(conn, settings.stream, _request(6), scope="bob")
    # Once alice's requests are gone, provisioning again sets the limit asked for.
    await conn.jsm().purge_stream(settings.stream.name, subject="mesh.v1.infer.smollm2.alice")
    info = await ensure_stream(conn.jsm(), settings.stream)
    assert info.config.max_msgs_per_subject == 3
