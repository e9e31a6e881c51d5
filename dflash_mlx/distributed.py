"""DFlash on a target sharded across processes with `mx.distributed` (issue 16).

With more than one process in the group, the target is sharded with
mlx-lm's tensor parallelism (`model.shard(group)`, loaded shard by shard by
`mlx_lm.utils.sharded_load`; tested for the families in `TENSOR_PARALLEL`); the drafter is small and is loaded whole on
every rank. Every rank then runs the same loop (`decode.stream_generate`):
the drafter identically everywhere (drafts need no communication), the
verify pass is the sharded target's own forward pass (its all_sums are the
only collectives), and acceptance, greedy or sampled with one seed for all
ranks, is computed identically on every rank, so all ranks keep identical
caches. Only rank 0 prints.

Run with mlx's launcher, e.g. two processes on this machine:

    mlx.launch -n 2 --backend ring -- python -m dflash_mlx.distributed \\
        --model DIR --draft DIR --prompt "..." --max-tokens 64 --block-size 8

Under tensor parallelism the tapped layer outputs are whole on every rank:
each decoder layer ends in sharded-to-all projections (attention's o_proj,
the MLP's down_proj) whose all_sum gives every rank the full residual
stream, and the embedding, final norm and LM head are not sharded.
`load_sharded` checks this once (`check_taps_whole`). Pipeline parallelism
(`model.model.pipeline(group)`, for families with no `shard`) is not
supported yet.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .errors import DFlashError

# Families whose tensor-parallel DFlash output is tested equal to plain
# decoding of the unsharded model (tests/test_distributed.py).
TENSOR_PARALLEL = ("qwen3", "llama", "qwen3_moe", "gpt_oss", "qwen3_5")
# For tests: the rank named here raises (or hangs) after loading (a failing rank must end the run).
FAIL_RANK_ENV = "DFLASH_MLX_TEST_FAIL_RANK"
HANG_RANK_ENV = "DFLASH_MLX_TEST_HANG_RANK"


def group() -> mx.distributed.Group:
    """The process group (mx.distributed.init); size 1 means not distributed."""
    return mx.distributed.init()


def is_main(g: Optional[mx.distributed.Group] = None) -> bool:
    """Whether this process is rank 0, the one that prints, streams or serves."""
    return (g or group()).rank() == 0


def _sharded_loader(g: mx.distributed.Group):
    """A `load.load` target loader: the target sharded over `g` by mlx-lm's own sharded loading."""
    from mlx_lm.utils import _get_classes, sharded_load

    from .target_caches import family_verdict

    def load_target(path: Path):
        cfg_path = Path(path) / "config.json"
        try:
            config = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise DFlashError(f"No config.json in {path}; --model must be an mlx-lm model directory, repo id or alias.")
        model_type = str(config.get("model_type"))
        ok, why = family_verdict(model_type)
        if not ok:
            raise DFlashError(f"Target family '{model_type}' is not supported: {why}.")
        try:
            model_cls, _ = _get_classes(config)
        except ValueError as e:
            raise DFlashError(f"Could not load the target from {path}: {str(e).splitlines()[0]}")
        if not hasattr(model_cls, "shard"):
            raise DFlashError(
                f"Target family '{model_type}' cannot be sharded across {g.size()} processes: mlx-lm gives it no "
                f"tensor parallelism (model.shard) and {_pipeline_note(model_cls)}."
            )
        if model_type not in TENSOR_PARALLEL:
            raise DFlashError(
                f"Target family '{model_type}' is not supported sharded yet (tensor parallelism is tested for "
                f"{', '.join(TENSOR_PARALLEL)}); run it in one process."
            )
        try:
            model, tokenizer, config = sharded_load(
                str(path), tensor_group=g, return_config=True, tokenizer_config={"trust_remote_code": False}
            )
        except (ValueError, FileNotFoundError) as e:
            raise DFlashError(f"Could not load the sharded target from {path}: {str(e).splitlines()[0]}")
        return model, tokenizer, config

    return load_target


def _pipeline_note(model_cls) -> str:
    """What mlx-lm offers a family without `shard`: pipeline parallelism, or nothing."""
    module = sys.modules.get(model_cls.__module__)
    if any(isinstance(c, type) and hasattr(c, "pipeline") for c in vars(module).values()):
        return "its pipeline parallelism (model.model.pipeline) is not supported by dflash-mlx yet (issue 16)"
    return "no pipeline parallelism either"


