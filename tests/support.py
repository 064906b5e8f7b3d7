"""Test support: tiny models, the mlx_lm reference, real server processes."""

import os
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import zmq

from mlxd.launcher import HTTP_PREFIX, READY_PREFIX, read_ready_addresses
from mlxd.protocol import DecodeRow, Decoder, ErrorReply, StreamChunk
from mlxd.protocol import encode as encode_message
from mlxd.runtime.keys import connect_with_curve, server_key_for

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Hello model server",
    "What is the capital of France? The capital",
    "a b c d e f g",
    "The quick brown fox jumps over the lazy dog and then",
    "x",
    "Paris is a city in France and it has a river",
    "Write a sentence about water, mountains and people who live there.",
    "the the the the",
]


@lru_cache(maxsize=4)
def load_reference(model_path: str):
    from mlx_lm import load

    return load(model_path)


def reference_tokens(model_path: str, input_ids: list[int], max_tokens: int,
                     ignore_eos: bool = False):
    """mlx_lm's own greedy generation: [(token, chosen-token logprob)], stopping at
    EOS unless `ignore_eos` (then mlx_lm's generate_step, which never stops early)."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.generate import generate_step

    model, tokenizer = load_reference(model_path)
    if ignore_eos:
        steps = generate_step(mx.array(input_ids), model, max_tokens=max_tokens)
        return [(token, logprobs[token].item()) for token, logprobs in steps]
    return [(r.token, r.logprobs[r.token].item())
            for r in stream_generate(model, tokenizer, input_ids, max_tokens=max_tokens)]


# Two chosen tokens whose logprobs are this close were tied: which one wins depends on
# the order of a float sum, and a resumed request computes its earlier tokens' KV in
# one prefill where the undisturbed run computed it one decode step at a time.
TIE = 1e-4


def assert_same_stream(tokens: list, logprobs: list[float], want_tokens: list,
                       want_logprobs: list[float], label=None) -> bool:
    """One stream's tokens equal another's, and their chosen-token logprobs agree to
    1e-3, up to the end or a tie (two different tokens chosen with logprobs within
    TIE), after which the streams may go apart. Whether they were equal to the end."""
    for i, (a, b) in enumerate(zip(tokens, want_tokens)):
        apart = abs(logprobs[i] - want_logprobs[i])
        if a != b:
            assert apart < TIE, (label, i, a, b, logprobs[i - 2:i + 1], want_logprobs[i - 2:i + 1])
            return False
        assert apart < 1e-3, (label, i, logprobs[i], want_logprobs[i])
    assert len(tokens) == len(want_tokens), label
    return True


def encode(model_path: str, prompt: str) -> list[int]:
    _, tokenizer = load_reference(model_path)
    return tokenizer.encode(prompt)


PRESSURE_LENGTHS = (50, 64, 160, 210, 260, 300)   # 210 = 5 x 40 + 10: a short last chunk


def pressure_prompts(model_path: str) -> list[list[int]]:
    """12 short prompts and 6 long ones of random ids (PRESSURE_LENGTHS), each twice
    in a row: 36 requests that overflow a 480-slot pool in chunks of 40."""
    import random

    rng = random.Random(0)
    short = [encode(model_path, p) for p in (PROMPTS * 2)[:12]]
    longs = [[rng.randrange(3, 500) for _ in range(n)] for n in PRESSURE_LENGTHS]
    return [ids for ids in short + longs for _ in range(2)]


def children_of(pid: int) -> list[int]:
    """Live child pids of `pid` (Linux /proc; empty elsewhere)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():   # a zombie is dead for our purposes
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return True


