"""A worker group: one logical worker made of `--tp N` ranks over mx.distributed.

Shared by the launcher (which starts the ranks), the scheduler (which sends every
Step to every rank) and the worker ranks (which form the group): where each rank
listens, what it is called, and the environment mx.distributed reads to form a ring
(`MLX_RANK`, `MLX_HOSTFILE`: a JSON list with one `["IP:PORT"]` per rank, as
`mlx.launch` writes it), so no `mlx.launch` is needed.
"""

import json
import socket
from pathlib import Path

RING_HOST = "127.0.0.1"


def rank_input_addr(addr: str, rank: int) -> str:
    """Where rank `rank` of the worker whose Step address is `addr` receives Steps."""
    return addr if rank == 0 else f"{addr}.r{rank}"


def rank_name(name: str, rank: int) -> str:
    """Rank `rank` of the worker process `name` (rank 0 keeps the worker's name)."""
    return name if rank == 0 else f"{name}.r{rank}"


def free_ports(n: int, host: str = RING_HOST) -> list[int]:
    """`n` TCP ports free on `host` now (held together while picked, so distinct)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_ring_hostfile(path: str, ports: list[int], host: str = RING_HOST) -> str:
    """The ring backend's hostfile for one rank per port on `host`; its path."""
    Path(path).write_text(json.dumps([[f"{host}:{port}"] for port in ports]))
    return path


def ring_environ(rank: int, hostfile: str) -> dict[str, str]:
    """What a rank's process needs in its environment to join the ring."""
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
