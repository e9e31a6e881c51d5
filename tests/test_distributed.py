"""DFlash with the target sharded across processes: tensor and
pipeline parallelism, two processes with the ring backend on loopback.

Each launch starts two Python processes that import mlx-lm (about 10 s on
two CPU cores), so every scenario that ends normally runs in one launch: this
file, run by each rank, calls the entry point `dflash_mlx.distributed.main`
for each command line (greedy over prompts and block sizes per family, seeded
sampling) and then the sharded oracle rollback cases and the pipelined
taps, and writes what each rank printed and generated; the tests below assert on that shared result. That
launch starts its ranks as `mlx.launch -n 2 --backend ring` does (`run_ranks`). A failing and a hanging
rank end their run, so each has a launch of its own, by `mlx.launch` (`python -m dflash_mlx.distributed`).
"""

import contextlib
import io
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

import tiny
from conftest import DRAFTER_LAYOUT, ROLLBACK_SCHEDULES, greedy_ref

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
PROMPTS = ["def add(a, b):", "Once upon a time there was"]
BLOCK_SIZES = [1, 4, 8]
MAX_TOKENS = 16
TIMEOUT = 300
# The shared launch counts as hung once no rank has printed a line for this long: each prints one per
# step (loading a sharded pair and decoding with it), which takes about 10 s on two CPU cores that two
# other busy processes share. The whole launch may take as long as its steps do.
STALL = 180
# Where free_ports looks: below the ephemeral ports (Linux from 32768, macOS from 49152) that the kernel
# hands to every outgoing connection and port-0 bind, so a probed port is seldom taken before it is bound.
PORTS = (20000, 32000)

pytestmark = pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch is not installed")

_held = []  # the sockets that hold the ports ring_ports handed out, for the life of this process


def free_ports(n=2):
    """A first port of `n` consecutive ones free on loopback now (for the ring backend, `ring_ports`)."""
    for _ in range(100):
        base = random.randint(*PORTS)
        try:
            with contextlib.ExitStack() as probes:
                for p in range(base, base + n):
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def ring_ports():
    """A first port of two for the ring backend's ranks (each listens on port + rank), held until
    this process ends so that no other socket takes one before the ranks bind them: `free_ports`'
    probe closes its sockets, and another test or process may bind a port, or be handed it for a
    connection, while the ranks import MLX. Each is held by a socket bound with SO_REUSEPORT, as
    the ring backend binds (so a rank can bind it too), that never listens (so connections reach the
    rank alone); any other socket is refused it, and a port held for another launch fails the probe."""
    for _ in range(100):
        base, held = free_ports(), []
        try:
            for p in (base, base + 1):
                held.append(socket.socket())
                held[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                held[-1].bind(("127.0.0.1", p))
        except OSError:  # taken since the probe
            for s in held:
                s.close()
            continue
        _held.extend(held)
        return base
    raise RuntimeError("no free ports")


def launch_cmd(*program, env=()):
    return [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_ports()),
            *[f"--env={e}" for e in env], "--", sys.executable, *map(str, program)]


def launch(*args, env=(), timeout=TIMEOUT):
    """`mlx.launch -n 2 --backend ring` of the entry point; (its output, the JSON lines rank 0 printed)."""
    cmd = launch_cmd("-m", "dflash_mlx.distributed", "--no-chat-template", *args, env=env)
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


