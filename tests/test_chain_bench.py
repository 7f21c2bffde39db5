"""``scripts/chain_bench.py``: each role's per-token chain beside its floor, in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import check_side_beside_floor, run_script


@pytest.mark.slow
@pytest.mark.parametrize(
    ("role", "floor"), [("edge", "bare middle"), ("sdk", "bare reader"), ("worker", "bare relay")]
)
def test_chain_bench_runs_a_role_and_its_floor_over_every_token(
    role: str, floor: str, tmp_path: Path
) -> None:
    out = tmp_path / "chain.json"
    run = run_script(
        "chain_bench.py",
        "--role",
        role,
        "--tokens",
        "40",
        "--rounds",
        "2",
        "--json",
        str(out),
    )
    check_side_beside_floor(run, out, "cpu_us_per_token", role, floor, rounds=2)
