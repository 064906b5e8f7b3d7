"""Start mlxd: the tokenizer, scheduler and MLX worker processes.

    mlxd --model PATH            (or: python launch.py --model PATH)
    mlxd --model A --model B     (or: --models FILE): several models, picked by name

Spawns the three as `python -m ...` subprocesses wired over ZeroMQ (with `--dp N`,
N engines of a scheduler and a worker each behind the one tokenizer), waits for
their READY, prints `mlxd ready: tcp://HOST:PORT`, then watches them. A worker
that crashes after its READY is replaced by a new one (`--restart-worker`, within
`--worker-restarts`), and so is a whole engine whose scheduler dies (or that the
front end reports unresponsive); its requests wait at the front end and go on once
it joins again. Any other death stops the others and the launcher exits non-zero.

With several models, the engines of the models that fit `--models-memory` start with
the server; the front end asks for the others (and for unloads) with ModelControl
messages on the launcher's socket, and the launcher starts and stops their engines;
a load that fails (its engine dies before it is ready, its folder is gone) is reported
to the front end at once (ModelLoadFailed on the front end's `front_control` socket).

    mlxd engine --join tcp://HOST:PORT --model PATH

starts one engine (a scheduler and its worker) that joins the front end on another
machine (its `--engine-port`), under the same `--curve-secret-key` file.
"""

import argparse
import collections
import dataclasses
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import zmq

from mlxd.protocol import (Decoder, EngineUnresponsive, ModelControl, ModelLoadFailed,
                           ProtocolError, Ready, encode)
from mlxd.runtime.config import parse_config, secret_environ, to_argv
from mlxd.runtime import keys
from mlxd.runtime.flags import (SCHEDULER, TOKENIZER, WORKER, WORKER_RESTART_WINDOW_SECONDS,
                                ServerFlags)
from mlxd.model_store.resolve import (ModelError, fetch_model, local_models, resolve_model,
                                      served_name)
from mlxd.runtime.blas import find_blas, mlx_gpu_backend
from mlxd.runtime.model_catalog import (Catalog, CatalogError, ModelEntry, build_catalog,
                                        read_models_file)
from mlxd.runtime.worker_group import (HostfileError, free_ports, rank_input_addr, rank_name,
                                       rank_step_addr, read_hostfile, ring_environ,
                                       write_ring_hostfile)
from mlxd.model_store.parallel import split_refusal
from mlxd.runtime.lifecycle import die_with_parent, pid_alive
from mlxd.scheduler_proc.main import SchedulerConfig
from mlxd.tokenizer_proc.main import TokenizerConfig
from mlxd.worker_proc.main import WorkerConfig

log = logging.getLogger("mlxd.launch")
# The folder that holds the `mlxd` package: a source checkout, or site-packages.
ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_SECONDS = 4.0
UNRESPONSIVE_GRACE_SECONDS = 2.0   # a scheduler whose link ended may take this to exit
IPC_PREFIX = "mlxd-"
PID_FILE = "launcher.pid"   # in the ipc folder: which launcher owns it
READY_PREFIX = "mlxd ready: "
HTTP_PREFIX = "mlxd http: "
ENGINE_PREFIX = "mlxd engines join: "   # the front end's engine address; an engine's own
MAX_REASON_CHARS = 1000   # of a failed load's cause, as the front end shows it


class Child:
    """A child process whose stderr is forwarded and whose tail is kept."""

    def __init__(self, name: str, module: str, config, env: dict):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *to_argv(config)], cwd=ROOT,
            env={**env, **secret_environ(config)},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, errors="replace")
        threading.Thread(target=self._pump, name=f"{name}-stderr", daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    def alive(self) -> bool:
        return self.proc.poll() is None


def make_ipc_dir() -> str:
    """A private folder for the sockets, recording our pid; first removes the folders
    of launchers that died without cleaning up (SIGKILL)."""
    remove_stale_ipc_dirs(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=IPC_PREFIX)
    Path(path, PID_FILE).write_text(str(os.getpid()))
    return path


def remove_stale_ipc_dirs(folder: str) -> list[str]:
    """Remove the `mlxd-*` folders in `folder` whose recorded launcher is dead. A
    folder without a readable pid file may not be ours, or is being made: kept."""
    removed = []
    for path in glob.glob(os.path.join(folder, IPC_PREFIX + "*")):
        pid = _recorded_pid(path)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _recorded_pid(path: str) -> int | None:
    try:
        text = Path(path, PID_FILE).read_text()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


class RestartBudget:
    """At most `limit` restarts within any `window` seconds."""

    def __init__(self, limit: int, window: float = WORKER_RESTART_WINDOW_SECONDS):
        self.limit, self.window = limit, window
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float) -> bool:
        """Count a restart at `now` if the budget allows one; whether it did."""
        while self._times and now - self._times[0] >= self.window:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True


