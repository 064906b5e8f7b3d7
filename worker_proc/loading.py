"""Loading a model folder for serving, with optional dequantization."""

import mlx.core as mx
import mlx.nn as nn


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
               for _, m in model.named_modules())


def resolve_dequantize(choice: str) -> bool:
    """auto: dequantize on the CPU backend, where MLX's quantized kernels are slow."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--dequantize must be auto, on or off, not {choice!r}")
    if choice == "auto":
        return mx.default_device().type == mx.DeviceType.cpu
    return choice == "on"


def load_model(path: str, dequantize: bool):
    """mlx_lm.load, then (if asked and quantized) dequantize; on the CPU backend
    the weights become float32, since half-precision matmuls are slow there."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, tokenizer = load(path)
    if dequantize and is_quantized(model):
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        if on_cpu:
            _upcast_quantization_params(model)
        model = dequantize_model(model)
        if on_cpu:
            model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return model, tokenizer


def _upcast_quantization_params(model: nn.Module) -> None:
    """float32 scales and biases make dequantization exact: in float16, an affine
    `q * scale + bias` with a large bias (8-bit blocks) loses ~3 significant bits."""
    for _, module in model.named_modules():
        # mxfp4's scales are uint8 exponents, exact as they are, and it has no biases
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and \
                module.mode == "affine":
            module.scales = module.scales.astype(mx.float32)
            module.biases = module.biases.astype(mx.float32)
