"""The learned router the edge runs: shipped weights, a threshold policy, and explanations."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_node.learned.data import Dataset
from edge_node.learned.features import extract
from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.learned.train import TrainConfig, train
from mesh.config import RouterSettings
from protocol.errors import ErrorCode, MeshError
from protocol.messages import InferRequest


class LearnedRouter:
    """Scores a request with the calibrated probability that the local model would fail.

    The threshold is a probability (``threshold``), or derived from a target share of cloud
    calls (``cloud_share``) using the score distribution recorded at training time.
    """

    def __init__(self, model: RouterModel, threshold: float) -> None:
        self.model = model
        self.threshold = threshold

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> LearnedRouter:
        path = Path(settings.weights) if settings.weights else WEIGHTS_PATH
        try:
            model = RouterModel.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise MeshError(
                f"cannot load router weights from {path}: {exc}; rebuild them "
                "with `mesh router train`",
                code=ErrorCode.UNAVAILABLE,
                retryable=False,
            ) from None
        if settings.threshold is not None:
            return cls(model, settings.threshold)
        return cls(model, model.threshold_for_share(settings.cloud_share))

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        probability, reasons = self.model.explain(request.text(), request.turns())
        return probability, reasons


def train_on(data: Dataset, cfg: TrainConfig | None = None) -> RouterModel:
    """The shipped model: trained on every row of the routing data."""
    rows = [extract(p) for p in data.prompts]
    subjects = sorted(set(data.subject.tolist()))
    return train(
        rows,
        data.local_fails,
        data.outcome,
        cfg,
        meta={
            "label": "local model fails (weak model wrong)",
            "subjects": len(subjects),
            "base_rate": round(float(np.mean(data.local_fails)), 4),
        },
    )
