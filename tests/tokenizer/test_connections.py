"""tokenizer_proc/connections.py: identities by the connection they came in on."""

from mlxd.tokenizer_proc.connections import Connections


def test_a_connections_end_forgets_its_identities_only():
    c = Connections()
    c.seen(b"a", 7)
    c.seen(b"b", 7)
    c.seen(b"c", 8)
    assert b"a" in c and len(c) == 3
    assert c.closed(7) == [b"a", b"b"]
    assert b"a" not in c and b"c" in c
    assert c.closed(7) == [] and c.closed(99) == []


def test_an_identity_that_moves_to_another_connection_follows_it():
    c = Connections()
    c.seen(b"a", 7)
    c.seen(b"a", 9)   # the same identity reconnected on another descriptor
    assert c.closed(7) == []
    assert c.closed(9) == [b"a"]


def test_a_reused_descriptor_starts_empty():
    c = Connections()
    c.seen(b"old", 5)
    assert c.closed(5) == [b"old"]
    c.seen(b"new", 5)
    assert c.closed(5) == [b"new"]
