"""Frozen config dataclasses <-> command-line flags.

Every process has one frozen config dataclass. Its fields become `--flag-name`
options whose defaults are the dataclass defaults, and `to_argv` turns a config
back into the flags, so launch.py composes configs and hands them to children.
"""

import argparse
import dataclasses
import typing


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp):
    """`int | None` -> int; plain types pass through."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_config_arguments(parser: argparse.ArgumentParser, cls, helps=None) -> None:
    helps = helps or {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = helps.get(f.name, "")
        if tp is bool:
            parser.add_argument(
                _flag(f.name), action=argparse.BooleanOptionalAction, default=default,
                required=f.default is dataclasses.MISSING, help=help_text)
        else:
            parser.add_argument(
                _flag(f.name), type=tp, default=default,
                required=f.default is dataclasses.MISSING,
                help=f"{help_text} (default: {default})".strip())


def config_from_args(cls, namespace: argparse.Namespace):
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def to_argv(config) -> list[str]:
    argv = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv.append(f"{_flag(f.name)}={value}")   # "=" keeps values like "-x" intact
    return argv


def parse_config(cls, description: str, argv=None, helps=None):
    parser = argparse.ArgumentParser(description=description)
    add_config_arguments(parser, cls, helps)
    return config_from_args(cls, parser.parse_args(argv))
