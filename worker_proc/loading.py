"""Loading a model folder for serving, with optional dequantization."""

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .memory import ACTIVATION_RESERVE_BYTES

log = logging.getLogger(__name__)
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QUANTIZED) for _, m in model.named_modules())


def float32_bytes(model: nn.Module) -> int:
    """The bytes the model's weights take once dequantized to float32."""
    total = sum(4 * v.size for _, v in tree_flatten(model.parameters()))
    for _, module in model.named_modules():
        if isinstance(module, QUANTIZED):   # the packed codes and scales become weights
            packed = [module.weight, module.scales, getattr(module, "biases", None)]
            total += 4 * (module.weight.size * 32 // module.bits
                          - sum(a.size for a in packed if a is not None))
    return total


def resolve_dequantize(choice: str, weights_float32_bytes: int = 0,
                       memory_limit: int = 0) -> bool:
    """on/off as asked. auto: float32 on the CPU backend, where MLX's quantized
    matmuls are several times slower than float32 ones with an optimized BLAS, when
    the float32 weights and the activation reserve fit `memory_limit` (0: unchecked);
    quantized on Metal and CUDA, and on the CPU when float32 would not fit."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--dequantize must be auto, on or off, not {choice!r}")
    if choice != "auto":
        return choice == "on"
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    return on_cpu and (not memory_limit or
                       weights_float32_bytes + ACTIVATION_RESERVE_BYTES <= memory_limit)


def load_for_serving(path: str, choice: str, memory_limit: int):
    """(model, tokenizer, dequantized): the folder loaded, its weights' form chosen
    by `--dequantize` `choice` (resolve_dequantize) and logged with its cost."""
    from mlx_lm import load

    model, tokenizer = load(path)
    if not is_quantized(model):
        return model, tokenizer, False
    wide = float32_bytes(model)
    dequantize = resolve_dequantize(choice, wide, memory_limit)
    log.info("weights: %s (--dequantize %s; float32 would take %.0f MiB, the memory "
             "limit is %.0f MiB)", "float32" if dequantize else "quantized", choice,
             wide / 2**20, memory_limit / 2**20)
    return (_dequantized(model) if dequantize else model), tokenizer, dequantize


def load_model(path: str, dequantize: bool):
    """mlx_lm.load, then (if asked and quantized) dequantize; on the CPU backend
    the weights become float32, since half-precision matmuls are slow there."""
    from mlx_lm import load

    model, tokenizer = load(path)
    if dequantize and is_quantized(model):
        model = _dequantized(model)
    return model, tokenizer


def _dequantized(model: nn.Module) -> nn.Module:
    from mlx_lm.utils import dequantize_model

    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if on_cpu:
        _upcast_quantization_params(model)
    model = dequantize_model(model)
    if on_cpu:
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _upcast_quantization_params(model: nn.Module) -> None:
    """float32 scales and biases make dequantization exact: in float16, an affine
    `q * scale + bias` with a large bias (8-bit blocks) loses ~3 significant bits."""
    for _, module in model.named_modules():
        # mxfp4's scales are uint8 exponents, exact as they are, and it has no biases
        if isinstance(module, QUANTIZED) and module.mode == "affine":
            module.scales = module.scales.astype(mx.float32)
            module.biases = module.biases.astype(mx.float32)
