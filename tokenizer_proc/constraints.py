"""`response_format`: a request's output constraint, checked and compiled into an
llguidance grammar before any compute.

Accepted (OpenAI's shape plus three extensions); any other key is refused:
  {"type": "text"}                     no constraint
  {"type": "json_object"}              any JSON object
  {"type": "json_object", "schema": {...}}   as json_schema (llama.cpp's, Together's shape)
  {"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}
  {"type": "regex", "regex": "..."}
  {"type": "grammar", "grammar": "<Lark, llguidance's flavour; %json {...} embeds a schema>"}

`parse_response_format` checks the shape (cheap, no tokenizer); `ConstraintCompiler`
compiles the grammar against the model's vocabulary (JSON schemas with their objects
closed where they leave them open: `closed_objects`) and refuses one that does not
compile or that no token can start. The worker compiles the same grammar text again
into its own matcher (worker_proc/grammar.py). llguidance is imported here only, never
MLX (the tokenizer process must not import it).
"""

import json
import threading
from dataclasses import dataclass

# JSON as json.dumps writes it: one space after ':' and ','. A schema's own
# "x-guidance" options override these. Fixed whitespace keeps a sampled model from
# spending its tokens on indentation.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 400   # llguidance's messages can quote a whole grammar
KINDS = ("text", "json_object", "json_schema", "regex", "grammar")
# The keys each type takes besides `type`, and those of `json_schema` (OpenAI's).
FIELDS = {"text": (), "json_object": ("schema",), "json_schema": ("json_schema",),
          "regex": ("regex",), "grammar": ("grammar",)}
JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")


class InvalidConstraint(ValueError):
    """A response_format that is malformed or does not compile; the message names
    response_format and the problem."""


@dataclass(frozen=True)
class Constraint:
    """A parsed response_format: `kind` and its source (a schema dict, a regex or a
    Lark grammar)."""

    kind: str
    source: dict | str

    @property
    def chars(self) -> int:
        """The source's size: what compiling it costs, roughly."""
        return len(self.source) if isinstance(self.source, str) else len(json.dumps(self.source))


def _fail(message: str) -> InvalidConstraint:
    return InvalidConstraint(f"response_format: {message}")


