"""The `dflash-mlx` command line."""

import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from dflash_mlx.cli.warning_lines import print_warning, show_warnings
from dflash_mlx.errors import DFlashError, printable

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="DFlash block-diffusion speculative decoding on MLX.",
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(printable(message))}", soft_wrap=True)
    raise typer.Exit(1)


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def ranged(default, *names, min=None, max=None, help: Optional[str] = None, **kwargs):
    """A numeric typer.Option that takes values from `min` to `max`.

    Out of range is one `error:` line and exit 1, as the commands' own checks
    give (typer's own bounds print a usage box and exit 2), and it is refused
    while the command line is read, before any model loads."""
    low, high = min, max
    span = (f"from {_number(low)} to {_number(high)}" if low is not None and high is not None
            else f"{_number(low)} or more" if low is not None else f"{_number(high)} or less")

    def check(param: typer.CallbackParam, value):
        if value is not None and (low is not None and value < low or high is not None and value > high):
            name = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            fail(f"{name} must be {span} (got {_number(value)}).")
        return value

    help = " ".join(filter(None, [help, f"Range: {span.removeprefix('from ')}."]))
    return typer.Option(default, *names, callback=check, help=help, **kwargs)


@app.callback()
def main():
    """DFlash block-diffusion speculative decoding on MLX."""
    show_warnings(err)


DRAFT_CONTEXT_HELP = (
    "Let the drafter read only the first 4 and the last N rows of the context (default: every row, or the "
    "windows its checkpoint declares). Keeps a draft's cost flat on long prompts; past N tokens the drafts "
    "change and acceptance may drop. Output stays exact.")


TREE_HELP = (
    "Tree verification (greedy, attention-only targets; others verify linearly): with a fixed --block-size, "
    "also verify this many branches (the drafter's 2nd/3rd choices) in every target pass; with auto, the most "
    "branches a cycle may use where the sizer finds they pay [default: as many as the cost curve timed, 2, so "
    "trees are used where this machine's timings say they pay; 0 turns them off].")
PROPOSAL_SCALE_HELP = (
    "When sampling: how much flatter (>1) or sharper (<1) than the drafter's own distribution its drafts are "
    "drawn (exact either way; 1: as z-lab's loop), or 'auto' to learn it per draft position from the "
    "acceptance each scale would have had. A seeded request draws without them (`--seed`).")
TIMEOUT_HELP = "Under mlx.launch: end the run when a rank makes no progress for this many seconds (0: never)."
SHARDING_HELP = ("Under mlx.launch: mlx-lm's 'tensor' or 'pipeline' parallelism for the target (auto: tensor "
                 "where the family has it, else pipeline).")


@app.command()
def generate(
    model: str = typer.Option(
        "demo", "--model",
        help="Alias (e.g. qwen3-4b), Hugging Face repo id or local directory; "
        "'demo' is the small code model shipped with the package.",
    ),
    draft: Optional[str] = typer.Option(
        None, "--draft", "--draft-model",
        help="DFlash drafter: repo id, directory or alias (default: the model's own).",
    ),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", "-p", help="Prompt text; '-' or no flag reads stdin."
    ),
    max_tokens: int = ranged(256, "--max-tokens", "-m", min=1, help="Most tokens to generate."),
    temp: float = ranged(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = ranged(0, "--top-k", min=0, help="Sample from the k most likely tokens (0 = off)."),
    min_p: float = ranged(0.0, "--min-p", min=0.0, max=1.0, help="Min-p filter (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    block_size: str = typer.Option(
        "auto", "--block-size",
        help="Tokens per verify block, or 'auto' to choose each cycle from measured costs and acceptance.",
    ),
    system: Optional[str] = typer.Option(None, "--system", "--system-prompt", help="System prompt."),
    chat_template: bool = typer.Option(
        True, "--chat-template/--no-chat-template", help="Apply the tokenizer's chat template."
    ),
    ignore_chat_template: bool = typer.Option(
        False, "--ignore-chat-template", help="mlx-lm's spelling of --no-chat-template."
    ),
    enable_thinking: Optional[bool] = typer.Option(
        None, "--enable-thinking/--disable-thinking", help="Turn the template's thinking mode on or off."
    ),
    lookup: bool = typer.Option(
        True, "--lookup/--no-lookup",
        help="With --block-size auto, also draft from an n-gram lookup over the prompt and the text so far.",
    ),
    tree: Optional[int] = ranged(None, "--tree", min=0, max=8, help=TREE_HELP),
    proposal_scale: str = typer.Option("auto", "--proposal-scale", help=PROPOSAL_SCALE_HELP),
    draft_context: Optional[int] = ranged(None, "--draft-context", min=1, help=DRAFT_CONTEXT_HELP),
    verbose: bool = typer.Option(False, "--verbose", help="Show paths, settings and per-cycle acceptance."),
    timeout: float = ranged(600.0, "--timeout", min=0.0, help=TIMEOUT_HELP),
    sharding: str = typer.Option("auto", "--sharding", help=SHARDING_HELP),
    json_schema: Optional[str] = typer.Option(
        None, "--json-schema", help="Constrain the output to a JSON schema: a file, or the schema's JSON.",
    ),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the output to a regular expression."),
    grammar: Optional[str] = typer.Option(
        None, "--grammar", help="Constrain the output to a Lark (or GBNF) grammar file (llguidance's syntax).",
    ),
):
    """Generate text with DFlash speculative decoding, streaming it.

    Under `mlx.launch` (more than one process) the target is sharded across
    the processes (see `python -m dflash_mlx.distributed`) and rank 0 prints."""
    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.cli.grammar_options import grammar_option
    from dflash_mlx.prompt import build_prompt
    from dflash_mlx.sampling import SamplingParams

    block, sharding, scale = _one_block_size(block_size), _sharding(sharding), _proposal_scale(proposal_scale)
    try:
        params = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        constraint = grammar_option(json_schema, regex, grammar)
    except DFlashError as e:
        fail(str(e))
    prompt = _prompt_text(prompt)
    if system is not None:
        system = _utf8(system, "--system")
    g = distributed.group()
    sharded, main_rank = g.size() > 1, distributed.is_main(g)
    watchdog = distributed.Watchdog(timeout if sharded else 0, f"dflash-mlx (rank {g.rank()} of {g.size()})")
    out = sys.stdout if main_rank else open(os.devnull, "w")
    stats = None
    try:
        if sharded and temp > 0:  # one seed for all ranks, so they draw the same numbers
            params = replace(params, seed=distributed.shared_seed(seed, g))
        pair, block = _load_pair(model, draft, g, sharding, draft_context, block)
        if constraint is not None:  # refused before any note or measurement
            pair.grammars.compile(constraint)
        if main_rank:
            _note_demo(pair)
            _note_draft_context(pair)
        watchdog.beat()
        if enable_thinking is None and pair.resolved is not None:
            enable_thinking = pair.resolved.enable_thinking
        ids = build_prompt(pair.tokenizer, prompt, system, chat_template and not ignore_chat_template,
                           enable_thinking)
        predicted = _auto_sizer(pair, len(ids)) if block == "auto" else None
        if verbose and main_rank:
            _print_settings(pair, len(ids), block, params)
        for event in dflash_mlx.stream_generate(
            pair, ids, max_tokens=max_tokens, sampling=params, block_size=block, lookup=lookup, tree=tree,
            proposal_scale=scale, grammar=constraint,
        ):
            watchdog.beat()
            out.write(event.text)
            out.flush()
            stats = event.stats
    except DFlashError as e:
        fail(f"rank {g.rank()} of {g.size()}: {e}" if sharded else str(e))
    except KeyboardInterrupt:
        out.write("\n")
        if stats is not None and main_rank:
            err.print(stats.line() + " (interrupted)")
        raise typer.Exit(130)
    finally:
        watchdog.stop()
    out.write("\n")
    out.flush()
    if main_rank:
        _print_summary(stats, verbose, block == "auto", predicted is not None, g.size())


