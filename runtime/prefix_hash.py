"""Block hashes of token prefixes: how a scheduler names what its radix tree holds and
how the front end's router looks a prompt up (one rule, both import it).

A prefix is cut in blocks of PREFIX_BLOCK tokens; the hash at block k covers tokens
[0, k * PREFIX_BLOCK) and chains the one before it, so two prompts share a hash
exactly where they share every token up to it. blake2b over the ids' bytes: the same
on every machine and Python version (an engine may run elsewhere).
"""

import array
import hashlib

PREFIX_BLOCK = 16   # tokens a hash covers beyond the one before it
ROOT_HASH = 0       # the empty prefix's


def chain(previous: int, block) -> int:
    """The hash of a prefix whose last block is `block` (PREFIX_BLOCK token ids) and
    whose other tokens hash to `previous`: a signed 64-bit int (msgpack's range)."""
    data = previous.to_bytes(8, "little", signed=True) + array.array("q", block).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little",
                          signed=True)


def block_hashes(tokens, start: int = 0, previous: int = ROOT_HASH) -> list[int]:
    """The hashes at the block boundaries of `tokens` after `start`, a boundary whose
    hash is `previous`."""
    assert start % PREFIX_BLOCK == 0
    hashes = []
    for cut in range(start + PREFIX_BLOCK, len(tokens) + 1, PREFIX_BLOCK):
        previous = chain(previous, tokens[cut - PREFIX_BLOCK:cut])
        hashes.append(previous)
    return hashes