class EngineProcs:
    """One engine's processes: a worker (one process, or the ranks of a tensor-parallel
    group) and the scheduler driving it, each restarted with the config it started
    with; a group always restarts whole (a ring cannot be formed again in a process)."""

    def __init__(self, worker: Callable[[], list[tuple["WorkerConfig", dict]]],
                 scheduler: tuple["SchedulerConfig", dict], restarts: int,
                 model: str = "", on_demand: bool = False):
        """`worker()`: each rank's config and environment (a group's: a fresh ring)."""
        self._worker_specs, self._scheduler_spec = worker, scheduler
        self.name = scheduler[0].engine   # its routing id at the front end
        self.suspect_since: float | None = None   # the front end lost it then
        self.model = model            # its model's name
        self.on_demand = on_demand    # loaded while serving: a failed start is not fatal
        self.restarts = RestartBudget(restarts)
        self.workers: list[Child] = []
        self.spawn_worker()
        self.scheduler = self.spawn_scheduler()

    @property
    def worker(self) -> Child:
        """Rank 0 (the only one without a group): the one that replies."""
        return self.workers[0]

    def spawn_worker(self) -> None:
        """(Re)start the worker: every rank, those still alive stopped first."""
        stop_in_order([self.workers])
        self.workers = [Child(config.name, "mlxd.worker_proc", config, env)
                        for config, env in self._worker_specs()]
        self.worker_ready = False   # a worker that reported READY may be restarted

    def spawn_scheduler(self) -> Child:
        self.suspect_since = None
        config, env = self._scheduler_spec
        self.scheduler = Child(config.name, "mlxd.scheduler_proc", config, env)
        self.ready = False   # both reported READY: the engine may be restarted
        return self.scheduler

    @property
    def children(self) -> list[Child]:
        return [*self.workers, self.scheduler]

    @property
    def tiers(self) -> list[list[Child]]:
        """The engine's processes in the order they stop: the scheduler, then the
        workers it drives."""
        return [[self.scheduler], self.workers]

    def stop(self) -> None:
        stop_in_order(self.tiers)


