"""Servers under load: N clients at once, each streaming its own greedy completion.

    LD_PRELOAD=... python benchmarks/serve_load.py --pair ~/.cache/dflash-mlx/peers/pairs/widened \
        --concurrency 1,2,4,8 --max-tokens 128 --out benchmarks/results/serve-load-widened-linux-cpu-openblas.json

Starts `dflash-mlx serve` on the pair and mlx-lm's own server (`mlx_lm.server`, batched
plain decoding) on its target, both at once, and drives each through the official
openai client: at each concurrency N, N threads send N distinct prompts of the `code`
suite at once (chat completions, streamed, temperature 0, `--max-tokens` each, EOS
ignored by neither). The servers take turns, one load each per repeat, while the other
idles, so that a shared machine's drift falls on both alike; the order of the turns rotates
each repeat (use a multiple of the servers' count), so that each server runs in each place
of it as often. Reported per server and N:
aggregate tokens/s (all tokens over the wall time from the first request sent to the
last token received), time to first token per request (median, max), and whether every
answer equals that server's answer to the same prompt sent alone. Each N runs
`--repeats` times; figures are medians. With `--before CHECKOUT` (a git worktree of an
earlier commit), that checkout's `dflash-mlx serve` runs as a third server, "before": a
before/after run of a change, taking turns with the others. With `--suite json` the prompts
are the `json` suite's and our servers get each prompt's schema as `response_format`
(`json_schema`, strict); mlx-lm's server has no structured output and answers the same
prompts unconstrained. Each constrained answer that ends before `--max-tokens` is checked
against its schema ("valid").
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc, seconds: float = 600) -> None:
    import urllib.request

    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not come up")


# `dflash-mlx` from a checkout (argv[1]): its package first on the path, and its `cli/` and `convert/` folders,
# which the wheel maps into the package, as `dflash_mlx.cli` and `dflash_mlx.convert` (an editable install of
# this checkout would map them to its own).
CHECKOUT_CLI = """import importlib.util, sys
root = sys.argv.pop(1)
sys.path.insert(0, root)
for name, folder in (("dflash_mlx.cli", "cli"), ("dflash_mlx.convert", "convert")):
    spec = importlib.util.spec_from_file_location(name, f"{root}/{folder}/__init__.py",
                                                  submodule_search_locations=[f"{root}/{folder}"])
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
from dflash_mlx.cli.main import app
app()"""


def checkout_cli(root: Path) -> list:
    """The command line of `dflash-mlx` as the checkout at `root` has it (run from outside it)."""
    return [sys.executable, "-c", CHECKOUT_CLI, str(root)]


def start(kind: str, pair: Path, log, before: Optional[Path] = None):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    serve = ["serve", "--model", str(pair / "target"), "--draft", str(pair / "drafter"), "--port", str(port)]
    if kind == "dflash-mlx":
        cmd = [str(Path(sys.executable).parent / "dflash-mlx")] + serve
    elif kind == "before":
        cmd = checkout_cli(before) + serve
    else:
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(pair / "target"), "--port", str(port)]
    # Not from this checkout's folder: Python puts the working directory first on the path.
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd="/" if kind == "before" else None)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def ask(client, prompt, max_tokens: int, model: str):
    """(text, tokens, seconds to the first token, seconds to the last, finish reason). `prompt`: its text, or
    {"prompt", "schema"}: the answer keeps to the schema (`response_format`)."""
    tic = time.perf_counter()
    first, parts, n = None, [], 0
    extra = {}
    if isinstance(prompt, dict):
        if model != "default_model":  # mlx-lm's server: no structured output
            extra["response_format"] = {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": prompt["schema"], "strict": True}}
        prompt = prompt["prompt"]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, **extra)
    finish = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - tic
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return "".join(parts), n, first or 0.0, time.perf_counter() - tic, finish


def load(client, prompts, max_tokens, model):
    """Every prompt at once: (answers, aggregate tok/s, times to first token, finish reasons)."""
    results = [None] * len(prompts)

    def run(i):
        results[i] = ask(client, prompts[i], max_tokens, model)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    tokens = sum(r[1] or len(r[0]) for r in results)
    return [r[0] for r in results], tokens / wall, [r[2] for r in results], [r[4] for r in results]


def variant(prompt, i: int):
    """The prompt made distinct (a suite shorter than the clients)."""
    if isinstance(prompt, dict):
        return dict(prompt, prompt=f"{prompt['prompt']} (request {i})")
    return f"{prompt}\n# variant {i}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/ (peers/widen.py builds them)")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--servers", default="dflash-mlx,mlx-lm")
    ap.add_argument("--suite", default="code", choices=["code", "json"])
    ap.add_argument("--before", default=None, metavar="CHECKOUT",
                    help="another checkout of this repository, served beside ours as 'before'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import openai

    from dflash_mlx.bench import load_prompts, machine_info, validates
    from dflash_mlx.machine import blas_name

    pair = Path(args.pair).expanduser()
    levels = [int(n) for n in args.concurrency.split(",")]
    prompts = load_prompts(args.suite)[args.suite]
    if max(levels) > len(prompts):
        prompts = [variant(p, i) for i in range(-(-max(levels) // len(prompts))) for p in prompts]
    kinds = args.servers.split(",") + (["before"] if args.before else [])
    before = Path(args.before).resolve() if args.before else None
    servers, logs = {}, {}
    try:
        for kind in kinds:
            logs[kind] = open(f"/tmp/serve-load-{kind}.log", "w")
            proc, url = start(kind, pair, logs[kind], before)
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
            model = client.models.list().data[0].id if kind != "mlx-lm" else "default_model"
            servers[kind] = proc, client, model
        alone = {kind: {} for kind in kinds}
        for kind, (_, client, model) in servers.items():
            for i, p in enumerate(prompts[: max(levels)]):
                ask(client, p, 8, model)  # warm-up (and, for ours, the cost curve)
                alone[kind][i] = ask(client, p, args.max_tokens, model)[0]
        rows = []
        for n in levels:
            runs = {kind: [] for kind in kinds}
            for r in range(args.repeats):
                # The order rotates each repeat: the server that runs right after another's load runs
                # a few percent faster here, whichever it is, so each takes each place alike.
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                    _, client, model = servers[kind]
                    runs[kind].append(load(client, prompts[:n], args.max_tokens, model))
            for kind in kinds:
                ttft = [t for r in runs[kind] for t in r[2]]
                row = {"server": kind, "clients": n, "tps": statistics.median(r[1] for r in runs[kind]),
                       "tps_runs": [r[1] for r in runs[kind]],
                       "ttft_median": statistics.median(ttft), "ttft_max": max(ttft),
                       "identical": all(a == alone[kind][i] for r in runs[kind] for i, a in enumerate(r[0]))}
                if args.suite == "json" and kind != "mlx-lm":  # answers cut by the budget are not complete
                    ended = [(a, p) for r in runs[kind] for a, p, f in zip(r[0], prompts[:n], r[3]) if f == "stop"]
                    row["valid"] = f"{sum(validates(a, p['schema']) for a, p in ended)} of {len(ended)} ended"
                rows.append(row)
                print(f"{kind} x{n}: {row['tps']:.1f} tok/s, ttft {row['ttft_median']:.2f} / "
                      f"{row['ttft_max']:.2f} s, identical {row['identical']}", file=sys.stderr, flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(60)
        for log in logs.values():
            log.close()
    base = {r["clients"]: r["tps"] for r in rows if r["server"] == "mlx-lm"}
    ours1 = next((r["tps"] for r in rows if r["server"] == "dflash-mlx" and r["clients"] == 1), None)
    print("| server | clients | aggregate tok/s | vs mlx-lm | vs 1 client | TTFT median / max | answers = alone |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['tps'] / base[r['clients']]:.2f}x" if r["clients"] in base else "-"
        own1 = next((o["tps"] for o in rows if o["server"] == r["server"] and o["clients"] == 1), None) or ours1
        scaled = f"{r['tps'] / own1:.2f}x" if own1 else "-"  # no 1-client run
        print(f"| {r['server']} | {r['clients']} | {r['tps']:.1f} | {vs} | {scaled} | "
              f"{r['ttft_median']:.2f} / {r['ttft_max']:.2f} s | {r['identical']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "blas": blas_name(), "pair": str(pair),
                                              "settings": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
