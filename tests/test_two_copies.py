"""Two copies of one request, generated at once by two workers: the first rule still holds.

The queue watch (:mod:`mesh.queue_watch`) queues a waiting request again when its queue was
lost. A worker may have taken the original just before, its start not yet at the reader (in
flight, or the worker frozen holding it). Both then generate the one answer. Numbered alike,
readers would take each position from whichever came first and mix the two texts. The copy
carries ``Mesh-Copy``: a worker numbers its attempt above any the original can reach, so
readers start over with the copy and drop the original's later events.

The same holds when the pool's consumer (not the stream) is lost: made again, it delivers the
messages the stream kept as first deliveries, one of them held by a worker still; a worker
numbers a delivery older than its consumer as a copy (:mod:`cloud_node.epoch`).

Real nats-server and two workers; the copy is published the way the watch does into a queue
made anew (another message id, so this queue takes it beside the original)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace

import pytest

from cloud_node.worker import Worker
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.queue import COPY_HEADER, MSG_ID_HEADER
from mesh.testing.chaos import expected_text
from protocol.messages import InferRequest
from protocol.subjects import consumer_name
from tests.conftest import make_settings
from tests.helpers import eventually, holds

TOKENS = 12


class Labelled(DeterministicBackend):
    """The deterministic backend with its worker's label on every token: two workers' answers
    to one request differ, so a mix of them shows."""

    def __init__(self, label: str, token_delay_ms: int) -> None:
        super().__init__(
            ModelSettings(backend="deterministic", slots=1, token_delay_ms=token_delay_ms)
        )
        self.label = label

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        async for chunk in super().generate(request, prefix=prefix, prefix_tokens=prefix_tokens):
            yield replace(chunk, text=chunk.text and f"{self.label}{chunk.text}")


def one_chain(text: str) -> bool:
    """Whether ``text`` is one answer: its tokens in order, from one worker, or from the
    original's up to where the other took it over and continued it (as after any takeover),
    never back again."""
    labels = re.findall(r"([AB]) t(\d+)", text)
    whole = "".join(f"{label} t{i}" for label, i in labels) == text
    in_order = [int(i) for _, i in labels] == list(range(TOKENS))
    said = "".join(label for label, _ in labels)
    return whole and in_order and said.lstrip("A").lstrip("B") == ""


async def _copy_queued(op: Connection, settings: MeshSettings, _model: str) -> None:
    """The original queued again the way the watch does into a queue made anew (another message
    id, so this queue takes it beside the original), marked as a copy."""
    stream = settings.stream.name
    last = (await op.jsm().stream_info(stream)).state.last_seq
    original = await op.jsm().get_msg(stream, last)
    headers = dict(original.headers or {})
    headers[MSG_ID_HEADER] += ".copy"  # a queue made anew holds no original to drop it against
    headers[COPY_HEADER] = "1"
    assert original.subject is not None and original.data is not None
    await op.nc.publish(original.subject, original.data, headers=headers)


async def _consumer_made_anew(op: Connection, settings: MeshSettings, model: str) -> None:
    """The pool's consumer deleted; the second worker makes it again as it starts, and it
    delivers the request the stream kept, as a first delivery with no mark."""
    await op.jsm().delete_consumer(settings.stream.name, consumer_name(model))


@pytest.mark.parametrize("fault", [_copy_queued, _consumer_made_anew])
async def test_two_workers_generating_one_request_give_one_answer(
    own_server: NatsServer, fault: Callable[[Connection, MeshSettings, str], Awaitable[None]]
) -> None:
    """The original's worker is the slower: the other's overtakes it mid-answer, where a reader
    taking each next position from either would mix them. Before, both were attempt 1: the SDK
    got a typed ``incomplete`` error."""
    settings = make_settings(own_server.url)
    a, b = Labelled("A", token_delay_ms=80), Labelled("B", token_delay_ms=10)
    assert expected_text("t", 1) == " t0"  # what Labelled puts its label before
    async with (
        Connection(settings.nats, "worker-a") as aconn,
        Connection(settings.nats, "worker-b") as bconn,
        Connection(settings.nats, "operator") as op,
        Worker(settings, aconn, a),
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        asking = asyncio.ensure_future(client.complete("x", max_tokens=TOKENS, via="cloud"))
        await eventually(lambda: holds(a.started == 1), what="the original taken")
        await fault(op, settings, a.model)
        async with Worker(settings, bconn, b):
            await eventually(lambda: holds(b.started == 1), what="the other worker's taken it")
            answer = await asyncio.wait_for(asking, 30)
    assert answer.path == "cloud"
    assert one_chain(answer.text), answer.text
