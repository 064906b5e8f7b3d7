"""Hostfiles (mlx's format) and the environment each rank of a group gets: the ring
backend's ports and addresses, JACCL's device matrix and coordinator, and the
hostfiles `mlx.launch` would refuse, refused with the reason."""

import json

import pytest

from mlxd.runtime.worker_group import HostfileError, read_hostfile


def write(tmp_path, data) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


JACCL = {"backend": "jaccl", "hosts": [
    {"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en2", "rdma_en3"]},
    {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en2", None, "rdma_en3"]},
    {"ssh": "m3", "ips": ["10.0.0.3"], "rdma": ["rdma_en2", ["rdma_en3", "rdma_en4"], None]},
]}


def test_a_ring_hostfile_gives_each_rank_its_port_on_its_host(tmp_path):
    hostfile = read_hostfile(write(tmp_path, [{"ssh": "a", "ips": ["10.0.0.1", "x"]},
                                              {"ssh": "b", "ips": ["10.0.0.2"]}]))
    assert hostfile.backend == "ring"
    assert [(h.ip, h.ssh) for h in hostfile.hosts] == [("10.0.0.1", "a"), ("10.0.0.2", "b")]
    env = hostfile.environ(1, str(tmp_path), 40000)
    assert env["MLX_RANK"] == "1"
    ring = json.loads(open(env["MLX_HOSTFILE"]).read())
    assert ring == [["10.0.0.1:40000"], ["10.0.0.2:40001"]]


def test_a_jaccl_hostfile_gives_the_device_matrix_and_the_coordinator(tmp_path):
    hostfile = read_hostfile(write(tmp_path, JACCL))
    assert hostfile.backend == "jaccl"
    env = hostfile.environ(2, str(tmp_path), 32323)
    assert env["MLX_RANK"] == "2"
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:32323"
    assert "MLX_JACCL_RING" not in env and "MLX_HOSTFILE" not in env
    assert json.loads(open(env["MLX_IBV_DEVICES"]).read()) == [h["rdma"] for h in JACCL["hosts"]]


def test_jaccl_ring_needs_devices_towards_neighbours_only(tmp_path):
    hosts = [{"ips": [f"10.0.0.{i}"], "rdma": [None] * 4} for i in range(4)]
    for i, host in enumerate(hosts):
        host["rdma"][(i - 1) % 4] = host["rdma"][(i + 1) % 4] = "rdma_en2"
    hostfile = read_hostfile(write(tmp_path, {"backend": "jaccl-ring", "hosts": hosts}))
    assert hostfile.environ(0, str(tmp_path), 5000)["MLX_JACCL_RING"] == "1"
    with pytest.raises(HostfileError, match="no RDMA device is listed towards host 2"):
        read_hostfile(write(tmp_path, {"backend": "jaccl", "hosts": hosts}))


@pytest.mark.parametrize("change,says", [
    (lambda h: h[0].update(rdma=["rdma_en2", "rdma_en2", "rdma_en3"]),
     "its own \"rdma\" entry (position 0) must be null"),
    (lambda h: h[1].update(rdma=["rdma_en2", None]), "must list one device per host (3)"),
    (lambda h: h[2].update(rdma=[None, "rdma_en3", None]),
     "host 2: no RDMA device is listed towards host 0"),
    (lambda h: h[1].update(rdma=[[], None, "x"]), "host 1: no RDMA device is listed"),
    (lambda h: h[0].pop("rdma"), "host 0: \"rdma\" must list one device per host"),
    (lambda h: h[1].update(ips=["m2.local", 7]), "give its address in \"ips\""),
])
def test_jaccl_hostfiles_mlx_launch_would_refuse_are_refused(tmp_path, change, says):
    data = json.loads(json.dumps(JACCL))
    change(data["hosts"])
    with pytest.raises(HostfileError) as refused:
        read_hostfile(write(tmp_path, data))
    assert says in str(refused.value)


@pytest.mark.parametrize("data,says", [
    ("{not json", "hosts.json"),
    ({"backend": "mpi", "hosts": []}, "backend 'mpi' is not served"),
    ({"backend": "ring", "hosts": [{"ips": ["10.0.0.1"]}]}, "at least 2 hosts"),
    ([{"ips": ["10.0.0.1"]}, "host"], "host 1: give its address"),
])
def test_other_broken_hostfiles_are_refused(tmp_path, data, says):
    with pytest.raises(HostfileError) as refused:
        read_hostfile(write(tmp_path, data))
    assert says in str(refused.value)
