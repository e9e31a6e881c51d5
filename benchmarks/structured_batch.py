"""Structured output in a batch: the `json` suite's prompts decoded together, with their schemas
and without, at the same batch sizes.

    LD_PRELOAD=... python benchmarks/structured_batch.py --pair widened --repeats 2 --out FILE

The 8 prompts join one batch (`Streams`, as the server's worker runs them), greedy, `--max-tokens`
each. Constrained answers that end their JSON stop early and leave a smaller batch behind, while
free text runs to the budget, so a whole run's throughput compares different batch sizes; this
reports tokens per second per batch size (cycles run with that many sequences), where the two
compare like for like, and the whole run's. Settings, in a rotated order per repeat:
  json          each prompt's schema, the batch's default policy (`BatchWidths`)
  json, plain   the same at width 1 (`FixedBatchWidth(1)`): plain batched steps, no drafts
  free          no schema, the default policy
  free, plain   no schema, width 1
Both json settings must give the same ids (checked).
"""

import collections
import json
import statistics
import sys
import time
from pathlib import Path

from dflash_mlx.bench import machine_info
from dflash_mlx.constrain import Grammar
from dflash_mlx.decode.running import Asks
from dflash_mlx.decode.streams import Joining, Streams
from dflash_mlx.policy.batch import FixedBatchWidth
from dflash_mlx.target.baseline import plain_target

sys.path.insert(0, str(Path(__file__).parent))
from structured import suite_setup  # noqa: E402

SETTINGS = ["json", "json, plain", "free", "free, plain"]


def run(pair, setting: str, prompts, rows, max_tokens: int) -> dict:
    """One batch of every prompt: per batch size its cycles, tokens and seconds; each answer's ids."""
    policy = FixedBatchWidth(1) if setting.endswith("plain") else None
    streams = Streams(pair, pair.draft_source.block_size, policy, lookup=True, block_size="auto")
    joining = [Joining(list(p), max_tokens, asks=Asks(grammar=Grammar.json_schema(r["schema"])
                                                      if setting.startswith("json") else None))
               for p, r in zip(prompts, rows)]
    ids = {}
    for uid, ev in streams.add_many(joining):
        ids[uid] = list(ev.tokens)
    sizes = collections.defaultdict(lambda: [0, 0, 0.0])  # batch size -> cycles, tokens, seconds
    tic = time.perf_counter()
    while len(streams):
        B, start = len(streams.decoder.seqs), time.perf_counter()
        events = streams.step()
        s = sizes[B]
        s[0] += 1
        s[1] += sum(len(ev.tokens) for _, ev in events)
        s[2] += time.perf_counter() - start
        for uid, ev in events:
            ids[uid] += ev.tokens
    return {"sizes": dict(sizes), "seconds": time.perf_counter() - tic, "ids": [ids[u] for u in sorted(ids)]}


def summary(runs: dict, batch: int) -> dict:
    """Per setting, medians over repeats: tokens per second with all `batch` sequences decoding,
    with 3-5 of them, and over the whole run; and the cycles run at each batch size, in all."""
    def rate(r, sizes):
        picked = [v for b, v in r["sizes"].items() if int(b) in sizes]
        return sum(v[1] for v in picked) / sum(v[2] for v in picked) if picked else None

    def median(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = {}
    for s, reps in runs.items():
        out[s] = {f"tok/s at {batch}": median(rate(r, {batch}) for r in reps),
                  "tok/s at 3-5": median(rate(r, {3, 4, 5}) for r in reps),
                  "tok/s overall": median(sum(v[1] for v in r["sizes"].values()) / r["seconds"] for r in reps),
                  "cycles at each size": {b: sum(r["sizes"].get(b, r["sizes"].get(str(b), [0]))[0] for r in reps)
                                          for b in range(1, batch + 1)}}
    out["json ids identical"] = all(r["ids"] == runs["json, plain"][0]["ids"] for s in ("json", "json, plain")
                                    for r in runs[s])
    return out


def main(argv=None):
    a, pair, rows, prompts = suite_setup(__doc__, argv, "widened", 2)
    for s in SETTINGS:  # warm-up: kernels compiled, the cost curve measured, grammars compiled
        run(pair, s, prompts, rows, 8)
    runs = {s: [] for s in SETTINGS}
    for rep in range(a.repeats):
        for s in SETTINGS[rep % len(SETTINGS):] + SETTINGS[: rep % len(SETTINGS)]:
            runs[s].append(run(pair, s, prompts, rows, a.max_tokens))
            print(f"repeat {rep + 1}/{a.repeats}: {s}", file=sys.stderr, flush=True)
    dtype = str(plain_target(pair).model.embed_tokens.weight.dtype)
    out = {"machine": machine_info(), "pair": a.pair, "dtype": dtype, "max_tokens": a.max_tokens, "repeats": a.repeats,
           "summary": summary(runs, len(rows)), "runs": runs}
    print(json.dumps(out["summary"], indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
