"""Picking the parsers from chat templates, the request's tool options, the grammar of
a required call, and the tokenizer core's handling of all of them."""

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from mlxd.tokenizer_proc.tools.grammar import tool_call_grammar
from mlxd.tokenizer_proc.tools.messages import template_message
from mlxd.tokenizer_proc.tools.request import InvalidOptions, chat_options
from mlxd.tokenizer_proc.tools.syntax import OutputSyntax, resolve

# Excerpts of the chat templates of the model families, as they mark tools and thinking.
QWEN25 = ("{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{% for tool in tools "
          "%}{{ tool | tojson }}{% endfor %}</tools>\\nFor each function call, return a json "
          "object within <tool_call></tool_call> XML tags{%- endif %}")
QWEN3 = QWEN25 + ("{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
QWEN3_CODER = ("{%- if tools %}<tools>...</tools>\\nIf you choose to call a function ONLY "
               "reply in the following format:\\n<tool_call>\\n<function=example_function_name>"
               "\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
               "</tool_call>{%- endif %}")
MISTRAL = ("{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in "
           "message.tool_calls %}{{- tool_call.function | tojson }}{%- endfor %}{%- endif %}")
LLAMA31 = ("{%- if tools_in_user_message %}Given the following functions, please respond "
           "with a JSON for a function call with its proper arguments that best answers the "
           "given prompt.\\nRespond in the format {\"name\": function name, \"parameters\": "
           "dictionary of argument name and its value}.{%- endif %}{%- if builtin_tools %}"
           "{{- '<|python_tag|>' }}{%- endif %}"
           "{{- '<|start_header_id|>ipython<|end_header_id|>' }}")
DEEPSEEK_R1 = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
           "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template, tools, thinks", [
    (QWEN25, "hermes", False), (QWEN3, "hermes", True), (QWEN3_CODER, "qwen3_coder", False),
    (MISTRAL, "mistral", False), (LLAMA31, "llama3_json", False),
    (DEEPSEEK_R1, "hermes", True),
    (SMOLLM2, "hermes", False),   # the default model shows no tool format: the fallback
    (None, "hermes", False),
])
def test_parsers_picked_from_the_chat_template(template, tools, thinks):
    assert resolve(template) == OutputSyntax(tools, thinks)


def test_flags_override_the_template_and_unknown_names_are_refused():
    assert resolve(QWEN3, "mistral", "none") == OutputSyntax("mistral", False)
    assert resolve(SMOLLM2, "auto", "think") == OutputSyntax("hermes", True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        resolve(QWEN3, "hermes2")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        resolve(QWEN3, "auto", "deep")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_options():
    options = chat_options({"tools": [WEATHER, TIME]})
    assert options.calls_tools and not options.constrained
    assert options.template_args() == {"tools": options.tools}
    assert options.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    named = chat_options({"tools": [WEATHER, TIME], "parallel_tool_calls": False,
                          "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.constrained and [t["function"]["name"] for t in named.callable_tools()] == \
        ["get_time"]
    none = chat_options({"tools": [WEATHER], "tool_choice": "none"})
    assert not none.calls_tools and none.template_args() == {}
    thinking = chat_options({"enable_thinking": False, "chat_template_kwargs": {"x": 1}})
    assert thinking.template_args() == {"x": 1, "enable_thinking": False}


@pytest.mark.parametrize("params, message", [
    ({"tools": {"name": "f"}}, "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "may not set"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
])
def test_bad_tool_options_are_named(params, message):
    with pytest.raises(InvalidOptions, match=message):
        chat_options(params)


def test_messages_with_tool_calls_reach_templates_with_object_arguments():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    message = template_message({"role": "assistant", "content": None, "tool_calls": [call]})
    assert message["content"] == ""
    assert message["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}
    assert template_message(tool) == tool
    with pytest.raises(InvalidOptions):
        template_message({"role": "user", "content": None})


GRAMMAR_GOLDEN = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"days": 0}}\n</tool_call>'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                    "</function>\n</tool_call>"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}'),
}


@pytest.fixture(scope="module")
def matcher_tokenizer(llama_model):
    tokenizer = AutoTokenizer.from_pretrained(llama_model)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    hf, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar))
    return matcher.consume_tokens(hf.encode(text, add_special_tokens=False)) and \
        matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(GRAMMAR_GOLDEN))
def test_the_grammar_of_a_named_call_takes_valid_calls_only(fmt, matcher_tokenizer):
    options = chat_options({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    grammar = tool_call_grammar(fmt, options)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    good, bad = GRAMMAR_GOLDEN[fmt]
    assert accepts(matcher_tokenizer, grammar, good)
    assert not accepts(matcher_tokenizer, grammar, bad)


def test_the_grammar_of_required_takes_any_tool_and_parallel_calls_when_allowed(
        matcher_tokenizer):
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    two = one + "\n" + GRAMMAR_GOLDEN["hermes"][0]
    parallel = tool_call_grammar("hermes", chat_options(
        {"tools": [WEATHER, TIME], "tool_choice": "required"}))
    single = tool_call_grammar("hermes", chat_options(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}))
    assert accepts(matcher_tokenizer, parallel, one) and accepts(matcher_tokenizer, parallel, two)
    assert accepts(matcher_tokenizer, single, one) and not accepts(matcher_tokenizer, single, two)
    assert not accepts(matcher_tokenizer, parallel, "Sure! " + one)


def test_special_markers_are_written_as_token_ids():
    grammar = tool_call_grammar("mistral", chat_options(
        {"tools": [TIME], "tool_choice": "required"}), lambda marker: "<[7]>")
    assert grammar.startswith("start: <[7]> %json ")
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert schema["items"]["properties"]["name"] == {"const": "get_time"}
