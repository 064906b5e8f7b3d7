"""The tokenizer process: an asyncio (uvloop) loop between clients and the scheduler,
around the socket-free TokenizerCore (core.py).

  client_addr            ROUTER  GenerateRequest / AbortRequest / StatsRequest in;
                                 StreamChunk / ErrorReply / StatsReply out
  engines_addr           ROUTER  each engine's scheduler: SchedulerReady (joining), then
                                 TokenBatch / Stats in; TokenizedRequest / Abort /
                                 GetStats out (engine_links.py)
  tcp://host:engine_port ROUTER  the same, for engines on other machines (CURVE)
  ready_addr             PUSH    Ready to the launcher (optional)

The client socket is bound once `expected_engines` engines have joined and their
limits are known: its frames are capped at `max_frame_bytes` (ZMQ_MAXMSGSIZE: ZeroMQ
drops the connection of a peer that sends a bigger one, before buffering it). Which
engine each message goes to is the EngineSet's to say (engines.py).
"""

import asyncio
import logging
import signal
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from mlxd.protocol import (
    AbortRequest, Decoder, ErrorReply, GenerateRequest, ProtocolError, Ready,
    SchedulerReady, Stats, StatsRequest, TokenBatch, TokenizedRequest, encode,
)
from mlxd.runtime.aio import LoopSocket
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import TOKENIZER, ServerFlags
from mlxd.runtime.keys import BadKey, randomize_routing_ids, read_secret_key, serve_with_curve
from mlxd.runtime.lifecycle import die_with_parent, setup_logging
from mlxd.runtime.sockets import decode_from, monitor_pair

from .auth import key_matches
from .connections import Connections
from .core import Pending, Reply, Sink, ToScheduler, TokenizerCore, protocol_error_reply
from .engine_links import EngineLink, RemoteEngines
from .engines import EngineSet
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
    expected_engines: int = 1   # engines to wait for before serving (the --dp replicas)
    flags: ServerFlags = field(default_factory=ServerFlags)   # those used_by the tokenizer
    parent_pid: int = 0


