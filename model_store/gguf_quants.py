"""GGML tensors in MLX's forms: exact wherever MLX has one.

An affine type's block decodes to codes q and, per group of 32 elements, a float32
scale and bias with w = scale * q + bias: MLX's affine quantization. Each product
(a float16 scale times a small integer, at most 24 significant bits) and each sum
(a value the block itself represents) is exact in float32, so `mx.dequantize` gives
`gguf.quants.dequantize`'s values bit for bit. MXFP4 is MLX's `mxfp4` mode as is.
The types with 16-element sub-blocks (Q2_K, Q3_K, Q6_K) and every other type
`gguf.quants` can decode become float32 (exact), or, if asked, 8-bit affine groups
of 32 re-quantized from those values (relative RMS error ~4e-3).
"""

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

GROUP = 32
INEXACT_FORMS = ("float32", "q8")   # for types with no exact MLX form; the first is the default
_IQ4 = np.array(quants.IQ4_NL.kvalues, dtype=np.int16)


class QuantError(ValueError):
    """A tensor whose type nothing here can read."""


@dataclass(frozen=True)
class Form:
    """How one GGML type is kept: `kind` is affine, mxfp4 or a float dtype."""

    kind: str
    bits: int = 0
    exact: bool = True

    def record(self) -> dict:
        quantized = {"bits": self.bits, "group_size": GROUP} if self.bits else {}
        return {"form": self.kind, **quantized, "exact": self.exact}

    def quantization(self) -> dict | None:
        """The module's entry in mlx_lm's "quantization" config (None: not quantized)."""
        if not self.bits:
            return None
        return {"group_size": GROUP, "bits": self.bits,
                "mode": "affine" if self.kind == "affine" else self.kind}


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([b & 0xF, b >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit i of the block's little-endian uint32 is element i's fifth bit."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b):
    return _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    d = _f16(b, 0)
    return (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d


def _k_scales(b):
    """Q4_K/Q5_K: the 8 sub-blocks' scale d*sc and bias -dmin*m."""
    sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * m.astype(np.float32))


def _q4_k(b):
    scale, bias = _k_scales(b)
    return _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 256), scale, bias


def _q5_k(b):
    scale, bias = _k_scales(b)
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return (low | (high << 4)).reshape(-1, 256), scale, bias


def _iq4_nl(b):
    d = _f16(b, 0)
    return (_IQ4[_nibbles(b[:, 2:18])] + 128).astype(np.uint8), d, -128 * d


def _iq4_xs(b):
    high = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16)
            >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = np.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], axis=-1).reshape(-1, 8)
    scale = _f16(b, 0) * ((low | (high << 4)).astype(np.float32) - 32)
    codes = _nibbles(b[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 256)
    return (_IQ4[codes] + 128).astype(np.uint8), scale, -128 * scale


T = GGMLQuantizationType
AFFINE = {T.Q4_0: (4, _q4_0), T.Q4_1: (4, _q4_1), T.Q5_0: (5, _q5_0), T.Q5_1: (5, _q5_1),
          T.Q8_0: (8, _q8_0), T.Q4_K: (4, _q4_k), T.Q5_K: (5, _q5_k),
          T.IQ4_NL: (8, _iq4_nl), T.IQ4_XS: (8, _iq4_xs)}
FLOATS = {T.F32: "float32", T.F16: "float16", T.BF16: "bfloat16"}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes (rows, cols) as MLX packs them: a little-endian bit stream of uint32s."""
    groups = q.reshape(q.shape[0], -1, GROUP).astype(np.uint64)
    words = np.zeros((*groups.shape[:2], bits + 1), np.uint64)   # + 1: spill-over
    for i in range(GROUP):
        word, shift = divmod(i * bits, 32)
        value = groups[..., i] << np.uint64(shift)
        words[..., word] |= value & np.uint64(0xFFFFFFFF)
        words[..., word + 1] |= value >> np.uint64(32)
    return words[..., :bits].astype(np.uint32).reshape(q.shape[0], -1)


def form_of(qtype, ndim: int, inexact: str) -> Form:
    """The form a tensor of `qtype` is kept in. Only matrices and stacks of them
    (MoE experts) are kept quantized."""
    matrix = ndim in (2, 3)
    if qtype in FLOATS:
        return Form(FLOATS[qtype])
    if matrix and qtype in AFFINE:
        return Form("affine", AFFINE[qtype][0])
    if matrix and qtype == T.MXFP4:
        return Form("mxfp4", 4)
    if qtype in AFFINE or qtype == T.MXFP4 or inexact == "float32" or not matrix:
        return Form("float32")
    return Form("affine", 8, exact=False)


def to_mlx(name: str, data: np.ndarray, qtype, shape: tuple, inexact: str) -> tuple[dict, Form]:
    """The tensor `name` (GGUF bytes or values `data`, numpy `shape`) as MLX arrays:
    {"weight"} or {"weight", "scales"[, "biases"]}, and the form chosen."""
    import mlx.core as mx

    form = form_of(qtype, len(shape), inexact)
    if qtype in FLOATS:
        if qtype == T.BF16:
            return {"weight": mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)}, form
        return {"weight": mx.array(data.reshape(shape))}, form
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    rows, out = (-1, shape[-1]), (*shape[:-1], -1)
    if form.kind == "affine" and form.exact:
        q, scales, biases = AFFINE[qtype][1](blocks)
        return {"weight": mx.array(pack(q.reshape(rows), form.bits).reshape(out)),
                "scales": mx.array(scales.reshape(out)),
                "biases": mx.array(biases.reshape(out))}, form
    if form.kind == "mxfp4":
        codes = _nibbles(blocks[:, 1:17]).reshape(rows)
        return {"weight": mx.array(pack(codes, 4).reshape(out)),
                "scales": mx.array(np.ascontiguousarray(blocks[:, 0]).reshape(out))}, form
    try:
        values = quants.dequantize(blocks, qtype).reshape(shape)
    except NotImplementedError:
        raise QuantError(f"tensor {name!r} has GGML type {qtype.name}, which has no MLX "
                         "form and no dequantizer in the gguf package") from None
    if form.kind == "float32":
        return {"weight": mx.array(values)}, form
    weight, scales, biases = mx.quantize(mx.array(values), group_size=GROUP, bits=8)
    return {"weight": weight, "scales": scales, "biases": biases}, form
