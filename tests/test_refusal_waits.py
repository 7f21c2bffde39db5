"""A refused publish ends the wait for its answer at once (``Refusals.until_refused``), and
nothing else: review S21a of f90a7dd.

Each test runs the operator-mode hub that `mesh creds` mints (``tests/test_security.py``'s
fixtures), every process under its own minted identity, nothing mocked. Where a test needs an
outside cancel at the very instant the server's refusal is heard, it wraps the connection's
``Refusals.heard`` (called by the connection's error callback with the server's real ``-ERR``)
to cancel the waiting task right there: the race, made certain.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import types
from collections.abc import AsyncIterator

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh import refusals as refusals_module
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.queue import publish_request
from mesh.served_models import model_is_served
from protocol.errors import UnauthorizedError
from protocol.messages import InferRequest
from tests.test_security import (  # noqa: F401 - fixtures
    Hub,
    hub,
    mesh,
)


def _request(model: str, prompt: str = "[tag:s21a] x") -> InferRequest:
    return InferRequest(model=model, prompt=prompt, max_tokens=5)


@contextlib.asynccontextmanager
async def _worker(hub: Hub) -> AsyncIterator[str]:  # noqa: F811
    settings = hub.settings("worker-w1")
    async with (
        Connection(settings.nats, "w1") as conn,
        Worker(settings, conn, DeterministicBackend(settings.worker.model)),
    ):
        yield settings.worker.model.name


# ---------------------------------------------------------------------------------------------
# Sound on 3.11: no stray cancel is left in the task once a refusal ended its wait.


async def test_no_stray_cancel_after_a_refused_publish_or_a_refused_look(
    mesh: Hub,  # noqa: F811
) -> None:
    model = mesh.settings("worker-w1").worker.model.name
    # A sender under edge site-a's credentials set to queue as site-b: its publish is refused.
    settings = mesh.settings("edge-site-a", MESH_NATS_SCOPE="site-b", MESH_NATS_REQUEST_TIMEOUT="5")
    async with Connection(settings.nats, "s21a") as conn:
        task = asyncio.current_task()
        assert task is not None
        for _ in range(3):
            began = time.monotonic()
            with pytest.raises(UnauthorizedError):
                await publish_request(conn, settings.stream, _request(model), "site-b")
            assert time.monotonic() - began < 1.0
            assert task.cancelling() == 0
            await asyncio.sleep(0.02)  # no cancel pending for a later await
        assert not conn.refusals._waiting
    # A client of an edge may not look: the look's refusal ends it, None, nothing pending.
    csettings = mesh.settings("client-site-a")
    async with Connection(csettings.nats, "s21a-client") as conn:
        began = time.monotonic()
        served = await model_is_served(conn.jsm(), csettings.stream, model, conn)
        assert served is None and time.monotonic() - began < 0.9
        assert task.cancelling() == 0
        await asyncio.sleep(0.02)


async def test_an_outside_cancel_heard_with_the_refusal_stays_a_cancel(
    mesh: Hub,  # noqa: F811
) -> None:
    model = mesh.settings("worker-w1").worker.model.name
    settings = mesh.settings("edge-site-a", MESH_NATS_SCOPE="site-b", MESH_NATS_REQUEST_TIMEOUT="5")
    async with Connection(settings.nats, "s21a") as conn:
        heard = conn.refusals.heard
        for first in ("cancel", "refusal"):
            sending: list[asyncio.Task[object]] = []

            def racing(
                error: Exception, first: str = first, sending: list[asyncio.Task[object]] = sending
            ) -> None:
                if first == "cancel":
                    sending[0].cancel()
                    heard(error)
                else:
                    heard(error)
                    sending[0].cancel()

            conn.refusals.heard = racing  # type: ignore[method-assign]
            try:
                sender = asyncio.ensure_future(
                    publish_request(conn, settings.stream, _request(model), "site-b")
                )
                sending.append(sender)
                done, _ = await asyncio.wait({sender}, timeout=3)
                assert sender in done
                assert sender.cancelled(), f"{first} first: {sender.exception()!r}"
            finally:
                conn.refusals.heard = heard  # type: ignore[method-assign]


async def test_an_edge_whose_own_publish_is_refused_answers_locally_at_once(
    hub: Hub,  # noqa: F811
) -> None:
    # Edge site-a under its own credentials, set to queue as site-b (a copied .env): its
    # cloud publish is refused. The client hears one local answer, saying why, at once; no
    # stray cancel breaks the local fallback; the edge answers again afterwards.
    settings = hub.settings("edge-site-a", MESH_NATS_SCOPE="site-b")
    local = DeterministicBackend(settings.edge.model)
    async with (
        _worker(hub),
        Connection(settings.nats, "edge") as econn,
        EdgeNode(settings, econn, local, HeuristicRouter()),
        MeshClient(settings=hub.settings("client-site-a")) as client,
    ):
        for i in range(2):
            began = time.monotonic()
            answer = await client.complete(f"[tag:e{i}] hi", route="cloud", max_tokens=5)
            took = time.monotonic() - began
            assert answer.end.path == "local", answer.end
            assert answer.text
            assert answer.end.fallback and "may not publish" in answer.end.fallback
            assert took < 2.0, f"the local answer came after {took:.1f}s"
        assert not econn.refusals._waiting


# ---------------------------------------------------------------------------------------------
# Review S21a's findings, fixed.


async def test_py310_an_outside_cancel_heard_with_the_refusal_stays_a_cancel(
    mesh: Hub,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before the fix (minor, Python 3.10 only: pyproject says requires-python >= 3.10). There
    # _UntilRefused could not tell its own cancel from an outside one (no Task.cancelling /
    # uncancel): a client's cancel, a shutdown's or wait_for's deadline that comes in the same
    # turn as the refusal is turned into UnauthorizedError, and the cancelled task goes on
    # (the edge's request task to its local fallback, a worker of a shutdown to its next
    # step). Emulated on 3.11 by showing mesh.refusals a 3.10 version_info. Now a wait on 3.10
    # is not ended by a refusal: it runs to its ack or its timeout, as before f90a7dd.
    monkeypatch.setattr(refusals_module, "sys", types.SimpleNamespace(version_info=(3, 10, 13)))
    model = mesh.settings("worker-w1").worker.model.name
    settings = mesh.settings("edge-site-a", MESH_NATS_SCOPE="site-b", MESH_NATS_REQUEST_TIMEOUT="5")
    async with Connection(settings.nats, "s21a") as conn:
        sender: asyncio.Task[object] | None = None
        heard = conn.refusals.heard

        def racing(error: Exception) -> None:
            assert sender is not None
            sender.cancel()  # the caller's cancel, in the same turn as the refusal
            heard(error)

        conn.refusals.heard = racing  # type: ignore[method-assign]
        sender = asyncio.ensure_future(
            publish_request(conn, settings.stream, _request(model), "site-b")
        )
        done, _ = await asyncio.wait({sender}, timeout=3)
        assert sender in done
        assert sender.cancelled(), f"the cancel was swallowed: {sender.exception()!r}"


async def test_a_refusal_of_a_subject_in_another_case_does_not_end_an_accepted_publish(
    mesh: Hub,  # noqa: F811
) -> None:
    # Before the fix (minor: first rule in a narrow setup). Subjects are case-sensitive; nats-py
    # lower-cases the server's -ERR, and Refusals keys the waits by the lower-cased subject.
    # Two senders sharing one connection (MeshClient(connection=...)) under edge site-a's
    # credentials, queueing as `site-a` (allowed) and `SITE-A` (refused): the refusal of
    # the second ends the first's wait with UnauthorizedError although its request was
    # stored (the queue holds it and a worker answers it, for nobody). Before f90a7dd the
    # case-folded lookup ran only after an ack timeout, never against an accepted publish. Now
    # waits for subjects that differ in case only are not ended: their acks or timeouts decide.
    operator = mesh.settings("operator")
    model = mesh.settings("worker-w1").worker.model.name
    settings = mesh.settings("edge-site-a", MESH_NATS_REQUEST_TIMEOUT="5")
    async with Connection(settings.nats, "shared") as conn, Connection(operator.nats, "op") as op:
        stream = settings.stream.name
        before = (await op.jsm().stream_info(stream)).state.messages
        allowed = _request(model, "[tag:s21a-ok] x")
        results = await asyncio.gather(
            publish_request(conn, settings.stream, allowed, "site-a"),
            publish_request(conn, settings.stream, _request(model), "SITE-A"),
            return_exceptions=True,
        )
        assert isinstance(results[1], UnauthorizedError)
        assert not isinstance(results[0], BaseException), (
            f"the accepted publish was told {results[0]!r}; "
            f"queue grew by {(await op.jsm().stream_info(stream)).state.messages - before}"
        )