def stop_in_order(tiers: list[list[Child]]) -> None:
    """Terminate tier by tier, each given a share of the grace to exit before the
    next is told (a process whose peer upstream went first is being stopped, and
    does not report it lost), then kill what has not exited by the end of the grace
    (a stopped process too: SIGKILL ends it)."""
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for tier in tiers:
        for child in tier:
            if child.alive():
                child.proc.terminate()
        tier_end = min(deadline, time.monotonic() + STOP_GRACE_SECONDS / (len(tiers) + 1))
        for child in tier:
            try:
                child.proc.wait(max(0.0, tier_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass   # killed at the deadline below
    for child in (c for tier in tiers for c in tier):
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; killing it", child.name)
            child.proc.kill()
            child.proc.wait()


def memory_share(flags: ServerFlags, parts: int) -> ServerFlags:
    """`flags` with a `parts`-th of the memory limit (`--mem-fraction`, or
    `--mem-limit-gb` where given)."""
    return dataclasses.replace(flags, mem_fraction=flags.mem_fraction / parts,
                               mem_limit_gb=flags.mem_limit_gb / parts)


def _suffix(index: int) -> str:
    """Engine 0's processes keep the plain names ("worker", "scheduler")."""
    return str(index) if index else ""


class Launcher:
    def __init__(self, cfg: ServerFlags):
        self.cfg = cfg
        self.engines: list[EngineProcs] = []
        self.tokenizer: Child | None = None
        self.catalog: Catalog | None = None
        self.hostfile = read_hostfile(cfg.hostfile) if cfg.hostfile else None
        self._engine_count = 0   # engines started so far: the next one's index
        self.client_keys = self._client_keys()
        self.published_port: int | None = None   # where the public key was published
        self._ready_decoder = Decoder(Ready, ModelControl, EngineUnresponsive)
        self.ipc_dir = make_ipc_dir()
        self.ctx = zmq.Context()
        self.ready_sock = self.ctx.socket(zmq.PULL)
        self.ready_sock.setsockopt(zmq.LINGER, 0)
        self.ready_sock.bind(self._ipc("launcher"))
        self.to_front: zmq.Socket | None = None   # reports to the front end (failed loads)

    @property
    def children(self) -> list[Child]:
        out = [c for engine in self.engines for c in engine.children]
        return out + ([self.tokenizer] if self.tokenizer else [])

    def _client_keys(self) -> keys.KeyPair:
        """The client socket's CURVE keys: `--curve-secret-key`'s, else the user's
        default pair (runtime/keys.py). The tokenizer reads the same file."""
        given = self.cfg.curve_secret_key
        path = os.path.abspath(given) if given else str(keys.default_key_file())
        self.cfg = dataclasses.replace(self.cfg, curve_secret_key=path)   # children run elsewhere
        try:
            return keys.read_secret_key(path)
        except keys.BadKey as exc:
            raise ChildFailure(f"--curve-secret-key: {exc}" if given else str(exc)) from None

    def publish_key(self, address: str) -> None:
        """Let this user's local clients find the server's public key (runtime/keys.py);
        tell the user how remote ones get it."""
        port = int(address.rsplit(":", 1)[1])
        keys.publish(port, self.client_keys, os.getpid())
        self.published_port = port
        log.info("client socket: CURVE; clients on other machines pass "
                 "server_key=%s (or set MLXD_SERVER_KEY)", self.client_keys.public.decode())
        warn_if_exposed(self.cfg)

    def _ipc(self, name: str) -> str:
        return f"ipc://{self.ipc_dir}/{name}"

    def _flags(self, model: str, draft_model: str, name: str = "") -> ServerFlags:
        return dataclasses.replace(   # the resolved folders, and the defaults derived
            self.cfg, model=model, http_host=self.cfg.http_host or self.cfg.host,
            served_model_name=name or self.cfg.served_model_name or
            served_name(self.cfg.model, model), draft_model=draft_model)

    def start(self, catalog: Catalog, draft_model: str = "") -> None:
        """Start the front end and the engines of the models loaded at start (each
        model's replicas), on the resolved folders (and `draft_model`'s)."""
        self.catalog = catalog
        self._draft_model = draft_model
        first = catalog.entries[0]
        flags = self._flags(first.path, draft_model, first.name)
        for entry in catalog.entries:
            if entry.name in catalog.at_start:
                self._start_model(entry)
        catalog_file = os.path.join(self.ipc_dir, "models.json")
        catalog.dump(catalog_file)
        self.to_front = self.ctx.socket(zmq.PUSH)
        self.to_front.setsockopt(zmq.LINGER, 0)
        self.to_front.connect(self._ipc("front_control"))
        tokenizer = TokenizerConfig(
            client_addr=f"tcp://{flags.host}:{flags.port}", engines_addr=self._ipc("engines"),
            ready_addr=self._ipc("launcher"), control_addr=self._ipc("front_control"),
            flags=flags, parent_pid=os.getpid(),
            expected_engines=sum(e.replicas for e in catalog.entries
                                 if e.name in catalog.at_start),
            catalog=catalog_file)
        self.tokenizer = Child(TOKENIZER, "mlxd.tokenizer_proc", tokenizer, self._env())

    def _start_model(self, entry: ModelEntry, on_demand: bool = False) -> None:
        """`entry`'s replicas, each an engine with its share of the model's memory."""
        assert self.catalog is not None
        flags = self._flags(entry.path, self._draft_model, entry.name)
        if entry.memory_gb:
            worker_flags = dataclasses.replace(flags, mem_limit_gb=entry.memory_gb /
                                               entry.replicas)
        else:   # an equal share of the limit for every model and replica
            worker_flags = memory_share(flags, len(self.catalog.entries) * entry.replicas)
        engines = sum(e.replicas for e in self.catalog.entries)
        for replica in range(entry.replicas):
            index = self._engine_count
            self._engine_count += 1
            self.engines.append(self._engine(
                index, flags, engine_disk(worker_flags, engines, entry.name, replica),
                self._ipc("engines"), f"engine{index}", entry.name, on_demand))

    def start_engine(self, model: str, draft_model: str = "") -> None:
        """`mlxd engine`: one engine joining the front end at `--join`."""
        flags = self._flags(model, draft_model)
        name = flags.engine_name or f"{socket.gethostname()}-{os.getpid()}"
        self.engines = [self._engine(0, flags, flags, flags.join, name,
                                     flags.served_model_name)]

    def _engine(self, index: int, flags: ServerFlags, worker_flags: ServerFlags,
                frontend_addr: str, name: str, model: str,
                on_demand: bool = False) -> EngineProcs:
        """Engine `index`'s processes (serving `model`), started."""
        suffix = _suffix(index)
        worker = WorkerConfig(input_addr=self._ipc(f"worker_in{suffix}"),
                              output_addr=self._ipc(f"worker_out{suffix}"),
                              ready_addr=self._ipc("launcher"), name=WORKER + suffix,
                              flags=worker_flags, parent_pid=os.getpid())
        scheduler = SchedulerConfig(
            frontend_addr=frontend_addr, worker_input_addr=worker.input_addr,
            worker_output_addr=worker.output_addr, ready_addr=self._ipc("launcher"),
            engine=name, name=SCHEDULER + suffix, model_name=model, flags=flags,
            worker_ranks=self.cfg.group_ranks, rank_addrs=",".join(
                rank_step_addr(self.hostfile.hosts, r, self.cfg.rank_port)
                for r in range(1, self.cfg.group_ranks) if self.hostfile),
            parent_pid=os.getpid())
        env = self._worker_env()
        return EngineProcs(lambda: self._ranks(worker, env, f"ring{suffix}.json"),
                           (scheduler, self._env()), self.cfg.worker_restarts, model,
                           on_demand)

    def _ranks(self, worker: WorkerConfig, env: dict,
               ring_file: str) -> list[tuple[WorkerConfig, dict]]:
        """Each rank's config and environment: one process without `--tp`/`--pp`;
        with one, N ranks on a ring of fresh ports on 127.0.0.1, each with its share
        of the worker's memory; with `--hostfile`, rank 0 (the others run on their
        machines under `mlxd rank`) in the hostfile's group."""
        n = self.cfg.group_ranks
        if n == 1:
            return [(worker, env)]
        if self.hostfile:
            return [(dataclasses.replace(worker, rank=0, ranks=n,
                                         backend=self.hostfile.backend),
                     {**env, **self.hostfile.environ(0, self.ipc_dir, self.cfg.ring_port)})]
        ring = write_ring_hostfile(os.path.join(self.ipc_dir, ring_file), free_ports(n))
        flags = memory_share(worker.flags, n)
        return [(dataclasses.replace(worker, input_addr=rank_input_addr(worker.input_addr, r),
                                     name=rank_name(worker.name, r), rank=r, ranks=n,
                                     flags=flags),
                 {**env, **ring_environ(r, ring)}) for r in range(n)]

    def _env(self) -> dict:
        # no PYTHONPATH: a child runs `python -m mlxd.<part>` from ROOT, where `mlxd`
        # is the installed package or, in a checkout, the folder beside launch.py
        return dict(os.environ)

    def _worker_env(self) -> dict:
        env = self._env()
        blas = find_blas(self.cfg.blas)
        if blas:
            env["LD_PRELOAD"] = os.pathsep.join(filter(None, [blas, env.get("LD_PRELOAD")]))
            log.info("worker BLAS: %s (preloaded)", blas)
        elif sys.platform.startswith("linux") and not mlx_gpu_backend():
            log.warning("no optimized BLAS found; the worker runs on mlx's slow reference "
                        "BLAS. Install one: apt-get install libopenblas0-pthread")
        return env

    def wait_ready(self) -> Ready:
        """Block until every child is READY; the tokenizer's Ready (its addresses),
        or an empty one without a tokenizer (`mlxd engine`)."""
        pending = {child.name for child in self.children}
        found = Ready(TOKENIZER)
        deadline = time.monotonic() + self.cfg.ready_timeout
        while pending:
            self._check_children()
            if time.monotonic() > deadline:
                raise ChildFailure(f"not ready after {self.cfg.ready_timeout:.0f} s: "
                                   f"{sorted(pending)}")
            msg = self._receive_ready(200)
            if msg is not None:
                pending.discard(msg.process)
                if msg.process == TOKENIZER:
                    found = msg
        return found

    def watch(self) -> None:
        while True:
            self._kill_unresponsive()
            self._check_children()
            self._receive_ready(200)   # a restarted worker's or engine's

    def _receive_ready(self, timeout_ms: int) -> Ready | None:
        """The next READY within `timeout_ms`, noting whose; None if none came."""
        if not self.ready_sock.poll(timeout_ms):
            return None
        try:
            msg = self._ready_decoder.decode(self.ready_sock.recv())
        except ProtocolError as exc:
            log.error("bad READY frame: %s", exc)
            return None
        if isinstance(msg, ModelControl):
            self._on_model_control(msg)
            return None
        if isinstance(msg, EngineUnresponsive):
            self._on_unresponsive(msg.engine, msg.pid)
            return None
        for engine in self.engines:
            if msg.process == engine.worker.name:   # rank 0: the whole group formed
                engine.worker_ready = True
            if msg.process == engine.scheduler.name:
                engine.ready = True
        return msg

    def _on_model_control(self, msg: ModelControl) -> None:
        """The front end loads or unloads a model: its engines start or stop."""
        entry = self.catalog.entry(msg.model) if self.catalog is not None else None
        if entry is None:
            log.error("the front end asked to %s an unknown model %r", msg.action, msg.model)
            return
        running = [e for e in self.engines if e.model == entry.name]
        if msg.action == "unload":
            self.engines = [e for e in self.engines if e.model != entry.name]
            for engine in running:
                engine.stop()
            log.info("model %s: stopped %d engines", entry.name, len(running))
        elif not running:
            why = load_refusal(entry.path)
            if why:   # its folder went away since the start
                log.error("model %s cannot be loaded: %s", entry.name, why)
                self._report_failure(entry.name, why)
                return
            log.info("model %s: loading (%d engines, %s)", entry.name, entry.replicas,
                     entry.path)
            self._start_model(entry, on_demand=True)

    def _report_failure(self, model: str, reason: str) -> None:
        """Tell the front end that `model`'s load failed: its waiting requests end
        with `reason` at once (instead of waiting out --model-load-timeout)."""
        if self.to_front is None:
            return
        try:
            self.to_front.send(encode(ModelLoadFailed(model, reason[:MAX_REASON_CHARS])),
                               zmq.NOBLOCK)
        except zmq.Again:   # the front end is gone or stuck: its wait times out instead
            log.warning("could not tell the front end that model %s failed to load", model)

    def _on_unresponsive(self, name: str, pid: int) -> None:
        """The front end lost an engine whose scheduler was `pid`: if that process
        still lives after a grace (one that is exiting is gone by then), it is
        stopped or hung, and is killed, to be restarted as a dead one is. A report
        naming an earlier scheduler of the engine (restarted since) is no news."""
        for engine in self.engines:
            if engine.name == name and engine.scheduler.proc.pid == pid:
                engine.suspect_since = time.monotonic()

    def _kill_unresponsive(self) -> None:
        now = time.monotonic()
        for engine in self.engines:
            since = engine.suspect_since
            if since is None or now - since < UNRESPONSIVE_GRACE_SECONDS:
                continue
            engine.suspect_since = None
            if engine.scheduler.alive():
                log.error("engine %s is unresponsive (the front end lost its link; its "
                          "scheduler still runs): its scheduler is killed", engine.name)
                engine.scheduler.proc.kill()

    def _check_children(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            time.sleep(0.2)   # let the stderr pump catch the last lines
            while self._receive_ready(0):   # a READY it sent just before it died
                pass
            tail = "\n".join(f"  {line}" for line in child.tail)
            engine, refusal = self._restart_refusal(child, code)
            if refusal is not None and self._drop_failed_load(child):
                return
            if refusal is not None:
                raise ChildFailure(f"{child.name} process exited with code {code}{refusal}; "
                                   f"its last stderr lines:\n{tail}")
            log.error("%s process exited with code %s; starting a new one. Its last "
                      "stderr lines:\n%s", child.name, code, tail)
            if child in engine.workers:
                engine.spawn_worker()
            else:
                self._restart_engine(engine)
            return

    def _drop_failed_load(self, child: Child) -> bool:
        """A model loaded while serving whose engine died before it was ready: the
        engine is dropped, the server serves on, and once none of the model's engines
        is left the front end is told why."""
        engine = next((e for e in self.engines if child in e.children), None)
        if engine is None or not engine.on_demand or engine.ready:
            return False
        why = exit_reason(child)
        log.error("model %s failed to load: %s", engine.model, why)
        self.engines.remove(engine)
        engine.stop()
        if not any(e.model == engine.model for e in self.engines):   # no replica left
            self._report_failure(engine.model, why)
        return True

    def _restart_refusal(self, child: Child, code: int) -> tuple[EngineProcs | None, str | None]:
        """The engine of a dead `child` to restart (its worker, or, for a dead
        scheduler, all of it) and None; or why the server stops (appended to its exit
        code)."""
        engine = next((e for e in self.engines if child in e.children), None)
        if engine is None or not self.cfg.restart_worker:
            return None, ""
        if code == 0:
            return None, " (it was told to stop)"
        if not (engine.worker_ready if child in engine.workers else engine.ready):
            return None, (" before it was ready; a process that fails to start is not "
                          "restarted")
        if not engine.restarts.take(time.monotonic()):
            return None, (f"; the {child.name} was restarted {self.cfg.worker_restarts} "
                          f"times in the last {WORKER_RESTART_WINDOW_SECONDS:g} s already "
                          "(--worker-restarts)")
        return engine, None

    def _restart_engine(self, engine: EngineProcs) -> None:
        """A dead scheduler takes its worker along: both start again, and the new
        scheduler joins the front end as a new engine of the same name."""
        for worker in engine.workers:
            if worker.alive():
                worker.proc.kill()
                worker.proc.wait()
        engine.spawn_worker()
        engine.spawn_scheduler()

    def stop(self) -> None:
        # top down: the front end (its clients see the server go, not each engine
        # lost), then every engine's tiers side by side
        engines = [[c for tier in level for c in tier]
                   for level in zip(*(e.tiers for e in self.engines))]
        stop_in_order([[self.tokenizer] if self.tokenizer else [], *engines])
        self.ready_sock.close(linger=0)
        if self.to_front is not None:
            self.to_front.close(linger=0)
        self.ctx.term()
        if self.published_port is not None:
            keys.unpublish(self.published_port, os.getpid())
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def warn_if_exposed(cfg: ServerFlags) -> None:
    """A server reachable from other machines without an API key: say so, loudly."""
    exposed = [h for h in dict.fromkeys([cfg.host, cfg.http_host or cfg.host])
               if not keys.is_loopback_host(h)]
    if not exposed or cfg.api_key:
        return
    log.warning("\n%s\nWARNING: mlxd listens on %s, reachable from other machines, with "
                "no --api-key: anyone who can reach it (over HTTP) or obtains the server's "
                "public key (ZeroMQ) can use it. Set --api-key (or MLXD_API_KEY).\n%s",
                "!" * 78, " and ".join(exposed), "!" * 78)


def read_ready_addresses(stdout, timeout: float) -> dict[str, str]:
    """The launcher's address lines up to its ready line, by prefix (READY_PREFIX,
    HTTP_PREFIX); without READY_PREFIX if it did not come within `timeout` seconds."""
    found: dict[str, str] = {}

    def read():
        for line in stdout:
            for prefix in (HTTP_PREFIX, ENGINE_PREFIX, READY_PREFIX):
                if line.startswith(prefix):
                    found[prefix] = line[len(prefix):].strip()
            if READY_PREFIX in found:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return dict(found)


def speculation_method(cfg: ServerFlags) -> str:
    """--speculative as served: a draft model implies `draft` unless speculation is
    off; `draft` without one, or a draft model beside it off, exits saying so."""
    if cfg.speculative == "draft" and not cfg.draft_model:
        sys.exit("mlxd: --speculative draft needs --draft-model")
    if cfg.draft_model and cfg.speculative == "off":
        sys.exit("mlxd: --draft-model is given but --speculative is off")
    return "draft" if cfg.draft_model else cfg.speculative


def with_hostfile(cfg: ServerFlags) -> ServerFlags:
    """`--hostfile` places one rank per host: `--pp` (when given) or `--tp` is their
    number (or exits saying why the two disagree, or why the hostfile cannot be used)."""
    if not cfg.hostfile:
        return cfg
    try:
        hosts = read_hostfile(cfg.hostfile).hosts
    except HostfileError as exc:
        sys.exit(f"mlxd: {exc}")
    split = "pp" if cfg.pp > 1 else "tp"
    if cfg.group_ranks not in (1, len(hosts)):
        sys.exit(f"mlxd: --{split} {cfg.group_ranks} but --hostfile {cfg.hostfile} lists "
                 f"{len(hosts)} hosts (one rank each)")
    if cfg.dp > 1:
        sys.exit("mlxd: --hostfile places one worker group; it cannot be combined with --dp")
    return dataclasses.replace(cfg, **{split: len(hosts)},
                               hostfile=os.path.abspath(cfg.hostfile))


def split_flags(cfg: ServerFlags) -> str:
    """How the worker group was asked for, as the user wrote it."""
    return " ".join(f"--{name} {n}" for name, n in (("tp", cfg.tp), ("pp", cfg.pp))
                    if n > 1) or "--tp 1"


def given_models(argv: list[str]) -> list[str]:
    """Every `--model` value on the command line, in order (it may be repeated)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", action="append", default=[])
    return parser.parse_known_args(argv)[0].model


def served_catalog(cfg: ServerFlags, models: list[str]) -> Catalog:
    """The models to serve (`--models FILE`, else every `--model`), resolved to
    folders and named; or the launcher exits saying why not."""
    try:
        if cfg.models and len(models) > 0:
            raise CatalogError("give either --models FILE or --model, not both")
        if len(models) > 1 and cfg.served_model_name:
            raise CatalogError("--served-model-name names one model; with several, "
                               "name them in a --models file")
        if (cfg.models or len(models) > 1) and cfg.hostfile:
            raise CatalogError("--hostfile places one worker group: it serves one model")
        if (cfg.models or len(models) > 1) and cfg.draft_model:
            raise CatalogError("--draft-model serves one model; it cannot be combined "
                               "with several models")
        given = read_models_file(cfg.models, cfg.dp) if cfg.models else \
            [ModelEntry("", m, replicas=cfg.dp) for m in models or [cfg.model]]
        entries = []
        for entry in given:
            path = model_folder(entry.model)
            name = entry.name or (cfg.served_model_name if len(given) == 1 else "") or \
                served_name(entry.model, path)
            entries.append(dataclasses.replace(entry, name=name, path=path))
        for entry in entries:
            why = split_refusal(entry.path, cfg.tp, cfg.pp)
            if why:
                raise CatalogError(f"{split_flags(cfg)}: the model {entry.name!r} cannot "
                                   f"be split: {why}")
        return build_catalog(entries, cfg.models_memory, cfg.mem_limit_gb, cfg.mem_fraction)
    except CatalogError as exc:
        sys.exit(f"mlxd: {exc}")


def exit_reason(child: Child) -> str:
    """How `child` ended, in a line: its exit code (or signal) and its last stderr
    line (a traceback's last line names the error)."""
    code = child.proc.returncode
    how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
    last = next((line.strip() for line in reversed(child.tail) if line.strip()), "")
    return f"its {child.name} process {how}" + (f": {last}" if last else "")


def load_refusal(path: str) -> str | None:
    """Why the resolved folder `path` cannot be loaded now (resolve.py's words: gone,
    or no longer a model folder), or None. Made absolute: never taken for a hub id,
    so nothing is downloaded here."""
    try:
        resolve_model(os.path.abspath(path))
    except ModelError as exc:
        return str(exc)
    return None


def model_folder(model: str) -> str:
    """`--model` as a folder to serve, or the launcher exits saying why not."""
    try:
        return resolve_model(model, log=log.info)
    except ModelError as exc:
        sys.exit(f"mlxd: {exc}")


class ChildFailure(RuntimeError):
    pass


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame):
    raise _Stop(signal.Signals(signum).name)


def engine_disk(flags: ServerFlags, engines: int, model: str, replica: int) -> ServerFlags:
    """With --kv-disk and several engines: a directory of its own for each (one server
    per directory), named by its model and replica, so a restart or a reload finds
    its entries again."""
    if not flags.kv_disk or engines == 1:
        return flags
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return dataclasses.replace(flags, kv_disk=os.path.join(flags.kv_disk, f"{name}-{replica}"))


def models_command(argv: list[str]) -> int:
    """`mlxd models`: the models already here; `mlxd pull ID`: fetch one, print its path."""
    import argparse

    parser = argparse.ArgumentParser(prog="mlxd")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("models", help="list the models in the Hugging Face cache, "
                                       "Ollama's store and mlxd's cache")
    pull = commands.add_parser("pull", help="fetch a model into the Hugging Face cache "
                                            "(as --model would) and print its local path")
    pull.add_argument("id", help="ORG/NAME[@REVISION][:QUANT] (or any --model value)")
    args = parser.parse_args(argv)
    if args.command == "models":
        table = [("NAME", "FORMAT", "SIZE"),
                 *[(name, kind, _size(size)) for name, kind, size in local_models()]]
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        for row in table:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        return 0
    try:
        print(fetch_model(args.id, log=lambda message: print(message, file=sys.stderr)))
    except ModelError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return 1
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["models"], ["pull"]):
        return models_command(argv)
    if argv[:1] == ["rank"]:
        from mlxd.rank import rank_main

        return rank_main(argv[1:])
    if argv[:1] == ["cache"]:
        from mlxd.cache_cli import cache_main

        return cache_main(argv[1:])
    engine = argv[:1] == ["engine"]
    cfg = parse_config(ServerFlags, "Start the mlxd server (also: `mlxd models`, "
                                    "`mlxd pull ID`, `mlxd cache ls|clear DIR`, `mlxd engine --join "
                                    "tcp://HOST:PORT "
                                    "...`: an engine for a front end on another machine).",
                       argv[engine:])
    if engine and not cfg.join.startswith("tcp://"):
        sys.exit("mlxd engine: --join tcp://HOST:PORT (the front end's --engine-port) "
                 "is required")
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO),
                        format="%(asctime)s launch %(levelname)s: %(message)s")
    cfg = dataclasses.replace(cfg, speculative=speculation_method(cfg))
    cfg = with_hostfile(cfg)
    models = given_models(argv[engine:])
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    die_with_parent(int(os.environ.get("MLXD_PARENT_PID", "0")) or None)
    try:
        launcher = Launcher(cfg)
    except ChildFailure as exc:
        log.error("%s", exc)
        return 1
    try:
        if cfg.group_ranks > 1 and cfg.draft_model:
            raise ChildFailure(f"--draft-model is not served by a {split_flags(cfg)} group "
                               "yet")
        draft = model_folder(cfg.draft_model) if cfg.draft_model else ""
        if engine:
            folder = model_folder(cfg.model)
            why = split_refusal(folder, cfg.tp, cfg.pp)
            if why:
                raise ChildFailure(f"{split_flags(cfg)}: the model cannot be split: {why}")
            launcher.start_engine(folder, draft)
        else:
            launcher.start(served_catalog(cfg, models), draft)
        ready = launcher.wait_ready()
        if engine:   # its address lines: the front end it joined
            print(f"{ENGINE_PREFIX}{cfg.join}\n{READY_PREFIX}{cfg.join}", flush=True)
        else:
            launcher.publish_key(ready.address)
            print(f"{HTTP_PREFIX}{ready.http_address}", flush=True)
            if ready.engine_address:
                print(f"{ENGINE_PREFIX}{ready.engine_address}", flush=True)
            print(f"{READY_PREFIX}{ready.address}", flush=True)
        launcher.watch()
    except ChildFailure as exc:
        log.error("%s", exc)
        return 1
    except _Stop as why:
        log.info("stopping (%s)", why)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