class TokenizerServer:
    """The sockets around a TokenizerCore: decodes frames, hands them to the core and
    sends what it returns. Replies to ZeroMQ clients are queued by their sinks and
    sent after each call into the core."""

    def __init__(self, cfg: TokenizerConfig, codec: TextCodec, ctx: zmq.asyncio.Context):
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
        for sock in self.sockets:
            getattr(sock, "sock", sock).setsockopt(zmq.LINGER, 0)
        if self.to_launcher:
            self.to_launcher.connect(cfg.ready_addr)
        self.links = [EngineLink(ctx, cfg.engines_addr)]
        self.remote = self._remote_engines(cfg.flags)
        if self.remote is not None:
            self.links.append(self.remote.link)
        self._link_of: dict[str, EngineLink] = {}   # each joined engine's
        flags = cfg.flags
        self.engines = EngineSet(Router(RoutePolicy(
            flags.route_balance_abs, flags.route_balance_rel, flags.route_min_match,
            flags.route_policy)))
        self._serving = asyncio.Event()   # enough engines joined: clients are served
        self.client_decoder = Decoder(GenerateRequest, AbortRequest, StatsRequest)
        self.engine_decoder = Decoder(TokenBatch, SchedulerReady, Stats)
        syntax = resolve(codec.chat_template_text, cfg.flags.tool_call_parser,
                         cfg.flags.reasoning_parser, codec.tokenizer.get_vocab)
        self.core = TokenizerCore(codec, cfg.flags.default_max_tokens,
                                  request_timeout=cfg.flags.request_timeout, syntax=syntax,
                                  offload=self._offload)
        self._replies: deque[tuple[bytes, Reply]] = deque()   # (client identity, reply)
        self._encoder = ThreadPoolExecutor(ENCODE_THREADS, "encode")
        self._encoding: set[asyncio.Task] = set()   # long prompts being encoded
        self._log_bad_frame = ThrottledLog(log, logging.ERROR)
        self.http_address: str | None = None   # the HTTP front end's, once bound

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
        return [s for s in (self.client_events, self.clients, self.to_launcher)
                if s is not None]

    def close(self) -> None:
        self.links[0].close()   # the local one; the remote one with its context:
        if self.remote is not None:
            self.remote.close()

    @property
    def address(self) -> str:
        return self.clients.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def engines_up(self) -> int:
        return len(self.engines.up)

    @property
    def engine_address(self) -> str | None:
        """Where engines on other machines join (None: they cannot)."""
        return self.remote.link.address if self.remote is not None else None

    async def run(self) -> None:
        loops = [loop for link in self.links
                 for loop in (self._engine_loop(link), self._engine_event_loop(link))]
        await asyncio.gather(self._serve_clients(), *loops)

    async def _serve_clients(self) -> None:
        await self._serving.wait()
        self._bind_client_socket()
        await asyncio.gather(self._client_loop(), self._connection_loop(),
                             self._deadline_loop())

    def _bind_client_socket(self) -> None:
        max_bytes = max_frame_bytes(self.core.limits, self.core.codec.max_chars_per_token)
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
        return self.core.handle(client, msg, self._sink(client))

    def _offload(self, pending: Pending) -> None:
        """The core's long prompts: encoded in a thread, then admitted."""
        task = asyncio.create_task(self._encode_and_admit(pending))
        self._encoding.add(task)
        task.add_done_callback(self._encoding.discard)

    async def _encode_and_admit(self, pending: Pending) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._encoder, self.core.encode, pending)
        await self.send(self.core.admit(pending))

    async def _deadline_loop(self) -> None:
        """Requests past their deadline end (checked every DEADLINE_CHECK_SECONDS)."""
        while True:
            await asyncio.sleep(DEADLINE_CHECK_SECONDS)
            if self.core.has_deadlines:
                await self.send(self.core.expire())

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
            aborts += self.core.forget(client)
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
            elif name not in self.engines.engines:   # not (or no longer) joined
                continue
            elif isinstance(msg, TokenBatch):
                await self.send(self.core.on_batch(self.engines.on_batch(name, msg)))
            elif isinstance(msg, Stats):
                self._route_back(self.engines.on_stats(name, msg))
                await self.send()

    def _on_join(self, name: str, link: EngineLink, msg: SchedulerReady) -> None:
        other = self._link_of.get(name)
        if other is not None and other is not link:
            log.error("refused engine %s: an engine of that name is joined already", name)
            return
        if other is not None:   # joining again (restarted) before its old link's end was seen
            self._on_lost(name)
        why = self.engines.join(name, msg)
        if why:
            log.error("refused engine %s: %s", name, why)
            return
        self._link_of[name] = link
        self.core.limits = self.engines.first.limits
        log.info("engine %s joined (%d up): kv_capacity=%d", name, len(self.engines.up),
                 msg.limits.kv_capacity)
        if len(self.engines.up) >= self.cfg.expected_engines:
            self._serving.set()

    async def _engine_event_loop(self, link: EngineLink) -> None:
        while True:
            for name in link.closed(await link.events.recv()):
                self._on_lost(name)
            await self.send()

    def _on_lost(self, name: str) -> None:
        """An engine's link ended: its requests run elsewhere or end."""
        if self._link_of.pop(name, None) is None:
            return
        out, failed = self.engines.lost(name)
        log.error("engine %s was lost (%d up): %d requests run again elsewhere, %d end "
                  "with an error", name, len(self.engines.up),
                  sum(1 for _, m in out if isinstance(m, TokenizedRequest)), len(failed))
        self._deliver_to_engines(out)
        self.core.end_requests(failed, f"the engine running the request ({name}) was "
                                       "lost; the request was lost")

    def _deliver_to_engines(self, out) -> None:
        """Send each (engine, message); an engine that cannot be reached is lost."""
        for name, msg in out:
            if name == "":
                self._route_back([(name, msg)])
                continue
            link = self._link_of.get(name)
            if link is None or not link.send(name, encode(msg)):
                self._on_lost(name)

    def _route_back(self, out) -> None:
        """The EngineSet's answers for the core (merged stats)."""
        for _, msg in out:
            self.core.on_stats(msg)

    def _sink(self, client: bytes) -> Sink:
        return lambda reply: self._replies.append((client, reply))

    async def send(self, to_scheduler: list[ToScheduler] = ()) -> None:
        """The core's messages for the scheduler, then every queued client reply; for
        any front end sharing the core on this loop."""
        to_scheduler = list(to_scheduler)
        while to_scheduler or self._replies:
            out, failed = self.engines.dispatch(to_scheduler)
            self._deliver_to_engines(out)
            self.core.end_requests(failed, "no engine is serving the model now; "
                                           "try again later")
            to_scheduler = []
            while self._replies:
                client, reply = self._replies.popleft()
                to_scheduler += self._deliver(client, reply)

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
        return self.core.fail_client(client, (
            f"the client fell behind reading its replies ({self.cfg.flags.client_queue_limit}"
            " queued); the request was ended"))

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



async def serve(cfg: TokenizerConfig) -> None:
    # Signals cancel the main task: an exception raised from a plain signal
    # handler would be swallowed by the event loop's callback machinery.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, asyncio.current_task().cancel)
    codec = TextCodec(cfg.flags.model)
    ctx = zmq.asyncio.Context()
    try:
        server = TokenizerServer(cfg, codec, ctx)
    except (BadKey, ValueError) as exc:   # a bad key file, an unknown parser name
        ctx.destroy(linger=0)
        raise SystemExit(f"mlxd tokenizer: {exc}") from None
    flags = cfg.flags
    http = HttpFrontEnd(server, flags.http_host, flags.http_port,
                        flags.served_model_name or codec.path.name, flags.api_key,
                        flags.access_log)
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