def run_ranks(hostfile, *program, env=None, base=None, stall=STALL):
    """(each rank's exit code, what the ranks printed, each line headed by the seconds since the
    start and its rank) of `python program` on two ranks with the ring backend on loopback (ports
    `base` and `base` + 1, default `ring_ports`), started as `mlx.launch -n 2 --backend ring` starts
    them: with MLX_RANK, and the ranks' addresses in the JSON file `hostfile`. Not by mlx.launch
    itself: its threads that pass the ranks' output on poll their pipes without ever sleeping
    (select on the ranks' stdin, always writable), and take as much CPU as a rank. A rank that fails
    ends the other, as under mlx.launch; ranks that print nothing for `stall` seconds are hung: both
    are killed and the test fails."""
    base = base or ring_ports()
    Path(hostfile).write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(2)]))
    ranks = [subprocess.Popen([sys.executable, *map(str, program)], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env=dict(os.environ, TOKENIZERS_PARALLELISM="false", MLX_RANK=str(r),
                                       MLX_HOSTFILE=str(hostfile), **(env or {})))
             for r in range(2)]
    lines = queue.Queue()

    def read(r):
        for line in ranks[r].stdout:
            lines.put((r, line))
        lines.put((r, None))

    for r in range(2):
        threading.Thread(target=read, args=(r,), daemon=True).start()
    out, running, start = [], 2, time.monotonic()
    try:
        while running:
            try:
                r, line = lines.get(timeout=stall)
            except queue.Empty:
                pytest.fail(f"the launch hung: no rank printed a line for {stall} s:\n{''.join(out)}")
            if line is not None:
                out.append(f"[{time.monotonic() - start:.0f} s, rank {r}] {line}")
                continue
            running -= 1
            if ranks[r].wait() != 0:  # as mlx.launch does: the other would wait for it forever
                for p in ranks:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in ranks], "".join(out)


# gpt_oss: sliding windows of 8 (WindowCache) with attention sinks, a routed MoE; qwen3_moe: routed MoE.
# qwen3_5: Gated DeltaNet heads split across ranks (the tape's output all-summed), attention every third layer.
# Pipelined (mlx-lm's model.model.pipeline): rank 1 runs layers 0-2, rank 0 layers 3-5, each its own caches
# (Gated DeltaNet tapes and KV caches); qwen3_next has no tensor parallelism, so "auto" pipelines it.
ORACLE_CASES = [("qwen3", 8, "auto"), ("llama", 4, "auto"), ("qwen3_moe", 8, "auto"), ("gpt_oss", 8, "auto"),
                ("qwen3_5", 8, "auto"), ("qwen3_5", 8, "pipeline"), ("qwen3_next", 4, "auto")]
PIPELINED = ("qwen3_5", "qwen3_next")


def rank_main(cfg_path):
    """One rank of the shared launch (`run_ranks`): each command line through the entry point's `main`
    (its stdout and stderr captured), then each oracle case's target sharded, drafts
    from the tests' OracleSource (the plain greedy continuation, corrupted at
    the indices each of ROLLBACK_SCHEDULES chooses), so verify accepts every prefix length and the sharded caches
    are cropped at every block position; every rank writes what it printed and generated. It prints a
    line after each step (`run_ranks` tells a slow launch from a hung one by them), and a command line
    that fails ends it: the other rank, which may not have failed, would wait for it in a collective."""
    import dflash_mlx
    from dflash_mlx.distributed import WholeTaps, collectives_per_pass, communication_seconds, group, load_sharded, main
    from conftest import OracleSource

    cfg = json.loads(Path(cfg_path).read_text())
    g = group()

    def say(what):
        print(f"rank {g.rank()}: {what}", flush=True)

    say("connected")
    runs = {}
    for name, argv in cfg["commands"].items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        runs[name] = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
        if rc:
            say(f"{name} failed:\n{err.getvalue()}")
            os._exit(rc)  # as the entry point does (`python -m dflash_mlx.distributed`)
        say(f"{name} done")
    oracle = []
    for i, case in enumerate(cfg["cases"]):
        pair = load_sharded(case["model"], case["draft"], g, case["sharding"])
        feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
        for name, corrupt in ROLLBACK_SCHEDULES.items():
            source = OracleSource(case["prompt"] + case["ref"], pair.target.vocab_size, feature_dim, corrupt)
            if pair.target.pipelined:
                source = WholeTaps(source, g)
            out, accepted = [], []
            for ev in dflash_mlx.stream_generate(pair, case["prompt"], max_tokens=len(case["ref"]),
                                                 block_size=case["block_size"], draft_source=source):
                out += ev.tokens
                accepted.append(ev.accepted)
            oracle.append({"case": i, "schedule": name, "tokens": out, "accepted": accepted[1:],
                           "expected": source.expected, "pipelined": pair.target.pipelined})
        say(f"oracle case {case['family']}-{case['block_size']}-{case['sharding']} done")
    taps = {}
    for family, (model, draft) in cfg["taps"].items():
        # The taps the drafter reads, summed from each rank's share, against one process's.
        pair, alone = load_sharded(model, draft, g, "pipeline"), dflash_mlx.load(model, draft)
        tokens = mx.array(cfg["cases"][0]["prompt"])[None]
        logits, share = pair.target(tokens, pair.target.make_cache())
        mx.eval(logits, share)
        ref_logits, ref = alone.target(tokens, alone.target.make_cache())
        whole = pair.draft_source.whole(share)
        H = pair.target.hidden_size
        taps[family] = {
            "equal": mx.array_equal(whole, ref).item(), "logits_equal": mx.array_equal(logits, ref_logits).item(),
            "nonzero": [bool(mx.any(share[..., k * H : (k + 1) * H] != 0).item()) for k in range(len(pair.target.tap_ids))],
            "tap_ids": pair.target.tap_ids, "local": pair.target.local_taps,
            "collectives": collectives_per_pass(pair.target.model),
            "seconds": communication_seconds(pair, [1, 4], rounds=1)}
        say(f"taps {family} done")
    out = Path(cfg["out"].format(rank=g.rank()))
    part = out.with_name(out.name + ".part")  # renamed when whole: a rank killed while writing leaves no result
    part.write_text(json.dumps({"commands": runs, "oracle": oracle, "taps": taps}))
    part.replace(out)


