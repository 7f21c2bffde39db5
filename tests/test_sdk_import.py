"""The SDK is importable without the node runtime: an application that only asks questions
loads no engine, no metrics registry, no nats-server launcher and no node package."""

from __future__ import annotations

from tests.helpers import modules_loaded_by

NODE_RUNTIME = (
    "edge_node",
    "cloud_node",
    "mesh_app",
    "mesh.backends",
    "mesh.metrics",
    "mesh.nats_server",
    "mesh.hub",
    "mesh.testing",
    "prometheus_client",
    "llama_cpp",
    "numpy",
    "vllm",
)


def test_importing_the_sdk_loads_no_node_runtime() -> None:
    loaded = modules_loaded_by(
        "from mesh.client import MeshClient\nfrom protocol import EndEvent, TokenEvent"
    )
    runtime = [
        m for m in loaded if m in NODE_RUNTIME or m.startswith(tuple(f"{p}." for p in NODE_RUNTIME))
    ]
    assert runtime == [], runtime
