"""One worker process whose engine serves several models: a pool per model, one engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from mesh.backends.deterministic import Script
from mesh.client import MeshClient
from mesh.config import MeshSettings, WorkerSettings, load_settings
from mesh.connection import Connection
from mesh.provision import served_models
from mesh.status import collect_status
from mesh.testing.chaos import MeshProcess, worker_env
from tests.helpers import eventually


def test_served_models_name_each_pool_and_node() -> None:
    worker = load_settings(
        {
            ("worker", "node_id"): "gpu-1",
            ("worker", "model", "backend"): "openai",
            ("worker", "model", "name"): "big",
            ("worker", "also_serve"): ["small=org/Small-8B", "tiny.v2"],
        },
        environ={},
    ).worker
    one, two, three = served_models(worker)
    assert (one.node_id, one.model.name) == ("gpu-1", "big")
    assert (two.node_id, two.model.name, two.model.remote_model) == (
        "gpu-1-small",
        "small",
        "org/Small-8B",
    )
    assert (three.node_id, three.model.remote_model) == ("gpu-1-tiny_v2", "tiny.v2")
    assert two.model.base_url == one.model.base_url  # the same engine


def test_an_engine_that_holds_one_model_refuses_more() -> None:
    with pytest.raises(ValidationError, match="holds one model"):
        WorkerSettings.model_validate(
            {"model": {"backend": "llama_cpp"}, "also_serve": ["another"]}
        )
    with pytest.raises(ValidationError, match="distinct"):
        WorkerSettings.model_validate(
            {"model": {"backend": "openai", "name": "a"}, "also_serve": ["a"]}
        )


async def test_one_worker_process_serves_two_pools(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    env = {
        **worker_env(settings.nats.url or "", "multi", slots=2, token_ms=1),
        "MESH_WORKER_ALSO_SERVE": '["small"]',
    }
    proc = await MeshProcess("worker", "multi", env, tmp_path / "worker.log").start()
    try:

        async def both_pools_live() -> bool:
            # A pool shows once its consumer is provisioned, before its worker announces
            # itself: wait for a live worker in each, not for the pool alone.
            pools = (await collect_status(conn, settings))["pools"]
            return all(pools.get(model, {}).get("workers") for model in ("smollm2", "small"))

        await eventually(both_pools_live, timeout=20, what="both pools to announce themselves")
        status = await collect_status(conn, settings)
        async with MeshClient(settings=settings, connection=conn) as client:
            big = await client.complete("[tag:b] hi", via="cloud", max_tokens=5)
            small = await client.complete("[tag:s] hi", via="cloud", model="small", max_tokens=5)
    finally:
        await proc.stop()
    assert big.text == Script(tag="b").answer(5) and big.end.served_by == "cloud:multi"
    assert small.text == Script(tag="s").answer(5)
    assert small.end.served_by == "cloud:multi-small"
    assert status["pools"]["small"]["workers"] == 1
    assert status["pools"]["smollm2"]["workers"] == 1
    assert proc.proc is not None and proc.proc.returncode == 0  # stopped in order
