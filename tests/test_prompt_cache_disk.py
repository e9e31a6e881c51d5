"""The prompt cache's disk tier: entries evicted from memory (or spilled at
shutdown) are read back, by this cache or a restarted one, and give exactly
the tokens of a cold run; files are keyed by model, bounded, written whole."""

import http.client
import json
import threading

import mlx.core as mx
import pytest
import tiny
from conftest import ScriptedWidths, plain_greedy

import dflash_mlx
from dflash_mlx.cache import prompt_store
from dflash_mlx.policy.plan import Plan
from dflash_mlx.decode.passes import prefill
from dflash_mlx.cache.prompt_cache import PromptCache
from dflash_mlx.cache.prompt_store import PromptStoreWarning

WIDTHS = [Plan(4, 3), 1, 8, 3]
GiB = 1 << 30


def run(pair, prompt, cache=None, max_tokens=16):
    tokens, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, block_size=ScriptedWidths(WIDTHS),
                                         prompt_cache=cache):
        tokens += ev.tokens
        events.append((ev.tokens, ev.accepted))
    return tokens, ev.stats, events


def files(cache):
    return sorted(p.name for p in cache.disk.folder.iterdir())


def holds(store, prompt):
    return any(f.tokens[: len(prompt)] == tuple(prompt) for f in store._files.values())


def file_of(store, prompt):
    """The file of the entry that starts with `prompt`."""
    (f,) = [f for f in store._files.values() if f.tokens[: len(prompt)] == tuple(prompt)]
    return store.folder / (f.name + ".safetensors")


@pytest.fixture(scope="module")
def window_pair(root, tokenizer_dir, vocab, drafters):
    from mlx_lm import load

    path = tiny.build_target(root / "disk-gemma4_text", "gemma4_text", tokenizer_dir, vocab[0])
    return dflash_mlx.load(str(path), str(drafters["old"])), load(str(path))[0]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4_text"])
def test_a_restarted_cache_reuses_the_conversation_from_disk(pairs, baselines, window_pair, family, tmp_path):
    """Attention, Gated DeltaNet and sliding-window targets: the next turn,
    read back by a new cache over the same folder, equals a cold run and
    mlx-lm; caches usable only whole stay so (a branch reuses nothing)."""
    pair, base = window_pair if family == "gemma4_text" else (pairs[family], baselines[family])
    tok = pair.tokenizer
    prompt = tok.encode("Once upon a time there was a tiny language model that could count: one two")
    first = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    answer, _, _ = run(pair, prompt, first)
    assert first.spill() >= 1 and len(first) == 0 and len(first.disk) >= 1

    again = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    assert len(again.disk) == len(first.disk) and again.disk.nbytes == first.disk.nbytes
    nxt = prompt + answer + tok.encode(" turn two def add(a, b):")
    warm, stats, warm_events = run(pair, nxt, again)
    cold, _, cold_events = run(pair, nxt)
    assert warm == cold == plain_greedy(base, nxt, 16)
    assert warm_events == cold_events  # the drafter saw the same context: same acceptance every cycle
    assert stats.cached_tokens >= len(prompt + answer) - 1 and again.disk.hits == 1

    branch = prompt[:10] + tok.encode(" import math")
    third = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    warm, stats, _ = run(pair, branch, third)
    assert warm == plain_greedy(base, branch, 16)
    assert stats.cached_tokens == (10 if family == "qwen3" else 0)


