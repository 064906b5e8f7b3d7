"""mlxd: a multi-process LLM server on MLX, and its client SDK.

    from mlxd import Client, AsyncClient

Everything mlxd installs lives in this one package: the SDK (`mlxd.client`), the
processes (`mlxd.tokenizer_proc`, `mlxd.scheduler_proc`, `mlxd.worker_proc`), the
wire (`mlxd.protocol`), shared plumbing (`mlxd.runtime`), models
(`mlxd.model_store`) and the launcher (`mlxd.launcher`, the `mlxd` command).
In the source tree those folders sit beside this one (see docs/ARCHITECTURE.md,
"Packaging"); an install maps them in here, and a checkout that was not
installed finds them through the line below.
"""

import os as _os

_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "launch.py")) and \
        _os.path.isdir(_os.path.join(_checkout, "worker_proc")):
    __path__.append(_checkout)

from mlxd.client import AsyncClient, AsyncStream, Chunk, Client, MlxdError, Result, Stream  # noqa: E402

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "MlxdError", "Result", "Stream"]
