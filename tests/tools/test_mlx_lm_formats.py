"""mlx_lm's tool-call formats (tools/mlx_lm_formats.py): each streamed through our
BlockParser finds what the format's own `parse_tool_call` finds; the template
detection agrees with mlx_lm's `_infer_tool_parser`; the forced-call grammars built
for them accept a call and refuse two for a named choice; ours where mlx_lm's is
wrong; and the tokenizer process still loads no MLX."""

import json
import subprocess
import sys

import pytest

from mlxd.tokenizer_proc.params import InvalidRequest
from mlxd.tokenizer_proc.tools import mlx_lm_formats
from mlxd.tokenizer_proc.tools.formats import PARSERS, SAME_FORMAT
from mlxd.tokenizer_proc.tools.grammar import UNFORCED, tool_call_grammar
from mlxd.tokenizer_proc.tools.request import chat_options
from structured_support import grammar_acceptor
from mlxd.tokenizer_proc.tools.syntax import resolve, tool_parser_of

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
GLM = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
       "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>")
# One call of get_weather(city="Paris", days=3) per format, as its module reads it.
REPLIES = {
    "function_gemma": "<start_function_call>call:get_weather{city:<escape>Paris<escape>,"
                      "days:3}<end_function_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
    "glm47": GLM, "laguna": GLM,
    "json_tools": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"days": 3}}</tool_call>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
               '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
               "<|tool_calls_section_end|>",
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
               '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
               '<|open|>argument key="days" type="integer"<|sep|>3<|close|>argument<|sep|>'
               "<|close|>call<|sep|><|close|>tools<|sep|>",
    "longcat": "<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key>"
               "<longcat_arg_value>Paris</longcat_arg_value><longcat_arg_key>days"
               "</longcat_arg_key><longcat_arg_value>3</longcat_arg_value></longcat_tool_call>",
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param>'
                '<param name="days">3</param></function>',
    "minimax_m2": '<minimax:tool_call><invoke name="get_weather"><parameter name="city">'
                  'Paris</parameter><parameter name="days">3</parameter></invoke>'
                  "</minimax:tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "muse_spark": '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter '
                  'name="city">Paris</atem:parameter><atem:parameter name="days">3'
                  "</atem:parameter></atem:invoke></atem:function_calls>",
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}


def streamed(parser_name: str, text: str, piece: int = 3) -> tuple[str, list[tuple]]:
    """The content and calls (name, arguments) of `text` fed in `piece`-sized bits."""
    parser = PARSERS[parser_name]([WEATHER])
    content, calls = [], []
    for at in range(0, len(text), piece):
        out, found = parser.feed(text[at:at + piece])
        content.append(out)
        calls += found
    out, found = parser.finish()
    calls += found
    return "".join(content) + out, [(c.name, json.loads(c.arguments)) for c in calls]


def module_calls(name: str, text: str) -> list[tuple]:
    """What mlx_lm's own parser makes of the block in `text` (markers cut off)."""
    start, end = mlx_lm_formats.markers(name)
    body = text.split(start, 1)[1]
    body = body.rsplit(end, 1)[0] if end else body
    found = mlx_lm_formats.module(name).parse_tool_call(body, [WEATHER])
    return [(c["name"], c["arguments"]) for c in (found if isinstance(found, list) else [found])]


def test_every_mlx_lm_format_has_a_reply_here():
    assert set(REPLIES) == set(mlx_lm_formats.NAMES)
    assert set(mlx_lm_formats.NAMES) <= set(PARSERS)


