"""An OpenAI-compatible HTTP server over DFlash.

Handler threads parse and validate requests; one worker thread owns the
model and runs jobs one at a time from a FIFO queue, so no two requests ever
share a cache, and all MLX work stays on one thread. A streaming client that
disconnects cancels its job; the worker stops at the next cycle.
"""

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

from .decode import stream_generate
from .errors import DFlashError
from .prompt import build_chat_prompt
from .sampling import SamplingParams

MAX_BODY = 4 * 1024 * 1024
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False),
    "top_logprobs": lambda v: v is not None,
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "logit_bias": lambda v: v not in (None, {}),
    "tools": lambda v: v not in (None, []),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v is not None,
}


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    prompt: List[int]
    max_tokens: int
    params: SamplingParams
    stop: List[str]
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    """Owns the pair; runs queued jobs one at a time on its own thread."""

    def __init__(self, pair, model_id: str, block_size: Optional[int] = None,
                 enable_thinking: Optional[bool] = None, max_prompt_tokens: int = 32768,
                 default_temp: float = 0.0):
        self.pair, self.model_id, self.block_size = pair, model_id, block_size
        self.default_temp = default_temp
        self.enable_thinking = enable_thinking
        self.max_prompt_tokens = max_prompt_tokens
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.stats = {"completed": 0, "cancelled": 0, "active": 0}
        self.thread = threading.Thread(target=self._run, daemon=True, name="dflash-engine")
        self.thread.start()

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self.stats["cancelled"] += 1
                continue
            self.stats["active"] = 1
            try:
                for event in stream_generate(self.pair, job.prompt, max_tokens=job.max_tokens,
                                             sampling=job.params, block_size=self.block_size, stop=job.stop):
                    job.events.put(event)
                    if job.cancelled.is_set():
                        break
                if job.cancelled.is_set():
                    self.stats["cancelled"] += 1
                else:
                    self.stats["completed"] += 1
            except DFlashError as e:
                job.events.put(APIError(400, str(e)))
            except Exception as e:  # keep serving whatever one request did
                job.events.put(APIError(500, f"generation failed: {e}", "server_error"))
            finally:
                self.stats["active"] = 0
                job.events.put(None)

    def close(self):
        self.jobs.put(None)


