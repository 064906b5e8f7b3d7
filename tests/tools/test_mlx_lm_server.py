"""A forced call on a real server whose model writes one of mlx_lm's formats (Kimi
K2's, read from its chat template, not named by a flag): the tiny random model's call
comes back parsed by mlx_lm's kimi_k2 module, through the `openai` client."""

import json
import shutil

import openai
import pytest

from mlxd.tokenizer_proc.text import TextCodec
from mlxd.tokenizer_proc.tools.syntax import resolve
from support import Server

# Kimi K2's markers, as its template writes an assistant's calls.
KIMI_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|system|>Tools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>"
    "functions.{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
    "{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|></s>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def kimi_model(llama_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "llama-kimi"
    shutil.copytree(llama_model, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": KIMI_TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def oai(kimi_model):
    server = Server(kimi_model, "--kv-capacity", "8192", "--log-level", "warning")
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client
    server.stop()


def test_a_forced_call_in_kimi_k2_format_comes_back_parsed(oai, kimi_model):
    # What the server resolves at start (tokenizer_proc/main.py), with no flag given.
    assert resolve(TextCodec(kimi_model).chat_template_text).tool_parser == "kimi_k2"
    name = kimi_model.rsplit("/", 1)[-1]
    for seed in range(3):
        reply = oai.chat.completions.create(
            model=name, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0,
            seed=seed, tool_choice={"type": "function", "function": {"name": "get_time"}})
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments) in ({"zone": "UTC"}, {"zone": "CET"})
        assert reply.choices[0].finish_reason == "tool_calls"
        assert not reply.choices[0].message.content
    required = oai.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=5,
        tool_choice="required", parallel_tool_calls=False, stream=True)
    deltas = [d for chunk in required for d in chunk.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].function.name in ("get_weather", "get_time")
    json.loads(deltas[0].function.arguments)


def test_a_format_without_a_grammar_answers_a_forced_call_with_a_400(kimi_model):
    """Gemma 4's format (named by the flag) has no forced-call grammar (grammar.py's
    UNFORCED); `auto` is still served."""
    server = Server(kimi_model, "--kv-capacity", "8192", "--log-level", "warning",
                    "--tool-call-parser", "gemma4")
    try:
        with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", timeout=60,
                           max_retries=0) as client:
            name = kimi_model.rsplit("/", 1)[-1]
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                               tool_choice="required", max_tokens=8)
            assert "gemma4" in str(refused.value)
            auto = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS,
                                                  max_tokens=8)
            assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    finally:
        server.stop()
