"""The tokenizer process: an asyncio (uvloop) loop between clients and the scheduler,
around the socket-free TokenizerCore (core.py).

  client_addr            ROUTER  GenerateRequest / AbortRequest / StatsRequest in;
                                 StreamChunk / ErrorReply / StatsReply out
  input_addr             PULL    SchedulerReady, then TokenBatch / Stats, from the scheduler
  scheduler_input_addr   PUSH    TokenizedRequest / Abort / GetStats to the scheduler
  ready_addr             PUSH    Ready to the launcher (optional)
"""

import asyncio
import logging
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
import zmq.asyncio

from mlxd.protocol import (
    AbortRequest, Decoder, GenerateRequest, ProtocolError, Ready, SchedulerReady, Stats,
    StatsRequest, TokenBatch, encode,
)
from mlxd.runtime.aio import LoopSocket
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import TOKENIZER, ServerFlags
from mlxd.runtime.lifecycle import die_with_parent, setup_logging

from .core import Reply, Sink, ToScheduler, TokenizerCore, protocol_error_reply
from .text import TextCodec

log = logging.getLogger("mlxd.tokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    PROCESS: ClassVar[str] = TOKENIZER
    client_addr: str
    input_addr: str
    scheduler_input_addr: str
    ready_addr: str = ""
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
        self.clients = LoopSocket(zmq.Socket(ctx, zmq.ROUTER), multipart=True)
        self.from_scheduler = LoopSocket(zmq.Socket(ctx, zmq.PULL))
        self.to_scheduler = ctx.socket(zmq.PUSH)
        self.to_launcher = ctx.socket(zmq.PUSH) if cfg.ready_addr else None
        for sock in self.sockets:
            getattr(sock, "sock", sock).setsockopt(zmq.LINGER, 0)
        self.clients.sock.bind(cfg.client_addr)
        self.from_scheduler.sock.bind(cfg.input_addr)
        self.to_scheduler.connect(cfg.scheduler_input_addr)
        if self.to_launcher:
            self.to_launcher.connect(cfg.ready_addr)
        self.client_decoder = Decoder(GenerateRequest, AbortRequest, StatsRequest)
        self.scheduler_decoder = Decoder(TokenBatch, SchedulerReady, Stats)
        self.core = TokenizerCore(codec, cfg.flags.default_max_tokens)
        self._replies: deque[tuple[bytes, Reply]] = deque()   # (client identity, reply)

    @property
    def sockets(self):
        return [s for s in (self.clients, self.from_scheduler, self.to_scheduler,
                            self.to_launcher) if s is not None]

    @property
    def address(self) -> str:
        return self.clients.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def run(self) -> None:
        await self._wait_for_scheduler()
        await asyncio.gather(self._client_loop(), self._scheduler_loop())

    async def _wait_for_scheduler(self) -> None:
        while True:
            msg = self._decode(self.scheduler_decoder, await self.from_scheduler.recv(),
                               "scheduler")
            if isinstance(msg, SchedulerReady):
                break
        self.core.limits = msg.limits
        if self.to_launcher:
            await self.to_launcher.send(encode(Ready("tokenizer", self.address)))
        log.info("ready: serving clients on %s", self.address)

    async def _client_loop(self) -> None:
        while True:
            frames = await self.clients.recv()
            if len(frames) != 2:
                log.error("dropped a client message of %d frames", len(frames))
                continue
            client, frame = frames
            await self.send(self._on_client_frame(client, frame))

    def _on_client_frame(self, client: bytes, frame: bytes) -> list[ToScheduler]:
        try:
            msg = self.client_decoder.decode(frame)
        except ProtocolError as exc:
            log.error("dropped a malformed frame from client %s: %s", client.hex(), exc)
            self._replies.append((client, protocol_error_reply(exc)))
            return []
        return self.core.handle(client, msg, self._sink(client))

    async def _scheduler_loop(self) -> None:
        while True:
            msg = self._decode(self.scheduler_decoder, await self.from_scheduler.recv(),
                               "scheduler")
            if isinstance(msg, TokenBatch):
                await self.send(self.core.on_batch(msg))
            elif isinstance(msg, Stats):
                self.core.on_stats(msg)
                await self.send()

    def _sink(self, client: bytes) -> Sink:
        return lambda reply: self._replies.append((client, reply))

    async def send(self, to_scheduler: list[ToScheduler] = ()) -> None:
        """The core's messages for the scheduler, then every queued client reply; for
        any front end sharing the core on this loop."""
        for msg in to_scheduler:
            await self.to_scheduler.send(encode(msg))
        while self._replies:
            client, reply = self._replies.popleft()
            await self.clients.send_multipart([client, encode(reply)])

    @staticmethod
    def _decode(decoder: Decoder, frame: bytes, sender: str):
        try:
            return decoder.decode(frame)
        except ProtocolError as exc:
            log.error("dropped a malformed frame from the %s: %s", sender, exc)
            return None


async def serve(cfg: TokenizerConfig) -> None:
    # Signals cancel the main task: an exception raised from a plain signal
    # handler would be swallowed by the event loop's callback machinery.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, asyncio.current_task().cancel)
    codec = TextCodec(cfg.flags.model)
    ctx = zmq.asyncio.Context()
    server = TokenizerServer(cfg, codec, ctx)
    try:
        await server.run()
    except asyncio.CancelledError:
        log.info("shutting down")
    finally:
        for sock in server.sockets:
            sock.close(linger=0)
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
