"""Cases generated from the message declarations, so a new message is covered as soon
as protocol/ exports it: it round-trips, and a frame with a field missing, an extra
field, or two differently-typed fields swapped is a ProtocolError."""

import dataclasses
import itertools

import msgpack
import pytest

from mlxd import protocol
from mlxd.protocol import Decoder, ProtocolError, encode
from mlxd.protocol.fields import Bool, Float, Int, List, Map, Opt, Str, Struct, wire
from mlxd.protocol.message import message, wire_fields

MESSAGES = sorted((cls for cls in vars(protocol).values()
                   if isinstance(cls, type) and hasattr(cls, "from_wire")),
                  key=lambda cls: cls.__name__)


def example(kind):
    """A valid, non-None wire value of `kind`. Lists hold two items, so the fields a
    message keeps aligned (rids and tokens, input_ids and slots) agree."""
    if isinstance(kind, Opt):
        return example(kind.kind)
    if isinstance(kind, Struct):
        return example_wire(kind.cls)
    if isinstance(kind, List):
        return [None, None] if kind.item is None else [example(kind.item)] * 2
    if isinstance(kind, Int):
        return max(3, kind.minimum or 0)
    if isinstance(kind, Str):
        return kind.choices[0] if kind.choices else "text"
    return {Float: 0.5, Bool: True, Map: {"key": 1}}[type(kind)]


def example_wire(cls) -> list:
    fields = {name: example(kind) for name, kind in wire_fields(cls).items()}
    if "runs" in fields:   # tokens per row: one each keeps the two rows' tokens aligned
        fields["runs"] = [1, 1]
    if "run" in fields and "slot_ids" in fields:   # a spill's run is as long as its tokens
        fields["run"][2] = 2
    if "model_draft" in fields:   # a DecodeRow's drafts come from the worker's draft
        fields["model_draft"], fields["draft"] = 2, []   # model (two, as its slots): none sent
    return list(fields.values())


def wire_type(kind):
    """What a field holds on the wire, optional or not: fields of different wire
    types must not accept each other's values."""
    if isinstance(kind, Opt):
        return wire_type(kind.kind)
    if isinstance(kind, List):
        return ("list", None if kind.item is None else wire_type(kind.item))
    if isinstance(kind, Struct):
        return kind.cls
    return type(kind)


def decode(cls, fields: list):
    """Through msgpack, and through a Decoder when the class is a tagged message."""
    if hasattr(cls, "TAG"):
        return Decoder(cls).decode(msgpack.packb([cls.TAG, *fields], use_bin_type=True))
    return cls.from_wire(msgpack.unpackb(msgpack.packb(fields, use_bin_type=True)))


def accepts(target, source) -> bool:
    """Whether a field of wire type `target` takes the example value of one of type
    `source`: a number field takes an int; a list, another list (a nested message
    is one) whose items it takes."""
    if target == source or (target, source) == (Float, Int):
        return True
    if not (isinstance(target, tuple) and target[0] == "list"):
        return False
    if isinstance(source, type) and hasattr(source, "from_wire"):
        items = [wire_type(kind) for kind in wire_fields(source).values()]
    elif isinstance(source, tuple):
        items = [source[1]]
    else:
        return False
    return target[1] is None or all(item is not None and accepts(target[1], item)
                                    for item in items)


def swaps(cls):
    kinds = list(wire_fields(cls).values())
    return [(a, b) for a, b in itertools.combinations(range(len(kinds)), 2)
            if wire_type(kinds[a]) != wire_type(kinds[b])]


def foreign_values(cls):
    """(field, other field) pairs where the field must refuse the other's value."""
    types = [wire_type(kind) for kind in wire_fields(cls).values()]
    return [(a, b) for a, b in itertools.permutations(range(len(types)), 2)
            if not accepts(types[a], types[b])]


SWAPS = [(cls, a, b) for cls in MESSAGES for a, b in swaps(cls)]
FOREIGN = [(cls, a, b) for cls in MESSAGES for a, b in foreign_values(cls)]


