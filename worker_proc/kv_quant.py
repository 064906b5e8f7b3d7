"""How stored KV is held (--kv-bits): as computed (float), or in MLX affine groups.

A `KVFormat` is one side's (keys' or values') storage: a float array `[..., dim]`, or
three arrays from `mx.quantize` along `dim` (the packed uint32 codes `[..., dim *
bits / 32]`, the groups' scales and biases `[..., dim / group]` in the float
dtype). Every store of KV (the pool, the window pool, the decode pages) holds each
side as the list of those arrays ("parts") and goes through `encode`/`decode`; the
decode pages attend to quantized parts with `mx.gather_qmm` (decode_pages.py).

Groups of 32 values: 8-bit is then 1.25 bytes a value with float32 scales and biases
(3.2x float32 KV), 1.125 with float16 ones (1.78x float16 KV). Larger groups hold
more tokens but agree less: on the default model (32 chats x 128 greedy tokens), 8-bit
in groups of 64 left float KV's output after a median of 41 tokens, in groups of 32
after 112 (bench/kv_bits.py).
"""

from dataclasses import dataclass

import mlx.core as mx

KV_BITS = (4, 8)   # the widths --kv-bits takes (0: float)
GROUP = 32   # values per scale and bias (see the module's docstring)


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
        if dim % GROUP:
            raise ValueError(f"--kv-bits needs head dimensions divisible by {GROUP} (this "
                             f"model's: {dim})")
        return cls(dtype, bits, GROUP)

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