def _print_settings(pair, prompt_tokens: int, block, params) -> None:
    cfg = pair.drafter.args
    err.print(f"target {pair.target_path} ({pair.target.model_type}, {pair.target.num_layers} layers)\n"
              f"drafter {pair.draft_path} (block {cfg.block_size}, taps {cfg.target_layer_ids})\n"
              f"prompt {prompt_tokens} tokens, block size {block}, {params}")


def _load_pair(model, draft, g, sharding, draft_context, block):
    """The pair (sharded across `g`'s processes where there are several) and the block size
    it runs: under mlx.launch 'auto' becomes the drafter's block size, since each rank would
    time its own curve and pick its own widths."""
    import dflash_mlx
    from dflash_mlx import distributed

    if g.size() == 1:
        return dflash_mlx.load(model, draft, draft_context=draft_context), block
    pair = distributed.load_sharded(model, draft, g, sharding, draft_context)
    if block == "auto":
        block = pair.draft_source.block_size
        if distributed.is_main(g):
            err.print(f"note: --block-size auto times one machine; {g.size()} ranks use the drafter's "
                      f"block size, {block}")
    return pair, block


def _print_summary(stats, verbose: bool, auto: bool, predicted: bool, ranks: int) -> None:
    """After a run: (verbose) the acceptance histogram and proposal scales, what the default
    did (auto), and the stats line."""
    if verbose:
        hist = Counter(stats.acceptance_lengths)
        err.print("acceptance histogram: " + ", ".join(f"{k}:{hist[k]}" for k in sorted(hist)))
        if stats.proposal_scales:
            err.print(stats.proposal_scales)
    if auto and stats.cycles:
        err.print(_decision(stats, predicted), highlight=False)
    err.print(stats.line() if ranks == 1 else f"[{ranks} ranks] {stats.line()}")


@app.command()
def convert(
    hf_path: str = typer.Option(..., "--hf-path", help="Drafter repo id, directory or checkpoint file."),
    mlx_path: str = typer.Option(..., "--mlx-path", help="Output directory."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: the checkpoint's)."
    ),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the linear layers."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight: 4 or 8."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Group size: 32, 64 or 128."),
    target: Optional[str] = typer.Option(
        None, "--target", help="Check the drafter fits this target (alias, repo id or directory) first."
    ),
    force: int = typer.Option(0, "--force", count=True, help="Replace a previous conversion at --mlx-path; "
                              "twice (--force --force) to replace any folder there."),
):
    """Convert a PyTorch / z-lab DFlash drafter checkpoint to MLX."""
    from dflash_mlx.cli.progress import progress
    from dflash_mlx.convert import convert_drafter
    from dflash_mlx.hub import resolve

    target_name = resolve(target).target if target else None
    try:
        with progress(err, "converting", counts=False, quiet_for=2.0) as update:
            result = convert_drafter(
                hf_path, mlx_path, dtype=dtype, quantize=quantize, q_bits=q_bits,
                q_group_size=q_group_size, target=target_name, force=force,
                progress=lambda step: update(0, description=f"converting: {step}"),
            )
    except DFlashError as e:
        fail(str(e))
    quant = (
        f", {result.quantization['bits']}-bit groups of {result.quantization['group_size']}"
        if result.quantization else ""
    )
    err.print(
        f"wrote {result.path} ({result.parameters / 1e6:.1f}M parameters, {result.dtype}{quant}, "
        f"{result.bits_per_weight:.2f} bits per weight)"
    )


