"""The trained stage-0 router: a multinomial logistic-regression head (classes: local right, both
wrong, escalation helps) over hashed n-grams and standardised scalars, whose P(local wrong) is
Platt-calibrated, with the distribution of its scores for cloud-share targets.

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

FORMAT = "mesh-router/2"
"""Version 2 has one weight column per head (class); version 1 files (one head) still load."""
FORMATS = ("mesh-router/1", FORMAT)
WEIGHTS_PATH = Path(__file__).with_name("weights.json")


def known_buckets(vocab: np.ndarray, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions in ``vocab`` (sorted) of ``buckets``, and a mask of those present in it."""
    if not len(vocab) or not len(buckets):
        return np.zeros(len(buckets), np.int64), np.zeros(len(buckets), bool)
    pos = np.minimum(np.searchsorted(vocab, buckets), len(vocab) - 1)
    return pos, vocab[pos] == buckets


def bucket_score(vocab: np.ndarray, weights: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """The n-gram part of each head's logit: known buckets' weights (rows of ``weights``),
    scaled by 1/sqrt(#buckets)."""
    pos, known = known_buckets(vocab, buckets)
    return weights[pos[known]].sum(0) / math.sqrt(max(1, len(buckets)))


@dataclass
class RouterModel:
    mean: np.ndarray
    """Scalar feature means (training data), for standardising."""
    std: np.ndarray
    buckets: np.ndarray
    """Sorted hashed n-gram buckets the heads have weights for."""
    bucket_weights: np.ndarray
    """(buckets, heads): a column per class other than "local right" (class 0)."""
    scalar_weights: np.ndarray
    """(scalars, heads)."""
    bias: np.ndarray
    """(heads,)."""
    platt: tuple[float, float]
    """Calibration: probability = sigmoid(a * logit + b)."""
    quantiles: np.ndarray
    """Calibrated probabilities of the training prompts (out of fold) at q = 0, 0.01, ..., 1."""
    meta: dict[str, Any]

    # -- scoring -------------------------------------------------------------------------
    def standardise(self, scalars: np.ndarray) -> np.ndarray:
        """Standardised scalars, clipped to +-5 sd so an unusual prompt cannot dominate."""
        return np.clip((scalars - self.mean) / self.std, -5.0, 5.0)

    def head_logits(self, features: Features, dense: np.ndarray | None = None) -> np.ndarray:
        """Each head's logit against class 0 ("local right")."""
        dense = self.standardise(features.scalars) if dense is None else dense
        ngrams = bucket_score(self.buckets, self.bucket_weights, features.buckets)
        z: np.ndarray = ngrams + dense @ self.scalar_weights + self.bias
        return z

    def logit(self, features: Features, dense: np.ndarray | None = None) -> float:
        """Uncalibrated log-odds that the local model fails: log P(not class 0) / P(class 0)."""
        z = self.head_logits(features, dense)
        return float(np.logaddexp.reduce(z)) if len(z) > 1 else float(z[0])

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
        z = self.head_logits(features, dense)
        probability = self.calibrate(float(np.logaddexp.reduce(z)))
        # A feature moves the fail log-odds by its weights, each head's weighted by that head's
        # share of the fail probability (the gradient of the log-sum-exp).
        share = np.exp(z - np.logaddexp.reduce(z))
        scalar_push = dense * (self.scalar_weights @ share)
        pushes: list[tuple[float, str | int]] = [
            (float(scalar_push[j]), j) for j in range(len(SCALAR_NAMES)) if dense[j] > 0
        ]
        pos, known = known_buckets(self.buckets, features.buckets)
        scale = 1.0 / math.sqrt(max(1, len(features.buckets)))
        bucket_push = scale * (self.bucket_weights[pos[known]] @ share)
        present = features.buckets[known].tolist()
        for bucket, push in zip(present, bucket_push.tolist(), strict=True):
            pushes.append((push, f"#{bucket}"))
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
            "bucket_weights": [[float(f"{v:.4g}") for v in head] for head in self.bucket_weights.T],
            "scalar_weights": [[float(f"{v:.6g}") for v in head] for head in self.scalar_weights.T],
            "bias": [float(f"{v:.6g}") for v in self.bias],
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
        if not isinstance(body, dict) or body.get("format") not in FORMATS:
            raise ValueError(f"{path} is not {FORMAT} router weights")

        def by_head(values: object) -> np.ndarray:
            """Version 2 stores a list per head; version 1 a single head's flat list."""
            array = np.array(values, float)
            return array.T if array.ndim == 2 else array.reshape(-1, 1)

        return cls(
            mean=np.array(body["mean"], float),
            std=np.array(body["std"], float),
            buckets=np.cumsum(np.array(body["bucket_deltas"], np.int64)),
            bucket_weights=by_head(body["bucket_weights"]),
            scalar_weights=by_head(body["scalar_weights"]),
            bias=np.atleast_1d(np.array(body["bias"], float)),
            platt=(float(body["platt"][0]), float(body["platt"][1])),
            quantiles=np.array(body["quantiles"], float),
            meta=dict(body["meta"]),
        )
