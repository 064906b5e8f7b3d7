"""The scheduler's one socket to the front end (the tokenizer process): a DEALER
connected to the front end's engine ROUTER, named by the engine's name (its routing
id). Requests, aborts and stats queries come in on it; SchedulerReady (the engine's
joining), TokenBatches and Stats go out.

On this machine the address is the front end's `ipc://` one; an engine on another
machine (`mlxd engine --join`) connects over `tcp://` with CURVE under the front
end's own key pair, which the front end's authenticator alone accepts, and ZeroMQ
heartbeats notice a peer that vanished; a frame over MAX_FRAME_BYTES (a handshake's
too, read before the key is checked) ends the connection. The socket monitor
reports the connection's ends and new starts: the loop re-announces itself on each
new start (a restarted front end learns of it) and drops the requests of an ended
one (nobody waits for them any more).
"""

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.runtime.keys import KeyPair, connect_as_owner
from mlxd.protocol.codec import MAX_FRAME_BYTES
from mlxd.runtime.sockets import cap_frames, heartbeat


class FrontendLink:
    """`sock` carries the messages both ways; `monitor` is readable when the
    connection ended or (re)started (poll it, then call `events()`)."""

    def __init__(self, ctx: zmq.Context, address: str, engine: str,
                 curve: KeyPair | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)   # never block the loop on the front end
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, engine.encode())
        if curve is not None:   # the front end's pair: its authenticator admits it alone
            connect_as_owner(self.sock, curve)
        if address.startswith("tcp://"):
            heartbeat(self.sock)
            # whoever answers at that address is read before its key is checked
            cap_frames(self.sock, MAX_FRAME_BYTES)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.secure = curve is not None
        self.sock.connect(address)

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv_nowait(self) -> bytes | None:
        try:
            return self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def events(self) -> list[str]:
        """What happened to the connection since the last call, in order:
        "ended", "started" (for CURVE: once its handshake succeeded)."""
        started = zmq.EVENT_HANDSHAKE_SUCCEEDED if self.secure else zmq.EVENT_CONNECTED
        out = []
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out
            if event["event"] == zmq.EVENT_DISCONNECTED:
                out.append("ended")
            elif event["event"] == started:
                out.append("started")
