"""The systems of bench/serving/: their server processes, their clients, and
their own tokenizer code (to check that both see the same prompt tokens).

mlxd is driven through its async SDK (`mlxd`) or its OpenAI-compatible HTTP API
(`mlxd_http`, the same client as mlx_lm.server's with `ignore_eos`); mlx_lm.server
through its OpenAI-style HTTP endpoints with `"stream": true` (SSE lines
`data: {json}`, comment lines `: keepalive n/m` while a prompt is processed, then
`data: [DONE]`).

mlx_lm.server has no `ignore_eos`: every EOS id of the model (as mlx_lm loads
them: config.json / generation_config.json plus the tokenizer's) gets a logit
bias of -1e9, so it is never sampled and the request runs to `max_tokens`.
"""

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from bench.common import MlxdServer, blas_env

EOS_BIAS = -1e9
CONNECT_RETRIES = 8
SYSTEMS = ("mlxd", "mlx_lm", "mlxd_http", "mlxd_padded", "mlxd_kv8")
# mlxd_padded: mlxd through its SDK with `--decode-layout padded` (the decode layout
# the paged one replaced), for the before/after comparison in one run


@dataclass
class Piece:
    """Streamed output. `tokens`: how many tokens it carries, None if the server
    does not say (mlx_lm.server sends text only)."""

    text: str
    tokens: int | None


@dataclass
class Final:
    finish_reason: str | None
    prompt_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    error: str | None = None
    retries: int = 0          # connection attempts that failed before the server read it


# ---- the servers' own tokenizer code -------------------------------------------


class PromptCodecs:
    """Each server's prompt encoding, run here: mlxd's TextCodec (transformers)
    and the TokenizerWrapper mlx_lm.server loads, with its EOS ids."""

    def __init__(self, model: str):
        from mlx_lm.utils import load_config, load_tokenizer

        from mlxd.tokenizer_proc.text import TextCodec

        self.mlxd = TextCodec(model)
        config = load_config(Path(model))
        self.mlx_lm = load_tokenizer(Path(model), eos_token_ids=config.get("eos_token_id"))
        self.mlx_lm_eos_ids = sorted(self.mlx_lm.eos_token_ids)

    @property
    def has_chat_template(self) -> bool:
        return self.mlxd.has_chat_template and self.mlx_lm.has_chat_template

    def text_ids(self, prompt: str) -> dict[str, list[int]]:
        ids = self.mlxd.encode_prompt(prompt)
        return {"mlxd": ids, "mlxd_http": ids, "mlxd_padded": ids, "mlxd_kv8": ids,
                "mlx_lm": self.mlx_lm.encode(prompt)}

    def chat_ids(self, messages: list[dict]) -> dict[str, list[int]]:
        # as mlx_lm.server's _tokenize does for a chat request without tools
        theirs = self.mlx_lm.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tools=None, tokenize=True)
        ids = self.mlxd.encode_chat(messages)
        return {"mlxd": ids, "mlxd_http": ids, "mlxd_padded": ids, "mlxd_kv8": ids,
                "mlx_lm": list(theirs)}


# ---- clients --------------------------------------------------------------------


