"""tokenizer_proc/params.py: client parameters (OpenAI names) -> RequestParams."""

import math

import pytest

from mlxd.protocol import SamplingParams
from mlxd.tokenizer_proc.params import (
    KNOWN, MAX_SEED, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, MIN_TEMPERATURE,
    InvalidRequest, parse_params,
)

VOCAB = 512
DEFAULT_MAX = 256


def parse(**params):
    return parse_params(params, VOCAB, DEFAULT_MAX)


def test_defaults():
    p = parse_params({}, VOCAB, DEFAULT_MAX)
    assert p.sampling == SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                        seed=None, top_logprobs=0)
    assert p.sampling.greedy
    assert p.max_tokens == DEFAULT_MAX
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ([], [], False, False)


def test_default_max_tokens_is_the_callers():
    assert parse_params({}, VOCAB, 7).max_tokens == 7


def test_everything_set():
    p = parse(max_tokens=10, temperature=0.8, top_p=0.95, top_k=50, min_p=0.1, seed=3,
              stop=["\n\n", "END"], stop_token_ids=[0, 511], ignore_eos=True, logprobs=True,
              top_logprobs=5, timeout=30, skip_special_tokens=False)
    assert p.sampling == SamplingParams(0.8, 0.95, 50, 0.1, 3, 5)
    assert p.skip_special_tokens is False and parse().skip_special_tokens is True
    assert p.timeout == 30.0
    assert p.max_tokens == 10 and p.stop == ["\n\n", "END"] and p.stop_token_ids == [0, 511]
    assert p.ignore_eos and p.logprobs
    assert set(KNOWN) == {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                          "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                          "logprobs", "top_logprobs",
                          "timeout", "presence_penalty", "frequency_penalty",
                          "repetition_penalty", "logit_bias", "min_tokens", "n", "tools",
                          "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                          "enable_thinking", "continue_final_message", "response_format",
                          "cache_prefixes", "thinking_budget"}


# ---- valid values --------------------------------------------------------------------

@pytest.mark.parametrize("name,value,field,expected", [
    ("temperature", 0, "temperature", 0.0),
    ("thinking_budget", 0, "thinking_budget", 0),
    ("thinking_budget", 4096, "thinking_budget", 4096),
    ("temperature", 1, "temperature", 1.0),
    ("temperature", 0.7, "temperature", 0.7),
    ("temperature", 100.0, "temperature", 100.0),
    ("top_p", 1, "top_p", 1.0),
    ("top_p", 1e-9, "top_p", 1e-9),
    ("top_p", 0.5, "top_p", 0.5),
    ("min_p", 0, "min_p", 0.0),
    ("min_p", 1, "min_p", 1.0),
    ("min_p", 0.05, "min_p", 0.05),
    ("top_k", 0, "top_k", 0),
    ("top_k", 1, "top_k", 1),
    ("top_k", 100000, "top_k", 100000),
    ("top_k", -1, "top_k", 0),                  # -1 means disabled (vLLM)
    ("top_k", 2**31 - 1, "top_k", 2**31 - 1),
    ("seed", 0, "seed", 0),
    ("seed", MAX_SEED, "seed", MAX_SEED),
    ("seed", None, "seed", None),
])
def test_valid_sampling_values(name, value, field, expected):
    sampling = parse(**{name: value}).sampling
    got = getattr(sampling, field)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value", [1e-300, 5e-324, 1e-40, 1e-6, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_minimum_is_greedy(value):
    sampling = parse(temperature=value).sampling
    assert sampling.temperature == 0.0 and sampling.greedy


def test_the_minimum_temperature_samples():
    assert not parse(temperature=MIN_TEMPERATURE).sampling.greedy


def test_stop_strings_up_to_the_length_cap():
    longest = "x" * MAX_STOP_LENGTH
    assert parse(stop=longest).stop == [longest]
    assert parse(stop=["a", longest]).stop == ["a", longest]


@pytest.mark.parametrize("value", ["x" * (MAX_STOP_LENGTH + 1), ["a", "y" * 10**6]],
                         ids=["one-over", "a-million"])
def test_stop_strings_over_the_length_cap(value):
    with pytest.raises(InvalidRequest, match="stop") as info:
        parse(stop=value)
    assert str(MAX_STOP_LENGTH) in str(info.value)


def test_temperature_makes_sampling_non_greedy():
    assert not parse(temperature=0.5).sampling.greedy
    assert parse(temperature=0).sampling.greedy


