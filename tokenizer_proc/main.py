"""The tokenizer process: an asyncio (uvloop) loop between clients and the scheduler,
around the socket-free TokenizerCore (core.py).

  client_addr            ROUTER  GenerateRequest / AbortRequest / StatsRequest in;
                                 StreamChunk / ErrorReply / StatsReply out
  engines_addr           ROUTER  each engine's scheduler: SchedulerReady (joining), then
                                 TokenBatch / Stats in; TokenizedRequest / Abort /
                                 GetStats out (engine_links.py)
  tcp://host:engine_port ROUTER  the same, for engines on other machines (CURVE)
  ready_addr             PUSH    Ready to the launcher (optional)
  control_addr           PULL    the launcher's reports: ModelLoadFailed (optional)

The client socket is bound once `expected_engines` engines have joined and their
limits are known: its frames are capped at `max_frame_bytes` (ZMQ_MAXMSGSIZE: ZeroMQ
drops the connection of a peer that sends a bigger one, before buffering it). Which
engine each message goes to is the EngineSet's to say (engines.py).

Several models (`catalog`, written by the launcher): each has its own core and engine
set (models.py); a request's `model` picks them, and one for a model not loaded waits
for its load (model_loader.py), which the launcher is asked for over `ready_addr`.
"""

import asyncio
import logging
import signal
from pathlib import Path
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mlxd.protocol import (
    AbortRequest, Decoder, EngineUnresponsive, ErrorReply, GenerateRequest, GetStats,
    ModelControl, ModelLoadFailed, ProtocolError, Ready, SchedulerReady, Stats,
    StatsRequest, TokenBatch, TokenizedRequest, encode,
)
from mlxd.runtime.aio import LoopSocket, TaskSet
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import TOKENIZER, ServerFlags
from mlxd.runtime.keys import BadKey, randomize_routing_ids, read_secret_key, serve_with_curve
from mlxd.runtime.lifecycle import die_with_parent, setup_logging
from mlxd.runtime.model_catalog import Catalog, ModelEntry
from mlxd.runtime.sockets import decode_from, monitor_pair

from .auth import key_matches
from .connections import Connections
from .core import Pending, Reply, Sink, ToScheduler, TokenizerCore, protocol_error_reply
from .engine_links import EngineLink, RemoteEngines
from .engines import Ended, EngineSet
from .model_loader import LoadFailed, ModelLoader, ModelUnavailable
from .models import LOADED, UNLOADING, ModelTable, Served, first_id, not_served
from .router import RoutePolicy, Router
from .http import HttpFrontEnd
from .text import TextCodec
from .tools.syntax import resolve
from .throttled_log import ThrottledLog
from .validation import ModelLimits, max_prompt_chars

log = logging.getLogger("mlxd.tokenizer")

MIN_FRAME_BYTES = 4 << 20      # a client frame may always be this big
PARAMS_BYTES = 1 << 20         # room for parameters and message structure
UNBOUNDED_CHARS_PER_TOKEN = 64  # where the vocabulary gives no bound (text.py)
CLIENT_FRAMES_QUEUED = 64      # frames taken off the client socket ahead (fairness)
FRAMES_PER_TURN = 64           # client frames handled before the other loop gets a turn
ENCODE_THREADS = 2
DEADLINE_CHECK_SECONDS = 0.1
BACKLOG_RETRY_SECONDS = 0.02   # how often a slow client's backlog is offered again
UNLOADED_FRAME_BYTES = 64 << 20   # the cap while a model's context is not known yet


def max_frame_bytes(limits: ModelLimits, chars_per_token: int | None) -> int:
    """The biggest client frame accepted: the longest prompt that can fit, at 4 bytes a
    character (UTF-8), plus parameters; at least MIN_FRAME_BYTES."""
    chars = max_prompt_chars(limits, chars_per_token or UNBOUNDED_CHARS_PER_TOKEN) or 0
    return max(MIN_FRAME_BYTES, 4 * chars + PARAMS_BYTES)


@dataclass(frozen=True)
class TokenizerConfig:
    PROCESS: ClassVar[str] = TOKENIZER
    client_addr: str
    engines_addr: str
    ready_addr: str = ""
    control_addr: str = ""   # where the launcher reports failed loads (we bind it)
    expected_engines: int = 1   # engines to wait for before serving (the --dp replicas)
    catalog: str = ""   # the served models (runtime/model_catalog.py); "": --model alone
    flags: ServerFlags = field(default_factory=ServerFlags)   # those used_by the tokenizer
    parent_pid: int = 0


