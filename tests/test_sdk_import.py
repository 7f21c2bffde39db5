"""The SDK is importable without the node runtime: an application that only asks questions
loads no engine, no metrics registry, no nats-server launcher and no node package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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
    code = (
        "import json, sys\n"
        "from mesh.client import MeshClient\n"
        "from protocol import EndEvent, TokenEvent\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    runtime = [
        m for m in loaded if m in NODE_RUNTIME or m.startswith(tuple(f"{p}." for p in NODE_RUNTIME))
    ]
    assert runtime == [], runtime
