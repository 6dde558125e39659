"""Parse and check what a ZMQ client sends before anything uses it. Pure; no sockets.

Everything is untrusted. `read_envelope` scans the top-level map with msgpack's C scanner,
unpacking only op, req_id and api_key and skipping the body unbuilt, so a frame is refused
before it costs anything; `read_body` unpacks and checks the body, for frames that pass.
Errors raise `ProtocolError` with the req_id when one could be read.
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
# First bytes of msgpack values (the format's type codes): maps, and everything that is not a
# scalar (maps, arrays, bin, ext including timestamps).
_MAP_CODES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_COMPOUND_CODES = frozenset(
    [*range(0x80, 0xA0), *range(0xC4, 0xCA), *range(0xD4, 0xD9), *range(0xDC, 0xE0)]
)


class ProtocolError(ValueError):
    """A frame the frontend cannot serve. req_id: the request's id when it could be read."""

    def __init__(self, message: str, req_id: int | str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.req_id = req_id
        self.param = param


@dataclass(frozen=True)
class Skipped:
    """A value the envelope scan left unread: payload[start:end]."""

    start: int
    end: int


@dataclass(frozen=True)
class Envelope:
    """A frame's checked envelope; the body, if any, is payload[body.start:body.end], unread."""

    op: str  # one of OPS
    req_id: int | str
    api_key: str | None
    body: Skipped | None  # a msgpack map for "generate", None for "abort"


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


def _read_req_id(fields: dict) -> int | str:
    req_id = fields.get("req_id")
    if isinstance(req_id, bool) or not isinstance(req_id, (int, str)):
        raise ProtocolError("req_id must be an integer or a string", param="req_id")
    if isinstance(req_id, int) and not _INT64[0] <= req_id <= _INT64[1]:
        raise ProtocolError("req_id must fit in 64 bits", param="req_id")
    if isinstance(req_id, str) and not 0 < len(req_id) <= MAX_REQ_ID_LEN:
        raise ProtocolError(f"req_id must be 1 to {MAX_REQ_ID_LEN} characters", param="req_id")
    return req_id


class _TooManyFields(Exception):
    pass


def _scan_value(unpacker: msgpack.Unpacker, payload: bytes) -> Any:
    """The next value if it is a scalar, else a `Skipped` span (nothing built)."""
    start = unpacker.tell()
    if payload[start] in _COMPOUND_CODES:
        unpacker.skip()
        return Skipped(start, unpacker.tell())
    return unpacker.unpack()


def _scan_map(payload: bytes) -> dict[Any, Any]:
    """The top-level map's fields (see `_scan_value`); ProtocolError if it is none."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(payload), 1))
    unpacker.feed(payload)
    try:
        if not payload or payload[0] not in _MAP_CODES:
            unpacker.skip()  # a valid msgpack value that is not a map, or it raises
            fields = None
        else:
            fields = {}
            num_fields = unpacker.read_map_header()
            if num_fields > len(_ENVELOPE_KEYS):  # refused before a wide map costs anything
                raise _TooManyFields(num_fields)
            for _ in range(num_fields):
                key = _scan_value(unpacker, payload)
                fields[key] = _scan_value(unpacker, payload)
        if unpacker.tell() != len(payload):
            raise msgpack.ExtraData(None, None)
    except _TooManyFields as e:
        raise ProtocolError(
            f"a message has at most {len(_ENVELOPE_KEYS)} fields "
            f"({', '.join(sorted(_ENVELOPE_KEYS))}), not {e.args[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for corrupt input
        raise ProtocolError(f"not a msgpack message ({type(e).__name__})") from None
    if fields is None:
        raise ProtocolError("a message must be a map with op, req_id (and body)")
    return fields


def _field_name(key: Any) -> str:
    return "<list, map or bytes>" if isinstance(key, Skipped) else str(key)[:64]


def read_envelope(payload: bytes) -> Envelope:
    """The checked envelope of one client frame, or ProtocolError; builds no list or map."""
    fields = _scan_map(payload)
    req_id = _read_req_id(fields)
    unknown = sorted(_field_name(k) for k in fields if k not in _ENVELOPE_KEYS)
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0]!r}", req_id, unknown[0])
    op = fields.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"op must be one of {', '.join(OPS)}", req_id, "op")
    body = fields.get("body")
    if op == "generate":
        if not isinstance(body, Skipped) or payload[body.start] not in _MAP_CODES:
            raise ProtocolError("body must be a map with the /generate fields", req_id, "body")
    elif body is not None:
        raise ProtocolError(f"op {op} takes no body", req_id, "body")
    api_key = fields.get("api_key")
    if api_key is not None and (not isinstance(api_key, str) or len(api_key) > MAX_API_KEY_LEN):
        raise ProtocolError("api_key must be a string", req_id, "api_key")
    return Envelope(op, req_id, api_key, body)


def read_body(payload: bytes, envelope: Envelope) -> dict[str, Any]:
    """The checked /generate body of a frame whose envelope is `envelope` (op "generate")."""
    assert envelope.body is not None
    span = memoryview(payload)[envelope.body.start : envelope.body.end]
    try:
        body = msgpack.unpackb(span, raw=False, strict_map_key=False)
        check_plain(body)
    except ProtocolError as e:
        raise ProtocolError(e.message, envelope.req_id, "body") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for corrupt input
        raise ProtocolError(
            f"the body is not plain msgpack data ({type(e).__name__})", envelope.req_id, "body"
        ) from None
    return body


def parse_client_message(payload: bytes) -> ClientMessage:
    """The checked message in one client frame, or ProtocolError (see the module docstring)."""
    envelope = read_envelope(payload)
    body = read_body(payload, envelope) if envelope.op == "generate" else None
    return ClientMessage(envelope.op, envelope.req_id, body, envelope.api_key)
