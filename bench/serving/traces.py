"""Request traces for bench/serving/: drawn from a seed, saved and replayed as JSONL.

A trace is a header (kind, seed, parameters, how EOS is ignored) and a list of
requests. Lengths count tokens of the served model's tokenizer: prompts are
made of words that are one token each (`WordText`), so a drawn length is the
prompt's exact token count (BOS included), and both servers, which encode the
same text with the same tokenizer, see the same tokens.

Kinds:
  burst      N requests at t=0
  poisson    N requests arriving at `rate` req/s (exponential gaps)
  multiturn  chat sessions arriving at `session_rate`; each turn's prompt is the
             conversation so far (built at run time from the system's own
             answers) plus the turn's user message, stored here
  longmix    N short requests at `rate` req/s, `long_count` of them replaced by
             prompts of ~`long_len` tokens (head-of-line blocking)

The file: line 1 is the header, then one JSON object per request (multiturn:
one per turn, ids "s<session>t<turn>").
"""

import json
import math
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol

KINDS = ("burst", "poisson", "multiturn", "longmix")
FORMAT = 1


@dataclass(frozen=True)
class LengthDist:
    """A long-tailed length: lognormal with this median, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return int(min(self.high, max(self.low, value)))


@dataclass
class TraceRequest:
    id: str
    arrival: float              # s after the trace starts (multiturn: when the session starts)
    output_tokens: int          # exactly this many tokens are asked for (EOS ignored)
    prompt: str | None = None   # text prompt (burst, poisson, longmix)
    prompt_tokens: int | None = None   # its token count, BOS included
    session: int | None = None  # multiturn
    turn: int | None = None
    user: str | None = None     # multiturn: this turn's user message
    user_tokens: int | None = None
    tag: str | None = None      # longmix: "long" or "short"


@dataclass
class Trace:
    header: dict
    requests: list[TraceRequest]

    @property
    def name(self) -> str:
        return self.header["name"]

    @property
    def kind(self) -> str:
        return self.header["kind"]

    def sessions(self) -> list[list[TraceRequest]]:
        """Multiturn: the turns of each session, in order."""
        by_session: dict[int, list[TraceRequest]] = {}
        for r in self.requests:
            by_session.setdefault(r.session, []).append(r)
        return [sorted(turns, key=lambda r: r.turn) for _, turns in sorted(by_session.items())]


class TextSource(Protocol):
    """Makes texts of an exact token count (see `WordText`)."""

    def prompt(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        """A prompt of `n_tokens` tokens as the servers encode it (BOS included);
        returns the text and its actual token count."""

    def message(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        """A chat message of `n_tokens` tokens (no special tokens)."""


# ---- generation ---------------------------------------------------------------


@dataclass(frozen=True)
class TraceParams:
    num_requests: int = 64
    rate: float = 1.0                 # poisson / longmix arrivals, req/s
    prompt: LengthDist = LengthDist(128, 0.8, 16, 1024)
    output: LengthDist = LengthDist(64, 0.7, 8, 256)
    sessions: int = 8
    turns: int = 4
    session_rate: float = 0.5         # multiturn session starts, sessions/s
    user: LengthDist = LengthDist(64, 0.6, 8, 256)
    long_count: int = 3
    long_len: int = 4000
    long_output: int = 32


def generate_trace(kind: str, params: TraceParams, seed: int, texts: TextSource,
                   extra_header: dict | None = None) -> Trace:
    """The same (kind, params, seed, texts) always gives the same trace."""
    # Lengths and arrival gaps come from `rng`; words from their own generator,
    # seeded by the trace name, so poisson traces at several rates share lengths
    # and (stretched) arrivals but never prompt text, which a prefix cache would reuse.
    rng = random.Random(f"{kind}:{seed}")
    words = _Words(texts, random.Random(f"{trace_name(kind, params)}:{seed}:text"))
    makers = {"burst": _burst, "poisson": _poisson, "multiturn": _multiturn,
              "longmix": _longmix}
    if kind not in makers:
        raise ValueError(f"unknown trace kind {kind!r}; choose from {', '.join(KINDS)}")
    requests = makers[kind](params, rng, words)
    header = {"format": FORMAT, "name": trace_name(kind, params), "kind": kind, "seed": seed,
              "params": _kind_params(kind, params), **(extra_header or {})}
    return Trace(header, requests)


def trace_name(kind: str, params: TraceParams) -> str:
    return f"poisson-r{params.rate:g}" if kind == "poisson" else kind


def _kind_params(kind: str, p: TraceParams) -> dict:
    common = {"prompt": asdict(p.prompt), "output": asdict(p.output)}
    return {
        "burst": {"num_requests": p.num_requests, **common},
        "poisson": {"num_requests": p.num_requests, "rate": p.rate, **common},
        "multiturn": {"sessions": p.sessions, "turns": p.turns, "session_rate": p.session_rate,
                      "user": asdict(p.user), "output": asdict(p.output)},
        "longmix": {"num_requests": p.num_requests, "rate": p.rate, **common,
                    "long_count": p.long_count, "long_len": p.long_len,
                    "long_output": p.long_output},
    }[kind]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process; the first request arrives at 0.
    Gaps are drawn at rate 1 and scaled, so one seed gives the same pattern
    (stretched) at every rate."""
    times, t = [], 0.0
    for _ in range(n):
        times.append(t / rate)
        t += rng.expovariate(1.0)
    return times