def test_the_drafter_context_comes_back_from_disk(pairs, tmp_path):
    """The drafter's committed context read back from disk is every row the
    target holds, equal to a cold prefill's."""
    pair, tok, source = pairs["qwen3"], pairs["qwen3"].tokenizer, pairs["qwen3"].draft_source
    prompt = tok.encode("def mean(values):\n    total = 0\n    for v in values:\n")
    first = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    answer, _, _ = run(pair, prompt, first)
    first.spill()
    nxt = prompt + answer + tok.encode("\ndef median(values):\n")
    tcache, state, n = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path).fetch(pair.target, source, nxt)
    assert n >= len(prompt + answer) - 1 and all(c.offset == n for c in tcache)
    cold_t, cold_s = pair.target.make_cache(), source.new_state()
    _, taps = prefill(pair.target, source, cold_s, mx.array(nxt), cold_t)
    source.add_context(cold_s, mx.concatenate(taps, axis=1)[:, :n])
    for r, c in zip(source.save(state), source.save(cold_s)):
        assert r.cache.length == c.cache.length == n and r.cache.offset == c.cache.offset == n
        assert mx.allclose(r.cache.keys[..., :n, :], c.cache.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(r.cache.values[..., :n, :], c.cache.values[..., :n, :], atol=1e-4).item()


def test_memory_evicts_to_disk_and_reads_it_back(pairs, baselines, tmp_path):
    pair, base, tok = pairs["qwen3"], baselines["qwen3"], pairs["qwen3"].tokenizer
    probe = PromptCache(pair)
    a = tok.encode("The quick brown fox jumps over the lazy dog")
    answer, _, _ = run(pair, a, probe)
    cache = PromptCache(pair, max_bytes=int(1.5 * probe.nbytes), disk_bytes=GiB, disk_dir=tmp_path)
    run(pair, a, cache)
    assert len(cache) == 1 and len(cache.disk) == 0
    run(pair, tok.encode("A small model proposes, a large model disposes."), cache)
    assert len(cache) == 1 and len(cache.disk) == 1  # the first entry went to disk
    nxt = a + answer + tok.encode(" and then")
    warm, stats, _ = run(pair, nxt, cache)
    assert warm == plain_greedy(base, nxt, 16)
    assert cache.disk.hits == 1 and stats.cached_tokens >= len(a + answer) - 1
    assert cache.nbytes <= 1.5 * probe.nbytes and len(cache.disk) == 2  # the second one was evicted in turn


def test_another_model_has_its_own_folder_and_never_reads_this_one(pairs, tmp_path):
    qwen, llama = pairs["qwen3"], pairs["llama"]
    cache = PromptCache(qwen, disk_bytes=GiB, disk_dir=tmp_path)
    run(qwen, qwen.tokenizer.encode("import math"), cache)
    cache.spill()
    other = PromptCache(llama, disk_bytes=GiB, disk_dir=tmp_path)
    assert other.disk.key != cache.disk.key and other.disk.folder != cache.disk.folder
    assert len(other.disk) == 0
    # A file copied into another model's folder is refused by its key, and removed.
    name = files(cache)[0]
    (other.disk.folder / name).write_bytes((cache.disk.folder / name).read_bytes())
    with pytest.warns(PromptStoreWarning, match="another model"):
        assert len(PromptCache(llama, disk_bytes=GiB, disk_dir=tmp_path).disk) == 0
    assert files(other) == []


def test_a_corrupt_file_is_skipped_and_removed(pairs, baselines, tmp_path):
    pair, base, tok = pairs["qwen3"], baselines["qwen3"], pairs["qwen3"].tokenizer
    prompts = [tok.encode("import math"), tok.encode("The quick brown fox")]
    cache = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    for p in prompts:
        run(pair, p, cache)
    cache.spill()
    first, second = (file_of(cache.disk, p) for p in prompts)
    first.write_bytes(b"not a safetensors file")
    with pytest.warns(PromptStoreWarning, match="skipping"):
        restarted = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    assert len(restarted.disk) == 1 and not first.exists()
    # Broken after the scan (truncated): the request runs cold, the file goes.
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    nxt = prompts[1] + tok.encode(" jumps")
    with pytest.warns(PromptStoreWarning, match="skipping"):
        warm, stats, _ = run(pair, nxt, restarted)
    assert warm == plain_greedy(base, nxt, 16) and stats.cached_tokens == 0
    assert len(restarted.disk) == 0 and files(restarted) == []


def test_the_disk_bound_evicts_the_least_recently_used_file(pairs, tmp_path):
    pair, tok = pairs["qwen3"], pairs["qwen3"].tokenizer
    prompts = [tok.encode(t) for t in ["import math", "The quick brown", "A small model", "for i in range"]]
    probe = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path / "probe")
    run(pair, prompts[0], probe)
    probe.spill()
    size = probe.disk.nbytes
    cache = PromptCache(pair, max_bytes=1, disk_bytes=int(2.5 * size), disk_dir=tmp_path)  # memory holds nothing

    run(pair, prompts[0], cache)
    run(pair, prompts[1], cache)
    run(pair, prompts[0], cache)  # read back from disk: now the most recently used
    assert cache.disk.hits == 1 and len(cache.disk) == 2
    run(pair, prompts[2], cache)
    assert cache.disk.nbytes <= 2.5 * size and cache.disk.evictions == 1
    kept = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path).disk  # the order of use survives a restart
    assert holds(kept, prompts[0]) and holds(kept, prompts[2]) and not holds(kept, prompts[1])
    run(pair, prompts[3], cache)
    assert not holds(cache.disk, prompts[0])  # it was the oldest


