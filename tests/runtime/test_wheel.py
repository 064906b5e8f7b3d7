"""The wheel: built from the checkout, its only top-level entry is `mlxd/` (the parts
under it as real files), and installed into a fresh virtual environment it serves a
request from there, not from the checkout."""

import subprocess
import sys
import zipfile

import pytest

from mlxd import Client
from support import ROOT, Server


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    (path,) = out.glob("mlxd-*.whl")
    return str(path)


def test_the_wheel_holds_only_the_mlxd_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"mlxd", next(
        n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))}
    for part in ("protocol", "runtime", "client", "model_store", "tokenizer_proc",
                 "tokenizer_proc/http", "tokenizer_proc/tools", "scheduler_proc",
                 "worker_proc"):
        assert f"mlxd/{part}/__init__.py" in names, part
    assert not [n for n in names if n.startswith(("mlxd/tests", "mlxd/bench", "mlxd/docs"))]


def test_the_installed_wheel_serves_a_request(wheel, tmp_path, llama_model):
    """A virtual environment that sees this machine's packages (mlx, zmq, ...) but
    gets mlxd only from the wheel; the server runs from outside the checkout."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    wheel], check=True, timeout=300, capture_output=True)
    where = subprocess.run([str(python), "-c", "import mlxd.worker_proc as w; print(w.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    server = Server(llama_model, "--log-level", "warning", command=[str(venv / "bin" / "mlxd")],
                    cwd=tmp_path)
    try:
        with Client(server.address) as c:
            result = c.generate("Hello model server", max_tokens=4, ignore_eos=True)
    finally:
        server.stop()
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
