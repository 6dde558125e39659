"""msgpack codec for the messages in `aerie.messages`, with explicit type tags. Never pickle.

A message is a msgpack ext value (code 1) holding `[type_name, field...]`. Only the types in
`MESSAGE_TYPES` encode or decode (else `CodecError`); the registry is checked at import. Token
ids travel as raw little-endian int32 bytes, float arrays as little-endian float32.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np

from aerie.messages import MESSAGE_TYPES

_EXT_MESSAGE = 1
_SCALARS = (int, float, str, bool, bytes, type(None))


class CodecError(ValueError):
    """A message could not be encoded or decoded (unknown type, bad payload)."""


def _check_type(hint: Any, owner: str) -> None:
    origin = typing.get_origin(hint)
    if origin is None:
        if hint in _SCALARS or hint in _REGISTRY.values():
            return
        raise TypeError(f"{owner}: field type {hint!r} is not supported by the codec")
    if origin in (list, tuple):
        for arg in typing.get_args(hint):
            if arg is not Ellipsis:
                _check_type(arg, owner)
        return
    if origin is dict:
        key, value = typing.get_args(hint)
        if key is not str:
            raise TypeError(f"{owner}: dict keys must be str")
        _check_type(value, owner)
        return
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            _check_type(arg, owner)
        return
    raise TypeError(f"{owner}: field type {hint!r} is not supported by the codec")


def _build_registry(message_types: Iterable[type]) -> dict[str, type]:
    registry: dict[str, type] = {}
    for cls in message_types:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"{cls!r} must be a frozen dataclass")
        if cls.__name__ in registry:
            raise TypeError(f"duplicate message type name {cls.__name__}")
        registry[cls.__name__] = cls
    return registry


_REGISTRY: dict[str, type] = _build_registry(MESSAGE_TYPES)
_FIELDS: dict[type, tuple[str, ...]] = {}
for _cls in _REGISTRY.values():
    _hints = typing.get_type_hints(_cls, vars(sys.modules[_cls.__module__]))
    _FIELDS[_cls] = tuple(f.name for f in dataclasses.fields(_cls))
    for _name in _FIELDS[_cls]:
        _check_type(_hints[_name], f"{_cls.__name__}.{_name}")


def _default(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    if _REGISTRY.get(cls.__name__) is not cls:
        raise CodecError(f"cannot encode {cls.__name__}: not a registered message type")
    payload = [cls.__name__, *(getattr(obj, name) for name in _FIELDS[cls])]
    return msgpack.ExtType(_EXT_MESSAGE, _pack(payload))


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_MESSAGE:
        raise CodecError(f"unknown msgpack ext code {code}")
    name, *values = _unpack(data)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name!r}")
    num_fields = len(_FIELDS[cls])
    if len(values) != num_fields:
        raise CodecError(f"{name}: expected {num_fields} fields, got {len(values)}")
    return cls(*values)  # in field order, as _default wrote them (half the cost of keywords)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)


def encode(message: Any) -> bytes:
    """Encode one registered message. Raises CodecError for anything else."""
    if _REGISTRY.get(type(message).__name__) is not type(message):
        raise CodecError(f"cannot encode {type(message).__name__}: not a registered message")
    try:
        return _pack(message)
    except TypeError as e:
        raise CodecError(f"cannot encode {type(message).__name__}: {e}") from e


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode`. Raises CodecError for a payload that is not a message."""
    try:
        message = _unpack(data)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises several types for corrupt data
        raise CodecError(f"corrupt message: {e}") from e
    if type(message) not in _FIELDS:
        raise CodecError(f"payload is not a message: {type(message).__name__}")
    return message


def pack_ids(ids: Iterable[int] | np.ndarray) -> bytes:
    """int32 little-endian bytes of a token id sequence (list, numpy array or CPU tensor)."""
    if hasattr(ids, "numpy"):
        ids = ids.numpy()  # type: ignore[union-attr]
    return np.asarray(ids, dtype="<i4").tobytes()


# A short array (a decode step's few tokens) is read through memoryview where the machine's own
# int and float are little-endian 4-byte values: the same values, without numpy's call cost
# (about half a microsecond per call, paid for every delta of every request).
_SHORT_BYTES = 256
_NATIVE_LE32 = sys.byteorder == "little" and struct.calcsize("i") == struct.calcsize("f") == 4


def unpack_ids(data: bytes) -> list[int]:
    if _NATIVE_LE32 and len(data) <= _SHORT_BYTES and not len(data) % 4:
        return memoryview(data).cast("i").tolist()
    return np.frombuffer(data, dtype="<i4").tolist()


def unpack_ids_array(data: bytes) -> np.ndarray:
    """Read-only int32 numpy view of packed ids (no copy)."""
    return np.frombuffer(data, dtype="<i4")


def pack_floats(values: Iterable[float] | np.ndarray) -> bytes:
    if hasattr(values, "numpy"):
        values = values.numpy()  # type: ignore[union-attr]
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(data: bytes) -> list[float]:
    if _NATIVE_LE32 and len(data) <= _SHORT_BYTES and not len(data) % 4:
        return memoryview(data).cast("f").tolist()
    return np.frombuffer(data, dtype="<f4").tolist()
