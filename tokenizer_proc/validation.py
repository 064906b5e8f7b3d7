"""The checks a request's prompt passes before it reaches the scheduler: exactly one of
prompt / messages / input_ids, every id in the model's vocabulary, and a length that
leaves room in the model's context and the KV pool."""

from typing import Callable, Protocol

from mlxd.protocol import GenerateRequest
from mlxd.runtime.request_limits import length_error

from .params import InvalidRequest
from .text import TextCodec
from .tools.messages import template_message
from .tools.request import InvalidOptions


class ModelLimits(Protocol):
    """What the checks read of the scheduler's READY (a `WorkerLimits`)."""

    kv_capacity: int
    max_context: int
    vocab_size: int


def model_vocab_size(limits: ModelLimits | None, codec: TextCodec) -> int:
    """Token ids the model takes: the worker's figure once known (a tokenizer may
    hold added tokens the model has no embedding for), else the tokenizer's."""
    return (limits.vocab_size if limits is not None else 0) or codec.vocab_size


def max_prompt_chars(limits: ModelLimits | None, chars_per_token: int | None) -> int | None:
    """The longest text, in characters, that can encode to a prompt that fits: one
    longer needs more tokens than the context or KV pool holds. None if unbounded."""
    if limits is None or chars_per_token is None:
        return None
    tokens = [n for n in (limits.max_context, limits.kv_capacity) if n]
    return min(tokens) * chars_per_token if tokens else None


def check_prompt_chars(req: GenerateRequest, max_chars: int | None) -> None:
    """Reject, before encoding it, a prompt too long to fit. Messages are checked once
    rendered (`prompt_ids`): a chat template may strip or drop some of their text."""
    if max_chars is not None and isinstance(req.prompt, str):
        _check_chars(len(req.prompt), max_chars, "prompt", "prompt")


def _check_chars(n: int, max_chars: int, what: str, param: str) -> None:
    if n > max_chars:
        raise InvalidRequest(f"the {what} has {n} characters; at most {max_chars} can fit "
                             f"the model's context", param)


def prompt_ids(req: GenerateRequest, codec: TextCodec, vocab_size: int,
               max_chars: int | None = None,
               render: Callable[[list[dict]], str] | None = None) -> list[int]:
    """The request's input ids, encoded from its prompt or messages (made text by
    `render`, by default the bare chat template) if not given; raises InvalidRequest
    unless exactly one is set, non-empty, in the vocabulary and, as text, no longer
    than `max_chars` (checked before encoding)."""
    given = [x for x in (req.prompt, req.messages, req.input_ids) if x is not None]
    if len(given) != 1:
        raise InvalidRequest("send exactly one of prompt, messages or input_ids", "prompt")
    if req.input_ids is not None:
        if any(not 0 <= t < vocab_size for t in req.input_ids):
            raise InvalidRequest(f"input_ids must be token ids in [0, {vocab_size})",
                                 "input_ids")
        ids = req.input_ids
    else:
        if req.messages is not None:
            text = (render or codec.render_chat)(checked_messages(req.messages))
            if max_chars is not None:
                _check_chars(len(text), max_chars, "chat template's text", "messages")
            ids = codec.encode_rendered(text)
        else:
            ids = codec.encode_prompt(req.prompt) if req.prompt else []
        if ids and max(ids) >= vocab_size:   # a token the model has no embedding for
            raise InvalidRequest(f"the prompt encodes to token id {max(ids)}; the "
                                 f"model's vocabulary is [0, {vocab_size})", "prompt")
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
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
        raise InvalidRequest(error, "prompt")


def checked_messages(messages: list) -> list[dict]:
    """The messages as the chat template takes them (tools/messages.py)."""
    try:
        checked = [template_message(m) for m in messages]
    except InvalidOptions as exc:
        raise InvalidRequest(str(exc), "messages") from None
    if not messages:
        raise InvalidRequest("messages is empty", "messages")
    return checked
