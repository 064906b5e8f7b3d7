"""The install: one `mlxd` package (no top-level `client`, `protocol`, `runtime`...),
`from mlxd import Client, AsyncClient`, and an `mlxd` command with the launcher's flags."""

import importlib.metadata
import os
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


def test_every_part_is_a_link_inside_mlxd():
    """Each source folder with an `__init__.py` (but tests and bench) is reached as
    `mlxd.<folder>` through a symbolic link `mlxd/<folder> -> ../<folder>`, and
    setuptools finds exactly `mlxd` and what lies under it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config == {"packages": {"find": {"include": ["mlxd", "mlxd.*"]}}}
    source = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "mlxd"}
    links = {p.name: p for p in (ROOT / "mlxd").iterdir() if p.is_symlink()}
    assert set(links) == source
    for name, link in links.items():
        assert os.readlink(link) == f"../{name}"
    assert "py-modules" not in config   # no top-level module either
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"mlxd": "mlxd.launcher:main"}


@pytest.mark.parametrize("name", ["mlxd.tests", "mlxd.docs", "mlxd.bench"])
def test_nothing_but_the_parts_is_importable_under_mlxd(name, tmp_path):
    done = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "No module named" in done.stderr


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
