"""Anthropic's cache_control through a real server and the real `anthropic` SDK, on the
tiny random-weight model with a small KV pool: a pinned prefix survives a pressure
that evicts an unpinned one, and is released after its TTL (TTLs scaled down by
MLXD_PIN_TTL_SCALE, the scheduler's test knob); the bound on pinned KV refuses a pin
(the request still succeeds) and both show in /metrics; breakpoints on a tool and on
a system block; bad cache_control values are 400s in Anthropic's words."""

import os
import random
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from mlxd.model_store.tiny import _WORDS
from mlxd.runtime.kv_layout import DECODE_PAGE
from support import Server

CAPACITY = 2048          # the tiny model's context too
MAX_PINNED = 1200
TTL_SCALE = 0.02          # 5m -> 6 s, 1h -> 72 s
WORDS = list(_WORDS)   # about 2 tokens each


@pytest.fixture(scope="module")
def server(llama_model):
    env = {**os.environ, "MLXD_PIN_TTL_SCALE": str(TTL_SCALE)}
    server = Server(llama_model, "--kv-capacity", str(CAPACITY), "--max-pinned-tokens",
                    str(MAX_PINNED), "--log-level", "warning", env=env)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", timeout=60,
                             max_retries=0) as client:
        yield client


@pytest.fixture
def name(llama_model) -> str:
    return Path(llama_model).name