class _Words:
    """A TextSource bound to its own random generator."""

    def __init__(self, texts: TextSource, rng: random.Random):
        self.texts, self.rng = texts, rng

    def prompt(self, n_tokens: int) -> tuple[str, int]:
        return self.texts.prompt(n_tokens, self.rng)

    def message(self, n_tokens: int) -> tuple[str, int]:
        return self.texts.message(n_tokens, self.rng)


def _text_request(rid: str, arrival: float, words: _Words, prompt_len: int, output_len: int,
                  tag: str | None = None) -> TraceRequest:
    text, n = words.prompt(prompt_len)
    return TraceRequest(rid, round(arrival, 6), output_len, prompt=text, prompt_tokens=n, tag=tag)


def _burst(p: TraceParams, rng, words) -> list[TraceRequest]:
    return [_text_request(f"r{i}", 0.0, words, p.prompt.draw(rng), p.output.draw(rng))
            for i in range(p.num_requests)]


def _poisson(p: TraceParams, rng, words) -> list[TraceRequest]:
    lengths = [(p.prompt.draw(rng), p.output.draw(rng)) for _ in range(p.num_requests)]
    arrivals = poisson_arrivals(p.num_requests, p.rate, rng)
    return [_text_request(f"r{i}", t, words, pl, ol)
            for i, (t, (pl, ol)) in enumerate(zip(arrivals, lengths))]


def _multiturn(p: TraceParams, rng, words) -> list[TraceRequest]:
    requests = []
    for s, start in enumerate(poisson_arrivals(p.sessions, p.session_rate, rng)):
        for turn in range(p.turns):
            user, n = words.message(p.user.draw(rng))
            requests.append(TraceRequest(f"s{s}t{turn}", round(start, 6), p.output.draw(rng),
                                         session=s, turn=turn, user=user, user_tokens=n))
    return requests


def _longmix(p: TraceParams, rng, words) -> list[TraceRequest]:
    n = p.num_requests
    arrivals = poisson_arrivals(n, p.rate, rng)
    # Never the first request: a long prompt should land while short ones are running.
    long_at = set(rng.sample(range(1, n), min(p.long_count, n - 1))) if n > 1 else set()
    requests = []
    for i, t in enumerate(arrivals):
        if i in long_at:
            prompt_len = max(1, round(p.long_len * rng.uniform(0.95, 1.0)))
            requests.append(_text_request(f"r{i}", t, words, prompt_len,
                                          p.long_output, tag="long"))
        else:
            requests.append(_text_request(f"r{i}", t, words, p.prompt.draw(rng),
                                          p.output.draw(rng), tag="short"))
    return requests


