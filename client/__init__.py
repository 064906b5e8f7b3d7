"""The mlxd client SDK: `Client` (blocking, thread-safe) and `AsyncClient`."""

from .async_client import AsyncClient, AsyncStream
from .sync_client import Client, Stream
from .types import Chunk, MlxdError, Result, ToolCall

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "MlxdError", "Result", "Stream",
           "ToolCall"]