def encode(tokenizer_dir, text):
    """The ids of `text` by the tokenizer every tiny target shares."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode(text)


def family_path(family, targets, root, tokenizer_dir, vocab):
    path = targets.get(family) or root / family
    if not path.exists():
        tiny.build_target(path, family, tokenizer_dir, vocab[0])
    return path


def indexed_path(family, model, source, root):
    """The target saved as mlx-lm saves a model (weights and model.safetensors.index.json, which
    mlx-lm's pipelined loading reads to find each rank's weights)."""
    from mlx_lm.utils import save_model

    path = root / f"{family}-indexed"
    if not (path / "model.safetensors.index.json").exists():
        save_model(path, model)
        for f in source.iterdir():
            if not f.name.startswith("model.safetensors"):
                shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def sharded(targets, drafters, baselines, root, tokenizer_dir, vocab, tmp_path_factory):
    """One 2-rank launch of every scenario that ends normally; (the cases, each rank's results, the ids dir)."""
    from mlx_lm import load

    tmp = tmp_path_factory.mktemp("sharded")
    V, mask = vocab
    # Taps on both ranks' layers and the last layer's (HF's final-norm entry) under pipeline parallelism.
    draft_all = tiny.build_drafter(root / "draft-taps-135", tiny.drafter_config("new", V, 6, mask_token_id=mask,
                                                                                layer_ids=(1, 3, 5)))
    models = {f: baselines[f] if f in baselines else load(str(family_path(f, targets, root, tokenizer_dir, vocab)))[0]
              for f in {f for f, _, _ in ORACLE_CASES}}
    indexed = {f: indexed_path(f, models[f], family_path(f, targets, root, tokenizer_dir, vocab), root)
               for f in PIPELINED}
    commands = {}
    for family in ("qwen3", "llama"):
        commands[f"greedy-{family}"] = [
            "--model", targets[family], "--draft", drafters[DRAFTER_LAYOUT[family]], "--no-chat-template",
            *sum((["--prompt", p] for p in PROMPTS), []), "--max-tokens", MAX_TOKENS,
            "--block-size", *BLOCK_SIZES, "--json"]
    commands["sampled-llama"] = [
        "--model", targets["llama"], "--draft", drafters["new"], "--no-chat-template", "--prompt", PROMPTS[0],
        "--prompt", PROMPTS[1], "--max-tokens", 24, "--block-size", 8, "--temp", 1.0, "--seed", 3, "--json",
        "--ids-out", tmp / "ids-llama-{rank}.json"]
    commands["greedy-qwen3_5-pipeline"] = [
        "--model", indexed["qwen3_5"], "--draft", draft_all, "--sharding", "pipeline", "--no-chat-template",
        *sum((["--prompt", p] for p in PROMPTS), []), "--max-tokens", MAX_TOKENS, "--block-size", *BLOCK_SIZES, "--json"]
    commands["sampled-qwen3_5-pipeline"] = [
        "--model", indexed["qwen3_5"], "--draft", draft_all, "--sharding", "pipeline", "--no-chat-template",
        "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", 24, "--block-size", 4, "--temp", 1.0,
        "--seed", 3, "--json", "--ids-out", tmp / "ids-qwen3_5-pipeline-{rank}.json"]
    cases = []
    prompt = encode(tokenizer_dir, PROMPTS[0])
    for family, block_size, sharding in ORACLE_CASES:
        path = indexed[family] if family in indexed else family_path(family, targets, root, tokenizer_dir, vocab)
        cases.append(dict(family=family, model=str(path), draft=str(drafters[DRAFTER_LAYOUT.get(family, "new")]),
                          prompt=prompt, ref=greedy_ref(models[family], prompt, 40), block_size=block_size,
                          sharding=sharding))
    cfg = tmp / "cases.json"
    cfg.write_text(json.dumps({"commands": {k: list(map(str, v)) for k, v in commands.items()}, "cases": cases,
                               "taps": {f: (str(indexed[f]), str(draft_all)) for f in PIPELINED},
                               "out": str(tmp / "out-{rank}.json")}))
    codes, output = run_ranks(tmp / "hosts.json", __file__, cfg)
    if codes != [0, 0] or not all((tmp / f"out-{r}.json").exists() for r in (0, 1)):
        pytest.fail(f"the launch ended before both ranks wrote their results:\n{output}")
    ranks = [json.loads((tmp / f"out-{r}.json").read_text()) for r in (0, 1)]
    return cases, ranks, tmp


def command_run(sharded, name):
    """Rank 0's JSON lines of a command line, checked to have ended well on both ranks with only rank 0 printing."""
    _, ranks, _ = sharded
    r0, r1 = (ranks[r]["commands"][name] for r in (0, 1))
    assert r0["rc"] == r1["rc"] == 0, (r0, r1)
    assert r1["stdout"] == ""  # only rank 0 prints
    return [json.loads(x) for x in r0["stdout"].splitlines() if x.startswith("{")]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5-pipeline"])
def test_greedy_equals_unsharded_plain_decoding(family, sharded, baselines, tokenizer_dir):
    runs = command_run(sharded, f"greedy-{family}")
    assert len(runs) == len(PROMPTS) * len(BLOCK_SIZES), runs
    assert sorted((r["prompt"], r["block_size"]) for r in runs) == sorted(
        (p, b) for p in PROMPTS for b in BLOCK_SIZES)
    for run in runs:
        assert run["ranks"] == 2
        want = greedy_ref(baselines[family.split("-")[0]], encode(tokenizer_dir, run["prompt"]), MAX_TOKENS)
        assert run["tokens"] == want, (run["prompt"], run["block_size"])


@pytest.mark.parametrize("name", ["llama", "qwen3_5-pipeline"])
def test_seeded_sampling_is_identical_on_every_rank(sharded, name):
    runs = command_run(sharded, f"sampled-{name}")
    tmp = sharded[2]
    assert len(runs) == 2, runs
    ids = [json.loads((tmp / f"ids-{name}-{r}.json").read_text()) for r in (0, 1)]
    assert ids[0] == ids[1] == [r["tokens"] for r in runs]
    assert all(len(t) > 0 for t in ids[0])
    # Drafts were accepted and the caches cropped to them, identically on both ranks.
    assert max(a for r in runs for a in r["acceptance"]) > 1


@pytest.mark.parametrize("case", range(len(ORACLE_CASES)), ids=[f"{f}-{b}-{s}" for f, b, s in ORACLE_CASES])
def test_sharded_caches_roll_back_at_every_block_position(sharded, case):
    cases, ranks, _ = sharded
    assert ranks[0]["oracle"] == ranks[1]["oracle"]
    c = cases[case]
    results = {r["schedule"]: r for r in ranks[0]["oracle"] if r["case"] == case}
    assert set(results) == set(ROLLBACK_SCHEDULES)
    assert all(r["pipelined"] == (c["sharding"] == "pipeline" or c["family"] == "qwen3_next") for r in results.values())
    for name, r in results.items():
        assert r["tokens"] == c["ref"], (c["family"], name)
        assert r["accepted"][: len(r["expected"])] == r["expected"], (c["family"], name)
    assert max(results["always full"]["accepted"]) == c["block_size"] - 1  # whole blocks accepted
    assert set(results["cycle through positions"]["expected"]) == set(range(c["block_size"]))  # every length


@pytest.mark.parametrize("family", PIPELINED)
def test_pipelined_taps_are_each_ranks_own_and_sum_to_one_process_taps(sharded, family):
    """Rank 1 runs layers 0-2, rank 0 layers 3-5 (mlx-lm gives rank 0 the last): each computes
    the taps of its own layers (the last one normed, HF's entry) and zeros for the others', and
    their sum, the one all_sum per cycle, equals one process's taps bit for bit."""
    _, ranks, _ = sharded
    t0, t1 = (ranks[r]["taps"][family] for r in (0, 1))
    assert t0["tap_ids"] == [1, 3, 5] and t0["local"] == [3, 5] and t1["local"] == [1]
    assert t0["nonzero"] == [False, True, True] and t1["nonzero"] == [True, False, False]
    assert t0["equal"] and t1["equal"] and t0["logits_equal"] and t1["logits_equal"]
    # A send/recv between the two ranks and an all_gather per pass; timed alone with the taps' all_sum.
    assert t0["collectives"] == t1["collectives"] == 2
    assert set(t0["seconds"]) == {"1", "4"} and all(s > 0 for s in t0["seconds"].values())


def test_a_failing_rank_ends_the_run(targets, drafters):
    output, runs = launch("--model", targets["qwen3"], "--draft", drafters["old"], "--prompt", PROMPTS[0],
                          "--max-tokens", 8, "--json", env=["DFLASH_MLX_TEST_FAIL_RANK=1"], timeout=120)
    assert runs == []
    assert "dflash-mlx (rank 1 of 2): rank 1 was told to fail" in output
    # mlx.launch 0.32 exits 0 whatever its ranks do; it reports their exit codes. The failed rank
    # leaves at once with its own code; the other either sees the collective fail first or is ended
    # by mlx.launch (which of the two is a race), never left waiting.
    assert "Node with rank 1 exited with code 1" in output
    assert ("dflash-mlx (rank 0 of 2): a collective failed" in output
            or "Node with rank 0 exited with code -15" in output)


@pytest.mark.parametrize("error,line", [
    (RuntimeError("[ring] Socket 3 was closed by the peer\nmore"),
     "a collective failed ([ring] Socket 3 was closed by the peer): another rank has probably stopped; "
     "its error is above"),
    (RuntimeError("out of memory\nmore"), "out of memory"),
])
def test_a_rank_says_in_one_line_why_it_stopped(monkeypatch, capsys, error, line):
    """What rank 0 prints when the other rank's exit breaks a collective (the launch above may end it
    before it can, a race), and any other error: one line, code 1."""
    from dflash_mlx import distributed

    def fail(args, g, watchdog):
        raise error

    monkeypatch.setattr(distributed, "run", fail)
    assert distributed.main(["--model", "m", "--prompt", "p"]) == 1
    assert capsys.readouterr().err == f"dflash-mlx (rank 0 of 1): {line}\n"


def test_a_hanging_rank_ends_the_run_after_the_timeout(targets, drafters):
    output, runs = launch("--model", targets["llama"], "--draft", drafters["new"], "--prompt", PROMPTS[0],
                          "--max-tokens", 8, "--json", "--timeout", 5, env=["DFLASH_MLX_TEST_HANG_RANK=1"],
                          timeout=120)
    assert runs == []
    assert "dflash-mlx (rank 0 of 2): no progress for 5 s, another rank is not answering" in output


RING_CHECK = ("import mlx.core as mx; g = mx.distributed.init(); "
              "print('sum', mx.distributed.all_sum(mx.array(g.rank() + 1.0)).item())")


def test_the_ports_a_launch_is_given_are_held_for_its_ranks_alone(tmp_path):
    """Between ring_ports and the ranks' binds (after they import MLX) no other socket can take a
    port: a plain bind and one with SO_REUSEADDR (as servers bind) are refused; the ranks bind them."""
    base = ring_ports()
    for options in ((), (socket.SO_REUSEADDR,)):
        with socket.socket() as other:
            for option in options:
                other.setsockopt(socket.SOL_SOCKET, option, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", base))
    codes, output = run_ranks(tmp_path / "hosts.json", "-c", RING_CHECK, base=base)
    assert codes == [0, 0] and output.count("sum 3.0") == 2, output


def test_a_rank_that_cannot_bind_its_port_ends_the_launch(tmp_path):
    """A port another process took (here one ring_ports did not hold): rank 0 fails to bind it
    and says so, and rank 1, which connected to whatever listens there, is ended rather than left
    waiting for rank 0 forever."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        codes, output = run_ranks(tmp_path / "hosts.json", "-c", RING_CHECK, base=taken.getsockname()[1])
    assert codes[0] == 1 and codes[1] != 0, output
    assert "[ring] Couldn't bind socket" in output and "sum" not in output


def test_a_launch_whose_ranks_print_nothing_fails_as_hung(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="no rank printed a line for 2 s"):
        run_ranks(tmp_path / "hosts.json", "-c", "import time; time.sleep(600)", stall=2)


def test_a_command_line_failing_on_one_rank_ends_the_shared_launch(targets, drafters, tmp_path):
    """The shared launch's ranks stop at a command line that fails: the other rank may still be
    running it, and would wait in a collective for a rank gone on to the next one."""
    argv = ["--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "--prompt", PROMPTS[0],
            "--max-tokens", "8", "--json"]
    cfg = tmp_path / "cases.json"
    cfg.write_text(json.dumps({"commands": {"first": argv, "second": argv}, "cases": [], "taps": {},
                               "out": str(tmp_path / "out-{rank}.json")}))
    codes, output = run_ranks(tmp_path / "hosts.json", __file__, cfg, env={"DFLASH_MLX_TEST_FAIL_RANK": "1"})
    assert codes[1] == 1 and codes[0] != 0, output
    assert "rank 1: first failed:" in output and "rank 1 was told to fail" in output
    assert "first done" not in output and "second" not in output and not list(tmp_path.glob("out-*.json"))


class _Group:
    def __init__(self, size=2, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("family,sharding,message", [
    ("gemma4_text", "auto", "mlx-lm gives it neither tensor parallelism (model.shard) nor pipeline parallelism"),
    ("qwen3_next", "tensor", "cannot be sharded with tensor parallelism: mlx-lm gives it none; use --sharding pipeline"),
    ("llama", "pipeline", "cannot be sharded with pipeline parallelism: mlx-lm gives it none; use --sharding tensor"),
    ("qwen3_5", "pipeline", "has no model.safetensors.index.json, which mlx-lm's pipeline loading reads"),
])
def test_families_that_cannot_be_sharded_are_refused(family, sharding, message, targets, root, tokenizer_dir, vocab):
    from dflash_mlx import DFlashError
    from dflash_mlx.distributed import _sharded_loader

    path = family_path(family, targets, root, tokenizer_dir, vocab)  # tiny targets are saved without an index
    with pytest.raises(DFlashError) as e:
        _sharded_loader(_Group(), sharding)(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_process_is_not_distributed():
    from dflash_mlx.distributed import group, is_main

    assert mx.distributed.init().size() == 1
    assert group().size() == 1 and is_main()


def test_the_word_to_stop_is_heard_one_event_later_on_every_rank():
    """Rank 0's word after an event is read after the next one (so no rank
    waits for the cycle in flight), and a new request starts with none pending."""
    from dflash_mlx.distributed import JobChannel

    channel = JobChannel(mx.distributed.init())
    assert [channel.keep_going(stop) for stop in (False, True, False, False)] == [True, True, False, True]
    channel.keep_going(True)
    channel.send({"prompt": [1]})
    assert channel.keep_going() is True and channel.keep_going() is True


class _Sent:
    """Rank 0's end of a JobChannel: what it sends, kept."""

    def __init__(self):
        self.requests = []

    def send(self, request):
        self.requests.append(request)

    def keep_going(self, stop=False):
        return not stop


class _Heard:
    """Another rank's end: rank 0's requests, in order."""

    def __init__(self, requests):
        self.requests = list(requests)

    def receive(self):
        return self.requests.pop(0)

    def keep_going(self, stop=False):
        return True


def test_an_unseeded_sampled_request_draws_alike_on_every_rank_and_still_learns(targets, drafters, tokenizer_dir):
    """Under `serve` with mlx.launch, rank 0 gives an unseeded sampled request a seed for MLX's
    generator on every rank, but not as the request's own: the request still shares the proposal
    scales the requests before it learnt (a seeded one would start afresh), and a rank that runs
    what rank 0 sent learns exactly what rank 0 did, so both drew the same tokens."""
    import numpy as np

    import dflash_mlx
    from dflash_mlx.distributed import follow
    from dflash_mlx.sampling import SamplingParams
    from dflash_mlx.serve.worker import Engine, Job

    params = SamplingParams(temp=1.0)
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    sent = _Sent()
    engine = Engine(pair, "tiny", block_size=4, channel=sent)
    # No EOS: a request whose first draw is EOS (one run in about a hundred, whatever the seeds rank 0
    # draws) would end before its first drafted cycle, with nothing to learn or to share.
    no_eos = {"logit_bias": {str(t): -1e9 for t in pair.tokenizer.eos_token_ids}}
    jobs = [engine.submit(Job(encode(tokenizer_dir, p), 24, params, [], processor_args=no_eos)) for p in PROMPTS]
    engine.close()
    finals = []
    for job in jobs:
        events = list(iter(job.events.get, None))
        assert events and all(isinstance(e, dflash_mlx.GenerationEvent) for e in events), events
        finals.append(events)
    requests, end = sent.requests[:-1], sent.requests[-1]
    assert end is None and len(requests) == 2
    assert all(r["params"]["seed"] is None and isinstance(r["seed"], int) for r in requests)
    assert requests[0]["seed"] != requests[1]["seed"]
    assert [sum(len(e.tokens) for e in events) for events in finals] == [24, 24]
    learnt = pair.proposal_scales(params)
    drafted = [[e for e in iter_events if e.finish_reason][-1].stats.draft_cycles for iter_events in finals]
    assert min(drafted) > 0 and learnt.cycles == sum(drafted) and learnt.weight.sum() > 0

    other = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    follow(other, _Heard(sent.requests), 4)
    theirs = other.proposal_scales(params)
    assert theirs.cycles == learnt.cycles
    assert np.array_equal(theirs.sums, learnt.sums) and np.array_equal(theirs.weight, learnt.weight)


if __name__ == "__main__":  # one rank of the shared launch (the `sharded` fixture)
    rank_main(sys.argv[1])
