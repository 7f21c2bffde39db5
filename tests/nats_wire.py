"""A minimal NATS client speaking the text protocol the way the `nats` CLI does.

No nats-py here on purpose: these bytes are what `nats req SUBJECT 'payload'` sends (a SUB on a
fresh inbox, then PUB or HPUB with that inbox as the reply subject), so the tests prove the mesh
answers the real CLI, not our own SDK.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class WireMsg:
    subject: str
    reply: str | None
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.data)


class RawNatsClient:
    def __init__(self) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sid = 0
        self.info: dict = {}  # type: ignore[type-arg]

    async def connect(self, url: str, timeout: float = 5.0) -> RawNatsClient:
        parsed = urlparse(url)
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(parsed.hostname, parsed.port), timeout
        )
        line = await asyncio.wait_for(self._reader.readline(), timeout)
        assert line.startswith(b"INFO "), line
        self.info = json.loads(line[5:])
        connect = {
            "verbose": False,
            "pedantic": False,
            "headers": True,
            "no_responders": True,
            "protocol": 1,
            "name": "nats-cli-like",
            "lang": "raw",
            "version": "0",
        }
        await self._send(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        reply = await asyncio.wait_for(self._reader.readline(), timeout)
        assert reply.strip() == b"PONG", reply
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()

    async def _send(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.write(data)
        await self._writer.drain()

    async def subscribe(self, subject: str) -> int:
        self._sid += 1
        await self._send(f"SUB {subject} {self._sid}\r\n".encode())
        return self._sid

    async def publish(
        self,
        subject: str,
        payload: bytes,
        reply: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        reply_part = f" {reply}" if reply else ""
        if headers:
            head = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            hbytes = head.encode()
            total = len(hbytes) + len(payload)
            await self._send(
                f"HPUB {subject}{reply_part} {len(hbytes)} {total}\r\n".encode()
                + hbytes
                + payload
                + b"\r\n"
            )
        else:
            await self._send(
                f"PUB {subject}{reply_part} {len(payload)}\r\n".encode() + payload + b"\r\n"
            )
        await self._send(b"PING\r\n")  # like the CLI, make sure the server has it

    async def next_msg(self, timeout: float) -> WireMsg:
        assert self._reader is not None
        while True:
            line = (
                (await asyncio.wait_for(self._reader.readline(), timeout)).decode().rstrip("\r\n")
            )
            op, *args = line.split(" ")
            if op == "PING":
                await self._send(b"PONG\r\n")
            elif op in ("PONG", "+OK", ""):
                continue
            elif op == "-ERR":
                raise RuntimeError(line)
            elif op == "MSG":
                subject, _sid, *rest = args
                reply, size = (rest[0], int(rest[1])) if len(rest) == 2 else (None, int(rest[0]))
                data = await self._reader.readexactly(size + 2)
                return WireMsg(subject, reply, data[:-2])
            elif op == "HMSG":
                subject, _sid, *rest = args
                reply = rest[0] if len(rest) == 3 else None
                hsize, total = int(rest[-2]), int(rest[-1])
                raw = await self._reader.readexactly(total + 2)
                head, data = raw[:hsize].decode(), raw[hsize:total]
                headers = {}
                for hline in head.split("\r\n")[1:]:
                    if ":" in hline:
                        key, value = hline.split(":", 1)
                        headers[key.strip()] = value.strip()
                status = head.split("\r\n")[0].split(" ")
                if len(status) > 1:
                    headers["Status"] = status[1]
                return WireMsg(subject, reply, data, headers)

    async def request(
        self,
        subject: str,
        payload: bytes,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> WireMsg:
        """What `nats req SUBJECT PAYLOAD` does: one reply on a fresh inbox."""
        inbox = f"_INBOX.{secrets.token_hex(8)}"
        await self.subscribe(inbox)
        await self.publish(subject, payload, reply=inbox, headers=headers)
        return await self.next_msg(timeout)
