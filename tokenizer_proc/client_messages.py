"""Parse and check what a ZMQ client sends before anything uses it. Pure; no sockets.

A client frame must be one msgpack map `{"op": str, "req_id": int | str, "body": map,
"api_key": str}` (body only for "generate"; api_key when the server has one). Everything is
untrusted: the payload may be any bytes, any msgpack value (ext types, timestamps, maps with
non-string keys, nesting up to msgpack's own limit), or a well-formed envelope with fields of
the wrong type or size. `parse_client_message` either
returns a `ClientMessage` whose fields have the documented types, or raises `ProtocolError`
carrying the req_id when one could be read (so the error reply can name the request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

OPS = ("generate", "abort")
MAX_REQ_ID_LEN = 256  # characters of a string req_id
MAX_DEPTH = 8  # nesting of maps and lists inside a message (a /generate body needs 5)
_INT64 = (-(2**63), 2**63 - 1)
_ENVELOPE_KEYS = frozenset({"op", "req_id", "body", "api_key"})
MAX_API_KEY_LEN = 1024


class ProtocolError(ValueError):
    """A frame the frontend cannot serve. req_id: the request's id when it could be read."""

    def __init__(self, message: str, req_id: int | str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.req_id = req_id
        self.param = param


@dataclass(frozen=True)
class ClientMessage:
    op: str  # one of OPS
    req_id: int | str  # scoped to the client connection
    body: dict[str, Any] | None  # the /generate body (plain data), for op "generate"
    api_key: str | None = None


def check_plain(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise ProtocolError unless value is plain data: None, bool, int (int64), float, str,
    lists and maps with str keys, nested at most max_depth deep. Iterative (no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, (bool, float, str)):
            continue
        if isinstance(item, int):
            if not _INT64[0] <= item <= _INT64[1]:
                raise ProtocolError(f"integer {item} is outside the 64-bit signed range")
            continue
        if isinstance(item, (list, dict)):
            if depth >= max_depth:
                raise ProtocolError(f"the message is nested more than {max_depth} levels deep")
            if isinstance(item, dict):
                if not all(isinstance(k, str) for k in item):
                    raise ProtocolError("map keys must be strings")
                items = item.values()
            else:
                items = item
            stack.extend((child, depth + 1) for child in items)
            continue
        raise ProtocolError(f"unsupported value of type {type(item).__name__} in the message")


def _read_req_id(envelope: dict) -> int | str:
    req_id = envelope.get("req_id")
    if isinstance(req_id, bool) or not isinstance(req_id, (int, str)):
        raise ProtocolError("req_id must be an integer or a string", param="req_id")
    if isinstance(req_id, int) and not _INT64[0] <= req_id <= _INT64[1]:
        raise ProtocolError("req_id must fit in 64 bits", param="req_id")
    if isinstance(req_id, str) and not 0 < len(req_id) <= MAX_REQ_ID_LEN:
        raise ProtocolError(f"req_id must be 1 to {MAX_REQ_ID_LEN} characters", param="req_id")
    return req_id


def parse_client_message(payload: bytes) -> ClientMessage:
    """The checked message in one client frame, or ProtocolError (see the module docstring)."""
    try:
        envelope = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for corrupt input
        raise ProtocolError(f"not a msgpack message ({type(e).__name__})") from None
    if not isinstance(envelope, dict):
        raise ProtocolError("a message must be a map with op, req_id (and body)")
    req_id = _read_req_id(envelope)
    unknown = sorted(str(k) for k in envelope if k not in _ENVELOPE_KEYS)
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0][:64]!r}", req_id, unknown[0][:64])
    op = envelope.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"op must be one of {', '.join(OPS)}", req_id, "op")
    body = envelope.get("body")
    if op == "generate":
        if not isinstance(body, dict):
            raise ProtocolError("body must be a map with the /generate fields", req_id, "body")
        try:
            check_plain(body)
        except ProtocolError as e:
            raise ProtocolError(e.message, req_id, "body") from None
    elif body is not None:
        raise ProtocolError(f"op {op} takes no body", req_id, "body")
    api_key = envelope.get("api_key")
    if api_key is not None and (not isinstance(api_key, str) or len(api_key) > MAX_API_KEY_LEN):
        raise ProtocolError("api_key must be a string", req_id, "api_key")
    return ClientMessage(op, req_id, body if op == "generate" else None, api_key)
