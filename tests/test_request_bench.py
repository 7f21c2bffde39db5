"""``scripts/request_bench.py``: a whole path's cost per request beside bare nats-py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import check_side_beside_floor, run_script


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
    check_side_beside_floor(run, out, "cpu_ms_per_request", path, floor, rounds=2)
