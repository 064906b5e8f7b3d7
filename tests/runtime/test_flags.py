"""runtime/flags.py: every flag declared once; the launcher's --help, each child's
command line and the README's table all derive from that declaration."""

import dataclasses
import re
import subprocess
import sys

from mlxd.runtime.config import secret_environ, to_argv
from mlxd.runtime.flags import CHILDREN, ServerFlags, markdown_table, secret_env, used_by
from mlxd.scheduler_proc.main import SchedulerConfig
from mlxd.tokenizer_proc.main import TokenizerConfig
from mlxd.worker_proc.main import WorkerConfig
from support import ROOT

CONFIGS = {"worker": WorkerConfig("ipc:///a", "ipc:///b"),
           "scheduler": SchedulerConfig("ipc:///a", "ipc:///b", "ipc:///c", "ipc:///d"),
           "tokenizer": TokenizerConfig("tcp://127.0.0.1:1", "ipc:///a", "ipc:///b")}


def _help_flags(argv: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return set(re.findall(r"^  (--[a-z][a-z-]*)", out, re.M)) - {"--help"}


def _names(flags: set[str]) -> set[str]:
    return {f.removeprefix("--no-").removeprefix("--").replace("-", "_") for f in flags}


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "regenerate it: python -m mlxd.runtime.flags"


def test_readme_flags_equal_the_launchers_help():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| flag | default | meaning |"):]
    table = table[:table.index("\n\n")]
    in_readme = {m for m in re.findall(r"^\| `(--[a-z-]+)`", table, re.M)}
    assert _names(_help_flags(["launch.py"])) == _names(in_readme)
    assert _names(_help_flags(["-m", "mlxd.launcher"])) == _names(in_readme)


def test_every_flag_reaches_exactly_the_processes_that_read_it():
    flags = ServerFlags(max_running_requests=3, max_prefill_tokens=5, kv_capacity=7,
                        default_max_tokens=9, model="/m", disable_overlap=True,
                        api_key="s3cret")
    for name, config in CONFIGS.items():
        config = dataclasses.replace(config, flags=flags)
        argv, environ = to_argv(config), secret_environ(config)
        for f in dataclasses.fields(ServerFlags):
            given = any(a.split("=")[0] in ("--" + f.name.replace("_", "-"),
                                            "--no-" + f.name.replace("_", "-")) for a in argv)
            given = given or secret_env(f) in environ
            assert given == used_by(f, name), (name, f.name)
        assert not any("s3cret" in a for a in argv)


def test_a_secret_flag_reaches_a_child_through_its_environment(monkeypatch):
    from mlxd.runtime.config import parse_config

    config = dataclasses.replace(CONFIGS["tokenizer"], flags=ServerFlags(api_key="k-1"))
    assert secret_environ(config) == {"MLXD_API_KEY": "k-1"}
    monkeypatch.setenv("MLXD_API_KEY", "k-1")
    assert parse_config(TokenizerConfig, "", to_argv(config)).flags.api_key == "k-1"
    monkeypatch.delenv("MLXD_API_KEY")
    assert parse_config(TokenizerConfig, "", to_argv(config)).flags.api_key == ""


def test_each_child_accepts_the_flags_it_reads():
    for name in CHILDREN:
        accepted = _names(_help_flags(["-m", f"mlxd.{name}_proc"]))
        wanted = {f.name for f in dataclasses.fields(ServerFlags) if used_by(f, name)}
        assert wanted <= accepted, (name, wanted - accepted)
        assert not ({f.name for f in dataclasses.fields(ServerFlags)} - wanted) & accepted


def test_every_flag_has_help_and_a_known_reader():
    for f in dataclasses.fields(ServerFlags):
        assert f.metadata["help"], f.name
        assert set(f.metadata["used_by"]) <= set(CHILDREN), f.name


def test_numbers_out_of_their_declared_range_are_refused(capsys):
    import pytest

    from mlxd.runtime.config import parse_config

    bounded = [f for f in dataclasses.fields(ServerFlags) if f.metadata.get("minimum") is not None]
    assert {f.name for f in bounded} >= {"request_timeout", "worker_timeout",
                                         "client_queue_limit", "max_running_requests"}
    for f in bounded:
        low = f.metadata["minimum"] - (0 if f.metadata["positive"] else 1)
        for bad in (str(low), "nan"):
            with pytest.raises(SystemExit):
                parse_config(ServerFlags, "t", ["--" + f.name.replace("_", "-"), bad])
            assert f.name.replace("_", "-") in capsys.readouterr().err
        # the declared minimum itself (or just above it) is accepted
        ok = f.metadata["minimum"] + (1 if f.metadata["positive"] else 0)
        flags = parse_config(ServerFlags, "t", ["--" + f.name.replace("_", "-"), str(ok)])
        assert getattr(flags, f.name) == ok
