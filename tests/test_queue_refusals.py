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
