"""Support for the per-process tests (test_worker_proc, test_scheduler_proc,
test_tokenizer_proc): one server process run for real, with the test playing its peers
over real ZeroMQ sockets."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent


def short_ipc_dir(tmp_path: Path, prefix: str = "mlxd-") -> Path:
    """tmp_path, unless it is too long for a unix socket path (~107 bytes)."""
    if len(str(tmp_path)) < 70:
        return tmp_path
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Child:
    """`python *args` as a process under test (`args` is usually ["-m", module, ...]).
    Its stdout+stderr are appended to a log file, shown when a check on it fails."""

    def __init__(self, name: str, args: list[str], log_path: Path):
        self.name = name                     # "the {name} died ..." in failures
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def fail(self, what: str):
        raise AssertionError(f"{what}; {self.name} exit code {self.proc.poll()}; its log:\n"
                             f"{self.log()}")

    def recv(self, sock: zmq.Socket, decoder, timeout: float, what: str):
        """The next message on `sock`, decoded; fails with the log if none comes within
        `timeout` or the process dies first."""
        deadline = time.monotonic() + timeout
        while not sock.poll(100):
            if self.proc.poll() is not None:
                time.sleep(0.2)              # the process may have sent it just before
                if sock.poll(0):
                    break
                self.fail(f"the {self.name} died waiting for {what}")
            if time.monotonic() > deadline:
                self.fail(f"no {what} within {timeout} s")
        return decoder.decode(sock.recv())

    def sigterm(self, timeout: float) -> int:
        """Send SIGTERM; the exit code, failing if it has not exited within `timeout`."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"the {self.name} did not exit within {timeout:g} s of SIGTERM")

    def stop(self, grace: float = 5.0) -> int:
        """Terminate it, killing it if it has not exited after `grace` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ProcHarness:
    """A process under test (`child`, once started) plus the sockets the test holds in
    place of its peers. Its log is <tmp_path>/<name>.log, its ipc sockets in `dir`.
    Used as a context manager, it is closed (process stopped, sockets closed) on exit."""

    def __init__(self, name: str, tmp_path: Path, recv_timeout: float):
        self.name = name
        self.tmp_path = tmp_path
        self.dir = short_ipc_dir(tmp_path, prefix=f"mlxd-{name}-")
        self.recv_timeout = recv_timeout
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.child: Child | None = None

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.proc

    def ipc(self, name: str) -> str:
        return f"ipc://{self.dir}/{name}"

    def _socket(self, kind, bind: str | None = None, connect: str | None = None) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        if bind:
            sock.bind(bind)
        else:
            sock.connect(connect)
        return sock

    def start_child(self, *args: str) -> Child:
        self.child = Child(self.name, list(args), self.tmp_path / f"{self.name}.log")
        return self.child

    def ensure_alive(self) -> None:
        """For harnesses with a start(): start the process again if it died."""
        if self.proc.poll() is not None:
            self.start()

    def log(self) -> str:
        return self.child.log()

    def fail(self, what: str):
        if self.child is None:
            raise AssertionError(f"{what}; the {self.name} was never started")
        self.child.fail(what)

    def _recv(self, sock: zmq.Socket, decoder, what: str, timeout: float | None = None):
        return self.child.recv(sock, decoder, self.recv_timeout if timeout is None else timeout,
                               what)

    def close_sockets(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets = []

    def close(self) -> None:
        if self.child:
            self.child.stop()
        self.close_sockets()
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RouterEnd:
    """The front end's engine ROUTER, bound at `address`, playing the front end for one
    engine (a DEALER named `peer`) as if it were a plain socket: `recv` strips the
    routing id, `send` adds it. With `skip_cache_events`, TokenBatches that carry only
    prefix-cache events (no entries) are kept aside in `cache_batches`, unseen."""

    def __init__(self, ctx: zmq.Context, address: str, peer: bytes = b"engine0",
                 skip_cache_events: bool = True):
        from mlxd.protocol import Decoder, ProtocolError, TokenBatch

        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.peer = peer
        self._batch = Decoder(TokenBatch)
        self._errors = ProtocolError
        self._skip = skip_cache_events
        self._held: list[bytes] = []
        self.cache_batches = []

    def _events_only(self, frame: bytes) -> bool:
        try:
            batch = self._batch.decode(frame)
        except self._errors:
            return False
        if batch.entries or not self._skip:
            return False
        self.cache_batches.append(batch)
        return True

    def poll(self, timeout: float | None = None, flags: int = zmq.POLLIN) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while not self._held:
            left = None if deadline is None else max(0, (deadline - time.monotonic()) * 1000)
            if not self.sock.poll(left):
                return 0
            peer, frame = self.sock.recv_multipart()
            self.peer = peer
            if not self._events_only(frame):
                self._held.append(frame)
        return zmq.POLLIN

    def recv(self, flags: int = 0) -> bytes:
        if not self.poll(0 if flags & zmq.NOBLOCK else None):
            raise zmq.Again()
        return self._held.pop(0)

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sock.send_multipart([self.peer, frame], flags)

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger)