def processes_using(text: str) -> list[int]:
    """Pids (other than this one) whose command line contains `text` (Linux /proc)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Server:
    """`python launch.py ...` as a real subprocess (`--model model_path` unless it is
    None). Always call stop()."""

    def __init__(self, model_path: str | None, *args: str, ready_timeout: float = 120.0,
                 env: dict | None = None, command: list[str] | None = None,
                 cwd: Path = ROOT):
        self.stderr_lines: list[str] = []
        self.child_pids: list[int] = []
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, str(ROOT / "launch.py")]),
             *(["--model", str(model_path)] if model_path is not None else []),
             "--port", "0", "--http-port", "0", "--host", "127.0.0.1", *args],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=env)
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self.address, self.http_url = self._wait_ready(ready_timeout)
        self.child_pids = children_of(self.proc.pid)

    def _pump_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    def _wait_ready(self, timeout: float) -> tuple[str, str | None]:
        """The client address and the HTTP API's base URL (`http://HOST:PORT`)."""
        found = self.addresses = read_ready_addresses(self.proc.stdout, timeout)
        if READY_PREFIX not in found:
            self.stop()
            raise RuntimeError("server did not become ready:\n" +
                               "\n".join(self.stderr_lines[-40:]))
        return found[READY_PREFIX], found.get(HTTP_PREFIX)

    def child(self, name: str) -> int:
        """The pid of the live child `name` (a restarted worker's: a new pid)."""
        self._note_children()
        for pid in self.child_pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if f"-m mlxd.{name}".encode() in cmdline:
                return pid
        raise LookupError(name)

    def _note_children(self) -> None:
        """Add the launcher's children started since (a restarted worker); forget the
        dead (their pids may be reused)."""
        new = [pid for pid in children_of(self.proc.pid) if pid not in self.child_pids]
        self.child_pids = [pid for pid in self.child_pids if pid_alive(pid)] + new

    def stop(self) -> int | None:
        """Stop the launcher and make sure no child survives it."""
        self._note_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.child_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode


def worker_limits(kv_capacity: int = 256, max_context: int = 128, vocab_size: int = 1000,
                  **overrides):
    """A WorkerLimits as a worker run with the default 64 requests would report it."""
    from mlxd.protocol import WorkerLimits
    from mlxd.runtime.kv_layout import decode_cache_budget

    fields = dict(
        kv_capacity=kv_capacity, decode_cache_tokens=decode_cache_budget(kv_capacity, 64),
        max_context=max_context, vocab_size=vocab_size, bytes_per_token=64,
        kv_pool_bytes=(kv_capacity + 1) * 64, weights_bytes=1024, buffer_cache_bytes=0,
        kv_dtype="float16", device="cpu", blas="test", quantized=False, dequantize=False,
        overlap=True)
    return WorkerLimits(**{**fields, **overrides})


def requests_in_server(address: str) -> int:
    """Requests the server at `address` runs or has waiting (asked by a client of its own)."""
    from mlxd import Client

    with Client(address, timeout=30) as c:
        stats = c.stats()
        return stats["running"] + stats["waiting"]


def connect_client(sock: zmq.Socket, address: str) -> zmq.Socket:
    """Connect a raw socket to a server's client address as the SDK would: with the
    CURVE key the local server published (runtime/keys.py), if any."""
    key = server_key_for(address)
    if key is not None:
        connect_with_curve(sock, key)
    sock.connect(address)
    return sock


