"""The compatibility policy (docs/design/http.md, "Compatibility policy"), applied by
one table, `TABLE`, to a request body's JSON before its model validates it.

Each row names a field of an API this server speaks (OpenAI's, Anthropic's, or
another server's well-known extension), where it is (the body, a message, a content
part or block) and what becomes of it:
- `ignored`: it has no effect on a local server; dropped, and said once in the log;
- `mapped`: it has a local meaning; rewritten into the body's own fields (two fields
  that set the same one are a 400: e.g. two output constraints);
- `refused`: it would change the output and this server cannot honour it; a 400 naming
  it and saying what is unsupported.
Nulls are dropped at every depth (`without_nulls`), except inside values that are data
(schemas, tool arguments). A field neither here nor in the body's model stays a 400
naming it (openai_schema.py, anthropic_schema.py)."""

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..constraints import InvalidConstraint, choice_grammar, lark_from_any
from .errors import ApiError, bad_request

log = logging.getLogger("mlxd.http")

CHAT, COMPLETIONS, MESSAGES = "chat", "completions", "messages"
OPENAI = (CHAT, COMPLETIONS)
IGNORED, MAPPED, REFUSED = "ignored", "mapped", "refused"
BODY, MESSAGE, PART = "body", "message", "part"   # where a row's field is
# Keys whose values are data, kept as sent, nulls included (a schema's `"default": null`).
DATA_KEYS = frozenset({"parameters", "input_schema", "schema", "input", "arguments",
                       "chat_template_kwargs", "guided_json", "json", "logit_bias"})
TOP_DATA_KEYS = DATA_KEYS | {"json_schema"}   # llama.cpp's and SGLang's: a schema itself

Fields = dict[str, Any]
Mapping = Callable[[Any, dict], Fields]   # (value, the object it is in) -> fields it sets


@dataclass(frozen=True)
class Rule:
    """What becomes of `name` (a field; for PART rows, a content part's or block's
    `type`) in the APIs `apis`. `note` says why it is ignored, what it maps to, or
    what is unsupported; `to` is a mapped field's mapping; a row with `when` applies
    only to the values it holds for."""

    name: str
    apis: tuple[str, ...]
    policy: str
    note: str
    where: str = BODY
    to: Mapping | None = None
    when: Callable[[Any], bool] | None = None


def _set(field: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapping:
    return lambda value, _: {field: convert(value)}


def _text_only(value) -> bool:
    return value == ["text"]


# ---- mappings ----------------------------------------------------------------------

THINKING_OFF = ("none", "minimal")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


# A reasoning effort's thinking budget in tokens (worker_proc/thinking.py); the
# higher efforts think as long as the model does.
EFFORT_BUDGETS = {"low": 1024, "medium": 8192}


def effort_fields(effort: str, body: dict) -> Fields:
    """What a reasoning effort sets: thinking on or off, its budget (unless the body
    sets one), and the level for templates that read it (gpt-oss's)."""
    fields: Fields = {"enable_thinking": effort not in THINKING_OFF,
                      "chat_template_kwargs": {"reasoning_effort": effort}}
    if effort in EFFORT_BUDGETS and body.get("thinking_budget") is None:
        fields["thinking_budget"] = EFFORT_BUDGETS[effort]
    return fields


def _reasoning_effort(value, body) -> Fields:
    if value not in EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {list(EFFORTS)}, got {value!r}",
                          "reasoning_effort")
    return effort_fields(value, body)


def _functions(value, _) -> Fields:
    if not isinstance(value, list):
        raise bad_request("functions must be a list of function definitions", "functions")
    return {"tools": [{"type": "function", "function": f} for f in value]}


