"""The launcher's choice of BLAS for the worker: a system OpenBLAS first, else MKL from
the `mkl` wheel in the environment, else none (mlx's reference BLAS)."""

import sys

import pytest

from mlxd.runtime.blas import find_blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


def _env(monkeypatch, tmp_path, mkl: bool):
    prefix = tmp_path / "venv"
    (prefix / "lib").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr("sysconfig.get_config_var", lambda name: None)
    return _touch(prefix / "lib" / "libmkl_rt.so.2") if mkl else None


def test_system_openblas_is_preferred_to_the_mkl_wheel(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, mkl=True)
    system = tmp_path / "usr-lib"
    openblas = _touch(system / "x86_64-linux-gnu" / "openblas-pthread" / "libblas.so.3")
    assert find_blas("auto", str(system)) == openblas


def test_the_mkl_wheel_is_found_in_the_environment(monkeypatch, tmp_path):
    mkl = _env(monkeypatch, tmp_path, mkl=True)
    assert find_blas("auto", str(tmp_path / "empty")) == mkl


def test_none_found_off_and_explicit(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path, mkl=False)
    assert find_blas("auto", str(tmp_path / "empty")) is None
    assert find_blas("off") is None
    assert find_blas("/opt/libblas.so") == "/opt/libblas.so"
