"""Logging HTTP relay: record exactly what an agent client sends to a model server.

Point a client (Claude Code, Codex CLI, the OpenAI Agents SDK, ...) at the relay instead of the server. Each
request is forwarded to the upstream, the upstream's answer is streamed back unchanged (SSE chunk by chunk),
and the exchange is written to OUT/NN-<path>.json:

    {"method", "path", "query", "headers", "body", "status", "response_headers", "response"}

with secret headers (authorization, x-api-key, cookies, ...) replaced by "<redacted>", "body" parsed as JSON
when it is JSON, and "response" the raw text for an SSE stream, parsed JSON otherwise. A forwarded answer also
has "arrivals": for each chunk read from the upstream, [seconds since the request was sent, bytes received by
then], from which each event's arrival time follows.

    python benchmarks/agents/relay.py --listen 127.0.0.1:9000 --upstream http://127.0.0.1:8080 --out DIR

Answer mode (`--answer FILE` instead of `--upstream`) forwards nothing: the relay answers every request itself
from a script, so a client can be driven through a whole tool-using session before a real server can answer
it. It speaks Anthropic Messages (/v1/messages, streamed or not, and /v1/messages/count_tokens), the OpenAI
Responses API (/v1/responses) and chat completions (/v1/chat/completions), and lists one model at /v1/models.
The script (see answer_ls.json) is

    {"tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}}, ...], "final_text": "...", "text": "..."}

A request that offers one of the scripted tools and has no tool result in its history gets a call of the
first such tool; one with a tool result in its history gets `final_text`; any other (side requests such as
title generation) gets `text`. The scripted answer is logged as the exchange's "response". An optional
"omit_events" list drops streamed events by name (e.g. "ping", "response.in_progress", "[DONE]") to find which
ones a client needs.
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import itertools
import json
import re
import threading
import time
import urllib.parse
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SECRET = re.compile(r"authorization|api[-_]?key|cookie|token|secret", re.IGNORECASE)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "host", "content-length"}


def redact(headers) -> dict:
    return {k: ("<redacted>" if SECRET.search(k) else v) for k, v in headers.items()}


def decode_body(raw: bytes, encoding: str):
    """The request body as JSON when it parses, else as text; gzip/deflate/zstd bodies are unpacked first."""
    try:
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding == "zstd":
            import zstandard  # only if a client compresses its requests with zstd

            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    except Exception as exc:  # noqa: BLE001 - keep what came, say why it is not decoded
        return {"undecoded": f"{encoding}: {exc}", "bytes": len(raw)}
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


class Log:
    """Writes one numbered JSON file per exchange."""

    def __init__(self, out: Path):
        self.out, self.lock, self.counter = out, threading.Lock(), itertools.count(1)
        out.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> Path:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", record["path"]).strip("-") or "root"
        with self.lock:
            path = self.out / f"{next(self.counter):02d}-{slug}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        return path


# ---------------------------------------------------------------------------------------------- answer mode

def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def sse(events: list[dict]) -> list[bytes]:
    """Server-sent events, each with an `event:` line naming its type (as Anthropic and OpenAI send them)."""
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def sse_name(chunk: bytes) -> str:
    """An SSE chunk's event name, or "[DONE]" for chat completions' last chunk."""
    first = chunk.split(b"\n", 1)[0].decode()
    return first[7:] if first.startswith("event: ") else first[6:] if first == "data: [DONE]" else ""


class Script:
    def __init__(self, spec: dict):
        self.tool_calls = spec.get("tool_calls", [])
        self.final_text = spec.get("final_text", "Done.")
        self.text = spec.get("text", "OK.")
        self.omit_events = set(spec.get("omit_events", []))  # to find which streamed events a client needs

    def decide(self, offered: list[str], has_result: bool):
        """("tool", name, arguments) or ("text", text)."""
        if has_result:
            return ("text", self.final_text)
        for call in self.tool_calls:
            if call["name"] in offered:
                return ("tool", call["name"], call.get("arguments", {}))
        return ("text", self.text)


def estimate_tokens(body) -> int:
    return max(1, len(json.dumps(body)) // 4)


def answer_anthropic(script: Script, body: dict):
    offered = [t.get("name") for t in body.get("tools") or []]
    has_result = any(isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
                     for m in body.get("messages", []) if m.get("role") == "user")
    choice = script.decide(offered, has_result)
    schema = ((body.get("output_config") or {}).get("format") or {}).get("schema")
    if choice[0] == "text" and schema:  # structured output (Claude Code's title request): a matching object
        choice = ("text", json.dumps({k: script.text for k in schema.get("required", [])}))
    usage = {"input_tokens": estimate_tokens(body), "output_tokens": 0, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}
    message = {"id": _new_id("msg_"), "type": "message", "role": "assistant", "model": body.get("model", "demo"),
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=1)}
    if choice[0] == "tool":
        block = {"type": "tool_use", "id": _new_id("toolu_"), "name": choice[1], "input": choice[2]}
        start, delta = dict(block, input={}), {"type": "input_json_delta", "partial_json": json.dumps(choice[2])}
        stop_reason = "tool_use"
    else:
        block = {"type": "text", "text": choice[1]}
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": choice[1]}
        stop_reason = "end_turn"
    usage["output_tokens"] = estimate_tokens(block)
    if not body.get("stream"):
        return 200, dict(message, content=[block], stop_reason=stop_reason, usage=usage)
    return 200, sse([
        {"type": "message_start", "message": message},
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None}, "usage": usage},
        {"type": "message_stop"},
    ])


RESULT_ITEMS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}


def answer_responses(script: Script, body: dict):
    tools = body.get("tools") or []
    offered = [t.get("name") or t.get("type") for t in tools]  # local_shell, web_search... have no name
    items = body.get("input") if isinstance(body.get("input"), list) else []
    choice = script.decide(offered, any(i.get("type") in RESULT_ITEMS for i in items))
    if choice[0] == "tool" and choice[1] == "local_shell":
        item = {"type": "local_shell_call", "id": _new_id("lsh_"), "call_id": _new_id("call_"),
                "status": "completed", "action": dict({"type": "exec", "env": {}}, **choice[2])}
    elif choice[0] == "tool":
        item = {"type": "function_call", "id": _new_id("fc_"), "call_id": _new_id("call_"), "name": choice[1],
                "arguments": json.dumps(choice[2]), "status": "completed"}
    else:
        item = {"type": "message", "id": _new_id("msg_"), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": choice[1], "annotations": [], "logprobs": []}]}
    n_in, n_out = estimate_tokens(body), estimate_tokens(item)
    response = {
        "id": _new_id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": body.get("model", "demo"), "output": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools, "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "reasoning": body.get("reasoning"), "text": body.get("text") or {"format": {"type": "text"}},
        "store": body.get("store", False), "previous_response_id": body.get("previous_response_id"),
        "usage": None,
    }
    done = dict(response, status="completed", output=[item], usage={
        "input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out})
    if not body.get("stream"):
        return 200, done
    at = {"output_index": 0, "item_id": item["id"]}
    events = [{"type": "response.created", "response": response},
              {"type": "response.in_progress", "response": response}]
    if item["type"] == "message":
        text, part = choice[1], {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += [
            {"type": "response.output_item.added", "output_index": 0,
             "item": dict(item, status="in_progress", content=[])},
            {"type": "response.content_part.added", **at, "content_index": 0, "part": part},
            {"type": "response.output_text.delta", **at, "content_index": 0, "delta": text, "logprobs": []},
            {"type": "response.output_text.done", **at, "content_index": 0, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "content_index": 0, "part": dict(part, text=text)},
        ]
    elif item["type"] == "function_call":
        events += [
            {"type": "response.output_item.added", "output_index": 0,
             "item": dict(item, status="in_progress", arguments="")},
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **at, "name": item["name"],
             "arguments": item["arguments"]},
        ]
    else:
        events.append({"type": "response.output_item.added", "output_index": 0, "item": item})
    events += [{"type": "response.output_item.done", "output_index": 0, "item": item},
               {"type": "response.completed", "response": done}]
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return 200, sse(events)


def answer_chat(script: Script, body: dict):
    offered = [(t.get("function") or {}).get("name") for t in body.get("tools") or []]
    has_result = any(m.get("role") == "tool" for m in body.get("messages", []))
    choice = script.decide(offered, has_result)
    if choice[0] == "tool":
        call = {"id": _new_id("call_"), "type": "function",
                "function": {"name": choice[1], "arguments": json.dumps(choice[2])}}
        message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": choice[1]}, "stop"
    n_in, n_out = estimate_tokens(body), estimate_tokens(message)
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    head = {"id": _new_id("chatcmpl-"), "created": int(time.time()), "model": body.get("model", "demo")}
    if not body.get("stream"):
        return 200, dict(head, object="chat.completion", usage=usage,
                         choices=[{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}])
    chunk = dict(head, object="chat.completion.chunk")
    if choice[0] == "tool":
        delta = {"role": "assistant", "content": None, "tool_calls": [dict(call, index=0)]}
    else:
        delta = {"role": "assistant", "content": choice[1]}
    chunks = [dict(chunk, choices=[{"index": 0, "delta": delta, "finish_reason": None}]),
              dict(chunk, choices=[{"index": 0, "delta": {}, "finish_reason": finish}])]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(dict(chunk, choices=[], usage=usage))
    return 200, [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


def answer(script: Script, method: str, path: str, body):
    """(status, JSON object or list of SSE chunks) for one request."""
    body = body if isinstance(body, dict) else {}
    if path.endswith("/messages/count_tokens"):
        return 200, {"input_tokens": estimate_tokens(body)}
    if path.endswith("/messages") and method == "POST":
        return answer_anthropic(script, body)
    if path.endswith("/responses") and method == "POST":
        return answer_responses(script, body)
    if path.endswith("/chat/completions") and method == "POST":
        return answer_chat(script, body)
    if path.endswith("/models") and method == "GET":
        return 200, {"object": "list", "data": [{"id": "demo-chat", "object": "model", "created": 0,
                                                 "owned_by": "relay", "type": "model"}]}
    return 404, {"error": {"type": "not_found_error", "message": f"relay has no scripted answer for {path}"}}


# ---------------------------------------------------------------------------------------------- the server

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: urllib.parse.SplitResult | None = None
    script: Script | None = None
    log: Log

    def log_message(self, fmt, *args):  # one line per exchange is printed by handle_any instead
        pass

    def handle_any(self):
        url = urllib.parse.urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        if length:
            raw = self.rfile.read(length)
        elif "chunked" in self.headers.get("transfer-encoding", ""):
            raw = self.read_chunked()
        else:
            raw = b""
        body = decode_body(raw, self.headers.get("content-encoding", "").strip().lower())
        record = {"method": self.command, "path": url.path, "query": url.query, "headers": redact(self.headers),
                  "body": body}
        try:
            if self.script is not None:
                self.send_scripted(record, url.path, body)
            else:
                self.forward(record, raw)
        except (BrokenPipeError, ConnectionResetError) as exc:
            record["client_disconnected"] = repr(exc)
        finally:
            print(f"{record['method']} {self.path} -> {record.get('status')}  {self.log.write(record).name}",
                  flush=True)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_any

    def read_chunked(self) -> bytes:
        data = b""
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return data
            data += self.rfile.read(size)
            self.rfile.readline()

    def start(self, status: int, headers: list[tuple[str, str]], chunked: bool):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def send_scripted(self, record: dict, path: str, body):
        status, reply = answer(self.script, self.command, path, body)
        record["status"] = status
        if isinstance(reply, list):  # SSE
            reply = [c for c in reply if sse_name(c) not in self.script.omit_events]
            headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                       ("request-id", _new_id("req_")), ("x-request-id", _new_id("req_"))]
            record["response_headers"] = dict(headers)
            self.start(status, headers, chunked=True)
            for chunk in reply:
                self.write_chunk(chunk)
            self.write_chunk(b"")
            record["response"] = b"".join(reply).decode()
        else:
            data = json.dumps(reply).encode()
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("request-id", _new_id("req_")), ("x-request-id", _new_id("req_"))]
            record["response_headers"] = dict(headers)
            self.start(status, headers, chunked=False)
            if self.command != "HEAD":
                self.wfile.write(data)
            record["response"] = reply

    def forward(self, record: dict, raw: bytes):
        up = self.upstream
        conn_class = http.client.HTTPSConnection if up.scheme == "https" else http.client.HTTPConnection
        conn = conn_class(up.hostname, up.port, timeout=3600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Accept-Encoding"] = "identity"  # keep the logged answer readable
        target = up.path.rstrip("/") + self.path
        tic = time.perf_counter()
        try:
            conn.request(self.command, target, body=raw if raw else None, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            record["status"], record["response"] = 502, f"upstream unreachable: {exc}"
            data = json.dumps({"error": {"type": "api_error", "message": record["response"]}}).encode()
            self.start(502, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))], False)
            self.wfile.write(data)
            return
        record["status"] = resp.status
        record["response_headers"] = dict(resp.getheaders())
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP | {"server", "date"}]
        known_length = resp.getheader("content-length")
        if known_length is not None:
            headers.append(("Content-Length", known_length))
        self.start(resp.status, headers, chunked=known_length is None and self.command != "HEAD")
        received = bytearray()
        # [seconds since the request was sent, bytes of the answer received by then], per chunk read
        record["arrivals"] = arrivals = []
        try:
            while chunk := resp.read1(65536):
                received += chunk
                arrivals.append([round(time.perf_counter() - tic, 4), len(received)])
                if known_length is None:
                    self.write_chunk(chunk)
                else:
                    self.wfile.write(chunk)
                    self.wfile.flush()
            if known_length is None and self.command != "HEAD":
                self.write_chunk(b"")
        finally:
            conn.close()
            text = received.decode("utf-8", "replace")
            if "text/event-stream" in (resp.getheader("content-type") or ""):
                record["response"] = text
            else:
                try:
                    record["response"] = json.loads(text)
                except ValueError:
                    record["response"] = text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:9000", help="host:port to listen on")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--upstream", help="base URL of the server to forward to, e.g. http://127.0.0.1:8080")
    mode.add_argument("--answer", type=Path, help="answer every request from this JSON script instead")
    p.add_argument("--out", type=Path, required=True, help="folder for the NN-<path>.json captures")
    args = p.parse_args()
    host, port = args.listen.rsplit(":", 1)
    Handler.log = Log(args.out)
    if args.upstream:
        Handler.upstream = urllib.parse.urlsplit(args.upstream)
    else:
        Handler.script = Script(json.loads(args.answer.read_text()))
    server = ThreadingHTTPServer((host, int(port)), Handler)
    print(f"relay on http://{args.listen} -> {args.upstream or f'script {args.answer}'}; captures in {args.out}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