@app.command()
def train(
    model: str = typer.Option(..., "--model", help="Target: alias, repo id or mlx-lm directory."),
    data: str = typer.Option(..., "--data", help="Prompts .jsonl ('prompt'/'text'/'messages') or a text directory."),
    out: str = typer.Option(..., "--out", help="Output directory (z-lab layout, plus mlx/)."),
    block_size: int = ranged(16, "--block-size", min=2, max=64),
    layers: int = ranged(5, "--layers", min=1, max=64, help="Drafter layers."),
    target_layers: Optional[str] = typer.Option(
        None, "--target-layers", help="Comma-separated target layers to tap (default: spread evenly)."
    ),
    steps: Optional[int] = ranged(None, "--steps", min=1, help="Training steps (default: --epochs)."),
    epochs: int = ranged(1, "--epochs", min=1),
    lr: float = ranged(6e-4, "--lr", min=0.0),
    blocks_per_seq: int = ranged(16, "--blocks-per-seq", min=1, help="Blocks trained per sequence."),
    max_new_tokens: int = ranged(256, "--max-new-tokens", min=1, help="Target response length."),
    temp: float = ranged(0.0, "--temp", min=0.0, help="Target sampling temperature for the data."),
    save_every: int = ranged(200, "--save-every", min=1),
    eval_every: int = ranged(50, "--eval-every", min=1, help="Steps between held-out acceptance estimates."),
    seed: int = typer.Option(0, "--seed"),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
    arch: str = typer.Option("dflash", "--arch", help="dflash, or dflash2 (convolutions, sliding windows, "
                             "candidate selector)."),
    sliding_window: int = ranged(512, "--sliding-window", min=1, help="DFlash 2: the context window."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from this drafter's weights (a folder of the "
                                       "same shape): fine-tune it on new data, such as longer contexts."),
):
    """Train a DFlash drafter for a target on the target's own outputs."""
    from contextlib import ExitStack

    import mlx.core as mx

    from dflash_mlx.target.adapter import load_target
    from dflash_mlx.cli.progress import progress
    from dflash_mlx.hub import fetch, resolve
    from dflash_mlx.train import TrainConfig, read_prompts
    from dflash_mlx.train import train as run_training

    if arch not in ("dflash", "dflash2"):
        fail(f"--arch must be dflash or dflash2 (got {arch}).")
    try:
        taps = [int(x) for x in target_layers.split(",")] if target_layers else None
    except ValueError:
        fail(f"--target-layers must be comma-separated integers (got '{target_layers}').")
    cfg = TrainConfig(block_size=block_size, layers=layers, target_layers=taps, steps=steps, epochs=epochs,
                      lr=lr, blocks_per_seq=blocks_per_seq, max_new_tokens=max_new_tokens, temp=temp,
                      save_every=save_every, eval_every=eval_every, seed=seed, mask_token_id=mask_token_id,
                      arch=arch, sliding_window=sliding_window, init=init)
    try:
        target_model, tokenizer, _ = load_target(fetch(resolve(model).target, "model"))
        if mx.default_device() == mx.cpu:
            # The CPU backend has no fast half-precision matmul.
            target_model.set_dtype(mx.float32)
        prompts = read_prompts(data, tokenizer)
        with ExitStack() as data_bar, ExitStack() as train_bar:
            gen = data_bar.enter_context(progress(err, "target responses", total=len(prompts), transient=False))
            fit = []

            def on_step(step, total, loss, acc):
                if not fit:  # one bar at a time: the data bar ends where training starts
                    data_bar.close()
                    fit.append(train_bar.enter_context(progress(err, "training", total=total, transient=False)))
                fit[0](step, total, f"training  loss {loss:.3f}  held-out acceptance {acc:.2f}")

            summary = run_training(target_model, tokenizer, prompts, out, cfg, resume=resume,
                                   on_data=lambda i, n: gen(i, n), on_step=on_step)
    except DFlashError as e:
        fail(str(e))
    err.print(
        f"wrote {out} (z-lab layout) and {out}/mlx: loss {summary['loss']:.3f}, held-out acceptance "
        f"{summary['heldout_acceptance']:.2f} tokens/cycle at block {block_size}"
    )


