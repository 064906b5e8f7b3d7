"""The disk tier of the prefix cache: a directory of KV runs, keyed by the prefix hash
chain (runtime/prefix_hash.py), that outlives the server.

An entry is one run of whole prefix blocks: the tokens after a prefix whose hash is
`parent`, up to the prefix whose hash is `end`, with the arrays that hold their KV
(and whatever else must travel with them: a recurrent state snapshot at the run's
end, window KV), as raw bytes with their dtypes and shapes. Its file name says
`parent`, `end` and the token count, so the index is rebuilt from the directory's
names and sizes alone (time proportional to the entries, not their bytes).

Entries live in a folder per fingerprint (below). Files are written to a temporary
name and renamed (a reader never sees half a file),
and carry a header: a magic, the format version, the fingerprint of what the KV was
computed with (the model's config and weights, the KV dtype or bits, this format), the
tokens, and a blake2b checksum of the payload. Reading checks all of it, and that the
tokens hash from `parent` to `end`: a truncated, corrupt, foreign (another model's,
another quantization's, another version's), oversized or unreadable file is a miss,
logged and removed, never loaded. One server per directory: a lock held while open.
The store is bounded by bytes and evicts the least recently used entries.

Pure: no MLX, no sockets. The worker reads and writes; the scheduler decides.
"""

import fcntl
import hashlib
import heapq
import json
import logging
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlxd.runtime.prefix_hash import PREFIX_BLOCK, ROOT_HASH, block_hashes

log = logging.getLogger("mlxd.kv_disk")

FORMAT_VERSION = 1
MAGIC = b"MLXDKV\x00\x01"
SUFFIX = ".kv"
LOCK_NAME = "lock"
MAX_HEADER = 1 << 24   # bytes of a header's JSON (its tokens dominate)


class StoreLocked(RuntimeError):
    """Another server holds the directory."""


@dataclass(frozen=True)
class ArrayBytes:
    """One array of an entry: its name (which cache leaf it is), dtype, shape, bytes."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Entry:
    parent: int            # the hash of the prefix before the run (ROOT_HASH: none)
    end: int               # the hash of the prefix the run completes
    tokens: tuple[int, ...]
    arrays: tuple[ArrayBytes, ...]
    # a prefill can resume at the run's end from it alone and what precedes it: it
    # holds what a model needs there beyond KV (a recurrent state, the window's KV)
    resumable: bool = True


@dataclass
class Listed:
    """What the index knows of an entry without reading it."""
    parent: int
    end: int
    n_tokens: int
    nbytes: int
    used: float = field(default=0.0)   # for LRU: last read or write (start: mtime)
    resumable: bool = True


def fingerprint(*parts: str | bytes) -> str:
    """A short hex digest naming what the KV was computed with; entries under another
    fingerprint are never loaded."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(FORMAT_VERSION).encode())
    for part in parts:
        h.update(b"\x00" + (part if isinstance(part, bytes) else part.encode()))
    return h.hexdigest()


def entry_name(parent: int, end: int, n_tokens: int, resumable: bool = True) -> str:
    kind = "r" if resumable else "m"   # resumable at its end, or a middle part only
    return f"{parent & (2**64 - 1):016x}-{end & (2**64 - 1):016x}-{n_tokens}-{kind}{SUFFIX}"


def run_name(run) -> str:
    """The file name of an entry described by `run` (anything with `parent`, `end`,
    `n_tokens`, `resumable`: the wire's DiskRun, an Entry's header)."""
    return entry_name(run.parent, run.end, run.n_tokens, run.resumable)


def parse_name(name: str) -> tuple[int, int, int, bool] | None:
    """(parent, end, n_tokens, resumable) of an entry's file name; None for any
    other name."""
    if not name.endswith(SUFFIX):
        return None
    parts = name[:-len(SUFFIX)].split("-")
    try:
        parent, end, n = int(parts[0], 16), int(parts[1], 16), int(parts[2])
    except (ValueError, IndexError):
        return None
    if len(parts) != 4 or parts[3] not in ("r", "m") or n <= 0 or n % PREFIX_BLOCK:
        return None
    return _signed(parent), _signed(end), n, parts[3] == "r"


def _signed(u: int) -> int:
    return u - 2**64 if u >= 2**63 else u


