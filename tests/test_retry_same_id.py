"""A request sent again under its id joins the first, or gets its outcome again: the same
answer, never a second one. But an outcome that another try may not meet (``overloaded``,
``unavailable``, a cancel, a deadline passed) is not the request's answer: the same id sent again
is that try. Before, the edge replayed the old error to it for its 60 s window, ``retry_after``
and all, although it had room again, so retrying under one id could never succeed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text, prompt
from protocol.errors import MeshTimeoutError, OverloadedError
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
