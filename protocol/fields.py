"""Field kinds: how one field of a message is validated when decoded.

A message declares each field once, `max_new_tokens: int = wire(Int(minimum=1))`;
the kind sits in the field's metadata. At class definition a kind compiles into a decoder
(wire value -> value, raising ProtocolError) and, for nested messages only, an
encoder (value -> wire value); other values are their own wire form.
"""

import dataclasses
from collections.abc import Callable

from .codec import ProtocolError

WIRE = "wire"   # the metadata key holding a field's kind


def wire(kind: "Kind", **field_args):
    """A dataclass field carrying its wire kind; `field_args` go to dataclasses.field."""
    return dataclasses.field(metadata={WIRE: kind}, **field_args)


def _type_error(name: str, what: str, value) -> ProtocolError:
    return ProtocolError(f"{name} must be {what}, got {type(value).__name__}")


class Kind:
    """One kind of field."""

    def decoder(self, name: str) -> Callable:
        """A function: wire value -> field value, or ProtocolError naming `name`."""
        raise NotImplementedError

    def encoder(self) -> Callable | None:
        """A function: field value -> wire value; None where they are the same."""
        return None


class Int(Kind):
    def __init__(self, minimum: int | None = None):
        self.minimum = minimum

    def decoder(self, name):
        minimum = self.minimum

        def decode(value):
            if type(value) is not int:
                raise _type_error(name, "an int", value)
            if minimum is not None and value < minimum:
                raise ProtocolError(f"{name} must be >= {minimum}, got {value}")
            return value
        return decode


class Float(Kind):
    """A number; an int on the wire becomes a float."""

    def decoder(self, name):
        def decode(value):
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise _type_error(name, "a number", value)
        return decode


class Str(Kind):
    """A string; one of `choices` when given, at most `max_len` characters when given."""

    def __init__(self, choices: tuple[str, ...] | None = None, max_len: int | None = None):
        self.choices = choices
        self.max_len = max_len

    def decoder(self, name):
        choices, max_len = self.choices, self.max_len

        def decode(value):
            if type(value) is not str:
                raise _type_error(name, "a string", value)
            if max_len is not None and len(value) > max_len:
                raise ProtocolError(f"{name} must be at most {max_len} characters, "
                                    f"got {len(value)}")
            if choices is not None and value not in choices:
                raise ProtocolError(f"unknown {name} {value!r}")
            return value
        return decode


class Bool(Kind):
    def decoder(self, name):
        def decode(value):
            if type(value) is not bool:
                raise _type_error(name, "a bool", value)
            return value
        return decode


class Map(Kind):
    """A msgpack map of anything (client parameters, stats)."""

    def decoder(self, name):
        def decode(value):
            if type(value) is not dict:
                raise _type_error(name, "a map", value)
            return value
        return decode


class Struct(Kind):
    """A nested message: `cls` is a class built by `message`."""

    def __init__(self, cls):
        self.cls = cls

    def decoder(self, name):
        return self.cls.from_wire

    def encoder(self):
        return self.cls.to_wire


class List(Kind):
    """A list; of `item`s when given, else of anything; at most `max_len` long when
    given. Lists of plain ints and numbers (token ids, logprobs) take a fast path:
    they are per-step data."""

    def __init__(self, item: Kind | None = None, max_len: int | None = None):
        self.item = item
        self.max_len = max_len

    def decoder(self, name):
        if self.max_len is not None:
            return _capped(name, self.max_len, List(self.item).decoder(name))
        item = self.item
        if item is None:
            return _list_decoder(name)
        if type(item) is Int and item.minimum is None:
            return _int_list_decoder(name)
        if type(item) is Float:
            return _number_list_decoder(name)
        decode_item = item.decoder(f"{name}[]")

        def decode(value):
            if type(value) is not list:
                raise _type_error(name, "a list", value)
            return [decode_item(x) for x in value]
        return decode

    def encoder(self):
        encode_item = None if self.item is None else self.item.encoder()
        if encode_item is None:
            return None
        return lambda value: [encode_item(x) for x in value]


def _capped(name, max_len, decode_list):
    def decode(value):
        if type(value) is list and len(value) > max_len:
            raise ProtocolError(f"{name} must hold at most {max_len} items, got {len(value)}")
        return decode_list(value)
    return decode


def _list_decoder(name):
    def decode(value):
        if type(value) is not list:
            raise _type_error(name, "a list", value)
        return value
    return decode


def _int_list_decoder(name):
    def decode(value):
        if type(value) is not list:
            raise _type_error(name, "a list", value)
        for x in value:
            if type(x) is not int:
                raise ProtocolError(f"{name} must hold ints only")
        return value
    return decode


def _number_list_decoder(name):
    """Ints stay ints here (unlike Float alone): converting would copy the list."""
    def decode(value):
        if type(value) is not list:
            raise _type_error(name, "a list", value)
        for x in value:
            if type(x) not in (int, float):
                raise ProtocolError(f"{name} must hold numbers only")
        return value
    return decode


class Opt(Kind):
    """`kind`, or None."""

    def __init__(self, kind: Kind):
        self.kind = kind

    def decoder(self, name):
        decode_kind = self.kind.decoder(name)
        return lambda value: None if value is None else decode_kind(value)

    def encoder(self):
        encode_kind = self.kind.encoder()
        if encode_kind is None:
            return None
        return lambda value: None if value is None else encode_kind(value)
