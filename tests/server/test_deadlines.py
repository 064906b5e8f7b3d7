"""Server-side deadlines: a request's own `timeout`, and the server's
`--request-timeout`, end it with finish_reason "error" and a "timeout" error, free its
KV, and leave other requests alone."""

import pytest

from mlxd import Client
from support import Server, wait_until


@pytest.fixture(scope="module")
def server(llama_model):
    # A long request must outlive the server's timeout: one token a step (no drafts,
    # which this model's looping output accepts up to 9 a step) takes it well past
    # 2 s before it reaches the model's 2048-token context.
    srv = Server(llama_model, "--kv-capacity", "16384", "--request-timeout", "2",
                 "--speculative", "off", "--log-level", "warning")
    yield srv
    srv.stop()


def test_a_requests_own_timeout(server):
    with Client(server.address, timeout=60) as c:
        r = c.generate("Once upon a time", max_tokens=100000, ignore_eos=True, timeout=0.5)
        assert r.finish_reason == "error" and r.error.startswith("timeout"), r
        assert r.usage["completion_tokens"] == len(r.token_ids) > 0
        assert wait_until(lambda: c.stats()["running"] == 0, 5)
        assert c.stats()["used_slots"] == 0


def test_the_servers_timeout_applies_to_every_request(server):
    with Client(server.address, timeout=60) as c:
        stream = c.stream("Once upon a time", max_tokens=100000, ignore_eos=True)
        chunks = list(stream)
        assert chunks[-1].finish_reason == "error" and chunks[-1].error.startswith("timeout")
        short = c.generate("Hello", max_tokens=4, timeout=30)   # finishes in time
        assert short.finish_reason == "length"
