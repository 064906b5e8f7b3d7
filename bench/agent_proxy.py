"""A recording HTTP proxy for bench/agent_clients.py: forwards every request to the
server unchanged and keeps what each side sent (bodies as JSON where they parse;
streamed replies whole), so a run of an agent client can be recorded."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
       "accept-encoding"}


class Recording:
    def __init__(self):
        self.exchanges: list[dict] = []
        self._lock = threading.Lock()

    def add(self, exchange: dict) -> None:
        with self._lock:
            self.exchanges.append(exchange)


def _parsed(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def handler_for(upstream: str, recording: Recording):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                parts = []
                while (size := int(self.rfile.readline().split(b";")[0], 16)):
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(parts)
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def _forward(self):
            body = self._body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            exchange = {"method": self.command, "path": self.path, "request": _parsed(body),
                        "status": None, "reply": None}   # recorded before it is answered
            recording.add(exchange)
            with httpx.Client(timeout=600) as client:
                with client.stream(self.command, upstream + self.path, content=body,
                                   headers=headers) as reply:
                    self.send_response(reply.status_code)
                    for k, v in reply.headers.items():
                        if k.lower() not in HOP:
                            self.send_header(k, v)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    received = b""
                    for piece in reply.iter_raw():
                        received += piece
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
            exchange.update(status=reply.status_code, reply=_parsed(received))

        do_GET = do_POST = do_DELETE = _forward

    return Handler


def start(upstream: str, port: int = 0) -> tuple[ThreadingHTTPServer, Recording]:
    """A proxy to `upstream` (http://host:port) on 127.0.0.1:port, in a thread."""
    recording = Recording()
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(upstream, recording))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, recording
