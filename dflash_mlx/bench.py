"""`dflash-mlx bench`: DFlash against plain mlx-lm decoding on the same tokens.

Each prompt runs the baseline (mlx-lm's own `stream_generate` on a plain,
unwrapped instance of the target holding the same weights) and DFlash at
every requested block size after a warm-up; greedy outputs are compared token
for token. Repeats interleave the settings in a random order each time.
Speedups are ratios of medians taken in the same run, and ratios of geometric
means over prompts (a paired comparison: the mean of per-prompt ratios,
steadier on a noisy machine). Prompt throughput is each loop's own figure for
the same prompt: mlx-lm's `prompt_tps`, and ours (prefill to the first token).

With `oracle`, each DFlash run drafts the target's own greedy continuation,
and right after it the same cycles are split: the loop is run again with the
target's passes replaced by their results (`ResultsTarget`; its time is the
loop's own work per cycle: drafting, acceptance, the host synchronisation,
cropping, detokenizing), and the target's bare verify passes of those cycles
are timed alone at the same widths and context lengths. Part of the loop's
work runs while the target's pass computes, so the two need not add up to a
cycle; neither is a difference of separately taken timings, so neither can
come out negative (a cost curve measured apart can: it differs from the
loop's cycles by more than the loop's own work, on a machine whose speed
wanders).
"""

import copy
import functools
import gzip
import json
import math
import os
import platform
import random
import statistics
import time
from collections import Counter
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx

from .policy.costs import CostCurve, measure_cost_curve
from .target.baseline import generate as baseline_generate, plain_target
from .decode import stream_generate
from .decode.cycle import Block, LinearCycle, PlainStep, Rows
from .decode.sequence import SequenceState
from .decode.timing import cycle_parts
from .draft.source import DraftSource
from .machine import blas_name, peak_memory_gb
from .errors import DFlashError
from .prompt import build_prompt
from .sampling import SamplingParams
from .constrain.grammar import Grammar
from .constrain.processor import GrammarProcessor

SUITES = ("code", "math", "chat", "json")
SCHEMA_VERSION = 3


def machine_info() -> Dict:
    info = mx.device_info()  # chip name on every backend; memory on Metal and CUDA
    cpu = info.get("device_name") or platform.processor() or platform.machine()
    memory = info.get("memory_size")
    if memory is None:  # the CPU backend does not report it
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = None
    memory = None if memory is None else memory / 1e9
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "chip": cpu,
        "cores": os.cpu_count(),
        "memory_gb": None if memory is None else round(memory, 1),
        "mlx": mx.__version__,
        "backend": "metal" if mx.default_device() == mx.gpu and mx.metal.is_available() else str(mx.default_device()),
        "blas": blas_name(),
    }


def prompt_text(prompt) -> str:
    """A prompt's text (a `json` suite prompt also has its schema)."""
    return prompt if isinstance(prompt, str) else prompt["prompt"]


def load_prompts(suite: Optional[str] = None, path: Optional[str] = None) -> Dict[str, list]:
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise DFlashError(f"--prompts {path} does not exist; give a .jsonl file of {{\"prompt\": ...}} rows.")
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            raise DFlashError(f"--prompts {path} is not UTF-8 text; give a .jsonl file of {{\"prompt\": ...}} rows.")
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(_prompt_row(row) if isinstance(row, dict) else None)
            except (ValueError, KeyError, RecursionError):
                rows.append(None)
            if rows[-1] is None:
                raise DFlashError(f"{path}:{n} must be a JSON object with a 'prompt' string (and, to constrain "
                                  "the answer, a 'schema' object).")
        if not rows:
            raise DFlashError(f"--prompts {path} holds no prompts; give a .jsonl file of {{\"prompt\": ...}} rows.")
        return {p.stem: rows}
    names = SUITES if suite in (None, "all") else (suite,)
    if any(n not in SUITES for n in names):
        raise DFlashError(f"--suite must be one of {', '.join(SUITES)} or all (got {suite}).")
    out = {}
    for name in names:
        text = resources.files("dflash_mlx").joinpath(f"suites/{name}.jsonl").read_text()
        out[name] = [_prompt_row(json.loads(line)) for line in text.splitlines() if line.strip()]
    return out


