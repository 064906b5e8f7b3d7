"""How much greedy output moves when the KV is rounded, in mlx_lm itself (no server):
the default model generates 128 greedy tokens for N chats with float32 KV, then with
KV rounded as it is cached (float16, bfloat16, 8-bit MLX affine groups, plain or
rotated as --kv-bits stores them), optionally only for positions older than the
newest `--recent` ones. Reports the first token where each leaves float32 KV's
output, and, teacher-forced on that output, top-1 agreement and the mean KL.

    python -m bench.kv_rounding                           # every rounding, 32 chats
    python -m bench.kv_rounding --formats q8-rot --recent 64
"""

import argparse
import statistics

from bench.common import bench_model, rerun_with_worker_blas
from bench.kv_bits import TOPICS, first_divergence

FORMATS = ("float16", "bfloat16", "q8", "q8-rot", "q8-rot-g64", "q4-rot")


def rounding(name: str):
    """`x -> x` as cached in the format `name`."""
    import mlx.core as mx

    from mlxd.worker_proc.kv_quant import KVFormat

    if name in ("float16", "bfloat16"):
        dtype = getattr(mx, name)
        return lambda x: x.astype(dtype).astype(x.dtype)
    bits, group = int(name[1]), 64 if name.endswith("g64") else 32
    if "rot" in name:
        def rotated(x):
            fmt = KVFormat.of(x.dtype, bits, x.shape[-1], group)
            return fmt.decode(fmt.encode(x))
        return rotated
    return lambda x: mx.dequantize(*mx.quantize(x, group_size=group, bits=bits),
                                   group_size=group, bits=bits)


def rounded_cache(model, name: str | None, recent: int) -> list:
    """A prompt cache per layer holding rounded KV (but the newest `recent` positions
    as computed)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    if name is None:
        return [KVCache() for _ in model.layers]
    f = rounding(name)

    class Rounded(KVCache):
        def __init__(self):
            super().__init__()
            self.exact = KVCache()

        def update_and_fetch(self, keys, values):
            k, v = super().update_and_fetch(f(keys), f(values))
            if not recent:
                return k, v
            ek, ev = self.exact.update_and_fetch(keys, values)
            cut = max(0, k.shape[2] - recent)
            return (mx.concatenate([k[:, :, :cut], ek[:, :, cut:]], axis=2),
                    mx.concatenate([v[:, :, :cut], ev[:, :, cut:]], axis=2))

    return [Rounded() for _ in model.layers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--recent", type=int, default=0,
                    help="the newest positions kept as computed (0: none)")
    args = ap.parse_args()
    rerun_with_worker_blas("bench.kv_rounding")

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxd.worker_proc.loading import load_model

    model, tokenizer = load_model(bench_model(args.model), True)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}."}],
        add_generation_prompt=True) for i in range(args.n)]

    def generate(prompt, name):
        cache = rounded_cache(model, name, args.recent)
        return [int(t) for t, _ in generate_step(mx.array(prompt), model,
                                                 max_tokens=args.tokens, prompt_cache=cache)]

    def forced(prompt, output, name):   # one forward: every position rounded
        logits = model(mx.array(prompt + output)[None], cache=rounded_cache(model, name, 0))
        logits = logits[0, len(prompt) - 1:-1].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    base = [generate(p, None) for p in prompts]
    reference = [forced(p, o, None) for p, o in zip(prompts, base)]
    print(f"{args.n} chats x {args.tokens} tokens; newest {args.recent} positions exact")
    for name in args.formats:
        firsts, agree, kls = [], 0, []
        for p, o, ref in zip(prompts, base, reference):
            firsts.append(first_divergence(generate(p, name), o))
            lp = forced(p, o, name)
            agree += mx.sum(mx.argmax(lp, -1) == mx.argmax(ref, -1)).item()
            kls.append(mx.mean(mx.sum(mx.exp(ref) * (ref - lp), -1)).item())
        print(f"{name}: first difference >= 64 on {sum(f >= 64 for f in firsts) / args.n:.0%}, "
              f"identical {sum(f >= args.tokens for f in firsts)}/{args.n}, median "
              f"{statistics.median(firsts)}; teacher-forced top-1 "
              f"{agree / (args.n * args.tokens):.4f}, mean KL {statistics.mean(kls):.2e}",
              flush=True)


if __name__ == "__main__":
    main()
