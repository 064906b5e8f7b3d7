"""mlxd: a multi-process LLM server on MLX, and its client SDK.

    from mlxd import Client, AsyncClient

Everything mlxd installs lives in this one package: the SDK (`mlxd.client`), the
processes (`mlxd.tokenizer_proc`, `mlxd.scheduler_proc`, `mlxd.worker_proc`), the
wire (`mlxd.protocol`), shared plumbing (`mlxd.runtime`), models
(`mlxd.model_store`) and the launcher (`mlxd.launcher`, the `mlxd` command).
In the source tree those folders sit beside this one, and `mlxd/<part>` is a
symbolic link to each (see docs/design/packaging.md), so an import path
is a file path for Python, an install and every static tool alike.
"""

from mlxd.client import AsyncClient, AsyncStream, Chunk, Client, MlxdError, Result, Stream

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "MlxdError", "Result", "Stream"]
