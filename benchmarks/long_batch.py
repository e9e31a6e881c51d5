"""A long prompt in a batch of short ones: the memory the batch holds and the short streams' speed.

    LD_PRELOAD=... python benchmarks/long_batch.py --pair ~/.cache/dflash-mlx/peers/pairs/widened \
        [--long 16384] [--short 512] [--streams 7] [--steps 24] [--before REV] [--out FILE]

On a RoPE-scaled stand-in of the pair's target (its positions scaled into the window it was trained
on, `--long` tokens past it), in greedy decoding through `decode.decoder.Decoder` (every batched cycle
at `--width`; each sequence with the adaptive sizer's statistics, as the server runs them):
- memory: the long prompt and `--streams` short ones decode in one batch; the memory the batch
  holds past the weights (`mx.get_active_memory` after each cycle, at its largest) against the sum of
  what each sequence holds decoding alone, and the same for the caches' own byte counts (the
  target's K/V and the drafter's context);
- speed: the short streams' tokens per second decoding beside the long one against the same
  streams decoding without it, once the batch has formed: the first `WARMUP` cycles after the last
  join (the drafter reading the prompts' held taps, the batch policy's first widths) are timed apart;
  split into the short streams' tokens per cycle and the seconds per cycle;
- joins: the K/V bytes of the sequences decoding already that a joining prompt's caches copy
  (arrays of theirs replaced by the join);
- what one row of the long prompt's attention costs on its own (`row_attention`, and the same at the
  short length, and at the long one read once: `--attention-only` times these alone): the part of a
  cycle beside it that no layout saves, since the short streams wait for the pass that carries it.
With `--before REV`, the same measurements run first on the package from that commit (a temporary
git worktree): both sets of figures come from one run on one machine.
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 2  # cycles after the last join before the speed is timed: the join's own cost is `join_stall.py`'s


def stand_in(pair: Path, long: int, out: Path) -> Path:
    """A copy of the pair's target whose RoPE positions are scaled so `long` + 1k tokens fit its window."""
    cfg = json.loads((pair / "target" / "config.json").read_text())
    trained = cfg["max_position_embeddings"]
    factor = max(1, -(-(long + 1024) // trained))
    folder = out / "target"
    folder.mkdir(parents=True, exist_ok=True)
    for f in (pair / "target").iterdir():
        if f.name != "config.json":
            dst = folder / f.name
            if not dst.exists():
                os.symlink(f, dst)
    cfg.update(max_position_embeddings=trained * factor,
               rope_scaling={"type": "linear", "factor": float(factor)} if factor > 1 else None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def prompts(tokenizer, long: int, short: int, streams: int):
    text = gzip.decompress((REPO / "dflash_mlx" / "suites" / "document.txt.gz").read_bytes()).decode()
    ids = tokenizer.encode(text)
    return ids[:long], [ids[long + i * short : long + (i + 1) * short] for i in range(streams)]


def arrays(c) -> list:
    """The arrays a cache holds: K/V (a sequence's, a padded batch's, a batch held per sequence, a
    drafter context) or recurrent states."""
    if c is None:
        return []
    if isinstance(c, (list, tuple)):
        return [a for x in c for a in arrays(x)]
    for name in ("parts", "caches", "kv"):  # a batch held in parts or per sequence; a padded drafter batch
        if hasattr(c, name):
            return arrays(getattr(c, name))
    if hasattr(c, "keys"):
        return [a for a in (c.keys, c.values) if a is not None]
    return [a for a in getattr(c, "cache", []) if a is not None]  # recurrent states


def held(dec) -> int:
    """Bytes the decoder's caches hold, each array once: the target's K/V and states, the pooled
    drafter contexts and the sequences' own, and the taps a sequence holds for its drafter to read
    (a prompt's, until its first drafted cycle: alone, a long prompt that steps plainly holds them
    where in a batch the pooled drafter has read them into its context)."""
    found = arrays(dec.caches.layers)
    if dec.drafting.pool is not None:
        found += arrays(dec.drafting.pool.cache)
    for s in dec.seqs:
        found += arrays(s.source.context(s.dstate)) + [a for t in s.taps for a in (t if isinstance(t, tuple) else [t])]
    return sum({id(a): a.nbytes for a in found}.values())


def kv_arrays(dec) -> dict:
    """{id: bytes} of the arrays the target's caches hold now."""
    return {id(a): a.nbytes for a in arrays(dec.caches.layers)}


def row_attention(target: str, columns: int, repeats: int = 20, once: bool = False) -> float:
    """Seconds of one query row's attention over `columns` rows of K/V in every full-attention layer
    of the target (its heads and head size, float32), as its attention runs it
    (`mx.fast.scaled_dot_product_attention` on K/V held in mlx-lm's `KVCache`): what a sequence of
    that length adds to a batch's pass, beyond its rows through the weights. With `once`, the same
    attention with the query heads that share a K/V head grouped as rows of one product, so that
    each K/V head is read once. Median of `repeats`."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cfg = json.loads((Path(target) / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    caches = []
    for _ in range(cfg["num_hidden_layers"]):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, kv, columns, dim)), mx.random.normal((1, kv, columns, dim)))
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches])
    q, new = mx.random.normal((1, heads, 1, dim)), mx.random.normal((1, kv, 1, dim))

    def attend(k, v):
        if not once:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5)
        grouped = q.reshape(1, kv, heads // kv, dim) * dim**-0.5
        weights = mx.softmax(grouped @ k.swapaxes(-1, -2), axis=-1, precise=True)
        return (weights @ v).reshape(1, heads, 1, dim)

    times = []
    for _ in range(repeats + 2):
        tic = time.perf_counter()
        outs = []
        for c in caches:
            outs.append(attend(*c.update_and_fetch(new, new)))
        mx.eval(outs)
        times.append(time.perf_counter() - tic)
        for c in caches:
            c.trim(1)
    return sorted(times[2:])[repeats // 2]


def measure(target: str, drafter: str, long: int, short: int, streams: int, steps: int, width: int) -> dict:
    """Run in the package under test (its `dflash_mlx` on sys.path)."""
    import mlx.core as mx

    import dflash_mlx
    from dflash_mlx.decode.decoder import Decoder

    pair = dflash_mlx.load(target, drafter)
    long_p, short_p = prompts(pair.tokenizer, long, short, streams)
    mx.eval(pair.target.model.parameters(), pair.drafter.parameters())
    weights = mx.get_active_memory()

    def decode(ps, n_steps, count=None):
        """Decode `ps` in one batch for `WARMUP` + `n_steps` cycles: (peak held bytes, cache bytes,
        tokens of the sequences `count` per second past the warm-up, K/V bytes of the others the joins
        replaced, seconds of the warm-up cycles)."""
        dec = Decoder(pair, width, block_size="auto")  # each sequence weighs its own rows, as served
        firsts = dec.add_many(ps[:1], [(WARMUP + n_steps) * width + 8])
        copied = 0
        for p in ps[1:]:
            before = kv_arrays(dec)
            firsts += dec.add_many([p], [(WARMUP + n_steps) * width + 8])
            after = kv_arrays(dec)
            copied += sum(n for i, n in before.items() if i not in after)
        uids = [f.uid for f in firsts]
        counted = set(uids if count is None else [uids[i] for i in count])
        mx.synchronize()
        peak, tokens, tic, warm = 0, 0, time.perf_counter(), 0.0
        for i in range(WARMUP + n_steps):
            if i == WARMUP:
                tokens, warm, tic = 0, time.perf_counter() - tic, time.perf_counter()
            for c in dec.step():
                tokens += len(c.tokens) if c.uid in counted else 0
            mx.synchronize()
            peak = max(peak, mx.get_active_memory() - weights)
        seconds = time.perf_counter() - tic
        return peak, held(dec), tokens / seconds, copied, warm, tokens / n_steps, seconds / n_steps

    print(f"{target}: the long prompt and one short one alone", file=sys.stderr, flush=True)
    alone = [decode([p], steps) for p in [long_p] + short_p[:1]]
    print(f"{target}: the long prompt beside {streams} short ones", file=sys.stderr, flush=True)
    together = decode([long_p] + short_p, steps, count=list(range(1, streams + 1)))
    print(f"{target}: the short ones without it", file=sys.stderr, flush=True)
    without = decode(short_p, steps)
    attention = {n: row_attention(target, n) for n in (long, short)}
    attention["once"] = row_attention(target, long, once=True)
    own = alone[0][0] + streams * alone[1][0]
    own_bytes = alone[0][1] + streams * alone[1][1]
    return {"weights_bytes": weights, "held_alone_sum": own, "held_batch": together[0],
            "held_ratio": together[0] / own, "cache_bytes_alone_sum": own_bytes, "cache_bytes_batch": together[1],
            "cache_ratio": together[1] / own_bytes, "short_tps_beside_long": together[2],
            "short_tps_without": without[2], "speed_ratio": together[2] / without[2],
            "kv_bytes_copied_by_joins": together[3], "warmup_seconds_beside_long": together[4],
            "warmup_seconds_without": without[4],
            "short_tokens_per_cycle_beside_long": together[5], "short_tokens_per_cycle_without": without[5],
            "cycle_seconds_beside_long": together[6], "cycle_seconds_without": without[6],
            "row_attention_seconds_long": attention[long], "row_attention_seconds_short": attention[short],
            "row_attention_seconds_long_read_once": attention["once"]}


def run(root: Path, args, target: Path) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
            "import long_batch; print(json.dumps(long_batch.measure(*sys.argv[3:5], *map(int, sys.argv[5:]))))")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    print(f"measuring the package under {root}", file=sys.stderr, flush=True)
    out = subprocess.run([sys.executable, "-c", code, str(root), str(Path(__file__).parent), str(target),
                          str(args.pair / "drafter"), str(args.long), str(args.short), str(args.streams),
                          str(args.steps), str(args.width)], env=env, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        sys.exit(f"The measurement under {root} failed (exit {out.returncode}); its error is printed above.")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, required=True, help="a folder with target/ and drafter/ (peers/widen.py)")
    ap.add_argument("--long", type=int, default=16384)
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--streams", type=int, default=7)
    ap.add_argument("--steps", type=int, default=24, help="cycles timed per measurement, after WARMUP")
    ap.add_argument("--width", type=int, default=8, help="the batch's block width")
    ap.add_argument("--before", help="also measure the package at this git revision first")
    ap.add_argument("--attention-only", action="store_true",
                    help="time only `row_attention` at --long and --short columns (and read once at --long)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    for need in ("target/config.json", "drafter"):
        if not (args.pair / need).exists():
            ap.error(f"--pair {args.pair} has no {need}; build the pair with benchmarks/peers/widen.py")
    if args.attention_only:
        target = str(args.pair / "target")
        times = {"long": row_attention(target, args.long), "short": row_attention(target, args.short),
                 "long_read_once": row_attention(target, args.long, once=True)}
        print(json.dumps({"command": " ".join(sys.argv), "row_attention_seconds": times}, indent=2))
        return
    work = Path(tempfile.mkdtemp(prefix="long-batch-"))
    try:
        target = stand_in(args.pair, args.long, work / "pair")
        results = {}
        if args.before:
            tree = work / "before"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.before],
                           check=True, capture_output=True)
            try:
                results["before"] = run(tree, args, target)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        results["now"] = run(REPO, args, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