def _prompt_row(row: dict):
    """A prompt's text, or with a JSON schema its answer keeps to, {"prompt", "schema"}."""
    if not isinstance(row.get("prompt"), str) or not isinstance(row.get("schema", {}), dict):
        return None
    return {"prompt": row["prompt"], "schema": row["schema"]} if "schema" in row else row["prompt"]


def validates(text: str, schema: dict) -> bool:
    """Whether `text` is JSON that validates against `schema`."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class OracleSource(DraftSource):
    """Drafts the target's own continuation: every block is fully accepted."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], vocab_size: int, block_size: int):
        self.seq = list(prompt) + list(continuation)
        self.vocab_size = vocab_size
        self.block_size = block_size

    def new_state(self):
        return {"committed": 0}

    def add_context(self, state, hidden):
        state["committed"] += hidden.shape[1]

    def propose(self, state, last, hidden, width):
        if hidden is not None:
            state["committed"] += hidden.shape[1]
        p = state["committed"]
        draft = self.seq[p + 1 : p + width]
        draft += [0] * (width - 1 - len(draft))
        one_hot = mx.arange(self.vocab_size)[None] == mx.array(draft)[:, None]
        return one_hot.astype(mx.float32) * 100.0


def _dflash_run(pair, ids, max_tokens, params, block_size, source=None, grammar=None):
    tokens, stats, ttft = [], None, None
    tic = time.perf_counter()
    for ev in stream_generate(pair, ids, max_tokens=max_tokens, sampling=params, block_size=block_size,
                              draft_source=source, grammar=grammar):
        if ttft is None:
            ttft = time.perf_counter() - tic
        tokens += ev.tokens
        stats = ev.stats
    return {"tokens": tokens, "generation_tps": stats.generation_tps, "prompt_tps": stats.prompt_tps,
            "ttft": ttft, "acceptance_lengths": stats.acceptance_lengths,
            "draft_cycles": stats.draft_cycles, "lookup_cycles": stats.lookup_cycles, "tree_cycles": stats.tree_cycles,
            "forced_tokens": stats.forced_tokens, "grammar_seconds": stats.grammar_seconds,
            "finish_reason": stats.finish_reason,
            "decode_seconds": stats.generation_tokens / stats.generation_tps if stats.generation_tps else 0.0}


class ResultsTarget:
    """Stands in for the target after the prompt: each pass returns the
    logits of a known greedy sequence (and zero taps) at once, so the loop
    makes the cycles it made with the target, and timing it times everything
    in a cycle but the target's pass. The prompt runs through the real target.
    Records each cycle's (width, kept positions)."""

    def __init__(self, target, seq: Sequence[int], prompt_tokens: int):
        self._target, self._prompt_tokens = target, prompt_tokens
        hot = mx.arange(target.vocab_size)[None] == mx.array(list(seq[1:]))[:, None]
        self._logits = hot.astype(target.dtype) * 100
        mx.eval(self._logits)
        self.pos, self.cycles, self._taps = 0, [], None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def make_cache(self):
        self.pos, self.cycles = 0, []
        return self._target.make_cache()

    def __call__(self, tokens, cache, **kwargs):
        n = tokens.shape[1]
        if self.pos < self._prompt_tokens:
            self.pos += n
            logits, taps = self._target(tokens, cache, **kwargs)
            self._taps = (taps.shape[-1], taps.dtype)
            return logits, taps
        logits = self._logits[self.pos : self.pos + n][None]
        self.pos += n
        self.cycles.append([n, n])
        return logits, mx.zeros((1, n, self._taps[0]), self._taps[1])

    def crop(self, cache, keep, width, before=None):
        self.pos -= width - keep
        self.cycles[-1][1] = keep