class DiskIndex:
    """Entries by name and by the prefix hash they continue: what a match walks.
    Pure: the store keeps one over its files, the scheduler its own copy."""

    def __init__(self):
        self.entries: dict[str, Listed] = {}
        self.children: dict[int, set[str]] = {}   # parent hash -> entry names
        self._ends: dict[int, int] = {}           # end hash -> entries ending there

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> Listed | None:
        return self.entries.get(name)

    def add_name(self, name: str, nbytes: int = 0, used: float = 0.0) -> bool:
        """Index an entry from its file name alone; False for a name that is not one."""
        parsed = parse_name(name)
        if parsed is None:
            return False
        parent, end, n, resumable = parsed
        self.add(name, Listed(parent, end, n, nbytes, used, resumable))
        return True

    def add(self, name: str, listed: Listed) -> None:
        if name in self.entries:
            return
        self.entries[name] = listed
        self.children.setdefault(listed.parent, set()).add(name)
        self._ends[listed.end] = self._ends.get(listed.end, 0) + 1

    def remove(self, name: str) -> Listed | None:
        listed = self.entries.pop(name, None)
        if listed is not None:
            self.children.get(listed.parent, set()).discard(name)
            left = self._ends[listed.end] - 1
            if left:
                self._ends[listed.end] = left
            else:
                del self._ends[listed.end]
        return listed

    def ends_at(self, h: int) -> bool:
        """Some entry ends at the prefix whose hash is `h`."""
        return h in self._ends

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def match(self, hashes: list[int], start_block: int = 0) -> list[str]:
        """The entries that continue a prompt from its block `start_block` (0: from
        the start) as far as any chain of them reaches, in order: `hashes[k]` is the
        prompt's hash at block k + 1 (block_hashes). Entries chain where one ends at
        the prefix the next continues."""
        position = {h: k + 1 for k, h in enumerate(hashes)}
        came: dict[int, tuple[int, str] | None] = {start_block: None}
        frontier, best = [start_block], start_block
        while frontier:
            at = heapq.heappop(frontier)
            parent = ROOT_HASH if at == 0 else hashes[at - 1]
            for name in self.children.get(parent, ()):
                listed = self.entries[name]
                reach = position.get(listed.end, 0)
                if reach == at + listed.n_tokens // PREFIX_BLOCK and reach not in came:
                    came[reach] = (at, name)
                    heapq.heappush(frontier, reach)
                    best = max(best, reach)
        names = []
        while came[best] is not None:
            best, name = came[best]
            names.append(name)
        return names[::-1]


