"""Whether the client's socket has a live connection to the server.

ZeroMQ reconnects on its own and queues what is sent meanwhile, so without this a
call to a dead server would wait its whole timeout. The socket's monitor reports
each completed handshake and each disconnect; a call made while no connection
exists waits a short grace period for one, then fails — saying so when the server
refused the handshake (a CURVE key missing or wrong).
"""

import asyncio
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from mlxd.runtime.aio import LoopSocket

from .types import MlxdError

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED


class Connection:
    """Follows a socket's monitor (a PAIR receiving its EVENTS, read as a multipart
    LoopSocket); made in the event loop that runs `watch()`. `on_lost` gets the error
    for the requests in flight when an established connection drops."""

    def __init__(self, monitor: LoopSocket, address: str,
                 on_lost: Callable[[MlxdError], None], encrypted: bool = False):
        self._monitor = monitor
        self._address = address
        self._on_lost = on_lost
        self._encrypted = encrypted
        self._up = asyncio.Event()
        self._refused = False   # the latest handshake failed

    @property
    def up(self) -> bool:
        return self._up.is_set()

    async def watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = False
                self._up.set()
            elif event["event"] & HANDSHAKE_FAILED:
                self._refused = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._up.is_set():
                self._up.clear()
                self._on_lost(MlxdError("disconnected",
                                        f"lost the connection to {self._address}"))

    async def ready(self, grace: float) -> None:
        """Return once connected; MlxdError("unavailable") if no connection exists
        within `grace` seconds (nothing listens there, or the server is gone)."""
        if self._up.is_set():
            return
        try:
            await asyncio.wait_for(self._up.wait(), grace)
        except asyncio.TimeoutError:
            if self._refused:
                raise MlxdError("unauthorized", self._refusal()) from None
            raise MlxdError("unavailable",
                            f"no connection to {self._address} within {grace} s") from None

    def _refusal(self) -> str:
        why = ("with the server key it was given: the key is wrong" if self._encrypted else
               "without a server key: the server requires CURVE; pass server_key= (or set "
               "MLXD_SERVER_KEY). Local servers publish theirs for the user who started them")
        return f"{self._address} refused the handshake {why}"