def check_taps_whole(pair, g: mx.distributed.Group) -> None:
    """Raise unless the target's taps are whole and identical on every rank.

    Under tensor parallelism they are: each layer's output is the residual
    stream after the all_sum of its sharded-to-all projections, so every
    rank holds all `hidden_size` columns, bit for bit the same. The drafter
    runs on them everywhere, so identical drafts (and so identical caches)
    depend on it. One short forward pass of the target on a fresh cache.
    """
    target = pair.target
    tokens = mx.arange(min(4, target.vocab_size))[None]
    _, taps = target(tokens, target.make_cache())  # the adapter's own check: taps are hidden-size wide
    want = target.hidden_size * len(target.tap_ids)
    same = mx.array_equal(mx.distributed.all_max(taps, group=g, stream=mx.cpu),
                          mx.distributed.all_min(taps, group=g, stream=mx.cpu))
    if taps.shape[-1] != want or not same.item():
        raise DFlashError(
            "The sharded target's tapped hidden states differ between ranks; the drafter needs them whole "
            "and identical on every rank."
        )


def load_sharded(model: str, draft: Optional[str] = None, g: Optional[mx.distributed.Group] = None):
    """A DFlashPair whose target is sharded over the process group (tensor
    parallelism) and whose drafter is whole on every rank. In one process it
    is `load.load`."""
    from .load import load

    g = g or group()
    if g.size() == 1:
        return load(model, draft)
    pair = load(model, draft, target_loader=_sharded_loader(g))
    pair.group = g
    check_taps_whole(pair, g)
    return pair


def collectives_per_pass(model) -> int:
    """The all_sums one forward pass of a tensor-parallel model makes: one per
    sharded-to-all projection (attention's o_proj, the MLP's down_proj, ...)."""
    import mlx.nn as nn

    kinds = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)
    return sum(isinstance(m, kinds) for _, m in model.named_modules())