def test_every_message_is_found():
    names = {cls.__name__ for cls in MESSAGES}
    assert {"Step", "StepResult", "StepTiming", "TokenBatch", "TokenEntry", "Usage",
            "WorkerReady", "WorkerLimits", "SchedulerReady", "Ready"} <= names
    assert all(cls.__name__ in protocol.__all__ for cls in MESSAGES)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_example_round_trips(cls):
    fields = example_wire(cls)
    msg = decode(cls, fields)
    assert type(msg) is cls and msg.to_wire() == fields
    assert decode(cls, msg.to_wire()) == msg
    if hasattr(cls, "TAG"):
        assert Decoder(cls).decode(encode(msg)) == msg


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_missing_field_is_rejected(cls):
    fields = example_wire(cls)
    for i in range(len(fields)):
        with pytest.raises(ProtocolError, match="expected"):
            decode(cls, fields[:i] + fields[i + 1:])


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_an_extra_field_is_rejected(cls):
    fields = example_wire(cls)
    for extra in (None, fields[-1], 0):
        with pytest.raises(ProtocolError, match="expected"):
            decode(cls, fields + [extra])


@pytest.mark.parametrize("cls,a,b", SWAPS,
                         ids=[f"{cls.__name__}[{a}<->{b}]" for cls, a, b in SWAPS])
def test_two_differently_typed_fields_swapped_are_rejected(cls, a, b):
    fields = example_wire(cls)
    fields[a], fields[b] = fields[b], fields[a]
    with pytest.raises(ProtocolError):
        decode(cls, fields)


@pytest.mark.parametrize("cls,a,b", FOREIGN,
                         ids=[f"{cls.__name__}[{a}]={b}" for cls, a, b in FOREIGN])
def test_a_field_refuses_another_fields_value_of_a_different_type(cls, a, b):
    fields = example_wire(cls)
    fields[a] = fields[b]
    with pytest.raises(ProtocolError):
        decode(cls, fields)


def test_only_messages_of_one_wire_type_have_no_swap_cases():
    """The swap cases are not vacuous: each message whose fields are not all of one
    wire type (or that has one field) contributes some."""
    without = {cls.__name__ for cls in MESSAGES} - {cls.__name__ for cls, _, _ in SWAPS}
    assert without == {"Abort", "AbortRequest", "ErrorReply", "GetStats", "ModelControl",
                       "ModelLoadFailed", "Pin", "Ready", "StatsRequest", "Usage",
                       "WorkerReady"}


# ---- the declaration machinery itself ------------------------------------------------

def test_wire_order_is_declaration_order():
    @message
    class Pair:
        TAG = 99
        second_name: str = wire(Str())
        first_count: int = wire(Int(minimum=0), default=0)

    assert Pair("a", 2).to_wire() == ["a", 2]
    assert Pair.from_wire(["a", 2]) == Pair("a", 2)
    assert Pair("a").as_dict() == {"second_name": "a", "first_count": 0}
    with pytest.raises(ProtocolError, match="first_count must be >= 0"):
        Pair.from_wire(["a", -1])


def test_check_runs_after_the_fields_decode():
    @message
    class Range:
        low: int = wire(Int())
        high: int = wire(Int())

        def check(self):
            if self.low > self.high:
                raise ProtocolError("low > high")

    assert Range.from_wire([1, 2]) == Range(1, 2)
    with pytest.raises(ProtocolError, match="low > high"):
        Range.from_wire([2, 1])


def test_a_field_without_a_wire_kind_is_a_declaration_error():
    with pytest.raises(TypeError, match="wire"):
        @message
        class Loose:
            rid: int = wire(Int())
            note: str = dataclasses.field(default="")


def test_errors_carry_the_rid_only_where_asked():
    @message(rid_in_errors=True)
    class Named:
        rid: str = wire(Str())
        n: int = wire(Int())

    @message
    class Plain:
        rid: str = wire(Str())
        n: int = wire(Int())

    for fields in (["x", "1"], ["x"], ["x", 1, 2]):
        with pytest.raises(ProtocolError) as named:
            Named.from_wire(fields)
        with pytest.raises(ProtocolError) as plain:
            Plain.from_wire(fields)
        assert named.value.rid == "x" and plain.value.rid is None
    with pytest.raises(ProtocolError) as unreadable:
        Named.from_wire([7, 1])
    assert unreadable.value.rid is None


def test_nested_lists_of_messages_encode_as_lists():
    @message
    class Inner:
        value: float = wire(Float())

    @message
    class Outer:
        items: list = wire(List(Struct(Inner)))
        maybe: Inner | None = wire(Opt(Struct(Inner)), default=None)

    outer = Outer([Inner(0.5), Inner(1.5)], Inner(2.0))
    assert outer.to_wire() == [[[0.5], [1.5]], [2.0]]
    assert Outer.from_wire(outer.to_wire()) == outer
    assert Outer([]).to_wire() == [[], None]
    with pytest.raises(ProtocolError):
        Outer.from_wire([[[0.5], ["x"]], None])
