"""Several models behind one front end, on real processes: two tiny models with
different vocabularies, each exact against mlx_lm by its name (OpenAI, Anthropic, the
SDK) and by alias; an unknown name is a 404 naming the served ones; `/v1/models` has
each model's state. Under a memory budget that holds one model: load on demand with
the least recently used model unloaded first (its running request finishing first),
requests arriving during a load, idle unload, the admin endpoints behind the API key,
and a load slower than the request's wait (503 with Retry-After). Loads that fail:
test_model_load_failures.py."""

import asyncio
import json
import time

import httpx
import pytest

from mlxd import AsyncClient, Client, MlxdError
from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import Server, load_reference, reference_tokens, wait_until

SMALL = TinySpec(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, vocab_size=384, seed=5)
# a llama of a 32k context: a request of it can run for a minute, so it is still
# running when an unload comes (at 2k the tiny model could finish it first)
LONG_CONTEXT = TinySpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, vocab_size=512, seed=0,
                        max_position_embeddings=32768)
MAX_TOKENS = 12
KEY = "sekrit"


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "small", SMALL))


def models_file(tmp_path, entries: list[dict]) -> str:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(entries))
    return str(path)


def serve(tmp_path, entries: list[dict], *args: str) -> Server:
    return Server(None, "--models", models_file(tmp_path, entries), "--kv-capacity", "2048",
                  "--speculative", "off", "--log-level", "warning", *args)


def prompt_ids(model: str, text: str) -> list[int]:
    return load_reference(model)[1].encode(text)


def assert_exact(model: str, ids: list[int], token_ids, logprobs, max_tokens=MAX_TOKENS):
    ref = reference_tokens(model, ids, max_tokens)
    assert list(token_ids) == [t for t, _ in ref]
    assert max(abs(a - b) for a, (_, b) in zip(logprobs, ref)) < 1e-3


def states(server: Server) -> dict[str, str]:
    data = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["state"] for card in data}


def openai_exact(server: Server, name: str, model: str, text: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=KEY, max_retries=0)
    ids = prompt_ids(model, text)
    reply = client.completions.create(model=name, prompt=ids, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=1, timeout=120)
    tokenizer = load_reference(model)[1]
    ref = reference_tokens(model, ids, MAX_TOKENS)
    assert reply.choices[0].text == tokenizer.decode([t for t, _ in ref],
                                                     skip_special_tokens=True)
    got = reply.choices[0].logprobs.token_logprobs
    assert max(abs(a - b) for a, (_, b) in zip(got, ref)) < 1e-3
    assert reply.model == client.models.retrieve(name).id


@pytest.fixture(scope="module")
def two(tmp_path_factory, llama_model, small_model):
    server = serve(tmp_path_factory.mktemp("two"), [
        {"name": "llama", "model": llama_model, "aliases": ["gpt-4o-mini"]},
        {"name": "small", "model": small_model}], "--api-key", KEY)
    yield server
    server.stop()


def test_each_model_answers_by_its_name_exactly_as_mlx_lm(two, llama_model, small_model):
    assert httpx.get(f"{two.http_url}/v1/models", timeout=30).status_code == 401
    listing = httpx.get(f"{two.http_url}/v1/models", timeout=30,
                        headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(c["id"], c["state"], c["aliases"]) for c in listing] == [
        ("llama", "loaded", ["gpt-4o-mini"]), ("small", "loaded", [])]
    for name, model in (("llama", llama_model), ("small", small_model),
                        ("gpt-4o-mini", llama_model)):
        openai_exact(two, name, model, "The quick brown fox jumps over")