def _function_call(value, _) -> Fields:
    if value in ("none", "auto"):
        return {"tool_choice": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return {"tool_choice": {"type": "function", "function": {"name": value["name"]}}}
    raise bad_request('function_call must be "none", "auto" or {"name": ...}',
                      "function_call")


def _n_predict(value, _) -> Fields:
    """llama.cpp's max_tokens; -1 (no limit there) is the server's default here."""
    return {} if value == -1 else {"max_tokens": value}


def _message_function_call(value, message) -> Fields:
    """An assistant's legacy call as a tool call (its result, a `function` message,
    becomes the `tool` message answering it)."""
    if message.get("tool_calls"):
        return {}
    return {"tool_calls": [{"id": LEGACY_CALL_ID, "type": "function", "function": value}]}


LEGACY_CALL_ID = "call_legacy"


def _function_role(value, message) -> Fields:
    return {"role": "tool", "tool_call_id": LEGACY_CALL_ID} if value == "function" else {}


def _refusal(value, message) -> Fields:
    """A refusal is what the assistant said, where it said nothing else."""
    return {} if message.get("content") else {"content": value}


def _thinking(value, _) -> Fields:
    """Anthropic's thinking: on (enabled, adaptive) or off; enabled's `budget_tokens`
    is the thinking budget."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request('thinking must be {"type": "enabled" | "adaptive" | "disabled"}',
                          "thinking")
    budget = value.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 0):
        raise bad_request("thinking.budget_tokens must be a non-negative integer",
                          "thinking.budget_tokens")
    fields: Fields = {"enable_thinking": kind != "disabled"}
    if kind == "enabled" and budget is not None:
        fields["thinking_budget"] = budget
    return fields


def _output_config(value, _) -> Fields:
    """Anthropic's output_config: its `format` is a constraint; `effort` has no local
    meaning (the ignore is logged by the caller, as for the row's note)."""
    if not isinstance(value, dict):
        raise bad_request("output_config must be an object", "output_config")
    unknown = sorted(set(value) - {"format", "effort"})
    if unknown:
        raise bad_request(f"output_config.{unknown[0]}: this server does not support the "
                          "parameter", f"output_config.{unknown[0]}")
    return {} if "format" not in value else _output_format(value["format"], "output_config.format")


def _output_format(value, where: str = "output_format") -> Fields:
    if not isinstance(value, dict) or value.get("type") != "json_schema" or \
            not isinstance(value.get("schema"), dict):
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', where)
    return {"response_format": _json_format(value["schema"], where)}


# Other servers' structured-output fields, each one response_format.

def _json_format(schema, where: str) -> dict:
    """A JSON schema, sent as an object or as its JSON text (SGLang's, vLLM's)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{where} must be a JSON schema (an object or its JSON text)",
                              where) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", where)
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


def _regex_format(regex, where: str) -> dict:
    if not isinstance(regex, str) or not regex:
        raise bad_request(f"{where} must be a non-empty regular expression", where)
    return {"type": "regex", "regex": regex}


def _choice_format(choices, where: str) -> dict:
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{where} must be a non-empty list of non-empty strings", where)
    return {"type": "grammar", "grammar": choice_grammar(choices)}


def _grammar_format(grammar, where: str) -> dict:
    """A grammar in GBNF (llama.cpp's, vLLM's and SGLang's EBNF) or Lark."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise bad_request(f"{where} must be a non-empty grammar (GBNF or Lark)", where)
    try:
        return {"type": "grammar", "grammar": lark_from_any(grammar)}
    except InvalidConstraint as exc:
        raise bad_request(f"{where}: {exc}", where) from None


def _object_format(flag, where: str) -> dict | None:
    return {"type": "json_object"} if flag is True else None


CONSTRAINTS = {"json": _json_format, "regex": _regex_format, "choice": _choice_format,
               "grammar": _grammar_format, "json_object": _object_format}


def _constraint(kind: str) -> Callable[[str], Mapping]:
    return lambda field: lambda value, _: {"response_format": CONSTRAINTS[kind](value, field)}


def _structured_outputs(value, _) -> Fields:
    """vLLM's {json | regex | choice | grammar | json_object}: exactly one."""
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - set(CONSTRAINTS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]}: this server does not support "
                          f"the parameter (it takes {sorted(CONSTRAINTS)})",
                          f"structured_outputs.{unknown[0]}")
    given = [k for k in CONSTRAINTS if k in value and value[k] is not False]
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {sorted(CONSTRAINTS)}",
                          "structured_outputs")
    kind = given[0]
    return {"response_format": CONSTRAINTS[kind](value[kind], f"structured_outputs.{kind}")}


def _constrained(name: str, kind: str, apis: tuple[str, ...], server: str) -> Rule:
    what = "grammar (GBNF or Lark)" if kind == "grammar" else kind
    return Rule(name, apis, MAPPED, f"{server}'s; a {what} constraint (response_format)",
                to=_constraint(kind)(name))


NO_EFFECT = "no effect on a local server"
TEXT_ONLY = "this server's model reads and writes text only"
LOGPROBS = "logprobs are not supported by the Messages API: use /v1/chat/completions"

