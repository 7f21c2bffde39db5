"""The trained stage-0 router: a logistic-regression head over hashed n-grams and standardised
scalars, Platt-calibrated, with the distribution of its scores for cloud-share targets.

The probability it returns is the calibrated chance that the LOCAL model would answer wrongly.
Inference is numpy and a few dict lookups; the weights are a small JSON file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_node.learned.features import SCALAR_NAMES, STOPWORDS, Features, extract, ngram_text

FORMAT = "mesh-router/1"
WEIGHTS_PATH = Path(__file__).with_name("weights.json")


def known_buckets(vocab: np.ndarray, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``vocab`` (sorted) of ``buckets``, and a mask of those present in it."""
    if not len(vocab) or not len(buckets):
        return np.zeros(len(buckets), np.int64), np.zeros(len(buckets), bool)
    pos = np.minimum(np.searchsorted(vocab, buckets), len(vocab) - 1)
    return pos, vocab[pos] == buckets


def bucket_score(vocab: np.ndarray, weights: np.ndarray, buckets: np.ndarray) -> float:
    """The n-gram part of a logit: known buckets' weights, scaled by 1/sqrt(#buckets)."""
    pos, known = known_buckets(vocab, buckets)
    return float(weights[pos[known]].sum()) / math.sqrt(max(1, len(buckets)))


@dataclass
class RouterModel:
    mean: np.ndarray
    """Scalar feature means (training data), for standardising."""
    std: np.ndarray
    buckets: np.ndarray
    """Sorted hashed n-gram buckets the head has weights for."""
    bucket_weights: np.ndarray
    scalar_weights: np.ndarray
    bias: float
    platt: tuple[float, float]
    """Calibration: probability = sigmoid(a * logit + b)."""
    quantiles: np.ndarray
    """Calibrated probabilities of the training prompts (out of fold) at q = 0, 0.01, ..., 1."""
    meta: dict[str, Any]

    # -- scoring -------------------------------------------------------------------------
    def standardise(self, scalars: np.ndarray) -> np.ndarray:
        """Standardised scalars, clipped to +-5 sd so an unusual prompt cannot dominate."""
        return np.clip((scalars - self.mean) / self.std, -5.0, 5.0)

    def logit(self, features: Features, dense: np.ndarray | None = None) -> float:
        dense = self.standardise(features.scalars) if dense is None else dense
        ngrams = bucket_score(self.buckets, self.bucket_weights, features.buckets)
        return float(ngrams + dense @ self.scalar_weights + self.bias)

    def calibrate(self, logit: float) -> float:
        a, b = self.platt
        t = a * logit + b
        return 1.0 / (1.0 + math.exp(-t)) if t > -30 else math.exp(t)

    def probability(self, text: str, turns: int = 1) -> float:
        return self.calibrate(self.logit(extract(text, turns)))

    def explain(
        self, text: str, turns: int = 1, k: int = 3, min_push: float = 0.1
    ) -> tuple[float, list[str]]:
        """The probability, and up to ``k`` features present in the prompt that pushed it up
        by at least ``min_push`` (logit units). Being below the training average is not a
        reason a person would recognise, so only above-average features and n-grams count."""
        features = extract(text, turns)
        dense = self.standardise(features.scalars)
        probability = self.calibrate(self.logit(features, dense))
        pushes: list[tuple[float, str | int]] = [
            (float(dense[j] * self.scalar_weights[j]), j)
            for j in range(len(SCALAR_NAMES))
            if dense[j] > 0
        ]
        pos, known = known_buckets(self.buckets, features.buckets)
        scale = 1.0 / math.sqrt(max(1, len(features.buckets)))
        for bucket, p in zip(features.buckets[known].tolist(), pos[known].tolist(), strict=True):
            pushes.append((scale * float(self.bucket_weights[p]), f"#{bucket}"))
        pushes.sort(key=lambda c: -c[0])
        reasons: list[str] = []
        for value, what in pushes:
            if value < min_push or len(reasons) == k:
                break
            if isinstance(what, int):
                reasons.append(SCALAR_NAMES[what])
                continue
            phrase = ngram_text(features.tokens, int(what[1:]))
            if phrase and any(w.isalpha() and w not in STOPWORDS for w in phrase.split()):
                reasons.append(f"'{phrase}'")
        return probability, reasons

    def threshold_for_share(self, share: float) -> float:
        """The probability threshold that sends about ``share`` of prompts to the cloud (on the
        training distribution, as RouteLLM calibrates its thresholds)."""
        share = min(1.0, max(0.0, share))
        q = np.linspace(0.0, 1.0, len(self.quantiles))
        return float(np.interp(1.0 - share, q, self.quantiles))

    # -- storage ---------------------------------------------------------------------------
    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "meta": self.meta,
            "mean": [round(float(v), 6) for v in self.mean],
            "std": [round(float(v), 6) for v in self.std],
            "bucket_deltas": np.diff(np.r_[0, self.buckets]).astype(int).tolist(),
            "bucket_weights": [float(f"{v:.4g}") for v in self.bucket_weights],
            "scalar_weights": [float(f"{v:.6g}") for v in self.scalar_weights],
            "bias": float(f"{self.bias:.6g}"),
            "platt": [float(f"{v:.6g}") for v in self.platt],
            "quantiles": [round(float(v), 5) for v in self.quantiles],
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path = WEIGHTS_PATH) -> RouterModel:
        """Load weights; ``ValueError`` when the file is not router weights of this format."""
        body = json.loads(Path(path).read_text())
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"{path} is not {FORMAT} router weights")
        return cls(
            mean=np.array(body["mean"], float),
            std=np.array(body["std"], float),
            buckets=np.cumsum(np.array(body["bucket_deltas"], np.int64)),
            bucket_weights=np.array(body["bucket_weights"], float),
            scalar_weights=np.array(body["scalar_weights"], float),
            bias=float(body["bias"]),
            platt=(float(body["platt"][0]), float(body["platt"][1])),
            quantiles=np.array(body["quantiles"], float),
            meta=dict(body["meta"]),
        )
