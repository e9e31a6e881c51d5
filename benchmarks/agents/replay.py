"""Replay the captured agent sessions against a running `dflash-mlx serve` and measure its prompt cache.

Each client's turns (tests/fixtures/clients/) are sent in order, as the client sent them (streamed where it
streamed), with the model renamed and each answer cut to --max-tokens: the next turn carries the captured
answer in its history, not this one. A second Claude Code session follows the first, its billing line's suffix
changed as a new session's is. Per request: the prompt's tokens, those the server took from its prompt cache
(from each API's usage), the time to the first event after the prompt is read (streamed requests) and in all.
Starts no server:

    dflash-mlx serve --model qwen3-8b --port 8080 --max-prompt-tokens 40960
    python benchmarks/agents/replay.py --base-url http://127.0.0.1:8080 --model qwen3-8b --json rows.json
"""
import argparse
import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "clients"
BUDGET = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_tokens"}
# Events a stream opens with before the prompt is read (a chat stream's first chunk, with the role, too):
# the first event after them is the time to first token. Anthropic's message_start waits for the prompt.
OPENING = {"response.created", "response.in_progress"}


def new_session(body: dict) -> dict:
    """A Claude Code turn 1 as another session sends it: another billing suffix, another session id."""
    system = [dict(b, text=b["text"].replace("cc_version=2.1.197.8a5", "cc_version=2.1.197.3f1"))
              for b in body["system"]]
    user = json.loads(body["metadata"]["user_id"])
    metadata = {"user_id": json.dumps(dict(user, session_id="00000000-0000-4000-8000-000000000001"))}
    return dict(body, system=system, metadata=metadata)


@dataclass
class Session:
    client: str
    turns: List[str]  # captures under FIXTURES, in the order the client sent them
    edit: Callable[[dict], dict] = lambda body: body


SESSIONS = [
    Session("Claude Code", ["claude-code-2.1.197/02-v1-messages.json", "claude-code-2.1.197/03-v1-messages.json"]),
    Session("Claude Code, new session", ["claude-code-2.1.197/02-v1-messages.json"], new_session),
    Session("Codex CLI", ["codex-0.171.0/01-v1-responses.json", "codex-0.171.0/02-v1-responses.json"]),
    *[Session(f"Agents SDK, {kind}", [f"openai-agents-0.24.0/{kind}/0{n}-v1-{path}.json" for n in (1, 2)])
      for kind, path in [("responses", "responses"), ("responses-stream", "responses"),
                         ("chat", "chat-completions"), ("chat-stream", "chat-completions")]],
]


@dataclass
class Row:
    client: str
    turn: int
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    ttft_s: Optional[float] = None  # streamed requests only
    total_s: Optional[float] = None
    error: Optional[str] = None

    @property
    def cached_share(self) -> Optional[float]:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int


def usage_of(obj: dict) -> Optional[Usage]:
    """Prompt and cached tokens from any API's usage: Anthropic's counts `input_tokens` without the cache's."""
    u = obj.get("usage") or (obj.get("response") or {}).get("usage") or (obj.get("message") or {}).get("usage")
    if not u:
        return None
    if "cache_read_input_tokens" in u:
        cached = u.get("cache_read_input_tokens") or 0
        return Usage(u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0), cached)
    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    return Usage(u.get("prompt_tokens", u.get("input_tokens")), details.get("cached_tokens") or 0)


def error_of(obj: dict) -> Optional[str]:
    """An error body's message, in OpenAI's, Anthropic's or the Responses stream's shape."""
    if obj.get("type") == "response.failed":
        obj = obj["response"]
    error = obj.get("error")
    return (error.get("message") or json.dumps(error)) if isinstance(error, dict) else None


