"""`mlxd rank`: a rank of a tensor- or pipeline-parallel worker group, on another
machine.

    mlxd rank --hostfile hosts.json --rank 1 --model PATH --curve-secret-key KEY [--pp 2]

The server (`mlxd --hostfile hosts.json --model PATH ...`) runs rank 0 beside its
scheduler; each other host of the hostfile runs `mlxd rank` with its rank. The rank's
worker process joins the ring (ports from `--ring-port`), receives every Step over TCP
at its host's address, port `--rank-port` + rank (a CURVE server under the front
end's key pair, admitting that key only), and runs it; it replies nothing. This
command keeps the worker running: when it exits (the group broke: a peer died, the
scheduler restarted the group, a step passed the deadline) it starts a new one, which
joins the next ring.
"""

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import WORKER, ServerFlags
from mlxd.runtime.lifecycle import die_with_parent
from mlxd.runtime.worker_group import HostfileError, rank_name, rank_step_addr, read_hostfile

log = logging.getLogger("mlxd.rank")
RESTART_DELAY_SECONDS = 1.0


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame):
    raise _Stop(signal.Signals(signum).name)


def rank_main(argv: list[str]) -> int:
    from mlxd.launcher import Child, model_folder, with_hostfile
    from mlxd.worker_proc.main import WorkerConfig

    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--rank", type=int, required=True,
                     help="this machine's rank in the --hostfile group (1, 2, ...)")
    mine, argv = own.parse_known_args(argv)
    cfg = parse_config(ServerFlags, "mlxd rank --rank R: a rank of a --tp (or, with --pp, "
                                    "a pipeline) worker group on another machine (see "
                                    "--hostfile)", argv)
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO),
                        format="%(asctime)s rank %(levelname)s: %(message)s")
    try:
        hostfile = read_hostfile(cfg.hostfile)
    except HostfileError as exc:
        sys.exit(f"mlxd rank: {exc}")
    cfg = with_hostfile(cfg)   # --tp or --pp: the number of hosts, as on the server
    hosts = hostfile.hosts
    if not 1 <= mine.rank < len(hosts):
        sys.exit(f"mlxd rank: --rank must be in [1, {len(hosts) - 1}] for this hostfile "
                 "(rank 0 runs with the server)")
    if not cfg.curve_secret_key:
        sys.exit("mlxd rank: --curve-secret-key (the server's key file) is required: "
                 "Steps arrive over TCP")
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    die_with_parent(int(os.environ.get("MLXD_PARENT_PID", "0")) or None)
    flags = dataclasses.replace(cfg, model=model_folder(cfg.model),
                                curve_secret_key=os.path.abspath(cfg.curve_secret_key))
    folder = tempfile.mkdtemp(prefix="mlxd-rank-")
    group_env = hostfile.environ(mine.rank, folder, cfg.ring_port)
    worker = WorkerConfig(input_addr=rank_step_addr(hosts, mine.rank, cfg.rank_port),
                          output_addr="", name=rank_name(WORKER, mine.rank), rank=mine.rank,
                          ranks=len(hosts), backend=hostfile.backend, flags=flags,
                          parent_pid=os.getpid())
    env = {**os.environ, **group_env}
    child = None
    try:
        while True:
            child = Child(worker.name, "mlxd.worker_proc", worker, env)
            log.info("rank %d of %d: worker started (pid %d), Steps on %s", mine.rank,
                     len(hosts), child.proc.pid, worker.input_addr)
            code = child.proc.wait()
            log.warning("rank %d: the worker exited with code %s; starting it again for "
                        "the next group", mine.rank, code)
            time.sleep(RESTART_DELAY_SECONDS)
    except _Stop as why:
        log.info("stopping (%s)", why)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if child is not None and child.alive():
            child.proc.terminate()
            try:
                child.proc.wait(5)
            except Exception:
                child.proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
