"""The install: one `mlxd` package (no top-level `client`, `protocol`, `runtime`...),
`from mlxd import Client, AsyncClient`, and an `mlxd` command with the launcher's flags."""

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from support import ROOT

INTERNAL = ("protocol", "runtime", "client", "model_store", "tokenizer_proc",
            "scheduler_proc", "worker_proc", "launch")


def test_the_sdk_is_imported_as_mlxd():
    from mlxd import AsyncClient, Client, MlxdError
    from mlxd.client import AsyncClient as A, Client as C

    assert (Client, AsyncClient) == (C, A) and issubclass(MlxdError, Exception)


def test_every_installed_package_is_inside_mlxd():
    """pyproject's packages are `mlxd` and its subpackages only, each mapped to a source
    folder, and every package folder of the source tree is one of them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = config["packages"], config["package-dir"]
    assert all(p == "mlxd" or p.startswith("mlxd.") for p in packages)
    assert set(packages) == set(dirs)
    for package, folder in dirs.items():
        assert (ROOT / folder / "__init__.py").is_file(), (package, folder)
    source = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert source == {folder for folder in dirs.values() if "/" not in folder}
    nested = {str(p.parent.relative_to(ROOT)) for folder in source
              for p in (ROOT / folder).glob("*/__init__.py")}
    assert nested == {folder for folder in dirs.values() if "/" in folder}
    assert "py-modules" not in config   # no top-level module either
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"mlxd": "mlxd.launcher:main"}


def test_the_installed_distribution_has_one_top_level_name():
    top = importlib.metadata.distribution("mlxd").read_text("top_level.txt")
    assert top.split() == ["mlxd"]


def test_the_mlxd_command_prints_the_flags():
    command = shutil.which("mlxd")
    if command is None:
        pytest.skip("mlxd is not installed (pip install -e .)")
    out = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "--max-running-requests" in out and "--model" in out


def test_code_imports_internal_parts_only_through_mlxd():
    """A bare `import protocol` would load a second copy of a module (or someone
    else's package of that name) once installed."""
    bare = re.compile(rf"^\s*(from|import) ({'|'.join(INTERNAL)})\b", re.M)
    offenders = [str(path.relative_to(ROOT)) for folder in (*INTERNAL[:-1], "mlxd", "bench", "tests")
                 for path in (ROOT / folder).rglob("*.py") if bare.search(path.read_text())]
    assert offenders == []
