"""``mesh bench confidence``: does the local model's own confidence tell when to escalate,
beyond stage 0?

    mesh bench confidence [--mmlu-per-subject 12] [--gsm8k 120] [--window 8] [--seed 0]
        [--arithmetic 300] [--json out.json]

Not part of ``mesh bench all``: it needs the routing data in ``../shared/routing`` and
llama-cpp-python, and takes minutes. Runs the bundled GGUF (greedy) on labelled prompts from
the routing data and reads, over its first ``--window`` generated tokens, the confidence the
edge's mid-answer escalation uses (mean and max entropy, mean and min top log-probability).
Two labels:

- **the local model's own correctness** (GSM8K): rows where the strong model is marked correct
  give the gold number (the last number of its response); the local answer is right when its
  last number equals it;
- **RouteLLM's "escalation helps"** (MMLU and GSM8K): the weak model wrong, the strong right.

Stage 0 is scored out of fold with whole subjects held out (a router that never saw the
subject), and the combination (stage 0 + confidence, a logistic regression) with the same
subject folds. Prints AUCs, the AUC added over stage 0, and the hold cost: the time to the
first token against the time to the window's last token.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import numpy as np

from edge_node.confidence import summarise
from edge_node.learned.features import extract
from mesh.config import load_settings
from mesh.models import resolve_model_path
from mesh_app.router.data import Dataset, load_dataset, subject_groups
from mesh_app.router.evaluate import out_of_fold, roc_auc, routing_metrics, subject_folds
from mesh_app.router.train import TrainConfig

FEATURES = ("mean_entropy", "max_entropy", "mean_logprob", "min_logprob")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def sample_rows(data: Dataset, per_subject: int, gsm8k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picked: list[int] = []
    for subject in sorted(set(data.subject.tolist())):
        rows = np.flatnonzero(data.subject == subject)
        take = gsm8k if subject == "gsm8k" else per_subject
        picked += rng.choice(rows, size=min(take, len(rows)), replace=False).tolist()
    return np.array(sorted(picked))


def run_model(
    prompts: list[str], window: int, long_for: set[int], max_tokens: int = 256
) -> list[dict[str, Any]]:
    from llama_cpp import Llama

    from mesh.backends.llama_cpp import _Probe

    model = load_settings(environ={}).edge.model
    path = str(resolve_model_path(model.path))
    # Any: the stream's chunks are read as plain dicts, as llama-cpp-python yields them.
    llm: Any = Llama(path, n_ctx=model.n_ctx, n_threads=1, verbose=False)
    out: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        probe = _Probe(window)
        began = time.perf_counter()
        times: list[float] = []
        text: list[str] = []
        stream = llm.create_chat_completion(
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            temperature=0.0,
            max_tokens=max_tokens if i in long_for else window,
            logits_processor=[probe],
        )
        readings: list[tuple[float, float]] = []
        for part in stream:
            piece = part["choices"][0].get("delta", {}).get("content")
            if piece:
                times.append(time.perf_counter() - began)
                text.append(piece)
                readings.extend(probe.fresh() or ())  # as the edge reads them
        conf = summarise(readings)
        out.append(
            {
                "text": "".join(text),
                "confidence": conf.as_dict() if conf else None,
                "ttft_s": times[0] if times else None,
                "window_s": times[min(window, len(times)) - 1] if times else None,
            }
        )
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(prompts)} prompts", flush=True)
    return out


def feature_matrix(results: list[dict[str, Any]]) -> np.ndarray:
    """The confidence features of each run, in FEATURES order (zeros where none was read)."""
    return np.array(
        [[r["confidence"][f] if r["confidence"] else 0.0 for f in FEATURES] for r in results]
    )


def feature_aucs(feats: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """Each feature's AUC against ``label``, oriented so that less sure scores higher."""
    return {
        f: roc_auc(-feats[:, j] if "logprob" in f else feats[:, j], label)
        for j, f in enumerate(FEATURES)
    }


def logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(q / (1 - q))


def logistic_cv(x: np.ndarray, y: np.ndarray, folds: np.ndarray) -> np.ndarray:
    """Out-of-fold probabilities of a small L2 logistic regression (Newton steps)."""
    scores = np.empty(len(y))
    for fold in np.unique(folds):
        tr, te = folds != fold, folds == fold
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-9
        a = np.c_[np.ones(tr.sum()), (x[tr] - mu) / sd]
        w = np.zeros(a.shape[1])
        for _ in range(25):
            p = 1 / (1 + np.exp(-a @ w))
            grad = a.T @ (p - y[tr]) + 1.0 * np.r_[0, w[1:]]
            hess = (a * (p * (1 - p))[:, None]).T @ a + np.diag(np.r_[0, np.ones(len(w) - 1)])
            w -= np.linalg.solve(hess, grad)
        b = np.c_[np.ones(te.sum()), (x[te] - mu) / sd]
        scores[te] = 1 / (1 + np.exp(-b @ w))
    return scores


