"""Validation of client parameters (OpenAI names) into what the scheduler needs.

Every accepted value samples sanely: a temperature below MIN_TEMPERATURE is greedy,
and however small top_p is, its nucleus keeps the most likely token (the worker's
sampling guarantees that where float32 rounds top_p to 0)."""

import math
from dataclasses import dataclass, field

from mlxd.protocol import SamplingParams

from .tools.request import ChatOptions, InvalidOptions, chat_options
from .constraints import Constraint, InvalidConstraint, parse_response_format

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256      # characters per stop string: the held-back text grows with it
MAX_SEED = 2**63 - 1
MAX_PENALTY = 2.0          # presence and frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_CHOICES = 16           # n
# Below this a temperature is greedy (as in vLLM): dividing logprobs by a smaller one
# overflows, and a float32 temperature of 0 would give NaN.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    pass


@dataclass
class RequestParams:
    sampling: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    skip_special_tokens: bool = True   # special tokens are left out of the text
    timeout: float | None = None   # seconds the whole request may take, server-side
    n: int = 1                     # choices: samples of the same prompt
    chat: ChatOptions = field(default_factory=ChatOptions)   # tools, template kwargs
    constraint: Constraint | None = None   # response_format, compiled when encoded


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 keeps it,
    so n=1 samples as before; the others get distinct seeds of their own."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (MAX_SEED + 1)


def _number(params, name, default, lo=-math.inf, hi=math.inf, lo_open=False):
    value = params.get(name, default)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be in {bound}, got {value}")
    return float(value)


def _integer(params, name, default, lo, hi):
    value = params.get(name, default)
    if type(value) is not int:
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _flag(params, name, default=False):
    value = params.get(name, default)
    if type(value) is not bool:
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def _stop_strings(params) -> list[str]:
    stop = params.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("stop must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_LENGTH:
        raise InvalidRequest(f"stop strings may have at most {MAX_STOP_LENGTH} "
                             f"characters, got one of {longest}")
    return stop


def _token_ids(params, name, vocab_size) -> list[int]:
    ids = params.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size
                                            for t in ids):
        raise InvalidRequest(f"{name} must be a list of token ids in [0, {vocab_size})")
    return ids


def _temperature(params) -> float:
    """0 means greedy; so does anything below MIN_TEMPERATURE."""
    value = _number(params, "temperature", 0.0, lo=0.0)
    return 0.0 if value < MIN_TEMPERATURE else value


def _seed(params):
    seed = params.get("seed")
    if seed is None:
        return None
    return _integer(params, "seed", None, 0, MAX_SEED)


def _top_logprobs(params, logprobs: bool) -> int:
    n = _integer(params, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if n and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=True")
    return n


MAX_TIMEOUT = 1e6   # seconds


def _timeout(params) -> float | None:
    if params.get("timeout") is None:
        return None
    return _number(params, "timeout", None, lo=0.0, hi=MAX_TIMEOUT, lo_open=True)


def _token_id(key, vocab_size) -> int:
    """A logit_bias key: an int, or a string of one (JSON objects have string keys)."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if type(key) is not int or not 0 <= key < vocab_size:
        raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), "
                             f"got {key!r}")
    return key


def _logit_bias(params, vocab_size) -> tuple[list[int], list[float]]:
    """`{token id: bias}` as (ids, biases), each bias in [-100, 100]."""
    bias = params.get("logit_bias")
    if bias is None:
        return [], []
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} "
                             f"entries, got {len(bias)}")
    merged: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key, vocab_size)
        if token in merged:
            raise InvalidRequest(f"logit_bias names token {token} twice")
        name = f"logit_bias[{token}]"
        merged[token] = _number({name: value}, name, None,
                                lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
    return list(merged), list(merged.values())


def _min_tokens(params, max_tokens: int) -> int:
    value = _integer(params, "min_tokens", 0, 0, 2**31 - 1)
    if value > max_tokens:
        raise InvalidRequest(f"min_tokens ({value}) must not exceed max_tokens ({max_tokens})")
    return value


def _penalties(params) -> dict:
    return dict(
        presence_penalty=_number(params, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(params, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_number(params, "repetition_penalty", 1.0, lo=0.0,
                                   hi=MAX_REPETITION_PENALTY, lo_open=True))


KNOWN = frozenset({"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens", "logprobs", "top_logprobs", "timeout",
                   "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "logit_bias", "min_tokens", "n", "tools", "tool_choice",
                   "parallel_tool_calls", "chat_template_kwargs", "enable_thinking",
                   "response_format"})


def _constraint(params, ignore_eos: bool, min_tokens: int) -> Constraint | None:
    """response_format's shape (compiled later, core.py). A constrained request ends
    with EOS where its grammar does, so EOS can be neither ignored nor held back."""
    try:
        constraint = parse_response_format(params.get("response_format"))
    except InvalidConstraint as exc:
        raise InvalidRequest(str(exc)) from None
    if constraint is not None and (ignore_eos or min_tokens):
        raise InvalidRequest("response_format cannot be combined with ignore_eos or "
                             "min_tokens: a constrained output ends with EOS where its "
                             "grammar ends")
    return constraint


def parse_params(params: dict, vocab_size: int, default_max_tokens: int) -> RequestParams:
    if not all(isinstance(k, str) for k in params):
        raise InvalidRequest("parameter names must be strings")
    unknown = sorted(set(params) - KNOWN)
    if unknown:
        raise InvalidRequest(f"unknown parameter(s) {unknown}; known: {sorted(KNOWN)}")
    top_k = _integer(params, "top_k", 0, -1, 2**31 - 1)
    logprobs = _flag(params, "logprobs")
    max_tokens = _integer(params, "max_tokens", default_max_tokens, 1, 2**31 - 1)
    bias_ids, bias_values = _logit_bias(params, vocab_size)
    sampling = SamplingParams(
        temperature=_temperature(params),
        top_p=_number(params, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=max(top_k, 0),   # -1 means disabled, as in vLLM
        min_p=_number(params, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=_seed(params),
        top_logprobs=_top_logprobs(params, logprobs),
        bias_ids=bias_ids, bias_values=bias_values,
        min_tokens=_min_tokens(params, max_tokens),
        **_penalties(params))
    ignore_eos = _flag(params, "ignore_eos")
    return RequestParams(
        sampling=sampling,
        max_tokens=max_tokens,
        stop=_stop_strings(params),
        stop_token_ids=_token_ids(params, "stop_token_ids", vocab_size),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=_flag(params, "skip_special_tokens", True),
        timeout=_timeout(params),
        n=_integer(params, "n", 1, 1, MAX_CHOICES),
        chat=_chat(params),
        constraint=_constraint(params, ignore_eos, sampling.min_tokens))


def _chat(params) -> ChatOptions:
    try:
        return chat_options(params)
    except InvalidOptions as exc:
        raise InvalidRequest(str(exc)) from None
