"""Per-request timing records and the metrics bench/serving/ reports.

Times are seconds since the trace started. A record keeps the arrival time of
every streamed chunk that carried tokens and how many it carried (None when the
server does not say: mlx_lm.server's SSE chunks carry text only, and a chunk
can hold several tokens when one of them decoded to no text yet).
"""

import heapq
from dataclasses import asdict, dataclass, field

# (key, label, unit, higher is better). Latencies are in seconds in the JSON.
METRICS = [
    ("request_throughput", "req/s", "req/s", True),
    ("output_throughput", "out tok/s", "tok/s", True),
    ("ttft_p50", "TTFT p50", "s", False),
    ("ttft_p90", "TTFT p90", "s", False),
    ("ttft_p99", "TTFT p99", "s", False),
    ("itl_p50", "ITL p50", "s", False),
    ("itl_p90", "ITL p90", "s", False),
    ("itl_p99", "ITL p99", "s", False),
    ("e2e_p50", "E2E p50", "s", False),
    ("e2e_p99", "E2E p99", "s", False),
    ("errors", "errors", "", False),
]
METRIC_KEYS = [m[0] for m in METRICS]


@dataclass
class RequestRecord:
    id: str
    sent: float                               # when the request was sent
    expected_output_tokens: int
    expected_prompt_tokens: int | None = None  # encoded locally with the server's tokenizer
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    done: float | None = None                 # when the last reply arrived
    prompt_tokens: int | None = None          # from the server's usage
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    failed: float | None = None               # when the error was noticed
    retries: int = 0                          # connections the server dropped unread
    text: str = ""                            # the answer (multiturn builds on it)

    @property
    def ok(self) -> bool:
        return self.error is None

    def check(self) -> None:
        """Mark as an error what did not finish as drawn: exactly the asked
        number of tokens, ending for length."""
        if self.error is not None:
            return
        if self.finish_reason != "length" or self.output_tokens != self.expected_output_tokens:
            self.error = (f"finished with {self.finish_reason!r} after {self.output_tokens} "
                          f"tokens, {self.expected_output_tokens} asked")
        elif not self.chunk_times:
            self.error = "no token arrived"
        elif None not in self.chunk_tokens and sum(self.chunk_tokens) != self.output_tokens:
            self.error = (f"streamed {sum(self.chunk_tokens)} tokens, usage says "
                          f"{self.output_tokens}")

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("text")
        out["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two nearest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def itl_samples(times: list[float], tokens: list[int | None], total: int | None) -> list[float]:
    """Inter-token latencies of one stream, one value per token after the first
    chunk: the gap before a chunk divided by the tokens it carried.

    When chunk sizes are unknown (mlx_lm.server's SSE, where a token that decodes
    to no text yet is merged into the next chunk), each chunk counts one token
    and the `total` - chunks left over go one at a time to the gap that is then
    longest per token: a merged chunk arrives after as many decode steps as it
    carries tokens."""
    if len(times) < 2:
        return []
    gaps = [b - a for a, b in zip(times, times[1:])]
    if all(k is not None for k in tokens):
        sizes = list(tokens[1:])
    else:
        sizes = [1] * len(gaps)
        longest = [(-gap, i) for i, gap in enumerate(gaps)]
        heapq.heapify(longest)
        for _ in range(max(0, (total or 0) - len(times))):
            _, i = heapq.heappop(longest)
            sizes[i] += 1
            heapq.heappush(longest, (-gaps[i] / sizes[i], i))
    return [gap / k for gap, k in zip(gaps, sizes) for _ in range(k)]


def summarize(records: list[RequestRecord], start: float = 0.0) -> dict:
    """The metrics of one system on one trace. Throughputs are over the time from
    the trace's start to the last completed reply; latencies cover completed
    requests only (failed ones count in `errors`)."""
    ok = [r for r in records if r.ok]
    ends = [r.done for r in ok]
    duration = (max(ends) - start) if ends else None
    ttft = [r.chunk_times[0] - r.sent for r in ok]
    e2e = [r.done - r.sent for r in ok]
    itl = [x for r in ok for x in itl_samples(r.chunk_times, r.chunk_tokens, r.output_tokens)]
    produced = sum(r.output_tokens or 0 for r in ok)
    out = {
        "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": produced / duration if duration else None,
        "output_tokens": produced,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "connection_retries": sum(r.retries for r in records),
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(values, q)
        out[f"{name}_mean"] = sum(values) / len(values) if values else None
    out.update(token_checks(records))
    return out


def token_checks(records: list[RequestRecord]) -> dict:
    """Token counts from the servers' usage against what the trace drew."""
    answered = [r for r in records if r.output_tokens is not None]
    return {
        "output_token_mismatches": sum(r.output_tokens != r.expected_output_tokens
                                       for r in answered),
        "prompt_token_mismatches": sum(
            r.prompt_tokens != r.expected_prompt_tokens for r in answered
            if r.expected_prompt_tokens is not None),
        # streams whose per-chunk token counts had to be estimated (see itl_samples)
        "itl_estimated_requests": sum(
            any(k is None for k in r.chunk_tokens) and len(r.chunk_times) != r.output_tokens
            for r in answered),
    }


def ratios(ours: dict, theirs: dict) -> dict:
    """mlxd / mlx_lm for every metric (None where either side has no value or
    the divisor is 0)."""
    out = {}
    for key in METRIC_KEYS:
        a, b = ours.get(key), theirs.get(key)
        out[key] = a / b if a is not None and b else None
    return out


def winner(key: str, ratio: float | None) -> str | None:
    higher_better = {m[0]: m[3] for m in METRICS}[key]
    if ratio is None or ratio == 1.0:
        return None
    return "mlxd" if (ratio > 1) == higher_better else "mlx_lm"
