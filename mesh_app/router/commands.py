"""``mesh router train``, ``eval`` and ``score``: deterministic, seconds to minutes on 2 cores."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.learned.router import LearnedRouter, budget_from_settings
from edge_node.router import decide
from mesh.config import RouterSettings
from mesh_app.router.data import Dataset, default_data_dir, load_dataset
from mesh_app.router.evaluate import Report, baselines, evaluate, latency_ms, routing_metrics
from mesh_app.router.train import train_on
from protocol.errors import ErrorCode, MeshError
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
        f"wrote {path} ({size / 1024:.0f} KiB, {len(model.buckets)} n-grams and "
        f"{len(model.scalar_weights)} scalars x {len(model.bias)} heads) "
        f"in {time.perf_counter() - started:.1f}s"
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


def router_score(settings: RouterSettings, window: int, as_json: bool) -> int:
    """Score a labelled directory with the configured (by default the shipped) weights, in the
    directory's order, the way the edge decides: the budget runs over the data as traffic."""
    data = load_dataset(settings.data_dir)
    if not data.prompts:
        raise MeshError(
            f"no prompts to score under {settings.data_dir or default_data_dir()}",
            code=ErrorCode.INVALID_REQUEST,
            retryable=False,
        )
    router = LearnedRouter.from_settings(settings)
    # Offline: a fresh budget (no state file) and no per-minute cap, since the rows carry no
    # arrival times. The first prompts warm up caches before anything is timed.
    router.budget = budget_from_settings(settings, router.model, persist=False, cap=False)
    for prompt in data.prompts[:50]:
        router.score(InferRequest(prompt=prompt))
    scores = np.empty(len(data.prompts))
    cloud = np.zeros(len(data.prompts), bool)
    times = np.empty(len(data.prompts))
    for i, prompt in enumerate(data.prompts):
        request = InferRequest(prompt=prompt)
        started = time.perf_counter()
        decision = decide(router, request)
        times[i] = (time.perf_counter() - started) * 1000
        scores[i] = decision.score if decision.score is not None else float("nan")
        cloud[i] = decision.decision == "cloud"
    windows = _window_shares(cloud, window)
    policy: dict[str, object] = {
        "policy": "threshold" if settings.threshold is not None else "cloud_share",
        "cloud_share": None if settings.threshold is not None else settings.cloud_share,
        "threshold": settings.threshold,
        "realized_share": float(cloud.mean()),
        "window": window,
        "window_shares": windows,
    }
    fixed = None
    if settings.threshold is None:  # what the pre-budget policy would have sent
        fixed = router.model.threshold_for_share(settings.cloud_share)
        policy["training_threshold"] = fixed
        policy["training_threshold_share"] = float(np.mean(scores >= fixed))
        policy["training_threshold_window_shares"] = _window_shares(scores >= fixed, window)
    source = str(settings.data_dir or default_data_dir())
    weights = str(settings.weights or WEIGHTS_PATH)
    metrics = routing_metrics(scores, data.weak, data.strong)
    compare = baselines(data)
    subjects = per_subject(data, scores)
    p50, p99 = (float(np.percentile(times, q)) for q in (50, 99))
    if as_json:
        result = {
            "data": source,
            "weights": weights,
            "prompts": len(data.prompts),
            "dropped_contaminated": data.dropped,
            "router": metrics,
            "baselines": compare,
            "subjects": subjects,
            "policy": policy,
            "latency_ms": {"p50": p50, "p99": p99, "decisions": len(times)},
        }
        print(json.dumps(result, indent=2))
        return 0
    report = Report()
    report.rows["router (these weights, no retraining)"] = metrics
    for name, values in compare.items():
        report.rows[f"baseline: {name}"] = values
    print(
        f"scored {len(data.prompts)} prompts from {source} "
        f"({data.dropped} contaminated dropped) with {weights}"
    )
    print(report.table())
    print(_subject_table(subjects))
    if settings.threshold is not None:
        rule = f"fixed threshold {settings.threshold:.3f}"
    else:
        rule = f"cloud_share {settings.cloud_share:.2f}, budget over the data in order"
    print(f"realized cloud share: {cloud.mean():.3f} ({rule}){_spread(windows, window)}")
    if fixed is not None:
        unbudgeted = scores >= fixed
        print(
            f"without the budget, the training-distribution threshold {fixed:.3f} would send "
            f"{unbudgeted.mean():.3f}{_spread(_window_shares(unbudgeted, window), window)}"
        )
    print(
        f"decision latency (score, reasons, budget): p50 {p50:.3f} ms, "
        f"p99 {p99:.3f} ms over {len(times)} decisions"
    )
    return 0


def per_subject(data: Dataset, scores: np.ndarray) -> dict[str, dict[str, float]]:
    """The router's APGR and AUC within each subject, next to prompt length's, and the subject's
    share of prompts where escalation helps."""
    length = np.array([len(p) for p in data.prompts], float)
    out: dict[str, dict[str, float]] = {}
    for subject in sorted(set(data.subject.tolist())):
        mask = data.subject == subject
        weak, strong = data.weak[mask], data.strong[mask]
        router = routing_metrics(scores[mask], weak, strong)
        by_length = routing_metrics(length[mask], weak, strong)
        out[subject] = {
            "n": int(mask.sum()),
            "escalation_helps": float(data.escalation_helps[mask].mean()),
            "router_apgr": router["apgr"],
            "length_apgr": by_length["apgr"],
            "router_auc": router["auc"],
            "length_auc": by_length["auc"],
        }
    return out


def _subject_table(subjects: dict[str, dict[str, float]]) -> str:
    head = f"{'subject':32}{'n':>6}{'helps':>7}  {'APGR router':>11} {'length':>7}"
    head += f"  {'AUC router':>10} {'length':>7}"
    lines = ["per subject:", head, "-" * len(head)]
    for name, r in subjects.items():
        lines.append(
            f"{name:32}{r['n']:6d}{r['escalation_helps']:7.2f}  {r['router_apgr']:11.3f} "
            f"{r['length_apgr']:7.3f}  {r['router_auc']:10.3f} {r['length_auc']:7.3f}"
        )
    return "\n".join(lines)


def _window_shares(cloud: np.ndarray, window: int) -> list[float]:
    """The cloud share of each whole ``window`` of consecutive decisions."""
    return [
        round(float(cloud[start : start + window].mean()), 4)
        for start in range(0, len(cloud) - window + 1, window)
    ]


def _spread(shares: list[float], window: int) -> str:
    if not shares:
        return ""
    return f"; per {window} prompts: min {min(shares):.3f}, max {max(shares):.3f}"
