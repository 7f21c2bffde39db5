"""``scripts/burst_bench.py``: bursts through a mesh of processes, timed at the client, with each
process's CPU a request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_script


@pytest.mark.slow
def test_burst_bench_times_whole_answers_and_counts_each_processs_cpu(tmp_path: Path) -> None:
    out = tmp_path / "bursts.json"
    run = run_script(
        "burst_bench.py",
        *("--streams", "4", "--requests", "8", "--warmup", "4", "--tokens", "3"),
        *("--prefill-ms", "5", "--token-ms", "2", "--worker-gap-ms", "4", "--gap-ms", "1"),
        *("--window-ms", "20", "--json", str(out)),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["answers"] == 8  # the warm-up's four are not counted; every answer whole
    assert (figures["worker_gap_ms"], figures["gap_ms"]) == (4.0, 1.0)
    assert 5 <= figures["ttft_ms"]["p50"] <= figures["ttft_ms"]["p99"]  # after the prefill
    assert figures["between_tokens_ms"]["p50"] > 0
    assert figures["total_ms"]["p50"] >= figures["ttft_ms"]["p50"]
    assert set(figures["cpu_ms_per_request"]) == {"edge", "worker", "server", "sdk"}
    assert figures["cpu_ms_per_request"]["sdk"] > 0
    assert "TTFT p50" in run.stdout and "CPU a request (ms): edge" in run.stdout
    window = figures["window"]  # each counted burst's first 20 ms, read there
    assert (window["ms"], window["bursts"]) == (20.0, 2)
    assert window["read_at_ms_p50"] >= 20
    assert set(window["cpu_ms_per_burst"]) == {"edge", "worker", "server", "sdk"}
    assert all(ms > 0 for ms in window["cpu_ms_per_burst"].values())  # a burst costs each one
    assert "CPU in a burst's first 20 ms" in run.stdout
