"""DFlash on a target sharded across processes with `mx.distributed`.

With more than one process in the group, the target is sharded with
mlx-lm's tensor parallelism (`model.shard(group)`; tested for the families
in `TENSOR_PARALLEL`) or its pipeline parallelism
(`model.model.pipeline(group)`; tested for `PIPELINE_PARALLEL`), loaded
shard by shard by `mlx_lm.utils.sharded_load`; `sharding="auto"` takes
tensor parallelism where the family has it. The drafter is small and is
loaded whole on every rank. Every rank then runs the same loop
(`decode.stream_generate`): the drafter identically everywhere, the verify
pass is the sharded target's own forward pass, and acceptance, greedy or
sampled with one seed for all ranks, is computed identically on every rank
from the logits every rank has, so all ranks keep consistent caches (under
pipeline parallelism each rank's for its own layers). Only rank 0 prints.

Run with mlx's launcher, e.g. two processes on this machine:

    mlx.launch -n 2 --backend ring -- python -m dflash_mlx.distributed \\
        --model DIR --draft DIR --prompt "..." --max-tokens 64 --block-size 8

Under tensor parallelism the tapped layer outputs are whole on every rank:
each decoder layer ends in sharded-to-all projections (attention's o_proj,
the MLP's down_proj) whose all_sum gives every rank the full residual
stream, and the embedding, final norm and LM head are not sharded.
`load_sharded` checks this once (`check_taps_whole`).

Under pipeline parallelism each rank runs its own layers only (rank 0 the
last ones), so it has the taps of its own layers and zeros for the others
(`TargetAdapter`); `WholeTaps` sums the shares over the ranks where the
drafter reads them, one all_sum per drafted cycle over the rows committed
since the last one (exact: each element is non-zero on one rank only).
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

from .constrain.gate import Reasoning
from .constrain.grammar import Grammar
from .errors import DFlashError

# Families whose tensor-parallel DFlash output is tested equal to plain
# decoding of the unsharded model (tests/test_distributed.py).
TENSOR_PARALLEL = ("qwen3", "llama", "qwen3_moe", "gpt_oss", "qwen3_5")
PIPELINE_PARALLEL = ("qwen3_5", "qwen3_next")
SHARDINGS = ("auto", "tensor", "pipeline")
# For tests: the rank named here raises (or hangs) after loading (a failing rank must end the run).
FAIL_RANK_ENV = "DFLASH_MLX_TEST_FAIL_RANK"
HANG_RANK_ENV = "DFLASH_MLX_TEST_HANG_RANK"


def group() -> mx.distributed.Group:
    """The process group (mx.distributed.init); size 1 means not distributed."""
    return mx.distributed.init()


def is_main(g: Optional[mx.distributed.Group] = None) -> bool:
    """Whether this process is rank 0, the one that prints, streams or serves."""
    return (g or group()).rank() == 0


def _sharded_loader(g: mx.distributed.Group, sharding: str = "auto"):
    """A `load.load` target loader: the target sharded over `g` by mlx-lm's own sharded loading."""
    from mlx_lm.utils import sharded_load

    from .target.adapter import model_class
    from .target.caches import family_verdict
    from .target.files import check_target_files, read_target_config

    if sharding not in SHARDINGS:
        raise DFlashError(f"--sharding must be one of {', '.join(SHARDINGS)} (got '{sharding}').")

    def load_target(path: Path):
        config = read_target_config(path)
        model_type = config["model_type"]
        ok, why = family_verdict(model_type)
        if not ok:
            raise DFlashError(f"Target family '{model_type}' is not supported: {why}.")
        check_target_files(path, config)
        model_cls = model_class(path, config)
        kind = _sharding_kind(model_cls, model_type, sharding, g)
        tested = TENSOR_PARALLEL if kind == "tensor" else PIPELINE_PARALLEL
        if model_type not in tested:
            raise DFlashError(
                f"Target family '{model_type}' is not supported with {kind} parallelism yet (it is tested for "
                f"{', '.join(tested)}); run it in one process."
            )
        if kind == "pipeline" and not (Path(path) / "model.safetensors.index.json").exists():
            raise DFlashError(
                f"{path} has no model.safetensors.index.json, which mlx-lm's pipeline loading reads to find each "
                "rank's weights; save the model with mlx_lm.convert (or mlx_lm.utils.save_model)."
            )
        groups = {"tensor_group": g} if kind == "tensor" else {"pipeline_group": g}
        try:
            model, tokenizer, config = sharded_load(
                str(path), **groups, return_config=True, tokenizer_config={"trust_remote_code": False}
            )
        except (ValueError, FileNotFoundError) as e:
            raise DFlashError(f"Could not load the sharded target from {path}: {str(e).splitlines()[0]}")
        return model, tokenizer, config

    return load_target


