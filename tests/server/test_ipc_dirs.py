"""launcher.py: the ipc folders of dead launchers are removed at the next start."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.launcher import PID_FILE, remove_stale_ipc_dirs
from support import Server, pid_alive, wait_until


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_dir(folder: Path, name: str, pid_text: str | None) -> Path:
    path = folder / name
    path.mkdir()
    (path / "socket").write_text("")
    if pid_text is not None:
        (path / PID_FILE).write_text(pid_text)
    return path


def test_only_folders_of_dead_launchers_are_removed(tmp_path):
    stale = make_dir(tmp_path, "mlxd-stale", str(dead_pid()))
    live = make_dir(tmp_path, "mlxd-live", str(os.getpid()))
    unknown = make_dir(tmp_path, "mlxd-no-pid-file", None)
    garbled = make_dir(tmp_path, "mlxd-garbled", "not a pid")
    other = make_dir(tmp_path, "other-dead", str(dead_pid()))
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists()
    assert all(p.exists() for p in (live, unknown, garbled, other))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_launcher_s_folder_is_removed_at_the_next_start(tmp_path, llama_model):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    first = Server(llama_model, "--kv-capacity", "1024", "--log-level", "warning", env=env)
    try:
        [old] = tmp_path.glob("mlxd-*")
        assert (old / PID_FILE).read_text() == str(first.proc.pid)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        assert wait_until(lambda: not any(pid_alive(p) for p in first.child_pids), 10)
        assert old.exists()   # nobody cleaned up after SIGKILL
    finally:
        first.stop()
    second = Server(llama_model, "--kv-capacity", "1024", "--log-level", "warning", env=env)
    try:
        [new] = tmp_path.glob("mlxd-*")
        assert new != old and not old.exists()
        assert (new / PID_FILE).read_text() == str(second.proc.pid)
    finally:
        second.stop()
