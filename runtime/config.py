"""Frozen config dataclasses <-> command-line flags.

Every process has one frozen config dataclass. Its fields become `--flag-name`
options whose defaults are the dataclass defaults, and `to_argv` turns a config
back into the flags, so the launcher composes configs and hands them to children.
A field whose type is itself a dataclass (`flags: ServerFlags`) is flattened: its
fields become options too, but only those the config's `PROCESS` reads (see
runtime/flags.py); help texts come from the fields' metadata.
"""

import argparse
import dataclasses
import os
import typing

from .flags import flag_help, secret_env, used_by


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp):
    """`int | None` -> int; plain types pass through."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _options(cls):
    """(field, type, holder) for each option of `cls`: holder is None for its own
    fields, or the name of the dataclass field whose fields (those `cls.PROCESS`
    reads) are flattened into options."""
    process = getattr(cls, "PROCESS", None)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        if not dataclasses.is_dataclass(tp):
            yield f, tp, None
            continue
        inner = typing.get_type_hints(tp)
        for g in dataclasses.fields(tp):
            if used_by(g, process):
                yield g, _base_type(inner[g.name]), f.name


def _bounded(tp, field: dataclasses.Field):
    """`tp`, refusing numbers below the field's declared minimum (or not above it,
    for a positive one); argparse reports the ValueError as a bad value."""
    minimum, positive = field.metadata.get("minimum"), field.metadata.get("positive")
    if minimum is None:
        return tp

    def parse(text: str):
        value = tp(text)
        if value != value or value < minimum or (positive and value == minimum):   # NaN too
            raise argparse.ArgumentTypeError(
                f"must be {'>' if positive else '>='} {minimum}, got {text}")
        return value

    parse.__name__ = tp.__name__
    return parse


def add_config_arguments(parser: argparse.ArgumentParser, cls, helps=None) -> None:
    helps = helps or {}
    for f, tp, _ in _options(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if secret_env(f):
            default = os.environ.get(secret_env(f), default)
        help_text = helps.get(f.name) or flag_help(f)
        if tp is bool:
            parser.add_argument(
                _flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                required=f.default is dataclasses.MISSING, help=help_text)
        else:
            parser.add_argument(
                _flag(f.name), type=_bounded(tp, f), default=default,
                required=f.default is dataclasses.MISSING,
                choices=f.metadata.get("choices"),
                help=f"{help_text} (default: {default})".strip())


def config_from_args(cls, namespace: argparse.Namespace):
    own: dict = {}
    nested: dict[str, dict] = {}
    for f, _, holder in _options(cls):
        target = own if holder is None else nested.setdefault(holder, {})
        target[f.name] = getattr(namespace, f.name)
    hints = typing.get_type_hints(cls)
    for holder, values in nested.items():   # fields the process does not read: defaults
        own[holder] = _base_type(hints[holder])(**values)
    return cls(**own)


def _values(config):
    for f, _, holder in _options(type(config)):
        yield f, getattr(config if holder is None else getattr(config, holder), f.name)


def to_argv(config) -> list[str]:
    """The command line of `config`, secret flags left out (see `secret_environ`)."""
    argv = []
    for f, value in _values(config):
        if value is None or secret_env(f):
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv.append(f"{_flag(f.name)}={value}")   # "=" keeps values like "-x" intact
    return argv


def secret_environ(config) -> dict[str, str]:
    """The environment variables that carry `config`'s secret flags to a child."""
    return {secret_env(f): str(value) for f, value in _values(config) if secret_env(f)}


def parse_config(cls, description: str, argv=None, helps=None):
    parser = argparse.ArgumentParser(description=description)
    add_config_arguments(parser, cls, helps)
    return config_from_args(cls, parser.parse_args(argv))