async def run(
    *,
    mmlu_per_subject: int = 12,
    gsm8k: int = 120,
    window: int = 8,
    seed: int = 0,
    arithmetic: int = 300,
) -> dict[str, Any]:
    """The report; the model runs in a thread, so the event loop stays free."""
    return await asyncio.to_thread(measure, mmlu_per_subject, gsm8k, window, seed, arithmetic)


def measure(
    mmlu_per_subject: int, gsm8k: int, window: int, seed: int, arithmetic_n: int
) -> dict[str, Any]:
    data = load_dataset()
    print(f"stage 0 out of fold, whole subjects held out ({len(data.prompts)} rows)...", flush=True)
    groups = subject_groups(data)
    folds = subject_folds(groups, k=5)
    rows = [extract(p) for p in data.prompts]
    stage0_all = out_of_fold(data, rows, folds, TrainConfig())

    index = sample_rows(data, mmlu_per_subject, gsm8k, seed)
    sample = data.subset(index)
    stage0 = stage0_all[index]
    is_gsm = sample.subject == "gsm8k"
    print(f"running the bundled model on {len(index)} prompts ({is_gsm.sum()} GSM8K)...")
    results = run_model(sample.prompts, window, set(np.flatnonzero(is_gsm).tolist()))
    ok = np.array([r["confidence"] is not None for r in results])
    feats = feature_matrix(results)
    report: dict[str, Any] = {"window": window, "rows": len(index)}

    # Label 1: "escalation helps" (RouteLLM's weak and strong models), every sampled row.
    helps = sample.escalation_helps.astype(float)
    sample_folds = folds[index]
    logit0 = logit(stage0)
    combo = logistic_cv(np.c_[logit0, feats], helps, sample_folds)
    conf_only = logistic_cv(feats, helps, sample_folds)

    def within(scores: np.ndarray) -> float:
        """Mean AUC within each held-out fold: blind to how folds' score levels differ (with
        whole subjects held out, a noise feature's intercept shifts against the fold's rate)."""
        return float(
            np.nanmean(
                [
                    roc_auc(scores[sample_folds == f], helps[sample_folds == f])
                    for f in np.unique(sample_folds)
                ]
            )
        )

    report["within_fold_auc"] = {
        "stage0": within(stage0),
        "confidence": within(conf_only),
        "stage0+confidence": within(combo),
    }
    report["escalation_helps"] = {
        "stage0": routing_metrics(stage0, sample.weak, sample.strong),
        "confidence": routing_metrics(conf_only, sample.weak, sample.strong),
        "stage0+confidence": routing_metrics(combo, sample.weak, sample.strong),
        "features_auc": feature_aucs(feats, helps),
    }

    # Label 2: the bundled model's own correctness on GSM8K rows with a gold number.
    gold_rows = [
        (k, last_number(str(g)))
        for k, g in zip(np.flatnonzero(is_gsm), _strong_responses(data, index[is_gsm]), strict=True)
    ]
    labelled = [(k, gold) for k, gold in gold_rows if gold is not None and sample.strong[k] == 1]
    own: dict[str, Any] = {"rows": len(labelled)}
    if labelled:
        ks = np.array([k for k, _ in labelled])
        local_right = np.array(
            [last_number(results[k]["text"]) == gold for k, gold in labelled], float
        )
        wrong = 1 - local_right
        own["local_right"] = int(local_right.sum())
        own["auc_stage0"] = roc_auc(stage0[ks], wrong)
        own["features_auc"] = feature_aucs(feats[ks], wrong)
    report["gsm8k_own_correctness"] = own
    if arithmetic_n:
        report["arithmetic_own_correctness"] = arithmetic(arithmetic_n, window, seed)

    ttft = np.array([r["ttft_s"] for r in results if r["ttft_s"] is not None]) * 1000
    hold = np.array([r["window_s"] for r in results if r["window_s"] is not None]) * 1000
    report["hold_cost_ms"] = {
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "window_p50": float(np.percentile(hold, 50)),
        "window_p99": float(np.percentile(hold, 99)),
    }
    report["scored_rows"] = int(ok.sum())
    return report


