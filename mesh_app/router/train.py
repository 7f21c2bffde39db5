"""Training the stage-0 router: L2 logistic regression fitted with a small deterministic L-BFGS,
then Platt calibration on inner out-of-fold logits. numpy only; same inputs, same weights."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from edge_node.learned.features import Features, extract
from edge_node.learned.model import RouterModel, bucket_score
from mesh_app.router.data import Dataset


@dataclass(frozen=True)
class TrainConfig:
    min_df: int = 20
    """Drop n-gram buckets seen in fewer training prompts (rare words overfit to topics)."""
    l2_buckets: float = 1e-4
    l2_scalars: float = 1e-3
    max_iter: int = 1000
    """A cap: the fit stops once every gradient component is under ``GTOL`` (518 and 564
    evaluations of the loss in two fits on the shipped data)."""
    calib_folds: int = 3
    seed: int = 0
    target: str = "three_class"
    """``three_class``: local right / both wrong / escalation helps (a head for each of the last
    two); ``local_wrong``: one logistic head. Either way the score is P(local model wrong)."""


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


Objective = Callable[[np.ndarray], tuple[float, np.ndarray]]
GTOL = 1e-7
"""Converged: the largest gradient component under this. The loss is flat along many n-gram
weights (their L2 is weak), so a fit stopped by the loss alone (a relative change under 1e-7,
at 100 steps) stopped where the float arithmetic's rounding had led it: numpy 2.4 on this
machine rebuilt the shipped weights 0.039 apart, and the same rows in another order moved them
by up to 0.009. Fitted to this, rows in another order move them by under 1e-4."""


def lbfgs(
    objective: Objective, x0: np.ndarray, max_iter: int, memory: int = 10, gtol: float = GTOL
) -> np.ndarray:
    """Minimise a smooth convex function with L-BFGS and Armijo backtracking."""
    x = x0.copy()
    f, g = objective(x)
    steps: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(max_iter):
        q = g.copy()
        alphas = []
        for s, y in reversed(steps):
            a = (s @ q) / (y @ s)
            alphas.append(a)
            q -= a * y
        if steps:
            s, y = steps[-1]
            q *= (s @ y) / (y @ y)
        else:
            q /= max(1.0, float(np.linalg.norm(g)))
        for (s, y), a in zip(steps, reversed(alphas), strict=True):
            q += s * (a - (y @ q) / (y @ s))
        direction = -q
        slope = g @ direction
        if slope >= 0:  # not a descent direction: restart from the gradient
            direction, slope, steps = -g, -(g @ g), []
        step = 1.0
        while True:
            x_new = x + step * direction
            f_new, g_new = objective(x_new)
            if f_new <= f + 1e-4 * step * slope or step < 1e-10:
                break
            step *= 0.5
        s, y = x_new - x, g_new - g
        if s @ y > 1e-12:
            steps = [*steps[-(memory - 1) :], (s, y)]
        stuck = step < 1e-10  # no step lowers the loss: as close as the arithmetic gets
        x, f, g = x_new, f_new, g_new
        if stuck or float(np.max(np.abs(g), initial=0.0)) < gtol:
            break
    return x


@dataclass
class _Head:
    buckets: np.ndarray
    bucket_weights: np.ndarray
    """(buckets, heads): one column per class other than class 0 ("local right")."""
    scalar_weights: np.ndarray
    bias: np.ndarray

    def logits(self, rows: Sequence[Features], dense: np.ndarray) -> np.ndarray:
        """Log-odds that the local model fails: log P(any class but 0) / P(class 0)."""
        weights = self.bucket_weights
        ngrams = np.array([bucket_score(self.buckets, weights, r.buckets) for r in rows])
        return fail_logit(ngrams + dense @ self.scalar_weights + self.bias)


def fail_logit(z: np.ndarray) -> np.ndarray:
    """Class 0 has logit 0, so log P(not 0) / P(0) is the log-sum-exp of the other logits."""
    return np.logaddexp.reduce(z, axis=-1) if z.shape[-1] > 1 else z[..., 0]


def fit_head(
    rows: Sequence[Features], dense: np.ndarray, y: np.ndarray, cfg: TrainConfig, classes: int = 2
) -> _Head:
    """Multinomial logistic regression with class 0 as reference (two classes: the plain
    logistic one); the bucket vocabulary comes from these rows only."""
    lengths = np.array([len(r.buckets) for r in rows])
    flat = np.concatenate([r.buckets for r in rows]) if lengths.sum() else np.zeros(0, np.int64)
    vocab, inverse, doc_freq = np.unique(flat, return_inverse=True, return_counts=True)
    keep = doc_freq >= cfg.min_df
    column = (np.cumsum(keep) - 1)[inverse][keep[inverse]]
    row = np.repeat(np.arange(len(rows)), lengths)[keep[inverse]]
    value = (1.0 / np.sqrt(np.maximum(lengths, 1)))[row]
    n, n_cols, n_dense, heads = len(y), int(keep.sum()), dense.shape[1], classes - 1
    l2 = np.r_[np.full(n_cols, cfg.l2_buckets), np.full(n_dense, cfg.l2_scalars), 0.0][:, None]
    target = np.eye(classes)[np.asarray(y, int)][:, 1:]

    def objective(flat_x: np.ndarray) -> tuple[float, np.ndarray]:
        x = flat_x.reshape(-1, heads)
        sparse = np.stack(
            [np.bincount(row, weights=value * x[column, k], minlength=n) for k in range(heads)], 1
        )
        z = sparse + dense @ x[n_cols:-1] + x[-1]
        total = np.logaddexp.reduce(np.c_[np.zeros(n), z], axis=1)
        loss = float(np.mean(total - (target * z).sum(1)) + 0.5 * np.sum(l2 * x * x))
        residual = (np.exp(z - total[:, None]) - target) / n
        grad_buckets = np.stack(
            [
                np.bincount(column, weights=value * residual[row, k], minlength=n_cols)
                for k in range(heads)
            ],
            1,
        )
        grad = np.r_[grad_buckets, dense.T @ residual, residual.sum(0, keepdims=True)] + l2 * x
        return loss, grad.ravel()

    x = lbfgs(objective, np.zeros((n_cols + n_dense + 1) * heads), cfg.max_iter).reshape(-1, heads)
    return _Head(vocab[keep], x[:n_cols], x[n_cols:-1], x[-1].copy())


def platt(logits: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Fit probability = sigmoid(a * logit + b) by Newton steps on Platt's smoothed targets."""
    positives, negatives = y.sum(), len(y) - y.sum()
    t = np.where(y == 1, (positives + 1) / (positives + 2), 1 / (negatives + 2))

    def nll(a: float, b: float) -> float:
        u = a * logits + b
        return float(np.sum(np.logaddexp(0.0, u) - t * u))

    a, b = 1.0, 0.0
    for _ in range(100):
        p = sigmoid(a * logits + b)
        grad = np.array([np.sum((p - t) * logits), np.sum(p - t)])
        w = p * (1 - p) + 1e-12
        hess = np.array(
            [[np.sum(w * logits * logits), np.sum(w * logits)], [np.sum(w * logits), np.sum(w)]]
        )
        da, db = np.linalg.solve(hess + 1e-6 * np.eye(2), grad)
        step, before = 1.0, nll(a, b)
        while nll(a - step * da, b - step * db) > before and step > 1e-8:
            step *= 0.5
        a, b = a - step * da, b - step * db
        if step * (abs(da) + abs(db)) < 1e-10:
            break
    return float(a), float(b)


