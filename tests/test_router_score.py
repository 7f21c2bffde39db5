"""``mesh router score``: scoring a labelled directory with the shipped weights, checked against
metrics worked out by hand on a small fixture.

The fixture (tests/fixtures/routing_small) holds three distinct prompts, each repeated with
different labels, so every metric depends only on how the router orders the three:

    row  prompt        file          local right  cloud right  gain  escalation helps
    0-3  E "Say hello"  mmlu_alpha    1 1 1 0      1 1 0 1      0 0 -1 +1   0 0 0 1
    4-6  M liver MCQ    mmlu_beta     0 1 0        1 1 0        +1 0 0      1 0 0
    7-9  H bakery sum   gsm8k         0 0 1        1 1 1        +1 +1 0     1 1 0

plus one contaminated prompt in mmlu_beta, listed in contaminated_prompts.jsonl, which must be
left out. The shipped router scores H > M > E (checked below); ties keep file order.

- AUC (escalation helps; 4 positives, 6 negatives, ties count half): E4 beats nothing and ties
  E1-3 (1.5); M1 beats E1-3 and ties M2-3 (4); H1 and H2 beat E1-3, M2-3 and tie H3 (5.5 each).
  16.5 / 24 = 0.6875.
- AUC (local wrong: E4, M1, M3, H1, H2 against E1-3, M2, H3): 1.5 + 3.5 + 3.5 + 4.5 + 4.5 = 17.5
  over 25 = 0.70.
- Escalating in the order H1 H2 H3 M1 M2 M3 E1 E2 E3 E4, accuracy goes .5 .6 .7 .7 .8 .8 .8 .8
  .8 .7 .8 (local-only .5, cloud-only .8), so PGR is 0 1/3 2/3 2/3 1 1 1 1 1 2/3 1 at shares
  0, .1, ..., 1. APGR (trapezoids) = 47/60 = 0.78333; CPT(50%) = 0.2; CPT(80%) = 0.4; 95% of
  cloud-only accuracy (0.76) is first reached at 0.4.
- A fixed threshold between M and H escalates the three H rows: share 0.3; per 5 rows, 0 then
  0.6.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from mesh_app.router.data import load_dataset

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "routing_small"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
E = "Say hello."
M = (
    "Which of the following is a function of the liver?\nA. Producing insulin\n"
    "B. Producing bile\nC. Pumping blood\nD. Filtering air"
)


def score(*args: str, data: Path = FIXTURE, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesh_app.cli", "router", "score", "--data", str(data), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**ENV, **env},
        check=False,
    )


def score_json(*args: str, **env: str) -> dict[str, Any]:
    result = score("--json", *args, **env)
    assert result.returncode == 0, result.stderr
    body: dict[str, Any] = json.loads(result.stdout)
    return body


def test_the_fixture_orders_as_the_hand_computation_assumes() -> None:
    data = load_dataset(FIXTURE)
    assert data.prompts[0] == E and data.prompts[4] == M and len(set(data.prompts)) == 3
    model = RouterModel.load(WEIGHTS_PATH)
    e, m, h = (model.probability(data.prompts[i]) for i in (0, 4, 7))
    assert e < m - 0.02 and m < 0.25 < h, (e, m, h)
    assert len(E) < len(M) < len(data.prompts[7])


def test_score_reports_hand_checked_metrics() -> None:
    body = score_json()
    assert body["prompts"] == 10 and body["dropped_contaminated"] == 1
    router = body["router"]
    assert router["auc"] == pytest.approx(16.5 / 24)
    assert router["auc_fail"] == pytest.approx(0.70)
    assert router["apgr"] == pytest.approx(47 / 60)
    assert router["cpt50"] == pytest.approx(0.2)
    assert router["cpt80"] == pytest.approx(0.4)
    assert router["q95"] == pytest.approx(0.4)
    # Prompt length orders the three the same way (E shortest, H longest): same figures.
    assert body["baselines"]["prompt length"] == pytest.approx(router)
    latency = body["latency_ms"]
    assert latency["decisions"] == 10 and 0 < latency["p50"] <= latency["p99"]
    assert body["weights"] == str(WEIGHTS_PATH)


def test_score_reports_the_realized_share_under_the_configured_policy() -> None:
    fixed = score_json("--window", "5", MESH_EDGE_ROUTER_THRESHOLD="0.25")["policy"]
    assert fixed["policy"] == "threshold" and fixed["threshold"] == 0.25
    assert fixed["realized_share"] == pytest.approx(0.3)
    assert fixed["window_shares"] == [0.0, 0.6]
    everything = score_json(MESH_EDGE_ROUTER_CLOUD_SHARE="1")["policy"]
    assert everything["policy"] == "cloud_share" and everything["realized_share"] == 1.0
    nothing = score_json(MESH_EDGE_ROUTER_CLOUD_SHARE="0")["policy"]
    assert nothing["realized_share"] == 0.0
    default = score_json()["policy"]
    assert default["cloud_share"] == 0.3 and 0.0 <= default["realized_share"] <= 1.0
    assert default["training_threshold"] == pytest.approx(
        RouterModel.load(WEIGHTS_PATH).threshold_for_share(0.3)
    )


def test_score_prints_a_readable_table() -> None:
    result = score("--window", "5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "scored 10 prompts" in out and "1 contaminated dropped" in out
    row = next(line for line in out.splitlines() if line.startswith("router"))
    assert row.split()[-6:] == ["0.688", "0.700", "0.783", "0.200", "0.400", "0.400"]
    assert "baseline: prompt length" in out and "baseline: random" in out
    assert "realized cloud share:" in out and "per 5 prompts" in out
    assert "decision latency" in out and "p99" in out


def test_score_fails_clearly_without_data(tmp_path: Path) -> None:
    result = score(data=tmp_path)
    assert result.returncode == 2
    assert f"routing data not found under {tmp_path}" in result.stderr


def test_score_takes_mmlu_only_data_and_prints_per_subject_rows(tmp_path: Path) -> None:
    """A directory of MMLU subjects alone (no GSM8K file) is labelled data like any other."""
    shutil.copytree(FIXTURE / "mmlu", tmp_path / "mmlu")
    result = score(data=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "scored 7 prompts" in result.stdout and "1 contaminated dropped" in result.stdout
    rows = {
        line.split()[0]: line.split()[1:]
        for line in result.stdout.split("per subject:", 1)[1].splitlines()[3:]
        if line.strip()
    }
    assert rows["alpha"][:2] == ["4", "0.25"] and rows["beta"][:2] == ["3", "0.33"]
    assert "gsm8k" not in rows


def test_score_json_has_each_subject_next_to_prompt_length() -> None:
    subjects = score_json()["subjects"]
    assert {name: row["n"] for name, row in subjects.items()} == {"alpha": 4, "beta": 3, "gsm8k": 3}
    assert subjects["gsm8k"]["escalation_helps"] == pytest.approx(2 / 3)
    for row in subjects.values():
        assert {"router_apgr", "length_apgr", "router_auc", "length_auc"} <= set(row)
