"""What every bench shares (``mesh_app.bench.common``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from mesh_app.bench.common import openai_backend


def test_a_bench_directory_is_gone_once_its_process_exits(tmp_path: Path) -> None:
    # A run of `mesh bench` used to leave every store and log behind (tens of MB each).
    code = (
        "from mesh_app.bench.common import bench_dir; "
        "d = bench_dir('mesh-bench-test-'); (d / 'store').mkdir(); "
        "(d / 'store' / 'data').write_bytes(b'x' * 1024); print(d); "
        "raise SystemExit(3)"  # an exit with an error cleans up too
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3, done.stderr
    made = Path(done.stdout.strip())
    assert made.name.startswith("mesh-bench-test-")
    assert not made.exists()


async def _arrivals(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    """When each of an answer's SSE chunks arrived (loop time)."""
    loop = asyncio.get_running_loop()
    body = {"model": "smollm2", "prompt": "[tag:ls] x", "max_tokens": tokens, "stream": True}
    arrivals = []
    async with session.post(f"{url}/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(loop.time())
    return arrivals


@pytest.mark.parametrize("lockstep", [True, False])
async def test_in_lockstep_answers_started_apart_get_their_tokens_together(lockstep: bool) -> None:
    """``--pacing lockstep``: the server makes every answer's next token at the same moments, as
    a batching engine's steps do; otherwise each answer keeps the clock its request started."""
    async with (
        openai_backend(prefill_ms=0, token_ms=60, lockstep=lockstep) as url,
        aiohttp.ClientSession() as session,
    ):
        first = asyncio.create_task(_arrivals(session, url, 8))
        await asyncio.sleep(0.025)  # the second request reaches the server ~25 ms later
        a, b = await asyncio.gather(first, _arrivals(session, url, 8))
    assert len(a) >= 8 and len(b) >= 8, (a, b)
    # From the third token on (the first two come after a prefill and a first, shorter step),
    # how far apart the two answers' tokens of one step are.
    apart = sorted(min(abs(t - u) for u in b) for t in a[2:7])
    if lockstep:
        assert apart[-1] < 0.015, apart
    else:
        assert apart[0] > 0.012, apart