class KVDiskStore:
    """The entries of one directory, for one fingerprint, bounded by `max_bytes`."""

    def __init__(self, root: str | os.PathLike, fprint: str, max_bytes: int,
                 clock=time.time):
        self.root = Path(root)
        self.fprint, self.max_bytes, self.clock = fprint, max_bytes, clock
        self.dir = self.root / fprint   # one folder per fingerprint: a model switch
        self.dir.mkdir(parents=True, exist_ok=True)   # keeps the other model's entries
        self._lock = _take_lock(self.root / LOCK_NAME)
        self.index = DiskIndex()
        self.gone: list[str] = []   # entries dropped since the owner last took them
        self.rebuild()

    # ---- the index ---------------------------------------------------------------

    def rebuild(self) -> None:
        """The index from the directory's names and sizes; leftovers of interrupted
        writes removed."""
        self.index = DiskIndex()
        for item in os.scandir(self.dir):
            if item.name.endswith(".tmp"):
                _remove(Path(item.path))
                continue
            if parse_name(item.name) is None or not item.is_file(follow_symlinks=False):
                continue
            info = item.stat(follow_symlinks=False)
            self.index.add_name(item.name, info.st_size, info.st_mtime)

    def _drop(self, name: str) -> None:
        if self.index.remove(name) is not None:
            self.gone.append(name)
        _remove(self.dir / name)

    def take_gone(self) -> list[str]:
        """The entries dropped (evicted, or found unusable) since the last call."""
        gone, self.gone = self.gone, []
        return gone

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def match(self, hashes: list[int], start_block: int = 0) -> list[str]:
        """`DiskIndex.match` over this store's entries."""
        return self.index.match(hashes, start_block)

    # ---- reading and writing -------------------------------------------------------

    def put(self, entry: Entry) -> str | None:
        """Write `entry` (whole blocks) unless it is there already; evict the least
        recently used entries to stay within the bound. Its name, or None when it
        cannot fit or the write failed (a full disk: logged, nothing left behind)."""
        n = len(entry.tokens)
        assert n and n % PREFIX_BLOCK == 0
        name = entry_name(entry.parent, entry.end, n, entry.resumable)
        listed = self.index.get(name)
        if listed is not None:
            listed.used = self.clock()
            return name
        blob = encode_entry(entry, self.fprint)
        if len(blob) > self.max_bytes:
            return None
        self.evict(self.max_bytes - len(blob))
        tmp = self.dir / f"{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, self.dir / name)
        except OSError as exc:
            log.warning("kv disk: could not write %s (%s); skipped", name, exc)
            _remove(tmp)
            return None
        self.index.add(name, Listed(entry.parent, entry.end, n, len(blob), self.clock(),
                                    entry.resumable))
        return name

    def get(self, name: str, tokens: list[int] | None = None) -> Entry | None:
        """The entry, checked whole (and, given `tokens`, equal to them); None for a
        miss. A file that fails a check is logged and removed."""
        listed = self.index.get(name)
        if listed is None:
            return None
        try:
            # non-blocking: a FIFO put in an entry's place must not hang the reader
            with open(os.open(self.dir / name, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise BadEntry("not a regular file")
                if st.st_size > self.max_bytes:
                    raise BadEntry("larger than the store's bound")
                data = f.read(st.st_size + 1)   # one more: a file that grew is refused
            entry = decode_entry(data, self.fprint, self.max_bytes)
            if (entry.parent, entry.end, len(entry.tokens), entry.resumable) != \
                    (listed.parent, listed.end, listed.n_tokens, listed.resumable):
                raise BadEntry("its header does not match its name")
        except (OSError, BadEntry) as exc:
            log.warning("kv disk: %s is not usable (%s); removed", name, exc)
            self._drop(name)
            return None
        if tokens is not None and list(entry.tokens) != list(tokens):
            return None   # a hash collision: another prompt's run
        listed.used = self.clock()
        return entry

    def evict(self, room: int) -> None:
        """Remove the least recently used entries until they take at most `room`."""
        total = self.nbytes
        entries = self.index.entries
        for name in sorted(entries, key=lambda n: entries[n].used):
            if total <= room:
                return
            total -= entries[name].nbytes
            self._drop(name)

    def clear(self) -> int:
        """Remove every entry; how many there were."""
        names = list(self.index.entries)
        for name in names:
            self._drop(name)
        return len(names)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class BadEntry(ValueError):
    pass


def encode_entry(entry: Entry, fprint: str) -> bytes:
    offset, specs = 0, []
    for a in entry.arrays:
        specs.append({"name": a.name, "dtype": a.dtype, "shape": list(a.shape),
                      "offset": offset, "nbytes": len(a.data)})
        offset += len(a.data)
    payload = b"".join(a.data for a in entry.arrays)
    header = json.dumps({
        "version": FORMAT_VERSION, "fingerprint": fprint, "parent": entry.parent,
        "end": entry.end, "tokens": list(entry.tokens), "arrays": specs,
        "resumable": entry.resumable,
        "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(data: bytes, fprint: str, max_bytes: int) -> Entry:
    """The entry a file holds, or BadEntry saying what is wrong with it."""
    if len(data) > max_bytes:
        raise BadEntry("larger than the store's bound")
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise BadEntry("not an entry (bad magic or truncated)")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if size > MAX_HEADER or start + size > len(data):
        raise BadEntry("truncated header")
    try:
        header = json.loads(data[start:start + size])
    except ValueError as exc:
        raise BadEntry(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        raise BadEntry("another format version")
    if header.get("fingerprint") != fprint:
        raise BadEntry("computed by another model, quantization or version")
    payload = data[start + size:]
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
        raise BadEntry("checksum mismatch (truncated or corrupt)")
    try:
        return _checked(header, payload)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadEntry(f"malformed header ({exc})") from None


def _checked(header: dict, payload: bytes) -> Entry:
    tokens = [int(t) for t in header["tokens"]]
    parent, end = int(header["parent"]), int(header["end"])
    if not tokens or len(tokens) % PREFIX_BLOCK:
        raise ValueError("not whole blocks")
    if block_hashes(tokens, 0, parent)[-1] != end:
        raise ValueError("its tokens do not hash to its name")
    arrays = []
    for spec in header["arrays"]:
        offset, n = int(spec["offset"]), int(spec["nbytes"])
        if offset < 0 or n < 0 or offset + n > len(payload):
            raise ValueError("an array outside the payload")
        arrays.append(ArrayBytes(str(spec["name"]), str(spec["dtype"]),
                                 tuple(int(d) for d in spec["shape"]),
                                 payload[offset:offset + n]))
    return Entry(parent, end, tuple(tokens), tuple(arrays), bool(header["resumable"]))


def _take_lock(path: Path):
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise StoreLocked(f"{path.parent} is in use by another mlxd server (each needs "
                          "its own --kv-disk directory)") from None
    return f


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ---- `mlxd cache ls|clear DIR` ----------------------------------------------------

def summary(root: str | os.PathLike) -> list[tuple[str, int, int, int]]:
    """Per fingerprint folder of `root` (and of the engine folders inside it, one per
    engine of a server with several: `ENGINE/FINGERPRINT`): (fingerprint, entries,
    tokens, bytes), read from the names and sizes only."""
    out = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        if (folder / LOCK_NAME).exists():   # an engine's own store
            out += [(f"{folder.name}/{name}", *rest) for name, *rest in summary(folder)]
            continue
        entries = tokens = nbytes = 0
        for item in os.scandir(folder):
            parsed = parse_name(item.name)
            if parsed is not None and item.is_file(follow_symlinks=False):
                entries, tokens = entries + 1, tokens + parsed[2]
                nbytes += item.stat(follow_symlinks=False).st_size
        out.append((folder.name, entries, tokens, nbytes))
    return out


def clear_all(root: str | os.PathLike) -> int:
    """Remove every entry of every fingerprint under `root`, and under the engine
    folders inside it (StoreLocked while a server holds any); how many there were."""
    root = Path(root)
    lock = _take_lock(root / LOCK_NAME)
    try:
        removed = 0
        for folder in [p for p in root.iterdir() if p.is_dir()]:
            if (folder / LOCK_NAME).exists():
                removed += clear_all(folder)
                continue
            for item in os.scandir(folder):
                if parse_name(item.name) is not None or item.name.endswith(".tmp"):
                    _remove(Path(item.path))
                    removed += item.name.endswith(SUFFIX)
            try:
                folder.rmdir()
            except OSError:   # something else lives there: left alone
                pass
        return removed
    finally:
        lock.close()
