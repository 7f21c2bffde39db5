"""Choosing the router implementation from configuration."""

from __future__ import annotations

from edge_node.router import CloudBudget, HeuristicRouter, Router
from mesh.config import RouterSettings


def create_router(settings: RouterSettings) -> Router:
    """The learned router with its cloud budget, or the heuristic one. The heuristic's scores
    are not calibrated, so it keeps a fixed threshold (0.5 unless set); its budget counts
    shares and applies the per-minute cap."""
    if settings.kind == "heuristic":
        threshold = 0.5 if settings.threshold is None else settings.threshold
        budget = CloudBudget(
            settings.cloud_share,
            threshold=threshold,
            cap_per_minute=settings.cloud_cap_per_minute,
        )
        return HeuristicRouter(threshold=threshold, budget=budget)
    from edge_node.learned.router import LearnedRouter

    return LearnedRouter.from_settings(settings)