class TokenizerServer:
    """The sockets around a TokenizerCore: decodes frames, hands them to the core and
    sends what it returns. Replies to ZeroMQ clients are queued by their sinks and
    sent after each call into the core."""

    def __init__(self, cfg: TokenizerConfig, catalog: Catalog, ctx: zmq.asyncio.Context):
        self.cfg = cfg
        # a token batch in and a chunk per stream out every decode step: the cheaper
        # path per message (runtime/aio.py)
        randomize_routing_ids()
        self.clients = LoopSocket(zmq.Socket(ctx, zmq.ROUTER), multipart=True,
                                  max_queued=CLIENT_FRAMES_QUEUED, copy=False)
        self._secure_client_socket(cfg.flags)
        # a connection's end forgets its clients (connections.py)
        self.client_events = LoopSocket(monitor_pair(ctx, self.clients.sock,
                                                 zmq.EVENT_DISCONNECTED), multipart=True)
        self.connections = Connections()
        # A client that does not read: its queue fills, ZeroMQ says so (instead of
        # dropping replies) and its requests end with an error; the replies it has not
        # taken wait in a backlog of its own, flushed as it reads (never dropped).
        self.clients.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.clients.sock.setsockopt(zmq.SNDHWM, cfg.flags.client_queue_limit)
        self._backlogs: dict[bytes, deque[Reply]] = {}
        self._flusher: asyncio.Task | None = None
        self.to_launcher = ctx.socket(zmq.PUSH) if cfg.ready_addr else None
        self.from_launcher = ctx.socket(zmq.PULL) if cfg.control_addr else None
        for sock in self.sockets:
            getattr(sock, "sock", sock).setsockopt(zmq.LINGER, 0)
        if self.to_launcher:
            self.to_launcher.connect(cfg.ready_addr)
        if self.from_launcher:
            self.from_launcher.bind(cfg.control_addr)
        # a local engine whose link is silent past --worker-timeout is stopped or hung
        self.links = [EngineLink(ctx, cfg.engines_addr, silent_s=cfg.flags.worker_timeout)]
        self.remote = self._remote_engines(cfg.flags)
        if self.remote is not None:
            self.links.append(self.remote.link)
        self._link_of: dict[str, EngineLink] = {}   # each joined engine's
        self._model_of: dict[str, Served] = {}      # each joined engine's
        self._serving = asyncio.Event()   # enough engines joined: clients are served
        self.client_decoder = Decoder(GenerateRequest, AbortRequest, StatsRequest)
        self.engine_decoder = Decoder(TokenBatch, SchedulerReady, Stats)
        self.models = ModelTable.of(catalog, self._model_parts)
        flags = cfg.flags
        self.loader = ModelLoader(self.models, self, flags.model_load_timeout,
                                  flags.unload_grace_seconds, flags.unload_idle_seconds,
                                  flags.ready_timeout)
        self.loader.started(catalog.at_start)
        self._parked: set[tuple[bytes, str]] = set()   # ZeroMQ requests waiting for a load
        self._tasks = TaskSet()   # ZeroMQ requests waiting for a load, long prompts encoding
        self._replies: deque[tuple[bytes, Reply]] = deque()   # (client identity, reply)
        self._encoder = ThreadPoolExecutor(ENCODE_THREADS, "encode")
        self._log_bad_frame = ThrottledLog(log, logging.ERROR)
        self.http_address: str | None = None   # the HTTP front end's, once bound

    def _model_parts(self, index: int, entry: ModelEntry) -> tuple[TokenizerCore, EngineSet]:
        """A served model's core (its tokenizer, ids from `first_id(index)`) and
        engine set."""
        flags = self.cfg.flags
        codec = TextCodec(entry.path)
        syntax = resolve(codec.chat_template_text, flags.tool_call_parser,
                         flags.reasoning_parser, codec.tokenizer.get_vocab)
        core = TokenizerCore(codec, flags.default_max_tokens,
                             request_timeout=flags.request_timeout, syntax=syntax,
                             offload=self._offload, first_id=first_id(index))
        router = Router(RoutePolicy(flags.route_balance_abs, flags.route_balance_rel,
                                    flags.route_min_match, flags.route_policy))
        # a request whose engines are all gone waits for one to (re)join this long
        return core, EngineSet(router, flags.worker_timeout + flags.model_load_timeout)

    def _secure_client_socket(self, flags: ServerFlags) -> None:
        """CURVE with the key in `--curve-secret-key` (the launcher always gives one);
        without it (the process started by hand) the socket is plain."""
        if not flags.curve_secret_key:
            log.warning("no --curve-secret-key: the client socket is neither encrypted "
                        "nor authenticated")
            return
        serve_with_curve(self.clients.sock, read_secret_key(flags.curve_secret_key))

    def _remote_engines(self, flags: ServerFlags) -> RemoteEngines | None:
        """The TCP socket engines on other machines join (`--engine-port`), under
        the client socket's key pair."""
        if flags.engine_port < 0:
            return None
        if not flags.curve_secret_key:
            raise ValueError("--engine-port needs --curve-secret-key: engines "
                             "authenticate with the front end's key pair")
        return RemoteEngines(f"tcp://{flags.host}:{flags.engine_port}",
                             read_secret_key(flags.curve_secret_key))

    @property
    def sockets(self):
        return [s for s in (self.client_events, self.clients, self.to_launcher,
                            self.from_launcher) if s is not None]

    def close(self) -> None:
        self.links[0].close()   # the local one; the remote one with its context:
        if self.remote is not None:
            self.remote.close()

    @property
    def address(self) -> str:
        return self.clients.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def engines_up(self) -> int:
        return len(self._model_of)

    @property
    def engine_address(self) -> str | None:
        """Where engines on other machines join (None: they cannot)."""
        return self.remote.link.address if self.remote is not None else None

    async def run(self) -> None:
        loops = [loop for link in self.links
                 for loop in (self._engine_loop(link), self._engine_event_loop(link))]
        if self.from_launcher is not None:
            loops.append(self._launcher_loop())
        await asyncio.gather(self._serve_clients(), *loops)

    async def _serve_clients(self) -> None:
        await self._serving.wait()
        self._bind_client_socket()
        await asyncio.gather(self._client_loop(), self._connection_loop(),
                             self._deadline_loop(), self.loader.watch())

    def _bind_client_socket(self) -> None:
        caps = [max_frame_bytes(s.core.limits, s.core.codec.max_chars_per_token)
                if s.core.limits is not None else UNLOADED_FRAME_BYTES
                for s in self.models.models]
        max_bytes = max(caps)
        self.clients.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self.clients.sock.bind(self.cfg.client_addr)
        log.info("client frames are capped at %d bytes", max_bytes)
        if self.to_launcher:
            self.to_launcher.send(encode(Ready("tokenizer", self.address,
                                               self.http_address, self.engine_address)))
        log.info("ready: serving clients on %s", self.address)

    async def _client_loop(self) -> None:
        handled = 0
        while True:
            frames = await self.clients.recv()
            await self.send(self._on_client_message(frames))
            handled += 1
            if handled % FRAMES_PER_TURN == 0:   # a flood must not starve the scheduler's
                await asyncio.sleep(0)

    def _on_client_message(self, parts: list[zmq.Frame]) -> list[ToScheduler]:
        frames = [part.bytes for part in parts]
        # a new identity: first the ends of connections (a reused descriptor's old end)
        aborts = [] if frames[0] in self.connections else self._drain_connection_events()
        self.connections.seen(frames[0], parts[-1].get(zmq.SRCFD))
        return aborts + self._on_client_frames(frames)

    def _on_client_frames(self, frames: list[bytes]) -> list[ToScheduler]:
        if len(frames) != 2:
            self._log_bad_frame("refused a client message of %d frames", len(frames))
            self._replies.append((frames[0], ErrorReply(
                None, "bad_request", f"send one frame per message, got {len(frames) - 1}")))
            return []
        client, frame = frames
        try:
            msg = self.client_decoder.decode(frame)
        except ProtocolError as exc:
            self._log_bad_frame("dropped a malformed frame from client %s: %s",
                                client.hex(), exc)
            self._replies.append((client, protocol_error_reply(exc)))
            return []
        if not key_matches(self.cfg.flags.api_key, msg.api_key):
            self._log_bad_frame("refused a message from client %s: wrong API key", client.hex())
            self._replies.append((client, ErrorReply(
                msg.rid, "unauthorized", "missing or wrong API key (the server has --api-key)")))
            return []
        if isinstance(msg, AbortRequest):   # rids are the client's: any model may hold it
            self._parked.discard((client, msg.rid))
            return [a for s in self.models.models for a in s.core.abort(client, msg.rid)]
        served = self.models.find(msg.model)
        if served is None:
            self._replies.append((client, ErrorReply(
                msg.rid, "model_not_found", not_served(msg.model, self.models.names()),
                "model")))
            return []
        if served.state != LOADED and isinstance(msg, GenerateRequest):
            self._parked.add((client, msg.rid))
            self._tasks.spawn(self._handle_when_loaded(served, client, msg))
            return []
        served.last_used = self.loader.clock()
        return served.core.handle(client, msg, self._sink(client))

    async def _handle_when_loaded(self, served: Served, client: bytes, msg) -> None:
        """A ZeroMQ client's message for a model not loaded: handled once it is
        (unless the client aborted it or left meanwhile)."""
        try:
            await self.loader.ready(served)
        except (ModelUnavailable, LoadFailed) as exc:
            if (client, msg.rid) in self._parked:
                self._replies.append((client, ErrorReply(msg.rid, exc.code, str(exc),
                                                         "model")))
            self._parked.discard((client, msg.rid))
            await self.send()
            return
        if (client, msg.rid) not in self._parked:
            return
        self._parked.discard((client, msg.rid))
        await self.send(served.core.handle(client, msg, self._sink(client)))

    def _offload(self, pending: Pending) -> None:
        """The core's long prompts: encoded in a thread, then admitted."""
        self._tasks.spawn(self._encode_and_admit(pending))

    async def _encode_and_admit(self, pending: Pending) -> None:
        core = self.models.owner(pending.rid).core
        await asyncio.get_running_loop().run_in_executor(self._encoder, core.encode, pending)
        await self.send(core.admit(pending))

    async def _deadline_loop(self) -> None:
        """Requests past their deadline end (checked every DEADLINE_CHECK_SECONDS)."""
        while True:
            await asyncio.sleep(DEADLINE_CHECK_SECONDS)
            for served in self.models.models:
                self._end(served, served.engines.expire())
                if served.core.has_deadlines:
                    await self.send(served.core.expire())
            await self.send()

    async def _connection_loop(self) -> None:
        while True:
            await self.send(self._on_connection_event(await self.client_events.recv()))

    def _drain_connection_events(self) -> list[ToScheduler]:
        aborts = []
        while (frames := self.client_events.recv_nowait()) is not None:
            aborts += self._on_connection_event(frames)
        return aborts

    def _on_connection_event(self, frames: list[bytes]) -> list[ToScheduler]:
        """A client connection ended: its clients' requests are aborted."""
        event = parse_monitor_message(frames)
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return []
        aborts = []
        for client in self.connections.closed(event["value"]):
            aborts += [a for s in self.models.models for a in s.core.forget(client)]
            self._parked = {(c, rid) for c, rid in self._parked if c != client}
            self._backlogs.pop(client, None)
        if aborts:
            log.info("a client connection ended: aborted %d requests", len(aborts))
        return aborts

    # ---- engines ---------------------------------------------------------------

    async def _engine_loop(self, link: EngineLink) -> None:
        while True:
            received = await link.recv()
            if received is None:
                continue
            name, frame = received
            msg = decode_from(self.engine_decoder, frame, f"engine {name}", log)
            if isinstance(msg, SchedulerReady):
                self._on_join(name, link, msg)
                await self.send()
                continue
            served = self._model_of.get(name)
            if served is None:   # not (or no longer) joined
                continue
            if isinstance(msg, TokenBatch):
                await self.send(served.core.on_batch(served.engines.on_batch(name, msg)))
            elif isinstance(msg, Stats):
                self._route_back(served, served.engines.on_stats(name, msg))
                await self.send()

    def _on_join(self, name: str, link: EngineLink, msg: SchedulerReady) -> None:
        other = self._link_of.get(name)
        if other is not None and other is not link:
            log.error("refused engine %s: an engine of that name is joined already", name)
            return
        if other is not None:   # joining again (restarted) before its old link's end was seen
            self._on_lost(name, report=False)
        served = self.models.find(msg.model or None)
        why = self._join_refusal(served, msg) or served.engines.join(name, msg)
        if why:
            log.error("refused engine %s: %s", name, why)
            return
        self._link_of[name], self._model_of[name] = link, served
        served.core.limits = served.engines.first.limits
        log.info("engine %s of model %s joined (%d up): kv_capacity=%d", name, served.name,
                 len(served.engines.up), msg.limits.kv_capacity)
        self._deliver_to_engines(served, served.engines.unpark())
        self.loader.joined(served)
        if self.engines_up >= self.cfg.expected_engines:
            self._serving.set()

    def _join_refusal(self, served: Served | None, msg: SchedulerReady) -> str | None:
        if served is None:
            return (f"it serves the model {msg.model!r}, which this front end does not "
                    f"(it serves {', '.join(map(repr, self.models.names()))})")
        if served.state == UNLOADING:
            return f"its model {served.name!r} is being unloaded"
        return None

    async def _engine_event_loop(self, link: EngineLink) -> None:
        while True:
            for name in link.closed(await link.events.recv()):
                self._on_lost(name)
            await self.send()

    def _on_lost(self, name: str, report: bool = True) -> None:
        """An engine's link ended: its requests run elsewhere or end; the launcher is
        told (`report`), to replace the engine if its scheduler still lives."""
        self._link_of.pop(name, None)
        served = self._model_of.pop(name, None)
        if served is None:
            return
        engine = served.engines.engines.get(name)
        if report and engine is not None and self.to_launcher is not None:
            self.to_launcher.send(encode(EngineUnresponsive(name, engine.ready.pid)))
        out, ended = served.engines.lost(name)
        log.error("engine %s of model %s was lost (%d up): %d requests go on elsewhere "
                  "(%d parked until an engine joins), %d end", name, served.name,
                  len(served.engines.up),
                  sum(1 for _, m in out if isinstance(m, TokenizedRequest)),
                  served.engines.parked, len(ended))
        self._deliver_to_engines(served, out)
        self._end(served, ended)

    @staticmethod
    def _end(served: Served, ended: list[Ended]) -> None:
        """The requests the engine set ends itself: their last chunks."""
        for end in ended:
            served.core.end_requests([end.rid], end.message, end.reason)

    def _deliver_to_engines(self, served: Served, out) -> None:
        """Send each (engine, message) of `served`'s; an engine that cannot be reached
        is lost."""
        for name, msg in out:
            if name == "":
                self._route_back(served, [(name, msg)])
                continue
            link = self._link_of.get(name)
            if link is None or not link.send(name, encode(msg)):
                self._on_lost(name)

    def _route_back(self, served: Served, out) -> None:
        """The EngineSet's answers for its core (merged stats)."""
        for _, msg in out:
            served.core.on_stats(msg)

    # ---- models (model_loader.LoaderHost, http.context.Directory) -------------------

    async def _launcher_loop(self) -> None:
        """The launcher's reports: a model's load failed (its waiting requests end)."""
        assert self.from_launcher is not None
        decoder = Decoder(ModelLoadFailed)
        while True:
            msg = decode_from(decoder, await self.from_launcher.recv(), "launcher", log)
            served = self.models.find(msg.model) if msg is not None else None
            if served is not None:
                self.loader.failed(served, msg.reason)

    def control(self, action: str, model: str) -> bool:
        if self.to_launcher is None:
            return False
        self.to_launcher.send(encode(ModelControl(action, model)))
        return True

    def stop_serving(self, served: Served, message: str) -> None:
        out, rids = served.engines.retire_all()
        self._deliver_to_engines(served, out)
        for name in [n for n, s in self._model_of.items() if s is served]:
            self._link_of.pop(name, None)
            self._model_of.pop(name, None)
        served.core.end_requests(rids, message)

    def find(self, name: str | None) -> Served | None:
        return self.models.find(name)

    def names(self) -> list[str]:
        return self.models.names()

    def listing(self) -> list[Served]:
        return self.models.models

    async def ready(self, served: Served) -> None:
        await self.loader.ready(served)

    def front(self, served: Served) -> "ModelFront":
        return ModelFront(self, served)

    async def unload(self, served: Served) -> None:
        await self.loader.unload(served, "admin")

    def status(self) -> str:
        if not self._serving.is_set():
            return "starting"
        lost = any(s.state == LOADED and not s.engines.engines for s in self.models.models)
        return "no engine" if lost else "ok"

    def _sink(self, client: bytes) -> Sink:
        return lambda reply: self._replies.append((client, reply))

    async def send(self, to_scheduler: list[ToScheduler] = ()) -> None:
        """The core's messages for the scheduler, then every queued client reply; for
        any front end sharing the core on this loop."""
        to_scheduler = list(to_scheduler)
        while to_scheduler or self._replies:
            for served, messages in self._by_model(to_scheduler):
                out, ended = served.engines.dispatch(messages)
                self._deliver_to_engines(served, out)
                self._end(served, ended)
            to_scheduler = []
            while self._replies:
                client, reply = self._replies.popleft()
                to_scheduler += self._deliver(client, reply)

    def _by_model(self, messages: list[ToScheduler]) -> list[tuple[Served, list]]:
        """The core's messages by the model whose core made them (its ids say)."""
        groups: dict[int, tuple[Served, list]] = {}
        for msg in messages:
            served = self.models.owner(msg.query_id if isinstance(msg, GetStats) else msg.rid)
            groups.setdefault(id(served), (served, []))[1].append(msg)
        return list(groups.values())

    def _deliver(self, client: bytes, reply: Reply) -> list[ToScheduler]:
        """Send a reply, or queue it behind the client's backlog; a client whose queue
        is full falls behind: its requests end (the aborts are returned)."""
        backlog = self._backlogs.get(client)
        if backlog is not None:
            backlog.append(reply)
            return []
        if self._try_send(client, reply):
            return []
        self._backlogs[client] = deque([reply])
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_backlogs())
        log.warning("client %s fell behind reading its replies; its requests are ended",
                    client.hex())
        message = (f"the client fell behind reading its replies "
                   f"({self.cfg.flags.client_queue_limit} queued); the request was ended")
        return [a for s in self.models.models for a in s.core.fail_client(client, message)]

    def _try_send(self, client: bytes, reply: Reply) -> bool:
        try:
            return self.clients.try_send_multipart([client, encode(reply)])
        except zmq.ZMQError as exc:   # EHOSTUNREACH: gone; its connection's end forgets it
            log.debug("reply to a gone client %s dropped: %s", client.hex(), exc)
            return True

    async def _flush_backlogs(self) -> None:
        """Hand each waiting client its backlog as it reads, until none is left."""
        while self._backlogs:
            await asyncio.sleep(BACKLOG_RETRY_SECONDS)
            for client, backlog in list(self._backlogs.items()):
                while backlog and self._try_send(client, backlog[0]):
                    backlog.popleft()
                if not backlog:
                    del self._backlogs[client]

    def close_encoder(self) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)


