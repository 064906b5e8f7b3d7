"""A mixed workload streamed through the SDK and the `openai` client, run once
undisturbed and once while a process of the server is killed or stopped: every
request must complete as it did undisturbed (tests/server/test_resume.py)."""

import asyncio
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import openai

from mlxd.client import AsyncClient
from structured_support import response_formats
from support import Server, children_of

MAX_TOKENS = 1024   # long enough to be running when the disturbance comes
VOCAB = 500


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


@dataclass
class Job:
    """One request of the workload: how it is sent, and with which parameters."""

    index: int
    via: str                 # "sdk" or "openai"
    params: dict

    @property
    def ids(self) -> list[int]:
        return random_ids(16, seed=300 + self.index)


def workload() -> list[Job]:
    """12 requests: greedy, seeded, JSON-schema constrained and penalised, through
    the SDK (8) and the openai client (4)."""
    greedy = dict(ignore_eos=True)
    seeded = dict(temperature=0.9, top_p=0.95, ignore_eos=True)
    penalised = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                     temperature=0.8, ignore_eos=True)
    constrained = dict(response_format=response_formats()["json_schema"], temperature=1.0)
    kinds = [("sdk", greedy), ("sdk", seeded), ("openai", greedy), ("sdk", constrained),
             ("sdk", penalised), ("openai", seeded), ("sdk", greedy), ("sdk", seeded),
             ("openai", penalised), ("sdk", constrained),
             ("sdk", dict(penalised, min_tokens=40, logit_bias={"11": 2.0})),
             ("openai", greedy)]
    return [Job(i, via, dict(params, seed=1000 + i)) for i, (via, params) in enumerate(kinds)]


@dataclass
class Outcome:
    finish_reason: str | None
    tokens: list[int] | None       # the SDK's (None through the openai client)
    text: str
    logprobs: list[float] | None
    error: str | None = None
    resumes: int = 0               # as its usage says (the SDK's)


async def _sdk(client: AsyncClient, job: Job, started: asyncio.Event) -> Outcome:
    tokens, logprobs, text, last = [], [], "", None
    async for chunk in client.stream(input_ids=job.ids, max_tokens=MAX_TOKENS,
                                     logprobs=True, **job.params):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs or []
        text += chunk.text
        last = chunk
        started.set()
    return Outcome(last.finish_reason, tokens, text, logprobs, last.error,
                   (last.usage or {}).get("resumes", 0))


async def _openai(client: openai.AsyncOpenAI, model: str, job: Job,
                  started: asyncio.Event) -> Outcome:
    params = dict(job.params)
    extra = {k: params.pop(k) for k in ("ignore_eos", "repetition_penalty", "min_tokens")
             if k in params}
    stream = await client.completions.create(
        model=model, prompt=job.ids, max_tokens=MAX_TOKENS, stream=True,
        extra_body=extra, **params)
    text, reason = "", None
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None:
            text += choice.text
            reason = choice.finish_reason or reason
            started.set()
    return Outcome(reason, None, text, None)


async def _run(server: Server, disturb=None) -> list[Outcome]:
    jobs = workload()
    started = [asyncio.Event() for _ in jobs]
    http = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none",
                              max_retries=0, timeout=180)
    async with AsyncClient(server.address, timeout=180) as sdk:
        model = (await http.models.list()).data[0].id
        tasks = [asyncio.ensure_future(_sdk(sdk, job, ev) if job.via == "sdk" else
                                       _openai(http, model, job, ev))
                 for job, ev in zip(jobs, started)]
        if disturb is not None:
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 120)
            disturb()
        results = await asyncio.gather(*tasks)
    await http.close()
    return results


def resumed(outcomes: list[Outcome]) -> int:
    """How many of the SDK's requests were resumed."""
    return sum(1 for o in outcomes if o.resumes)


def run_workload(server: Server, disturb=None) -> list[Outcome]:
    """The workload's outcomes; `disturb()` is called once every request streamed."""
    return asyncio.run(_run(server, disturb))


def assert_same(disturbed: list[Outcome], undisturbed: list[Outcome]) -> None:
    """Every request completed, with the tokens (text) of its undisturbed run."""
    for job, got, want in zip(workload(), disturbed, undisturbed):
        assert got.finish_reason in ("stop", "length"), (job, got)
        assert got.finish_reason == want.finish_reason, job
        assert got.text == want.text, job
        assert got.tokens == want.tokens, job
        if got.logprobs is not None:
            assert len(got.logprobs) == len(want.logprobs)
            assert max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs)),
                       default=0) < 1e-3, job


def pid_of(server: Server, module: str, *args: str) -> int:
    """A live child of the server running `module` with all of `args`."""
    for pid in children_of(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"mlxd.{module}".encode() in cmdline and all(a.encode() in cmdline for a in args):
            return pid
    raise LookupError((module, args))


def killer(pid_fn, sig=signal.SIGKILL):
    """A disturbance: `sig` to the process `pid_fn()` names at that moment."""
    killed = []

    def disturb():
        pid = pid_fn()
        killed.append(pid)
        os.kill(pid, sig)
    disturb.killed = killed
    return disturb
