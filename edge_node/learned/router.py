"""The learned router the edge runs: shipped weights, a threshold policy, and explanations."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

from edge_node.learned.model import WEIGHTS_PATH, RouterModel
from edge_node.router import CloudBudget
from mesh.config import RouterSettings
from protocol.errors import ErrorCode, MeshError
from protocol.messages import InferRequest


class LearnedRouter:
    """Scores a request with the calibrated probability that the local model would fail.

    Without a budget the threshold is fixed; with one (:meth:`from_settings` always attaches
    one) it comes from the budget: a fixed ``threshold`` setting, or the quantile of recent
    scores that keeps the ``cloud_share`` of escalations.
    """

    def __init__(
        self, model: RouterModel, threshold: float, budget: CloudBudget | None = None
    ) -> None:
        self.model = model
        self._threshold = threshold
        self.budget = budget

    @property
    def threshold(self) -> float:
        return self.budget.threshold if self.budget is not None else self._threshold

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> LearnedRouter:
        path = Path(settings.weights) if settings.weights else WEIGHTS_PATH
        try:
            raw = path.read_bytes()
            model = RouterModel.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise MeshError(
                f"cannot load router weights from {path}: {exc}; rebuild them "
                "with `mesh router train`",
                code=ErrorCode.UNAVAILABLE,
                retryable=False,
            ) from None
        budget = budget_from_settings(settings, model, hashlib.sha256(raw).hexdigest()[:16])
        return cls(model, budget.threshold, budget)

    def score(self, request: InferRequest) -> tuple[float, list[str]]:
        probability, reasons = self.model.explain(request.text(), request.turns())
        return probability, reasons


def budget_from_settings(
    settings: RouterSettings,
    model: RouterModel,
    fingerprint: str = "",
    *,
    persist: bool = True,
    cap: bool = True,
    clock: Callable[[], float] = time.time,
) -> CloudBudget:
    """The edge's cloud budget for ``settings``, seeded with the training score distribution.
    ``persist``/``cap`` off give a fresh, uncapped budget (to replay a dataset offline)."""
    return CloudBudget(
        settings.cloud_share,
        model.quantiles,
        threshold=settings.threshold,
        window=settings.budget_window,
        cap_per_minute=settings.cloud_cap_per_minute if cap else None,
        state_file=settings.budget_state if persist else None,
        fingerprint=fingerprint,
        clock=clock,
    )
