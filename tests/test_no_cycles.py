"""A finished request leaves nothing for the garbage collector: its objects are freed as it ends,
not kept for a collection that stops the event loop (and every stream with it) to walk them.
Reference cycles here once came from a reader and its subscription, a queued request and its
reader, and the stall watchdog's self-scheduling closure (``docs/performance.md``)."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh_app.local import LocalMesh
from protocol.messages import EndEvent

OURS = ("mesh.", "edge_node.", "cloud_node.", "protocol.")


@pytest.fixture
async def local_mesh(settings: MeshSettings, conn: Connection) -> AsyncIterator[LocalMesh]:
    settings.worker.model.backend = "deterministic"
    settings.edge.model.backend = "deterministic"
    async with LocalMesh(settings) as mesh:
        yield mesh


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """What the collector finds unreachable, kept for the test to read instead of freed."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_requests_via_the_cloud_and_via_an_edge_leave_no_cycles(
    local_mesh: LocalMesh, saved_garbage: list[object]
) -> None:
    async with MeshClient(settings=local_mesh.settings) as client:

        async def one(**how: str) -> None:
            ends = [e async for e in client.stream("hi", max_tokens=8, **how)]
            assert isinstance(ends[-1], EndEvent)

        await asyncio.gather(*(one(via="cloud") for _ in range(8)))
        await asyncio.gather(*(one(route="cloud") for _ in range(8)))
        gc.collect()
        found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in saved_garbage)
        ours = {name: n for name, n in found.items() if name.startswith(OURS)}
        assert ours == {}, ours
        # Closures and bound methods are how a cycle holds our objects; a few may come from
        # the libraries underneath (a connection's setup), not one per request.
        per_request = sum(found[k] for k in ("builtins.function", "builtins.cell")) / 16
        assert per_request < 1, found.most_common(10)
