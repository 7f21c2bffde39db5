"""A request sent again under its id joins the first, or gets its outcome again: the same
answer, never a second one. But an outcome that another try may not meet (``overloaded``,
``unavailable``, a cancel, a deadline passed) is not the request's answer: the same id sent again
is that try. Before, the edge replayed the old error to it for its 60 s window, ``retry_after``
and all, although it had room again, so retrying under one id could never succeed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text, prompt
from protocol.errors import MeshTimeoutError, OverloadedError
from protocol.messages import TokenEvent
from tests.helpers import eventually, holds


async def test_a_retry_under_the_same_id_after_a_retryable_error_is_answered(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.local_queue = 0  # one local answer at a time, none waiting: the next is refused
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=1, token_delay_ms=20, faults=False)
    )
    async with (
        EdgeNode(settings, conn, backend, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):

        def job() -> Awaitable[Completion]:
            return client.complete(prompt("job"), route="local", max_tokens=5, request_id="job-7")

        busy = asyncio.ensure_future(client.complete(prompt("busy"), route="local", max_tokens=20))
        await eventually(lambda: holds(backend.started == 1), what="the busy answer under way")
        with pytest.raises(OverloadedError):
            await job()
        await busy
        again = await job()
        assert again.text == expected_text("job", 5)
        # An answer is the request's own: the same id sent again gets it again, not a new one.
        before = backend.started
        once_more = await job()
        assert once_more.text == again.text and backend.started == before


async def test_a_retry_right_after_a_timeout_is_not_given_the_cancel_of_the_first(
    settings: MeshSettings, conn: Connection
) -> None:
    """The SDK gives up waiting (its timeout), sends its cancel, and the app retries at once
    under the same id: the retry came while the first was still ending, joined it, and got its
    ``cancelled`` (not retryable, for a request nobody cancelled)."""
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=2, token_delay_ms=400, faults=False)
    )
    async with (
        EdgeNode(settings, conn, backend, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=0.2, idle_timeout=0.2) as client,
    ):
        with pytest.raises(MeshTimeoutError):
            await client.complete(prompt("sd"), route="local", max_tokens=5, request_id="job-5")
        client.first_event_timeout = client.idle_timeout = 10
        again = await client.complete(prompt("sd"), route="local", max_tokens=5, request_id="job-5")
        assert again.text == expected_text("sd", 5)


@pytest.mark.parametrize("left", ["started", "queued", "break", "break, then a moment"])
async def test_a_request_the_sdk_withdrew_from_the_cloud_is_a_new_try_under_its_id(
    settings: MeshSettings, conn: Connection, left: str
) -> None:
    """The SDK withdraws a cloud request its call gave up on (a timeout, a break out of the
    stream): cancelled at its worker, or deleted from the queue. The same id sent again from
    that client is a new try (mesh.try_ids), and answered. Before, the queue dropped it as a
    duplicate: the retry got the withdrawn try's ``cancelled`` at once, a cancel its caller
    never sent, or, withdrawn while still queued, nothing until its own timeout."""
    backend = DeterministicBackend(
        ModelSettings(
            backend="deterministic",
            slots=1,
            token_delay_ms=20,
            prefill_delay_ms=1500 if left == "started" else 0,
            faults=False,
        )
    )
    job = f"job-{left.replace(', ', '-').replace(' ', '')}"  # the window spans the cases
    async with (
        Worker(settings, conn, backend),
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        busy = None
        if left == "queued":  # the worker's one slot is taken: the request waits in the queue
            busy = asyncio.ensure_future(
                client.complete(prompt("busy"), via="cloud", max_tokens=60)
            )
            await eventually(lambda: holds(backend.started == 1), what="the slot taken")
        if left.startswith("break"):
            async for event in client.stream(
                prompt("job"), via="cloud", max_tokens=30, request_id=job
            ):
                if isinstance(event, TokenEvent):
                    break
            if left != "break":  # the stream left closes a loop turn later, and withdraws
                for _turn in range(5):
                    await asyncio.sleep(0)
        else:
            client.first_event_timeout = 0.7
            with pytest.raises(MeshTimeoutError):
                await client.complete(prompt("job"), via="cloud", max_tokens=5, request_id=job)
            client.first_event_timeout = 10
        tokens = 30 if left.startswith("break") else 5
        retried = await client.complete(
            prompt("job"), via="cloud", max_tokens=tokens, request_id=job
        )
        assert retried.text == expected_text("job", tokens) and retried.path == "cloud"
        assert all(e.id == job for e in retried.events)  # under the id it was asked with
        again = await client.complete(prompt("job"), via="cloud", max_tokens=tokens, request_id=job)
        assert again.text == retried.text  # the same id once more joins the try that ended
        if busy is not None:
            assert (await busy).text == expected_text("busy", 60)


async def test_an_error_of_a_new_try_names_the_id_it_was_asked_with(
    settings: MeshSettings, conn: Connection
) -> None:
    """A new try under a withdrawn id goes under an id of its own: refused by the queue (this
    sender's share of it is full), its error still names the caller's id, not that one."""
    settings.stream.max_msgs_per_scope = 1
    backend = DeterministicBackend(
        ModelSettings(
            backend="deterministic", slots=1, prefill_delay_ms=1500, token_delay_ms=50, faults=False
        )
    )
    async with (
        Worker(settings, conn, backend),
        MeshClient(settings=settings, first_event_timeout=0.7, idle_timeout=10) as client,
    ):
        with pytest.raises(MeshTimeoutError):
            await client.complete(prompt("job"), via="cloud", max_tokens=5, request_id="job-named")
        client.first_event_timeout = 10
        busy = asyncio.ensure_future(client.complete(prompt("busy"), via="cloud", max_tokens=40))
        await eventually(lambda: holds(backend.started == 2), what="the share taken")
        with pytest.raises(OverloadedError) as refused:
            await client.complete(prompt("job"), via="cloud", max_tokens=5, request_id="job-named")
        assert refused.value.request_id == "job-named"
        assert (await busy).text == expected_text("busy", 40)
