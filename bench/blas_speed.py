"""Single-stream decode rate of a model in-process under whichever BLAS is preloaded:
run it once per library to compare them (what the README's BLAS table shows).

    python -m bench.blas_speed MODEL_DIR
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m bench.blas_speed MODEL_DIR
    LD_PRELOAD=$(python -c "import sys; print(sys.prefix)")/lib/libmkl_rt.so.3 python -m bench.blas_speed MODEL_DIR
"""

import sys, time
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlxd.worker_proc.loading import load_model
path = sys.argv[1]   # e.g. ~/.cache/mlxd/smollm2-135m-instruct-q4_1 (the default model)
model, tok = load_model(path, dequantize=True)
ids = mx.array(tok.encode("What is the capital of France? Tell me about its history."))
steps = generate_step(ids, model, max_tokens=72)
for _ in range(8): next(steps)     # prefill and warm-up
t = time.perf_counter(); n = 0
for _ in steps: n += 1
print(f"{n / (time.perf_counter() - t):.1f} tok/s decode")
