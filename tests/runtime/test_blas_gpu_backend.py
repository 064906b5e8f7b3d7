"""With MLX's CUDA backend installed, `--blas auto` preloads no CPU BLAS into the worker
(its matmuls run on the GPU); an explicit library is still preloaded."""

import sys

import pytest

from mlxd.runtime.blas import find_blas, mlx_gpu_backend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _installed(monkeypatch, tmp_path, name: str, version: str = "0.32.4") -> None:
    """A distribution's metadata on sys.path, as `pip install --target` leaves it."""
    info = tmp_path / "site" / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


@pytest.fixture
def system_openblas(tmp_path):
    lib = tmp_path / "usr-lib" / "x86_64-linux-gnu" / "openblas-pthread" / "libblas.so.3"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    return tmp_path / "usr-lib", str(lib)


@pytest.mark.parametrize("backend", ["mlx-cuda-13", "mlx-cuda-12"])
def test_a_cuda_backend_gets_no_cpu_blas(monkeypatch, tmp_path, system_openblas, backend):
    system_lib, _ = system_openblas
    _installed(monkeypatch, tmp_path, backend)
    assert mlx_gpu_backend() == backend
    assert find_blas("auto", str(system_lib)) is None
    assert find_blas("/opt/libblas.so", str(system_lib)) == "/opt/libblas.so"


def test_the_cpu_backend_still_gets_one(monkeypatch, tmp_path, system_openblas):
    system_lib, openblas = system_openblas
    _installed(monkeypatch, tmp_path, "mlx-cpu")
    assert mlx_gpu_backend() is None
    assert find_blas("auto", str(system_lib)) == openblas
