"""Which client connection each ZeroMQ identity came in on, so that a connection's
end forgets its clients at once (their requests are aborted, not run for nobody).

A ROUTER says nothing when a peer goes; its socket monitor does (EVENT_DISCONNECTED,
with the connection's file descriptor), and every received message names the
descriptor it came from (ZMQ_SRCFD). The two meet here. Events are read before a new
identity is registered: a descriptor number can be reused by a new connection, and
the old connection's end is always reported before the new one is accepted.
"""

from collections import defaultdict


class Connections:
    def __init__(self):
        self._fd_of: dict[bytes, int] = {}
        self._clients_on: defaultdict[int, set[bytes]] = defaultdict(set)

    def __contains__(self, client: bytes) -> bool:
        return client in self._fd_of

    def seen(self, client: bytes, fd: int) -> None:
        """`client` sent a message over connection `fd`."""
        old = self._fd_of.get(client)
        if old == fd:
            return
        if old is not None:
            self._clients_on[old].discard(client)
        self._fd_of[client] = fd
        self._clients_on[fd].add(client)

    def closed(self, fd: int) -> list[bytes]:
        """Connection `fd` ended: the identities that came in on it (now forgotten)."""
        clients = self._clients_on.pop(fd, set())
        for client in clients:
            del self._fd_of[client]
        return sorted(clients)

    def __len__(self) -> int:
        return len(self._fd_of)
