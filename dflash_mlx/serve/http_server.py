"""The HTTP server: the API app (`http_app`) on uvicorn, over a socket bound when the server is made.

The socket is bound up front, so port 0 picks a free port and `server_address` names it before
serving starts. uvicorn runs on a thread of its own (`serve_forever` waits for it): off the main
thread it installs no signal handlers, so Ctrl-C reaches the caller as KeyboardInterrupt.
"""

import json
import logging
import socket
import threading
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_app import READ_TIMEOUT_S, Settings, create_app
from .metrics import registry
from .api_errors import APIError
from .worker import Engine

BACKLOG = 128  # connections waiting to be accepted: bursts of clients
SHUTDOWN_GRACE_S = 5  # how long `shutdown` lets answers in flight finish before it cancels them


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 (h11), whose answer to a request it cannot parse (a Content-Length that is
    not a number, a malformed header) is a JSON error, as every other refusal is."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, "The request is not valid HTTP/1.1: check its request line and headers "
                                        "(a Content-Length must be a non-negative integer).").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: a free port); OSError if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


class HTTPServer:
    """Serves `app` on a listening socket once `serve_forever` is called."""

    def __init__(self, sock: socket.socket, app, engine: Engine, settings: Settings):
        self.socket, self.engine, self.settings = sock, engine, settings
        self.server_address = sock.getsockname()[:2]
        config = uvicorn.Config(app, http=_Protocol, lifespan="off", log_config=None, log_level="error",
                                access_log=False, backlog=BACKLOG, timeout_keep_alive=READ_TIMEOUT_S,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        self.uvicorn = uvicorn.Server(config)
        self._serving: Optional[threading.Thread] = None
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serve until `shutdown` (or, on the main thread, until Ctrl-C)."""
        self._serving = threading.Thread(target=self._serve, daemon=True, name="dflash-http")
        self._serving.start()
        self._stopped.wait()  # not Thread.join: one that Ctrl-C interrupts leaves the thread marked stopped

    def _serve(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving and wait until stopped: answers in flight get SHUTDOWN_GRACE_S to finish."""
        self.uvicorn.should_exit = True
        if self._serving is not None:
            self._stopped.wait()

    def server_close(self) -> None:
        """Stop at once, answers in flight cut short and their jobs cancelled (the process is about to leave)."""
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # each cut, a traceback otherwise
        self.uvicorn.should_exit = self.uvicorn.force_exit = True
        if self._serving is not None:
            self._stopped.wait()
        self.socket.close()


def make_server(pair, model_id: str, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
                block_size: Optional[int] = None, enable_thinking: Optional[bool] = None,
                max_prompt_tokens: int = 32768, default_temp: float = 0.0, max_tokens_limit: int = 32768,
                default_max_tokens: Optional[int] = None, prompt_cache_bytes: int = 4 << 30, prompt_cache_disk_bytes: int = 0,
                prompt_cache_dir: Optional[str] = None, channel=None) -> HTTPServer:
    """`max_prompt_tokens` and `max_tokens_limit` bound every request (over them: a 400);
    `default_max_tokens` is what a request that names no limit gets (None: up to the model's
    context); the prompt
    cache holds at most `prompt_cache_bytes` (0: none) in memory and
    `prompt_cache_disk_bytes` (0: none) on disk under `prompt_cache_dir`. With a
    `channel` (distributed.JobChannel), the other ranks mirror every request.
    OSError if `host`:`port` cannot be bound."""
    sock = listen(host, port)  # first: a busy port starts no engine
    engine = Engine(pair, model_id, block_size, enable_thinking, max_prompt_tokens, default_temp,
                    max_tokens_limit, default_max_tokens, prompt_cache_bytes, prompt_cache_disk_bytes,
                    prompt_cache_dir, channel)
    settings = Settings(engine, registry(engine), api_key)
    return HTTPServer(sock, create_app(settings), engine, settings)
