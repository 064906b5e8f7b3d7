"""The tokenizer's socket-free core: validation, request state and output fan-out.

A front end hands the core each client message together with an opaque, hashable
client key (a ZeroMQ identity, an HTTP connection) and a sink: a callable that takes
the replies to that message (StreamChunk, ErrorReply, StatsReply), at once or as the
scheduler's tokens arrive. Sinks are called synchronously and must neither block nor
raise. Methods return the messages for the scheduler (TokenizedRequest, Abort,
GetStats), in order, for the caller to send. Any number of front ends may share one
core: each request's replies go to the sink it came with.

A request with `n` > 1 runs as n requests in the scheduler (choices), sharing the
prompt (and so its KV, through the radix cache); each choice's chunks carry its
`index`, each finishes with its own finish chunk and usage, and aborting, forgetting
or timing out the client's request ends all of them.
"""

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from mlxd.protocol import (
    Abort, AbortRequest, ErrorReply, GenerateRequest, GetStats, Pin, ProtocolError,
    SamplingParams, Stats, StatsReply, StatsRequest, StreamChunk, TokenBatch, TokenEntry,
    TokenizedRequest, Usage,
)

from .constraints import (THINK_CLOSE, THINK_OPEN, ConstraintCompiler, InvalidConstraint,
                          after_thinking)
from .detokenizer import IncrementalDetokenizer
from .params import InvalidRequest, RequestParams, choice_seed, parse_params
from .request_stream import RequestStream
from .text import TextCodec
from .tools.grammar import tool_call_grammar
from .tools.prompt import ChatRenderer
from .tools.syntax import OutputSyntax
from .validation import (
    ModelLimits, check_length, check_prompt_chars, checked_messages, max_prompt_chars,
    model_vocab_size, prompt_ids,
)

log = logging.getLogger("mlxd.tokenizer")
INLINE_CHARS = 16_384   # prompts shorter than this are encoded on the event loop

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
    deadline: float | None = None   # clock() time past which the request is ended
    prompt_tokens: int = 0          # for the usage of a request ended before any token


@dataclass(slots=True, eq=False)
class Pending:
    """A validated request between `validate` and `admit`; `encode` fills in
    `tokenized` or `error`."""

    client: Hashable
    req: GenerateRequest
    sink: Sink
    rids: list[int]           # one per choice
    params: RequestParams
    vocab_size: int
    max_chars: int | None     # the longest text that can fit, None if unbounded
    limits: ModelLimits | None
    aborted: bool = False     # the client aborted it before admission
    thinking: bool = False    # the prompt ends inside a think block
    tokenized: TokenizedRequest | None = None   # choice 0's
    error: ErrorReply | None = None

    @property
    def rid(self) -> int:
        return self.rids[0]

    @property
    def text_chars(self) -> int:
        """The characters to encode and compile (response_format's source): what
        encoding costs, roughly."""
        constraint = self.params.constraint
        compiled = constraint.chars if constraint is not None else 0
        if self.req.prompt is not None:
            return len(self.req.prompt) + compiled
        return compiled + sum(len(m.get("content", "")) for m in self.req.messages or ()
                              if isinstance(m, dict) and isinstance(m.get("content"), str))


@dataclass(slots=True)
class _StatsQuery:
    client: Hashable
    rid: str
    sink: Sink


