"""A wave of requests joining one batch as the server's worker takes them, in one process, without HTTP.

    LD_PRELOAD=... python benchmarks/batch_wave.py --pair ~/.cache/dflash-mlx/peers/pairs/widened \
        --clients 16 --rounds 2 --checkout /tmp/before-0279c43 --out results/batch-wave-....json

N prompts of the `code` suite (with the target's chat template; `--suite json`: the `json` suite's, each
keeping to its strict schema, as `serve_load.py --suite json` asks the server) join a `Streams` batch as
`serve.worker` lets them in when they come at once: the first alone, then the rest together, and
decode greedily to `--max-tokens` each, with a prompt cache and the batch policy the server uses
(both outlive the rounds, as in a server). A warm-up round runs first (it fills the prompt cache, so
the timed rounds' joins find their prompts there, as a repeated load does). Per round: the seconds
each join took, the median time to a request's first event, the wall time, the cycles the batch ran
and how many of them drafted. `--checkout DIR` measures the package of another checkout of this
repository (a git worktree) instead of this one: run the script once for each, taking turns.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/ (peers/widen.py)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--suite", default="code", choices=["code", "json"])
    ap.add_argument("--checkout", help="measure the package of this checkout (default: this one)")
    ap.add_argument("--out", help="write the rounds here (JSON)")
    args = ap.parse_args(argv)
    if args.clients < 2 or args.rounds < 1:
        ap.error("give --clients of 2 or more and --rounds of 1 or more")
    root = Path(args.checkout or Path(__file__).resolve().parents[1]).resolve()
    if not (root / "dflash_mlx" / "__init__.py").exists():
        ap.error(f"--checkout {root}: no dflash_mlx package there; give a checkout of this repository")
    sys.path.insert(0, str(root))

    import dflash_mlx
    from dflash_mlx.bench import load_prompts, machine_info
    from dflash_mlx.cache.prompt_cache import PromptCache
    from dflash_mlx.constrain.grammar import Grammar
    from dflash_mlx.decode.decoder import Asks, batch_width
    from dflash_mlx.decode.streams import Joining, Streams
    from dflash_mlx.machine import blas_name
    from dflash_mlx.policy.batch import BatchWidths
    from dflash_mlx.prompt import build_prompt

    pair_dir = Path(args.pair).expanduser()
    pair = dflash_mlx.load(str(pair_dir / "target"), draft=str(pair_dir / "drafter"))
    suite = load_prompts(args.suite)[args.suite]
    texts = [p if isinstance(p, str) else p["prompt"] for p in suite]
    schemas = [p["schema"] if isinstance(p, dict) and "schema" in p else None for p in suite]
    prompts = [build_prompt(pair.tokenizer, t) for t in texts]
    prompts = (prompts * -(-args.clients // len(prompts)))[: args.clients]
    schemas = (schemas * -(-args.clients // len(schemas)))[: args.clients]

    def asks(schema):
        return Asks(grammar=Grammar.json_schema(schema)) if schema is not None else Asks()
    width = batch_width(pair, None)
    policy, cache = BatchWidths(width), PromptCache(pair)

    def wave() -> dict:
        batch = Streams(pair, width, policy, cache, block_size=pair.draft_source.block_size)
        tic, first, joins = time.perf_counter(), {}, []
        for group in ((0, 1), (1, len(prompts))):
            t = time.perf_counter()
            started = batch.add_many([Joining(list(prompts[i]), args.max_tokens, asks=asks(schemas[i]))
                                      for i in range(*group)])
            joins.append(time.perf_counter() - t)
            for uid, event in started:
                if event is not None:
                    first[uid] = time.perf_counter() - tic
        cycles = drafted = 0
        seen = {}  # each request's drafted cycles so far
        while len(batch):
            events = batch.step()
            for uid, _ in events:
                first.setdefault(uid, time.perf_counter() - tic)
            cycles += 1
            drafted += any(e.stats.draft_cycles > seen.get(uid, 0) for uid, e in events)
            seen.update((uid, e.stats.draft_cycles) for uid, e in events)
            batch.keep()
        return {"wall_s": time.perf_counter() - tic, "ttft_median_s": statistics.median(first.values()),
                "join_s": joins, "cycles": cycles, "drafted_cycles": drafted}

    wave()  # warm-up: the prompt cache and the policy's first figures
    rounds = []
    for r in range(args.rounds):
        rounds.append(wave())
        x = rounds[-1]
        print(f"{root.name} round {r}: wall {x['wall_s']:.2f} s, first token {x['ttft_median_s']:.3f} s (median), "
              f"joins {' + '.join(f'{s:.3f}' for s in x['join_s'])} s, cycles {x['cycles']} "
              f"({x['drafted_cycles']} drafted)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine_info(), "blas": blas_name(), "package": str(root),
                                              "settings": vars(args), "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