def _sharding_kind(model_cls, model_type: str, sharding: str, g: mx.distributed.Group) -> str:
    """"tensor" or "pipeline", what `sharding` asks for and mlx-lm gives the family, or a DFlashError."""
    module = sys.modules.get(model_cls.__module__)
    kinds = [k for k, ok in (
        ("tensor", hasattr(model_cls, "shard")),
        ("pipeline", any(isinstance(c, type) and hasattr(c, "pipeline") for c in vars(module).values())),
    ) if ok]
    if sharding != "auto" and sharding not in kinds:
        other = f"; use --sharding {kinds[0]}" if kinds else ""
        raise DFlashError(f"Target family '{model_type}' cannot be sharded with {sharding} parallelism: mlx-lm "
                          f"gives it none{other}.")
    if not kinds:
        raise DFlashError(
            f"Target family '{model_type}' cannot be sharded across {g.size()} processes: mlx-lm gives it neither "
            "tensor parallelism (model.shard) nor pipeline parallelism (model.model.pipeline)."
        )
    return kinds[0] if sharding == "auto" else sharding


class WholeTaps:
    """A draft source on a pipelined target: every `hidden` it is handed (the
    rank's share of the taps, `TargetAdapter`) is made whole first, with one
    all_sum over the group; the rest is the wrapped source's."""

    def __init__(self, inner, g: mx.distributed.Group):
        self.inner, self.g = inner, g
        self._last = None  # (share, whole): `propose` after a `propose_path` that declined sums nothing again

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def whole(self, hidden: Optional[mx.array]) -> Optional[mx.array]:
        if hidden is None:
            return None
        if self._last is not None and self._last[0] is hidden:
            return self._last[1]
        out = mx.distributed.all_sum(hidden, group=self.g)
        # Queued now, before the next pass's send/recv: every rank runs its collectives in the same order
        # (rank 0's share may not depend on the pass, so the graph alone would not order them).
        mx.async_eval(out)
        self._last = (hidden, out)
        return out

    def add_context(self, state, hidden):
        self.inner.add_context(state, self.whole(hidden))

    def pooled(self):
        return None  # each hidden must be made whole first

    def propose(self, state, last, hidden, width):
        return self.inner.propose(state, last, self.whole(hidden), width)

    def propose_path(self, state, last, hidden, *args, **kwargs):
        return self.inner.propose_path(state, last, self.whole(hidden), *args, **kwargs)


def check_taps_whole(pair, g: mx.distributed.Group) -> None:
    """Raise unless the taps the drafter reads are whole and identical on every rank.

    Under tensor parallelism they are: each layer's output is the residual
    stream after the all_sum of its sharded-to-all projections, so every
    rank holds all `hidden_size` columns, bit for bit the same. Under
    pipeline parallelism each tap must be computed on exactly one rank (the
    others' zeros), and the taps are checked after `WholeTaps` sums them. The
    drafter runs on them everywhere, so identical drafts (and so consistent
    caches) depend on it. One short forward pass of the target on a fresh cache.
    """
    target = pair.target
    tokens = mx.arange(min(4, target.vocab_size))[None]
    logits, taps = target(tokens, target.make_cache())  # the adapter's own check: taps are hidden-size wide
    owned = True
    if target.pipelined:
        mx.eval(logits, taps)  # the pass and its send/recv and all_gather, as mlx-lm runs them
        mine = mx.array([i in target.local_taps for i in target.tap_ids], mx.int32)
        owned = (mx.distributed.all_sum(mine, group=g, stream=mx.cpu) == 1).all().item()
        taps = pair.draft_source.whole(taps)
    want = target.hidden_size * len(target.tap_ids)
    same = mx.array_equal(mx.distributed.all_max(taps, group=g, stream=mx.cpu),
                          mx.distributed.all_min(taps, group=g, stream=mx.cpu))
    if taps.shape[-1] != want or not owned or not same.item():
        raise DFlashError(
            "The sharded target's tapped hidden states differ between ranks; the drafter needs them whole "
            "and identical on every rank."
        )


def load_sharded(model: str, draft: Optional[str] = None, g: Optional[mx.distributed.Group] = None,
                 sharding: str = "auto", draft_context: Optional[int] = None):
    """A DFlashPair whose target is sharded over the process group (`sharding`:
    "tensor", "pipeline" or "auto", tensor where the family has it) and whose
    drafter is whole on every rank. In one process it is `load.load`."""
    from .pair import load

    g = g or group()
    if g.size() == 1:
        return load(model, draft, draft_context=draft_context)
    pair = load(model, draft, target_loader=_sharded_loader(g, sharding), draft_context=draft_context)
    pair.group = g
    if pair.target.pipelined:
        pair.draft_source = WholeTaps(pair.draft_source, g)
    check_taps_whole(pair, g)
    return pair


def shard_like(model, pair) -> None:
    """Shard a fresh mlx-lm `model` over `pair.group` as the pair's target is (e.g. a baseline)."""
    if pair.target.pipelined:
        model.model.pipeline(pair.group)
    else:
        model.shard(pair.group)


