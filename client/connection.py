"""Whether the client's socket has a live connection to the server.

ZeroMQ reconnects on its own and queues what is sent meanwhile, so without this a
call to a dead server would wait its whole timeout. The socket's monitor reports
each connect and disconnect; a call made while no connection exists waits a short
grace period for one, then fails.
"""

import asyncio
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from .types import MlxdError

EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class Connection:
    """Follows a monitor socket (`sock.get_monitor_socket(EVENTS)`); made in the event
    loop that runs `watch()`. `on_lost` gets the error for the requests in flight when
    an established connection drops."""

    def __init__(self, monitor, address: str, on_lost: Callable[[MlxdError], None]):
        self._monitor = monitor
        self._address = address
        self._on_lost = on_lost
        self._up = asyncio.Event()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    async def watch(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self._up.set()
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
            raise MlxdError("unavailable",
                            f"no connection to {self._address} within {grace} s") from None