@pytest.mark.parametrize("value", [1, 2, 4096, 2**31 - 1])
def test_valid_max_tokens(value):
    assert parse(max_tokens=value).max_tokens == value


@pytest.mark.parametrize("value,expected", [
    (None, []), ([], []), ("\n", ["\n"]), ("END", ["END"]), (["a", "bc"], ["a", "bc"]),
    (["x"] * MAX_STOP_STRINGS, ["x"] * MAX_STOP_STRINGS), ("日本", ["日本"]),
])
def test_valid_stop(value, expected):
    assert parse(stop=value).stop == expected


@pytest.mark.parametrize("value,expected", [
    (None, []), ([], []), ([0], [0]), ([5, VOCAB - 1], [5, VOCAB - 1]), ([3, 3], [3, 3]),
])
def test_valid_stop_token_ids(value, expected):
    assert parse(stop_token_ids=value).stop_token_ids == expected


@pytest.mark.parametrize("name", ["ignore_eos", "logprobs"])
@pytest.mark.parametrize("value", [True, False])
def test_valid_flags(name, value):
    assert getattr(parse(**{name: value}), name) is value


@pytest.mark.parametrize("n", [0, 1, MAX_TOP_LOGPROBS])
def test_top_logprobs_with_logprobs(n):
    p = parse(logprobs=True, top_logprobs=n)
    assert p.logprobs and p.sampling.top_logprobs == n


def test_logprobs_without_top_logprobs():
    assert parse(logprobs=True).sampling.top_logprobs == 0


# ---- invalid values ------------------------------------------------------------------

INVALID = [
    ("thinking_budget", -1), ("thinking_budget", 1.5), ("thinking_budget", "8"),
    ("temperature", -0.01), ("temperature", -1), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", "0.5"),
    ("temperature", True), ("temperature", False), ("temperature", None), ("temperature", [1]),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.0001), ("top_p", 2),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", "1"), ("top_p", True), ("top_p", None),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan), ("min_p", -math.inf),
    ("min_p", "0"), ("min_p", True), ("min_p", None),
    ("top_k", -2), ("top_k", -100), ("top_k", 2**31), ("top_k", 1.0), ("top_k", 5.5),
    ("top_k", "5"), ("top_k", True), ("top_k", False), ("top_k", None), ("top_k", math.nan),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**31), ("max_tokens", 10.0),
    ("max_tokens", "10"), ("max_tokens", True), ("max_tokens", None), ("max_tokens", math.inf),
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 1.0), ("seed", "1"), ("seed", True),
    ("seed", False), ("seed", math.nan),
    ("ignore_eos", 1), ("ignore_eos", 0), ("ignore_eos", "true"), ("ignore_eos", None),
    ("logprobs", 1), ("logprobs", "yes"), ("logprobs", None), ("logprobs", [True]),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", 5), ("stop", ["a", 5]),
    ("stop", [None]), ("stop", {"a": 1}), ("stop", ("a",)), ("stop", True), ("stop", b"x"),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", [["a"]]),
    ("stop", 0), ("stop", False), ("stop", {}),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("stop_token_ids", [1, 10**6]),
    ("stop_token_ids", [1.0]), ("stop_token_ids", ["1"]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", "1,2"), ("stop_token_ids", {"1": 1}),
    ("stop_token_ids", (1, 2)), ("stop_token_ids", [None]),
    ("stop_token_ids", 0), ("stop_token_ids", False), ("stop_token_ids", ""),
]


@pytest.mark.parametrize("name,value", INVALID, ids=[f"{n}={v!r}"[:60] for n, v in INVALID])
def test_invalid_values(name, value):
    params = {name: value}
    if name == "top_logprobs":
        params["logprobs"] = True
    with pytest.raises(InvalidRequest) as info:
        parse_params(params, VOCAB, DEFAULT_MAX)
    assert name in str(info.value)


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, 1.0, "2", True, None])
def test_invalid_top_logprobs(value):
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        parse(logprobs=True, top_logprobs=value)


@pytest.mark.parametrize("n", [1, MAX_TOP_LOGPROBS])
def test_top_logprobs_requires_logprobs(n):
    for params in ({"top_logprobs": n}, {"top_logprobs": n, "logprobs": False}):
        with pytest.raises(InvalidRequest, match="top_logprobs") as info:
            parse_params(params, VOCAB, DEFAULT_MAX)
        assert "logprobs" in str(info.value)