def text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def metric(server, name: str) -> float:
    body = httpx.get(server.http_url + "/metrics", timeout=30).text
    line = next(line for line in body.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def ephemeral(ttl: str = "5m") -> dict:
    return {"type": "ephemeral", "ttl": ttl}


def ask(claude, name, system, user="Hello", **kw):
    return claude.messages.create(model=name, max_tokens=2, system=system,
                                  messages=[{"role": "user", "content": user}], **kw)


def press(claude, name, server):
    """A prompt that needs every slot no pin holds (but a few): all unpinned KV goes.
    The pool is booked in whole pages: the pinned prefix holds its pages, and the
    prompt's first page starts after the template start it shares with it."""
    pinned = int(metric(server, "mlxd_kv_slots_pinned"))
    room = CAPACITY - -(-pinned // DECODE_PAGE) * DECODE_PAGE - DECODE_PAGE - 24
    words = room
    while True:
        prompt = text(words, seed=99)
        n = claude.messages.count_tokens(
            model=name, messages=[{"role": "user", "content": prompt}]).input_tokens
        if n <= room:
            break
        words = words * room // n - 1
    reply = claude.messages.create(model=name, max_tokens=1,
                                   messages=[{"role": "user", "content": prompt}])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > room - 40


def totals(usage) -> int:
    return (usage.input_tokens + usage.cache_creation_input_tokens
            + usage.cache_read_input_tokens)


def test_a_pinned_prefix_survives_a_pressure_that_evicts_an_unpinned_one(
        claude, name, server):
    pinned_system = [{"type": "text", "text": text(150, seed=1),
                      "cache_control": ephemeral("1h")}]
    plain_system = [{"type": "text", "text": text(150, seed=2)}]
    first = ask(claude, name, pinned_system)
    counted = claude.messages.count_tokens(
        model=name, system=pinned_system,
        messages=[{"role": "user", "content": "Hello"}]).input_tokens
    assert totals(first.usage) == counted
    assert 100 < first.usage.cache_creation_input_tokens < counted
    assert first.usage.cache_read_input_tokens == 0
    plain = ask(claude, name, plain_system)
    assert plain.usage.cache_creation_input_tokens == 0
    again = ask(claude, name, plain_system)          # cached, not pinned
    assert again.usage.cache_read_input_tokens > 100

    press(claude, name, server)

    kept = ask(claude, name, pinned_system)
    gone = ask(claude, name, plain_system)
    assert kept.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert kept.usage.cache_creation_input_tokens == 0   # a refresh writes nothing new
    assert gone.usage.cache_read_input_tokens < 10       # the shared template start at most


def test_a_pin_is_released_after_its_ttl(claude, name, server):
    system = [{"type": "text", "text": text(100, seed=3), "cache_control": ephemeral()}]
    before = metric(server, "mlxd_kv_slots_pinned")
    first = ask(claude, name, system)
    pinned = first.usage.cache_creation_input_tokens
    assert pinned > 80
    with_it = metric(server, "mlxd_kv_slots_pinned")
    assert with_it == before + pinned
    deadline = time.monotonic() + 60                 # 5m scaled: 6 s
    while metric(server, "mlxd_kv_slots_pinned") > with_it - pinned and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(server, "mlxd_kv_slots_pinned") <= with_it - pinned
    press(claude, name, server)
    after = ask(claude, name, system)
    assert after.usage.cache_read_input_tokens < 10  # evicted as unpinned KV is
    assert after.usage.cache_creation_input_tokens == pinned   # and pinned anew


def test_the_bound_refuses_a_pin_and_the_request_still_succeeds(claude, name, server):
    refused = metric(server, "mlxd_kv_pins_refused")
    assert metric(server, "mlxd_kv_slots_pinned_max") == MAX_PINNED
    system = [{"type": "text", "text": text(MAX_PINNED // 2 + 100, seed=4),
               "cache_control": ephemeral()}]
    reply = ask(claude, name, system)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.cache_creation_input_tokens == 0
    assert metric(server, "mlxd_kv_pins_refused") == refused + 1
    assert metric(server, "mlxd_kv_slots_pinned") <= MAX_PINNED


def test_a_breakpoint_on_a_tool_pins_the_tools_up_to_it(claude, name, server):
    tools = [{"name": f"tool_{i}", "description": text(10, seed=10 + i),
              "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}
             for i in range(2)]
    tools[0]["cache_control"] = ephemeral()
    system = text(30, seed=12)
    shape = dict(model=name, max_tokens=2, system=system, tools=tools,
                 messages=[{"role": "user", "content": "Hello"}])
    with claude.messages.stream(**shape) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = events[0].message.usage
    assert start.cache_creation_input_tokens == final.usage.cache_creation_input_tokens
    created = final.usage.cache_creation_input_tokens
    # the system prompt and the first tool, not the second tool nor the turn
    without_second = claude.messages.count_tokens(
        model=name, system=system, tools=tools[:1],
        messages=[{"role": "user", "content": "Hello"}]).input_tokens
    assert 20 < created < without_second
    assert totals(final.usage) == totals(start)
    # a request that changes only the second tool reads the pinned part back
    tools[1]["description"] = text(10, seed=13)
    other = claude.messages.create(**{**shape, "tools": tools})
    assert other.usage.cache_read_input_tokens >= created - 1


def test_a_breakpoint_on_a_system_block_pins_up_to_that_block(claude, name, server):
    first_block = {"type": "text", "text": text(60, seed=20), "cache_control": ephemeral()}
    system = [first_block, {"type": "text", "text": text(60, seed=21)}]
    reply = ask(claude, name, system)
    created = reply.usage.cache_creation_input_tokens
    assert 40 < created < totals(reply.usage) - 40
    other = ask(claude, name, [first_block, {"type": "text", "text": text(60, seed=22)}])
    assert other.usage.cache_read_input_tokens >= created - 1
    assert other.usage.cache_creation_input_tokens == 0


def test_a_breakpoint_on_a_message_block_pins_the_conversation_up_to_it(claude, name):
    turns = [{"role": "user", "content": text(40, seed=30)},
             {"role": "assistant", "content": text(40, seed=31)},
             {"role": "user", "content": [
                 {"type": "text", "text": text(20, seed=32), "cache_control": ephemeral()}]}]
    reply = claude.messages.create(model=name, max_tokens=2, messages=turns)
    assert 80 < reply.usage.cache_creation_input_tokens <= totals(reply.usage)
    follow = turns + [{"role": "assistant", "content": "yes"},
                      {"role": "user", "content": "more"}]
    again = claude.messages.create(model=name, max_tokens=2, messages=follow)
    assert again.usage.cache_read_input_tokens >= reply.usage.cache_creation_input_tokens - 2


@pytest.mark.parametrize("control, words", [
    ({"type": "persistent"}, "Input should be 'ephemeral'"),
    ({"type": "ephemeral", "ttl": "2h"}, "Input should be '5m' or '1h'"),
    ({"type": "ephemeral", "scope": "global"}, "does not support the parameter"),
])
def test_bad_cache_control_is_a_400_in_anthropics_words(claude, name, control, words):
    system = [{"type": "text", "text": "hi", "cache_control": control}]
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(claude, name, system)
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert "cache_control" in error["message"] and words in error["message"]


def test_more_than_four_breakpoints_is_a_400(claude, name):
    system = [{"type": "text", "text": f"part {i}", "cache_control": ephemeral()}
              for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(claude, name, system)
    assert info.value.body["error"]["message"] == (
        "A maximum of 4 blocks with cache_control may be provided. Found 5.")