class MlxdDriver:
    name = "mlxd"

    def __init__(self, address: str, timeout: float):
        from mlxd.client import AsyncClient

        self.client = AsyncClient(address, timeout=timeout)

    async def stream(self, *, prompt: str | None = None, messages: list[dict] | None = None,
                     max_tokens: int):
        """Pieces, then one Final."""
        # special tokens' text kept, as mlx_lm.server streams it: a conversation then
        # carries the same answer text on every system
        stream = self.client.stream(prompt=prompt, messages=messages, max_tokens=max_tokens,
                                    ignore_eos=True, temperature=0.0, skip_special_tokens=False)
        finished = False
        try:
            async for chunk in stream:
                if chunk.text or chunk.token_ids:
                    yield Piece(chunk.text, len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    finished = True
                    usage = chunk.usage or {}
                    yield Final(chunk.finish_reason, usage.get("prompt_tokens"),
                                usage.get("completion_tokens"), usage.get("cached_tokens"),
                                chunk.error)
        finally:
            if not finished:   # timed out or cancelled: free the server's slot
                await self.client.abort(stream.rid)

    async def close(self) -> None:
        await self.client.close()


def http_client():
    """The HTTP client module. httpx2 is the httpx API under another name (async
    streaming: AsyncClient.stream, Response.aiter_lines); huggingface_hub >= 2
    depends on it and hub 1.x on httpx, so one of the two comes with transformers."""
    try:
        import httpx2 as httpx   # async streaming; comes with transformers (huggingface_hub >= 2)
    except ImportError:
        import httpx             # the same API, for huggingface_hub 1.x
    return httpx


class MlxLmDriver:
    name = "mlx_lm"

    def __init__(self, base_url: str, timeout: float, eos_ids: list[int]):
        httpx = http_client()
        self.http = httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(timeout), trust_env=False,
            # no client-side queueing: every request gets its own connection at once
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        self.logit_bias = {str(i): EOS_BIAS for i in eos_ids}
        # failures before any response byte: the server never saw the request
        self.connection_errors = (httpx.ConnectError, httpx.ReadError, httpx.WriteError,
                                  httpx.RemoteProtocolError)

    def _body(self, prompt, messages, max_tokens) -> tuple[str, dict]:
        path, body = (("/v1/chat/completions", {"messages": messages}) if messages is not None
                      else ("/v1/completions", {"prompt": prompt}))
        body.update(max_tokens=max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True}, logit_bias=self.logit_bias)
        return path, body

    async def _open(self, path: str, body: dict):
        """The response (headers read), and how many times the connection was
        retried. mlx_lm.server listens with socketserver's backlog of 5: when more
        connections arrive at once, the kernel drops or resets the overflow (on
        Linux with SYN cookies the client sees a reset about 1 s later) before
        the server has read the request. Those are retried, as a client would;
        the time lost counts in the request's TTFT."""
        for attempt in range(CONNECT_RETRIES + 1):
            try:
                request = self.http.build_request("POST", path, json=body)
                return await self.http.send(request, stream=True), attempt
            except self.connection_errors:
                if attempt == CONNECT_RETRIES:
                    raise
                await asyncio.sleep(0.05 * 2 ** attempt)

    async def stream(self, *, prompt: str | None = None, messages: list[dict] | None = None,
                     max_tokens: int):
        """Pieces, then one Final."""
        response, retries = await self._open(*self._body(prompt, messages, max_tokens))
        try:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            finish, usage, done = None, {}, False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue       # blank separators and ": keepalive" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        yield Piece(text, None)
                    finish = choice.get("finish_reason") or finish
        finally:
            await response.aclose()
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        yield Final(finish, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                    retries=retries)

    async def close(self) -> None:
        await self.http.aclose()


class MlxdHttpDriver(MlxLmDriver):
    """mlxd's HTTP API, driven like mlx_lm.server's; output lengths by `ignore_eos`."""

    name = "mlxd_http"

    def __init__(self, base_url: str, timeout: float, model_name: str):
        super().__init__(base_url, timeout, [])
        self.model_name = model_name

    def _body(self, prompt, messages, max_tokens) -> tuple[str, dict]:
        path, body = super()._body(prompt, messages, max_tokens)
        del body["logit_bias"]
        # text as mlx_lm.server streams it: special tokens spelled out, so that a
        # reply of special tokens still arrives as text chunks
        body.update(model=self.model_name, ignore_eos=True, skip_special_tokens=False)
        return path, body


# ---- server processes -----------------------------------------------------------


class MlxdProcess:
    """mlxd via bench/common.py's MlxdServer (launch.py --port 0)."""

    name = "mlxd"

    def __init__(self, model: str, flags: list[str]):
        self.server = MlxdServer(model, *flags)   # stops the launcher if interrupted
        self.address = self.server.address
        self.model_name = Path(model).name   # the HTTP API's default served name

    def alive(self) -> bool:
        return self.server.proc.poll() is None

    def driver(self, timeout: float) -> MlxdDriver:
        return MlxdDriver(self.address, timeout)

    def http_driver(self, timeout: float) -> MlxdHttpDriver:
        return MlxdHttpDriver(self.server.http_url, timeout, self.model_name)

    def stop(self) -> None:
        self.server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the bench dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG


class MlxLmProcess:
    """`python -m mlx_lm.server` on a free loopback port, with the worker's BLAS.
    Ready when GET /health answers 200; the model loads in its generation thread,
    so the first request (the bench's warm-up) waits for the load."""

    name = "mlx_lm"

    def __init__(self, model: str, flags: list[str], ready_timeout: float = 300.0):
        self.port = _free_port()
        self.command = [sys.executable, "-m", "mlx_lm.server", "--model", model,
                        "--host", "127.0.0.1", "--port", str(self.port),
                        "--log-level", "WARNING", *flags]
        self.tail: deque[str] = deque(maxlen=30)
        self.proc = subprocess.Popen(
            self.command, env=blas_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _pump_stderr(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError("mlx_lm.server exited:\n" + "\n".join(self.tail))
            if self._healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"mlx_lm.server not ready after {timeout:g} s:\n" + "\n".join(self.tail))

    def _healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def driver(self, timeout: float, eos_ids: list[int]) -> MlxLmDriver:
        return MlxLmDriver(f"http://127.0.0.1:{self.port}", timeout, eos_ids)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def blas_note() -> str:
    return blas_env().get("LD_PRELOAD") or "none found (MLX's reference BLAS)"
