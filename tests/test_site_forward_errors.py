"""What a site's forwarder makes of the hub's JetStream refusing a held request: a refusal for
good ends the request typed (a 4xx: it would be refused again); anything the hub will get over
(its queue full, no leader, a failure on its side) keeps the request held and tried again.

JetStream's 503 "system temporarily unavailable" (an election, a lost quorum: seconds) was
taken for a refusal: the held request left the outbox, and its site kept ``unavailable`` as
its answer for a week, given again to the same request sent again."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError

from mesh.js_refused import for_now as _for_now


def _api_error(code: int, err_code: int, description: str) -> APIError:
    try:
        APIError.from_error({"code": code, "err_code": err_code, "description": description})
    except APIError as exc:
        return exc
    raise AssertionError("from_error raises")  # pragma: no cover


@pytest.mark.parametrize(
    ("code", "err_code", "description", "for_now"),
    [
        (503, 10008, "JetStream system temporarily unavailable", True),  # an election
        (500, 10077, "maximum messages exceeded", True),  # the queue full
        (400, 10054, "maximum bytes exceeded", True),  # the queue full, by its text
        (500, 10049, "stream store failed", True),  # the hub's own failure
        (400, 10054, "message size exceeds maximum allowed", False),  # never fits
        (400, 10060, "expected stream does not match", False),  # a wrong queue
    ],
)
def test_the_forwarder_waits_out_what_the_hub_gets_over(
    code: int, err_code: int, description: str, for_now: bool
) -> None:
    assert _for_now(_api_error(code, err_code, description)) is for_now
