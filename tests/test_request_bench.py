"""``scripts/request_bench.py``: a whole path's cost per request beside bare nats-py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script


@pytest.mark.slow
@pytest.mark.parametrize(("path", "floor"), [("edge", "bare middle"), ("cloud", "bare relay")])
def test_request_bench_runs_a_path_and_its_floor_with_every_answer_whole(
    path: str, floor: str, tmp_path: Path
) -> None:
    out = tmp_path / "requests.json"
    run = run_script(
        "request_bench.py",
        "--path",
        path,
        "--requests",
        "24",
        "--tokens",
        "3",
        "--rounds",
        "2",
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-2000:]  # each side checks every answer came whole
    figures = json.loads(out.read_text())
    assert set(figures["cpu_ms_per_request"]) == {path, floor}
    assert all(len(v) == 2 and min(v) > 0 for v in figures["cpu_ms_per_request"].values())
    assert figures["of_floor"] == figures["best"][path] / figures["best"][floor]
    assert f"{path} / {floor}" in run.stdout