# ---- JSONL --------------------------------------------------------------------


def save_trace(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(trace.header) + "\n")
        for r in trace.requests:
            f.write(json.dumps({k: v for k, v in asdict(r).items() if v is not None}) + "\n")


def load_trace(path: str | Path) -> Trace:
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty trace file")
    header = json.loads(lines[0])
    if header.get("format") != FORMAT or header.get("kind") not in KINDS:
        raise ValueError(f"{path}: line 1 is not a trace header (format {FORMAT}, kind in {KINDS})")
    known = {f.name for f in fields(TraceRequest)}
    requests = []
    for number, line in enumerate(lines[1:], start=2):
        record = json.loads(line)
        unknown = set(record) - known
        if unknown or "id" not in record or "output_tokens" not in record:
            raise ValueError(f"{path}:{number}: not a trace request ({sorted(unknown) or record})")
        requests.append(TraceRequest(**record))
    _check_requests(header["kind"], requests, path)
    return Trace(header, requests)


def _check_requests(kind: str, requests: list[TraceRequest], path) -> None:
    for r in requests:
        needed = ("session", "turn", "user") if kind == "multiturn" else ("prompt",)
        if any(getattr(r, name) is None for name in needed) or r.output_tokens < 1:
            raise ValueError(f"{path}: request {r.id} lacks {needed} or output_tokens >= 1")


# ---- texts of exact token counts ------------------------------------------------


class WordText:
    """Texts built from words that are one token each in `tokenizer` (a
    transformers tokenizer), checked by encoding the result: a prompt of n tokens
    is the tokenizer's special tokens (BOS) plus n - those words."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.first, self.rest = single_token_words(tokenizer)
        if not self.first or not self.rest:
            raise ValueError("the tokenizer has too few single-token words to build prompts")
        probe = self.first[0]
        self.special = len(tokenizer.encode(probe)) - len(self._encode(probe))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _words(self, n: int, rng: random.Random) -> list[str]:
        return [rng.choice(self.first)] + [rng.choice(self.rest) for _ in range(n - 1)]

    def message(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        words = self._words(max(1, n_tokens), rng)
        for _ in range(4):     # fits at once unless words merged; then adjust
            n = len(self._encode(" ".join(words)))
            if n == n_tokens:
                break
            if n > n_tokens:
                words = words[:max(1, len(words) - (n - n_tokens))]
            else:
                words += [rng.choice(self.rest) for _ in range(n_tokens - n)]
        text = " ".join(words)
        return text, len(self._encode(text))

    def prompt(self, n_tokens: int, rng: random.Random) -> tuple[str, int]:
        """At least one word: never fewer than `special` + 1 tokens."""
        text, _ = self.message(max(1, n_tokens - self.special), rng)
        return text, len(self.tokenizer.encode(text))


def single_token_words(tokenizer) -> tuple[list[str], list[str]]:
    """(words that are one token at the start of a text, words that are one token
    after a space), ASCII letters only, in vocabulary order."""
    candidates = []
    seen = set()
    for token_id in range(len(tokenizer)):
        word = tokenizer.decode([token_id]).strip()
        if word and word.isascii() and word.isalpha() and word not in seen:
            seen.add(word)
            candidates.append(word)
    first = [w for w in candidates if len(tokenizer.encode(w, add_special_tokens=False)) == 1]
    if not first:
        return [], []
    lead = len(tokenizer.encode(first[0], add_special_tokens=False))
    rest = [w for w in candidates
            if len(tokenizer.encode(f"{first[0]} {w}", add_special_tokens=False)) == lead + 1]
    return first, rest
