"""The radix tree's block hashes and cache events (what the front end's router learns
of an engine's prefix cache): after any mix of inserts, splits, evictions and resets,
the tree's hashes are exactly the block hashes of its paths, and replaying the events
reproduces that set."""

import random

from mlxd.runtime.prefix_hash import PREFIX_BLOCK, block_hashes, chain
from mlxd.scheduler_proc.radix_cache import RadixCache


def path_hashes(tree: RadixCache) -> set[int]:
    """Every block hash of every root-to-node path, computed from the tokens."""
    out = set()
    stack = [(child, list(child.key)) for child in tree.root.children.values()]
    while stack:
        node, tokens = stack.pop()
        out.update(block_hashes(tokens))
        stack.extend((c, tokens + c.key) for c in node.children.values())
    return out


class Replica:
    """What a router rebuilds from the events."""

    def __init__(self):
        self.held: set[int] = set()

    def apply(self, tree: RadixCache) -> None:
        reset, stored, removed = tree.events.take()
        if reset:
            self.held.clear()
        self.held -= set(removed)
        self.held |= set(stored)


def test_hashes_chain_per_block_and_ignore_a_partial_block():
    tokens = list(range(40))
    hashes = block_hashes(tokens)
    assert len(hashes) == 40 // PREFIX_BLOCK
    assert hashes[1] == chain(hashes[0], tokens[PREFIX_BLOCK:2 * PREFIX_BLOCK])
    assert block_hashes(tokens[:32]) == hashes
    other = list(tokens)
    other[3] += 1   # a change in the first block changes every later hash
    assert not set(block_hashes(other)) & set(hashes)


def test_a_split_keeps_each_boundary_on_the_node_that_ends_past_it():
    tree, replica = RadixCache(lambda slots: None), Replica()
    a = list(range(50))
    tree.insert(a, list(range(1, 51)))
    tree.insert(a[:20] + [999] * 30, list(range(100, 150)))   # splits at 20
    tree.check_integrity()
    replica.apply(tree)
    assert set(tree.all_hashes()) == path_hashes(tree) == replica.held


def test_random_workload_events_replay_to_the_tree_s_hashes():
    rng = random.Random(7)
    for _ in range(20):
        freed = []
        tree, replica = RadixCache(freed.extend), Replica()
        next_slot = 1
        prompts = [[rng.randrange(6) for _ in range(rng.randrange(1, 80))] for _ in range(8)]
        for _ in range(60):
            op = rng.random()
            if op < 0.6:
                tokens = rng.choice(prompts)[:rng.randrange(1, 80)]
                tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(0, 20))]
                slots = list(range(next_slot, next_slot + len(tokens)))
                next_slot += len(tokens)
                tree.insert(tokens, slots)
            elif op < 0.7:
                tree.match_prefix(rng.choice(prompts)[:rng.randrange(1, 80)])   # may split
            elif op < 0.97:
                tree.evict(rng.randrange(1, 40))
            else:
                tree.reset()
            tree.check_integrity()
            if rng.random() < 0.5:
                replica.apply(tree)
                assert replica.held == path_hashes(tree) == set(tree.all_hashes())