@dataclass
class Answer:
    usage: Optional[Usage] = None
    first: Optional[float] = None  # when the first event after the opening ones came
    error: Optional[str] = None

    def add(self, obj: dict, at: float) -> None:
        self.error = self.error or error_of(obj)
        self.usage = usage_of(obj) or self.usage
        role = "role" in ((obj.get("choices") or [{}])[0].get("delta") or {})
        if self.first is None and obj.get("type") not in OPENING and not role:
            self.first = at


def send(base_url: str, capture: dict, body: dict, api_key: str, timeout: float) -> Answer:
    """One request; its answer read event by event where streamed."""
    query = f"?{capture['query']}" if capture.get("query") else ""
    headers = {k: v for k, v in capture["headers"].items() if k.lower() in ("anthropic-version", "anthropic-beta")}
    headers.update({"Content-Type": "application/json", "Authorization": f"Bearer {api_key}", "x-api-key": api_key})
    req = urllib.request.Request(base_url + capture["path"] + query, json.dumps(body).encode(), headers)
    tic, answer = time.perf_counter(), Answer()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not body.get("stream"):
                answer.add(json.loads(r.read()), time.perf_counter() - tic)
                return answer
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    answer.add(json.loads(line[6:]), time.perf_counter() - tic)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            answer.error = f"{e.code}: {error_of(json.loads(text)) or text}"
        except ValueError:
            answer.error = f"{e.code}: {text[:200]}"
    except (urllib.error.URLError, OSError) as e:
        answer.error = str(getattr(e, "reason", e))
    return answer


def replay(args) -> List[Row]:
    rows = []
    for session in SESSIONS:
        for turn, name in enumerate(session.turns, 1):
            capture = json.loads((args.fixtures / name).read_text())
            body = session.edit(dict(capture["body"], model=args.model))
            body[BUDGET[capture["path"]]] = args.max_tokens
            tic = time.perf_counter()
            answer = send(args.base_url.rstrip("/"), capture, body, args.api_key, args.timeout)
            row = Row(session.client, turn, total_s=round(time.perf_counter() - tic, 3), error=answer.error)
            if answer.usage is not None:
                row.prompt_tokens, row.cached_tokens = answer.usage.prompt_tokens, answer.usage.cached_tokens
            if body.get("stream") and answer.first is not None:
                row.ttft_s = round(answer.first, 3)
            rows.append(row)
    return rows


def table(rows: List[Row]) -> Table:
    def num(v, fmt="{}"):
        return "-" if v is None else fmt.format(v)

    t = Table("client", "turn", "prompt tokens", "cached tokens", "cached share", "time to first token", "total")
    for r in rows:
        cached = ("[red]error[/red]", "") if r.error else (num(r.cached_tokens), num(r.cached_share, "{:.0%}"))
        t.add_row(r.client, str(r.turn), num(r.prompt_tokens), *cached, num(r.ttft_s, "{:.2f} s"),
                  num(r.total_s, "{:.2f} s"))
    return t


def server_args(p: argparse.ArgumentParser) -> None:
    """The options naming the server and its model (shared with run_clients.py)."""
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="the server, without /v1")
    p.add_argument("--model", default="demo-chat")


def show(console: Console, table: Table) -> None:
    """A table on a terminal, or at its natural width with no cell wrapped in a pipe or a file."""
    if not console.is_terminal:
        console.width = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    console.print(table)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_args(p)
    p.add_argument("--api-key", default="x")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's budget")
    p.add_argument("--timeout", type=float, default=900, help="seconds per request")
    p.add_argument("--fixtures", type=Path, default=FIXTURES)
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args()
    rows = replay(args)
    console = Console(highlight=False)
    show(console, table(rows))
    for r in rows:
        if r.error:
            console.print(f"[red]{escape(r.client)}, turn {r.turn}:[/red] {escape(r.error)}", soft_wrap=True)
    if args.json:
        args.json.write_text(json.dumps([dict(asdict(r), cached_share=r.cached_share) for r in rows], indent=1))


if __name__ == "__main__":
    main()
