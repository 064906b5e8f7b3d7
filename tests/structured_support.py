"""Constraints for the structured-output tests, and a small JSON schema validator
(the keywords these schemas use) to check the outputs with."""

import json
import re
from typing import Callable

# An object with required keys, enums, nested arrays and bounded numbers. Every
# string is an enum and every array bounded, so a random model's output stays short.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "level": {"type": "integer", "minimum": -5, "maximum": 5},
        "grid": {"type": "array", "maxItems": 3, "items": {
            "type": "array", "minItems": 1, "maxItems": 2,
            "items": {"enum": ["x", "y", 1]}}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "grid"],
    "additionalProperties": False,
}

REGEX = r"(cat|dog)-[0-9]{2,4}"
LARK = 'start: "(" item (" " item)* ")"\nitem: "a" | "bb" | NUMBER\nNUMBER: /[0-9]{1,3}/\n'
LARK_TEXT = re.compile(r"\((a|bb|[0-9]{1,3})( (a|bb|[0-9]{1,3}))*\)")


def response_formats() -> dict:
    """A response_format of each kind, by name."""
    return {
        "json_schema": {"type": "json_schema",
                        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        "regex": {"type": "regex", "regex": REGEX},
        "grammar": {"type": "grammar", "grammar": LARK},
    }


def satisfies(kind: str, text: str) -> bool:
    """Whether `text` is an output the response_format of `kind` allows."""
    if kind == "json_schema":
        try:
            return not schema_errors(json.loads(text), SCHEMA)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return LARK_TEXT.fullmatch(text) is not None


_TYPES = {"object": dict, "array": list, "boolean": bool, "string": str}


def _type_ok(value, kind: str) -> bool:
    if kind == "integer":
        return type(value) is int
    if kind == "number":
        return type(value) in (int, float)
    return isinstance(value, _TYPES[kind])


def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    """What `value` breaks of `schema` (type, enum, minimum/maximum, required,
    properties, additionalProperties: false, items, minItems/maxItems)."""
    if "enum" in schema:
        ok = any(value == e and type(value) is type(e) for e in schema["enum"])
        return [] if ok else [f"{path}: {value!r} not in the enum"]
    if "type" in schema and not _type_ok(value, schema["type"]):
        return [f"{path}: {value!r} is not of type {schema['type']}"]
    errors = []
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} below the minimum")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} above the maximum")
    if isinstance(value, dict):
        errors += _object_errors(value, schema, path)
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{path}: {len(value)} items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    return errors


def _object_errors(value: dict, schema: dict, path: str) -> list[str]:
    properties = schema.get("properties", {})
    errors = [f"{path}: {key} is missing" for key in schema.get("required", ())
              if key not in value]
    for key, item in value.items():
        if key in properties:
            errors += schema_errors(item, properties[key], f"{path}.{key}")
        elif schema.get("additionalProperties", True) is False:
            errors.append(f"{path}: unexpected key {key}")
    return errors


def grammar_acceptor(codec) -> Callable[[str, str], bool]:
    """accepts(grammar, text): whether llguidance lets the grammar take `text` (encoded
    by `codec`'s tokenizer) as a whole reply, as the worker's matcher would."""
    from llguidance import LLMatcher

    from mlxd.tokenizer_proc.constraints import ConstraintCompiler

    compiler = ConstraintCompiler(codec)

    def accepts(grammar: str, text: str) -> bool:
        matcher = LLMatcher(compiler._ll_tokenizer(), grammar, log_level=0)
        ids = codec.tokenizer.encode(text, add_special_tokens=False)
        return (matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting())
    return accepts
