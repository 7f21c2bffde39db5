"""No raw nats-py exception reaches a caller of the SDK: a connection that cannot carry a request
gives a typed, retryable error, on either path."""

from __future__ import annotations

import pytest

from mesh.client import MeshClient
from mesh.config import MeshSettings
from protocol.errors import MeshError, UnavailableError


@pytest.mark.parametrize("route", ["local", "cloud"])
async def test_a_closed_connection_is_a_typed_error_on_either_path(
    settings: MeshSettings, route: str
) -> None:
    client = MeshClient(settings=settings)
    await client.connect()
    await client.conn.nc.close()  # under the SDK's feet: the socket is gone
    via = {"via": "cloud"} if route == "cloud" else {}
    with pytest.raises(MeshError) as raised:
        await client.complete("hi", route=route, max_tokens=4, **via)
    assert isinstance(raised.value, UnavailableError), repr(raised.value)
    assert raised.value.retryable
    await client.close()
