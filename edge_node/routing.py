"""Choosing the router implementation from configuration."""

from __future__ import annotations

from edge_node.router import HeuristicRouter, Router
from mesh.config import RouterSettings


def create_router(settings: RouterSettings) -> Router:
    return HeuristicRouter(threshold=settings.threshold)
