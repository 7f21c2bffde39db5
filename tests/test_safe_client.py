"""``mesh.safe_client.SafeClient`` builds every readable message as the installed nats-py does
(it builds it in place, to add no call per message), and drops only what nats-py cannot read.
The end-to-end cases (a real nats-server passing such bytes on) are in
``tests/test_nats_cli_hostile.py``."""

from __future__ import annotations

import random

from nats.aio.client import Client

from mesh.safe_client import SafeClient, dropped


def test_a_readable_message_is_built_as_nats_py_builds_it() -> None:
    plain, safe = Client(), SafeClient()
    for headers in (None, {"Content-Type": "application/msgpack"}):
        ours = safe._build_message(7, b"mesh.v1.tok.a.b", b"_INBOX.x", b"\x81\xa1t", headers)
        theirs = plain._build_message(7, b"mesh.v1.tok.a.b", b"_INBOX.x", b"\x81\xa1t", headers)
        assert type(ours) is type(theirs)
        for field in ("subject", "reply", "data", "headers", "_sid"):
            assert getattr(ours, field) == getattr(theirs, field), field
        assert ours._client is safe


async def test_only_what_nats_py_cannot_read_is_dropped() -> None:
    safe = SafeClient()
    before = dropped.count
    assert safe._build_message(1, b"a.\xff", b"", b"x", None) is None
    assert safe._build_message(1, b"a.b", b"_INBOX.\xfe", b"x", None) is None
    unreadable = await safe._process_headers(b"NATS/1.0 \xff\xfe\r\n\r\n")
    assert safe._build_message(1, b"a.b", b"", b"x", unreadable) is None
    assert dropped.count == before + 3
    assert await safe._process_headers(b"") is None
    status = await safe._process_headers(b"NATS/1.0 408 Request Timeout\r\n\r\n")
    assert status is not None and status.get("Status") == "408"
    value = await safe._process_headers(b"NATS/1.0\r\nKey: \xff\r\n\r\n")  # a value: replaced
    assert value is not None and safe._build_message(1, b"a.b", b"", b"x", value) is not None


def test_header_lines_parse_as_nats_py_parses_them() -> None:
    """Random header blocks, odd ones included (names with blanks, control characters or bytes
    that are not ASCII, no colon, empty lines, values that are not UTF-8): the same headers as
    the installed nats-py's parse."""
    rng = random.Random(27)
    pieces = [
        b"Content-Type",
        b"Nats-Msg-Id",
        b"a b",
        b"\tx",
        b"\x1fk",
        b"\xffn",
        b"",
        b":",
        b": ",
        b"value",
        b"\xfe\xff",
        b" v ",
        b"\x0bz",
        b"traceparent",
    ]
    for _ in range(3000):
        lines = []
        for _line in range(rng.randint(0, 5)):
            name = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 3)))
            sep = rng.choice([b":", b": ", b"", b":\t"])
            value = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 2)))
            lines.append(name + sep + value)
        raw = b"\r\n".join(lines) + rng.choice([b"", b"\r\n", b"\r\n\r\n"])
        assert SafeClient._parse_header_lines(raw) == Client._parse_header_lines(raw), raw
