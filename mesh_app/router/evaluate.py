"""Evaluating routers the way RouteLLM does, in-distribution and on subjects never seen.

For scores s (higher = escalate): acc(c) routes the top share c of prompts to the cloud;
PGR(c) = (acc(c) - acc(0)) / (acc(1) - acc(0)); APGR is its area over c in [0, 1]; CPT(x) is the
smallest c with PGR >= x; Q95 the smallest c with acc(c) >= 95% of cloud-only accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge_node.learned.features import Features, extract
from mesh_app.router.data import Dataset, prompt_groups, subject_groups
from mesh_app.router.train import TrainConfig, sigmoid, stratified_folds, train

METRICS = ("auc", "auc_fail", "apgr", "cpt50", "cpt80", "q95")


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC, ties at their average rank."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(scores, kind="mergesort")
    ordered = np.asarray(scores, float)[order]
    starts = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1]
    ends = np.r_[starts[1:], len(ordered)]
    ranks = np.empty(len(ordered))
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")  # undefined with a single class
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def routing_metrics(scores: np.ndarray, weak: np.ndarray, strong: np.ndarray) -> dict[str, float]:
    n = len(scores)
    order = np.lexsort((np.arange(n), -np.asarray(scores, float)))
    gain = (strong.astype(float) - weak.astype(float))[order]
    acc = (weak.sum() + np.r_[0.0, np.cumsum(gain)]) / n  # acc[k]: top k prompts to the cloud
    share = np.arange(n + 1) / n
    gap = acc[-1] - acc[0]
    pgr = (acc - acc[0]) / gap if gap > 0 else np.zeros_like(acc)  # no gap: nothing recovered

    def first(mask: np.ndarray) -> float:
        return float(share[np.argmax(mask)]) if mask.any() else 1.0

    return {
        "auc": roc_auc(scores, (weak == 0) & (strong == 1)),
        "auc_fail": roc_auc(scores, weak == 0),
        "apgr": float(np.sum((pgr[1:] + pgr[:-1]) / 2 * np.diff(share))),
        "cpt50": first(pgr >= 0.5),
        "cpt80": first(pgr >= 0.8),
        "q95": first(acc >= 0.95 * acc[-1] - 1e-12),
    }


def calibration(probability: np.ndarray, labels: np.ndarray, bins: int = 10) -> dict[str, float]:
    """Brier score, expected calibration error, and the Brier score of always saying the base
    rate (a calibrated model should beat it)."""
    which = np.minimum((probability * bins).astype(int), bins - 1)
    ece = sum(
        (which == b).mean() * abs(probability[which == b].mean() - labels[which == b].mean())
        for b in range(bins)
        if (which == b).any()
    )
    base = labels.mean()
    return {
        "brier": float(np.mean((probability - labels) ** 2)),
        "ece": float(ece),
        "brier_base_rate": float(np.mean((base - labels) ** 2)),
    }


def stratified_prompt_folds(data: Dataset, k: int = 5, seed: int = 0) -> np.ndarray:
    """Stratified by outcome; identical prompts always share a fold."""
    groups = prompt_groups(data.prompts)
    first = np.unique(groups, return_index=True)[1]
    return stratified_folds(data.outcome[first], k, seed)[groups]


def subject_folds(groups: np.ndarray, k: int = 5, seed: int | None = None) -> np.ndarray:
    """Whole subjects per fold, sizes balanced greedily (seed: shuffle the order first)."""
    ids, sizes = np.unique(groups, return_counts=True)
    order = (
        np.lexsort((ids, -sizes))
        if seed is None
        else np.random.default_rng(seed).permutation(len(ids))
    )
    load = np.zeros(k, dtype=int)
    fold_of: dict[int, int] = {}
    for i in order:
        fold = int(np.argmin(load))
        fold_of[int(ids[i])] = fold
        load[fold] += sizes[i]
    return np.array([fold_of[int(g)] for g in groups])


def out_of_fold(
    data: Dataset, rows: list[Features], folds: np.ndarray, cfg: TrainConfig
) -> np.ndarray:
    """Calibrated probabilities for every row from a model that never saw its fold."""
    scores = np.empty(len(rows))
    y, classes = data.classes(cfg.target)
    for fold in np.unique(folds):
        train_idx, test_idx = np.flatnonzero(folds != fold), np.flatnonzero(folds == fold)
        subset = [rows[i] for i in train_idx]
        model = train(subset, y[train_idx], data.outcome[train_idx], cfg, classes=classes)
        dense = model.standardise(np.array([rows[i].scalars for i in test_idx]))
        logits = np.array([model.logit(rows[i], d) for i, d in zip(test_idx, dense, strict=True)])
        scores[test_idx] = sigmoid(model.platt[0] * logits + model.platt[1])
    return scores


def baselines(data: Dataset, seeds: int = 20) -> dict[str, dict[str, float]]:
    runs = [
        routing_metrics(
            np.random.default_rng(1000 + i).random(len(data.prompts)), data.weak, data.strong
        )
        for i in range(seeds)
    ]
    length = np.array([len(p) for p in data.prompts], float)
    return {
        f"random (mean of {seeds})": {k: float(np.mean([r[k] for r in runs])) for k in runs[0]},
        "prompt length": routing_metrics(length, data.weak, data.strong),
        "oracle": routing_metrics(data.escalation_helps.astype(float), data.weak, data.strong),
    }


def latency_ms(
    decide: Callable[[str], object], prompts: list[str], n: int = 1000
) -> dict[str, float]:
    """p50/p99 wall time of single decisions (after 50 warm-up calls)."""
    sample = [prompts[i % len(prompts)] for i in range(n)]
    for prompt in sample[:50]:
        decide(prompt)
    times = []
    for prompt in sample:
        start = time.perf_counter()
        decide(prompt)
        times.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


@dataclass
class Report:
    rows: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        header = f"{'':52}" + "".join(f"{m:>9}" for m in METRICS)
        lines = [header, "-" * len(header)]
        for name, values in self.rows.items():
            cells = "".join(f"{values[m]:9.3f}" if m in values else f"{'':9}" for m in METRICS)
            lines.append(f"{name:52}{cells}")
        lines += [f"{k}: {v}" for k, v in self.notes.items()]
        return "\n".join(lines)


def evaluate(
    data: Dataset,
    cfg: TrainConfig | None = None,
    group_seeds: int = 0,
    progress: Callable[[str], None] = lambda _m: None,
) -> Report:
    cfg = cfg or TrainConfig()
    report = Report()
    for name, values in baselines(data).items():
        report.rows[f"baseline: {name}"] = values
    groups = subject_groups(data)
    rate = {g: data.escalation_helps[groups == g].mean() for g in np.unique(groups)}
    report.rows["diagnostic: true per-subject rate (reads labels)"] = routing_metrics(
        np.array([rate[g] for g in groups]), data.weak, data.strong
    )

    rows = [extract(p) for p in data.prompts]
    progress("stratified 5-fold")
    scores = out_of_fold(data, rows, stratified_prompt_folds(data), cfg)
    report.rows["router, stratified 5-fold"] = routing_metrics(scores, data.weak, data.strong)
    cal = calibration(scores, data.local_fails)
    report.notes["calibration, stratified (P(local fails))"] = _fmt(cal)

    progress("subject-held-out 5-fold")
    scores = out_of_fold(data, rows, subject_folds(groups), cfg)
    report.rows["router, whole subjects held out"] = routing_metrics(scores, data.weak, data.strong)
    report.notes["calibration, held-out subjects"] = _fmt(calibration(scores, data.local_fails))
    held_out = [report.rows["router, whole subjects held out"]]
    for seed in range(1, group_seeds + 1):
        progress(f"subject-held-out 5-fold, shuffled split {seed}")
        scores = out_of_fold(data, rows, subject_folds(groups, seed=seed), cfg)
        held_out.append(routing_metrics(scores, data.weak, data.strong))
    if group_seeds:
        report.rows[f"router, subjects held out, mean of {len(held_out)} splits"] = {
            m: float(np.mean([h[m] for h in held_out])) for m in METRICS
        }
    return report


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in values.items())
