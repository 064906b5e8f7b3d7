"""The checks a request's prompt passes before it reaches the scheduler: exactly one of
prompt / messages / input_ids, every id in the model's vocabulary, and a length that
leaves room in the model's context and the KV pool."""

from typing import Protocol

from mlxd.protocol import GenerateRequest
from mlxd.runtime.request_limits import length_error

from .params import InvalidRequest
from .text import TextCodec


class ModelLimits(Protocol):
    """What the checks read of the scheduler's READY (a `WorkerLimits`)."""

    kv_capacity: int
    max_context: int
    vocab_size: int


def model_vocab_size(limits: ModelLimits | None, codec: TextCodec) -> int:
    """Token ids the model takes: the worker's figure once known (a tokenizer may
    hold added tokens the model has no embedding for), else the tokenizer's."""
    return (limits.vocab_size if limits is not None else 0) or codec.vocab_size


def prompt_ids(req: GenerateRequest, codec: TextCodec, vocab_size: int) -> list[int]:
    """The request's input ids, encoded from its prompt or messages if not given;
    raises InvalidRequest unless exactly one is set, non-empty and in the vocabulary."""
    given = [x for x in (req.prompt, req.messages, req.input_ids) if x is not None]
    if len(given) != 1:
        raise InvalidRequest("send exactly one of prompt, messages or input_ids")
    if req.input_ids is not None:
        if any(not 0 <= t < vocab_size for t in req.input_ids):
            raise InvalidRequest(f"input_ids must be token ids in [0, {vocab_size})")
        ids = req.input_ids
    else:
        if req.messages is not None:
            ids = codec.encode_chat(checked_messages(req.messages))
        else:
            ids = codec.encode_prompt(req.prompt) if req.prompt else []
        if ids and max(ids) >= vocab_size:   # a token the model has no embedding for
            raise InvalidRequest(f"the prompt encodes to token id {max(ids)}; the "
                                 f"model's vocabulary is [0, {vocab_size})")
    if not ids:
        raise InvalidRequest("the prompt is empty")
    return ids


def check_length(n: int, limits: ModelLimits | None, max_tokens: int = 1) -> None:
    """A prompt of n tokens must leave room in the model's context for one generated
    token, and n plus max_tokens (clamped to the context) must fit in the KV pool;
    the scheduler rejects the same requests (runtime/request_limits.py). Figures the
    worker reports as 0 are unknown and unchecked."""
    if limits is None:
        return
    error = length_error(n, max_tokens, limits.max_context or n + max_tokens + 1,
                         limits.kv_capacity or n + max_tokens + 1)
    if error:
        raise InvalidRequest(error)


def checked_messages(messages: list) -> list[dict]:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise InvalidRequest("messages must be a list of {role: str, content: str}")
    if not messages:
        raise InvalidRequest("messages is empty")
    return messages
