"""The Python client SDK.

    async with MeshClient("nats://127.0.0.1:4222") as client:
        async for event in client.stream("Why is the sky blue?"):
            if isinstance(event, TokenEvent):
                print(event.text, end="")
        answer = await client.complete("2+2?", via="cloud")

``via="edge"`` (default) asks an edge node, which routes; ``via="cloud"`` queues the request
for the worker pool directly. Errors arrive as typed :class:`protocol.errors.MeshError`s.
Leaving a stream early (break, cancel) cancels the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors
from pydantic import ValidationError

from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.events import read_events
from mesh.lifecycle import Lifecycle
from mesh.provision import model_is_served
from mesh.queue import CANCELLER_HEADER, CloudCall
from protocol.codec import CONTENT_TYPE, WireFormat, dump, invalid_request_error
from protocol.errors import MeshError, MeshTimeoutError, UnknownModelError
from protocol.messages import (
    ChatMessage,
    EndEvent,
    InferRequest,
    RestartEvent,
    RouteChoice,
    TokenEvent,
)
from protocol.subjects import cancel_subject, edge_infer_subject

Via = Literal["edge", "cloud"]
StreamItem = TokenEvent | RestartEvent | EndEvent


@dataclass
class Completion:
    """A whole answer: its text and the end message (path, routing, usage, timings)."""

    text: str
    end: EndEvent
    restarts: int = 0
    events: list[StreamItem] = field(default_factory=list, repr=False)

    @property
    def path(self) -> str:
        return self.end.path


class MeshClient(Lifecycle):
    def __init__(
        self,
        nats_url: str | None = None,
        *,
        edge_id: str | None = None,
        settings: MeshSettings | None = None,
        connection: Connection | None = None,
        first_event_timeout: float = 60.0,
        idle_timeout: float = 60.0,
    ) -> None:
        overrides: dict[tuple[str, ...], Any] = {
            ("nats", "url"): nats_url,
            ("edge", "edge_id"): edge_id,
        }
        self.settings = settings or load_settings(overrides)
        if settings is not None and nats_url is not None:
            self.settings.nats.url = nats_url
        self.edge_id = edge_id or self.settings.edge.edge_id
        self.first_event_timeout = first_event_timeout
        self.idle_timeout = idle_timeout
        self._own_conn = connection is None
        self.conn = connection or Connection(self.settings.nats, "mesh-client")

    async def connect(self) -> MeshClient:
        if self._own_conn:
            await self.conn.connect()
        return self

    async def close(self) -> None:
        if self._own_conn:
            await self.conn.close()

    def build_request(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | list[ChatMessage] | None = None,
        **fields: Any,
    ) -> InferRequest:
        """Validate a request client-side; :class:`InvalidRequestError` names the bad field."""
        data = {k: v for k, v in fields.items() if v is not None}
        try:
            return InferRequest.model_validate({"prompt": prompt, "messages": messages, **data})
        except ValidationError as exc:
            raise invalid_request_error(exc, data.get("id")) from None

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | list[ChatMessage] | None = None,
        via: Via = "edge",
        route: RouteChoice = "auto",
        model: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 1.0,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """Token events (and a restart event if a worker died mid-answer), then the end.

        ``deadline`` is absolute (Unix seconds): a request past it is never started, and an
        edge answers locally when too little time is left for the cloud.
        """
        request = self.build_request(
            prompt,
            messages=messages,
            route=route,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            deadline=deadline,
            id=request_id,
            stream=True,
            origin="sdk",
        )
        source = self._via_cloud(request) if via == "cloud" else self._via_edge(request)
        async with contextlib.aclosing(source):
            async for event in source:
                yield event

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole answer at once (a restart drops the text gathered before it)."""
        parts: list[str] = []
        events: list[StreamItem] = []
        restarts = 0
        async for event in self.stream(prompt, **kwargs):
            events.append(event)
            if isinstance(event, TokenEvent):
                parts.append(event.text)
            elif isinstance(event, RestartEvent):
                parts.clear()
                restarts += 1
            else:
                return Completion(text="".join(parts), end=event, restarts=restarts, events=events)
        raise RuntimeError("stream ended without an end event")  # read_events guarantees one

    async def _via_edge(self, request: InferRequest) -> AsyncGenerator[StreamItem, None]:
        nc = self.conn.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        finished = False
        try:
            await nc.publish(
                edge_infer_subject(self.edge_id),
                dump(request, WireFormat.MSGPACK),
                reply=inbox,
                headers={CONTENT_TYPE: WireFormat.MSGPACK.content_type},
            )
            events = read_events(
                sub,
                first_timeout=self.first_event_timeout,
                idle_timeout=self.idle_timeout,
                what=f"edge {self.edge_id!r}",
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, EndEvent):
                        finished = True
                    yield event
            finished = True
        except MeshTimeoutError:
            raise  # the edge may still be at it: the finally cancels
        except MeshError:
            finished = True  # the edge answered with an error: nothing left to cancel
            raise
        finally:
            if not finished:
                with contextlib.suppress(nats.errors.Error):
                    await nc.publish(
                        cancel_subject(request.id), b"", headers={CANCELLER_HEADER: "sdk"}
                    )
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _via_cloud(self, request: InferRequest) -> AsyncGenerator[StreamItem, None]:
        model = request.model or self.settings.edge.cloud_model
        if not await model_is_served(self.conn.jsm(), self.settings.stream, model):
            raise UnknownModelError(f"no worker pool serves model {model!r}", request_id=request.id)
        request = request.model_copy(update={"model": model})
        finished = False
        async with CloudCall(self.conn, self.settings.stream, request, canceller="sdk") as call:
            try:
                events = call.events(
                    first_timeout=self.first_event_timeout, idle_timeout=self.idle_timeout
                )
                async with contextlib.aclosing(events):
                    async for event in events:
                        if isinstance(event, EndEvent):
                            finished = True
                        yield event
            finally:
                if not finished:
                    await call.withdraw()

    start = connect
    stop = close
