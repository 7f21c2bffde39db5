"""Choosing the router implementation from configuration."""

from __future__ import annotations

from edge_node.router import HeuristicRouter, Router
from mesh.config import RouterSettings


def create_router(settings: RouterSettings) -> Router:
    if settings.kind == "heuristic":
        return HeuristicRouter(threshold=0.5 if settings.threshold is None else settings.threshold)
    from edge_node.learned.router import LearnedRouter

    return LearnedRouter.from_settings(settings)