def test_stop_token_ids_bound_is_the_vocab_size():
    assert parse_params({"stop_token_ids": [9]}, 10, 1).stop_token_ids == [9]
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        parse_params({"stop_token_ids": [10]}, 10, 1)


@pytest.mark.parametrize("params,named", [
    ({"max_new_tokens": 5}, "max_new_tokens"),
    ({"temprature": 0.5}, "temprature"),
    ({"best_of": 2, "temperature": 1.0}, "best_of"),
    ({"stream": True}, "stream"),
    ({"": 1}, "''"),
])
def test_unknown_parameters(params, named):
    with pytest.raises(InvalidRequest, match="unknown") as info:
        parse_params(params, VOCAB, DEFAULT_MAX)
    assert named in str(info.value)


def test_errors_are_value_errors():
    assert issubclass(InvalidRequest, ValueError)


def test_input_dict_is_not_modified():
    params = {"temperature": 0.5, "stop": "x", "top_k": -1}
    copy = dict(params)
    parse_params(params, VOCAB, DEFAULT_MAX)
    assert params == copy


def test_timeout_is_a_positive_number_of_seconds():
    assert parse_params({}, 512, 16).timeout is None
    assert parse_params({"timeout": 2.5}, 512, 16).timeout == 2.5
    for bad in (0, -1, "1", float("inf"), 1e7):
        with pytest.raises(InvalidRequest, match="timeout"):
            parse_params({"timeout": bad}, 512, 16)


# ---- penalties, logit_bias, min_tokens -------------------------------------------------

def test_penalties_bias_and_min_tokens_reach_the_sampling_params():
    p = parse(presence_penalty=1.5, frequency_penalty=-2, repetition_penalty=1.3,
              logit_bias={"7": -100, 11: 2.5}, min_tokens=4, max_tokens=9)
    s = p.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.5, -2.0, 1.3)
    assert (s.bias_ids, s.bias_values, s.min_tokens) == ([7, 11], [-100.0, 2.5], 4)
    assert type(s.frequency_penalty) is float and s.processes_logits


def test_no_penalties_by_default():
    s = parse().sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (s.bias_ids, s.bias_values, s.min_tokens) == ([], [], 0)
    assert not s.processes_logits
    assert not parse(logit_bias={}, min_tokens=0, repetition_penalty=1).sampling.processes_logits


def test_min_tokens_may_equal_max_tokens():
    assert parse(min_tokens=5, max_tokens=5).sampling.min_tokens == 5
    assert parse(min_tokens=DEFAULT_MAX).sampling.min_tokens == DEFAULT_MAX


def test_logit_bias_takes_up_to_300_entries():
    bias = {str(t): 1.0 for t in range(300)}
    assert len(parse(logit_bias=bias).sampling.bias_ids) == 300
    with pytest.raises(InvalidRequest, match="at most 300"):
        parse(logit_bias={**bias, "300": 1.0})


@pytest.mark.parametrize("name,value,message", [
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ("presence_penalty", "1", "presence_penalty must be a finite number"),
    ("frequency_penalty", -2.01, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ("frequency_penalty", math.nan, "frequency_penalty must be a finite number"),
    ("frequency_penalty", None, "frequency_penalty must be a finite number"),
    ("repetition_penalty", 0, r"repetition_penalty must be in \(0.0, 100.0\]"),
    ("repetition_penalty", -1.0, "repetition_penalty must be in"),
    ("repetition_penalty", math.inf, "repetition_penalty must be a finite number"),
    ("repetition_penalty", True, "repetition_penalty must be a finite number"),
    ("min_tokens", -1, r"min_tokens must be in \[0, "),
    ("min_tokens", 2.0, "min_tokens must be an integer"),
    ("min_tokens", DEFAULT_MAX + 1, "min_tokens .* must not exceed max_tokens"),
    ("logit_bias", [[1, 2]], "logit_bias must map token ids to numbers"),
    ("logit_bias", {"a": 1}, r"logit_bias keys must be token ids in \[0, 512\)"),
    ("logit_bias", {"512": 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {-1: 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {1.0: 1}, "logit_bias keys must be token ids"),
    ("logit_bias", {"3": 100.5}, r"logit_bias\[3\] must be in \[-100.0, 100.0\]"),
    ("logit_bias", {"3": "1"}, r"logit_bias\[3\] must be a finite number"),
    ("logit_bias", {"3": 1, 3: 2}, "logit_bias names token 3 twice"),
])
def test_invalid_penalties_name_the_parameter(name, value, message):
    with pytest.raises(InvalidRequest, match=message):
        parse(**{name: value})
