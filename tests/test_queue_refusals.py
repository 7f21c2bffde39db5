"""What JetStream's refusal of a request's publish to the queue tells its sender
(``mesh.js_refused``): a request over the queue stream's message size limit is refused for
good, typed as too large, where the SDK publishes it as where a site forwards it
(``tests/test_site_refusals.py``). Real nats-server."""

from __future__ import annotations

import pytest

from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import provision
from protocol.errors import MeshError
from tests.conftest import make_settings


# Before the fix (typed): a request over MESH_INFER's max_msg_size was refused by JetStream with
# "message size exceeds maximum allowed", which mesh.queue read as a full stream (the word
# "maximum"): the SDK raised a retryable `overloaded: the cloud queue is full`, and a client
# that retried met the same refusal every time.
async def test_a_request_over_the_queues_message_size_limit_is_too_large_not_full(
    own_server: NatsServer,
) -> None:
    settings = make_settings(own_server.url)
    async with Connection(settings.nats, "operator") as conn:
        await provision(conn.jsm(), settings.stream, [settings.worker.model.name])
        config = (await conn.jsm().stream_info(settings.stream.name)).config
        config.max_msg_size = 2048
        await conn.jsm().update_stream(config)
    async with MeshClient(settings=settings) as client:
        with pytest.raises(MeshError) as refused:
            await client.complete("x" * 4000, via="cloud", max_tokens=5)
    assert refused.value.code.value == "payload_too_large", refused.value
    assert refused.value.retryable is False
    assert "message size" in refused.value.message


# Before the fix (typed): a publish JetStream answers "duplicate message id is in process" (a
# leaderless stream still storing the same id: a resend after a reconnect) read as refused for
# good, not retryable: tests/chaos/test_recovery_cluster.py failed on it in a clean-clone CI run
# (a publish without quorum). It is for now, where the SDK or an edge publishes and where a site
# forwards.
def test_a_duplicate_still_in_process_is_for_now() -> None:
    from nats.js.errors import APIError

    from mesh.js_refused import for_now as _for_now
    from mesh.js_refused import in_process

    busy = APIError(code=400, err_code=10158, description="duplicate message id is in process")
    too_big = APIError(code=400, err_code=10054, description="message size exceeds maximum allowed")
    assert in_process(busy) and _for_now(busy)
    assert not in_process(too_big) and not _for_now(too_big)


# Before the fix (typed / error text): `is_full` took four codes as a full stream's, and three of
# them are not (10078: a consumer's config is missing; 10027: the account's limit of streams;
# 10028: of memory), while a store failing for another reason (10077 with its own text, a 503)
# read "the cloud queue is full". And a 429 (a burst over the stream's ingest queue) said "the
# cloud queue is full (too many requests)" with the full queue's retry_after.
def test_only_a_full_stream_or_store_reads_full_and_a_burst_says_so() -> None:
    from nats.js.errors import APIError

    from mesh.js_refused import BURST_RETRY_S, for_now, is_full, no_room

    def refused(code: int, err_code: int, text: str) -> APIError:
        return APIError(code=code, err_code=err_code, description=text)

    full = [
        refused(503, 10077, "maximum messages exceeded"),
        refused(503, 10077, "maximum bytes exceeded"),
        refused(503, 10077, "maximum messages per subject exceeded"),
        refused(503, 10047, "insufficient storage resources available"),
    ]
    not_full = [
        refused(400, 10078, "consumer config required"),
        refused(400, 10027, "maximum number of streams reached"),
        refused(500, 10028, "insufficient memory resources available"),
        refused(503, 10077, "error opening msg block file"),
    ]
    assert [is_full(e) for e in full] == [True] * 4
    assert [is_full(e) for e in not_full] == [False] * 4
    assert for_now(not_full[3])  # a store in trouble (503): the same publish may go again
    share = no_room(full[2], "the cloud queue", 2.0, "r1")
    assert share is not None and share.message.startswith("this sender's share of the cloud")
    assert share.retry_after == 2.0 and share.retryable
    burst = no_room(refused(429, 10167, "too many requests"), "the cloud queue", 2.0, "r1")
    assert burst is not None and burst.code.value == "overloaded"
    assert "too many at once" in burst.message and "full" not in burst.message
    assert burst.retry_after == BURST_RETRY_S and burst.request_id == "r1"
    assert no_room(not_full[3], "the cloud queue", 2.0, "r1") is None
