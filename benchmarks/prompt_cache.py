"""Time to first token of a request that extends a conversation by one turn, with and without the prompt cache.

A conversation of about `--context` tokens is sent once (its answer fills the
prompt cache); the next request adds the answer and one more turn. Its time to
first token (prefill until the first token is on the host) is measured cold
(no cache) and warm (from the cache), interleaved, `--repeats` times; greedy
ids of the two are checked equal.

    python benchmarks/prompt_cache.py --context 1900                   # the demo pair, near its 2,048 window
    python benchmarks/prompt_cache.py --context 16000 --stand-in 32768  # a long-context stand-in
    python benchmarks/prompt_cache.py --context 1900 --disk            # also warm from the disk tier

`--stand-in N` runs a float32 (`--dtype`) copy of the demo target with linear RoPE scaling
to an N-token window (the weights are the demo's, untrained at that length:
its text is not meaningful there, its timing is). `--disk` also times the
request warm from the disk tier: the first request's caches spilled to files,
read back by a new `PromptCache` over the same folder (a restarted server);
the file was just written, so it is read from the OS page cache, not the
device. Results go to `--out` as JSON.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.bench import load_prompts, machine_info, median, prompt_text
from dflash_mlx.hub import cache_root

DEMO = Path(dflash_mlx.__file__).parent / "demo"


def stand_in(window: int, dtype: str = "float32") -> Path:
    """The demo target with its RoPE positions scaled to a `window`-token window, its weights in `dtype`."""
    out = cache_root() / "bench" / (f"demo-rope{window}" + ("" if dtype == "float32" else f"-{dtype}"))
    factor = window / 2048
    cfg = json.loads((DEMO / "target" / "config.json").read_text())
    cfg.update(max_position_embeddings=window, rope_scaling={"rope_type": "linear", "factor": factor},
               torch_dtype=dtype)
    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text()) != cfg:
        tmp = out.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(DEMO / "target", tmp)
        # float32 by default: half-precision matmuls are slow on a CPU and would time the wrong thing
        weights = mx.load(str(tmp / "model.safetensors"))
        mx.save_safetensors(str(tmp / "model.safetensors"), {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def conversation(tokenizer, n: int):
    """About `n` tokens of turns taken from the shipped suites, and one more turn."""
    texts = [prompt_text(p) for suite in load_prompts().values() for p in suite]
    ids, i = [], 0
    while len(ids) < n:
        ids += tokenizer.encode(f"\n# turn {i}\n{texts[i % len(texts)]}\n")
        i += 1
    return ids[:n], tokenizer.encode(f"\n# turn {i}\n{texts[i % len(texts)]}\n")


def first_token(pair, prompt, cache=None, max_tokens=32):
    """(seconds to the first token, all tokens, stats)."""
    tic = time.perf_counter()
    ttft, tokens, stats = None, [], None
    for event in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, block_size=4, prompt_cache=cache):
        if ttft is None:
            ttft = time.perf_counter() - tic
        tokens += event.tokens
        stats = event.stats
    return ttft, tokens, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1900, help="tokens in the conversation so far")
    ap.add_argument("--stand-in", type=int, default=0, help="window of a RoPE-scaled demo target (0: the demo pair)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the stand-in's weights (float32: half-precision matmuls are slow on a CPU)")
    ap.add_argument("--make-stand-in", action="store_true",
                    help="only write the stand-in (for `dflash-mlx bench --model`) and print its folder")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    ap.add_argument("--disk", action="store_true", help="also time the request warm from the disk tier")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.make_stand_in:
        if not args.stand_in:
            sys.exit("--make-stand-in needs --stand-in WINDOW")
        print(stand_in(args.stand_in, args.dtype))
        return
    folder = Path(tempfile.mkdtemp(prefix="dflash-prompt-cache-bench-"))

    model = str(stand_in(args.stand_in, args.dtype)) if args.stand_in else "demo"
    pair = dflash_mlx.load(model, str(DEMO / "drafter") if args.stand_in else None)
    history, turn = conversation(pair.tokenizer, args.context)
    first_token(pair, history[:64])  # warm-up
    rows = []
    for r in range(args.repeats):
        cache = dflash_mlx.PromptCache(pair)
        _, answer, _ = first_token(pair, history, cache, args.answer)
        nxt = history + answer + turn
        cold, cold_ids, cold_stats = first_token(pair, nxt, None, args.answer)
        warm, warm_ids, warm_stats = first_token(pair, nxt, cache, args.answer)
        if warm_ids != cold_ids:
            sys.exit("warm and cold greedy ids differ: the prompt cache is broken")
        rows.append({"cold_s": cold, "warm_s": warm, "ratio": warm / cold, "prompt_tokens": len(nxt),
                     "cached_tokens": warm_stats.cached_tokens, "cold_peak_memory_gb": cold_stats.peak_memory_gb})
        line = f"warm {warm * 1e3:.1f} ms ({warm / cold:.3f})"
        if args.disk:
            spilled = dflash_mlx.PromptCache(pair, disk_bytes=1 << 40, disk_dir=folder / str(r))
            first_token(pair, history, spilled, args.answer)
            spilled.spill()
            restarted = dflash_mlx.PromptCache(pair, disk_bytes=1 << 40, disk_dir=folder / str(r))
            disk, disk_ids, disk_stats = first_token(pair, nxt, restarted, args.answer)
            if disk_ids != cold_ids or restarted.disk.hits != 1:
                sys.exit("warm-from-disk and cold greedy ids differ, or the disk was not read: the disk tier is broken")
            rows[-1].update(disk_s=disk, disk_ratio=disk / cold, disk_cached_tokens=disk_stats.cached_tokens,
                            disk_file_bytes=spilled.disk.nbytes, disk_files=len(spilled.disk))
            line += f", warm from disk {disk * 1e3:.1f} ms ({disk / cold:.3f}, {spilled.disk.nbytes / 1e6:.0f} MB)"
        print(f"[{r + 1}/{args.repeats}] {len(nxt)} tokens: cold {cold * 1e3:.0f} ms, {line}, "
              f"{warm_stats.cached_tokens} cached", flush=True)
    result = {
        "what": "time to first token of a conversation's next turn, warm (prompt cache) / cold",
        "model": "demo target, linear RoPE scaling to a %d window (timing stand-in)" % args.stand_in
        if args.stand_in else "demo pair",
        "context": args.context, "turn_tokens": len(turn), "answer_tokens": args.answer,
        "median_ratio": median([r["ratio"] for r in rows]),
        "median_cold_s": median([r["cold_s"] for r in rows]), "median_warm_s": median([r["warm_s"] for r in rows]),
        "rows": rows, "machine": machine_info(), "dtype": str(pair.target.dtype),
        "command": "python benchmarks/prompt_cache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.disk:
        result.update(median_disk_s=median([r["disk_s"] for r in rows]),
                      median_disk_ratio=median([r["disk_ratio"] for r in rows]),
                      disk_note="warm from disk: a new PromptCache over the folder the first request's caches were "
                                "spilled to (a restarted server); the file was just written (OS page cache)")
    shutil.rmtree(folder, ignore_errors=True)
    print(f"median warm/cold time to first token: {result['median_ratio']:.3f} "
          f"({result['median_warm_s'] * 1e3:.1f} ms / {result['median_cold_s'] * 1e3:.0f} ms)")
    if args.disk:
        print(f"median warm-from-disk/cold: {result['median_disk_ratio']:.3f} "
              f"({result['median_disk_s'] * 1e3:.1f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mx.clear_cache()


if __name__ == "__main__":
    main()
