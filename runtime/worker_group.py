"""A worker group: one logical worker made of `--tp N` (or `--pp N`) ranks over
mx.distributed.

Shared by the launcher (which starts the ranks), the scheduler (which sends every
Step to every rank) and the worker ranks (which form the group): where each rank
listens, what it is called, and the environment mx.distributed reads to form the
group, as `mlx.launch` would set it, so no `mlx.launch` is needed: for the ring
backend `MLX_RANK` and `MLX_HOSTFILE` (a JSON list with one `["IP:PORT"]` per rank);
for JACCL (RDMA over Thunderbolt 5) `MLX_RANK`, `MLX_IBV_DEVICES` (a JSON matrix: row
r names rank r's RDMA device towards each other rank) and `MLX_JACCL_COORDINATOR`
(rank 0's IP and a port).
"""

import json
import socket
from dataclasses import dataclass
from pathlib import Path

RING_HOST = "127.0.0.1"
BACKENDS = ("ring", "jaccl", "jaccl-ring")   # those a --hostfile may name


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
    ip: str          # where its ring connection (or JACCL's coordinator) and Steps listen
    ssh: str = ""    # its name in the hostfile (informative)
    rdma: tuple = ()   # JACCL: its RDMA device towards each rank (None towards itself)


@dataclass(frozen=True)
class Hostfile:
    """An mlx hostfile: one rank per host, in order; rank 0 is the server's machine."""
    hosts: list[RankHost]
    backend: str = "ring"

    def environ(self, rank: int, folder: str, port: int) -> dict[str, str]:
        """What rank `rank`'s process needs in its environment to join the group,
        the files it names written into `folder`; `port`: the ring's first port
        (rank r listens on it + r), or JACCL's coordinator's port on rank 0's host."""
        if self.backend == "ring":
            ring = write_ring_hostfile(str(Path(folder) / "ring.json"),
                                       [port + r for r in range(len(self.hosts))],
                                       [h.ip for h in self.hosts])
            return ring_environ(rank, ring)
        devices = Path(folder) / "ibv-devices.json"
        devices.write_text(json.dumps([list(h.rdma) for h in self.hosts]))
        env = {"MLX_RANK": str(rank), "MLX_IBV_DEVICES": str(devices),
               "MLX_JACCL_COORDINATOR": f"{self.hosts[0].ip}:{port}"}
        return {**env, "MLX_JACCL_RING": "1"} if self.backend == "jaccl-ring" else env


def read_hostfile(path: str) -> Hostfile:
    """An mlx hostfile (`mlx.launch`'s JSON: a list of hosts, or `{"backend", "envs",
    "hosts"}`; each `{"ssh": NAME, "ips": [IP, ...]}`, with `"rdma": [DEVICE | null,
    ...]` for JACCL), checked as `mlx.launch` checks it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostfileError(f"--hostfile {path}: {exc}") from None
    backend = (data.get("backend") or "ring") if isinstance(data, dict) else "ring"
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if backend not in BACKENDS:
        raise HostfileError(f"--hostfile {path}: backend {backend!r} is not served (ring, "
                            "jaccl and jaccl-ring are)")
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise HostfileError(f"--hostfile {path}: expected a list of at least 2 hosts")
    out = []
    for i, host in enumerate(hosts):
        ips = host.get("ips") if isinstance(host, dict) else None
        if not (isinstance(ips, list) and ips and all(isinstance(ip, str) for ip in ips)):
            raise HostfileError(f"--hostfile {path}, host {i}: give its address in "
                                "\"ips\" (the group needs IPs, not host names)")
        rdma = host.get("rdma", []) if backend != "ring" else []
        out.append(RankHost(ips[0], str(host.get("ssh", "")), tuple(rdma or ())))
    if backend != "ring":
        _check_rdma(path, out, ring=backend == "jaccl-ring")
    return Hostfile(out, backend)


def _check_rdma(path: str, hosts: list[RankHost], ring: bool) -> None:
    """JACCL's device matrix: host i lists one entry per rank, null for itself and a
    device (or a list of devices) for every rank it talks to: all of them, or its
    two neighbours with jaccl-ring."""
    n = len(hosts)
    for i, host in enumerate(hosts):
        if len(host.rdma) != n:
            raise HostfileError(f"--hostfile {path}, host {i}: \"rdma\" must list one "
                                f"device per host ({n}), null for itself")
        if host.rdma[i] is not None:
            raise HostfileError(f"--hostfile {path}, host {i}: its own \"rdma\" entry "
                                f"(position {i}) must be null")
        peers = {(i - 1) % n, (i + 1) % n} if ring else set(range(n))
        for j in sorted(peers - {i}):
            device = host.rdma[j]
            named = isinstance(device, str) or (
                isinstance(device, list) and device and all(isinstance(d, str) for d in device))
            if not named:
                raise HostfileError(f"--hostfile {path}, host {i}: no RDMA device is "
                                    f"listed towards host {j}")


def rank_step_addr(hosts: list[RankHost], rank: int, rank_port: int) -> str:
    """Where rank `rank` of a group on `hosts` receives Steps over TCP."""
    return f"tcp://{hosts[rank].ip}:{rank_port + rank}"


def ring_environ(rank: int, hostfile: str) -> dict[str, str]:
    """What a rank's process needs in its environment to join the ring."""
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