def collectives_per_pass(model) -> int:
    """The collectives one forward pass of a sharded model makes: under tensor
    parallelism one all_sum per sharded-to-all projection (attention's o_proj,
    the MLP's down_proj, ...); under pipeline parallelism a send/recv between
    each pair of neighbouring ranks and one all_gather (a drafted cycle adds
    the taps' all_sum, `WholeTaps`)."""
    import mlx.nn as nn

    size = getattr(getattr(getattr(model, "language_model", model), "model", None), "pipeline_size", 1)
    if size > 1:
        return size
    kinds = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)
    return sum(isinstance(m, kinds) for _, m in model.named_modules())


def _pipeline_collectives(x: mx.array, g: mx.distributed.Group) -> mx.array:
    """What mlx-lm's pipelined forward pass sends around, for a hidden state `x`."""
    r, n = g.rank(), g.size()
    if r < n - 1:
        x = mx.distributed.recv_like(x, r + 1, group=g)
    if r != 0:
        x = mx.distributed.send(x, r - 1, group=g)
    return mx.distributed.all_gather(x, group=g)[: x.shape[0]]


def communication_seconds(pair, widths, rounds: int = 5) -> dict:
    """Seconds the collectives of one verify pass take at each width, alone, on
    arrays of the target's dtype; the median of `rounds`. Tensor parallel: as
    many chained all_sums of [1, width, hidden] as the target makes per pass.
    Pipeline: its send/recv and all_gather of [1, width, hidden], and (width > 1)
    the taps' all_sum of [1, width, taps * hidden] (a cycle sums at most that)."""
    g, target = pair.group, pair.target
    n = collectives_per_pass(target.model)
    out = {}
    for w in widths:
        x = mx.zeros((1, w, target.hidden_size), dtype=target.dtype)
        taps = mx.zeros((1, w, target.hidden_size * len(target.tap_ids)), dtype=target.dtype)
        times = []
        for _ in range(rounds + 1):  # the first warms up
            tic = time.perf_counter()
            if target.pipelined:
                mx.eval(_pipeline_collectives(x, g))
                if w > 1:
                    mx.eval(mx.distributed.all_sum(taps, group=g))
            else:
                y = x
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
        self._word: Optional[mx.array] = None  # rank 0's word after the last event, in flight

    def _share(self, values) -> mx.array:
        x = values if is_main(self.g) else mx.zeros_like(values)
        return mx.distributed.all_sum(x, group=self.g, stream=mx.cpu)

    def send(self, request: Optional[dict]) -> None:
        """Rank 0: the next request (None: the server stops)."""
        self._word = None
        data = b"" if request is None else json.dumps(request).encode()
        self._share(mx.array([len(data) if request is not None else -1], mx.int32)).item()
        if data:
            mx.eval(self._share(mx.array(list(data), mx.int32)))

    def receive(self) -> Optional[dict]:
        """The other ranks: the next request rank 0 sent (None: stop)."""
        self._word = None
        n = self._share(mx.zeros((1,), mx.int32)).item()
        if n < 0:
            return None
        data = self._share(mx.zeros((n,), mx.int32))
        return json.loads(bytes(data.tolist()).decode())

    def keep_going(self, stop: bool = False) -> bool:
        """After each event, on every rank: whether to go on (`stop` is rank 0's word).

        Rank 0's word is shared in the background and read after the next event,
        by when it has long arrived: reading it at once would wait for the cycle
        the loop launched before handing this event over, which is the loop's
        overlap lost. So every rank stops one event after rank 0 said so, all at
        the same one.
        """
        heard, self._word = self._word, self._share(mx.array([int(stop)], mx.int32))
        mx.async_eval(self._word)
        return heard is None or heard.item() == 0


def follow(pair, channel: JobChannel, block_size, prompt_cache=None) -> None:
    """The other ranks under `serve`: run every request rank 0 sends, in step with it."""
    from .decode import stream_generate
    from .sampling import SamplingParams, make_processors

    while True:
        request = channel.receive()
        if request is None:
            return
        if request.get("seed") is not None:  # rank 0's draw for an unseeded sampled request
            mx.random.seed(request["seed"])
        try:
            for _ in stream_generate(pair, request["prompt"], max_tokens=request["max_tokens"],
                                     sampling=SamplingParams(**request["params"]), block_size=block_size,
                                     stop=request["stop"], prompt_cache=prompt_cache,
                                     logprobs=request["logprobs"],
                                     logits_processors=make_processors(request["processors"]),
                                     grammar=request["grammar"] and Grammar(**request["grammar"]),
                                     reasoning=request.get("reasoning") and Reasoning(
                                         **dict(request["reasoning"], end=tuple(request["reasoning"]["end"]),
                                                close=tuple(request["reasoning"].get("close", ())),
                                                start=tuple(request["reasoning"].get("start", ()))))):
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
    p.add_argument("--sharding", choices=SHARDINGS, default="auto",
                   help="mlx-lm's tensor or pipeline parallelism (auto: tensor where the family has it)")
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
    pair = load_sharded(args.model, args.draft, g, args.sharding)
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
    code = main()
    if code:
        # A failed rank leaves at once: its interpreter's teardown (the models, the ring's sockets) can
        # outlast the other ranks' noticing, and mlx.launch then kills it and reports a signal instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