def parse_response_format(value) -> Constraint | None:
    """The constraint `value` asks for; None for none (absent or `text`). Raises
    InvalidConstraint naming response_format for anything malformed, and for any key
    it does not use (a constraint silently dropped would pass any output)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in KINDS:
        raise _fail(f"must be an object whose type is one of {list(KINDS)}, got {value!r:.200}")
    kind = value["type"]
    _known_keys(value, ("type", *FIELDS[kind]), f"type {kind}")
    if kind == "text":
        return None
    if kind == "json_object":   # llama.cpp's, Together's and Fireworks' schema here
        if "schema" not in value:
            return Constraint(kind, {"type": "object"})
        return Constraint("json_schema", _schema({"schema": value["schema"]}, "schema"))
    if kind == "json_schema":
        return Constraint(kind, _schema(value.get("json_schema")))
    source = value.get(kind)
    if not isinstance(source, str) or not source:
        raise _fail(f"type {kind} needs a non-empty string field {kind!r}")
    return Constraint(kind, source)


def _known_keys(given: dict, known: tuple, where: str) -> None:
    unknown = sorted(set(given) - set(known), key=str)
    if unknown:
        raise _fail(f"{where} does not take {', '.join(map(repr, unknown))} (it takes "
                    f"{', '.join(map(repr, known))})")


def _schema(spec, where: str = "json_schema.schema") -> dict:
    if not isinstance(spec, dict):
        raise _fail("json_schema must be an object: {name, description, schema, strict}")
    _known_keys(spec, JSON_SCHEMA_FIELDS, "json_schema")
    if not all(isinstance(spec.get(k, ""), str) for k in ("name", "description")) or \
            type(spec.get("strict", False)) is not bool:
        raise _fail("json_schema.name and .description must be strings and "
                    "json_schema.strict a boolean")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _fail(f"{where} must be a JSON schema object")
    return schema


# Where a JSON schema holds schemas: one, a map of them by name, or a list of them.
ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "additionalProperties", "unevaluatedItems",
              "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
               "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")


def closed_objects(schema):
    """A copy of `schema` where an object schema that lists properties and does not
    say whether others may follow allows none, as vLLM's guidance backend does in its
    strict mode: tool schemas as LangChain and instructor send them say nothing, and a
    small model then invents keys until max_tokens. `additionalProperties` set either
    way is kept; an object listing no properties stays free-form; `allOf` members are
    left open (closing one part of an intersection would refuse the other parts' keys)."""
    if isinstance(schema, list):   # `items` as a list (older drafts)
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema   # true, false
    out = dict(schema)
    for key in ONE_SCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_open_members(s) for s in out["allOf"]]
    listed = "properties" in out or "patternProperties" in out
    if listed and not {"additionalProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _open_members(schema):
    """An `allOf` member: its own properties stay open, what it nests is closed."""
    if not isinstance(schema, dict):
        return schema
    inner = closed_objects(schema)
    if "additionalProperties" not in schema and "additionalProperties" in inner:
        del inner["additionalProperties"]
    return inner


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for `constraint` (not yet checked)."""
    from llguidance import LLMatcher

    if constraint.kind in ("json_object", "json_schema"):
        try:
            return LLMatcher.grammar_from_json_schema(closed_objects(constraint.source),
                                                      defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise _fail(f"the JSON schema is not valid: {_short(exc)}") from None
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.source)
    return LLMatcher.grammar_from_lark(constraint.source)


def lark_from_any(text: str) -> str:
    """A grammar in llama.cpp's GBNF or in Lark, as Lark in llguidance's flavour
    (llguidance's own converter; Lark passes through). Raises InvalidConstraint."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter raises its own and plain exceptions
        raise InvalidConstraint(f"the grammar is neither Lark nor GBNF that llguidance "
                                f"can convert: {_short(exc)}") from None


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose text is exactly one of `choices`."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_thinking(grammar: str, opened: bool) -> str:
    """`grammar` (llguidance's JSON form) preceded by a think block the model may write
    first (`<think>` ... `</think>`), or must finish first when the prompt `opened`
    one: a reasoning model's constraint starts where its thinking ends. The think text
    is free and ends at the first `</think>` (a text marker: vocabularies where it is
    a special token are not served by this rule)."""
    try:
        inner = json.loads(grammar)
    except ValueError:   # a Lark grammar comes back as its own text
        inner = {"grammars": [{"lark_grammar": grammar}]}
    inner["grammars"][0]["name"] = "constrained"
    start = "start: think_text @constrained" if opened else "start: think? @constrained"
    lark = "\n".join([
        start,
        f"think: {json.dumps(THINK_OPEN)} think_text",
        f"think_text[stop={json.dumps(THINK_CLOSE)}]: /(.|\\n)*/", ""])
    return json.dumps({**inner, "grammars": [{"lark_grammar": lark}, *inner["grammars"]]})


def _short(error) -> str:
    text = str(error).strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class ConstraintCompiler:
    """Compiles constraints against the vocabulary of `codec` (a TextCodec: its Hugging
    Face fast `tokenizer` and `vocab_size`). The llguidance tokenizer is built on first
    use, once (requests may compile on several threads)."""

    def __init__(self, codec):
        self._codec = codec
        self._lock = threading.Lock()
        self._tokenizer = None

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._codec.tokenizer,
                                                               self._codec.vocab_size)
            return self._tokenizer

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar text of `constraint`. Raises InvalidConstraint (naming
        response_format and the problem) if it does not compile, or if no token of
        the vocabulary can start text it allows."""
        from llguidance import LLMatcher

        grammar = grammar_text(constraint)
        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise _fail(f"the {constraint.kind} does not compile: {_short(matcher.get_error())}")
        # a mask with no token to continue with stops the matcher, short of its end
        if not any(matcher.compute_bitmask()) or (matcher.is_stopped()
                                                   and not matcher.is_accepting()):
            raise _fail(f"no token of the model's vocabulary can start text the "
                        f"{constraint.kind} allows")
        return grammar
