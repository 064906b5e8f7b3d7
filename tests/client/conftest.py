import pytest

from support import Server


@pytest.fixture(scope="module")
def server(llama_model):
    server = Server(llama_model, "--kv-capacity", "16384", "--log-level", "warning")
    yield server
    server.stop()
