"""Protocol v1 of the mesh: wire types, codec, subject names, error codes. Pure: no I/O."""

from protocol.codec import (
    RequestLimits,
    WireFormat,
    decode_event,
    decode_request,
    dump,
    dump_token,
    error_event,
    to_exception,
)
from protocol.errors import ErrorCode, MeshError
from protocol.messages import (
    PROTOCOL_VERSION,
    Answer,
    ChatMessage,
    EndEvent,
    ErrorEvent,
    InferRequest,
    RestartEvent,
    RouteDecision,
    Timings,
    TokenEvent,
    Usage,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Answer",
    "ChatMessage",
    "EndEvent",
    "ErrorCode",
    "ErrorEvent",
    "InferRequest",
    "MeshError",
    "RequestLimits",
    "RestartEvent",
    "RouteDecision",
    "Timings",
    "TokenEvent",
    "Usage",
    "WireFormat",
    "decode_event",
    "decode_request",
    "dump",
    "dump_token",
    "error_event",
    "to_exception",
]
