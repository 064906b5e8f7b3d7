"""The one codec: msgpack frames `[TAG, field, field, ...]`.

Each message class declares an integer TAG and explicit `to_wire()` /
`from_wire()`; a `Decoder` per socket accepts only the classes that socket
may carry, so bad input fails here, at the boundary, as a ProtocolError.
"""

import msgpack

MAX_FRAME_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message. `rid` is set when it could be read."""

    def __init__(self, message: str, rid=None):
        super().__init__(message)
        self.rid = rid


def encode(msg) -> bytes:
    return msgpack.packb([msg.TAG, *msg.to_wire()], use_bin_type=True)


class Decoder:
    def __init__(self, *classes):
        self._by_tag = {cls.TAG: cls for cls in classes}

    def decode(self, frame: bytes):
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"not a msgpack frame: {exc}") from None
        if not isinstance(obj, list) or not obj or type(obj[0]) is not int:
            raise ProtocolError("frame is not a [tag, ...] list")
        cls = self._by_tag.get(obj[0])
        if cls is None:
            raise ProtocolError(f"unexpected message tag {obj[0]}")
        return cls.from_wire(obj[1:])


# ---- field validation helpers, used by from_wire() -------------------------

def expect_len(fields: list, n: int, name: str) -> None:
    if len(fields) != n:
        raise ProtocolError(f"{name}: expected {n} fields, got {len(fields)}")


def expect_int(value, name: str, minimum: int | None = None) -> int:
    if type(value) is not int:
        raise ProtocolError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{name} must be >= {minimum}, got {value}")
    return value


def expect_float(value, name: str) -> float:
    if type(value) not in (int, float):
        raise ProtocolError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def expect_str(value, name: str) -> str:
    if type(value) is not str:
        raise ProtocolError(f"{name} must be a string, got {type(value).__name__}")
    return value


def expect_bool(value, name: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def expect_list(value, name: str) -> list:
    if type(value) is not list:
        raise ProtocolError(f"{name} must be a list, got {type(value).__name__}")
    return value


def expect_dict(value, name: str) -> dict:
    if type(value) is not dict:
        raise ProtocolError(f"{name} must be a map, got {type(value).__name__}")
    return value


def expect_int_list(value, name: str) -> list[int]:
    expect_list(value, name)
    for x in value:
        if type(x) is not int:
            raise ProtocolError(f"{name} must hold ints only")
    return value


def expect_float_list(value, name: str) -> list[float]:
    expect_list(value, name)
    for x in value:
        if type(x) not in (int, float):
            raise ProtocolError(f"{name} must hold numbers only")
    return value


def optional(check, value, name: str):
    return None if value is None else check(value, name)
