"""Structured output on the `json` suite: constrained DFlash against mlx-lm's constrained decoding
(the same grammar engine as a logits processor), against unconstrained decoding, and with the
grammar's forced tokens drafted or not.

    LD_PRELOAD=... python benchmarks/structured.py --pair widened --repeats 3 --out FILE

Settings, each run on every prompt in a fresh random order per repeat (greedy, `--max-tokens`):
  mlx-lm json     mlx-lm's `stream_generate` with `GrammarProcessor`
  mlx-lm free     mlx-lm's `stream_generate`
  ours json       `--block-size auto` with the prompt's schema
  ours json b1    `--block-size 1` with the schema (its ids must equal the two above)
  ours json, no forced drafts   the same as `ours json` with forced tokens left to the target step
                  by step (`forced_run=0` for these runs)
  ours free       `--block-size auto`, no schema
Decode tok/s is each loop's own figure (mlx-lm's `generation_tps`, ours from the first token on);
ratios are per-prompt medians over repeats, summarised as the median and geometric mean of the
per-prompt ratios. Tokens per cycle are pooled over every cycle after the first token. The
grammar's host seconds (`GenerationStats.grammar_seconds`) are given as a share of decode time.
"""

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import dflash_mlx
from dflash_mlx.bench import context_prompt, load_prompts, machine_info, validates
from dflash_mlx.constrain import Grammar
from dflash_mlx.constrain.processor import GrammarProcessor
from dflash_mlx.policy.planner import FORCED_RUN
from dflash_mlx.target.baseline import generate as baseline_generate, plain_target

sys.path.insert(0, str(Path(__file__).parent))
from seed_cost import load_pair  # noqa: E402

SETTINGS = ["mlx-lm json", "mlx-lm free", "ours json", "ours json b1", "ours json, no forced drafts", "ours free"]


def run(pair, model, setting: str, ids, schema, max_tokens: int) -> dict:
    grammar = Grammar.json_schema(schema)
    if setting.startswith("mlx-lm"):
        procs = [GrammarProcessor(pair.grammars.constraint(grammar), len(ids))] if setting == "mlx-lm json" else []
        r = baseline_generate(model, pair.tokenizer, ids, max_tokens, 0.0, procs)
        return {"tps": r["generation_tps"], "ids": r["tokens"], "finish": "length" if len(r["tokens"]) >= max_tokens
                else "stop"}
    ids_out, stats = [], None
    for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=max_tokens,
                                         block_size=1 if setting.endswith("b1") else "auto",
                                         grammar=None if setting == "ours free" else grammar,
                                         forced_run=0 if setting == "ours json, no forced drafts" else FORCED_RUN):
        ids_out += ev.tokens
        stats = ev.stats
    decode = stats.generation_tokens / stats.generation_tps if stats.generation_tps else 0.0
    return {"tps": stats.generation_tps, "ids": ids_out, "finish": stats.finish_reason,
            "cycle_tokens": sum(stats.acceptance_lengths), "cycles": len(stats.acceptance_lengths),
            "forced": stats.forced_tokens, "grammar_seconds": stats.grammar_seconds, "decode_seconds": decode}


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(runs: dict, pair, rows: list) -> dict:
    med = {s: [statistics.median(r["tps"] for r in per) for per in runs[s]] for s in SETTINGS}

    def ratio(a, b):
        rs = [x / y for x, y in zip(med[a], med[b])]
        return {"median": statistics.median(rs), "geomean": geomean(rs)}

    def per_cycle(s):
        return sum(r["cycle_tokens"] for per in runs[s] for r in per) / sum(r["cycles"] for per in runs[s] for r in per)

    ours = [r for per in runs["ours json"] for r in per]
    stopped = [(i, per[0]) for i, per in enumerate(runs["ours json"]) if per[0]["finish"] == "stop"]
    return {
        "ours json / mlx-lm json": ratio("ours json", "mlx-lm json"),
        "ours json / ours free": ratio("ours json", "ours free"),
        "mlx-lm json / mlx-lm free": ratio("mlx-lm json", "mlx-lm free"),
        "ours json / no forced drafts": ratio("ours json", "ours json, no forced drafts"),
        "tokens per cycle": {s: per_cycle(s) for s in ("ours json", "ours json, no forced drafts", "ours free")},
        "grammar share of decode time": sum(r["grammar_seconds"] for r in ours) / sum(r["decode_seconds"] for r in ours),
        "forced tokens per answer token": sum(r["forced"] for r in ours) / sum(len(r["ids"]) for r in ours),
        "identical ids (ours json, b1, mlx-lm json)": sum(
            all(r["ids"] == runs["mlx-lm json"][i][0]["ids"] for s in ("ours json", "ours json b1",
                                                                     "ours json, no forced drafts")
                for r in runs[s][i]) for i in range(len(rows))),
        "answers stopped / valid": [len(stopped), sum(validates(pair.tokenizer.decode(r["ids"]), rows[i]["schema"])
                                                      for i, r in stopped)],
        "prompts": len(rows),
    }


def suite_setup(doc: str, argv, pair: str, repeats: int):
    """The command line (`--pair`, `--repeats`, `--max-tokens`, `--out`), the pair, and the `json`
    suite's rows and prompt ids."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--pair", choices=["demo", "widened"], default=pair)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    pair = load_pair(a.pair)
    rows = load_prompts("json")["json"]
    return a, pair, rows, [context_prompt(pair.tokenizer, r["prompt"], 0) for r in rows]


def main(argv=None):
    a, pair, rows, prompts = suite_setup(__doc__, argv, "demo", 3)
    model = plain_target(pair)
    for s in SETTINGS:  # warm-up: kernels compiled, the cost curve measured, grammars compiled
        run(pair, model, s, prompts[0], rows[0]["schema"], 8)
    runs = {s: [[] for _ in rows] for s in SETTINGS}
    rng = random.Random(0)
    for rep in range(a.repeats):
        for i, (ids, row) in enumerate(zip(prompts, rows)):
            order = list(SETTINGS)
            rng.shuffle(order)
            for s in order:
                runs[s][i].append(run(pair, model, s, ids, row["schema"], a.max_tokens))
            print(f"repeat {rep + 1}/{a.repeats}, prompt {i + 1}/{len(rows)}", file=sys.stderr, flush=True)
    out = {"machine": machine_info(), "pair": a.pair, "dtype": str(model.model.embed_tokens.weight.dtype),
           "max_tokens": a.max_tokens, "repeats": a.repeats, "summary": summary(runs, pair, rows), "runs": runs}
    print(json.dumps(out["summary"], indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
