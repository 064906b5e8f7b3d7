"""runtime/config.py: frozen config dataclasses <-> command-line flags."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest

from mlxd.runtime.config import add_config_arguments, parse_config, to_argv


@dataclass(frozen=True)
class Cfg:
    model: str
    port: int
    name: str = "mlxd"
    workers: int = 2
    mem_fraction: float = 0.3
    verbose: bool = False
    reuse: bool = True
    seed: int | None = None
    ratio: Optional[float] = None
    label: str | None = None


REQUIRED = ["--model", "m", "--port", "1"]


def parse(argv):
    return parse_config(Cfg, "test", argv)


def test_defaults():
    cfg = parse(REQUIRED)
    assert cfg == Cfg(model="m", port=1)
    assert cfg.seed is None and cfg.ratio is None and cfg.label is None
    assert cfg.verbose is False and cfg.reuse is True


def test_flags_and_types():
    cfg = parse(["--model", "/models/x y", "--port", "8080", "--name", "n", "--workers", "-3",
                 "--mem-fraction", "0.75", "--verbose", "--no-reuse", "--seed", "42",
                 "--ratio", "1e-3", "--label", "L"])
    assert cfg == Cfg("/models/x y", 8080, "n", -3, 0.75, True, False, 42, 0.001, "L")
    assert type(cfg.port) is int and type(cfg.mem_fraction) is float
    assert type(cfg.seed) is int and type(cfg.ratio) is float


def test_result_is_the_frozen_dataclass():
    cfg = parse(REQUIRED)
    assert isinstance(cfg, Cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 2


@pytest.mark.parametrize("cfg", [
    Cfg("m", 1),
    Cfg("model path with spaces", 65535, "", 0, 0.0, True, False, 0, 0.0, ""),
    Cfg("ipc:///tmp/mlxd-1/sched", 0, "日本語", -7, 1e-12, False, True, 2**63 - 1, -2.5, "x=y"),
    Cfg("m", 1, mem_fraction=0.1 + 0.2, ratio=1 / 3),          # floats survive exactly
    Cfg("m", -1, workers=-100, seed=-5, ratio=-0.5),           # negative numbers
])
def test_round_trip(cfg):
    argv = to_argv(cfg)
    assert all(isinstance(a, str) for a in argv)
    assert parse(argv) == cfg


def test_to_argv_format():
    argv = to_argv(Cfg("m", 5, verbose=True, reuse=False, seed=3))
    assert argv == ["--model=m", "--port=5", "--name=mlxd", "--workers=2",
                    "--mem-fraction=0.3", "--verbose", "--no-reuse", "--seed=3"]


def test_to_argv_skips_none():
    argv = to_argv(Cfg("m", 5))
    assert not any(a.startswith(("--seed", "--ratio", "--label")) for a in argv)


def test_str_value_starting_with_a_dash_round_trips():
    cfg = Cfg("-model-", 1, name="--odd")
    assert parse(to_argv(cfg)) == cfg


@pytest.mark.parametrize("argv", [
    [], ["--model", "m"], ["--port", "1"],
])
def test_required_fields_are_required(argv, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert "required" in capsys.readouterr().err


def test_required_bool_field_is_required(capsys):
    @dataclass(frozen=True)
    class WithFlag:
        enable: bool
        n: int = 1

    assert parse_config(WithFlag, "t", ["--enable"]).enable is True
    assert parse_config(WithFlag, "t", ["--no-enable"]).enable is False
    with pytest.raises(SystemExit):
        parse_config(WithFlag, "t", [])


@pytest.mark.parametrize("argv", [
    REQUIRED + ["--port", "x"], REQUIRED + ["--workers", "1.5"],
    REQUIRED + ["--mem-fraction", "lots"], REQUIRED + ["--seed", "1.0"],
    REQUIRED + ["--unknown", "1"], REQUIRED + ["--verbose=yes"],
])
def test_bad_values_exit(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_last_flag_wins():
    assert parse(REQUIRED + ["--port", "9", "--verbose", "--no-verbose"]) == Cfg("m", 9)


def test_help_texts_and_defaults_in_help():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Cfg, {"workers": "how many workers"})
    text = parser.format_help()
    assert "--mem-fraction" in text and "--no-verbose" in text
    assert "how many workers (default: 2)" in text


def test_real_process_configs_round_trip():
    from mlxd.runtime.flags import ServerFlags
    from mlxd.scheduler_proc.main import SchedulerConfig
    from mlxd.tokenizer_proc.main import TokenizerConfig

    flags = ServerFlags(max_running_requests=3, log_level="debug", model="/m",
                        default_max_tokens=17)
    sched = SchedulerConfig("ipc:///a", "ipc:///b", "ipc:///c", "ipc:///d",
                            flags=flags, parent_pid=123)
    back = parse_config(SchedulerConfig, "t", to_argv(sched))
    # the scheduler's command line carries only the flags it reads
    assert back.flags == ServerFlags(max_running_requests=3, log_level="debug")
    assert dataclasses.replace(back, flags=flags) == sched
    assert "--model=/m" not in to_argv(sched) and "--max-running-requests=3" in to_argv(sched)
    tok = TokenizerConfig("tcp://127.0.0.1:0", "ipc:///i", "ipc:///s", flags=flags)
    back = parse_config(TokenizerConfig, "t", to_argv(tok))
    assert back.flags == ServerFlags(model="/m", log_level="debug", default_max_tokens=17)
