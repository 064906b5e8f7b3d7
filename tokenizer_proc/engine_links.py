"""The front end's sockets to its engines: one ROUTER on this machine's `ipc://`
address (the `--dp` replicas' schedulers connect to it) and, with `--engine-port`,
one on TCP for engines on other machines (`mlxd engine --join`).

Each engine's scheduler connects a DEALER named after the engine (its routing id).
The TCP socket is a CURVE server whose authenticator (ZAP, in a context of its own)
admits one client key: the front end's own public key, so only a holder of the front
end's key file joins; a peer without it fails the handshake, and no frame of its
reaches the front end or any scheduler. A link's end is seen as a client's is
(connections.py): the socket monitor's EVENT_DISCONNECTED with the descriptor each
message came on; on TCP, ZeroMQ heartbeats end a link whose peer vanished (or
stopped), and a frame over the protocol's MAX_FRAME_BYTES ends its link before it is
buffered, from a peer with the key or without.
"""

import logging

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.protocol.codec import MAX_FRAME_BYTES
from mlxd.runtime.aio import LoopSocket
from mlxd.runtime.keys import KeyPair, own_key_authenticator, serve_with_curve
from mlxd.runtime.sockets import cap_frames, heartbeat, monitor_pair

from .connections import Connections

log = logging.getLogger("mlxd.tokenizer")
ZAP_DOMAIN = "mlxd-engines"


class EngineLink:
    """One ROUTER: `recv` gives (engine name, frame); `events` has the monitor's
    frames, which `closed` reads."""

    def __init__(self, ctx: zmq.Context, address: str, keys: KeyPair | None = None,
                 silent_s: float | None = None):
        """`silent_s`: a link whose peer answers no heartbeat this long ends (a
        stopped scheduler's); over TCP (`keys`) the default HEARTBEAT_TIMEOUT_MS."""
        sock = zmq.Socket(ctx, zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a gone engine is an error, not a drop
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            serve_with_curve(sock, keys)
            sock.zap_domain = ZAP_DOMAIN.encode()
            heartbeat(sock)
            # an engine's batches grow with limits it states only in its first frame
            cap_frames(sock, MAX_FRAME_BYTES)
        elif silent_s is not None:
            heartbeat(sock, int(silent_s * 1000))
        pair = monitor_pair(ctx, sock, zmq.EVENT_DISCONNECTED)
        sock.bind(address)
        self.sock = LoopSocket(sock, multipart=True, copy=False)
        self.events = LoopSocket(pair, multipart=True)
        self.connections = Connections()

    @property
    def address(self) -> str:
        return self.sock.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> tuple[str, bytes] | None:
        """The next (engine, frame); None for a message that is not one frame."""
        parts = await self.sock.recv()
        if len(parts) != 2:
            log.error("dropped an engine message of %d frames", len(parts) - 1)
            return None
        name = parts[0].bytes
        self.connections.seen(name, parts[-1].get(zmq.SRCFD))
        return name.decode("utf-8", "replace"), parts[1].bytes

    def send(self, engine: str, frame: bytes) -> bool:
        """False when the engine is not connected (any more)."""
        try:
            self.sock.try_send_multipart([engine.encode(), frame])
            return True
        except zmq.ZMQError as exc:   # EHOSTUNREACH: its connection ended
            log.debug("a message to engine %s was not sent: %s", engine, exc)
            return False

    def closed(self, frames: list[bytes]) -> list[str]:
        """The engines whose connection the monitor event `frames` reports ended."""
        event = parse_monitor_message(frames)
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return []
        return [name.decode("utf-8", "replace")
                for name in self.connections.closed(event["value"])]

    def close(self) -> None:
        self.events.close(linger=0)
        self.sock.close(linger=0)


class RemoteEngines:
    """The TCP link's own context and authenticator (ZAP is per context: the client
    socket's CURVE admits any client key, this one only the front end's)."""

    def __init__(self, address: str, keys: KeyPair):
        self.ctx = zmq.Context()
        self.auth = own_key_authenticator(self.ctx, keys, ZAP_DOMAIN, lambda: log.warning(
            "refused an engine connection: its key is not this front end's"))
        self.link = EngineLink(self.ctx, address, keys)

    def close(self) -> None:
        self.link.close()
        self.auth.stop()
        self.ctx.term()