class TokenizerCore:
    """`limits` (None before the scheduler's READY) bound prompt lengths and token
    ids; any object with `kv_capacity`, `max_context` and `vocab_size` will do."""

    def __init__(self, codec: TextCodec, default_max_tokens: int,
                 limits: ModelLimits | None = None, request_timeout: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 syntax: OutputSyntax = OutputSyntax(),
                 offload: Callable[["Pending"], None] | None = None, first_id: int = 1):
        """`syntax`: the tool-call format and reasoning markup the model writes.
        `offload`: takes a validated request with a long prompt (INLINE_CHARS or
        more) to `encode` it off the event loop and `admit` it; without it every
        prompt is encoded at once. `first_id`: where its rids and stats query ids
        start (each served model's core has ids of its own)."""
        self.codec = codec
        self._offload = offload
        self.syntax = syntax
        self._marked_decode = None   # decoding that keeps the syntax's markers
        self.render_chat = ChatRenderer(codec.render_chat, syntax.tool_parser)
        self.constraints = ConstraintCompiler(codec)
        self.default_max_tokens = default_max_tokens
        self.limits = limits
        self.request_timeout = request_timeout   # the server's limit (0: none)
        self.clock = clock
        self.requests: dict[int, _Request] = {}
        # client key -> its rid -> the rids of its choices still running (all of them
        # while pending)
        self._rids: dict[Hashable, dict[str, list[int]]] = {}
        self._stats_queries: dict[int, _StatsQuery] = {}
        self._pending: dict[int, Pending] = {}   # validated, not yet admitted
        self._next_id = itertools.count(first_id)   # rids and stats query ids

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
        """A request of any front end: `validate`, then `encode` and `admit` at once,
        or, for a long prompt, through `offload` (so that it holds up no one else;
        the rid, and an abort meanwhile, are kept)."""
        pending = self.validate(client, req, sink)
        if pending is None:
            return []
        if self._offload is not None and pending.text_chars >= INLINE_CHARS:
            self._offload(pending)
            return []
        self.encode(pending)
        return self.admit(pending)

    def validate(self, client: Hashable, req: GenerateRequest, sink: Sink) -> "Pending | None":
        """The cheap checks (rid, parameters, prompt size in characters). A rejection
        goes to `sink` as an ErrorReply (`duplicate_rid`, `invalid_request`) and returns
        None; otherwise the rid is taken (a duplicate is refused, an abort is kept for
        `admit`) and the request waits for `encode` then `admit`."""
        if req.rid in self._rids.get(client, {}):
            sink(ErrorReply(req.rid, "duplicate_rid",
                            f"request id {req.rid!r} is already running"))
            return None
        try:
            vocab_size = model_vocab_size(self.limits, self.codec)
            params = parse_params(req.params, vocab_size, self.default_max_tokens)
            if params.chat.constrained:
                params = self._constrained(req.params, params, vocab_size)
            max_chars = max_prompt_chars(self.limits, self.codec.max_chars_per_token)
            check_prompt_chars(req, max_chars)
        except InvalidRequest as exc:
            sink(ErrorReply(req.rid, "invalid_request", str(exc), exc.param))
            return None
        rids = [next(self._next_id) for _ in range(params.n)]
        pending = Pending(client, req, sink, rids, params, vocab_size, max_chars, self.limits)
        self._pending[pending.rid] = pending
        self._rids.setdefault(client, {})[req.rid] = list(rids)
        return pending

    def encode(self, pending: "Pending") -> None:
        """Encode the prompt: the slow part, safe to run off the event loop (it reads
        only `pending` and the codec). Its result or error waits in `pending`."""
        try:
            pending.tokenized = self._tokenized(pending)
        except InvalidRequest as exc:
            pending.error = ErrorReply(pending.req.rid, "invalid_request", str(exc), exc.param)
        except Exception as exc:  # one bad request must not stop the server
            log.exception("request %r failed", pending.req.rid)
            pending.error = ErrorReply(pending.req.rid, "internal_error",
                                       f"{type(exc).__name__}: {exc}")

    def admit(self, pending: "Pending") -> list[ToScheduler]:
        """Start an encoded request: returns a TokenizedRequest per choice (and their
        Aborts if the client aborted it meanwhile); a rejection goes to its sink.
        Nothing for a request whose client was forgotten meanwhile."""
        if self._pending.pop(pending.rid, None) is None:
            return []
        if pending.error is not None:
            del self._rids[pending.client][pending.req.rid]
            self._unindex(pending.client, pending.req.rid)
            pending.sink(pending.error)
            return []
        choices = _choices(pending)
        for index, tokenized in enumerate(choices):
            self._admit(pending, tokenized.rid, index)
        if pending.aborted:
            return choices + [Abort(rid) for rid in pending.rids]
        return choices

    def abort(self, client: Hashable, client_rid: str) -> list[Abort]:
        """End the client's request early; its last chunk (finish "abort") follows the
        scheduler's. An rid the client has not running is ignored."""
        rids = self._rids.get(client, {}).get(client_rid, [])
        if rids and rids[0] in self._pending:   # still encoding: `admit` sends the aborts
            self._pending[rids[0]].aborted = True
            return []
        return [Abort(rid) for rid in rids]

    def query_stats(self, client: Hashable, client_rid: str, sink: Sink) -> list[GetStats]:
        """Ask the scheduler for its counters; the StatsReply goes to `sink`."""
        query_id = next(self._next_id)
        self._stats_queries[query_id] = _StatsQuery(client, client_rid, sink)
        return [GetStats(query_id)]

    def forget(self, client: Hashable) -> list[Abort]:
        """The client is gone: its requests are aborted and dropped, and nothing more
        goes to its sinks (its stats queries included)."""
        rids = []
        for choices in self._rids.pop(client, {}).values():
            if choices[0] in self._pending:
                del self._pending[choices[0]]   # `admit` drops it
            else:
                rids += choices
        for rid in rids:
            del self.requests[rid]
        self._stats_queries = {query_id: q for query_id, q in self._stats_queries.items()
                               if q.client != client}
        return [Abort(rid) for rid in rids]

    def expire(self) -> list[Abort]:
        """End every request past its deadline (its own `timeout`, or the server's):
        finish_reason "error", an error that starts with "timeout"; aborted in the
        scheduler."""
        now = self.clock()
        late = [rid for rid, r in self.requests.items()
                if r.deadline is not None and now >= r.deadline]
        self.end_requests(late, "timeout: the request ran past its deadline")
        return [Abort(rid) for rid in late]

    @property
    def has_deadlines(self) -> bool:
        return any(r.deadline is not None for r in self.requests.values())

    def _end(self, rid: int, request: _Request, message: str | None,
             reason: str = "error") -> None:
        """Send the request's last chunk: finish_reason `reason` with `message`."""
        stream = request.stream
        # the scheduler's count arrives with the first token; before it, the prompt's
        usage = (stream.usage or Usage(request.prompt_tokens, 0, 0)).with_completion_tokens(
            len(stream.token_ids))
        chunk = stream.on_entry(TokenEntry(rid, [], [], finish_reason=reason, usage=usage,
                                           error=message))
        if chunk is not None:
            request.sink(chunk)

    def end_requests(self, rids: list[int], message: str | None,
                     reason: str = "error") -> None:
        """End these requests with finish_reason `reason` and `message` (no engine
        runs them: nothing is aborted)."""
        for rid in rids:
            request = self.requests.get(rid)
            if request is not None:
                self._end(rid, request, message, reason)
                self._drop(rid, request)

    def fail_client(self, client: Hashable, message: str) -> list[Abort]:
        """End every running request of the client with finish_reason "error" and
        `message` (each sink gets its final chunk); they are aborted in the scheduler.
        Requests still being tokenized and stats queries are dropped as by `forget`."""
        finals = [(rid, self.requests[rid]) for rids in self._rids.get(client, {}).values()
                  for rid in rids if rid in self.requests]
        for rid, request in finals:
            self._end(rid, request, message)
        return self.forget(client)

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

    def prompt_tokens(self, req: GenerateRequest) -> int:
        """The number of tokens `req`'s prompt encodes to, rendered as it would be
        were it submitted (template, tools, system prompt); nothing is started.
        Raises InvalidRequest. Safe to run off the event loop (as `encode`)."""
        vocab_size = model_vocab_size(self.limits, self.codec)
        params = parse_params(req.params, vocab_size, self.default_max_tokens)
        args = params.chat.template_args()
        return len(prompt_ids(req, self.codec, vocab_size,
                              max_prompt_chars(self.limits, self.codec.max_chars_per_token),
                              lambda messages: self.render_chat(messages, args)))

    def usage_so_far(self, client: Hashable, client_rid: str) -> Usage | None:
        """The scheduler's latest usage of the client's running request (its first
        choice; known from its first token on), None when it is not running."""
        rids = self._rids.get(client, {}).get(client_rid)
        request = self.requests.get(rids[0]) if rids else None
        return None if request is None else request.stream.usage

    def check_integrity(self) -> None:
        """Every request is indexed under its client key and client rid, and only those."""
        indexed = {rid: (client, client_rid) for client, rids in self._rids.items()
                   for client_rid, choices in rids.items() for rid in choices}
        known = {rid: (r.client, r.stream.client_rid) for rid, r in self.requests.items()}
        known.update({rid: (p.client, p.req.rid) for p in self._pending.values()
                      for rid in p.rids})
        assert indexed == known, (indexed, self.requests, self._pending)
        assert all(self._rids.values()), "a client key without requests is kept"
        assert all(all(rids.values()) for rids in self._rids.values()), \
            "a client rid without running choices is kept"

    # ---- internals ---------------------------------------------------------

    def _constrained(self, given: dict, params: RequestParams,
                     vocab_size: int) -> RequestParams:
        """The params of a request that must call a tool: its output constrained by
        the grammar of a call in the model's format."""
        if given.get("response_format") is not None:
            raise InvalidRequest("response_format cannot be combined with tool_choice "
                                 "'required' or a named function", "response_format")
        grammar = tool_call_grammar(self.syntax.tool_parser, params.chat, self._token_ref)
        return parse_params({**given, "response_format": {"type": "grammar",
                                                          "grammar": grammar}},
                            vocab_size, self.default_max_tokens)

    def _token_ref(self, marker: str) -> str:
        """A marker as the grammar writes it: a special token by id, else its text."""
        token = self.codec.special_id(marker)
        return json.dumps(marker, ensure_ascii=False) if token is None else f"<[{token}]>"

    def _tokenized(self, pending: "Pending") -> TokenizedRequest:
        params = pending.params
        args = params.chat.template_args()
        input_ids = prompt_ids(pending.req, self.codec, pending.vocab_size, pending.max_chars,
                               lambda messages: self.render_chat(messages, args))
        pending.thinking = (self.syntax.reasoning and pending.req.messages is not None
                            and self._ends_thinking(input_ids))
        check_length(len(input_ids), pending.limits, params.max_tokens)
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += self.codec.eos_token_ids
        thinks = (self.syntax.reasoning and pending.req.messages is not None
                  and params.chat.template_kwargs.get("enable_thinking") is not False)
        return TokenizedRequest(pending.rid, input_ids,
                                self._sampling(params, thinks, pending.thinking),
                                params.max_tokens, stop_ids, self._pins(params, input_ids))

    def _pins(self, params: RequestParams, input_ids: list[int]) -> list[Pin]:
        """Where each cache prefix ends in the prompt: the tokens the prompt shares
        with the prefix's chat rendered alone (so a template's or the tokenizer's
        choices at the boundary cut it short, never long). A prefix the template
        refuses is left out (logged)."""
        args = {k: v for k, v in params.chat.template_args().items() if k != "continue_final"}
        pins = []
        for prefix in params.cache_prefixes:
            tools = {"tools": prefix.tools} if prefix.tools and "tools" in args else {}
            try:
                text = self.render_chat(checked_messages(prefix.messages), {**args, **tools})
            except InvalidRequest as exc:
                log.info("a cache_control prefix is not pinned: %s", exc)
                continue
            ids = self.codec.encode_rendered(text)
            n = next((i for i, (a, b) in enumerate(zip(ids, input_ids)) if a != b),
                     min(len(ids), len(input_ids)))
            if n:
                pins.append(Pin(n, prefix.ttl))
        return pins

    def _sampling(self, params: RequestParams, thinks: bool = False, opened: bool = False):
        """The request's sampling parameters, with its thinking budget's markers and
        its response_format's grammar; for a chat with a reasoning model (`thinks`),
        the grammar starts after the thinking (`opened`: the prompt already opened
        the think block). A request that does not think has no budget."""
        sampling = self._thinking(params.sampling, thinks, opened)
        if params.constraint is None:
            return sampling
        try:
            grammar = self.constraints.compile(params.constraint)
        except InvalidConstraint as exc:
            raise InvalidRequest(str(exc), "response_format") from None
        if thinks:
            grammar = after_thinking(grammar, opened)
        return dataclasses.replace(sampling, grammar=grammar)

    def _thinking(self, sampling: SamplingParams, thinks: bool, opened: bool) -> SamplingParams:
        if sampling.thinking_budget is None:
            return sampling
        if not thinks:
            return dataclasses.replace(sampling, thinking_budget=None)
        return dataclasses.replace(sampling, think_start_ids=self._marker_ids(THINK_OPEN),
                                   think_end_ids=self._marker_ids(THINK_CLOSE),
                                   think_opened=opened)

    def _marker_ids(self, marker: str) -> list[int]:
        """A marker's tokens as the model writes it: a special token, else its text's."""
        token = self.codec.special_id(marker)
        return [token] if token is not None else self.codec.encode_text(marker)

    def _ends_thinking(self, input_ids: list[int]) -> bool:
        """Whether the prompt's last tokens open a think block (templates that start
        the reply thinking)."""
        tail = self.codec.tokenizer.decode(input_ids[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith("<think>")

    def _admit(self, pending: "Pending", rid: int, index: int) -> None:
        params = pending.params
        tools = params.chat.tools if params.chat.calls_tools else None
        parser = self.syntax.parser(tools, pending.req.messages is not None, pending.thinking)
        decode = self.codec.decode
        if not params.skip_special_tokens:
            decode = self.codec.decode_all
        elif parser is not None:
            if self._marked_decode is None:
                self._marked_decode = self.codec.decoder_keeping(self.syntax.markers)
            decode = self._marked_decode
        stream = RequestStream(pending.req.rid, rid, IncrementalDetokenizer(decode),
                               params.stop, pending.req.stream, params.logprobs, index,
                               parser)
        limits = [t for t in (params.timeout, self.request_timeout) if t]
        deadline = self.clock() + min(limits) if limits else None
        self.requests[rid] = _Request(pending.client, stream, pending.sink, deadline,
                                      len(pending.tokenized.input_ids))

    def _drop(self, rid: int, request: _Request) -> None:
        del self.requests[rid]
        choices = self._rids[request.client][request.stream.client_rid]
        choices.remove(rid)
        if not choices:   # the client's request ends with its last choice
            del self._rids[request.client][request.stream.client_rid]
            self._unindex(request.client, request.stream.client_rid)

    def _unindex(self, client: Hashable, client_rid: str) -> None:
        """After `client_rid` left the client's index: drop a key left empty."""
        if not self._rids[client]:   # a key per HTTP connection must not pile up
            del self._rids[client]


def _choices(pending: "Pending") -> list[TokenizedRequest]:
    """The scheduler's requests for an encoded request, one per choice: the same
    prompt, each choice's own rid and seed."""
    first = pending.tokenized
    return [first] + [
        dataclasses.replace(first, rid=rid, sampling=dataclasses.replace(
            first.sampling, seed=choice_seed(first.sampling.seed, index)))
        for index, rid in enumerate(pending.rids[1:], start=1)]
