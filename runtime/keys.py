"""CURVE keys of the client socket, and how a local client finds the server's.

The client socket is encrypted and authenticated with ZeroMQ's CURVE by default: a
client must know the server's public key to complete the handshake, and a peer that
does not gets nothing — libzmq drops it before any frame reaches the tokenizer. So
the public key works as an access token, as a notebook server's does:

- A server uses the key pair `--curve-secret-key FILE` names (`python -m
  mlxd.runtime.keys FILE` writes one and prints its public key, for remote clients:
  `Client(address, server_key=...)` or MLXD_SERVER_KEY), else the user's own default
  pair, made on first use in the runtime folder below (`server.key`, 0600). It stays
  the same across restarts, so a client outlives a server restart.
- The launcher publishes the public key of a running server in a file of the
  user's own runtime folder (0700, the file 0600), named by port; an SDK client
  connecting to a loopback address reads it there. Other local users cannot read
  it, so they cannot connect.

Keys are Z85 text (40 characters), as pyzmq's `curve_keypair()` makes them.
"""

import ctypes
import ipaddress
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import zmq

from .lifecycle import pid_alive

KEY_CHARS = 40
RUNTIME_ENV = "MLXD_RUNTIME_DIR"   # overrides where local servers publish their keys
SERVER_KEY_ENV = "MLXD_SERVER_KEY"


class BadKey(ValueError):
    """A key or key file that cannot be used; the message says why."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes

    @classmethod
    def new(cls) -> "KeyPair":
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, secret: bytes) -> "KeyPair":
        return cls(zmq.curve_public(secret), secret)


def parse_key(text: str | bytes) -> bytes:
    """A Z85 CURVE key from text (surrounding whitespace ignored)."""
    key = text.strip() if isinstance(text, bytes) else text.strip().encode("ascii", "replace")
    if len(key) != KEY_CHARS:
        raise BadKey(f"a CURVE key is {KEY_CHARS} Z85 characters, got {len(key)}")
    try:
        zmq.curve_public(key)   # decodes it: rejects characters outside Z85
    except (zmq.ZMQError, ValueError) as exc:
        raise BadKey(f"not a Z85 CURVE key: {exc}") from None
    return key


def read_secret_key(path: str | Path) -> KeyPair:
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise BadKey(f"cannot read the CURVE secret key file {path}: {exc.strerror}") from None
    try:
        return KeyPair.from_secret(parse_key(text))
    except BadKey as exc:
        raise BadKey(f"{path}: {exc}") from None


# ---- the server side ------------------------------------------------------------

def serve_with_curve(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make the (not yet bound) `sock` accept CURVE clients only."""
    sock.curve_server = True
    sock.curve_secretkey = pair.secret


def randomize_routing_ids() -> None:
    """Seed the C library's rand(), from which libzmq takes the first routing id a
    ROUTER hands out (then counts up). Never seeded, it starts at the same value in
    every process: a client that claimed the next ids for itself made libzmq abort
    when an ordinary client got one of them. Call before making the ROUTER."""
    try:
        ctypes.CDLL(None).srand(ctypes.c_uint(secrets.randbits(32)))
    except (OSError, AttributeError):   # no C library to reach: libzmq seeds nothing
        pass


# ---- where local servers publish their public key --------------------------------

def runtime_dir() -> Path:
    """The folder (made 0700) where this user's servers publish their public keys."""
    base = os.environ.get(RUNTIME_ENV)
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "mlxd") if xdg else os.path.join(
            os.path.expanduser("~"), ".cache", "mlxd", "run")
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def default_key_file() -> Path:
    """The user's default server key file; made (0600) on first use."""
    path = runtime_dir() / "server.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "wb") as f:
        f.write(KeyPair.new().secret + b"\n")
    return path


def _published(port: int) -> Path:
    return runtime_dir() / f"server-{port}.json"


def publish(port: int, pair: KeyPair, pid: int) -> Path:
    """Record that this user's server `pid` listens on `port` with `pair`'s key."""
    path = _published(port)
    tmp = path.with_suffix(f".{pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"public_key": pair.public.decode(), "pid": pid}, f)
    os.replace(tmp, path)
    return path


def unpublish(port: int, pid: int) -> None:
    """Remove the record of `port`, if it is still `pid`'s."""
    path = _published(port)
    if _read_record(path).get("pid") == pid:
        path.unlink(missing_ok=True)


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def local_server_key(port: int) -> bytes | None:
    """The public key this user's live server on `port` published, if any."""
    record = _read_record(_published(port))
    if not pid_alive(record.get("pid")):
        return None
    try:
        return parse_key(record.get("public_key", ""))
    except BadKey:
        return None


# ---- the client side ------------------------------------------------------------

def is_loopback(address: str) -> bool:
    """Whether a `tcp://HOST:PORT` address names this machine."""
    return is_loopback_host(urlsplit(address).hostname or "")


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_key_for(address: str, given: str | bytes | None = None) -> bytes | None:
    """The server key a client uses: the one it was given, else MLXD_SERVER_KEY, else,
    for a loopback address, the one the local server published; None: connect
    without CURVE (a server that requires it then refuses the handshake)."""
    if given:
        return parse_key(given)
    if os.environ.get(SERVER_KEY_ENV):
        return parse_key(os.environ[SERVER_KEY_ENV])
    try:
        port = urlsplit(address).port
    except ValueError:
        return None
    if port and urlsplit(address).scheme == "tcp" and is_loopback(address):
        return local_server_key(port)
    return None


class OwnKeyOnly:
    """A ZAP CURVE check admitting one key: the server's own public key (the peer
    holds the same key file), for links between a server's own processes across
    machines (engines, worker ranks)."""

    def __init__(self, public: bytes, refused: Callable[[], None] = lambda: None):
        self.public, self.refused = public, refused

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self.public:
            self.refused()
        return key == self.public


def own_key_authenticator(ctx: zmq.Context, pair: KeyPair, domain: str,
                          refused: Callable[[], None] = lambda: None):
    """A started ZAP authenticator for `ctx` (ZAP is per context) admitting `pair`'s
    public key only on `domain`; stop() it before the context ends."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain, OwnKeyOnly(pair.public, refused))
    return auth


def connect_as_owner(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make the (not yet connected) `sock` a CURVE client holding the server's own
    pair: the one key an `own_key_authenticator` admits."""
    sock.curve_serverkey = pair.public
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret


def connect_with_curve(sock: zmq.Socket, server_key: bytes) -> None:
    """Make the (not yet connected) `sock` talk CURVE to the server holding
    `server_key`, under a throwaway key pair of its own."""
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = server_key
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def main(argv=None) -> int:
    """`python -m mlxd.runtime.keys FILE`: write a new secret key to FILE (0600) and
    print its public key, for `--curve-secret-key FILE` and remote clients."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.stderr.write("usage: python -m mlxd.runtime.keys FILE\n")
        return 2
    pair = KeyPair.new()
    try:
        fd = os.open(argv[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        sys.stderr.write(f"{argv[0]}: {exc.strerror}; nothing written\n")
        return 1
    with os.fdopen(fd, "wb") as f:
        f.write(pair.secret + b"\n")
    print(f"secret key written to {argv[0]}; the server's public key (for clients):")
    print(pair.public.decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
