"""`dflash-mlx serve`: the HTTP server (OpenAI chat and completions, Anthropic Messages)."""

import os
import sys
from typing import Optional

import typer

from dflash_mlx.cli.common import (DRAFT_CONTEXT_HELP, SHARDING_HELP, auto_sizer, block_size_choice, err, fail,
                                   load_pair, note_draft_context, ranged, sharding_choice)
from dflash_mlx.errors import DFlashError


def main(
    model: str = typer.Option("demo", "--model", help="Alias, Hugging Face repo id or local directory."),
    draft: Optional[str] = typer.Option(
        None, "--draft", "--draft-model", help="DFlash drafter (default: the model's own)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless told otherwise)."),
    port: int = ranged(8080, "--port", min=0, max=65535, help="Port to listen on (0: any free port, printed at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY'."),
    block_size: str = typer.Option("auto", "--block-size", help="N or 'auto'."),
    temp: float = ranged(0.0, "--temp", min=0.0, max=2.0, help="Temperature for a request that sets none (0 = greedy)."),
    max_prompt_tokens: int = ranged(32768, "--max-prompt-tokens", min=1,
                                    help="Longest prompt a request may send, in tokens; longer ones get a 400."),
    max_tokens: int = ranged(
        32768, "--max-tokens", min=1, help="Most tokens one request may generate; asking for more gets a 400."
    ),
    default_max_tokens: Optional[int] = ranged(
        None, "--default-max-tokens", min=1,
        help="Tokens generated for a request that sets no max_tokens (default: up to the model's context, within "
             "--max-tokens, as OpenAI's API has it).",
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
    """Serve OpenAI-compatible (chat, completions) and Anthropic (Messages) APIs with DFlash.

    Under `mlx.launch` the target is sharded across the processes; rank 0
    serves HTTP and the other ranks run every request with it."""
    import dflash_mlx
    from dflash_mlx import distributed
    from dflash_mlx.serve.http_server import make_server

    sharding = sharding_choice(sharding)
    cache_bytes = _bytes(prompt_cache_bytes, "--prompt-cache-bytes")
    disk_bytes = _bytes(prompt_cache_disk_bytes, "--prompt-cache-disk-bytes")
    if disk_bytes and not cache_bytes:
        fail("--prompt-cache-disk-bytes needs the memory tier: give --prompt-cache-bytes a size above 0.")
    g = distributed.group()
    sharded = g.size() > 1
    if sharded and disk_bytes:
        fail("--prompt-cache-disk-bytes is not supported under mlx.launch yet (each rank would need its own "
             "folder, kept in step); leave it at 0.")
    block = block_size_choice(block_size)
    channel = None
    try:
        pair, block = load_pair(model, draft, g, sharding, draft_context, block)
        if sharded:
            channel = distributed.JobChannel(g)
            if not distributed.is_main(g):
                cache = dflash_mlx.PromptCache(pair, max_bytes=cache_bytes) if cache_bytes else None
                distributed.follow(pair, channel, block, cache)
                return
        elif block == "auto":
            auto_sizer(pair, 0)
        if distributed.is_main(g):
            note_draft_context(pair)
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
