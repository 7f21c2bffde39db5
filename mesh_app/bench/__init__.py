"""``mesh bench``: what the mesh costs and carries, measured on this machine.

    mesh bench [paths|relay|model|overload|fleet|cascade|failover|vllm|all] [--json FILE]

Each part prints a table and the figures go to a JSON file too. Nothing is asserted: figures
come from one run, on a machine whose other load is not ours to control.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

PARTS = ("paths", "relay", "model", "overload", "fleet", "cascade", "failover")
"""What ``all`` runs; ``vllm`` needs a CUDA GPU and vLLM, so it runs only when named."""


async def run(parts: list[str], json_path: str | None) -> int:
    from mesh_app.bench import cascade, failover, fleet, model, overload, paths, relay, vllm

    modules: dict[str, Any] = {
        "paths": paths,
        "relay": relay,
        "model": model,
        "overload": overload,
        "fleet": fleet,
        "cascade": cascade,
        "failover": failover,
        "vllm": vllm,  # imports vLLM only when it runs
    }
    figures: dict[str, Any] = {"taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for part in parts:
        began = time.perf_counter()
        results = await modules[part].run()
        figures[part] = results
        print(modules[part].render(results), flush=True)
        print(f"({part}: {time.perf_counter() - began:.0f} s)\n", flush=True)
    if json_path:
        text = json.dumps(figures, indent=2, default=float)
        await asyncio.to_thread(Path(json_path).write_text, text)
        print(f"figures written to {json_path}")
    return 0
