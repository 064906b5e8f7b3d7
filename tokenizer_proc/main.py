"""The tokenizer process: an asyncio (uvloop) loop between clients and the scheduler.

  client_addr            ROUTER  GenerateRequest / AbortRequest in; StreamChunk / ErrorReply out
  input_addr             PULL    SchedulerReady, then TokenBatch, from the scheduler
  scheduler_input_addr   PUSH    TokenizedRequest / Abort to the scheduler
  ready_addr             PUSH    Ready to the launcher (optional)
"""

import asyncio
import itertools
import logging
import signal
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
import zmq.asyncio

from mlxd.protocol import (
    Abort, AbortRequest, Decoder, ErrorReply, GenerateRequest, GetStats, ProtocolError,
    Ready, SchedulerReady, Stats, StatsReply, StatsRequest, TokenBatch, TokenizedRequest,
    WorkerLimits, encode,
)
from mlxd.runtime.aio import LoopSocket
from mlxd.runtime.config import parse_config
from mlxd.runtime.flags import TOKENIZER, ServerFlags
from mlxd.runtime.lifecycle import die_with_parent, setup_logging

from .detokenizer import IncrementalDetokenizer
from .params import InvalidRequest, parse_params
from .request_stream import RequestStream
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
    def __init__(self, cfg: TokenizerConfig, codec: TextCodec, ctx: zmq.asyncio.Context):
        self.cfg = cfg
        self.codec = codec
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
        self.stats_queries: dict[int, tuple[bytes, str]] = {}
        self.limits: WorkerLimits | None = None   # from SchedulerReady
        self.streams: dict[int, RequestStream] = {}
        self.by_client: dict[tuple[bytes, str], int] = {}
        self._next_rid = itertools.count(1)

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
        self.limits = msg.limits
        if self.to_launcher:
            await self.to_launcher.send(encode(Ready("tokenizer", self.address)))
        log.info("ready: serving clients on %s", self.address)

    # ---- clients -----------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            frames = await self.clients.recv()
            if len(frames) != 2:
                log.error("dropped a client message of %d frames", len(frames))
                continue
            client, frame = frames
            try:
                msg = self.client_decoder.decode(frame)
            except ProtocolError as exc:
                log.error("dropped a malformed frame from client %s: %s", client.hex(), exc)
                # A readable rid means a request with badly typed fields: bad input.
                code = "bad_request" if exc.rid is None else "invalid_request"
                await self._reply(client, ErrorReply(exc.rid, code, str(exc)))
                continue
            try:
                if isinstance(msg, GenerateRequest):
                    await self._admit(client, msg)
                elif isinstance(msg, StatsRequest):
                    query_id = next(self._next_rid)
                    self.stats_queries[query_id] = (client, msg.rid)
                    await self.to_scheduler.send(encode(GetStats(query_id)))
                else:
                    await self._abort_from_client(client, msg.rid)
            except Exception as exc:  # one bad request must not stop the server
                log.exception("request %r failed", msg.rid)
                await self._reply(client, ErrorReply(msg.rid, "internal_error",
                                                     f"{type(exc).__name__}: {exc}"))

    async def _admit(self, client: bytes, req: GenerateRequest) -> None:
        if (client, req.rid) in self.by_client:
            await self._reply(client, ErrorReply(req.rid, "duplicate_rid",
                                                 f"request id {req.rid!r} is already running"))
            return
        try:
            params = parse_params(req.params, self.vocab_size, self.cfg.flags.default_max_tokens)
            input_ids = self._input_ids(req)
            self._check_length(len(input_ids))
        except InvalidRequest as exc:
            await self._reply(client, ErrorReply(req.rid, "invalid_request", str(exc)))
            return
        rid = next(self._next_rid)
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += self.codec.eos_token_ids
        self.streams[rid] = RequestStream(
            client, req.rid, rid, IncrementalDetokenizer(self.codec.decode), params.stop,
            req.stream, params.logprobs)
        self.by_client[(client, req.rid)] = rid
        await self.to_scheduler.send(encode(TokenizedRequest(
            rid, input_ids, params.sampling, params.max_tokens, stop_ids)))

    def _input_ids(self, req: GenerateRequest) -> list[int]:
        given = [x for x in (req.prompt, req.messages, req.input_ids) if x is not None]
        if len(given) != 1:
            raise InvalidRequest("send exactly one of prompt, messages or input_ids")
        vocab = self.vocab_size
        if req.input_ids is not None:
            if any(not 0 <= t < vocab for t in req.input_ids):
                raise InvalidRequest(f"input_ids must be token ids in [0, {vocab})")
            ids = req.input_ids
        else:
            if req.messages is not None:
                ids = self.codec.encode_chat(_checked_messages(req.messages))
            else:
                ids = self.codec.encode_prompt(req.prompt) if req.prompt else []
            if ids and max(ids) >= vocab:   # a token the model has no embedding for
                raise InvalidRequest(f"the prompt encodes to token id {max(ids)}; the "
                                     f"model's vocabulary is [0, {vocab})")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        return ids

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes: the worker's figure once known (a tokenizer may
        hold added tokens the model has no embedding for), else the tokenizer's."""
        return self.limits.vocab_size if self.limits else self.codec.vocab_size

    def _check_length(self, n: int) -> None:
        max_context = self.limits.max_context
        kv_capacity = self.limits.kv_capacity
        if max_context and n >= max_context:
            raise InvalidRequest(f"the prompt has {n} tokens; the model's context is "
                                 f"{max_context} tokens")
        if kv_capacity and n >= kv_capacity:
            raise InvalidRequest(f"the prompt has {n} tokens; the KV cache holds "
                                 f"{kv_capacity} tokens")

    async def _abort_from_client(self, client: bytes, client_rid: str) -> None:
        rid = self.by_client.get((client, client_rid))
        if rid is not None:
            await self.to_scheduler.send(encode(Abort(rid)))

    # ---- scheduler ---------------------------------------------------------

    async def _scheduler_loop(self) -> None:
        while True:
            msg = self._decode(self.scheduler_decoder, await self.from_scheduler.recv(),
                               "scheduler")
            if isinstance(msg, TokenBatch):
                await self._on_batch(msg)
            elif isinstance(msg, Stats) and msg.query_id in self.stats_queries:
                client, rid = self.stats_queries.pop(msg.query_id)
                stats = {**msg.stats, "tokenizer": {"streams": len(self.streams)}}
                await self._reply(client, StatsReply(rid, stats))

    async def _on_batch(self, batch: TokenBatch) -> None:
        for entry in batch.entries:
            stream = self.streams.get(entry.rid)
            if stream is None:   # finished here already (stop string) or unknown
                continue
            chunk = stream.on_entry(entry)
            if stream.finished:
                self._forget(stream)
                if not entry.finish_reason:   # a stop string: the scheduler still runs it
                    await self.to_scheduler.send(encode(Abort(stream.rid)))
            if chunk is not None:
                await self._reply(stream.client, chunk)

    def _forget(self, stream: RequestStream) -> None:
        del self.streams[stream.rid]
        self.by_client.pop((stream.client, stream.client_rid), None)

    async def _reply(self, client: bytes, msg) -> None:
        await self.clients.send_multipart([client, encode(msg)])

    @staticmethod
    def _decode(decoder: Decoder, frame: bytes, sender: str):
        try:
            return decoder.decode(frame)
        except ProtocolError as exc:
            log.error("dropped a malformed frame from the %s: %s", sender, exc)
            return None


def _checked_messages(messages: list) -> list[dict]:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise InvalidRequest("messages must be a list of {role: str, content: str}")
    if not messages:
        raise InvalidRequest("messages is empty")
    return messages


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