def verify_seconds(pair, seq: Sequence[int], prompt_tokens: int, cycles) -> float:
    """Seconds of the target's bare verify passes (each settled alone, as the loop's cycles)
    over `cycles` [(width, kept)], at the context lengths the loop ran them."""
    target, source = pair.target, pair.draft_source
    tcache = target.make_cache()
    for s in range(0, prompt_tokens, 2048):
        target(mx.array(seq[s : min(s + 2048, prompt_tokens)])[None], tcache, last_only=True)
        mx.eval([c.state for c in tcache])
    rows = Rows(target, tcache, [SequenceState(source=source, dstate=source.new_state())])
    pos, total = prompt_tokens, 0.0
    for width, kept in cycles:
        block = mx.array(seq[pos : pos + width], dtype=mx.uint32)
        mx.eval(block)
        tic = time.perf_counter()
        if width == 1:
            PlainStep(rows, block).settle()
        else:
            cycle = LinearCycle(rows, Block(block[:1], block[None, 1:], [None], [None]))
            cycle.settle()
        total += time.perf_counter() - tic
        if width > 1:
            cycle.cut([kept])
        pos += kept
    return total


def _oracle_split(pair, ids, run, max_tokens, params, block_size, source) -> Dict:
    """An oracle run's cycles, split right after it runs: the loop's own work
    (the loop run again on `ResultsTarget`) and the target's bare verify
    passes of the same cycles."""
    eos = list(getattr(pair.tokenizer, "eos_token_ids", None) or [0])
    seq = list(ids) + run["tokens"] + eos[:1] * (block_size + 1)
    stand_in = copy.copy(pair)
    stand_in.target = ResultsTarget(pair.target, seq, len(ids))
    loop = _dflash_run(stand_in, ids, max_tokens, params, block_size, source)
    cycles = stand_in.target.cycles
    if loop["tokens"] != run["tokens"] or len(cycles) != len(run["acceptance_lengths"]):
        raise DFlashError("The oracle run could not be replayed cycle for cycle; its overhead is not measured.")
    return {"cycles": len(cycles), "seconds": run["decode_seconds"],
            "verify_seconds": verify_seconds(pair, seq, len(ids), cycles),
            "overhead_seconds": loop["decode_seconds"]}


