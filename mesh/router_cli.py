"""``mesh router train`` and ``mesh router eval``: deterministic, minutes on 2 cores."""

from __future__ import annotations

import sys
import time

import numpy as np

from edge_node.learned.data import default_data_dir, load_dataset
from edge_node.learned.evaluate import evaluate, latency_ms
from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.learned.router import LearnedRouter, train_on
from protocol.messages import InferRequest


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def router_train(data_dir: str | None, out: str | None) -> int:
    data = load_dataset(data_dir)
    _say(f"training on {len(data.prompts)} prompts from {data_dir or default_data_dir()}")
    started = time.perf_counter()
    model = train_on(data)
    path = out or WEIGHTS_PATH
    model.save(path)
    size = len(model.to_json().encode())
    print(
        f"wrote {path} ({size / 1024:.0f} KiB, {len(model.buckets)} n-gram weights, "
        f"{len(model.scalar_weights)} scalar weights) in {time.perf_counter() - started:.1f}s"
    )
    return 0


def router_eval(data_dir: str | None, group_seeds: int, latency_n: int) -> int:
    data = load_dataset(data_dir)
    _say(f"evaluating on {len(data.prompts)} prompts ({len(set(data.subject.tolist()))} subjects)")
    started = time.perf_counter()
    report = evaluate(data, group_seeds=group_seeds, progress=_say)
    router = LearnedRouter(RouterModel.load(WEIGHTS_PATH), threshold=0.5)
    report.notes["decision latency (shipped weights, score + reasons, single prompts)"] = (
        "p50 {p50_ms:.3f} ms, p99 {p99_ms:.3f} ms".format(
            **latency_ms(lambda p: router.score(InferRequest(prompt=p)), data.prompts, latency_n)
        )
    )
    shares = {s: router.model.threshold_for_share(s) for s in (0.2, 0.45, 0.5)}
    report.notes["thresholds for cloud shares"] = ", ".join(
        f"{s:.0%} -> {t:.3f}" for s, t in shares.items()
    )
    sample = np.array([router.score(InferRequest(prompt=p))[0] for p in data.prompts[::7]])
    report.notes["cloud share at threshold 0.5 (shipped weights, every 7th prompt)"] = (
        f"{np.mean(sample >= 0.5):.1%}"
    )
    print(report.table())
    _say(f"done in {time.perf_counter() - started:.0f}s")
    return 0
