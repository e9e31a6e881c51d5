"""A long prompt joining running streams: how long the streams stall, and the joiner's first token.

    LD_PRELOAD=... python benchmarks/join_stall.py --pair ~/.cache/dflash-mlx/peers/pairs/widened \
        [--before REV] [--streams 3] [--prompt-tokens 1800] [--out FILE]

Starts `dflash-mlx serve` on the pair and drives it through the official openai client:
`--streams` greedy chat completions stream long answers; once each has streamed for a while, a
prompt of about `--prompt-tokens` tokens (the shipped long document) joins with a short answer.
Reported per server: the streams' median gap between two streamed pieces while no prompt joins
and all of them decode (before the long prompt comes, and after its first token until the first
stream ends); while it is prefilled, their longest gap (a gap it came into counts from its
arrival) and the longest time in which no stream got a piece (a stall of them all; one stream's
gap may also span two cycles where its text waits for the next token to be printable), each
against that median; the joiner's time to first token, and the same prompt's time to first
token sent alone (its own prefill). With
`--before REV` the same load runs first on a server from that commit (a temporary git worktree),
so both figures come from one run on one machine.
"""

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serve_load import checkout_cli, free_port, wait_ready  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STREAM_PROMPTS = ("Write a long Python module with many small utility functions.",
                  "Explain, step by step and at length, how a hash map works.",
                  "List and describe every built-in exception in Python.",
                  "Write a long story about a lighthouse keeper.")
WARM = 3.0  # seconds the streams run before the long prompt joins: past their own start


def long_prompt(pair: Path, tokens: int, ask: str = "Summarise this document in one line.") -> str:
    """`ask` and the start of the shipped long document, `tokens` tokens in all (the pair's tokenizer)."""
    from tokenizers import Tokenizer

    text = gzip.decompress((REPO / "dflash_mlx" / "suites" / "document.txt.gz").read_bytes()).decode()
    tokenizer = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    ids = tokenizer.encode(ask + "\n\n" + text[: tokens * 8]).ids[:tokens]
    return tokenizer.decode(ids)


def start(pair: Path, root: Path, log):
    """`dflash-mlx serve` from the package under `root` (this checkout, or a worktree)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = checkout_cli(root) + ["serve", "--model", str(pair / "target"), "--draft", str(pair / "drafter"),
                                "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd="/")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def stream(client, prompt: str, max_tokens: int, times: list) -> None:
    """Stream a greedy answer, appending the arrival time of each piece to `times`."""
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())


def first_token(client, prompt: str) -> float:
    model = client.models.list().data[0].id
    tic = time.perf_counter()
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=4, temperature=0, stream=True)
    for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter() - tic
    return time.perf_counter() - tic


def run(url: str, streams: int, prompt: str, alone_prompt: str, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    first_token(client, STREAM_PROMPTS[0])  # warm-up
    alone = first_token(client, alone_prompt)  # a long prompt's own prefill (another start: no cache hit)
    times = [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream, args=(client, STREAM_PROMPTS[i % len(STREAM_PROMPTS)], max_tokens,
                                                    times[i])) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(WARM)
    joined_at = time.perf_counter()
    joiner = first_token(client, prompt)
    first_at = joined_at + joiner
    for t in threads:
        t.join()
    outside, during = [], []
    together = min(ts[-1] for ts in times)  # until the first stream ends, all of them decode
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b < joined_at or first_at <= a and b <= together:
                outside.append(b - a)
            elif b > joined_at and a < first_at:  # a gap the join came into: its part since then
                during.append((b - max(a, joined_at), a - joined_at))
    median = statistics.median(outside)
    longest = max(during)[0] if during else 0.0
    # No stream's next piece: a stall of them all (a stream's own gap may also span two cycles where
    # its text waits for the next token to be printable).
    pieces = sorted(t for ts in times for t in ts if joined_at < t <= first_at)
    stall = max((b - a for a, b in zip([joined_at] + pieces, pieces)), default=0.0)
    return {"median_gap": median, "longest_gap_while_joining": longest, "ratio": longest / median,
            "longest_stall_of_all": stall, "stall_ratio": stall / median,
            "joiner_ttft": joiner, "alone_ttft": alone, "ttft_ratio": joiner / alone,
            "stream_pieces": [len(ts) for ts in times],
            "longest_gaps": [{"seconds": g, "after_join": at} for g, at in sorted(during, reverse=True)[:5]]}


def measure(pair: Path, root: Path, args, prompt: str, alone_prompt: str) -> dict:
    """`run` against a server started from `root`, stopped after."""
    with open(Path(tempfile.gettempdir()) / "join_stall_server.log", "w") as log:
        proc, url = start(pair, root, log)
        try:
            return run(url, args.streams, prompt, alone_prompt, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait()


def worktree(rev: str) -> Path:
    """A checkout of `rev` whose package imports as installed (cli/ and convert/ linked in)."""
    path = Path(tempfile.mkdtemp(prefix="dflash-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True, capture_output=True)
    for name in ("cli", "convert"):
        (path / "dflash_mlx" / name).symlink_to(path / name)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/ (peers/widen.py builds them)")
    ap.add_argument("--before", help="also measure a server from this commit, first")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1800, help="the joining prompt (the chat template adds a few)")
    ap.add_argument("--max-tokens", type=int, default=1000, help="each stream's answer: long enough to outlast the join")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from dflash_mlx.bench import machine_info
    from dflash_mlx.machine import blas_name

    pair = Path(args.pair).expanduser()
    prompt = long_prompt(pair, args.prompt_tokens)
    alone_prompt = long_prompt(pair, args.prompt_tokens, "Give this document a title.")
    roots = ([("before " + args.before, worktree(args.before))] if args.before else []) + [("this tree", REPO)]
    rows = []
    try:
        for name, root in roots:
            rows.append({"server": name, **measure(pair, root, args, prompt, alone_prompt)})
            r = rows[-1]
            print(f"{name}: median gap {r['median_gap']:.3f} s, longest while joining "
                  f"{r['longest_gap_while_joining']:.2f} s ({r['ratio']:.1f}x), of all streams at once "
                  f"{r['longest_stall_of_all']:.2f} s ({r['stall_ratio']:.1f}x); joiner TTFT {r['joiner_ttft']:.2f} s "
                  f"against {r['alone_ttft']:.2f} s alone ({r['ttft_ratio']:.2f}x)", flush=True)
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(roots[0][1])], cwd=REPO, capture_output=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "what": "streams' longest gap while a long prompt joins, and the joiner's time to first token",
            "pair": str(pair), "machine": machine_info(), "blas": blas_name(), "settings": vars(args),
            "rows": rows, "command": "python benchmarks/join_stall.py " + " ".join(argv or sys.argv[1:]),
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