def communication_seconds(pair, widths, rounds: int = 5) -> dict:
    """Seconds the all_sums of one verify pass take at each width, alone: as
    many chained all_sums of [1, width, hidden] (the target's dtype) as the
    sharded target makes per pass; the median of `rounds`."""
    g, n = pair.group, collectives_per_pass(pair.target.model)
    out = {}
    for w in widths:
        x = mx.zeros((1, w, pair.target.hidden_size), dtype=pair.target.dtype)
        times = []
        for _ in range(rounds + 1):  # the first warms up
            y = x
            tic = time.perf_counter()
            for _ in range(n):
                y = mx.distributed.all_sum(y, group=g)
            mx.eval(y)
            times.append(time.perf_counter() - tic)
        out[w] = sorted(times[1:])[rounds // 2]
    return out


class JobChannel:
    """How `serve` keeps the ranks in step: rank 0 (which serves HTTP) sends each
    request to the others, which run the same generation, and after every event
    tells them whether to go on (a client that went away ends it on all ranks).

    Everything goes through all_sums on the CPU stream, the other ranks adding
    zeros: a length, then the request as JSON bytes.
    """

    def __init__(self, g: mx.distributed.Group):
        self.g = g

    def _share(self, values) -> mx.array:
        x = values if is_main(self.g) else mx.zeros_like(values)
        return mx.distributed.all_sum(x, group=self.g, stream=mx.cpu)

    def send(self, request: Optional[dict]) -> None:
        """Rank 0: the next request (None: the server stops)."""
        data = b"" if request is None else json.dumps(request).encode()
        self._share(mx.array([len(data) if request is not None else -1], mx.int32)).item()
        if data:
            mx.eval(self._share(mx.array(list(data), mx.int32)))

    def receive(self) -> Optional[dict]:
        """The other ranks: the next request rank 0 sent (None: stop)."""
        n = self._share(mx.zeros((1,), mx.int32)).item()
        if n < 0:
            return None
        data = self._share(mx.zeros((n,), mx.int32))
        return json.loads(bytes(data.tolist()).decode())

    def keep_going(self, stop: bool = False) -> bool:
        """After each event, on every rank: whether rank 0 goes on (`stop` is rank 0's word)."""
        return self._share(mx.array([int(stop)], mx.int32)).item() == 0


def follow(pair, channel: JobChannel, block_size, prompt_cache=None) -> None:
    """The other ranks under `serve`: run every request rank 0 sends, in step with it."""
    from .decode import stream_generate
    from .sampling import SamplingParams, make_processors

    while True:
        request = channel.receive()
        if request is None:
            return
        try:
            for _ in stream_generate(pair, request["prompt"], max_tokens=request["max_tokens"],
                                     sampling=SamplingParams(**request["params"]), block_size=block_size,
                                     stop=request["stop"], prompt_cache=prompt_cache,
                                     logprobs=request["logprobs"],
                                     logits_processors=make_processors(request["processors"])):
                if not channel.keep_going():
                    break
        except DFlashError:
            pass  # rank 0 met the same error and answered it


def shared_seed(seed: Optional[int], g: mx.distributed.Group) -> int:
    """One seed for all ranks: `seed`, or one rank 0 draws."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF if is_main(g) else 0
        if g.size() > 1:
            seed = int(mx.distributed.all_sum(mx.array(seed if is_main(g) else 0, mx.int64), group=g,
                                              stream=mx.cpu).item())
    return seed


class Watchdog:
    """Ends this process when it makes no progress for `seconds`.

    mlx's collectives do not time out: a rank whose peer hangs (rather than
    exits, which closes its sockets) would wait forever. The thread runs
    while the main thread is blocked in a collective (mlx releases the GIL
    while it evaluates); once this rank exits, mlx.launch ends the others.
    """

    def __init__(self, seconds: float, who: str, loading: float = 300.0):
        self.seconds, self.who = seconds, who
        self.last = time.monotonic() + loading  # loading the model may take longer than a cycle
        self._done = threading.Event()
        if seconds > 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.seconds / 4)):
            if time.monotonic() - self.last > self.seconds:
                print(f"{self.who}: no progress for {self.seconds:g} s, another rank is not answering "
                      "(see --timeout); ending the run", file=sys.stderr, flush=True)
                os._exit(1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_mlx.distributed",
        description="DFlash generation with the target sharded across the processes mlx.launch starts "
                    "(every prompt at every block size, in turn).",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompt", "-p", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--block-size", type=int, nargs="+", default=[None],
                   help="fixed widths (default: the drafter's); not 'auto', which would time each rank apart")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="end the run when a rank makes no progress (a cycle) for this many seconds; loading "
                        "gets 300 s more (default 600; 0: wait forever)")
    p.add_argument("--json", action="store_true",
                   help="rank 0 prints one JSON line per generation (prompt, block size, token ids, text)")
    p.add_argument("--ids-out", help="every rank writes the token ids of every generation as JSON to this "
                                     "path, {rank} filled in")
    return p


def run(args, g: mx.distributed.Group, watchdog: Watchdog) -> None:
    from .decode import stream_generate
    from .prompt import build_prompt
    from .sampling import SamplingParams

    rank0 = is_main(g)
    pair = load_sharded(args.model, args.draft, g)
    watchdog.beat()
    if os.environ.get(FAIL_RANK_ENV) == str(g.rank()):
        raise RuntimeError(f"rank {g.rank()} was told to fail ({FAIL_RANK_ENV})")
    if os.environ.get(HANG_RANK_ENV) == str(g.rank()):
        watchdog.stop()  # a rank hung past helping itself
        time.sleep(1e6)
    # Sampling draws the same numbers on every rank: one seed for all.
    params = SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=shared_seed(args.seed, g) if args.temp > 0 else args.seed)
    runs = []
    for text in args.prompt:
        prompt = build_prompt(pair.tokenizer, text, chat_template=args.chat_template)
        for block_size in args.block_size:
            ids, stats = [], None
            for event in stream_generate(pair, prompt, max_tokens=args.max_tokens, sampling=params,
                                         block_size=block_size, lookup=False):
                watchdog.beat()
                ids += event.tokens
                stats = event.stats
                if rank0 and not args.json:
                    print(event.text, end="", flush=True)
            runs.append(ids)
            if not rank0:
                continue
            if args.json:
                print(json.dumps({"prompt": text, "block_size": block_size or pair.draft_source.block_size,
                                  "tokens": ids, "text": pair.tokenizer.decode(ids), "ranks": g.size(),
                                  "acceptance": stats.acceptance_lengths}), flush=True)
            else:
                print(flush=True)
                print(f"[{g.size()} ranks] {stats.line()}", file=sys.stderr, flush=True)
    if args.ids_out:
        Path(args.ids_out.format(rank=g.rank())).write_text(json.dumps(runs))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    g = group()
    who = f"dflash-mlx (rank {g.rank()} of {g.size()})"
    watchdog = Watchdog(args.timeout if g.size() > 1 else 0, who)
    try:
        run(args, g, watchdog)
    except DFlashError as e:
        print(f"{who}: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "[ring]" in msg or "peer" in msg:
            msg = f"a collective failed ({msg}): another rank has probably stopped; its error is above"
        print(f"{who}: {msg}", file=sys.stderr, flush=True)
        return 1
    finally:
        watchdog.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