@pytest.mark.parametrize("name", sorted(REPLIES))
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_reply_gives_the_calls_mlx_lm_finds(name, piece):
    reply = REPLIES[name]
    content, calls = streamed(name, "Let me look. " + reply, piece)
    assert content == "Let me look. "
    assert calls == module_calls(name, reply) == [
        ("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("name", ["pythonic", "kimi_k2", "muse_spark", "minimax_m2"])
def test_two_calls_in_one_block(name):
    two = {"pythonic": '<|tool_call_start|>[get_weather(city="Paris", days=3), '
                       'get_weather(city="Rome", days=1)]<|tool_call_end|>',
           "kimi_k2": REPLIES["kimi_k2"].replace(
               "<|tool_calls_section_end|>", "<|tool_call_begin|>functions.get_weather:1"
               '<|tool_call_argument_begin|>{"city": "Rome", "days": 1}<|tool_call_end|>'
               "<|tool_calls_section_end|>"),
           "muse_spark": REPLIES["muse_spark"].replace(
               "</atem:function_calls>", '<atem:invoke name="get_weather"><atem:parameter '
               'name="city">Rome</atem:parameter><atem:parameter name="days">1'
               "</atem:parameter></atem:invoke></atem:function_calls>"),
           "minimax_m2": REPLIES["minimax_m2"].replace(
               "</minimax:tool_call>", '<invoke name="get_weather"><parameter name="city">'
               'Rome</parameter><parameter name="days">1</parameter></invoke>'
               "</minimax:tool_call>")}[name]
    _, calls = streamed(name, two, 4)
    assert calls == module_calls(name, two) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Rome", "days": 1})]


def test_a_block_mlx_lm_cannot_read_stays_content():
    text = "<|tool_call_start|>not a call<|tool_call_end|>"
    assert streamed("pythonic", text) == (text, [])


# Where ours is kept: mlx_lm's module reads these wrong.
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}


def test_qwen3_coder_is_ours_a_string_null_stays_a_string():
    body = "\n<function=note>\n<parameter=text>\nnull\n</parameter>\n</function>\n"
    assert mlx_lm_formats.module("qwen3_coder").parse_tool_call(body, [NOTE]) == \
        {"name": "note", "arguments": {"text": None}}
    [call] = PARSERS["qwen3_coder"]([NOTE]).parse(body) or []
    assert json.loads(call.arguments) == {"text": "null"}


def test_mistral_is_ours_a_call_id_is_not_the_name():
    body = 'get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 3}'
    assert mlx_lm_formats.module("mistral").parse_tool_call(body)["name"] == "a1b2c3d4e"
    [call] = PARSERS["mistral"]([WEATHER]).parse(body) or []
    assert call.name == "get_weather"


# Template snippets: each names one format (or none), as the families' templates do.
SNIPPETS = [
    "{{ '<minimax:tool_call>' }}", "<|tool_call>call:{{ name }}<tool_call|>",
    "<start_function_call>", "<longcat_tool_call>", "<tool_call>{{ name }}<arg_key>",
    "<|tool_list_start|>", "<|tool_call_start|>", "<tool_call>\\n<function={{ name }}>",
    "<tool_call>\n<function=", "<|tool_calls_section_begin|>",
    '<function name="f"><param name="p">', "[TOOL_CALLS]", "<atem:function_calls>",
    '<tool_call>\n{"name": "{{ tool_call.name }}"', "{{ messages }}",
]


@pytest.mark.parametrize("template", SNIPPETS)
def test_the_template_detection_agrees_with_mlx_lm(template):
    from mlx_lm.tokenizer_utils import _infer_tool_parser   # the real one (MLX is fine here)

    class Shown:
        chat_template = template

        def get_vocab(self):
            return {}
    theirs = _infer_tool_parser(Shown())
    ours = tool_parser_of(template)
    assert ours == (SAME_FORMAT.get(theirs, theirs) if theirs else "hermes")


@pytest.mark.parametrize(("template", "expected"), [
    ('<tool_call>{"name": ...}</tool_call>', "hermes"),
    ("<tool_call><function=", "qwen3_coder"),
    ("<|python_tag|>", "llama3_json"),
])
def test_ours_decide_where_mlx_lm_sees_no_format(template, expected):
    assert mlx_lm_formats.inferred(template) is None
    assert tool_parser_of(template) == expected


def test_the_vocabulary_decides_when_the_template_shows_nothing():
    vocab = {t: i for i, t in enumerate(("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))}
    assert tool_parser_of("{{ messages }}", lambda: vocab) == "kimi_k3"
    lfm = {"<|tool_call_start|>": 1, "<|tool_call_end|>": 2}
    assert resolve("{{ messages }}", vocab=lambda: lfm).tool_parser == "pythonic"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_flag_names_every_format(name):
    assert resolve(None, name).tool_parser == name
    from mlxd.runtime.flags import ServerFlags, flag_help
    import dataclasses
    field = next(f for f in dataclasses.fields(ServerFlags) if f.name == "tool_call_parser")
    assert f"`{name}`" in flag_help(field)


def test_the_parsers_load_without_mlx():
    code = ("import sys; from mlxd.tokenizer_proc.tools import mlx_lm_formats as m, grammar; "
            "[m.module(n) for n in m.NAMES]; m.inferred(''); "
            "assert not [k for k in sys.modules if k.split('.')[0] in ('mlx', 'mlx_lm')]")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- forced calls ---------------------------------------------------------------

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
DATE = {"type": "function", "function": {"name": "get_date", "parameters": {
    "type": "object", "properties": {}}}}
ZONE = '{"zone": "UTC"}'
JSON_CALL = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
K2_CALL = ("<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
           f"{ZONE}<|tool_call_end|>")
K3_CALL = ('<|open|>call tool="get_time"<|sep|><|open|>json type="object"<|sep|>'
           f"{ZONE}<|close|>json<|sep|><|close|>call<|sep|>")
MUSE_CALL = ('<atem:invoke name="get_time"><atem:parameter name="zone">"UTC"'
             "</atem:parameter></atem:invoke>")
# (one call, two calls) of get_time as each forced grammar writes them.
FORCED = {
    "glm47": (f"<tool_call>{JSON_CALL}</tool_call>",) * 2,
    "laguna": (f"<tool_call>{JSON_CALL}</tool_call>",) * 2,
    "longcat": (f"<longcat_tool_call>{JSON_CALL}</longcat_tool_call>",) * 2,
    "kimi_k2": (f"<|tool_calls_section_begin|>{K2_CALL}<|tool_calls_section_end|>",
                f"<|tool_calls_section_begin|>{K2_CALL}{K2_CALL}<|tool_calls_section_end|>"),
    "kimi_k3": (f"<|open|>tools<|sep|>{K3_CALL}<|close|>tools<|sep|>",
                f"<|open|>tools<|sep|>{K3_CALL}{K3_CALL}<|close|>tools<|sep|>"),
    "pythonic": ('<|tool_call_start|>[get_time(zone="UTC", )]<|tool_call_end|>',
                 '<|tool_call_start|>[get_time(zone="UTC", ), get_time(zone="UTC", )]'
                 "<|tool_call_end|>"),
    "muse_spark": (f"<atem:function_calls>{MUSE_CALL}</atem:function_calls>",
                   f"<atem:function_calls>{MUSE_CALL}{MUSE_CALL}</atem:function_calls>"),
}


def two_of(name: str) -> str:
    one, two = FORCED[name]
    return two if two != one else f"{one}\n{one}"   # blocks of their own, a line apart


@pytest.fixture(scope="module")
def accepts(llama_model):
    from mlxd.tokenizer_proc.text import TextCodec
    return grammar_acceptor(TextCodec(llama_model))


def forced(name: str, **params) -> str:
    return tool_call_grammar(name, chat_options({"tools": [TIME, DATE], **params}))


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_forced_call_is_one_call_the_format_reads(accepts, name):
    one = FORCED[name][0]
    named = forced(name, tool_choice=NAMED, parallel_tool_calls=True)
    assert accepts(named, one)
    assert not accepts(named, two_of(name))
    assert streamed(name, one) == ("", [("get_time", {"zone": "UTC"})])


@pytest.mark.parametrize("name", sorted(FORCED))
def test_required_repeats_when_parallel_calls_are_allowed(accepts, name):
    assert accepts(forced(name, tool_choice="required", parallel_tool_calls=True), two_of(name))
    assert not accepts(forced(name, tool_choice="required", parallel_tool_calls=False),
                       two_of(name))
    _, calls = streamed(name, two_of(name))
    assert calls == [("get_time", {"zone": "UTC"})] * 2


@pytest.mark.parametrize("name", UNFORCED)
def test_a_format_without_a_grammar_refuses_forced_calls(name):
    with pytest.raises(InvalidRequest) as refused:
        forced(name, tool_choice="required")
    assert refused.value.param == "tool_choice" and name in str(refused.value)


def test_every_format_is_forced_or_refused():
    from mlxd.tokenizer_proc.tools.grammar import BUILDERS
    assert set(BUILDERS) | set(UNFORCED) == set(PARSERS)
    assert not set(BUILDERS) & set(UNFORCED)
