"""The HTTP front end in the tokenizer process: uvicorn serving the FastAPI app on
the tokenizer's own event loop, beside the ZeroMQ front end and through the same
core; no extra process, no extra hop per token.

The listening socket is bound here (so `--http-port 0` can report the port it got),
and uvicorn is kept off the process's signals: the tokenizer's own handlers stop it."""

import asyncio
import contextlib
import logging
import socket

import uvicorn

from .app import build_app
from .calls import Front
from .context import Api, Directory

log = logging.getLogger("mlxd.http")
STOP_SECONDS = 2.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):   # the tokenizer's handlers stay in place
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HttpFrontEnd:
    """`start()` binds and serves; `url` is then the bound address; `stop()` ends it."""

    def __init__(self, front: Front, host: str, port: int, model_name: str, api_key: str,
                 access_log: bool = True, directory: Directory | None = None):
        """`front` and `model_name`: the first model's; `directory`: all served models."""
        self.api = Api(front, model_name, api_key, directory=directory)
        self.access_log = access_log
        self.host, self.port = host or "127.0.0.1", port
        self.url: str | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        sock = bind(self.host, self.port)
        self.url = url_of(sock)
        # uvicorn's own access log stays off: ours (access_log.py) knows the model and tokens
        config = uvicorn.Config(build_app(self.api, self.access_log), log_config=None,
                                access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        log.info("HTTP API on %s (model %r)", self.url, self.api.model_name)
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, STOP_SECONDS)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()
