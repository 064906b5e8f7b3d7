"""A worker group: one logical worker made of `--tp N` ranks over mx.distributed.

Shared by the launcher (which starts the ranks), the scheduler (which sends every
Step to every rank) and the worker ranks (which form the group): where each rank
listens, what it is called, and the environment mx.distributed reads to form a ring
(`MLX_RANK`, `MLX_HOSTFILE`: a JSON list with one `["IP:PORT"]` per rank, as
`mlx.launch` writes it), so no `mlx.launch` is needed.
"""

import json
import socket
from dataclasses import dataclass
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


def write_ring_hostfile(path: str, ports: list[int], ips: list[str] | None = None) -> str:
    """The ring backend's hostfile: rank r at `ips[r]` (default 127.0.0.1), `ports[r]`;
    its path."""
    ips = ips or [RING_HOST] * len(ports)
    Path(path).write_text(json.dumps([[f"{ip}:{port}"] for ip, port in zip(ips, ports)]))
    return path


class HostfileError(ValueError):
    """A --hostfile that cannot place a group; the message says why."""


@dataclass(frozen=True)
class RankHost:
    ip: str          # where its ring connection and its Step socket listen
    ssh: str = ""    # its name in the hostfile (informative)


def read_hostfile(path: str) -> list[RankHost]:
    """The hosts of an mlx hostfile (`mlx.launch`'s JSON: a list of hosts, or
    `{"backend", "envs", "hosts"}`; each `{"ssh": NAME, "ips": [IP, ...]}`), one rank
    each, in order; rank 0 is the server's own machine. Only the ring backend."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostfileError(f"--hostfile {path}: {exc}") from None
    backend = data.get("backend", "") if isinstance(data, dict) else ""
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if backend not in ("", "ring"):
        raise HostfileError(f"--hostfile {path}: backend {backend!r} is not served yet "
                            "(the ring backend is)")
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise HostfileError(f"--hostfile {path}: expected a list of at least 2 hosts")
    out = []
    for i, host in enumerate(hosts):
        ips = host.get("ips") if isinstance(host, dict) else None
        if not (isinstance(ips, list) and ips and all(isinstance(ip, str) for ip in ips)):
            raise HostfileError(f"--hostfile {path}, host {i}: give its address in "
                                "\"ips\" (the ring needs IPs, not host names)")
        out.append(RankHost(ips[0], str(host.get("ssh", ""))))
    return out


def rank_step_addr(hosts: list[RankHost], rank: int, rank_port: int) -> str:
    """Where rank `rank` of a group on `hosts` receives Steps over TCP."""
    return f"tcp://{hosts[rank].ip}:{rank_port + rank}"


def ring_environ(rank: int, hostfile: str) -> dict[str, str]:
    """What a rank's process needs in its environment to join the ring."""
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