def test_a_failed_write_leaves_no_file(pairs, baselines, tmp_path, monkeypatch):
    pair, base, tok = pairs["qwen3"], baselines["qwen3"], pairs["qwen3"].tokenizer
    prompt = tok.encode("import math")
    real = mx.save_safetensors

    def half_then_fail(path, arrays, metadata):
        real(path, dict(list(arrays.items())[:1]), metadata)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_store.mx, "save_safetensors", half_then_fail)
    cache = PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path)
    run(pair, prompt, cache)
    with pytest.warns(PromptStoreWarning, match="No space left"):
        assert cache.spill() == 0
    assert files(cache) == [] and len(cache.disk) == 0
    monkeypatch.undo()
    nxt = prompt + tok.encode(" import os")
    warm, stats, _ = run(pair, nxt, PromptCache(pair, disk_bytes=GiB, disk_dir=tmp_path))
    assert warm == plain_greedy(base, nxt, 16) and stats.cached_tokens == 0


def chat(port, model, messages):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}))
    body = json.loads(conn.getresponse().read())
    assert "usage" in body, body
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    conn.close()
    return body, health["prompt_cache"]["disk"], metrics


def test_a_restarted_server_reuses_the_prefix_from_disk(pairs, targets, drafters, tmp_path):
    """The real `serve` command, stopped as a service manager does (SIGTERM),
    spills its prompt cache under the cache folder; a server started again
    on that folder reads the next turn's prefix from disk."""
    import os
    import re
    import shutil
    import signal
    import subprocess
    import sys

    from dflash_mlx.serve.http_server import make_server

    model = str(targets["qwen3"])
    exe = shutil.which("dflash-mlx")
    proc = subprocess.Popen(([exe] if exe else [sys.executable, "-m", "dflash_mlx.cli.main"]) + [
        "serve", "--model", model, "--draft", str(drafters["old"]), "--port", "0", "--block-size", "4",
        "--prompt-cache-disk-bytes", "1GB"], stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, DFLASH_MLX_CACHE=str(tmp_path)))
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "serve exited before listening"
        messages = [{"role": "user", "content": "def add(a, b):"}]
        body, disk, _ = chat(int(re.search(r"127\.0\.0\.1:(\d+)/v1", line).group(1)), model, messages)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and disk["entries"] == disk["hits"] == 0
    folders = {p.parent for p in tmp_path.glob("prompt-cache/*/*.safetensors")}
    assert len(folders) == 1  # one folder per model, under the cache folder

    server = make_server(pairs["qwen3"], model, "127.0.0.1", 0, prompt_cache_disk_bytes=GiB,
                         prompt_cache_dir=tmp_path / "prompt-cache")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "import math"}]
        body, disk, metrics = chat(server.server_address[1], model, messages)
    finally:
        server.shutdown()
        server.engine.close()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 5
    assert disk["entries"] >= 1 and disk["hits"] == 1 and disk["bytes"] > 0 and disk["folder"] == str(*folders)
    assert "dflash_prompt_cache_disk_hits_total 1.0" in metrics.splitlines()


def serve_until_listening(model, draft, folder):
    """The real `serve` command with its disk prompt cache in `folder`, stopped
    (SIGTERM) once it answers: its stderr."""
    import re
    import shutil
    import signal
    import subprocess
    import sys

    exe = shutil.which("dflash-mlx")
    proc = subprocess.Popen(([exe] if exe else [sys.executable, "-m", "dflash_mlx.cli.main"]) + [
        "serve", "--model", model, "--draft", draft, "--port", "0", "--block-size", "4",
        "--prompt-cache-disk-bytes", "1GB", "--prompt-cache-dir", str(folder)], stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        while not lines or "serving" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], "serve exited before listening:\n" + "".join(lines)
        conn = http.client.HTTPConnection("127.0.0.1", int(re.search(r":(\d+)/v1", lines[-1]).group(1)), timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    return "".join(lines) + rest


def test_the_server_says_a_file_is_skipped_in_one_warning_line(targets, drafters, tmp_path):
    """As `warning: <message>`, not in Python's format with the source line that warned."""
    model, draft = str(targets["qwen3"]), str(drafters["old"])
    serve_until_listening(model, draft, tmp_path)
    (folder,) = tmp_path.iterdir()  # the model's folder, made at start
    damaged = folder / ("0" * 32 + ".safetensors")
    damaged.write_bytes(b"not a safetensors file")
    log = serve_until_listening(model, draft, tmp_path)
    warned = [line for line in log.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1 and warned[0].startswith(f"warning: prompt cache: skipping {damaged} ("), log
    assert warned[0].endswith("; it was removed.") and ".py:" not in log and not damaged.exists()


@pytest.mark.parametrize("args, says", [
    (["--prompt-cache-disk-bytes", "lots"], "--prompt-cache-disk-bytes takes a size such as 8GB, 512MB or 0 (got 'lots')"),
    (["--prompt-cache-disk-bytes", "20GB", "--prompt-cache-bytes", "0"],
     "--prompt-cache-disk-bytes needs the memory tier: give --prompt-cache-bytes a size above 0."),
])
def test_bad_disk_options_are_one_clear_line(args, says):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 1 and says in r.output
