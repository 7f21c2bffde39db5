"""An SDK reading an answer through an edge that nobody answers for (its link is down, or it
died) gives it ``edge_gone_after`` to come back, counted from when it went away: an edge that
came back (its events arrived) and goes away again later is timed from its second absence."""

from __future__ import annotations

import asyncio

import pytest

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.repair import SourceGone
from protocol.errors import IncompleteAnswerError, UnavailableError
from protocol.messages import StartEvent, token_event
from protocol.stream import AnswerState

AWAY_S = 0.3


async def nothing() -> None:
    return None


async def test_an_edge_away_twice_in_one_answer_is_timed_from_its_second_absence(
    settings: MeshSettings,
) -> None:
    # No edge runs under this id: the server says nobody answers for it, as for an edge whose
    # link is down. The answer's own events stand for the edge being back in between.
    async with MeshClient(settings=settings, edge_gone_after=AWAY_S) as client:
        state = AnswerState("away-1")
        state.feed(StartEvent(id="away-1", node=f"edge:{client.edge_id}"))
        repair = client._edge_repair("away-1", "_INBOX.away-1", nothing)
        with pytest.raises(UnavailableError):
            await repair(state)  # away: asked again later
        for seq in range(5):  # it came back: its tokens arrived
            state.feed(token_event("away-1", seq, f" t{seq}", 1, 1))
        await asyncio.sleep(AWAY_S + 0.1)
        with pytest.raises(UnavailableError):
            await repair(state)  # away again, just now: not yet gone
        await asyncio.sleep(AWAY_S + 0.1)
        with pytest.raises(SourceGone) as gone:
            await repair(state)  # away since, with nothing of the answer in between: gone
        assert isinstance(gone.value.error, IncompleteAnswerError)