class RawDealer:
    """A bare DEALER for frames the SDK would never send."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        connect_client(self.sock, address)
        self.decoder = Decoder(StreamChunk, ErrorReply)

    def send(self, msg) -> None:
        self.sock.send(encode_message(msg))

    def recv(self, timeout: float = 15.0):
        if not self.sock.poll(timeout * 1000):
            raise AssertionError(f"no reply within {timeout} s")
        return self.decoder.decode(self.sock.recv())

    def replies(self, seconds: float = 0.3) -> list:
        out = []
        while self.sock.poll(seconds * 1000):
            out.append(self.decoder.decode(self.sock.recv()))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send_raw_garbage(address: str) -> None:
    """Raw bytes at a tcp:// ZeroMQ port: no handshake, a bad greeting followed by
    nothing, a little, and 1 MiB; each peer vanishes after sending."""
    import random
    import socket

    host, port = address[len("tcp://"):].rsplit(":", 1)
    rng = random.Random(5)
    for size in (0, 10, 64, 1 << 20):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            try:
                raw.sendall(b"\xff" + bytes(8) + b"\x7f" + rng.randbytes(size))
            except OSError:   # the peer may drop it part way: that is the point
                pass


def flood(address: str, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    """Every prompt at once through the async SDK (greedy, ignore_eos, logprobs): the
    results in order, and the server's stats after."""
    import asyncio

    from mlxd.client import AsyncClient

    async def run():
        async with AsyncClient(address, timeout=300) as c:
            results = await asyncio.gather(*(
                c.generate(input_ids=p, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
                for p in prompts))
            return results, await c.stats()
    return asyncio.run(run())


def dense_reference(q, keys, values, scale, window=0, sinks=None, queries=None):
    """Per row, softmax attention over its own positions (numpy, float64): row r's
    last `queries[r]` positions (default 1) are its queries, in its first slots of
    `q` `[B, Hq, L, D]`, each attending causally (within the window); `[B, Hq, L,
    Dv]`, NaN in the slots past a row's queries."""
    import numpy as np

    hq, slots = q.shape[1], q.shape[2]
    queries = [1] * len(keys) if queries is None else queries
    out = np.full((len(keys), hq, slots, values[0].shape[-1]), np.nan)
    for r, (k, v) in enumerate(zip(keys, values)):   # k: [Hkv, n, D]
        g, n = hq // k.shape[0], k.shape[1]
        k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
        for j in range(queries[r]):
            at = n - queries[r] + j
            low = max(0, at + 1 - window) if window else 0
            for h in range(hq):
                s = (np.asarray(q[r, h, j], np.float64) * scale) @ k[h // g, low:at + 1].T
                logits = s if sinks is None else np.append(s, float(sinks[h]))
                w = np.exp(logits - logits.max())
                w = w / w.sum()
                out[r, h, j] = w[:at + 1 - low] @ v[h // g, low:at + 1]
    return out


class PageBooker:
    """Books pool slots as the scheduler does (scheduler_proc/allocator.py): position p
    of a request at offset p mod page of the page it took for that window (`page` 1:
    one slot after another)."""

    def __init__(self, capacity: int, page: int):
        from mlxd.scheduler_proc.allocator import SlotAllocator

        self.alloc, self.page = SlotAllocator(capacity, page), page
        self.length: dict[int, int] = {}             # rid -> positions it holds
        self.own: dict[int, dict[int, int]] = {}     # rid -> window -> the page it took

    def slots(self, rid: int, n: int, start: int | None = None) -> list[int]:
        """Slots for the request's next `n` positions (from `start`: after a prefix)."""
        start = self.length.get(rid, 0) if start is None else start
        own = self.own.setdefault(rid, {})
        got = self.alloc.extend(start, n, own.get(start // self.page, 0))
        for p in range(start, start + n):
            own[p // self.page] = got[p - start] // self.page
        self.length[rid] = start + n
        return got

    def book_next(self, rid: int) -> int:
        """The page a chained decode writes the request's next position in, where that
        position starts one (the scheduler's `DecodeRow.chain_page`; 0: none)."""
        n, own = self.length[rid], self.own[rid]
        if self.page == 1 or n % self.page or n // self.page in own:
            return 0
        own[n // self.page] = self.alloc.take_page(n // self.page)
        return own[n // self.page]

    def forget(self, rid: int) -> None:
        """A released request starts over when it comes back (its pages stay taken)."""
        self.length.pop(rid, None)
        self.own.pop(rid, None)


def decode_rows(rids, slots, windows=(), chain_pages=()) -> list[DecodeRow]:
    """A Step's decode records from a driver's per-row lists (`windows`,
    `chain_pages`: empty, none)."""
    return [DecodeRow(rid, slot, window=windows[i] if windows else 0,
                      chain_page=chain_pages[i] if chain_pages else 0)
            for i, (rid, slot) in enumerate(zip(rids, slots, strict=True))]