def test_the_sdk_picks_the_model_per_request_and_per_client(two, llama_model, small_model):
    async def run():
        async with AsyncClient(two.address, api_key=KEY, timeout=120) as c:
            jobs = [c.generate(input_ids=prompt_ids(m, f"water and people {i}"),
                               max_tokens=MAX_TOKENS, logprobs=True, model=name)
                    for i in range(3) for name, m in (("llama", llama_model),
                                                      ("small", small_model))]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, result in enumerate(results):
        model = (llama_model, small_model)[i % 2]
        assert_exact(model, prompt_ids(model, f"water and people {i // 2}"),
                     result.token_ids, result.logprobs)
    with Client(two.address, api_key=KEY, model="small", timeout=120) as c:
        ids = prompt_ids(small_model, "a b c d")
        result = c.generate(input_ids=ids, max_tokens=MAX_TOKENS, logprobs=True)
        assert_exact(small_model, ids, result.token_ids, result.logprobs)
        assert c.stats()["capacity"] == 2048 and c.stats("llama")["capacity"] == 2048
        with pytest.raises(MlxdError) as caught:
            c.generate("hi", model="gpt-5", max_tokens=2)
        assert caught.value.code == "model_not_found"
        assert "'llama', 'small'" in str(caught.value)
        # a token id only the bigger vocabulary has is refused by the small model
        with pytest.raises(MlxdError, match="token"):
            c.generate(input_ids=[500], max_tokens=2)


def test_anthropic_client_and_unknown_names(two, small_model):
    import anthropic
    import openai

    client = anthropic.Anthropic(base_url=two.http_url, api_key=KEY, max_retries=0)
    reply = client.messages.create(model="small", max_tokens=8,
                                   messages=[{"role": "user", "content": "hello"}])
    assert reply.model == "small" and reply.usage.output_tokens > 0
    assert [m.id for m in client.models.list().data] == ["llama", "small"]
    with pytest.raises(anthropic.NotFoundError, match="'llama', 'small'"):
        client.messages.create(model="claude-x", max_tokens=8,
                               messages=[{"role": "user", "content": "hello"}])
    oai = openai.OpenAI(base_url=f"{two.http_url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="gpt-5", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-5")


def test_metrics_are_labelled_by_model(two):
    text = httpx.get(f"{two.http_url}/metrics", timeout=30).text
    for name in ("llama", "small"):
        assert f'mlxd_model_kv_slots_capacity{{model="{name}"}} 2048.0' in text
        assert f'mlxd_model_state{{model="{name}",state="loaded"}} 1.0' in text
        assert f'mlxd_engines_up{{model="{name}"}} 1.0' in text
    assert "mlxd_kv_slots_capacity 4096.0" in text   # all models together


# ---- a budget that holds one model ---------------------------------------------------

@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory, llama_model, small_model):
    server = serve(tmp_path_factory.mktemp("budget"), [
        {"name": "llama", "model": llama_model, "memory_gb": 1.0},
        {"name": "small", "model": small_model, "memory_gb": 1.0}],
        "--models-memory", "1.5", "--api-key", KEY)
    yield server
    server.stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_load_on_demand_unloads_the_least_recently_used_model(one_at_a_time, llama_model,
                                                              small_model):
    server = one_at_a_time
    assert states_auth(server) == {"llama": "loaded", "small": "unloaded"}

    async def run():
        async with AsyncClient(server.address, api_key=KEY, timeout=120) as c:
            # a long request on llama is running when small is asked for, twice
            long = asyncio.ensure_future(c.generate(
                input_ids=prompt_ids(llama_model, "long"), max_tokens=800, ignore_eos=True,
                model="llama"))
            await asyncio.sleep(0.3)
            during = [c.generate(input_ids=prompt_ids(small_model, f"x {i}"),
                                 max_tokens=MAX_TOKENS, logprobs=True, model="small")
                      for i in range(2)]
            return await long, await asyncio.gather(*during)

    long, during = asyncio.run(run())
    assert long.finish_reason == "length" and len(long.token_ids) == 800   # finished first
    for i, result in enumerate(during):
        assert_exact(small_model, prompt_ids(small_model, f"x {i}"), result.token_ids,
                     result.logprobs)
    assert states_auth(server) == {"llama": "unloaded", "small": "loaded"}
    openai_exact(server, "llama", llama_model, "and back again")   # loads llama again
    assert states_auth(server) == {"llama": "loaded", "small": "unloaded"}
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    assert 'mlxd_model_unloads_total{model="llama",reason="memory"} 1.0' in text
    assert 'mlxd_model_loads_total{model="small"} 1.0' in text


