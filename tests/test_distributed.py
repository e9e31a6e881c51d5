"""DFlash with the target sharded across processes (issue 16): tensor
parallelism for qwen3 and llama, two processes started by `mlx.launch` with
the ring backend on loopback, running `python -m dflash_mlx.distributed`.

Each launch starts two Python processes that import mlx-lm and load the
pair (about 10 s on two CPU cores), so every prompt and block size goes
through one launch per family.
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import tiny
from conftest import DRAFTER_LAYOUT, plain_greedy

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
PROMPTS = ["def add(a, b):", "Once upon a time there was"]
BLOCK_SIZES = [1, 4, 8]
MAX_TOKENS = 16
TIMEOUT = 240

pytestmark = pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch is not installed")


def free_ports(n=2):
    """A first port of `n` consecutive free ones on loopback (the ring backend listens on port + rank)."""
    for _ in range(100):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(*args, env=(), timeout=TIMEOUT):
    """`mlx.launch -n 2 --backend ring` of the entry point; (its output, the JSON lines rank 0 printed)."""
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports()),
           *[f"--env={e}" for e in env], "--", sys.executable, "-m", "dflash_mlx.distributed",
           "--no-chat-template", *map(str, args)]
    stdout, stderr = run_launch(cmd, timeout)
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    return stdout + stderr, lines


def run_launch(cmd, timeout):
    """(stdout, stderr) of a launch; a hang (a collective waiting forever) fails the test after
    `timeout` seconds, and the launcher and its ranks (one process group) are killed."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), start_new_session=True)
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the launch hung for {timeout} s:\n{out}{err}")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_equals_unsharded_plain_decoding(family, targets, drafters):
    from mlx_lm import load

    model, tokenizer = load(str(targets[family]))
    output, runs = launch("--model", targets[family], "--draft", drafters[DRAFTER_LAYOUT[family]],
                          *sum((["--prompt", p] for p in PROMPTS), []), "--max-tokens", MAX_TOKENS,
                          "--block-size", *BLOCK_SIZES, "--json")
    assert len(runs) == len(PROMPTS) * len(BLOCK_SIZES), output
    assert "rank 1" not in output  # only rank 0 prints
    for run in runs:
        assert run["ranks"] == 2
        want = plain_greedy(model, tokenizer.encode(run["prompt"]), MAX_TOKENS)
        assert run["tokens"] == want, (run["prompt"], run["block_size"])


def test_seeded_sampling_is_identical_on_every_rank(targets, drafters, tmp_path):
    output, runs = launch("--model", targets["llama"], "--draft", drafters["new"], "--prompt", PROMPTS[0],
                          "--prompt", PROMPTS[1], "--max-tokens", 24, "--block-size", 8, "--temp", 1.0,
                          "--seed", 3, "--json", "--ids-out", tmp_path / "ids-{rank}.json")
    assert len(runs) == 2, output
    ids = [json.loads((tmp_path / f"ids-{r}.json").read_text()) for r in (0, 1)]
    assert ids[0] == ids[1] == [r["tokens"] for r in runs]
    assert all(len(t) > 0 for t in ids[0])
    # Drafts were accepted and the caches cropped to them, identically on both ranks.
    assert max(a for r in runs for a in r["acceptance"]) > 1


def test_a_failing_rank_ends_the_run(targets, drafters):
    output, runs = launch("--model", targets["qwen3"], "--draft", drafters["old"], "--prompt", PROMPTS[0],
                          "--max-tokens", 8, "--json", env=["DFLASH_MLX_TEST_FAIL_RANK=1"], timeout=120)
    assert runs == []
    assert "dflash-mlx (rank 1 of 2): rank 1 was told to fail" in output
    assert "dflash-mlx (rank 0 of 2): a collective failed" in output
    # mlx.launch 0.32 exits 0 whatever its ranks do; it reports their exit codes.
    assert "Node with rank 1 exited with code 1" in output


SCHEDULES = {  # test_lossless's: which draft index the oracle corrupts (None: a perfect draft)
    "always full": "None",
    "always first": "0",
    "cycle through positions": "c % w if c % w < w - 1 else None",
}


