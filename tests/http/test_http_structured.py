"""response_format over the OpenAI chat API, through the real `openai` package."""

import openai
import pytest

from structured_support import SCHEMA, response_formats, satisfies
from test_http_server import CHAT, model_name


@pytest.fixture
def oai(llama_server):
    with openai.OpenAI(base_url=llama_server.http_url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_is_valid_streamed_or_not(oai, llama_model, stream):
    rf = response_formats()["json_schema"]
    r = oai.chat.completions.create(model=model_name(llama_model), messages=CHAT, seed=4,
                                    temperature=1.0, max_tokens=200, response_format=rf,
                                    stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop" and satisfies("json_schema", text), text


def test_the_regex_and_grammar_extensions_pass_through(oai, llama_model):
    for kind in ("regex", "grammar"):
        r = oai.chat.completions.create(model=model_name(llama_model), messages=CHAT,
                                        temperature=1.0, seed=1, max_tokens=100,
                                        extra_body={"response_format": response_formats()[kind]})
        assert satisfies(kind, r.choices[0].message.content), r.choices[0].message.content


def test_mid_structure_max_tokens_is_length_and_a_bad_schema_a_400(oai, llama_model):
    r = oai.chat.completions.create(model=model_name(llama_model), messages=CHAT,
                                    max_tokens=3, response_format=response_formats()["json_schema"])
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=model_name(llama_model), messages=CHAT, max_tokens=3,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "integer",
                                                                "minimum": "ten"}}})
    assert exc.value.body["param"] == "response_format"
    assert "response_format" in exc.value.body["message"]


def test_a_schema_under_json_object_holds_and_unknown_keys_are_a_400(oai, llama_model):
    """llama.cpp's, Together's and Fireworks' json_object with a schema (issue 23,
    item 5): the schema holds; a key the server does not use is refused by name."""
    ask = dict(model=model_name(llama_model), messages=CHAT, temperature=1.0, max_tokens=200)
    for seed in range(3):
        r = oai.chat.completions.create(**ask, seed=seed, response_format={
            "type": "json_object", "schema": SCHEMA})
        assert satisfies("json_schema", r.choices[0].message.content), r.choices[0]
    for rf in ({"type": "json_object", "json_schema": {"schema": SCHEMA}},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                       "strictly": True}}):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.chat.completions.create(**ask, response_format=rf)
        assert exc.value.body["param"] == "response_format"
        unknown = "json_schema" if rf["type"] == "json_object" else "strictly"
        assert repr(unknown) in exc.value.body["message"]