def median(xs):
    """Median of the values that are not None (None if none are)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def geomean(xs):
    """Geometric mean of the nonzero values (None if none are)."""
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarise(rows: List[Dict], key: str) -> Dict:
    base = median([r["baseline"]["generation_tps"] for r in rows])
    ours = median([r["dflash"][key]["generation_tps"] for r in rows])
    # Geometric means over prompts: their ratio is the mean of per-prompt
    # ratios, a paired comparison steadier than a ratio of medians.
    base_g = geomean([r["baseline"]["generation_tps"] for r in rows])
    ours_g = geomean([r["dflash"][key]["generation_tps"] for r in rows])
    lengths = [a for r in rows for a in r["dflash"][key]["acceptance_lengths"]]
    base_p = median([r["baseline"]["prompt_tps"] for r in rows])
    ours_p = median([r["dflash"][key]["prompt_tps"] for r in rows])
    out = {
        "prompts": len(rows),
        "baseline_tps": base,
        "dflash_tps": ours,
        "speedup": None if not base or ours is None else ours / base,
        "baseline_tps_geomean": base_g,
        "dflash_tps_geomean": ours_g,
        "speedup_geomean": None if not base_g or ours_g is None else ours_g / base_g,
        # The median prompt's own ratio: paired, as the geometric means are, and robust to one outlier.
        "speedup_median_per_prompt": median([r["dflash"][key]["generation_tps"] / r["baseline"]["generation_tps"]
                                             for r in rows if r["baseline"]["generation_tps"]
                                             and r["dflash"][key]["generation_tps"] is not None]),
        "mean_acceptance": sum(lengths) / len(lengths) if lengths else None,
        "cycles": len(lengths),
        "draft_cycles": sum(r["dflash"][key].get("draft_cycles", 0) for r in rows),
        "lookup_cycles": sum(r["dflash"][key].get("lookup_cycles", 0) for r in rows),
        "tree_cycles": sum(r["dflash"][key].get("tree_cycles", 0) for r in rows),
        "acceptance_histogram": {str(k): v for k, v in sorted(Counter(lengths).items())},
        "baseline_prompt_tps": base_p,
        "dflash_prompt_tps": ours_p,
        "prompt_speedup": None if not base_p or ours_p is None else ours_p / base_p,
        "baseline_ttft": median([r["baseline"]["ttft"] for r in rows]),
        "dflash_ttft": median([r["dflash"][key]["ttft"] for r in rows]),
        "identical": sum(1 for r in rows if r["dflash"][key]["identical"] is True),
        "forced_tokens": sum(r["dflash"][key].get("forced_tokens", 0) for r in rows),
        "grammar_seconds": sum(r["dflash"][key].get("grammar_seconds", 0.0) for r in rows),
        "stopped": sum(1 for r in rows if r["dflash"][key].get("finish_reason") == "stop"),
        "invalid_prompts": [r["prompt"] for r in rows if r["dflash"][key].get("valid") is False],
        "mismatched_prompts": [r["prompt"] for r in rows if r["dflash"][key]["identical"] is False],
    }
    splits = [o for r in rows for o in r["dflash"][key].get("oracle_runs", [])]
    if splits:
        # Totals over every oracle run: each split was measured right after its run.
        cycles = sum(o["cycles"] for o in splits)
        out["seconds_per_cycle"] = sum(o["seconds"] for o in splits) / cycles
        out["verify_seconds_per_cycle"] = sum(o["verify_seconds"] for o in splits) / cycles
        out["overhead_seconds_per_cycle"] = sum(o["overhead_seconds"] for o in splits) / cycles
    return out


# A context prompt's length is the context give or take a few tokens (the
# document is cut, decoded and encoded again with the prompt after it).
CONTEXT_SLACK = 16


@functools.lru_cache(maxsize=1)
def document() -> str:
    """A long document to put before prompts: about 77k tokens of this package's
    source, frozen in `suites/document.txt.gz` so that a context prompt is the same
    in every version (figures taken at different commits compare the same prompts)."""
    return gzip.decompress(resources.files("dflash_mlx").joinpath("suites/document.txt.gz").read_bytes()).decode()


def context_prompt(tok, text: str, context: int = 0) -> List[int]:
    """The prompt for `text`, after about `context` tokens of `document()` when `context` is set."""
    ids = build_prompt(tok, text)
    if not context or context <= len(ids):
        return ids
    text_doc = document()
    doc = tok.encode(text_doc[: 6 * context])  # enough characters for `context` tokens in any tokenizer
    if len(doc) < context:
        doc = tok.encode(text_doc) * (context // len(doc) + 1)
    return build_prompt(tok, tok.decode(doc[: context - len(ids)]) + "\n\n" + text)


def check_context(pair, contexts: Sequence[int], max_tokens: int) -> None:
    """Each context, its prompt and a `max_tokens` answer must fit the target's window."""
    window = getattr(pair.target.args, "max_position_embeddings", None)
    over = [c for c in contexts if window and c + CONTEXT_SLACK + max_tokens > window]
    if over:
        raise DFlashError(f"--context {over[0]} with {max_tokens} new tokens does not fit the model's window of "
                          f"{window} tokens (max_position_embeddings); use a shorter context or --max-tokens, "
                          "or a long-context model.")


class Interrupted(KeyboardInterrupt):
    """A benchmark stopped by Ctrl-C (or SIGTERM, where the caller turns it into one), with
    `result`: the prompts it finished, the result marked partial."""

    def __init__(self, result: Dict):
        super().__init__()
        self.result = result


def run_bench(pair, prompts: Dict[str, List[str]], max_tokens: int = 128,
              block_sizes: Sequence[Union[int, str]] = ("auto",), temp: float = 0.0, repeats: int = 1,
              oracle: bool = False, progress=lambda done, total, what: None, context: int = 0) -> Dict:
    """Plain mlx-lm decoding and DFlash at each block size on each prompt, interleaved;
    with `context`, each prompt comes after about that many tokens of a long document.

    Interrupted, it raises `Interrupted` with the result of the prompts finished so far."""
    params = SamplingParams(temp=temp, seed=0 if temp > 0 else None)
    settings = {"max_tokens": max_tokens, "block_sizes": [str(b) for b in block_sizes], "temp": temp,
                "repeats": repeats, "oracle": oracle, "context": context, "draft_context": pair.draft_context}
    planned, suites = sum(len(v) for v in prompts.values()), {}
    try:
        _measure(pair, prompts, max_tokens, block_sizes, temp, repeats, oracle, progress, context, params, suites)
    except KeyboardInterrupt:
        raise Interrupted(assemble(pair, suites, block_sizes, settings, planned)) from None
    return assemble(pair, suites, block_sizes, settings, planned)


