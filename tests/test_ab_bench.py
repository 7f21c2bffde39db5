"""``scripts/ab_bench.py``: two versions of a node (or of the SDK) in one mesh, here the same code
on both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("role", ["worker", "edge", "sdk"])
def test_ab_bench_measures_both_versions_and_the_floor(role: str, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    run = run_script(
        "ab_bench.py",
        "--role",
        role,
        "--a-tree",
        str(ROOT),
        "--streams",
        "2",
        "--rounds",
        "1",
        "--lens",
        "2,6",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures) >= {"floor", "A", "B"}
    assert "B/A" in run.stdout and f"{role} A/B" in run.stdout
    if role != "sdk":  # the SDK's sides run in client processes of their own: no TTFT here
        for side in ("floor", "A", "B"):
            ttft = figures[side]["ttft_ms"]
            assert 0 < ttft["p50"] <= ttft["p99"] < 60_000, (side, ttft)
