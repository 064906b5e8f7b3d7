import os
import tempfile

import pytest

from mlxd.model_store.tiny import TinySpec, build_tiny_model
from support import Server

# Servers the tests start publish their CURVE keys here, not in the user's own
# runtime folder (runtime/keys.py); the servers inherit it from this process.
os.environ["MLXD_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="mlxd-test-run-")

LLAMA = TinySpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=512, seed=0)
QWEN3 = TinySpec(arch="qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=256, vocab_size=512, seed=1)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "llama", LLAMA))


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3", QWEN3))


@pytest.fixture(scope="module")
def llama_server(llama_model):
    server = Server(llama_model, "--kv-capacity", "16384", "--log-level", "warning")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory):
    """arch -> the folder of a tiny random-weight model of that mlx_lm architecture
    (model_store.tiny.HYBRID_EXTRA), built once per session."""
    from mlxd.model_store.tiny import hybrid_spec

    root = tmp_path_factory.mktemp("hybrid-models")
    return lambda arch: str(build_tiny_model(root / arch, hybrid_spec(arch)))
