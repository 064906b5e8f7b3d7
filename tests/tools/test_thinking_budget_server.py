"""Thinking budgets through a real server: the tiny model's template opens a think
block (in <think> text markers) whenever thinking is on, as DeepSeek-R1's does, and,
its weights random, it would think until the token limit; with a budget its
reasoning stops there and the reply goes on after it. Through the OpenAI client
(`thinking_budget`, and `reasoning_effort`'s budget), the Responses API and the
Anthropic SDK (`thinking.budget_tokens`)."""

import anthropic
import openai
import pytest

from support import Server

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def server(thinking_model):
    server = Server(thinking_model, "--kv-capacity", "8192", "--log-level", "warning",
                    "--reasoning-parser", "think")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(thinking_model) -> str:
    return thinking_model.rsplit("/", 1)[-1]


def tokens(server, text: str) -> int:
    """The tokens of `text` alone (what /tokenize adds to any text, BOS, left out)."""
    import httpx

    def count(t):
        return len(httpx.post(server.http_url + "/tokenize", json={"prompt": t},
                              timeout=30).json()["tokens"])
    return count(text) - count("") if text else 0


def chat(server, model, **extra):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as oai:
        return oai.chat.completions.create(
            model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Hi"}],
            **extra)


def test_without_a_budget_the_random_model_thinks_to_the_limit(server, model):
    r = chat(server, model)
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.content   # all of it was thinking


def thought(server, choice) -> int:
    """The tokens a reply thought: those before the end marker's, by its logprobs."""
    text = ""
    for i, entry in enumerate(choice.logprobs.content):
        text += entry.token
        if text.endswith("</think>"):
            return i + 1 - tokens(server, "</think>")
    raise AssertionError(f"no end of thinking in {text!r}")


@pytest.mark.parametrize("n", [0, 5, 12])
def test_a_budget_ends_the_thinking_and_the_reply_follows(server, model, n):
    r = chat(server, model, logprobs=True, extra_body={"thinking_budget": n})
    choice = r.choices[0]
    assert thought(server, choice) == n
    # the forced </think> ends the reasoning: the rest is the reply
    assert "</think>" not in (choice.message.content or "")
    assert r.usage.completion_tokens == MAX_TOKENS or choice.finish_reason == "stop"
    assert choice.message.content or choice.finish_reason == "stop"


def test_reasoning_effort_low_sets_a_budget_of_its_own(server, model):
    """low: 1024 tokens, more than the reply may have here: the thinking runs to the
    limit; a budget sent beside it wins."""
    r = chat(server, model, reasoning_effort="low")
    assert not r.choices[0].message.content
    r = chat(server, model, reasoning_effort="low", logprobs=True,
             extra_body={"thinking_budget": 4})
    assert thought(server, r.choices[0]) == 4


def test_the_anthropic_budget_tokens_and_thinking_blocks(server, model):
    """Without a budget the whole reply is thinking, in a thinking block; with one,
    the thinking block stops at it and the answer after it is the text. Streamed, the
    same blocks. A request that does not turn thinking on gets no thinking block."""
    with anthropic.Anthropic(base_url=server.http_url, api_key="none", timeout=60,
                             max_retries=0) as client:
        ask = dict(model=model, max_tokens=MAX_TOKENS,
                   messages=[{"role": "user", "content": "Hi"}])
        whole = client.messages.create(**ask, thinking={"type": "enabled"})
        assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
        assert whole.stop_reason == "max_tokens"
        cut = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 6})
        assert [b.type for b in cut.content] == ["thinking", "text"]
        assert cut.content[0].thinking != whole.content[0].thinking and cut.content[1].text
        with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 6}) as stream:
            streamed = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in streamed.content] == \
            [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
             for b in cut.content]
        plain = client.messages.create(**ask)   # thinking not asked for: none shown
        assert [b.type for b in plain.content] == ["text"]
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": -1})


def test_the_responses_api_budget_from_its_effort(server, model):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as oai:
        r = oai.responses.create(model=model, input="Hi", max_output_tokens=MAX_TOKENS,
                                 reasoning={"effort": "low"})
        assert r.usage.output_tokens > 0
