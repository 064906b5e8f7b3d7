"""A minimal GGUF (v3) writer for tests: F32, F16, Q4_0, Q4_1 and Q8_0 tensors.

Quantization follows the GGML reference block formats (32 values per block,
fp16 scales); `quantize` also returns the values a reader must decode to.
"""

import struct

import numpy as np

BLOCK = 32
GGML_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
ALIGNMENT = 32

# metadata value types
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


def _f16(x):
    return np.asarray(x, dtype=np.float16)


def _q4_0(block: np.ndarray):
    peak = block[np.argmax(np.abs(block))]
    d = _f16(peak / -8)
    inv = 1.0 / np.float32(peak / -8) if peak != 0 else 0.0
    q = np.minimum(15, np.trunc(block * inv + 8.5)).astype(np.uint8)
    packed = q[:16] | (q[16:] << 4)
    return d.tobytes() + packed.tobytes(), (q.astype(np.float32) - 8) * np.float32(d)


def _q4_1(block: np.ndarray):
    lo, hi = block.min(), block.max()
    d, m = _f16((hi - lo) / 15), _f16(lo)
    inv = 1.0 / np.float32((hi - lo) / 15) if hi != lo else 0.0
    q = np.minimum(15, np.trunc((block - lo) * inv + 0.5)).astype(np.uint8)
    packed = q[:16] | (q[16:] << 4)
    return (d.tobytes() + m.tobytes() + packed.tobytes(),
            q.astype(np.float32) * np.float32(d) + np.float32(m))


def _q8_0(block: np.ndarray):
    amax = np.abs(block).max()
    d = _f16(amax / 127)
    inv = 127.0 / amax if amax != 0 else 0.0
    q = np.round(block * inv).astype(np.int8)
    return d.tobytes() + q.tobytes(), q.astype(np.float32) * np.float32(d)


BLOCK_QUANTIZERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0}


def quantize(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """Raw tensor bytes in `kind`, and the float32 values they decode to."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if kind == "F32":
        return x.tobytes(), x
    if kind == "F16":
        h = x.astype(np.float16)
        return h.tobytes(), h.astype(np.float32)
    blocks = x.reshape(-1, BLOCK)
    raw, values = zip(*(BLOCK_QUANTIZERS[kind](b) for b in blocks))
    return b"".join(raw), np.concatenate(values).reshape(x.shape)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, bool):
        return BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        return (UINT32, struct.pack("<I", v)) if v >= 0 else (INT32, struct.pack("<i", v))
    if isinstance(v, float):
        return FLOAT32, struct.pack("<f", v)
    if isinstance(v, str):
        return STRING, _string(v)
    if isinstance(v, list):
        if all(isinstance(e, str) for e in v):
            return ARRAY, struct.pack("<IQ", STRING, len(v)) + b"".join(map(_string, v))
        return ARRAY, struct.pack("<IQ", INT32, len(v)) + b"".join(
            struct.pack("<i", e) for e in v)
    raise TypeError(f"no GGUF type for {v!r}")


def write_gguf(path, tensors: dict, metadata: dict) -> dict[str, np.ndarray]:
    """`tensors`: name -> (array, kind). Returns name -> the decoded float32 values."""
    header = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, value in metadata.items():
        vtype, payload = _value(value)
        header += [_string(key), struct.pack("<I", vtype), payload]
    data, decoded, offset = [], {}, 0
    for name, (array, kind) in tensors.items():
        raw, decoded[name] = quantize(array, kind)
        dims = array.shape[::-1]   # GGUF lists the innermost dimension first
        header += [_string(name), struct.pack("<I", len(dims)),
                   struct.pack(f"<{len(dims)}Q", *dims), struct.pack("<IQ", GGML_TYPE[kind], offset)]
        pad = (-len(raw)) % ALIGNMENT
        data.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = b"".join(header)
    head += b"\0" * ((-len(head)) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(head)
        f.write(b"".join(data))
    return decoded
