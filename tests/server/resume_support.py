"""A mixed workload streamed through the SDK and the `openai` client, run once
undisturbed and once while a process of the server is killed or stopped: every
request must complete as it did undisturbed (tests/server/test_resume.py)."""

import asyncio
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from mlxd.client import AsyncClient
from structured_support import response_formats
from support import Server, assert_same_stream, children_of

MAX_TOKENS = 2048   # long enough to be running when the disturbance comes
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
    tokens: list               # ids through the SDK, token texts through the openai client
    text: str
    logprobs: list[float]
    error: str | None = None
    resumes: int = 0           # as its usage says (the SDK's)


class Started:
    """Set once each of the jobs `indices` names has had its first chunk."""

    def __init__(self, indices: set[int]):
        self.left, self.event = indices, threading.Event()

    def first_chunk(self, index: int) -> None:
        self.left.discard(index)
        if not self.left:
            self.event.set()


async def _sdk(client: AsyncClient, job: Job, started: Started) -> Outcome:
    tokens, logprobs, text, last = [], [], "", None
    async for chunk in client.stream(input_ids=job.ids, max_tokens=MAX_TOKENS,
                                     logprobs=True, **job.params):
        started.first_chunk(job.index)
        tokens += chunk.token_ids
        logprobs += chunk.logprobs or []
        text += chunk.text
        last = chunk
    return Outcome(last.finish_reason, tokens, text, logprobs, last.error,
                   (last.usage or {}).get("resumes", 0))


async def _openai(client: openai.AsyncOpenAI, model: str, job: Job) -> Outcome:
    params = dict(job.params)
    extra = {k: params.pop(k) for k in ("ignore_eos", "repetition_penalty", "min_tokens")
             if k in params}
    stream = await client.completions.create(
        model=model, prompt=job.ids, max_tokens=MAX_TOKENS, stream=True, logprobs=0,
        extra_body=extra, **params)
    text, reason, tokens, logprobs = "", None, [], []
    async for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is not None:
            text += choice.text
            reason = choice.finish_reason or reason
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    return Outcome(reason, tokens, text, logprobs)


async def _run(server: Server, disturb=None) -> list[Outcome]:
    jobs = workload()
    started = Started({job.index for job in jobs if job.via == "sdk"})
    http = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none",
                              max_retries=0, timeout=180)
    async with AsyncClient(server.address, timeout=180) as sdk:
        model = (await http.models.list()).data[0].id
        tasks = [asyncio.ensure_future(_sdk(sdk, job, started) if job.via == "sdk" else
                                       _openai(http, model, job))
                 for job in jobs]
        if disturb is not None:   # in a thread: this loop is busy reading 12 streams
            tasks.append(asyncio.ensure_future(asyncio.to_thread(disturb, started.event)))
        results = (await asyncio.gather(*tasks))[:len(jobs)]
    await http.close()
    return results


def resumed(outcomes: list[Outcome]) -> int:
    """How many of the SDK's requests were resumed."""
    return sum(1 for o in outcomes if o.resumes)


def run_workload(server: Server, disturb=None) -> list[Outcome]:
    """The workload's outcomes; `disturb(started)` runs beside it, in a thread
    (`started` is set once each of the SDK's streams has had its first chunk)."""
    return asyncio.run(_run(server, disturb))


def assert_same(disturbed: list[Outcome], undisturbed: list[Outcome]) -> None:
    """Every request completed, with the tokens and logprobs of its undisturbed run
    (up to a tie; assert_same_stream)."""
    for job, got, want in zip(workload(), disturbed, undisturbed):
        assert got.finish_reason in ("stop", "length"), (job, got)
        if assert_same_stream(got.tokens, got.logprobs, want.tokens, want.logprobs, job):
            assert got.finish_reason == want.finish_reason, job
            assert got.text == want.text, job


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


# The engines run ahead of what the front end has passed on (a tiny model on two
# cores outpaces it with 12 streams): the disturbance is timed from the first chunk
# of the SDK's last stream to start, when the front end holds tokens of every request
# on both engines (a lost engine's requests are then resumed, not run again) and the
# engines are a few hundred of their 2048 tokens in.
DISTURB_AFTER_S = 0.2


def killer(pid_fn, sig=signal.SIGKILL, engine: str | None = None):
    """A disturbance: DISTURB_AFTER_S after each SDK stream's first chunk (`engine`:
    the one disturbed), `sig` to the process `pid_fn()` names at that moment (kept in
    `.killed`)."""
    killed = []

    def disturb(started: threading.Event):
        assert started.wait(60), "a stream never started"
        time.sleep(DISTURB_AFTER_S)
        pid = pid_fn()
        killed.append(pid)
        os.kill(pid, sig)
    disturb.killed = killed
    disturb.engine = engine
    return disturb
