"""Run real agent clients headless against a running `dflash-mlx serve` and tabulate how each did.

Each client works in a fresh folder holding README.md, main.py and notes.txt, on one task (by default "list the
files here, read one, answer"), through relay.py forwarding to the server (capture.sh runs it), so that every
request and answer is logged with its arrival times. Per client: its version, the model requests it made
(turns), the outcome (`done`: it exited 0 and its answer quotes a line of one of the files; `answered`: it
exited 0 without one), each turn's prompt tokens and the share of them the server's prompt cache held, and
each turn's time to first token. Starts no server:

    dflash-mlx serve --model demo-chat --port 8080
    python benchmarks/agents/run_clients.py --base-url http://127.0.0.1:8080 --json results.json

Needs the clients: `npm install --prefix /tmp/clients @anthropic-ai/claude-code @openai/codex` and
`openai-agents` in a virtual environment of its own (`--agents-python`).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from replay import Answer, server_args, show  # noqa: E402

MODEL_PATHS = {"/v1/messages", "/v1/responses", "/v1/chat/completions"}
# Lines of capture.sh's three files: an answer that quotes one has read a file.
FILE_LINES = ["A tiny project.", 'print("hello")', "buy milk"]
CLIENTS = ["claude", "codex", "agents-responses", "agents-responses-stream", "agents-chat", "agents-chat-stream"]


@dataclass
class Turn:
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    ttft_s: Optional[float] = None
    status: Optional[int] = None


@dataclass
class Run:
    client: str
    version: str
    exit_code: int
    outcome: str
    answer: str
    turns: List[Turn] = field(default_factory=list)


def version(client: str, args) -> str:
    if client.startswith("agents"):
        cmd = [args.agents_python, "-c", "import importlib.metadata as m; print(m.version('openai-agents'))"]
    else:
        cmd = [os.environ.get(client.upper(), client), "--version"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip().split("\n")[0]
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def events(text: str, arrivals: List[List[float]]):
    """Each `data:` event of an SSE answer, parsed, with the time its last byte arrived."""
    raw, at, offset = text.encode(), 0, 0
    for line in raw.split(b"\n"):
        offset += len(line) + 1
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            while at < len(arrivals) - 1 and arrivals[at][1] < offset - 1:
                at += 1
            yield json.loads(line[6:]), arrivals[at][0] if arrivals else None


def turn(record: dict) -> Turn:
    answer, response = Answer(), record.get("response")
    if isinstance(response, str):
        for obj, at in events(response, record.get("arrivals") or []):
            answer.add(obj, at)
    elif isinstance(response, dict):
        answer.add(response, None)
        answer.first = None
    out = Turn(status=record.get("status"), ttft_s=answer.first)
    if answer.usage is not None:
        out.prompt_tokens, out.cached_tokens = answer.usage.prompt_tokens, answer.usage.cached_tokens
    return out


def run(client: str, args) -> Run:
    out = Path(tempfile.mkdtemp(prefix=f"agents-{client}-"))
    env = dict(os.environ, UPSTREAM=args.base_url, PROMPT=args.prompt, MODEL=args.model, PORT=str(args.port),
               CLIENT_TIMEOUT=str(args.timeout), AGENTS_PYTHON=args.agents_python, AGENTS_ARGS="--read-tool",
               CLAUDE_ARGS=args.claude_args, RELAY_PYTHON=sys.executable)
    done = subprocess.run(["bash", str(HERE / "capture.sh"), client, str(out)], env=env, capture_output=True,
                          text=True, timeout=args.timeout + 60)
    text = done.stdout
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    turns = [turn(r) for r in records if r["method"] == "POST" and r["path"] in MODEL_PATHS]
    quoted = any(line in text for line in FILE_LINES)
    outcome = "done" if done.returncode == 0 and quoted else "answered" if done.returncode == 0 else "failed"
    answer = text.strip()
    if client == "claude":
        try:
            answer = json.loads(answer.splitlines()[0]).get("result", answer)
        except (ValueError, IndexError, AttributeError):
            pass
    return Run(client, version(client, args), done.returncode, outcome, answer[-400:], turns)


def table(runs: List[Run]) -> Table:
    t = Table(title="Agent clients against dflash-mlx serve")
    for c in ["client", "version", "turns", "outcome", "prompt tokens per turn", "cached share, turn 2 on",
              "time to first token (s)"]:
        t.add_column(c, justify="left" if c in ("client", "version", "outcome") else "right")
    for r in runs:
        later = [x for x in r.turns[1:] if x.prompt_tokens]
        share = (sum(x.cached_tokens or 0 for x in later) / sum(x.prompt_tokens for x in later)) if later else None
        t.add_row(r.client, r.version, str(len(r.turns)), r.outcome,
                  " / ".join(f"{x.prompt_tokens:,}" if x.prompt_tokens else "-" for x in r.turns),
                  f"{share:.0%}" if share is not None else "-",
                  " / ".join(f"{x.ttft_s:.2f}" if x.ttft_s is not None else "-" for x in r.turns))
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_args(p)
    p.add_argument("--prompt", default="list the files here, read one, answer")
    p.add_argument("--clients", nargs="+", default=CLIENTS, choices=CLIENTS)
    p.add_argument("--port", type=int, default=9000, help="the relay's port")
    p.add_argument("--timeout", type=int, default=600, help="seconds each client may take")
    p.add_argument("--agents-python", default=os.environ.get("AGENTS_PYTHON", "python"),
                   help="a Python with openai-agents installed")
    p.add_argument("--claude-args", default="", help='extra flags for claude, e.g. "--allowedTools Bash"')
    p.add_argument("--json", type=Path, help="write the runs here")
    args = p.parse_args()
    console, runs = Console(stderr=True), []
    for client in args.clients:
        console.print(f"running {client} ...")
        runs.append(run(client, args))
        console.print(f"  {runs[-1].outcome}: {runs[-1].answer[-200:]!r}")
    show(Console(highlight=False), table(runs))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2) + "\n")


if __name__ == "__main__":
    main()
