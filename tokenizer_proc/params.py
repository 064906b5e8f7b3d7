"""Validation of client parameters (OpenAI names) into what the scheduler needs.

Each parameter is declared in protocol/sampling.py: numbers, integers and flags are
checked by their declaration alone; the other kinds, special values and the rules
across parameters are written here.

Every accepted value samples sanely: a temperature below MIN_TEMPERATURE is greedy,
and however small top_p is, its nucleus keeps the most likely token (the worker's
sampling guarantees that where float32 rounds top_p to 0)."""

import math
from dataclasses import dataclass, field

from mlxd.protocol import MAX_PINS, PARAMS, Param, SamplingParams
from mlxd.protocol.sampling import MAX_SEED, SAMPLING_PARAMS
from mlxd.protocol.sampling import MAX_TOP_LOGPROBS  # noqa: F401 (imported from here too)

from .tools.request import ChatOptions, InvalidOptions, chat_options
from .constraints import Constraint, InvalidConstraint, parse_response_format

KNOWN = frozenset(PARAMS)   # every parameter a request may set (protocol/sampling.py)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256      # characters per stop string: the held-back text grows with it
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_PIN_SECONDS = 86_400   # a cache prefix's ttl (Anthropic's longest is an hour)
# Below this a temperature is greedy (as in vLLM): dividing logprobs by a smaller one
# overflows, and a float32 temperature of 0 would give NaN.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request the core refuses; `param` names the client parameter at fault (under
    protocol/sampling.py's name, or `prompt`, `input_ids`, `messages`), None where
    no one parameter is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    cache_prefixes: list["CachePrefix"] = field(default_factory=list)


@dataclass
class CachePrefix:
    """A prefix of the prompt to pin for `ttl` seconds: the tokens the prompt shares
    with `messages` rendered (with `tools` instead of the request's, when given)."""

    messages: list
    tools: list | None
    ttl: int


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 keeps it,
    so n=1 samples as before; the others get distinct seeds of their own."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (MAX_SEED + 1)


def _scalar(p: Param, params: dict, default=None):
    """The value of a number, integer or flag parameter, checked against its
    declaration: `default` (or the declared one) when not sent; None when sent as
    null where null means not sent."""
    value = params.get(p.name, p.default if default is None else default)
    if value is None and p.nullable:
        return None
    if p.kind == "flag":
        if type(value) is not bool:
            raise InvalidRequest(f"{p.name} must be true or false, got {value!r}", p.name)
        return value
    if p.kind == "integer":
        if type(value) is not int:
            raise InvalidRequest(f"{p.name} must be an integer, got {value!r}", p.name)
    elif type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidRequest(f"{p.name} must be a finite number, got {value!r}", p.name)
    if p.outside(value):
        raise InvalidRequest(f"{p.name} must be in {p.bounds()}, got {value}", p.name)
    return value if p.kind == "integer" else float(value)


def _stop_strings(params) -> list[str]:
    stop = params.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_LENGTH:
        raise InvalidRequest(f"stop strings may have at most {MAX_STOP_LENGTH} "
                             f"characters, got one of {longest}", "stop")
    return stop


def _token_ids(params, name, vocab_size) -> list[int]:
    ids = params.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size
                                            for t in ids):
        raise InvalidRequest(f"{name} must be a list of token ids in [0, {vocab_size})", name)
    return ids


def _token_id(key, vocab_size) -> int:
    """A logit_bias key: an int, or a string of one (JSON objects have string keys)."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if type(key) is not int or not 0 <= key < vocab_size:
        raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), "
                             f"got {key!r}", "logit_bias")
    return key


def _bias(token: int, value) -> float:
    """One logit_bias entry's bias, in [-100, 100]."""
    entry = Param(f"logit_bias[{token}]", "number", lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
    try:
        return _scalar(entry, {entry.name: value})
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc), "logit_bias") from None


def _logit_bias(params, vocab_size) -> tuple[list[int], list[float]]:
    """`{token id: bias}` as (ids, biases), each bias in [-100, 100]."""
    bias = params.get("logit_bias")
    if bias is None:
        return [], []
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {bias!r}",
                             "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} "
                             f"entries, got {len(bias)}", "logit_bias")
    merged: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_id(key, vocab_size)
        if token in merged:
            raise InvalidRequest(f"logit_bias names token {token} twice", "logit_bias")
        merged[token] = _bias(token, value)
    return list(merged), list(merged.values())


