"""A tiny model whose chat template renders tools, tool calls and results in the
Hermes format and thinks in <think> (enable_thinking=False closes the block; the
kwarg open_thinking opens it in the prompt, as DeepSeek-R1's template does)."""

import json
import shutil

import pytest

TOOL_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|system|>Tools:{% for t in tools %} "
    "{{ t.function.name }}{% endfor %}</s>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}"
    "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response></s>"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>{% endif %}{% if open_thinking %}<think>{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="session")
def tool_model(llama_model, tmp_path_factory) -> str:
    """The tiny llama model with TOOL_TEMPLATE as its chat template."""
    path = tmp_path_factory.mktemp("models") / "llama-tools"
    shutil.copytree(llama_model, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def plain_model(llama_model, tmp_path_factory) -> str:
    """A model of the default model's (SmolLM2's) kind: its chat template has no tools
    branch, its vocabulary no `<tool_call>` token, and its unknown token is a special
    one (SmolLM2's is `<|endoftext|>`), which is what a lookup of a marker it lacks
    returns."""
    path = tmp_path_factory.mktemp("models") / "llama-plain"
    shutil.copytree(llama_model, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "unk_token": "<pad>"}))
    return str(path)


@pytest.fixture(scope="session")
def thinking_model(tool_model, tmp_path_factory) -> str:
    """The tool model, its template opening the think block whenever thinking is on
    (as DeepSeek-R1's does): a random model then thinks until the token limit."""
    path = tmp_path_factory.mktemp("models") / "llama-thinks"
    shutil.copytree(tool_model, path)
    opens = TOOL_TEMPLATE.replace("{% if open_thinking %}<think>{% endif %}",
                                  "{% if enable_thinking is not defined or enable_thinking %}"
                                  "<think>{% endif %}")
    assert opens != TOOL_TEMPLATE
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": opens}))
    return str(path)