def _measure(pair, prompts, max_tokens, block_sizes, temp, repeats, oracle, progress, context, params,
             suites: Dict[str, List[Dict]]) -> None:
    """Add each prompt's row to `suites` as soon as all its runs are done."""
    # mlx-lm on the model the adapter wrapped would time our wrappers too.
    tok, model = pair.tokenizer, plain_target(pair)
    total = sum(len(v) for v in prompts.values()) * (1 + len(block_sizes)) * repeats
    done, rng = 0, random.Random(0)
    # Warm-up: compile kernels and fill allocator caches once for each path,
    # on the longest prompt, so neither path's prefill meets sizes first.
    first = max((context_prompt(tok, prompt_text(t), context) for texts in prompts.values() for t in texts), key=len)
    progress(0, total, "warming up")
    baseline_generate(model, tok, first, 8, temp)
    for bs in block_sizes:
        _dflash_run(pair, first, 8, params, bs)
    for suite, texts in prompts.items():
        for prompt in texts:
            text, schema = prompt_text(prompt), None if isinstance(prompt, str) else prompt["schema"]
            ids = context_prompt(tok, text, context)
            grammar = None if schema is None else Grammar.json_schema(schema)

            def processors():  # mlx-lm's: the same grammar engine, a fresh matcher per run
                return [] if grammar is None else [GrammarProcessor(pair.grammars.constraint(grammar), len(ids))]

            runs, dr, source = [], {bs: [] for bs in block_sizes}, None
            if oracle:  # the target's own greedy continuation, drafted back to it
                source = OracleSource(ids, baseline_generate(model, tok, ids, max_tokens, temp, processors())["tokens"],
                                      pair.target.vocab_size, pair.draft_source.block_size)
            # Repeats interleave the settings in a fresh random order each
            # time, so neither a slow spell of the machine nor what ran just
            # before falls on one setting more than another.
            for r in range(repeats):
                order = [None, *block_sizes]  # None: the baseline
                rng.shuffle(order)
                for bs in order:
                    what = "baseline" if bs is None else f"block {bs}"
                    progress(done, total, f"{suite}: {what}")  # said before it runs: a long prompt takes minutes
                    if bs is None:
                        runs.append(baseline_generate(model, tok, ids, max_tokens, temp, processors()))
                    else:
                        bs_run = bs if not (oracle and bs == "auto") else pair.draft_source.block_size
                        run = _dflash_run(pair, ids, max_tokens, params, bs_run, source, grammar)
                        if oracle:
                            run["oracle"] = _oracle_split(pair, ids, run, max_tokens, params, bs_run, source)
                        dr[bs].append(run)
                    done += 1
            base = dict(runs[0], generation_tps=median([r["generation_tps"] for r in runs]),
                        prompt_tps=median([r["prompt_tps"] for r in runs]))
            row = {"prompt": text, "prompt_tokens": len(ids), "baseline": {k: v for k, v in base.items() if k != "tokens"},
                   "dflash": {}}
            row["baseline"]["generated_tokens"] = len(base["tokens"])
            for bs in block_sizes:
                d = dict(dr[bs][0], generation_tps=median([x["generation_tps"] for x in dr[bs]]),
                         prompt_tps=median([x["prompt_tps"] for x in dr[bs]]))
                d.pop("oracle", None)
                if oracle:
                    d["oracle_runs"] = [x["oracle"] for x in dr[bs]]
                d["identical"] = all(x["tokens"] == base["tokens"] for x in dr[bs]) if temp == 0 else None
                if schema is not None:  # an answer that stopped (not cut by the budget) validates
                    d["valid"] = all(validates(tok.decode(x["tokens"]), schema) for x in dr[bs]
                                     if x["finish_reason"] == "stop")
                d["generated_tokens"] = len(d.pop("tokens"))
                row["dflash"][str(bs)] = d
            suites.setdefault(suite, []).append(row)
    progress(done, total, "measured")