def states_auth(server: Server) -> dict[str, str]:
    data = httpx.get(f"{server.http_url}/v1/models", headers=auth(), timeout=30).json()
    return {card["id"]: card["state"] for card in data["data"]}


def test_admin_endpoints_load_and_unload_behind_the_api_key(one_at_a_time, small_model):
    server = one_at_a_time
    url = server.http_url
    assert httpx.post(f"{url}/admin/models/load", json={"model": "small"},
                      timeout=30).status_code == 401
    r = httpx.post(f"{url}/admin/models/load", json={"model": "small"}, headers=auth(),
                   timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    assert states_auth(server) == {"llama": "unloaded", "small": "loaded"}
    r = httpx.post(f"{url}/admin/models/unload", json={"model": "small"}, headers=auth(),
                   timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    assert states_auth(server) == {"llama": "unloaded", "small": "unloaded"}
    with Client(server.address, api_key=KEY, timeout=30) as c:   # answered, loads nothing
        assert c.stats("small")["engines"] == {}
    assert states_auth(server) == {"llama": "unloaded", "small": "unloaded"}
    for body, status in (({"model": "nope"}, 404), ({"name": "small"}, 400), ([], 400)):
        r = httpx.post(f"{url}/admin/models/load", json=body, headers=auth(), timeout=30)
        assert r.status_code == status, r.text
    assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    openai_exact(server, "small", small_model, "after the admin")


def test_a_running_request_of_an_unloaded_model_ends_with_an_error_past_the_grace(
        tmp_path, small_model):
    long_model = str(build_tiny_model(tmp_path / "long", LONG_CONTEXT))
    server = serve(tmp_path, [{"name": "llama", "model": long_model},
                              {"name": "small", "model": small_model}],
                   "--unload-grace-seconds", "0", "--kv-capacity", "32768")
    try:
        with Client(server.address, timeout=120) as c:
            stream = c.stream(input_ids=prompt_ids(long_model, "long"), max_tokens=30000,
                              ignore_eos=True, model="llama")
            chunks = iter(stream)
            next(chunks)   # it runs
            r = httpx.post(f"{server.http_url}/admin/models/unload",
                           json={"model": "llama"}, timeout=60)
            assert r.json()["state"] == "unloaded"
            last = [chunk for chunk in chunks][-1]
            assert last.finish_reason == "error" and "was unloaded (admin)" in last.error
            ids = prompt_ids(small_model, "still here")
            result = c.generate(input_ids=ids, max_tokens=MAX_TOKENS, logprobs=True,
                                model="small")
            assert_exact(small_model, ids, result.token_ids, result.logprobs)
    finally:
        server.stop()


def test_idle_models_are_unloaded_and_come_back_on_their_next_request(
        tmp_path, llama_model, small_model):
    server = serve(tmp_path, [{"name": "llama", "model": llama_model, "pinned": True},
                              {"name": "small", "model": small_model}],
                   "--unload-idle-seconds", "1")
    try:
        assert wait_until(lambda: states(server)["small"] == "unloaded", 30)
        time.sleep(1.5)
        assert states(server)["llama"] == "loaded"   # pinned
        openai_exact(server, "small", small_model, "wake up")
        assert states(server)["small"] == "loaded"
    finally:
        server.stop()


def test_a_load_slower_than_the_wait_is_a_503_with_retry_after(tmp_path, llama_model,
                                                                small_model):
    server = serve(tmp_path, [{"name": "llama", "model": llama_model, "memory_gb": 1.0},
                              {"name": "small", "model": small_model, "memory_gb": 1.0}],
                   "--models-memory", "1", "--model-load-timeout", "0.2")
    try:
        r = httpx.post(f"{server.http_url}/v1/completions", timeout=60, json={
            "model": "small", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, r.text
        assert "not loaded yet" in r.json()["error"]["message"]
        with Client(server.address, timeout=60) as c:   # the SDK: the same, as an error
            with pytest.raises(MlxdError) as caught:
                c.generate("hi", model="small", max_tokens=2)
            assert caught.value.code == "unavailable"
        assert wait_until(lambda: states(server)["small"] == "loaded", 60)
        openai_exact(server, "small", small_model, "now it is here")
    finally:
        server.stop()


def test_several_model_flags_serve_each_folder_by_its_name(llama_model, small_model):
    server = Server(llama_model, "--model", small_model, "--kv-capacity", "2048",
                    "--log-level", "warning")
    try:
        assert states(server) == {"llama": "loaded", "small": "loaded"}
        openai_exact(server, "small", small_model, "by folder name")
        openai_exact(server, "llama", llama_model, "by folder name")
    finally:
        server.stop()


@pytest.mark.parametrize("args,says", [
    (["--models", "m.json"], "give either --models FILE or --model"),
    (["--served-model-name", "x"], "--served-model-name names one model"),
    (["--models-memory", "0.5", "--mem-limit-gb", "4"], "needs more than --models-memory"),
])
def test_model_lists_that_cannot_be_served_are_refused_at_start(llama_model, small_model,
                                                                tmp_path, args, says):
    import subprocess
    import sys

    from support import ROOT

    (tmp_path / "m.json").write_text(json.dumps([{"model": small_model}]))
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", llama_model,
                           "--model", small_model, "--port", "0", "--http-port", "0", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and says in done.stderr, done.stderr[-2000:]


def test_an_engine_on_another_machine_serves_a_model_by_its_name(tmp_path, llama_model,
                                                                 small_model):
    import subprocess
    import sys

    from mlxd.launcher import ENGINE_PREFIX
    from support import ROOT

    key = tmp_path / "front.key"
    subprocess.run([sys.executable, "-m", "mlxd.runtime.keys", str(key)], check=True,
                   cwd=ROOT, capture_output=True)
    front = serve(tmp_path, [{"name": "llama", "model": llama_model, "memory_gb": 1.0},
                             {"name": "small", "model": small_model, "memory_gb": 1.0}],
                  "--models-memory", "1", "--engine-port", "0",
                  "--curve-secret-key", str(key), "--log-level", "info")
    engines = []

    def engine(name: str, model_name: str) -> Server:
        engines.append(Server(small_model, "--join", front.addresses[ENGINE_PREFIX],
                              "--engine-name", name, "--served-model-name", model_name,
                              "--curve-secret-key", str(key), "--kv-capacity", "2048",
                              command=[sys.executable, str(ROOT / "launch.py"), "engine"]))
        return engines[-1]

    try:
        assert states(front) == {"llama": "loaded", "small": "unloaded"}
        engine("far", "small")
        assert wait_until(lambda: states(front)["small"] == "loaded", 30)
        assert states(front)["llama"] == "loaded"   # nothing was unloaded for it
        with Client(front.address, model="small", timeout=60) as c:
            ids = prompt_ids(small_model, "from afar")
            result = c.generate(input_ids=ids, max_tokens=MAX_TOKENS, logprobs=True)
            assert sorted(c.stats()["engines"]) == ["far"]
        assert_exact(small_model, ids, result.token_ids, result.logprobs)
        engine("stranger", "mistral")
        assert wait_until(lambda: any("refused engine stranger: it serves the model "
                                      "'mistral'" in line for line in front.stderr_lines), 30)
    finally:
        for e in engines:
            e.stop()
        front.stop()