TABLE: tuple[Rule, ...] = (
    # (a) no effect on a local server: accepted and ignored
    Rule("store", (CHAT,), IGNORED, "nothing is stored: a completion is not kept"),
    Rule("service_tier", (*OPENAI, MESSAGES), IGNORED, "one tier: " + NO_EFFECT),
    Rule("prompt_cache_key", (*OPENAI,), IGNORED, "prefix caching is automatic"),
    Rule("safety_identifier", (*OPENAI,), IGNORED, NO_EFFECT),
    Rule("metadata", (*OPENAI, MESSAGES), IGNORED, NO_EFFECT),
    Rule("user", (*OPENAI,), IGNORED, NO_EFFECT),
    Rule("verbosity", (CHAT,), IGNORED, "the model's own length is kept"),
    Rule("modalities", (CHAT,), IGNORED, "text is the only output", when=_text_only),
    Rule("cache_prompt", (*OPENAI,), IGNORED, "llama.cpp's; the prefix cache is always on"),
    Rule("context_management", (MESSAGES,), IGNORED,
         "no context editing: the history is used as sent"),
    # (b) a local meaning: mapped
    Rule("reasoning_effort", (CHAT,), MAPPED, "enable_thinking (off for none and minimal), "
         "a thinking budget (low: 1024 tokens, medium: 8192) and the chat template's "
         "reasoning_effort", to=_reasoning_effort),
    Rule("functions", (CHAT,), MAPPED, "tools", to=_functions),
    Rule("function_call", (CHAT,), MAPPED, "tool_choice", to=_function_call),
    Rule("n_predict", (*OPENAI,), MAPPED, "llama.cpp's; max_tokens (-1: the default)",
         to=_n_predict),
    Rule("thinking", (MESSAGES,), MAPPED, "enable_thinking: on for enabled and adaptive, "
         "off for disabled; budget_tokens: the thinking budget", to=_thinking),
    Rule("output_config", (MESSAGES,), MAPPED, "format: response_format json_schema; "
         "effort: ignored", to=_output_config),
    Rule("output_format", (MESSAGES,), MAPPED, "response_format json_schema",
         to=lambda v, _: _output_format(v)),
    Rule("structured_outputs", (*OPENAI,), MAPPED, "vLLM's; response_format",
         to=_structured_outputs),
    _constrained("guided_json", "json", OPENAI, "vLLM"),
    _constrained("guided_regex", "regex", OPENAI, "vLLM"),
    _constrained("guided_choice", "choice", OPENAI, "vLLM"),
    _constrained("guided_grammar", "grammar", OPENAI, "vLLM"),
    _constrained("regex", "regex", OPENAI, "SGLang"),
    _constrained("ebnf", "grammar", OPENAI, "SGLang"),
    _constrained("json_schema", "json", OPENAI, "SGLang's and llama.cpp"),
    _constrained("grammar", "grammar", OPENAI, "llama.cpp"),
    # (c) would change the output, cannot be honoured: refused
    Rule("modalities", (CHAT,), REFUSED, "audio output is not supported: " + TEXT_ONLY),
    Rule("audio", (CHAT,), REFUSED, "audio output is not supported: " + TEXT_ONLY),
    Rule("logprobs", (MESSAGES,), REFUSED, LOGPROBS),
    Rule("top_logprobs", (MESSAGES,), REFUSED, LOGPROBS),
    # (d) what a server's own reply objects carry, sent back in the history
    Rule("refusal", (CHAT,), MAPPED, "the content, where there is none", MESSAGE,
         to=_refusal),
    Rule("annotations", (CHAT,), IGNORED, "citations of an earlier reply", MESSAGE),
    Rule("reasoning", (CHAT,), IGNORED, "an earlier reply's thinking: not re-sent, as "
         "reasoning_content", MESSAGE),
    Rule("function_call", (CHAT,), MAPPED, "tool_calls", MESSAGE, to=_message_function_call),
    Rule("role", (CHAT,), MAPPED, "a function result (role function) is a tool message",
         MESSAGE, to=_function_role, when=lambda v: v == "function"),
    Rule("audio", (CHAT,), REFUSED, "audio is not supported: " + TEXT_ONLY, MESSAGE),
    Rule("role", (MESSAGES,), MAPPED, "a system message among the messages joins the "
         "system prompt", MESSAGE, when=lambda v: v == "system"),
    # content parts (OpenAI) and blocks (Anthropic), by type
    Rule("refusal", (CHAT,), MAPPED, "a text part", PART,
         to=lambda part, _: {"type": "text", "text": part.get("refusal", "")}),
    Rule("image_url", (CHAT,), REFUSED, "image input is not supported: " + TEXT_ONLY, PART),
    Rule("input_audio", (CHAT,), REFUSED, "audio input is not supported: " + TEXT_ONLY, PART),
    Rule("file", (CHAT,), REFUSED, "file input is not supported: " + TEXT_ONLY, PART),
    Rule("image", (MESSAGES,), REFUSED, "image input is not supported: " + TEXT_ONLY, PART),
    Rule("document", (MESSAGES,), REFUSED, "document input is not supported: " + TEXT_ONLY,
         PART),
    Rule("thinking", (MESSAGES,), IGNORED, "an earlier reply's thinking: not re-sent", PART),
    Rule("redacted_thinking", (MESSAGES,), IGNORED, "an earlier reply's thinking: not "
         "re-sent", PART),
)


