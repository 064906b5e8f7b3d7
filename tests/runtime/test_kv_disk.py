"""The disk tier's store: entries keyed by the prefix hash chain, written whole or not
at all, checked on every read (truncated, bit-flipped, foreign, oversized, unreadable,
misnamed: a miss, removed, never loaded), one server per directory, bounded by bytes
with LRU eviction, the index rebuilt from names and sizes alone."""

import os
import random
import subprocess
import sys

import pytest

from mlxd.runtime import kv_disk
from mlxd.runtime.kv_disk import (ArrayBytes, Entry, KVDiskStore, StoreLocked, clear_all,
                                  fingerprint, parse_name, summary)
from mlxd.runtime.prefix_hash import PREFIX_BLOCK, ROOT_HASH, block_hashes

FP = fingerprint("config-a", "weights-a", "float16")


def run_of(tokens: list[int], start_block: int, blocks: int, payload: int = 256) -> Entry:
    """The entry for blocks [start_block, start_block + blocks) of `tokens`."""
    hashes = block_hashes(tokens)
    parent = ROOT_HASH if start_block == 0 else hashes[start_block - 1]
    end = hashes[start_block + blocks - 1]
    run = tokens[start_block * PREFIX_BLOCK:(start_block + blocks) * PREFIX_BLOCK]
    rng = random.Random(end)
    arrays = (ArrayBytes("k0", "float16", (2, len(run), 4), rng.randbytes(payload)),
              ArrayBytes("v0", "float16", (2, len(run), 4), rng.randbytes(payload)))
    return Entry(parent, end, tuple(run), arrays)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50000) for _ in range(n)]


@pytest.fixture
def store(tmp_path):
    s = KVDiskStore(tmp_path, FP, 1 << 20)
    yield s
    s.close()


def test_a_run_written_is_read_back_whole(store):
    tokens = prompt(64)
    entry = run_of(tokens, 0, 4)
    name = store.put(entry)
    assert store.get(name, list(entry.tokens)) == entry
    assert parse_name(name) == (ROOT_HASH, entry.end, 64, True)


def test_match_follows_the_chain_as_far_as_the_prompt_goes(store):
    tokens = prompt(160)
    store.put(run_of(tokens, 0, 4))
    store.put(run_of(tokens, 4, 2))
    store.put(run_of(tokens, 4, 1))     # a shorter run from the same place
    store.put(run_of(tokens, 6, 3))
    hashes = block_hashes(tokens)
    names = store.match(hashes)
    assert [parse_name(n)[2] for n in names] == [64, 32, 48]   # the longest each step
    assert store.match(hashes, start_block=4) == names[1:]
    other = tokens[:80] + prompt(80, seed=9)                   # diverges in block 5
    assert [parse_name(n)[2] for n in store.match(block_hashes(other))] == [64, 16]
    assert store.match(block_hashes(prompt(160, seed=3))) == []


def test_the_index_is_rebuilt_from_names_after_a_restart(tmp_path):
    tokens = prompt(64)
    first = KVDiskStore(tmp_path, FP, 1 << 20)
    name = first.put(run_of(tokens, 0, 4))
    (first.dir / f"{name}.123.tmp").write_bytes(b"half a write")   # a crash mid-write
    first.close()
    again = KVDiskStore(tmp_path, FP, 1 << 20)
    assert list(again.index.entries) == [name]
    assert not [p for p in again.dir.iterdir() if p.name.endswith(".tmp")]
    assert again.get(name) == run_of(tokens, 0, 4)
    again.close()


