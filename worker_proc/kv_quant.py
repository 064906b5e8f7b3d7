"""How stored KV is held (--kv-bits): as computed (float), or in MLX affine groups.

A `KVFormat` is one side's (keys' or values') storage: a float array `[..., dim]`, or
three arrays from `mx.quantize` along `dim` (the packed uint32 codes `[..., dim *
bits / 32]`, the groups' scales and biases `[..., dim / group]` in the float
dtype). Every store of KV (the pool, the window pool, the decode pages) holds each
side as the list of those arrays ("parts") and goes through `encode`/`decode`; the
decode pages attend to quantized parts with `mx.gather_qmm` (decode_pages.py). The
group is the largest of 128, 64, 32 that divides the head dimension: larger groups
carry fewer scales (8-bit in groups of 64 is 1.125 bytes a value with float32
scales, 1.0625 with float16).
"""

from dataclasses import dataclass

import mlx.core as mx

KV_BITS = (4, 8)   # the widths --kv-bits takes (0: float)
GROUPS = (128, 64, 32)


@dataclass(frozen=True)
class KVFormat:
    dtype: mx.Dtype   # the computed KV's dtype (and the scales' and biases')
    bits: int = 0     # 0: float
    group: int = 0

    @classmethod
    def of(cls, dtype: mx.Dtype, bits: int, dim: int) -> "KVFormat":
        """The format for `bits` (0: float) over a head dimension `dim`; ValueError
        when `dim` takes no group."""
        if not bits:
            return cls(dtype)
        if bits not in KV_BITS:
            raise ValueError(f"--kv-bits takes {', '.join(map(str, KV_BITS))} (or 0), not {bits}")
        group = next((g for g in GROUPS if dim % g == 0), 0)
        if not group:
            raise ValueError(f"--kv-bits needs head dimensions divisible by 32 (this "
                             f"model's: {dim})")
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
        x = x if x.dtype == self.dtype else x.astype(self.dtype)
        if not self.bits:
            return [x]
        return list(mx.quantize(x, group_size=self.group, bits=self.bits))

    def decode(self, parts: list[mx.array]) -> mx.array:
        """The values `parts` hold (as the float dtype)."""
        if not self.bits:
            return parts[0]
        return mx.dequantize(*parts, group_size=self.group, bits=self.bits).astype(self.dtype)

    def describe(self) -> str:
        return f"{self.bits}-bit (groups of {self.group})" if self.bits else "float"
