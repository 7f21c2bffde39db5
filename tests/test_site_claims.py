"""A site's claims (who held each request that can wait): a claim the site's store refuses for
another reason than "held before under this id" (the store full here) means the request is not
held, and its client is told so, typed: before, every refusal was taken for "claimed before",
and the request was held without a claim, its answer later no one's to fetch by id. And a claim
lives as long as its answer can: the answer is kept from when it is collected, the claim from
when the request was held, which may be an outbox's age and a kept age (the answer waiting at
the hub) before."""

from __future__ import annotations

import asyncio

import pytest

from mesh.client import Completion, MeshClient
from mesh.testing.chaos import expected_text
from protocol.errors import UnavailableError
from protocol.subjects import CLAIMS_STREAM
from tests.test_edge_site import Topology, running_mesh, topology  # noqa: F401 - a fixture
from tests.test_security import certs  # noqa: F401 - a fixture


async def test_a_claim_the_store_refuses_is_a_typed_error_not_a_hold_without_one(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    site = "site-a"
    settings = topology.site_settings(site)
    async with running_mesh(topology):
        edge = topology.edges[site]
        assert edge.site is not None
        async with MeshClient(settings=topology.site_settings(site, "client")) as client:

            async def ask(request_id: str) -> Completion:
                return await client.complete(
                    f"[tag:{request_id}] x",
                    route="cloud",
                    max_tokens=3,
                    deferrable=True,
                    request_id=request_id,
                )

            answer = await asyncio.wait_for(ask("c1"), 30)  # held, forwarded, answered
            assert answer.path == "cloud" and answer.text == expected_text("c1", 3)
            jsm = edge.site.conn.site_jsm()
            config = (await jsm.stream_info(CLAIMS_STREAM)).config
            s = settings.stream
            assert config.max_age == s.outbox_max_age + 2 * s.kept_max_age
            config.max_msgs = 1  # c1's claim fills the store
            await jsm.update_stream(config)
            with pytest.raises(UnavailableError, match="claim was refused"):
                await asyncio.wait_for(ask("c2"), 10)
            assert await edge.site.held() == 0  # not held