def test_one_server_per_directory(tmp_path, store):
    with pytest.raises(StoreLocked, match="in use by another mlxd server"):
        KVDiskStore(tmp_path, FP, 1 << 20)
    # another process too (flock is per open file, across processes)
    code = ("import sys\nfrom mlxd.runtime.kv_disk import KVDiskStore, StoreLocked\n"
            f"try:\n    KVDiskStore({str(tmp_path)!r}, 'x', 1)\nexcept StoreLocked:\n"
            "    sys.exit(3)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 3
    store.close()
    KVDiskStore(tmp_path, FP, 1 << 20).close()


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bit-flipped payload":
        data[-7] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "bit-flipped header":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "unreadable":   # open() fails (as root, chmod would not stop a read)
        path.unlink()
        path.symlink_to(path.parent / "nowhere")


@pytest.mark.parametrize("how", ["truncated", "empty", "bit-flipped payload",
                                 "bit-flipped header", "garbage", "unreadable"])
def test_a_damaged_file_is_a_miss_logged_and_removed(store, how, caplog):
    entry = run_of(prompt(64), 0, 4)
    name = store.put(entry)
    _damage(store.dir / name, how)
    assert store.get(name) is None
    assert "not usable" in caplog.text
    assert name not in store.index
    assert not os.path.lexists(store.dir / name)
    assert store.put(entry) == name and store.get(name) == entry   # written again


def test_another_models_file_is_never_loaded(tmp_path):
    tokens = prompt(64)
    other = KVDiskStore(tmp_path / "b", fingerprint("config-b", "weights-b", "float16"),
                        1 << 20)
    name = other.put(run_of(tokens, 0, 4))
    other.close()
    store = KVDiskStore(tmp_path / "a", FP, 1 << 20)
    (store.dir / name).write_bytes((other.dir / name).read_bytes())   # copied in
    store.rebuild()
    assert store.match(block_hashes(tokens)) == [name]   # named right, but
    assert store.get(name) is None and not (store.dir / name).exists()
    store.close()


def test_a_file_whose_tokens_do_not_hash_to_its_name_is_refused(store):
    tokens = prompt(64)
    entry = run_of(tokens, 0, 4)
    forged = Entry(entry.parent, entry.end, tuple(prompt(64, seed=5)), entry.arrays)
    name = kv_disk.entry_name(entry.parent, entry.end, 64)
    (store.dir / name).write_bytes(kv_disk.encode_entry(forged, FP))
    store.rebuild()
    assert store.get(name) is None


def test_an_oversized_file_is_refused_without_reading_it_whole(tmp_path):
    store = KVDiskStore(tmp_path, FP, 4096)
    entry = run_of(prompt(64), 0, 4)
    name = store.put(entry)
    with open(store.dir / name, "ab") as f:
        f.write(b"\0" * 8192)
    store.rebuild()
    assert store.get(name) is None
    store.close()


def test_the_bound_evicts_the_least_recently_used(tmp_path):
    clock = iter(range(1000)).__next__
    tokens = prompt(16 * 12)
    sizes = [len(kv_disk.encode_entry(run_of(tokens, k, 1), FP)) for k in range(3)]
    store = KVDiskStore(tmp_path, FP, sum(sizes) + 10, clock=clock)   # room for three
    names = [store.put(run_of(tokens, k, 1)) for k in range(3)]
    store.get(names[0])                        # used again: now the newest
    fourth = store.put(run_of(tokens, 3, 1))
    assert set(store.index.entries) == {names[0], names[2], fourth}
    assert store.nbytes <= store.max_bytes
    assert store.put(run_of(tokens, 0, 12, payload=4096)) is None   # larger than the bound
    store.close()


def test_a_failed_write_leaves_nothing(store, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kv_disk.os, "fsync", full)
    assert store.put(run_of(prompt(64), 0, 4)) is None
    assert not store.index and list(store.dir.iterdir()) == []


def test_hash_collisions_are_caught_by_the_tokens(store):
    tokens = prompt(64)
    name = store.put(run_of(tokens, 0, 4))
    assert store.get(name, prompt(64, seed=8)) is None
    assert name in store.index   # the entry itself is fine


def test_ls_and_clear(tmp_path):
    store = KVDiskStore(tmp_path, FP, 1 << 20)
    tokens = prompt(96)
    store.put(run_of(tokens, 0, 4))
    store.put(run_of(tokens, 4, 2))
    [(fp, entries, n_tokens, nbytes)] = summary(tmp_path)
    assert (fp, entries, n_tokens) == (FP, 2, 96) and nbytes == store.nbytes
    with pytest.raises(StoreLocked):
        clear_all(tmp_path)   # not while a server holds it
    store.close()
    assert clear_all(tmp_path) == 2
    assert summary(tmp_path) == []
