"""``scripts/hop_timeline.py``: a lone request's time to first token, split hop by hop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script

PATHS = ("direct", "bare relay", "bare queue", "bare middle", "bare queued middle")


@pytest.mark.slow
def test_hop_timeline_splits_every_path_and_names_each_hop(tmp_path: Path) -> None:
    out = tmp_path / "hops.json"
    run = run_script("hop_timeline.py", "--rounds", "2", "--json", str(out))
    assert "via edge" in run.stdout and "edge in" in run.stdout, run.stdout
    figures = json.loads(out.read_text())
    assert set(figures) == {*PATHS, "via cloud", "via edge"}, figures
    for path, f in figures.items():
        assert f["requests"] >= 2, (path, f)
        assert f["added"] >= f["back"] > 0, (path, f)  # medians of each: no sum
        if path != "direct":
            assert f["to engine"] > 0, (path, f)
    # Each process on a path is named with its own part.
    assert "worker in" in figures["via cloud"]
    assert {"edge in", "worker in"} <= set(figures["via edge"])
    assert "bare relay in" in figures["bare relay"]
    assert {"bare middle in", "bare relay in"} <= set(figures["bare middle"])
    for role in ("edge", "worker"):
        assert 0 < figures["via edge"][f"{role} in, cpu"] < 1000