@app.command()
def serve(
    model: str = typer.Option("demo", "--model", help="Alias, Hugging Face repo id or local directory."),
    draft: Optional[str] = typer.Option(
        None, "--draft", "--draft-model", help="DFlash drafter (default: the model's own)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless told otherwise)."),
    port: int = ranged(8080, "--port", min=0, max=65535),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY'."),
    block_size: str = typer.Option("auto", "--block-size", help="N or 'auto'."),
    temp: float = ranged(0.0, "--temp", min=0.0, max=2.0, help="Default temperature."),
    max_prompt_tokens: int = ranged(32768, "--max-prompt-tokens", min=1),
    max_tokens: int = ranged(
        32768, "--max-tokens", min=1, help="Most tokens one request may generate; asking for more gets a 400."
    ),
    default_max_tokens: int = ranged(
        256, "--default-max-tokens", min=1, help="Tokens generated for a request that sets no max_tokens."
    ),
    prompt_cache_bytes: str = typer.Option(
        "4GB", "--prompt-cache-bytes",
        help="Memory for caches of earlier requests, reused when a prompt extends one (e.g. 8GB, 512MB; 0: off).",
    ),
    prompt_cache_disk_bytes: str = typer.Option(
        "0", "--prompt-cache-disk-bytes",
        help="Disk for prompt caches evicted from memory or left at shutdown, reused after a restart (e.g. 20GB; "
             "0: off).",
    ),
    prompt_cache_dir: Optional[str] = typer.Option(
        None, "--prompt-cache-dir",
        help="Folder for the disk prompt cache, one subfolder per model (default: prompt-cache/ in the cache folder).",
    ),
    draft_context: Optional[int] = ranged(None, "--draft-context", min=1, help=DRAFT_CONTEXT_HELP),
    sharding: str = typer.Option("auto", "--sharding", help=SHARDING_HELP),
):
    """Serve an OpenAI-compatible API (chat and completions) with DFlash.

    Under `mlx.launch` the target is sharded across the processes; rank 0
    serves HTTP and the other ranks run every request with it."""
    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.serve.http_server import make_server

    sharding = _sharding(sharding)
    cache_bytes = _bytes(prompt_cache_bytes, "--prompt-cache-bytes")
    disk_bytes = _bytes(prompt_cache_disk_bytes, "--prompt-cache-disk-bytes")
    if disk_bytes and not cache_bytes:
        fail("--prompt-cache-disk-bytes needs the memory tier: give --prompt-cache-bytes a size above 0.")
    g = distributed.group()
    sharded = g.size() > 1
    if sharded and disk_bytes:
        fail("--prompt-cache-disk-bytes is not supported under mlx.launch yet (each rank would need its own "
             "folder, kept in step); leave it at 0.")
    block = _one_block_size(block_size)
    channel = None
    try:
        pair, block = _load_pair(model, draft, g, sharding, draft_context, block)
        if sharded:
            channel = distributed.JobChannel(g)
            if not distributed.is_main(g):
                cache = dflash_mlx.PromptCache(pair, max_bytes=cache_bytes) if cache_bytes else None
                distributed.follow(pair, channel, block, cache)
                return
        elif block == "auto":
            _auto_sizer(pair, 0)
        if distributed.is_main(g):
            _note_draft_context(pair)
        server = make_server(pair, model, host, port, api_key, block,
                             pair.resolved.enable_thinking if pair.resolved else None,
                             max_prompt_tokens, temp, max_tokens_limit=max_tokens,
                             default_max_tokens=default_max_tokens,
                             prompt_cache_bytes=cache_bytes, prompt_cache_disk_bytes=disk_bytes,
                             prompt_cache_dir=prompt_cache_dir, channel=channel)
    except DFlashError as e:
        fail(f"rank {g.rank()} of {g.size()}: {e}" if sharded else str(e))
    except OSError as e:
        fail(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port.")
    err.print(f"serving {model} on http://{host}:{server.server_address[1]}/v1 (Ctrl-C to stop)")
    if server.engine.batch_width is None:
        why = f"{g.size()} ranks" if sharded else f"this {pair.target.model_type} target's caches"
        err.print(f"note: requests run one at a time ({why}); concurrent requests are batched on one machine")
    _serve_until_stopped(server, spill=bool(disk_bytes), sharded=sharded)


def _serve_until_stopped(server, spill: bool, sharded: bool) -> None:
    """Serve until Ctrl-C (or, where the prompt cache spills to disk or ranks follow, SIGTERM),
    then close the engine and leave the process."""
    if spill or sharded:  # a service manager's stop (SIGTERM) also spills the prompt cache / ends the ranks
        import signal

        def stop(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if spill:
            err.print("writing the prompt cache to disk ...")
        if spill or sharded:  # the other ranks stop when the engine does
            server.engine.close()
    # All is written and closed. Leave without the native libraries' exit-time
    # teardown: with torch loaded (transformers imports it where installed) it
    # aborts now and then ("terminate called without an active exception"),
    # which a service manager reports as a failed stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _note_draft_context(pair) -> None:
    """A bounded drafter context is never silent: one line says what the drafts read."""
    if pair.draft_context is not None:
        err.print(f"note: drafts read the first {pair.drafter.context_bound[0]} and the last {pair.draft_context} "
                  f"context rows (--draft-context); past that, drafts differ from the checkpoint's own")


def _bytes(text: str, option: str) -> int:
    """'8GB', '512MB', '1.5GiB', '1000000' -> bytes (powers of 1024, as memory is sized)."""
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    number = t.rstrip("KMGT")
    try:
        value = float(number) * units[t[len(number):]]
    except (ValueError, KeyError):
        value = -1
    if value < 0:
        fail(f"{option} takes a size such as 8GB, 512MB or 0 (got '{text}').")
    return int(value)


def _auto_sizer(pair, context: int) -> Optional[str]:
    """Ready --block-size auto (measuring this machine's costs first if needed,
    with progress); say and return what the cost curve predicts where it
    predicts that the drafter does not pay (None where it predicts drafting)."""
    from contextlib import ExitStack

    from dflash_mlx.cli.progress import progress

    with ExitStack() as stack:
        bar = []

        def update(done, total):
            if not bar:  # nothing is shown when the costs are already cached
                busy = _busy()
                if busy:
                    err.print(busy, highlight=False)
                bar.append(stack.enter_context(progress(
                    err, "measuring this machine's verify costs (about 10 s, first runs only)", counts=False)))
            bar[0](done, total)

        sizer = pair.auto_sizer(progress=update)
    prediction = sizer.explain(context)
    if prediction:
        err.print(prediction, highlight=False)
    return prediction


def _decision(stats, predicted: bool) -> str:
    """What --block-size auto did, from the final stats and in their words, and why."""
    drafted, lookup = stats.draft_cycles, stats.lookup_cycles
    if not drafted:
        return "the default decoded plainly" + (
            ", as the cost curve predicted" if predicted else ": no draft was expected to pay on this text")
    if lookup == drafted:
        plain = stats.cycles - drafted
        return (f"the default drafted from the n-gram lookup only ({drafted} cycles, where the text repeated)"
                + (f" and decoded plainly elsewhere ({plain} cycles)" if plain else "")
                + ("; the drafter was not expected to pay" if predicted else ""))
    from_lookup = f", {lookup} of them from the lookup" if lookup else ""
    return (f"the default drafted with the drafter ({drafted} cycles{from_lookup}): "
            + ("it tried whether this text's acceptance pays, against the cost curve's prediction" if predicted
               else "the acceptance it expected paid for the wider verify passes"))


def _note_demo(pair) -> None:
    """The bundled demo's text is repetitive: say so once, and how to run a real model."""
    from dflash_mlx.hub import aliases

    alias = pair.resolved.alias if pair.resolved is not None else None
    if alias and aliases().get(alias, {}).get("builtin"):
        err.print(f"note: '{alias}' is a tiny {pair.target.num_layers}-layer demo model whose text is repetitive by "
                  "nature; for a real model: dflash-mlx generate --model qwen3-4b (dflash-mlx list shows all)",
                  highlight=False)


def _utf8(text, where: str) -> str:
    """`text` (bytes, or a str from the command line, where undecodable bytes arrive
    as surrogate escapes) as UTF-8 text; one error line, before any model loads, if it is not."""
    if isinstance(text, str):
        try:
            text = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        line = text.count(b"\n", 0, e.start) + 1
        fail(f"{where} is not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start}, line {line}); "
             f"convert it to UTF-8 first, e.g. with iconv -f LATIN1 -t UTF-8.")


def _prompt_text(prompt: Optional[str]) -> str:
    """The prompt from --prompt or stdin, refused before any model loads where it is not UTF-8 text or is empty."""
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            fail("give a prompt with --prompt, or pipe it on stdin.")
        stdin = getattr(sys.stdin, "buffer", None)
        try:
            prompt = _utf8(stdin.read() if stdin is not None else sys.stdin.read(), "stdin")
        except UnicodeDecodeError:  # a text stream that decodes strictly by itself
            fail("stdin is not UTF-8 text; convert it to UTF-8 first, e.g. with iconv -f LATIN1 -t UTF-8.")
    else:
        prompt = _utf8(prompt, "--prompt")
    if not prompt.strip():
        fail("The prompt is empty; give some text with --prompt or on stdin.")
    return prompt


def _busy() -> Optional[str]:
    """A warning when other work loads the machine: costs measured now may be off."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None
    if load < 0.75 * cores:
        return None
    return (f"note: this machine is busy (load {load:.1f} on {cores} cores); the costs measured now may be "
            f"off, and later runs refine them.")


def _sharding(text: str) -> str:
    from dflash_mlx.distributed import SHARDINGS

    if text not in SHARDINGS:
        fail(f"--sharding must be one of {', '.join(SHARDINGS)} (got '{text}').")
    return text


def _proposal_scale(text: str):
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        fail(f"--proposal-scale takes a number > 0 or 'auto' (got '{text}').")
    return value


def _one_block_size(text: str):
    if text == "auto":
        return "auto"
    if text.isdigit() and 1 <= int(text) <= 64:
        return int(text)
    fail(f"--block-size takes a number from 1 to 64 or 'auto' (got '{text}').")


def _contexts(text: str) -> List[int]:
    """'1k,8k,32k' -> [1024, 8192, 32768] (a plain number is tokens)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        number = part[:-1] if part.endswith("k") else part
        if not number.isdigit() or int(number) == 0:
            fail(f"--context takes token counts such as 1k,8k,32k or 3000 (got '{text}').")
        out.append(int(number) * (1024 if part.endswith("k") else 1))
    return sorted(set(out))


def _block_sizes(text: str):
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if part in ("auto", "sweep"):
            sizes.append(part)
        elif part.isdigit() and 1 <= int(part) <= 64:
            sizes.append(int(part))
        else:
            fail(f"--block-size takes N (1-64), auto, sweep, or a comma list of them (got '{text}').")
    if "sweep" in sizes and len(sizes) > 1:
        fail("--block-size sweep cannot be combined with other sizes.")
    return sizes


@app.command()
def bench(
    model: str = typer.Option("demo", "--model", help="Alias, repo id or directory."),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model"),
    suite: str = typer.Option("all", "--suite",
                              help="code, math, chat, json (answers kept to a JSON schema each) or all."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="A .jsonl of {\"prompt\": ...} rows instead."),
    max_tokens: int = ranged(128, "--max-tokens", "-m", min=1),
    block_size: str = typer.Option("auto", "--block-size", help="N, auto, sweep, or a comma list (e.g. 4,8,16,auto)."),
    temp: float = ranged(0.0, "--temp", min=0.0),
    repeats: int = ranged(1, "--repeats", min=1),
    out: Optional[str] = typer.Option(None, "--out", help="Write the results as JSON."),
    oracle: bool = typer.Option(False, "--oracle", help="Draft the target's own continuation (the ceiling)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Draw a PNG (needs matplotlib)."),
    context: Optional[str] = typer.Option(
        None, "--context", help="Put each prompt after this many tokens of a long document: e.g. 1k,8k,32k."),
    draft_context: Optional[int] = ranged(None, "--draft-context", min=1, help=DRAFT_CONTEXT_HELP),
    sharding: str = typer.Option(
        "auto", "--sharding", help="Under mlx.launch: mlx-lm's 'tensor' or 'pipeline' parallelism for the target "
                                   "(auto: tensor where the family has it, else pipeline).",
    ),
):
    """Benchmark DFlash against plain mlx-lm decoding on this machine."""
    from dflash_mlx import distributed

    sizes, sharding = _block_sizes(block_size), _sharding(sharding)
    contexts = _contexts(context) if context else [0]
    if context and sizes == ["sweep"]:
        fail("--context cannot be combined with --block-size sweep.")
    g = distributed.group()
    sharded, main_rank = g.size() > 1, distributed.is_main(g)
    if sharded and sizes == ["sweep"]:
        fail("--block-size sweep times one machine; give block sizes under mlx.launch.")
    for path in (out, plot):
        if path and Path(path).is_dir():
            fail(f"Cannot write {path}: it is a folder; give a file name.")
        if path and not Path(path).resolve().parent.is_dir():
            fail(f"Cannot write {path}: its folder does not exist; create it or pick another path.")
    if not main_rank:  # only rank 0 reports; every rank runs the same benchmark
        err.file = open(os.devnull, "w")
    try:
        result = _run_bench(model, draft, suite, prompts, max_tokens, sizes, temp, repeats, oracle, contexts,
                            draft_context, sharding, g)
    except DFlashError as e:
        if not main_rank:
            err.file = None  # back to the process's stderr
        fail(f"rank {g.rank()} of {g.size()}: {e}" if sharded else str(e))
    if not main_rank:
        return
    _print_bench(result, temp)
    _write_bench(result, out, plot)


def _run_bench(model, draft, suite, prompts, max_tokens, sizes, temp, repeats, oracle, contexts, draft_context,
               sharding, g) -> dict:
    """Load the pair (sharded under mlx.launch) and run the benchmark at each context."""
    import dflash_mlx
    from dflash_mlx import bench as B
    from dflash_mlx import distributed
    from dflash_mlx.cli.progress import progress as show_progress

    texts = None if sizes == ["sweep"] else B.load_prompts(suite, prompts)  # before any model loads
    if g.size() > 1:
        pair = distributed.load_sharded(model, draft, g, sharding, draft_context)
        if "auto" in sizes:  # each rank would time its own curve and pick its own widths
            fixed = pair.draft_source.block_size
            sizes = list(dict.fromkeys(fixed if s == "auto" else s for s in sizes))
            err.print(f"note: --block-size auto times one machine; {g.size()} ranks use the drafter's "
                      f"block size, {fixed}")
    else:
        pair = dflash_mlx.load(model, draft, draft_context=draft_context)
    _note_draft_context(pair)
    with show_progress(err, "benchmark") as update:

        def progress(done, total, what="measuring"):
            update(done, total, what)

        if sizes == ["sweep"]:
            return B.sweep(pair, pair.draft_source.block_size, progress=progress)
        B.check_context(pair, contexts, max_tokens)
        by_context = {}
        for c in contexts:
            def step(done, total, what="measuring", c=c):
                progress(done, total, f"context {c}: {what}" if c else what)

            by_context[c] = B.run_bench(pair, texts, max_tokens, sizes, temp, repeats, oracle, step, c)
    result = by_context[contexts[0]]
    if contexts != [0]:
        result = dict(result, contexts={str(c): r for c, r in by_context.items()})
    return result


def _print_bench(result: dict, temp: float) -> None:
    """The machine line and the benchmark's tables."""
    from rich.table import Table

    from dflash_mlx import bench as B

    m = result["machine"]
    err.print(f"{m['chip']} ({m['cores']} cores, {m['memory_gb']} GB), MLX {m['mlx']} on {m['backend']}, "
              f"BLAS: {escape(m['blas'])}")
    if "verify_relative" in result:  # a sweep
        table = Table("width", *[f"verify/1 @ctx {c}" for c in result["contexts"]], "draft/verify1")
        for w in range(len(result["verify_relative"][0])):
            table.add_row(str(w + 1), *[f"{row[w]:.2f}" for row in result["verify_relative"]],
                          f"{result['draft_relative'][0][w]:.2f}")
        err.print(table)
        return
    table = Table("suite", "block", "baseline tok/s", "DFlash tok/s", "speedup", "acceptance", "identical",
                  caption="speedup: ratio of medians (median of per-prompt ratios, ratio of geometric means)")
    prompt_table = Table("suite", "block", "baseline prompt tok/s", "DFlash prompt tok/s", "ratio",
                         "baseline TTFT ms", "DFlash TTFT ms",
                         caption="prompt processing: medians of mlx-lm's and our own figures, same prompts")
    groups = [(name, result["suites"][name]) for name in result["suites"]] + [("overall", result["overall"])]
    for name, per_size in groups:
        for key, s in per_size.items():
            table.add_row(name, key, f"{s['baseline_tps']:.1f}", f"{s['dflash_tps']:.1f}",
                          f"{s['speedup']:.2f}x ({s['speedup_median_per_prompt']:.2f}x, "
                          f"{s['speedup_geomean']:.2f}x)", f"{s['mean_acceptance']:.2f}",
                          f"{s['identical']}/{s['prompts']}" if temp == 0 else "n/a")
            prompt_table.add_row(name, key, f"{s['baseline_prompt_tps']:.0f}", f"{s['dflash_prompt_tps']:.0f}",
                                 f"{s['prompt_speedup']:.2f}x", f"{(s['baseline_ttft'] or 0) * 1000:.0f}",
                                 f"{(s['dflash_ttft'] or 0) * 1000:.0f}")
    err.print(table)
    err.print(prompt_table)
    if "contexts" in result:
        ctx_table = Table("context", "prompt tokens", "block", "speedup", "acceptance", "DFlash TTFT ms",
                          "peak memory GB", caption="each suite prompt after a long document (this package's "
                                                    "source); peak memory is the process's so far")
        for c, r in result["contexts"].items():
            rows = [row for rows in r["prompts"].values() for row in rows]
            for key, s in r["overall"].items():
                ctx_table.add_row(c, str(int(B.median([row["prompt_tokens"] for row in rows]))), key,
                                  f"{s['speedup']:.2f}x", f"{s['mean_acceptance']:.2f}",
                                  f"{(s['dflash_ttft'] or 0) * 1000:.0f}", f"{r['peak_memory_gb']:.2f}")
        err.print(ctx_table)
    for key, s in result["overall"].items():
        if "overhead_seconds_per_cycle" in s:
            ms = {k: s[k] * 1000 for k in ("seconds_per_cycle", "verify_seconds_per_cycle", "overhead_seconds_per_cycle")}
            err.print(f"oracle, block {key}: {ms['seconds_per_cycle']:.2f} ms per cycle; the target's bare verify pass "
                      f"{ms['verify_seconds_per_cycle']:.2f} ms; the loop's own work "
                      f"{ms['overhead_seconds_per_cycle']:.2f} ms per cycle (the same cycles rerun with the "
                      f"target's results in place of its passes)")
    if "distributed" in result:
        d = result["distributed"]
        per_pass = ", ".join(f"width {w}: {s * 1000:.2f} ms" for w, s in d["seconds_per_pass"].items())
        shares = ", ".join(f"{k}: {v:.0%}" for k, v in d["share"].items())
        err.print(f"{d['ranks']} ranks: {d['collectives_per_pass']} collectives per target pass ({per_pass} alone); "
                  f"their share of a step or cycle: {shares}")
    for key, s in result["suites"].get("json", {}).items():
        err.print(f"json, block {key}: {s['stopped']} of {s['prompts']} answers ended within the budget, "
                  f"{s['stopped'] - len(s['invalid_prompts'])} of them valid against their schemas; "
                  f"{s['forced_tokens']} tokens forced by the grammars; {s['grammar_seconds'] * 1000:.0f} ms in "
                  "the grammar engine (both loops constrain with the same engine)")
    mismatched = [p for s in result["overall"].values() for p in s.get("mismatched_prompts", [])]
    if mismatched:
        print_warning(err, f"{len(mismatched)} greedy output(s) differ from plain mlx-lm decoding")
    invalid = [p for s in result["overall"].values() for p in s.get("invalid_prompts", [])]
    if invalid:
        print_warning(err, f"{len(invalid)} answer(s) that stopped do not validate against their schema")


def _write_bench(result: dict, out: Optional[str], plot: Optional[str]) -> None:
    """The results as JSON (a half-written file never replaces an earlier one) and the plot."""
    import json

    from dflash_mlx import bench as B

    if out:
        tmp = Path(out).with_name(Path(out).name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)
        err.print(f"wrote {out}")
    if plot:
        try:
            B.plot(result, plot)
        except ImportError:
            fail("--plot needs matplotlib: pip install 'dflash-mlx[plot]'.")
        err.print(f"wrote {plot}")


@app.command()
def doctor():
    """List the custom kernels and whether each runs on this machine, and the supported target families."""
    import os
    import platform

    import mlx.core as mx
    from rich.table import Table

    from dflash_mlx import kernels
    from dflash_mlx.machine import blas_name

    device = "metal" if kernels.backend() == "metal" else str(mx.default_device())
    err.print(f"MLX {mx.__version__} on {device}, {platform.system()} {platform.machine()}, BLAS: {escape(blas_name())}")
    if os.environ.get(kernels.ENV):
        err.print(f"{kernels.ENV}={os.environ[kernels.ENV]}")
    table = Table("kernel", "status", "why", "what it does")
    colours = {"active": "green", "fallback": "yellow", "unavailable": "dim", "reference": "cyan"}
    for name, summary, state, reason in kernels.report():
        table.add_row(name, f"[{colours.get(state, 'white')}]{state}[/]", reason, summary)
    out = Console(highlight=False, soft_wrap=True)
    out.print(table)
    # Target families: every mlx-lm family whose caches all have a rollback rule.
    from dflash_mlx.target.caches import CI_TESTED, supported_families

    families = supported_families()
    groups = {}
    for family, caches in families.items():
        groups.setdefault(caches, []).append(family)
    out.print(f"Target families ({len(families)} of mlx-lm's, by the cache rollback rule; "
              "others are refused at load with the reason):")
    for caches, names in sorted(groups.items(), key=lambda g: (len(g[0]), g[0])):
        out.print(f"  {escape(caches)}: {', '.join(names)}")
    out.print(f"  tested in CI against plain mlx-lm decoding: {', '.join(CI_TESTED)}")


# `list`'s columns; on a terminal too narrow for all of them, LIST_SPARE are left out
# in this order before an id is cut. The alias and target columns, what a user types, stay.
LIST_COLUMNS = ("alias", "target (--model ALIAS) and variants (ALIAS:VARIANT)", "drafter", "DFlash",
                "target family", "ids confirmed by", "cached locally")
LIST_SPARE = ("ids confirmed by", "target family", "DFlash", "cached locally", "drafter")


def _stdout() -> Console:
    return Console(highlight=False)


def _alias_table(console: Console, rows: List[List[str]]):
    """(table, headers left out) for `console`.

    Off a terminal (a pipe, a file) the table takes its natural width: no cell
    wraps, nothing is cut. On a terminal too narrow for that, the alias, target
    and drafter columns keep the width of their longest id while the other
    columns wrap; where even that does not fit, the least needed columns are
    left out, and only where the alias and target columns alone do not fit do
    the target's ids fold (every character kept) onto more lines."""
    from rich.measure import Measurement
    from rich.table import Column, Table
    from rich.text import Text

    def widest(i):
        return max(len(w) for row in rows for w in Text.from_markup(row[i]).plain.split())

    def build(headers, fixed=False):
        columns = []
        for h in headers:
            i = LIST_COLUMNS.index(h)
            if i == 0:
                columns.append(Column(h, no_wrap=True, width=widest(0)))
            elif i <= 2:  # rich shrinks only the columns without a set width
                columns.append(Column(h, width=widest(i) if fixed else None, overflow="fold"))
            else:
                columns.append(Column(h, overflow="fold"))
        table = Table(*columns)
        for row in rows:
            table.add_row(*[row[LIST_COLUMNS.index(h)] for h in headers])
        return table

    def needs(table):
        return Measurement.get(console, console.options.update_width(1 << 16), table)

    table = build(LIST_COLUMNS)
    if not console.is_terminal:
        console.width = needs(table).maximum
        return table, []
    if needs(table).maximum <= console.width:
        return table, []
    for n in range(len(LIST_SPARE) + 1):
        headers = [h for h in LIST_COLUMNS if h not in LIST_SPARE[:n]]
        table = build(headers, fixed=True)
        if needs(table).minimum <= console.width:
            return table, list(LIST_SPARE[:n])
    return build(headers), list(LIST_SPARE)


@app.command("list")
def list_models():
    """List the model aliases: target and its 4/8-bit MLX variants, drafter, and what is in the Hugging Face cache."""
    from huggingface_hub import constants

    from dflash_mlx.hub import aliases, cached_repos
    from dflash_mlx.target.caches import family_verdict

    cached = cached_repos()
    marks = {"cached": " [green](cached)[/]", "partial": " [yellow](partly cached)[/]"}

    def repo(name: str) -> str:
        return escape(name) + marks.get(cached.get(name.lower()), "")

    rows = []
    for alias, e in aliases().items():
        if e.get("builtin"):
            target, draft, have = f"{e['target']} (in the package)", f"{e['draft']} (in the package)", "built in"
        else:
            lines = [repo(e["target"])]
            lines += [f":{v} {repo(r)}" for v, r in sorted((e.get("variants") or {}).items())]
            target, draft = "\n".join(lines), repo(e["draft"])
            named = [("target", e["target"]), *[(f":{v}", r) for v, r in sorted((e.get("variants") or {}).items())],
                     ("drafter", e["draft"])]
            have = ", ".join(k for k, r in named if cached.get(r.lower()) == "cached") or "-"
        family = e.get("family", "?")
        ok, _ = family_verdict(family)
        family_cell = family + (f" ({e['model_type']})" if e.get("model_type") else "")
        family_cell += "" if ok else " [red](not in this mlx-lm)[/]"
        rows.append([escape(alias), target, draft, str(e.get("dflash", 1)), family_cell,
                     escape(e.get("confirmed", "unconfirmed")), have])
    out = _stdout()
    table, left_out = _alias_table(out, rows)
    out.print(table)
    if left_out:
        out.print(f"Left out to fit this terminal: {', '.join(left_out)}; `dflash-mlx list | cat` prints every "
                  "column.", soft_wrap=True)
    out.print(f"Hugging Face cache: {escape(str(constants.HF_HUB_CACHE))}. "
              "Run `dflash-mlx generate --model ALIAS` (or ALIAS:4bit, ALIAS:8bit for a quantized MLX target).",
              soft_wrap=True)


if __name__ == "__main__":
    app()
