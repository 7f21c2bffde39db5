"""``scripts/chain_bench.py``: each role's per-token chain beside its floor, in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script


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
    assert run.returncode == 0, run.stderr[-2000:]  # each side checks its answer came whole
    figures = json.loads(out.read_text())
    assert set(figures["cpu_us_per_token"]) == {role, floor}
    assert all(len(v) == 2 and min(v) > 0 for v in figures["cpu_us_per_token"].values())
    assert figures["of_floor"] == figures["best"][role] / figures["best"][floor]
    assert f"{role} / {floor}" in run.stdout