class ModelFront:
    """One served model as a front end sees it (http.calls.Front): its core, its
    engines, and the server's `send`."""

    def __init__(self, server: TokenizerServer, served: Served):
        self.server, self.served = server, served

    @property
    def core(self) -> TokenizerCore:
        return self.served.core

    @property
    def engines_up(self) -> int:
        return len(self.served.engines.engines)

    async def send(self, to_scheduler: list[ToScheduler] = ()) -> None:
        await self.server.send(to_scheduler)


def catalog_of(cfg: TokenizerConfig) -> Catalog:
    """The launcher's catalog, or `--model` alone (the process started by hand)."""
    if cfg.catalog:
        return Catalog.load(cfg.catalog)
    flags = cfg.flags
    name = flags.served_model_name or Path(flags.model).name
    entry = ModelEntry(name=name, model=flags.model, path=flags.model)
    return Catalog((entry,), at_start=(name,))



async def serve(cfg: TokenizerConfig) -> None:
    # Signals cancel the main task: an exception raised from a plain signal
    # handler would be swallowed by the event loop's callback machinery.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, asyncio.current_task().cancel)
    ctx = zmq.asyncio.Context()
    try:
        server = TokenizerServer(cfg, catalog_of(cfg), ctx)
    except (BadKey, ValueError) as exc:   # a bad key file, an unknown parser name
        ctx.destroy(linger=0)
        raise SystemExit(f"mlxd tokenizer: {exc}") from None
    flags = cfg.flags
    first = server.models.first
    http = HttpFrontEnd(server.front(first), flags.http_host, flags.http_port, first.name,
                        flags.api_key, flags.access_log, directory=server)
    try:
        server.http_address = await http.start()   # 503 until the scheduler is ready
        await server.run()
    except asyncio.CancelledError:
        log.info("shutting down")
    finally:
        await http.stop()
        server.close_encoder()
        for sock in server.sockets:
            sock.close(linger=0)
        server.close()
        ctx.term()


def main(argv=None) -> None:
    cfg = parse_config(TokenizerConfig, "mlxd tokenizer process", argv)
    setup_logging("tokenizer", cfg.flags.log_level)
    die_with_parent(cfg.parent_pid)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:   # uvloop is optional where it does not build
        runner = asyncio.run
    runner(serve(cfg))
