"""The edge's one rule for whether the cloud serves a model, asked two ways:

- :meth:`CloudModels.deployed`: a worker pool was deployed for the model (its consumer exists):
  the mesh knows the model. :class:`mesh.provision.ServedModels` answers, the rule the SDK
  follows too (a yes remembered 30 s, a no 3 s; when JetStream cannot tell, yes: the publish
  decides). A request naming a model nobody deployed is ``unknown_model``.
- :meth:`CloudModels.live`: the registry shows a live worker serving it (None: it cannot tell,
  not yet, or not for a model outside the edge's pool). The edge's readiness says "cloud
  reachable" by it.

:meth:`CloudModels.cannot_serve` puts the two together for an escalation: the cloud cannot take
a request for a model without a pool, nor for one the registry shows no live worker for.
"""

from __future__ import annotations

from typing import Protocol

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.provision import ServedModels
from mesh.registry import NodeInfo


class RegistryView(Protocol):
    """What the edge reads of the node registry (:class:`mesh.registry.NodeView`)."""

    def live(self, role: str = "worker") -> list[NodeInfo]: ...

    def serves(self, model: str) -> bool | None: ...

    def is_live(self, node_id: str, model: str | None = None) -> bool | None: ...


class CloudModels:
    def __init__(self, conn: Connection, stream: StreamSettings, nodes: RegistryView) -> None:
        self._deployed = ServedModels(conn.jsm, stream)
        self._nodes = nodes

    async def deployed(self, model: str) -> bool:
        """Whether a worker pool was deployed for ``model`` (yes when JetStream cannot tell)."""
        return await self._deployed(model)

    def live(self, model: str) -> bool | None:
        """Whether the registry shows a live worker serving ``model``; None: it cannot tell."""
        return self._nodes.serves(model)

    async def cannot_serve(self, model: str) -> tuple[str, str] | None:
        """Why the cloud cannot take a request for ``model`` now, and a word for it (``no_pool``,
        ``no_worker``); None when it may."""
        if not await self.deployed(model):
            return f"no worker pool serves {model!r}", "no_pool"
        return self.no_live_worker(model)

    def no_live_worker(self, model: str) -> tuple[str, str] | None:
        """``no_worker`` when the registry shows no live worker serving ``model`` (only then:
        not while it cannot tell)."""
        if self.live(model) is False:
            return f"no live worker serves {model!r}", "no_worker"
        return None
