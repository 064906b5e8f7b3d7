"""What the fuzz tests of the CURVE sockets between machines share (the front end's
engine port, a remote rank's Step socket): peers without the key, peers holding it
(insiders), and a TCP relay that makes an insider slow or cuts it off mid-message."""

import socket
import struct
import threading
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.runtime.keys import KeyPair, connect_as_owner

LONG_COMMAND = 0x06   # a ZMTP command frame with an 8-byte size


def curve_greeting(as_server: bool) -> bytes:
    """ZMTP 3.0's greeting of a CURVE peer: signature, version, mechanism, role."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + \
        bytes([as_server]) + bytes(31)


def rss_mib(pid: int) -> float:
    """The resident memory of `pid`, MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)


def huge_command(raw: socket.socket, as_server: bool = False, announced: int = 1 << 30,
                 payload: int = 96 << 20) -> int:
    """Greet as a CURVE peer without the key, then send a handshake command announced
    as `announced` bytes, up to `payload` of it: the bytes taken before the other end
    cut us off. Without a frame cap ZeroMQ buffers all of it."""
    raw.sendall(curve_greeting(as_server))
    raw.recv(64)   # the other end's greeting
    chunk, sent = bytes(1 << 20), 0
    try:
        raw.sendall(bytes([LONG_COMMAND]) + struct.pack(">Q", announced))
        while sent < payload:
            raw.sendall(chunk)
            sent += len(chunk)
    except OSError:   # cut off: the point
        pass
    return sent


def huge_handshake(address: str, pid: int) -> tuple[int, float]:
    """`huge_command` at a server's `address`, staying connected: (bytes it took,
    how far `pid`'s resident memory grew meanwhile, MiB)."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    before = rss_mib(pid)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        sent = huge_command(raw)
        time.sleep(0.5)   # what arrived is read (or refused) before we look
        return sent, rss_mib(pid) - before


def slow_raw_peers(address: str, count: int, seconds: float) -> None:
    """`count` peers without the key that dribble a greeting, a byte every 50 ms and
    never all of it, for `seconds` (a slowloris at the handshake), then vanish."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    peers = [socket.create_connection((host, int(port)), timeout=10) for _ in range(count)]
    end = time.monotonic() + seconds
    try:
        for byte in curve_greeting(False)[:-1]:
            if time.monotonic() > end:
                break
            for raw in peers:
                try:
                    raw.send(bytes([byte]))
                except OSError:
                    pass
            time.sleep(0.05)
        time.sleep(max(0.0, end - time.monotonic()))
    finally:
        for raw in peers:
            raw.close()


class Insider:
    """A ZeroMQ peer holding the server's key pair (what a scheduler holds): admitted
    within `wait` seconds (0: not waited for; a stranger's pair is never admitted)."""

    def __init__(self, kind: int, address: str, pair: KeyPair, routing_id: bytes = b"",
                 wait: float = 10):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        if routing_id:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        connect_as_owner(self.sock, pair)
        self.events = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED |
                                                   zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        assert not wait or self._wait(zmq.EVENT_HANDSHAKE_SUCCEEDED, wait), "not admitted"

    def _wait(self, event: int, seconds: float) -> bool:
        while self.events.poll(seconds * 1000):
            if parse_monitor_message(self.events.recv_multipart())["event"] == event:
                return True
        return False

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def dropped(self, seconds: float = 10) -> bool:
        """Whether the server drops our connection within `seconds`."""
        return self._wait(zmq.EVENT_DISCONNECTED, seconds)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.events.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


class Relay:
    """A TCP relay to `target` for one connection: the peer's bytes pass at most
    `rate` bytes a second (a slow peer) and, past `cut_after` of them, both ends are
    closed (a peer that vanished mid-message). Later connections are refused."""

    def __init__(self, target: str, cut_after: int | None = None, rate: float | None = None):
        host, port = target[len("tcp://"):].rsplit(":", 1)
        self.target = (host, int(port))
        self.cut_after, self.rate = cut_after, rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.passed = 0
        self.cut = threading.Event()
        self._ends: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            peer, _ = self.listener.accept()
        except OSError:   # closed before anyone came
            return
        self.listener.close()
        upstream = socket.create_connection(self.target)
        self._ends = [peer, upstream]
        threading.Thread(target=self._pipe, args=(upstream, peer), daemon=True).start()
        try:
            while not self.cut.is_set():
                data = peer.recv(1024 if self.rate else 65536)
                if not data:
                    break
                if self.cut_after is not None and self.passed + len(data) >= self.cut_after:
                    upstream.sendall(data[:self.cut_after - self.passed])
                    break
                upstream.sendall(data)
                self.passed += len(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            self.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        """Both ends closed at once: the peer vanished (whatever it was sending)."""
        self.cut.set()
        self.listener.close()
        for end in self._ends:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()