def _get(body, name, types, default=None, check=None, what=""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    if not isinstance(value, types) or (check is not None and not check(value)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    return value


def parse_request(engine: Engine, body: Any, chat: bool):
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != engine.model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{engine.model_id}'.",
                       param="model", code="model_not_found")
    for name, bad in UNSUPPORTED.items():
        if name in body and bad(body[name]):
            raise APIError(400, f"'{name}' is not supported by DFlash speculative decoding; remove it.",
                           param=name, code="unsupported_parameter")
    tok = engine.pair.tokenizer
    if chat:
        messages = _get(body, "messages", list, None, lambda v: len(v) > 0, "a non-empty list of messages")
        if messages is None:
            raise APIError(400, "'messages' is required.", param="messages")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise APIError(400, "Each message needs a string 'role' and a string 'content'.", param="messages")
        thinking = body.get("enable_thinking", (body.get("chat_template_kwargs") or {}).get("enable_thinking"))
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, "'enable_thinking' must be a boolean.", param="enable_thinking")
        if thinking is None:
            thinking = engine.enable_thinking
        if getattr(tok, "chat_template", None):
            prompt = build_chat_prompt(tok, messages, thinking)
        else:
            prompt = tok.encode("\n".join(m["content"] for m in messages))
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise APIError(400, "'prompt' must be a string.", param="prompt")
        prompt = tok.encode(text)
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="messages" if chat else "prompt")
    if len(prompt) > engine.max_prompt_tokens:
        raise APIError(400, f"The prompt has {len(prompt)} tokens; this server accepts at most "
                            f"{engine.max_prompt_tokens}.", code="context_length_exceeded")
    max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v >= 1, "a positive integer")
    max_tokens = _get(body, "max_tokens", int, max_tokens or 256, lambda v: v >= 1, "a positive integer")
    temp = _get(body, "temperature", (int, float), engine.default_temp, lambda v: 0 <= v <= 2,
                "a number in [0, 2]")
    top_p = _get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lambda v: v >= 0, "a non-negative integer")
    min_p = _get(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    seed = _get(body, "seed", int, None, None, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4):
        raise APIError(400, "'stop' must be a string or a list of up to 4 strings.", param="stop")
    stream = _get(body, "stream", bool, False, None, "a boolean")
    params = SamplingParams(temp=float(temp), top_p=float(top_p), top_k=top_k, min_p=float(min_p), seed=seed)
    return Job(prompt, max_tokens, params, stop), stream


class Handler(BaseHTTPRequestHandler):
    engine: Engine = None
    api_key: Optional[str] = None
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def _send_json(self, status: int, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorised(self) -> bool:
        if not self.api_key:
            return True
        if self.headers.get("Authorization", "") == f"Bearer {self.api_key}":
            return True
        self._send_json(401, APIError(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                                      "authentication_error", code="invalid_api_key").body())
        return False

    def do_GET(self):
        if self.path == "/health":
            return self._send_json(200, {"status": "ok", **self.engine.stats, "queued": self.engine.jobs.qsize()})
        if not self._authorised():
            return
        if self.path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [
                {"id": self.engine.model_id, "object": "model", "created": 0, "owned_by": "dflash-mlx"}]})
        self._send_json(404, APIError(404, f"No route {self.path}.", code="not_found").body())

    def do_POST(self):
        if not self._authorised():
            return
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self._send_json(404, APIError(404, f"No route {self.path}.", code="not_found").body())
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise APIError(413, f"The request body is over {MAX_BODY} bytes.")
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"The request body is not valid JSON: {e}.")
            job, stream = parse_request(self.engine, body, chat)
        except APIError as e:
            self.close_connection = True
            return self._send_json(e.status, e.body())
        except DFlashError as e:
            return self._send_json(400, APIError(400, str(e)).body())
        self.engine.submit(job)
        if stream:
            self._stream(job, chat)
        else:
            self._complete(job, chat)

    def _events(self, job):
        while True:
            event = job.events.get()
            if event is None:
                return
            yield event

    def _complete(self, job: Job, chat: bool):
        text, stats, finish = [], None, None
        for event in self._events(job):
            if isinstance(event, APIError):
                return self._send_json(event.status, event.body())
            text.append(event.text)
            stats, finish = event.stats, event.finish_reason
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                  if chat else {"index": 0, "text": content, "finish_reason": finish, "logprobs": None})
        self._send_json(200, {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.engine.model_id, "choices": [choice], "usage": _usage(stats),
        })

    def _stream(self, job: Job, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(delta_text, finish, first=False, usage=None):
            if chat:
                delta = {"content": delta_text} if delta_text or not first else {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                obj = {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": self.engine.model_id, "choices": [choice]}
            else:
                obj = {"id": rid, "object": "text_completion", "created": created, "model": self.engine.model_id,
                       "choices": [{"index": 0, "text": delta_text, "finish_reason": finish, "logprobs": None}]}
            if usage is not None:
                obj["usage"] = usage
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        try:
            if chat:
                chunk("", None, first=True)
            for event in self._events(job):
                if isinstance(event, APIError):
                    self.wfile.write(f"data: {json.dumps(event.body())}\n\n".encode())
                    break
                if event.text or event.finish_reason:
                    chunk(event.text, event.finish_reason,
                          usage=_usage(event.stats) if event.finish_reason else None)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            job.cancelled.set()
            for _ in self._events(job):  # drain until the engine lets go
                pass


def _usage(stats) -> Dict[str, Any]:
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "dflash": {"mean_acceptance_length": round(stats.mean_acceptance, 3), "cycles": stats.cycles,
                   "generation_tps": round(stats.generation_tps, 2)},
    }


def make_server(pair, model_id: str, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
                block_size: Optional[int] = None, enable_thinking: Optional[bool] = None,
                max_prompt_tokens: int = 32768, default_temp: float = 0.0) -> ThreadingHTTPServer:
    engine = Engine(pair, model_id, block_size, enable_thinking, max_prompt_tokens, default_temp)
    handler = type("DFlashHandler", (Handler,), {"engine": engine, "api_key": api_key})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.engine = engine
    return server
