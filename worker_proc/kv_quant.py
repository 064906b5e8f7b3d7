"""How stored KV is held (--kv-bits): as computed (float), or in MLX affine groups.

A `KVFormat` is one side's (keys' or values') storage: a float array `[..., dim]`, or
three arrays from `mx.quantize` along `dim` (the packed uint32 codes `[..., dim *
bits / 32]`, the groups' scales and biases `[..., dim / group]` in the float
dtype). Every store of KV (the pool, the window pool, the decode pages) holds each
side as the list of those arrays ("parts") and goes through `encode`/`decode`; the
decode pages attend to quantized parts with `mx.gather_qmm` (decode_pages.py).

Groups of 32 values by default (--kv-group-size 64 or 128 where the head dimension
allows): 8-bit is then 1.25 bytes a value with float32 scales and biases (3.2x
float32 KV), 1.125 with float16 ones (1.78x float16 KV; groups of 128: 1.94x).

Quantized heads are stored rotated: `x @ R`, R a fixed orthogonal matrix (`rotation`).
A few channels of a head's keys carry most of their magnitude, so in a group holding
one of them every other value gets a coarse step; rotated, each group's values are
mixed from all channels and have a like range. On the default model the rotation
cut 8-bit keys' rounding error by a quarter and the output's mean KL from float KV
from 1.9e-4 to 1.3e-4 (bench/kv_rounding.py). Attention needs no un-rotation of the
pages: q . k = (q R) . (k R), and sum p v = (sum p (v R)) R^T, so the decode pages
rotate the queries and the output (decode_pages.py), and `decode` un-rotates.
"""

import hashlib
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from mlxd.runtime.kv_layout import KV_GROUP, KV_GROUPS

KV_BITS = (4, 8)   # the widths --kv-bits takes (0: float)
GROUPS, GROUP = KV_GROUPS, KV_GROUP   # group sizes --kv-group-size takes, the default
ROTATION = "kv-rotation-1"   # names the rotation's sign flips: part of the stored format


def rotation_signs(dim: int) -> np.ndarray:
    """`dim` signs (+-1) from the bits of blake2b(ROTATION, dim): the same on every
    machine and numpy version (a stored entry depends on them)."""
    digest = b""
    while len(digest) * 8 < dim:
        digest += hashlib.blake2b(f"{ROTATION}/{dim}/{len(digest)}".encode()).digest()
    bits = np.unpackbits(np.frombuffer(digest, np.uint8))[:dim]
    return 1.0 - 2.0 * bits


@cache
def rotation(dim: int) -> mx.array:
    """A fixed orthogonal `[dim, dim]` float32 matrix: block-diagonal Walsh-Hadamard
    blocks (the largest power of two dividing `dim`; all of it for the usual 64 or 128)
    scaled to unit rows, rows' signs flipped by `rotation_signs`. Deterministic: its
    entries are +-1/sqrt(block) rounded to float32."""
    block = dim & -dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    r = np.kron(np.eye(dim // block), h / np.sqrt(block)) * rotation_signs(dim)[:, None]
    return mx.array(r.astype(np.float32))


@dataclass(frozen=True)
class KVFormat:
    dtype: mx.Dtype   # the computed KV's dtype (and the scales' and biases')
    bits: int = 0     # 0: float
    group: int = 0

    @classmethod
    def of(cls, dtype: mx.Dtype, bits: int, dim: int, group: int = GROUP) -> "KVFormat":
        """The format for `bits` (0: float) over a head dimension `dim` in groups of
        `group`; ValueError when they do not fit."""
        if not bits:
            return cls(dtype)
        if bits not in KV_BITS:
            raise ValueError(f"--kv-bits takes {', '.join(map(str, KV_BITS))} (or 0), not {bits}")
        if group not in GROUPS:
            raise ValueError(f"--kv-group-size takes {', '.join(map(str, GROUPS))}, not {group}")
        if dim % group:
            raise ValueError(f"--kv-bits in groups of {group} needs head dimensions divisible "
                             f"by {group} (this model's: {dim}; --kv-group-size 32 fits more)")
        return cls(dtype, bits, group)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def widths(self, dim: int) -> list[tuple[int, mx.Dtype]]:
        """Each part's last dimension and dtype, for a head dimension `dim`."""
        if not self.bits:
            return [(dim, self.dtype)]
        return [(dim * self.bits // 32, mx.uint32), (dim // self.group, self.dtype),
                (dim // self.group, self.dtype)]

    def token_bytes(self, dim: int) -> int:
        """Bytes one head's `dim` values take."""
        return sum(width * dtype.size for width, dtype in self.widths(dim))

    def zeros(self, lead: tuple[int, ...], dim: int) -> list[mx.array]:
        return [mx.zeros((*lead, width), dtype) for width, dtype in self.widths(dim)]

    def encode(self, x: mx.array) -> list[mx.array]:
        """`x [..., dim]` as stored."""
        return self.pack(self.basis(x))

    def basis(self, x: mx.array) -> mx.array:
        """`x [..., dim]` in the stored heads' basis (rotated where quantized), as the
        float dtype: what `pack` stores, and what a float tail holds (decode_pages)."""
        x = self.rotate(x)
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    def pack(self, x: mx.array) -> list[mx.array]:
        """`x` in the stored basis (`basis`) as stored."""
        if not self.bits:
            return [x]
        return list(mx.quantize(x, group_size=self.group, bits=self.bits))

    def decode(self, parts: list[mx.array]) -> mx.array:
        """The values `parts` hold (as the float dtype)."""
        if not self.bits:
            return parts[0]
        x = mx.dequantize(*parts, group_size=self.group, bits=self.bits)
        return self.rotate(x, back=True).astype(self.dtype)

    def rotate(self, x: mx.array, back: bool = False) -> mx.array:
        """`x [..., dim]` into the stored heads' basis (`back`: out of it), in float32;
        the identity for float formats."""
        if not self.bits:
            return x
        r = rotation(x.shape[-1])
        return x.astype(mx.float32) @ (r.T if back else r)

    def describe(self) -> str:
        return f"{self.bits}-bit (groups of {self.group}, {ROTATION})" if self.bits else "float"
