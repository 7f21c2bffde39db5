"""The edge's memory of which cloud pools exist: a model nobody serves is looked up once in a
while, not at every request, and a pool removed for good is unknown again. Each failed on a
version that did not remember "no" while its registry view could not tell, for every model
(review S16x)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import mesh.served_models as served_models
from edge_node.served import CloudModels
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.node_view import NodeView
from mesh.provision import provision
from protocol.subjects import consumer_name
from tests.helpers import eventually, holds

MODEL = "smollm2"


async def _edge_models(conn: Connection, settings: MeshSettings) -> tuple[NodeView, CloudModels]:
    """An edge's view and rule, as edge_node/node.py makes them: the view follows the edge's
    own cloud pool (``smollm2``) only, so for any other model ``serves`` is None for ever."""
    view = NodeView(conn, 30.0, pool=MODEL, stream=settings.stream)
    await view.start()
    await eventually(lambda: holds(view.ready), what="the view ready")
    return view, CloudModels(conn, settings.stream, view, "scope-a")


async def test_a_model_nobody_serves_is_not_looked_up_at_every_request(
    conn: Connection, settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edge answering many clients that name a model nobody serves (not its own cloud
    pool) asks JetStream once for a burst (the no is remembered ``no_for``, 3 s:
    mesh/served_models.py). A version that forgot the no whenever ``live`` was not False
    cost every request a JetStream API round trip to the hub: for a model outside the edge's
    pool ``live`` is always None, not only for a while after a reconnect (hostile input: a
    flood naming one unknown model)."""
    await provision(conn.jsm(), settings.stream, [MODEL])
    looks: list[str] = []
    real = served_models.model_is_served

    async def counted(*args: Any, **kwargs: Any) -> bool | None:
        looks.append(args[2])
        return await real(*args, **kwargs)

    monkeypatch.setattr(served_models, "model_is_served", counted)
    view, models = await _edge_models(conn, settings)
    try:
        for _ in range(20):
            assert await models.deployed("nobody-serves-this") is False
    finally:
        await models.close()
        await view.stop()
    assert len(looks) == 1, f"20 requests naming an unknown model: {len(looks)} JetStream looks"


async def test_a_pool_removed_for_good_is_unknown_again_not_served_for_ever(
    conn: Connection, settings: MeshSettings
) -> None:
    """A pool for ``qwen`` (not the edge's own cloud pool) served once; then it is retired
    (its consumer deleted, no worker left). Once the remembered yes lapses (30 s; shortened
    here) JetStream says no, and a request naming it must get ``unknown_model`` at once. A
    version that took every model it had seen served as served while ``live`` was None
    answered yes for ever (``live('qwen')`` is None outside the view's pool), and queued every
    such request where no worker reads: it waited out its deadline."""
    other = "qwen"
    await provision(conn.jsm(), settings.stream, [MODEL, other])
    view, models = await _edge_models(conn, settings)
    models._deployed._for[True] = 0.2  # the yes's 30 s, shortened
    try:
        assert await models.deployed(other) is True
        await conn.jsm().delete_consumer(settings.stream.name, consumer_name(other))
        await asyncio.sleep(0.5)  # past the remembered yes
        answers = [await models.deployed(other) for _ in range(3)]
        live = models.live(other)
    finally:
        await models.close()
        await view.stop()
    assert answers == [False, False, False], (
        f"a retired pool (no consumer; registry live()={live}): deployed() said {answers}"
    )
