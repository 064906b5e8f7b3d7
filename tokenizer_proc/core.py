"""The tokenizer's socket-free core: validation, request state and output fan-out.

A front end hands the core each client message together with an opaque, hashable
client key (a ZeroMQ identity, an HTTP connection) and a sink: a callable that takes
the replies to that message (StreamChunk, ErrorReply, StatsReply), at once or as the
scheduler's tokens arrive. Sinks are called synchronously and must neither block nor
raise. Methods return the messages for the scheduler (TokenizedRequest, Abort,
GetStats), in order, for the caller to send. Any number of front ends may share one
core: each request's replies go to the sink it came with.
"""

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Hashable

from mlxd.protocol import (
    Abort, AbortRequest, ErrorReply, GenerateRequest, GetStats, ProtocolError, Stats,
    StatsReply, StatsRequest, StreamChunk, TokenBatch, TokenizedRequest,
)

from .detokenizer import IncrementalDetokenizer
from .params import InvalidRequest, RequestParams, parse_params
from .request_stream import RequestStream
from .text import TextCodec
from .validation import ModelLimits, check_length, model_vocab_size, prompt_ids

log = logging.getLogger("mlxd.tokenizer")

Reply = StreamChunk | ErrorReply | StatsReply
Sink = Callable[[Reply], None]
ToScheduler = TokenizedRequest | Abort | GetStats


def protocol_error_reply(exc: ProtocolError) -> ErrorReply:
    """The answer to a client message that did not decode: with a readable rid it is
    a request with badly typed fields (bad input), without one a bad frame."""
    code = "bad_request" if exc.rid is None else "invalid_request"
    return ErrorReply(exc.rid, code, str(exc))


@dataclass(slots=True)
class _Request:
    client: Hashable
    stream: RequestStream
    sink: Sink


@dataclass(slots=True)
class _StatsQuery:
    client: Hashable
    rid: str
    sink: Sink


