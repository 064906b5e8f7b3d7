"""The one codec: msgpack frames `[TAG, field, field, ...]`.

Each message class declares an integer TAG and its fields (protocol/message.py
derives `to_wire()` / `from_wire()` from them); a `Decoder` per socket accepts
only the classes that socket may carry, so bad input fails here, at the
boundary, as a ProtocolError.
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