def _constraint(params, ignore_eos: bool, min_tokens: int) -> Constraint | None:
    """response_format's shape (compiled later, core.py). A constrained request ends
    with EOS where its grammar does, so EOS can be neither ignored nor held back."""
    try:
        constraint = parse_response_format(params.get("response_format"))
    except InvalidConstraint as exc:
        raise InvalidRequest(str(exc), "response_format") from None
    if constraint is not None and (ignore_eos or min_tokens):
        raise InvalidRequest("response_format cannot be combined with ignore_eos or "
                             "min_tokens: a constrained output ends with EOS where its "
                             "grammar ends", "response_format")
    return constraint


def _names(params: dict) -> None:
    if not all(isinstance(k, str) for k in params):
        raise InvalidRequest("parameter names must be strings")
    unknown = sorted(set(params) - KNOWN)
    if unknown:
        raise InvalidRequest(f"unknown parameter(s) {unknown}; known: {sorted(KNOWN)}",
                             unknown[0])


def _sampling(values: dict, bias: tuple[list[int], list[float]]) -> SamplingParams:
    """The worker's parameters, from the checked values (the rules across parameters
    and their special values applied)."""
    sampling = {p.name: values[p.name] for p in SAMPLING_PARAMS}
    if sampling["temperature"] < MIN_TEMPERATURE:   # greedy (MIN_TEMPERATURE, above)
        sampling["temperature"] = 0.0
    sampling["top_k"] = max(sampling["top_k"], 0)   # -1 means disabled, as in vLLM
    if sampling["top_logprobs"] and not values["logprobs"]:
        raise InvalidRequest("top_logprobs requires logprobs=True", "top_logprobs")
    if sampling["min_tokens"] > values["max_tokens"]:
        raise InvalidRequest(f"min_tokens ({sampling['min_tokens']}) must not exceed "
                             f"max_tokens ({values['max_tokens']})", "min_tokens")
    return SamplingParams(**sampling, bias_ids=bias[0], bias_values=bias[1])


def parse_params(params: dict, vocab_size: int, default_max_tokens: int) -> RequestParams:
    """A request's parameters, checked: InvalidRequest names the one at fault."""
    _names(params)
    defaults = {"max_tokens": default_max_tokens}
    values = {p.name: _scalar(p, params, defaults.get(p.name))
              for p in PARAMS.values() if p.scalar}
    sampling = _sampling(values, _logit_bias(params, vocab_size))
    return RequestParams(
        sampling=sampling,
        max_tokens=values["max_tokens"],
        stop=_stop_strings(params),
        stop_token_ids=_token_ids(params, "stop_token_ids", vocab_size),
        ignore_eos=values["ignore_eos"],
        logprobs=values["logprobs"],
        skip_special_tokens=values["skip_special_tokens"],
        timeout=values["timeout"],
        n=values["n"],
        chat=_chat(params),
        constraint=_constraint(params, values["ignore_eos"], sampling.min_tokens),
        cache_prefixes=_cache_prefixes(params))


def _cache_prefixes(params) -> list[CachePrefix]:
    """`[{"messages": [...], "tools": [...] (optional), "ttl": seconds}, ...]`."""
    given = params.get("cache_prefixes")
    if given is None:
        return []
    shape = ('cache_prefixes must be a list of at most {} {{"messages": [...], "tools": '
             '[...], "ttl": seconds}}').format(MAX_PINS)
    if not isinstance(given, list) or len(given) > MAX_PINS:
        raise InvalidRequest(shape, "cache_prefixes")
    prefixes = []
    for entry in given:
        if not (isinstance(entry, dict) and set(entry) <= {"messages", "tools", "ttl"}
                and isinstance(entry.get("messages"), list) and entry["messages"]
                and type(entry.get("ttl")) is int and 1 <= entry["ttl"] <= MAX_PIN_SECONDS):
            raise InvalidRequest(shape, "cache_prefixes")
        tools = entry.get("tools")
        if tools is not None:
            try:
                tools = chat_options({"tools": tools}).tools
            except InvalidOptions as exc:
                raise InvalidRequest(f"cache_prefixes: {exc}", "cache_prefixes") from None
        prefixes.append(CachePrefix(entry["messages"], tools, entry["ttl"]))
    return prefixes


def _chat(params) -> ChatOptions:
    try:
        return chat_options(params)
    except InvalidOptions as exc:
        raise InvalidRequest(str(exc), exc.param) from None