def oracle_main(cfg_path):
    """Under mlx.launch: each case's target sharded, drafts from test_lossless's
    OracleSource (the plain greedy continuation, corrupted at chosen indices),
    so verify accepts every prefix length and the sharded caches are cropped
    at every block position; every rank writes what it generated."""
    import dflash_mlx
    from dflash_mlx.distributed import group, load_sharded
    from test_lossless import OracleSource

    cfg = json.loads(Path(cfg_path).read_text())
    g = group()
    results = []
    for case in cfg["cases"]:
        pair = load_sharded(case["model"], case["draft"], g)
        feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
        for name, rule in SCHEDULES.items():
            source = OracleSource(case["prompt"] + case["ref"], pair.target.vocab_size, feature_dim,
                                  eval(f"lambda c, w: {rule}"))
            out, accepted = [], []
            for ev in dflash_mlx.stream_generate(pair, case["prompt"], max_tokens=len(case["ref"]),
                                                 block_size=case["block_size"], draft_source=source):
                out += ev.tokens
                accepted.append(ev.accepted)
            results.append({"schedule": name, "tokens": out, "accepted": accepted[1:], "expected": source.expected})
    Path(cfg["out"].format(rank=g.rank())).write_text(json.dumps(results))


def test_sharded_caches_roll_back_at_every_block_position(targets, drafters, root, tokenizer_dir, vocab, tmp_path):
    from mlx_lm import load

    cases = []
    # gpt_oss: sliding windows of 8 (WindowCache) with attention sinks, a routed MoE; qwen3_moe: routed MoE.
    # qwen3_5: Gated DeltaNet heads split across ranks (the tape's output all-summed), attention every third layer.
    for family, block_size in [("qwen3", 8), ("llama", 4), ("qwen3_moe", 8), ("gpt_oss", 8), ("qwen3_5", 8)]:
        path = targets.get(family) or root / family
        if not path.exists():
            tiny.build_target(path, family, tokenizer_dir, vocab[0])
        model, tokenizer = load(str(path))
        prompt = tokenizer.encode(PROMPTS[0])
        cases.append(dict(model=str(path), draft=str(drafters[DRAFTER_LAYOUT.get(family, "new")]), prompt=prompt,
                          ref=plain_greedy(model, prompt, 40), block_size=block_size))
    cfg = tmp_path / "cases.json"
    cfg.write_text(json.dumps({"cases": cases, "out": str(tmp_path / "out-{rank}.json")}))
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_ports()), "--",
           sys.executable, __file__, str(cfg)]
    output = "".join(run_launch(cmd, TIMEOUT))
    ranks = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)] \
        if (tmp_path / "out-1.json").exists() else output
    assert isinstance(ranks, list), ranks
    assert ranks[0] == ranks[1]
    for i, case in enumerate(cases):
        results = ranks[0][i * len(SCHEDULES) : (i + 1) * len(SCHEDULES)]
        for r in results:
            assert r["tokens"] == case["ref"], r["schedule"]
            assert r["accepted"][: len(r["expected"])] == r["expected"], r["schedule"]
        assert max(results[0]["accepted"]) == case["block_size"] - 1  # whole blocks accepted


def test_a_hanging_rank_ends_the_run_after_the_timeout(targets, drafters):
    output, runs = launch("--model", targets["llama"], "--draft", drafters["new"], "--prompt", PROMPTS[0],
                          "--max-tokens", 8, "--json", "--timeout", 5, env=["DFLASH_MLX_TEST_HANG_RANK=1"],
                          timeout=120)
    assert runs == []
    assert "dflash-mlx (rank 0 of 2): no progress for 5 s, another rank is not answering" in output


class _Group:
    def __init__(self, size=2, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("family,message", [
    ("qwen3_next", "pipeline parallelism (model.model.pipeline) is not supported by dflash-mlx yet"),
    ("gemma4_text", "no pipeline parallelism either"),
])
def test_families_that_cannot_be_sharded_are_refused(family, message, root, tokenizer_dir, vocab):
    from dflash_mlx import DFlashError
    from dflash_mlx.distributed import _sharded_loader

    path = root / family
    if not path.exists():
        tiny.build_target(path, family, tokenizer_dir, vocab[0])
    with pytest.raises(DFlashError, match="^Target family") as e:
        _sharded_loader(_Group())(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_process_is_not_distributed():
    from dflash_mlx.distributed import group, is_main

    assert mx.distributed.init().size() == 1
    assert group().size() == 1 and is_main()


if __name__ == "__main__":  # one rank of test_sharded_caches_roll_back_at_every_block_position
    oracle_main(sys.argv[1])
