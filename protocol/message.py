"""`message`: a dataclass whose wire form is derived from its field declarations.

The wire form of a message is the list of its fields' values in declaration
order (nested messages as their own lists). `to_wire`, `from_wire` and
`as_dict` are built once, when the class is defined, from the fields' kinds
(protocol/fields.py); a class may add `check(self)` for rules across fields,
run after its fields decoded. `as_dict` is shallow: nested messages stay objects.
"""

import dataclasses

from .codec import ProtocolError
from .fields import WIRE, Int, Kind, Opt


def message(cls=None, *, rid_in_errors: bool = False):
    """Class decorator (`@message` or `@message(rid_in_errors=True)`): a slotted
    dataclass with generated wire methods. With `rid_in_errors`, a ProtocolError
    about a frame whose first field (the rid) decoded carries that rid."""
    def build(cls):
        cls = dataclasses.dataclass(slots=True)(cls)
        kinds = wire_fields(cls)
        from_wire = _from_wire(cls, kinds)
        if rid_in_errors:
            from_wire = _naming_rid(from_wire, *next(iter(kinds.items())))
        cls.from_wire = staticmethod(from_wire)
        cls.to_wire = _to_wire(kinds)
        cls.as_dict = _as_dict(kinds)
        return cls
    return build if cls is None else build(cls)


def wire_fields(cls) -> dict[str, Kind]:
    """A message class's fields in wire order, with their kinds."""
    kinds = {}
    for f in dataclasses.fields(cls):
        if WIRE not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with wire()")
        kinds[f.name] = f.metadata[WIRE]
    return kinds


def _as_dict(kinds: dict[str, Kind]):
    items = ", ".join(f"{field!r}: self.{field}" for field in kinds)
    return _compile("as_dict", ["def as_dict(self):", f"    return {{{items}}}"], {})


def _to_wire(kinds: dict[str, Kind]):
    env, values = {}, []
    for i, (field, kind) in enumerate(kinds.items()):
        value = f"self.{field}"
        encoder = _inner(kind).encoder()
        if encoder is not None:
            env[f"e{i}"] = encoder
            value = _maybe_none(kind, value, f"e{i}({value})")
        values.append(value)
    return _compile("to_wire", ["def to_wire(self):",
                                f"    return [{', '.join(values)}]"], env)


def _from_wire(cls, kinds: dict[str, Kind]):
    name, n = cls.__name__, len(kinds)
    env = {"cls": cls, "ProtocolError": ProtocolError}
    values, args = [], []
    checks = []
    for i, (field, kind) in enumerate(kinds.items()):
        env[f"d{i}"] = _inner(kind).decoder(field)
        values.append(f"v{i},")
        if type(kind) is Int:   # checked inline (most of a per-step record's fields); the
            bad = f"type(v{i}) is not int"   # decoder raises the error it names
            if kind.minimum is not None:
                bad += f" or v{i} < {kind.minimum!r}"
            checks.append(f"    if {bad}: d{i}(v{i})")
            args.append(f"v{i}")
        else:
            args.append(_maybe_none(kind, f"v{i}", f"d{i}(v{i})"))
    lines = [
        "def from_wire(fields):",
        "    if type(fields) is not list:",
        f"        raise ProtocolError(f'{name} must be a list, got {{type(fields).__name__}}')",
        f"    if len(fields) != {n}:",
        f"        raise ProtocolError(f'{name}: expected {n} fields, got {{len(fields)}}')",
        f"    {' '.join(values)} = fields" if n else "",
        *checks,
        f"    msg = cls({', '.join(args)})",
        "    msg.check()" if hasattr(cls, "check") else "",
        "    return msg",
    ]
    return _compile("from_wire", lines, env)


def _naming_rid(from_wire, field: str, kind: Kind):
    """from_wire, whose errors carry the frame's first field when it decodes."""
    decode_rid = kind.decoder(field)

    def from_wire_naming_rid(fields):
        try:
            return from_wire(fields)
        except ProtocolError as exc:
            raise ProtocolError(str(exc), rid=_readable_rid(decode_rid, fields)) from None
    return from_wire_naming_rid


def _inner(kind: Kind) -> Kind:
    return kind.kind if isinstance(kind, Opt) else kind


def _maybe_none(kind: Kind, value: str, converted: str) -> str:
    """Optional fields pass None through, inline: they are most of a TokenEntry."""
    return f"(None if {value} is None else {converted})" if isinstance(kind, Opt) else converted


def _compile(name: str, lines: list[str], env: dict):
    """Straight-line code per class, like a hand-written method (dataclasses builds
    __init__ the same way): encode and decode are on the per-step path."""
    exec("\n".join(line for line in lines if line), env)
    return env[name]


def _readable_rid(decode, fields):
    if type(fields) is not list or not fields:
        return None
    try:
        return decode(fields[0])
    except ProtocolError:
        return None
