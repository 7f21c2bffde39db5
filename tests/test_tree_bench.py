"""``scripts/tree_bench.py``: a whole path's CPU a request for two checkouts, taking turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("path", ["cloud", "edge"])
def test_tree_bench_runs_both_trees_in_turn(path: str, tmp_path: Path) -> None:
    out = tmp_path / "trees.json"
    run = run_script(
        "tree_bench.py",
        "--a-tree",
        str(ROOT),  # this tree on both sides: a run must still give each its figures
        "--path",
        path,
        "--requests",
        "30",
        "--rounds",
        "2",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "round 2, B:" in run.stdout and "round 2, A:" in run.stdout, run.stdout
    assert f"via {path}, 30 one-token requests" in run.stdout, run.stdout
    figures = json.loads(out.read_text())
    assert set(figures["ms_per_request"]) == {"A", "B"}
    for side in ("A", "B"):
        spent = figures["ms_per_request"][side]
        assert len(spent) == 2 and all(ms > 0 for ms in spent), figures
        assert figures["best"][side] == min(spent)
