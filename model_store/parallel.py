"""Whether a model folder can be split over a worker group (`--tp N` or `--pp N`),
checked before anything starts (the launcher refuses it with the reason)."""

import json
import sys
from pathlib import Path


def split_refusal(model_path: str, tp: int = 1, pp: int = 1) -> str | None:
    """Why the model cannot be split over `tp` tensor-parallel ranks (mlx_lm's
    `shard()`) or `pp` pipeline stages (`model.model.pipeline()`); None when it can."""
    if tp > 1 and pp > 1:
        return ("--tp and --pp cannot be combined: a group is one mx.distributed ring, "
                "which cannot be split into tensor and pipeline groups")
    if tp == 1 and pp == 1:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    text = config.get("text_config", config)
    model_type = config.get("model_type", "?")
    if tp > 1:
        return _tensor_refusal(config, text, model_type, tp)
    if not _has(config, _pipelines):
        return (f"mlx_lm's {model_type} model has no pipeline split (`pipeline()`); "
                "serve it without --pp (or with --tp if it has `shard()`)")
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and layers < pp:
        return f"its {layers} layers cannot give each of {pp} stages one (--pp)"
    return None


def _tensor_refusal(config: dict, text: dict, model_type: str, ranks: int) -> str | None:
    if not _has(config, lambda cls: hasattr(cls, "shard")):
        return (f"mlx_lm's {model_type} model has no tensor-parallel split (`shard()`); "
                "serve it without --tp")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(n, int) and n % ranks:
            return f"its {n} {what} do not divide over {ranks} ranks (--tp)"
    return None


def _pipelines(model_class) -> bool:
    """Whether mlx_lm's module of `model_class` has a body that can be pipelined."""
    from mlx_lm.models.pipeline import PipelineMixin

    module = sys.modules[model_class.__module__]
    return any(isinstance(v, type) and issubclass(v, PipelineMixin) and v is not PipelineMixin
               for v in vars(module).values())


def _has(config: dict, test) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except ValueError:   # an architecture mlx_lm does not know: the load will say so
        return True
    return test(model_class)