def assemble(pair, suites: Dict[str, List[Dict]], block_sizes, settings: Dict, planned: int) -> Dict:
    """The result of the prompts measured (`suites`: the suites with a finished prompt, their
    rows), marked partial where fewer than the `planned` prompts are."""
    measured = sum(len(rows) for rows in suites.values())
    result = {
        "schema_version": SCHEMA_VERSION,
        "partial": measured < planned,
        "prompts_measured": measured,
        "prompts_planned": planned,
        "machine": machine_info(),
        "model": str(pair.target_path),
        "draft": str(pair.draft_path),
        "settings": settings,
        "peak_memory_gb": peak_memory_gb(),
        "suites": {},
        "overall": {},
    }
    all_rows = [r for rows in suites.values() for r in rows]
    for bs in block_sizes:
        key = str(bs)
        result["overall"][key] = summarise(all_rows, key)
        for suite, rows in suites.items():
            result["suites"].setdefault(suite, {})[key] = summarise(rows, key)
    result["prompts"] = suites
    # A stopped run's ranks are no longer in step: their collectives would not meet.
    if pair.group is not None and measured == planned:
        result["distributed"] = communication(pair, result["overall"])
    return result


def communication(pair, overall: Dict) -> Dict:
    """Under `mlx.launch`: the sharded target's all_sums per pass, their time
    alone at each width, and their share of a baseline step and of a DFlash
    cycle (seconds per cycle: tokens per cycle / tokens per second)."""
    from .distributed import collectives_per_pass, communication_seconds

    widths = sorted({1} | {int(k) for k in overall if k.isdigit()})
    seconds = communication_seconds(pair, widths)
    out = {"ranks": pair.group.size(), "collectives_per_pass": collectives_per_pass(pair.target.model),
           "seconds_per_pass": {str(w): s for w, s in seconds.items()}, "share": {}}
    first = next(iter(overall.values()), None)
    if first and first["baseline_tps"]:
        out["share"]["baseline"] = seconds[1] * first["baseline_tps"]
    for key, s in overall.items():
        if key.isdigit() and s["dflash_tps"] and s["mean_acceptance"]:
            out["share"][key] = seconds[int(key)] / (s["mean_acceptance"] / s["dflash_tps"])
    return out


def sweep(pair, max_width: int = 16, progress=lambda d, t: None) -> Dict:
    curve = CostCurve.from_samples(measure_cost_curve(partial(cycle_parts, pair), max_width, budget=60.0,
                                                      min_rounds=8, split_rounds=8, progress=progress))
    return {
        "schema_version": SCHEMA_VERSION,
        "machine": machine_info(),
        "model": str(pair.target_path),
        "contexts": curve.contexts,
        "verify_relative": [[v / row[0] for v in row] for row in curve.verify],
        "draft_relative": [[d / vrow[0] for d in drow] for drow, vrow in zip(curve.draft, curve.verify)],
        "verify_seconds": curve.verify,
        "draft_seconds": curve.draft,
    }


def validate(result: Dict) -> None:
    """Checks the JSON layout the benchmark promises (used by tests and tools)."""
    for key in ("schema_version", "partial", "prompts_measured", "prompts_planned", "machine", "settings", "suites",
                "overall", "prompts"):
        if key not in result:
            raise ValueError(f"benchmark result lacks '{key}'")
    for field in ("chip", "mlx", "backend", "blas"):
        if field not in result["machine"]:
            raise ValueError(f"benchmark machine info lacks '{field}'")
    for key, s in result["overall"].items():
        for field in ("baseline_tps", "dflash_tps", "speedup", "speedup_geomean", "speedup_median_per_prompt",
                      "mean_acceptance", "acceptance_histogram",
                      "baseline_prompt_tps", "dflash_prompt_tps", "prompt_speedup", "baseline_ttft", "dflash_ttft",
                      "identical", "mismatched_prompts"):
            if field not in s:
                raise ValueError(f"overall[{key}] lacks '{field}'")


def plot(result: Dict, path: str) -> None:
    """Speedup and acceptance by block size (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(result["overall"])
    speed = [result["overall"][k]["speedup"] or 0 for k in keys]
    acc = [result["overall"][k]["mean_acceptance"] or 0 for k in keys]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(keys, speed)
    a.set_title("speedup over mlx-lm")
    a.set_xlabel("block size")
    b.bar(keys, acc, color="tab:orange")
    b.set_title("mean acceptance (tokens/cycle)")
    b.set_xlabel("block size")
    m = result["machine"]
    fig.suptitle(f"{m['chip']} / {m['backend']} / BLAS {m['blas']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
