"""`dflash-mlx generate`: one prompt's answer, streamed."""

import os
import sys
from collections import Counter
from dataclasses import replace
from typing import Optional

import typer

from dflash_mlx.cli.common import (DRAFT_CONTEXT_HELP, SHARDING_HELP, TEMP_HELP, auto_sizer, block_size_choice, err, fail,
                                   load_pair, note_draft_context, ranged, sharding_choice)
from dflash_mlx.errors import DFlashError

TREE_HELP = (
    "Tree verification (greedy, attention-only targets; others verify linearly): with a fixed --block-size, "
    "also verify this many branches (the drafter's 2nd/3rd choices) in every target pass; with auto, the most "
    "branches a cycle may use where the sizer finds they pay (default: 2, as many as the cost curve times, "
    "so trees are used where this machine's timings say they pay; 0 turns them off).")
PROPOSAL_SCALE_HELP = (
    "When sampling: how much flatter (>1) or sharper (<1) than the drafter's own distribution its drafts are "
    "drawn (exact either way; 1: as z-lab's loop), or 'auto' to learn it per draft position from the "
    "acceptance each scale would have had. A seeded request draws without them (`--seed`).")
TIMEOUT_HELP = "Under mlx.launch: end the run when a rank makes no progress for this many seconds (0: never)."


def main(
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
    temp: float = ranged(0.0, "--temp", min=0.0, max=2.0, help=TEMP_HELP),
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

    block, sharding, scale = block_size_choice(block_size), sharding_choice(sharding), _proposal_scale(proposal_scale)
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
    stats, tokens = None, []
    try:
        if sharded and temp > 0:  # one seed for all ranks, so they draw the same numbers
            params = replace(params, seed=distributed.shared_seed(seed, g))
        pair, block = load_pair(model, draft, g, sharding, draft_context, block)
        if constraint is not None:  # refused before any note or measurement
            pair.grammars.compile(constraint)
        if main_rank:
            _note_demo(pair)
            note_draft_context(pair)
        watchdog.beat()
        if enable_thinking is None and pair.resolved is not None:
            enable_thinking = pair.resolved.enable_thinking
        ids = build_prompt(pair.tokenizer, prompt, system, chat_template and not ignore_chat_template,
                           enable_thinking)
        predicted = auto_sizer(pair, len(ids)) if block == "auto" else None
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
            tokens += event.tokens
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
        if constraint is not None:
            _check_complete(pair, constraint, tokens, stats, max_tokens)


def _check_complete(pair, constraint, tokens, stats, max_tokens: int) -> None:
    """An answer that does not keep to its grammar is an error line (exit 1), never silent: one
    the grammar engine gave up on, or one cut by --max-tokens before the grammar's end."""
    from dflash_mlx.constrain.grammar import describe

    what = describe(constraint.kind)
    if stats.finish_reason == "error":
        fail(f"the answer stopped after {_count(stats.generation_tokens, 'token')}: {stats.error}; simplify the "
             f"{what}.")
    if stats.finish_reason == "length":
        walked = pair.grammars.constraint(constraint)
        walked.commit(tokens)
        if not walked.accepting:
            fail(f"the answer reached --max-tokens ({max_tokens}) before its {what} was complete: it is cut short "
                 f"and does not {'validate' if constraint.kind.startswith('json') else 'match'}; raise --max-tokens.")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _print_settings(pair, prompt_tokens: int, block, params) -> None:
    cfg = pair.drafter.args
    err.print(f"target {pair.target_path} ({pair.target.model_type}, {pair.target.num_layers} layers)\n"
              f"drafter {pair.draft_path} (block {cfg.block_size}, taps {cfg.target_layer_ids})\n"
              f"prompt {_count(prompt_tokens, 'token')}, block size {block}, {params}")


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


def _decision(stats, predicted: bool) -> str:
    """What --block-size auto did, from the final stats and in their words, and why."""
    drafted, lookup = stats.draft_cycles, stats.lookup_cycles
    if not drafted:
        return "the default decoded plainly" + (
            ", as the cost curve predicted" if predicted else ": no draft was expected to pay on this text")
    if lookup == drafted:
        plain = stats.cycles - drafted
        return (f"the default drafted from the n-gram lookup only ({_count(drafted, 'cycle')}, where the text repeated)"
                + (f" and decoded plainly elsewhere ({_count(plain, 'cycle')})" if plain else "")
                + ("; the drafter was not expected to pay" if predicted else ""))
    from_lookup = f", {lookup} of them from the lookup" if lookup else ""
    return (f"the default drafted with the drafter ({_count(drafted, 'cycle')}{from_lookup}): "
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