class TokenizerCore:
    """`limits` (None before the scheduler's READY) bound prompt lengths and token
    ids; any object with `kv_capacity`, `max_context` and `vocab_size` will do."""

    def __init__(self, codec: TextCodec, default_max_tokens: int,
                 limits: ModelLimits | None = None):
        self.codec = codec
        self.default_max_tokens = default_max_tokens
        self.limits = limits
        self.requests: dict[int, _Request] = {}
        self._rids: dict[Hashable, dict[str, int]] = {}   # client key -> its rid -> rid
        self._stats_queries: dict[int, _StatsQuery] = {}
        self._next_id = itertools.count(1)   # rids and stats query ids

    # ---- from clients ------------------------------------------------------

    def handle(self, client: Hashable, msg, sink: Sink) -> list[ToScheduler]:
        """A decoded client message: GenerateRequest, AbortRequest or StatsRequest."""
        if isinstance(msg, GenerateRequest):
            return self.submit(client, msg, sink)
        if isinstance(msg, AbortRequest):
            return self.abort(client, msg.rid)
        if isinstance(msg, StatsRequest):
            return self.query_stats(client, msg.rid, sink)
        raise TypeError(f"not a client message: {type(msg).__name__}")

    def submit(self, client: Hashable, req: GenerateRequest, sink: Sink) -> list[ToScheduler]:
        """Validate and admit a request: returns its TokenizedRequest, and its chunks go
        to `sink` as tokens arrive. A rejection goes to `sink` as an ErrorReply
        (`duplicate_rid`, `invalid_request`, `internal_error`) and returns nothing."""
        if req.rid in self._rids.get(client, {}):
            sink(ErrorReply(req.rid, "duplicate_rid",
                            f"request id {req.rid!r} is already running"))
            return []
        try:
            tokenized, params = self._tokenized(req)
        except InvalidRequest as exc:
            sink(ErrorReply(req.rid, "invalid_request", str(exc)))
            return []
        except Exception as exc:  # one bad request must not stop the server
            log.exception("request %r failed", req.rid)
            sink(ErrorReply(req.rid, "internal_error", f"{type(exc).__name__}: {exc}"))
            return []
        self._admit(client, req, tokenized, params, sink)
        return [tokenized]

    def abort(self, client: Hashable, client_rid: str) -> list[Abort]:
        """End the client's request early; its last chunk (finish "abort") follows the
        scheduler's. An rid the client has not running is ignored."""
        rid = self._rids.get(client, {}).get(client_rid)
        return [] if rid is None else [Abort(rid)]

    def query_stats(self, client: Hashable, client_rid: str, sink: Sink) -> list[GetStats]:
        """Ask the scheduler for its counters; the StatsReply goes to `sink`."""
        query_id = next(self._next_id)
        self._stats_queries[query_id] = _StatsQuery(client, client_rid, sink)
        return [GetStats(query_id)]

    def forget(self, client: Hashable) -> list[Abort]:
        """The client is gone: its requests are aborted and dropped, and nothing more
        goes to its sinks (its stats queries included)."""
        rids = list(self._rids.pop(client, {}).values())
        for rid in rids:
            del self.requests[rid]
        self._stats_queries = {query_id: q for query_id, q in self._stats_queries.items()
                               if q.client != client}
        return [Abort(rid) for rid in rids]

    # ---- from the scheduler ------------------------------------------------

    def on_batch(self, batch: TokenBatch) -> list[Abort]:
        """Fan a step's tokens out as chunks. A stop string finishes a request here
        while the scheduler still runs it: its Abort is returned."""
        aborts = []
        for entry in batch.entries:
            request = self.requests.get(entry.rid)
            if request is None:   # finished here already (stop string), forgotten, unknown
                continue
            chunk = request.stream.on_entry(entry)
            if request.stream.finished:
                self._drop(entry.rid, request)
                if not entry.finish_reason:
                    aborts.append(Abort(entry.rid))
            if chunk is not None:
                request.sink(chunk)
        return aborts

    def on_stats(self, stats: Stats) -> None:
        """Answer the client whose query this is (none if it has been forgotten)."""
        query = self._stats_queries.pop(stats.query_id, None)
        if query is not None:
            query.sink(StatsReply(query.rid, {**stats.stats, "tokenizer": self.stats()}))

    def stats(self) -> dict:
        return {"streams": len(self.requests)}

    def check_integrity(self) -> None:
        """Every request is indexed under its client key and client rid, and only those."""
        indexed = {rid: (client, client_rid) for client, rids in self._rids.items()
                   for client_rid, rid in rids.items()}
        assert indexed == {rid: (r.client, r.stream.client_rid)
                           for rid, r in self.requests.items()}, (indexed, self.requests)
        assert all(self._rids.values()), "a client key without requests is kept"

    # ---- internals ---------------------------------------------------------

    def _tokenized(self, req: GenerateRequest) -> tuple[TokenizedRequest, RequestParams]:
        vocab_size = model_vocab_size(self.limits, self.codec)
        params = parse_params(req.params, vocab_size, self.default_max_tokens)
        input_ids = prompt_ids(req, self.codec, vocab_size)
        check_length(len(input_ids), self.limits)
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += self.codec.eos_token_ids
        return TokenizedRequest(next(self._next_id), input_ids, params.sampling,
                                params.max_tokens, stop_ids), params

    def _admit(self, client: Hashable, req: GenerateRequest, tokenized: TokenizedRequest,
               params: RequestParams, sink: Sink) -> None:
        stream = RequestStream(req.rid, tokenized.rid, IncrementalDetokenizer(self.codec.decode),
                               params.stop, req.stream, params.logprobs)
        self.requests[tokenized.rid] = _Request(client, stream, sink)
        self._rids.setdefault(client, {})[req.rid] = tokenized.rid

    def _drop(self, rid: int, request: _Request) -> None:
        del self.requests[rid]
        rids = self._rids[request.client]
        del rids[request.stream.client_rid]
        if not rids:   # a key per HTTP connection must not pile up
            del self._rids[request.client]
