"""Structured output: decode tok/s of one batch of N requests with 0%, 50% and 100%
of them constrained by a JSON schema (response_format), overlap on and off.

    python -m bench.structured                  # ~40M random-weight model, N=64
    python -m bench.structured --model smollm2 --n 64 --prompt-len 32 --gen-len 64

Every request samples at temperature 1 (seeded) and runs exactly G tokens:
unconstrained ones with ignore_eos, constrained ones under a schema no output of G
tokens can complete (an array of at least 1000 records), so both end with `length`
and the batch keeps N rows throughout. Decode
rate: output tokens streamed between the moment every request had its first token
and the last token, over that time. In each repeat a server runs the three fractions
back to back (fresh random prompts each time, the order reversed every other repeat);
medians reported, and the ratio is the median of each repeat's ratio to its own
unconstrained run. It also times the worker's mask computation
alone: llguidance's masks for N matchers at the states a sampled run passes through.
"""

import argparse
import asyncio
import json
import statistics

from bench.common import MlxdServer, bench_model, machine_summary, now, random_prompts, tokenizer_vocab

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "score": {"type": "number"}},
    "required": ["name", "age", "tags", "score"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {
    "records": {"type": "array", "items": RECORD, "minItems": 1000}},
    "required": ["records"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}
FRACTIONS = (0.0, 0.5, 1.0)


async def _drive(address: str, prompts, gen_len: int, constrained: int) -> float:
    """Decode tok/s of the batch, the first `constrained` requests under the schema."""
    from mlxd.client import AsyncClient

    async with AsyncClient(address, timeout=600) as c:
        await c.generate(input_ids=prompts[0][:8], max_tokens=4, ignore_eos=True)
        arrivals: list[tuple[float, int]] = []
        firsts: list[float] = []

        async def one(i, prompt):
            extra = ({"response_format": RESPONSE_FORMAT} if i < constrained
                     else {"ignore_eos": True})
            extra.update(temperature=1.0, seed=i)   # every row samples alike
            got = 0
            async for chunk in c.stream(input_ids=prompt, max_tokens=gen_len, **extra):
                if chunk.token_ids and not got:
                    firsts.append(now())
                got += len(chunk.token_ids)
                arrivals.append((now(), len(chunk.token_ids)))
            assert got == gen_len and chunk.finish_reason == "length", (got, chunk)
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    start = max(firsts)
    tokens = sum(n for t, n in arrivals if t > start)
    return tokens / (max(t for t, _ in arrivals) - start)


def mask_ms_per_step(model_path: str, n: int, steps: int) -> float:
    """ms to compute the masks of `n` constrained rows, per decode step, along the
    tokens a random sampler picks among the allowed ones (the worker's code path)."""
    import random

    import numpy as np
    from mlx_lm import load

    from mlxd.tokenizer_proc.constraints import JSON_OPTIONS
    from mlxd.worker_proc.grammar import Grammars
    from mlxd.worker_proc.sampling import RowState
    from mlxd.protocol import SamplingParams
    from llguidance import LLMatcher

    model, tokenizer = load(model_path)
    grammars = Grammars.for_model(tokenizer, model.args.vocab_size)
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    rows = [RowState(SamplingParams(grammar=grammar), 0, grammar=grammars.row(grammar))
            for _ in range(n)]
    rng = random.Random(0)
    elapsed = 0.0
    for _ in range(steps):
        start = now()
        bitmask = grammars.start_masks(rows).result()
        elapsed += now() - start
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        for row, allowed in zip(rows, bits):
            row.grammar.advance(rng.choice(np.flatnonzero(allowed).tolist()))
    grammars.close()
    return elapsed / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.model = bench_model(args.model)
    vocab = tokenizer_vocab(args.model)
    servers = {"overlap_on": MlxdServer(args.model),
               "overlap_off": MlxdServer(args.model, "--disable-overlap")}
    runs = {(name, f): [] for name in servers for f in FRACTIONS}
    seeds = iter(range(10**6))   # fresh prompts for every run: no prefix-cache hits
    try:
        for repeat in range(args.repeats):
            # the fractions of one server back to back, in turns forward and backward,
            # so each ratio compares runs minutes apart at most on a shared machine
            order = FRACTIONS if repeat % 2 == 0 else FRACTIONS[::-1]
            for name in servers:
                for fraction in order:
                    prompts = random_prompts(args.n, args.prompt_len, vocab, seed=next(seeds))
                    runs[(name, fraction)].append(asyncio.run(_drive(
                        servers[name].address, prompts, args.gen_len,
                        round(fraction * args.n))))
    finally:
        for server in servers.values():
            server.stop()
    mask_ms = mask_ms_per_step(args.model, args.n, steps=args.gen_len)
    report(args, runs, mask_ms)


def report(args, runs: dict, mask_ms: float) -> None:
    med = {key: statistics.median(rates) for key, rates in runs.items()}
    out = {"machine": machine_summary(), "model": args.model, "n": args.n,
           "prompt_len": args.prompt_len, "gen_len": args.gen_len,
           "mask_ms_per_step": mask_ms, "configs": []}
    print(f"{args.n} requests, {args.prompt_len} prompt + {args.gen_len} output tokens; "
          f"{out['machine']}")
    for (name, fraction), rate in med.items():
        # the median of each repeat's ratio to the unconstrained run next to it
        ratio = statistics.median(r / base for r, base in zip(runs[(name, fraction)],
                                                              runs[(name, 0.0)]))
        out["configs"].append({"server": name, "constrained": fraction, "decode_tok_s": rate,
                               "runs": runs[(name, fraction)], "ratio": ratio})
        print(f"{name:12s} {fraction:4.0%} constrained  {rate:8.1f} decode tok/s  "
              f"ratio {ratio:.3f}  runs {[round(r, 1) for r in runs[(name, fraction)]]}")
    print(f"masks of {args.n} constrained rows, computed alone: {mask_ms:.2f} ms per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