def stratified_folds(strata: np.ndarray, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    folds = np.empty(len(strata), dtype=int)
    for stratum in np.unique(strata):
        members = np.flatnonzero(strata == stratum)
        folds[members[rng.permutation(len(members))]] = np.arange(len(members)) % k
    return folds


def train(
    rows: Sequence[Features],
    y: np.ndarray,
    strata: np.ndarray,
    cfg: TrainConfig | None = None,
    meta: dict[str, object] | None = None,
    *,
    classes: int = 2,
) -> RouterModel:
    """Fit the head on all rows (``y``: class ids, 0 meaning the local model is right);
    calibrate P(class != 0) on inner out-of-fold logits (``strata`` keeps each fold's outcome
    mix); record the out-of-fold probability quantiles for share targets."""
    cfg = cfg or TrainConfig()
    scalars = np.array([r.scalars for r in rows])
    mean, std = scalars.mean(0), np.maximum(scalars.std(0), 1e-3)
    dense = np.clip((scalars - mean) / std, -5.0, 5.0)
    head = fit_head(rows, dense, y, cfg, classes)
    folds = stratified_folds(strata, cfg.calib_folds, cfg.seed)
    oof = np.empty(len(y))
    for fold in range(cfg.calib_folds):
        train_idx, held = np.flatnonzero(folds != fold), np.flatnonzero(folds == fold)
        inner = fit_head(
            [rows[int(i)] for i in train_idx], dense[train_idx], y[train_idx], cfg, classes
        )
        oof[held] = inner.logits([rows[int(i)] for i in held], dense[held])
    fails = (np.asarray(y) != 0).astype(int)
    a, b = platt(oof, fails)
    calibrated = sigmoid(a * oof + b)
    return RouterModel(
        mean=mean,
        std=std,
        buckets=head.buckets,
        bucket_weights=head.bucket_weights,
        scalar_weights=head.scalar_weights,
        bias=head.bias,
        platt=(a, b),
        quantiles=np.quantile(calibrated, np.linspace(0, 1, 101)),
        meta={
            "config": asdict(cfg),
            "rows": len(rows),
            "positives": int(fails.sum()),
            **(meta or {}),
        },
    )


CLASS_NAMES = {
    "three_class": ["local right", "both wrong", "escalation helps"],
    "local_wrong": ["local right", "local wrong"],
}


def train_on(data: Dataset, cfg: TrainConfig | None = None) -> RouterModel:
    """The shipped model: trained on every row of the routing data."""
    cfg = cfg or TrainConfig()
    rows = [extract(p) for p in data.prompts]
    subjects = sorted(set(data.subject.tolist()))
    y, classes = data.classes(cfg.target)
    return train(
        rows,
        y,
        data.outcome,
        cfg,
        meta={
            "label": "local model fails (weak model wrong)",
            "classes": CLASS_NAMES[cfg.target],
            "subjects": len(subjects),
            "base_rate": round(float(np.mean(data.local_fails)), 4),
        },
        classes=classes,
    )
