"""Tool calls and reasoning in a model's output: parsers per model family, picked from
the chat template (docs/design/tool-calling.md)."""