def arithmetic(n: int, window: int, seed: int) -> dict[str, Any]:
    """Questions whose gold answer is known by construction, from easy (one-digit sums) to hard
    (three-digit products): where the bundled model is sometimes right, so its own correctness
    can label its confidence. Stage 0 is the shipped router (it never saw such prompts)."""
    from edge_node.learned.router import LearnedRouter
    from mesh.config import RouterSettings
    from protocol.messages import InferRequest

    rng = np.random.default_rng(seed + 1)
    prompts, golds = [], []
    for _ in range(n):
        digits = int(rng.integers(1, 4))
        a, b = (int(x) for x in rng.integers(10 ** (digits - 1), 10**digits, size=2))
        op = str(rng.choice(["+", "-", "*"]))
        prompts.append(f"What is {a} {op} {b}? Answer with the number only.")
        golds.append(float(a + b if op == "+" else a - b if op == "-" else a * b))
    results = run_model(prompts, window, set(range(n)), max_tokens=24)
    right = np.array(
        [last_number(r["text"]) == g for r, g in zip(results, golds, strict=True)], float
    )
    wrong = 1 - right
    router = LearnedRouter.from_settings(RouterSettings())
    stage0 = np.array([router.score(InferRequest(id="a", prompt=p))[0] for p in prompts])
    feats = feature_matrix(results)
    folds = np.arange(n) % 5
    logit0 = logit(stage0)
    return {
        "rows": n,
        "local_right": int(right.sum()),
        "auc_stage0": roc_auc(stage0, wrong),
        "auc_confidence_cv": roc_auc(logistic_cv(feats, wrong, folds), wrong),
        "auc_stage0+confidence_cv": roc_auc(logistic_cv(np.c_[logit0, feats], wrong, folds), wrong),
        "features_auc": feature_aucs(feats, wrong),
    }


def _strong_responses(data: Dataset, rows: np.ndarray) -> list[str]:
    """The strong model's GSM8K responses, by dataset row."""
    import csv
    import sys

    from mesh_app.router.data import STRONG, default_data_dir

    csv.field_size_limit(sys.maxsize)
    wanted = {data.prompts[i] for i in rows}
    found: dict[str, str] = {}
    path = default_data_dir() / "gsm8k" / "gsm8k_responses.csv"
    with path.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["prompt"] in wanted:
                found[row["prompt"]] = row.get(f"{STRONG}_response", "")
    return [found.get(data.prompts[i], "") for i in rows]


def render(report: dict[str, Any]) -> str:
    lines = [f"confidence: first {report['window']} tokens; rows: {report['rows']}"]
    lines.append("\n'escalation helps' (RouteLLM labels), subject-held-out folds:")
    lines.append(f"  {'scorer':<20} {'AUC':>6} {'APGR':>6} {'CPT50':>6} {'CPT80':>6} {'q95':>6}")
    for name in ("stage0", "confidence", "stage0+confidence"):
        m = report["escalation_helps"][name]
        lines.append(
            f"  {name:<20} {m['auc']:6.3f} {m['apgr']:6.3f} {m['cpt50']:6.3f} "
            f"{m['cpt80']:6.3f} {m['q95']:6.3f}"
        )
    w = report["within_fold_auc"]
    lines.append(
        f"  mean AUC within held-out folds: stage 0 {w['stage0']:.3f}, confidence "
        f"{w['confidence']:.3f}, both {w['stage0+confidence']:.3f}"
    )
    added = (
        report["escalation_helps"]["stage0+confidence"]["auc"]
        - report["escalation_helps"]["stage0"]["auc"]
    )
    lines.append(f"  AUC added by confidence: {added:+.3f}")
    lines.append(f"  single features: {_fmt(report['escalation_helps']['features_auc'])}")
    own = report["gsm8k_own_correctness"]
    lines.append(
        f"\nGSM8K, the bundled model's own correctness ({own['rows']} rows with a gold number):"
    )
    if own["rows"]:
        lines.append(
            f"  local right: {own['local_right']}; "
            f"AUC('local wrong') stage 0 {own['auc_stage0']:.3f}"
        )
        lines.append(f"  single features: {_fmt(own['features_auc'])}")
    ari = report.get("arithmetic_own_correctness")
    if ari:
        lines.append(
            f"\narithmetic with gold by construction ({ari['rows']} questions), the bundled "
            f"model's own correctness: right {ari['local_right']}"
        )
        lines.append(
            f"  AUC('local wrong'): stage 0 {ari['auc_stage0']:.3f}, confidence (5-fold) "
            f"{ari['auc_confidence_cv']:.3f}, both {ari['auc_stage0+confidence_cv']:.3f}"
        )
        lines.append(f"  single features: {_fmt(ari['features_auc'])}")
    h = report["hold_cost_ms"]
    lines.append(
        f"\nhold cost: TTFT p50 {h['ttft_p50']:.0f} ms (p99 {h['ttft_p99']:.0f}); "
        f"window's last token p50 {h['window_p50']:.0f} ms (p99 {h['window_p99']:.0f})"
    )
    return "\n".join(lines)


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in values.items())
