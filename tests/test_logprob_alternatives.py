"""An engine's top logprob alternative that is half a character (review S18f of this stop's
fixes). The test failed on dd35144: its docstring says what a user saw then."""

from __future__ import annotations

import functools
import json
import time

from aiohttp import web
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from mesh.backends.base import openai_logprobs
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.queue import publish_request
from protocol.codec import decode_event
from protocol.messages import EndEvent, ErrorEvent, InferRequest, TokenEvent
from protocol.subjects import DEFAULT_SCOPE, token_subject
from tests.conftest import make_settings
from tests.helpers import chat_backend, chat_server, eventually, holds


async def _got(events: list[object], msg: Msg) -> None:
    events.append(decode_event(msg.data, msg.headers))


# -- 1. an engine's top alternative that is half a character ------------------------------------


def _lp_event(text: str, token: str, alternative: str) -> bytes:
    """A chat delta with logprobs: the chosen token and one top alternative, as JSON escapes
    them (an engine that detokenizes one token at a time may cut an emoji's UTF-16 pair)."""
    event = {
        "choices": [
            {
                "index": 0,
                "delta": {"content": text},
                "logprobs": {
                    "content": [
                        {
                            "token": token,
                            "logprob": -0.1,
                            "bytes": [240, 159],
                            "top_logprobs": [
                                {"token": token, "logprob": -0.1, "bytes": [240, 159]},
                                {"token": alternative, "logprob": -2.5, "bytes": [240, 159]},
                            ],
                        }
                    ]
                },
                "finish_reason": None,
            }
        ]
    }
    return json.dumps(event).encode()  # ensure_ascii: "\ud83d" as the escape an engine writes


async def test_a_top_alternative_that_is_half_an_emoji_does_not_fail_the_answer(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """Before the fix (first rule / typed). openai_logprobs passed the chosen token through
    ``whole()`` (a lone surrogate becomes U+FFFD: "an answer streamed with its logprobs
    failed") but not the tokens of ``top_logprobs``. An engine whose alternative is half an
    emoji (the same cut the chosen token is guarded against) gave a TokenLogprob.top holding
    '\\ud83d'; the worker's msgpack encoder then raised UnicodeEncodeError on every delivery,
    and the client got max_deliveries after about 2 s instead of its answer. Now the
    alternatives go through ``whole()`` too (chat and completions formats)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in (_lp_event("Hi", "Hi", "\ud83d"), _lp_event(" there", " there", " t")):
            await response.write(b"data: " + data + b"\n\n")
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await response.write(b"data: " + json.dumps(end).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    settings = make_settings(nats_server.url)
    async with chat_server(chat) as base:
        backend = chat_backend(settings.worker.model.name, base)
        await backend.start()
        try:
            events: list[object] = []
            sub = await conn.nc.subscribe(
                token_subject(DEFAULT_SCOPE, "lp-1"),
                cb=functools.partial(_got, events),
            )
            request = InferRequest(
                id="lp-1",
                prompt="hi",
                model=settings.worker.model.name,
                max_tokens=8,
                logprobs=True,
                top_logprobs=2,
                deadline=time.time() + 8,
            )
            async with (
                Connection(settings.nats, "worker") as wconn,
                Worker(settings, wconn, backend),
            ):
                await publish_request(conn, settings.stream, request, scope=DEFAULT_SCOPE)
                await eventually(
                    lambda: holds(any(isinstance(e, (EndEvent, ErrorEvent)) for e in events)),
                    6,
                    "the answer's end or its error",
                )
            await sub.unsubscribe()
            errors = [e for e in events if isinstance(e, ErrorEvent)]
            assert not errors, (
                f"an answer whose top alternative is half an emoji failed: {errors[0].code}: "
                f"{errors[0].message}"
            )
            text = "".join(e.text for e in events if isinstance(e, TokenEvent))
            assert text == "Hi there"
        finally:
            await backend.close()


def test_alternatives_half_a_character_read_as_a_replacement_in_both_formats() -> None:
    """The same in the completions API's format (alternatives as a map) and chat's, by hand."""
    completions = openai_logprobs(
        {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"\ud83d": -2.0, "a": -0.1}]},
        chat=False,
        top=2,
    )
    assert completions[0].top == [("\ufffd", -2.0), ("a", -0.1)]
    chat = openai_logprobs(
        {
            "content": [
                {
                    "token": "a",
                    "logprob": -0.1,
                    "top_logprobs": [{"token": "\ude00", "logprob": -3.0}],
                }
            ]
        },
        chat=True,
        top=1,
    )
    assert chat[0].top == [("\ufffd", -3.0)]
