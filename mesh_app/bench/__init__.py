"""``mesh bench``: what the mesh costs and carries, measured on this machine.

    mesh bench [PART] [PART OPTIONS] [--json FILE]

Each part is a module here with ``run(**options) -> figures`` and ``render(figures) -> str``.
Each part prints a table and the figures go to a JSON file too. Nothing is asserted: figures
come from one run, on a machine whose other load is not ours to control.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from pathlib import Path
from typing import Any

PARTS = {
    "paths": "what the mesh adds over calling the engine's HTTP API directly",
    "relay": "how fast answers move from a worker process to its clients",
    "model": "the bundled GGUF through the mesh against raw llama-cpp-python",
    "overload": "offered load far above capacity, and what becomes of every request",
    "fleet": "many worker processes, on one server and on a 3-node cluster",
    "cascade": "what mid-answer escalation costs in time to first token",
    "failover": "how long an answer stands still when what serves it fails",
    "vllm": "vLLM in process against vLLM behind the mesh (CUDA GPU and vLLM; not in all)",
    "registry": "the nats-server CPU per node-registry delivery (not in all)",
    "embedded": "the mesh in one process: edge-local vs escalated, coalescing, the answer "
    "store (not in all)",
    "confidence": "does the local model's confidence tell when to escalate (routing data, "
    "minutes; not in all)",
}
"""Every part, with a line saying what it measures."""

ALL = ("paths", "relay", "model", "overload", "fleet", "cascade", "failover")
"""What ``all`` runs. The others run only when named: ``vllm`` needs a CUDA GPU and vLLM,
``embedded`` and ``confidence`` take minutes (``confidence`` also the routing data and
llama-cpp-python), and ``registry`` measures the server alone."""


async def run(
    parts: list[str], json_path: str | None, options: dict[str, Any] | None = None
) -> int:
    """Run ``parts`` in order; ``options`` (a part's own flags) go to each part's ``run``."""
    figures: dict[str, Any] = {"taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for part in parts:
        module: Any = importlib.import_module(f"mesh_app.bench.{part}")  # vllm: imported on use
        began = time.perf_counter()
        results = await module.run(**(options or {}))
        figures[part] = results
        print(module.render(results), flush=True)
        print(f"({part}: {time.perf_counter() - began:.0f} s)\n", flush=True)
    if json_path:
        text = json.dumps(figures, indent=2, default=float)
        await asyncio.to_thread(Path(json_path).write_text, text)
        print(f"figures written to {json_path}")
    return 0