def rules(api: str, where: str) -> dict[str, list[Rule]]:
    """The table's rows for one API and place, by name (in the table's order)."""
    out: dict[str, list[Rule]] = {}
    for rule in TABLE:
        if api in rule.apis and rule.where == where:
            out.setdefault(rule.name, []).append(rule)
    return out


def _rule(found: dict[str, list[Rule]], name: str, value) -> Rule | None:
    return next((r for r in found.get(name, ()) if r.when is None or r.when(value)), None)


# ---- applying it -------------------------------------------------------------------

def without_nulls(value, data_keys: frozenset = TOP_DATA_KEYS):
    """`value` with the null fields of its objects left out, at every depth; values
    under DATA_KEYS are kept as they are (a list's nulls are kept: they are items)."""
    if isinstance(value, dict):
        return {k: v if k in data_keys else without_nulls(v, DATA_KEYS)
                for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v, DATA_KEYS) for v in value]
    return value


class Compat:
    """Applies TABLE to bodies; says once per field in the log what it ignored."""

    def __init__(self):
        self._logged: set[tuple[str, str]] = set()

    def apply(self, api: str, body: dict) -> dict:
        """`body` (nulls already dropped) with the table applied; raises ApiError."""
        body = self._fields(api, BODY, body, "")
        messages = body.get("messages")
        if isinstance(messages, list):
            body["messages"] = [self._message(api, m, f"messages.{i}")
                                for i, m in enumerate(messages)]
        return body

    def note(self, api: str, name: str, what: str) -> None:
        """Log once that `name` has no effect here."""
        if (api, name) not in self._logged:
            self._logged.add((api, name))
            log.info("%s: %s is accepted and ignored (%s)", api, name, what)

    def _fields(self, api: str, where: str, obj: dict, path: str) -> dict:
        found = rules(api, where)
        out = {k: v for k, v in obj.items() if not _rule(found, k, v)}
        set_by: dict[str, str] = {}
        for name, value in obj.items():
            rule = _rule(found, name, value)
            if rule is None:
                continue
            param = path + name
            if rule.policy == REFUSED:
                raise bad_request(f"{param}: {rule.note}", param)
            if rule.policy == IGNORED:
                self.note(api, param if where == BODY else name, rule.note)
                continue
            if name == "output_config" and "effort" in value:
                self.note(api, "output_config.effort", "no effect on a local server")
            mapped = rule.to(value, obj) if rule.to is not None else {name: value}
            for target, new in mapped.items():
                out[target] = _merged(out, target, new, param, set_by)
                set_by[target] = param
        return out

    def _message(self, api: str, message, path: str):
        if not isinstance(message, dict):
            return message
        message = self._fields(api, MESSAGE, message, path + ".")
        return self._content(api, message, path)

    def _content(self, api: str, holder: dict, path: str) -> dict:
        """`holder`'s content parts (a message's, a tool result's) by the PART rows."""
        content = holder.get("content")
        if isinstance(content, list):
            parts = rules(api, PART)
            holder["content"] = [
                p for p in (self._part(api, parts, part, f"{path}.content.{j}")
                            for j, part in enumerate(content)) if p is not None]
        return holder

    def _part(self, api: str, found: dict, part, param: str):
        kind = part.get("type") if isinstance(part, dict) else None
        rule = _rule(found, kind, part) if isinstance(kind, str) else None
        if rule is None:
            return self._content(api, part, param) if kind == "tool_result" else part
        if rule.policy == REFUSED:
            raise bad_request(f"{param}: {rule.note} (content of type {kind})", param)
        if rule.policy == IGNORED:
            return None
        return rule.to(part, part) if rule.to is not None else part


def _merged(out: dict, target: str, new, param: str, set_by: dict[str, str]):
    """The value `target` gets: `new`, merged into an object already there key by
    key; a value set twice (by the body and a mapped field, or two mapped fields) is
    a 400 naming the field that came second."""
    old = out.get(target)
    if old is None:
        return new
    if isinstance(old, dict) and isinstance(new, dict) and not set(old) & set(new) \
            and target != "response_format":
        return {**old, **new}
    other = set_by.get(target, target)
    what = "both constrain the output: send one" if target == "response_format" else \
        f"both set {target}: send one"
    raise ApiError(400, f"{param} and {other} {what}", param, "invalid_value")
