"""The Codex CLI and Claude Code against mlxd, one short turn each, run by hand.

    python -m bench.agent_clients                      # the default model (8k context)
    python -m bench.agent_clients --model long         # a random-weight model, 64k context

Installs both clients from the npm registry into bench/results/agents (once), starts
mlxd, puts a recording proxy (bench/agent_proxy.py) in front of its HTTP API, runs
`codex exec` on the Responses API and `claude -p` on the Messages API, and prints
what each sent (endpoint, status, the body's fields, the prompt's size) and got (its
exit code, its last output lines). The whole recording goes to
bench/results/agent_clients.json. Both clients' first request is long (their system
prompts and tool lists): the default model's 8k context is too short for them, which
each client is told in its own API's words. The random-weight model has room, but
its reply is noise that runs to the client's `max_tokens` (Claude Code asks 32000), so
a turn there takes as long as the time limit allows.
"""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.agent_proxy import start as start_proxy
from bench.common import ROOT, MlxdServer, bench_model
from mlxd.model_store.tiny import TinySpec, build_tiny_model, default_cache_dir

AGENTS = ROOT / "bench" / "results" / "agents"
PACKAGES = ("@openai/codex", "@anthropic-ai/claude-code")
PROMPT = "What is the capital of France? Answer in one word."
# a small random-weight model whose context holds an agent's first request
LONG_CONTEXT = TinySpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=256, vocab_size=2048,
                        max_position_embeddings=65536, seed=5)


def install_clients() -> Path:
    """The clients' executables folder (npm install into AGENTS the first time)."""
    bin_dir = AGENTS / "node_modules" / ".bin"
    if not all((bin_dir / name).exists() for name in ("codex", "claude")):
        AGENTS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-fund", "--no-audit", *PACKAGES], cwd=AGENTS,
                       check=True, timeout=600)
    return bin_dir


def codex_turn(bin_dir: Path, base_url: str, model: str, home: Path) -> subprocess.CompletedProcess:
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "mlxd"\n\n[model_providers.mlxd]\n'
        f'name = "mlxd"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\n'
        'env_key = "MLXD_KEY"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "MLXD_KEY": "none"}
    return _run([str(bin_dir / "codex"), "exec", "--skip-git-repo-check", PROMPT], env, home)


def claude_turn(bin_dir: Path, base_url: str, model: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": base_url,
           "ANTHROPIC_API_KEY": "none", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return _run([str(bin_dir / "claude"), "-p", PROMPT, "--model", model], env, home)


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(argv, 124, _text(exc.stdout), _text(exc.stderr))


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def summary(exchange: dict) -> str:
    body = exchange["request"]
    line = f"  {exchange['method']} {exchange['path']} -> {exchange['status'] or 'no answer'}"
    if isinstance(body, dict):
        tools = body.get("tools") or []
        line += (f"  fields: {', '.join(sorted(body))}; {len(tools)} tools"
                 f" ({', '.join(sorted({str(t.get('type')) for t in tools}))});"
                 f" {len(json.dumps(body))} bytes")
    reply = exchange["reply"]
    if (exchange["status"] or 0) >= 400:
        line += f"\n    error: {str(reply)[:300]}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2",
                    help="a model folder, smollm2 (the default model), or long (a 64k-context "
                         "random-weight model)")
    ap.add_argument("--clients", default="codex,claude")
    args = ap.parse_args()
    model = bench_model(args.model) if args.model != "long" else str(
        build_tiny_model(default_cache_dir() / "bench-agents-64k", LONG_CONTEXT))
    bin_dir = install_clients()
    server = MlxdServer(model)
    proxy, recording = start_proxy(server.http_url)
    base_url = f"http://127.0.0.1:{proxy.server_address[1]}"
    name = Path(model).name
    results = {}
    try:
        for client in args.clients.split(","):
            start = len(recording.exchanges)
            with tempfile.TemporaryDirectory(prefix=f"mlxd-{client}-") as home:
                turn = {"codex": codex_turn, "claude": claude_turn}[client]
                done = turn(bin_dir, base_url, name, Path(home))
            exchanges = recording.exchanges[start:]
            results[client] = {"returncode": done.returncode, "stdout": done.stdout,
                               "stderr": done.stderr[-4000:], "exchanges": exchanges}
            print(f"{client}: exit {done.returncode}, {len(exchanges)} requests")
            for exchange in exchanges:
                print(summary(exchange))
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            print("  last output:", *tail[-4:], sep="\n    ")
    finally:
        proxy.shutdown()
        server.stop()
    out = ROOT / "bench" / "results" / "agent_clients.json"
    out.write_text(json.dumps({"model": name, "clients": results}, indent=1))
    print(f"recorded: {out}")


if __name__ == "__main__":
    main()
