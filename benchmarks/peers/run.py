"""Peers: this repository's DFlash runtime against other MLX DFlash runtimes on one pair.

    python benchmarks/peers/run.py [--pair demo|widened] [--max-tokens 64] [--repeats 2]
                                   [--prompts 5] [--out FILE] [--runtimes ours,zlab,...]

Runtimes (each answers through `benchmarks/peers/runners/<name>.py`, started once per run in
its own interpreter; see each runner's docstring for how it loads, what its settings are and
where its cycle counts come from):

- mlxlm:   plain mlx-lm decoding, the baseline (this repository's venv): greedy, and sampled at
           temperature 1 (the baseline of the "t1-*" settings, run when any of them is)
- ours:    this repository's `dflash_mlx`, block_size "auto" and 8 (this repository's venv)
- zlab:    z-lab `dflash==0.1.0` (`dflash.model_mlx`), its default (the drafter's block) and 8
- bstnxbt: bstnxbt `dflash-mlx==0.1.8`, its default (adaptive verify) and fixed block 8
- dspark:  `mlx-dspark==0.20.3` in DFlash mode, its default (measured cap) and 8 verified
- before:  with `--before CHECKOUT`, another checkout of this repository (a git worktree of an
           earlier commit) through its own `ours` runner: a before/after run of a change

Each peer is installed once into its own virtual environment under
~/.cache/dflash-mlx/peers/<name>/venv (bstnxbt's import name is `dflash_mlx`, like ours),
with the same pinned mlx/mlx-lm as this repository's environment. The pair (float32 copies,
and the widened target) is built by `widen.py` under ~/.cache/dflash-mlx/peers/pairs/.

Every runtime decodes the same prompt ids (this repository's `code` suite, built with
`dflash_mlx.prompt.build_prompt`), greedy, `--max-tokens` new tokens. Each repeat runs
every prompt through every runtime and setting in a fresh random order. Reported: median
decode tok/s over repeats per prompt, then over prompts; the ratio to mlx-lm as a ratio of
those medians, as the median of per-prompt ratios and as a ratio of geometric means over
prompts (the mean of per-prompt ratios); our default against each peer's default, paired
by prompt (median and geometric mean of the per-prompt ratios); tokens per cycle pooled
over all cycles (committed tokens / target passes after the prefill); and whether every
greedy output equals mlx-lm's.
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = Path(os.environ.get("DFLASH_PEERS_CACHE", Path.home() / ".cache" / "dflash-mlx" / "peers"))
SCHEMA_VERSION = 1

# Pinned installs: the peer itself, and the mlx / mlx-lm / transformers this repository's
# environment runs (every peer accepts them), so MLX's version is not a variable.
MLX, MLX_LM, TRANSFORMERS = "0.32.4", "0.32.2", "5.23.0"
COMMON_PINS = [f"mlx[cpu]=={MLX}", f"mlx-lm=={MLX_LM}", f"transformers=={TRANSFORMERS}"]
PEERS = {
    # model_mlx imports huggingface_hub at the top, which the package declares only for macOS.
    "zlab": {"packages": ["dflash==0.1.0", "huggingface-hub==1.33.0"], "label": "z-lab dflash 0.1.0"},
    "bstnxbt": {"packages": ["dflash-mlx==0.1.8"], "label": "bstnxbt dflash-mlx 0.1.8"},
    "dspark": {"packages": ["mlx-dspark==0.20.3"], "label": "mlx-dspark 0.20.3"},
}
RUNTIMES = ["mlxlm", "ours", "zlab", "bstnxbt", "dspark"]
LABELS = {"mlxlm": "mlx-lm (baseline)", "ours": "dflash-mlx (ours)", **{k: v["label"] for k, v in PEERS.items()}}
EVENT_GAP = 0.2  # seconds between runs: lets BLAS threads of the previous process go idle


class PeersError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- environments


def venv_python(name: str) -> Path:
    return CACHE / name / "venv" / "bin" / "python"


def ensure_venv(name: str) -> Path:
    """The peer's venv, created and installed once (again only when its pins change)."""
    spec = {"packages": PEERS[name]["packages"] + COMMON_PINS, "python": platform.python_version()}
    root = CACHE / name
    marker = root / "install.json"
    py = venv_python(name)
    if marker.is_file() and py.exists():
        try:
            if json.loads(marker.read_text()).get("spec") == spec:
                return py
        except json.JSONDecodeError:
            pass
    log(f"installing {name} into {root / 'venv'} ({', '.join(spec['packages'])}); once, takes minutes")
    root.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    r = subprocess.run([base, "-m", "venv", "--clear", str(root / "venv")], capture_output=True, text=True)
    if r.returncode:
        raise PeersError(f"cannot create the {name} venv: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *spec["packages"]],
                       capture_output=True, text=True)
    (root / "install.log").write_text(r.stdout + r.stderr)
    if r.returncode:
        last = [l for l in (r.stderr or r.stdout).splitlines() if l.strip() and not l.startswith("WARNING")]
        raise PeersError(f"pip could not install {name} (see {root / 'install.log'}): {(last or ['?'])[-1]}")
    marker.write_text(json.dumps({"spec": spec, "installed": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    return py


def freeze(py: Path) -> list:
    r = subprocess.run([str(py), "-m", "pip", "freeze", "--disable-pip-version-check"], capture_output=True, text=True)
    return sorted(l for l in r.stdout.splitlines() if l and not l.startswith("#") and " @ " not in l)


# ---------------------------------------------------------------- runners


class Runner:
    """One runtime's runner process: started once, asked one JSON line at a time."""

    def __init__(self, name: str, python: Path, pair_dir: Path, logdir: Path, blas: str, repo: Path = REPO):
        """`repo`: the checkout whose `dflash_mlx` and runners run ("before": another one)."""
        self.name = name
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if name in PEERS:
            env.pop("PYTHONPATH", None)  # a peer must never see this repository's dflash_mlx
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(repo)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        runners = repo / "benchmarks" / "peers" / "runners"
        script = runners / ("ours.py" if name == "before" else f"{name}.py")
        self.log_path = logdir / f"{name}.log"
        self.log_file = open(self.log_path, "w")
        cmd = [str(python), str(script), "--target", str(pair_dir / "target"),
               "--drafter", str(pair_dir / "drafter"), "--drafter-zlab", str(pair_dir / "drafter-zlab"),
               "--cache", str(CACHE / name / f"calibration-{pair_dir.name}-{blas.split()[0]}")]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file,
                                     text=True, bufsize=1, cwd=str(runners), env=env)
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise PeersError(f"{name} could not load the pair: {hello.get('error', 'no answer')} (log: {self.log_path})")
        self.info = hello["info"]
        self.settings = hello["settings"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text().strip().splitlines()[-1:] if self.log_path.exists() else []
            return {"error": f"runner exited ({tail[0] if tail else 'no output'})"}
        return json.loads(line)

    def ask(self, prompt_ids, max_tokens: int, setting: str) -> dict:
        self.proc.stdin.write(json.dumps({"prompt_ids": prompt_ids, "max_tokens": max_tokens, "setting": setting}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
        self.log_file.close()


# ---------------------------------------------------------------- statistics


def normalise(tokens, eos, max_tokens):
    out = []
    for t in tokens[:max_tokens]:
        if t in eos:
            break
        out.append(t)
    return out


def paired(tps, base_tps) -> list:
    """Per-prompt ratios of two runtimes' median tok/s, over the prompts both have a figure for."""
    return [a / b for a, b in zip(tps, base_tps) if a and b]


def summarise(runs: dict, keys, n_prompts: int) -> dict:
    """runs[(runtime, setting)][prompt] = list of answers (one per repeat)."""
    from dflash_mlx.bench import geomean, median
    greedy_base = runs[("mlxlm", "default")]
    out = {}
    for key in keys:
        per = runs[key]
        sampled = key[1].startswith("t1-")  # temperature 1: ids are a sample, not comparable with greedy ones
        # Sampled settings are compared with mlx-lm sampling at the same temperature, where it ran.
        base = runs.get(("mlxlm", "t1-default"), greedy_base) if sampled else greedy_base
        base_tps = [median([a["tps"] for a in base[p]]) for p in range(n_prompts)]
        if any(a.get("error") for p in range(n_prompts) for a in per[p]):
            errs = sorted({a["error"] for p in range(n_prompts) for a in per[p] if a.get("error")})
            out[f"{key[0]}/{key[1]}"] = {"runtime": key[0], "setting": key[1], "error": errs[0]}
            continue
        tps = [median([a["tps"] for a in per[p]]) for p in range(n_prompts)]
        cycles = sum(a["cycles"] for p in range(n_prompts) for a in per[p])
        ctoks = sum(a["cycle_tokens"] for p in range(n_prompts) for a in per[p])
        ident = [sampled or all(a["ids"] == base[p][0]["ids"] for a in per[p]) for p in range(n_prompts)]
        med, bmed = median(tps), median(base_tps)
        g, bg = geomean(tps), geomean(base_tps)
        out[f"{key[0]}/{key[1]}"] = {
            "runtime": key[0], "setting": key[1], "tps_median": med, "tps_geomean": g,
            "ratio_medians": med / bmed if med and bmed else None,
            "ratio_geomeans": g / bg if g and bg else None,
            "ratio_median_per_prompt": median(paired(tps, base_tps)),
            "tokens_per_cycle": ctoks / cycles if cycles else None, "cycles": cycles, "cycle_tokens": ctoks,
            "identical_prompts": None if sampled else sum(ident), "prompts": n_prompts,
            "mismatched_prompts": [p for p, ok in enumerate(ident) if not ok],
            "tps_per_prompt": tps,
        }
    return out


def head_to_head(summary: dict) -> dict:
    """Our default against each peer's default, paired by prompt: the per-prompt ratios of
    median tok/s, their median and geometric mean (the fastest peer: highest geomean vs mlx-lm)."""
    from dflash_mlx.bench import geomean, median
    ours = summary.get("ours/default")
    peers = {k: s for k, s in summary.items() if s["runtime"] in PEERS and s["setting"] == "default" and "error" not in s}
    if not ours or "error" in ours or not peers:
        return {}
    out = {}
    for key, s in peers.items():
        ratios = paired(ours["tps_per_prompt"], s["tps_per_prompt"])
        out[key] = {"median": median(ratios), "geomean": geomean(ratios), "per_prompt": ratios}
    fastest = max(peers, key=lambda k: peers[k]["ratio_geomeans"] or 0.0)
    return {"fastest_peer": fastest, "against": out}


def _x(ratio) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def table(result: dict) -> str:
    rows = []
    for key, s in result["summary"].items():
        label = LABELS.get(s["runtime"], s["runtime"])
        if "error" in s:
            rows.append([label, s["setting"], "error", "", "", "", "", s["error"][:60]])
            continue
        rows.append([label, s["setting"], f"{s['tps_median']:.1f}", f"{s['ratio_medians']:.2f}x",
                     _x(s["ratio_median_per_prompt"]), f"{s['ratio_geomeans']:.2f}x", f"{s['tokens_per_cycle']:.2f}",
                     "sampled" if s["identical_prompts"] is None else f"{s['identical_prompts']}/{s['prompts']}"])
    head = ["runtime", "setting", "tok/s (median)", "vs mlx-lm (medians)", "vs mlx-lm (median per prompt)",
            "vs mlx-lm (geomeans)", "tokens/cycle", "greedy ids = mlx-lm"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    h2h = result.get("head_to_head") or {}
    for key, r in h2h.get("against", {}).items():
        fastest = " (the fastest peer default)" if key == h2h["fastest_peer"] else ""
        lines.append(f"\nours/default vs {key}{fastest}: {_x(r['median'])} median per prompt, "
                     f"{_x(r['geomean'])} geomean (per prompt {', '.join(f'{x:.2f}' for x in r['per_prompt'])})")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def load_prompt_ids(n: int, target_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx.bench import load_prompts
    from dflash_mlx.prompt import build_prompt

    tok = load_tokenizer(target_dir)
    texts = load_prompts("code")["code"][:n]
    return texts, [build_prompt(tok, t) for t in texts], sorted(set(tok.eos_token_ids))


def git_state(repo: Path = REPO):
    def git(*a):
        r = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    dirty = git("status", "--porcelain", "--", "dflash_mlx")
    return {"commit": git("rev-parse", "HEAD"), "dflash_mlx_dirty": bool(dirty)}


def main(argv=None):
    ap = argparse.ArgumentParser(description="DFlash runtimes on MLX against each other and mlx-lm.")
    ap.add_argument("--pair", choices=["demo", "widened"], default="demo")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=5, help="how many prompts of the code suite (1-12)")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"comma-separated subset of {','.join(RUNTIMES)}")
    ap.add_argument("--settings", default=None,
                    help="comma-separated settings to run (e.g. default,block1,block8; mlx-lm's always runs): "
                         "default: every setting of every runtime")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run order")
    ap.add_argument("--out", default=None, help="JSON result file (default: print only)")
    ap.add_argument("--before", default=None, metavar="CHECKOUT",
                    help="another checkout of this repository (say a git worktree of an earlier commit): its "
                         "runtime runs beside ours, through its own runner, as 'before'")
    ap.add_argument("--setup-only", action="store_true", help="install the venvs and build the pair, then stop")
    args = ap.parse_args(argv)
    try:
        run(args)
    except PeersError as e:
        sys.exit(f"error: {e}")


def run(args):
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE))
    import mlx.core as mx

    import widen
    from dflash_mlx.machine import blas_name
    from dflash_mlx.bench import machine_info

    names = [n.strip() for n in args.runtimes.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNTIMES]
    if bad:
        raise PeersError(f"unknown runtime(s) {bad}; choose from {', '.join(RUNTIMES)}")
    if "mlxlm" not in names:
        names.insert(0, "mlxlm")  # the baseline every ratio needs
    before = Path(args.before).resolve() if args.before else None
    if before is not None:
        if not (before / "benchmarks" / "peers" / "runners" / "ours.py").is_file():
            raise PeersError(f"--before {args.before} is not a checkout of this repository")
        names.append("before")
        LABELS["before"] = f"dflash-mlx at {git_state(before)['commit'][:10]}"
    if not 1 <= args.prompts <= 12 or args.repeats < 1 or args.max_tokens < 2:
        raise PeersError("--prompts must be 1-12, --repeats >= 1 and --max-tokens >= 2")
    if mx.__version__ != MLX:
        log(f"warning: this environment runs mlx {mx.__version__}, the peers' venvs pin {MLX}")
    blas = blas_name()
    if blas != "openblas":
        log(f"note: BLAS is {blas}; the committed results use OpenBLAS (LD_PRELOAD, see benchmarks/README.md)")

    pythons = {"mlxlm": Path(sys.executable), "ours": Path(sys.executable), "before": Path(sys.executable)}
    problems = {}
    for n in names:
        if n in PEERS:
            try:
                pythons[n] = ensure_venv(n)
            except PeersError as e:
                problems[n] = str(e)
                log(f"skipping {n}: {e}")
    try:
        pair_dir = widen.prepare(args.pair, log=log)
    except widen.WidenError as e:
        raise PeersError(str(e))
    build = json.loads((pair_dir / "build.json").read_text())
    texts, prompts, eos = load_prompt_ids(args.prompts, pair_dir / "target")

    check = None
    if args.pair != "demo":  # the widened target must decode exactly as the demo target does
        check_file = pair_dir / f"check-{blas.split()[0]}-{args.prompts}-{args.max_tokens}.json"
        if check_file.is_file():
            check = json.loads(check_file.read_text())
        else:
            log(f"checking that the {args.pair} target's greedy ids equal the demo target's")
            try:
                check = widen.check(pair_dir, prompts, args.max_tokens)
            except widen.WidenError as e:
                raise PeersError(str(e))
            check_file.write_text(json.dumps(check))
    if args.setup_only:
        log(f"set up: {', '.join(n for n in names if n not in problems)}; pair {pair_dir}")
        return

    logdir = CACHE / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    runners = {}
    # Started one after another: loading (and any calibration a runtime does) never overlaps.
    for n in names:
        if n in problems:
            continue
        log(f"starting {n}")
        try:
            runners[n] = Runner(n, pythons[n], pair_dir, logdir, blas, before if n == "before" else REPO)
        except PeersError as e:
            problems[n] = str(e)
            log(f"skipping {n}: {e}")
    if "mlxlm" not in runners:
        raise PeersError(f"the mlx-lm baseline could not start: {problems.get('mlxlm')}")
    try:
        wanted = set(args.settings.split(",")) if args.settings else None
        baselines = {"default"} | ({"t1-default"} if not wanted or any(w.startswith("t1-") for w in wanted) else set())
        keys = [(n, s) for n, r in runners.items() for s in r.settings
                if (n == "mlxlm" and s in baselines) or not wanted or s in wanted]
        for n in [n for n in runners if not any(k[0] == n for k in keys)]:
            runners.pop(n).close()
        missing = wanted - {s for _, s in keys} if wanted else set()
        if missing:
            raise PeersError(f"no runtime has setting(s) {sorted(missing)}")
        for n, r in runners.items():
            r.settings = [s for s in r.settings if (n, s) in keys]
        # Warm-up: every runtime and setting once (kernels, caches, cost curves, calibrations).
        for n, s in keys:
            log(f"warm-up {n}/{s}")
            a = runners[n].ask(prompts[0], min(16, args.max_tokens), s)
            if a.get("error"):
                log(f"  {n}/{s} failed: {a['error']}")
        runs = {k: [[] for _ in prompts] for k in keys}
        rng = random.Random(args.seed)
        total, done, t0 = len(keys) * len(prompts) * args.repeats, 0, time.time()
        for r in range(args.repeats):
            for p, ids in enumerate(prompts):
                order = list(keys)
                rng.shuffle(order)
                for n, s in order:
                    time.sleep(EVENT_GAP)
                    a = runners[n].ask(ids, args.max_tokens, s)
                    if not a.get("error"):
                        a["ids"] = normalise(a.pop("tokens"), eos, args.max_tokens)
                    runs[(n, s)][p].append(a)
                    done += 1
                    what = f"{a['tps']:.1f} tok/s" if not a.get("error") and a.get("tps") else a.get("error", "?")
                    eta = (time.time() - t0) / done * (total - done)
                    log(f"[{done}/{total}] repeat {r + 1} prompt {p + 1}: {n}/{s} {what} (about {eta:.0f} s left)")
    finally:
        for rn in runners.values():
            rn.close()

    runtimes = {}
    for n in names:
        entry = {"label": LABELS[n]}
        if n in runners:
            entry["info"] = runners[n].info
            entry["acceptance_source"] = next((a.get("acceptance_source") for p in runs[(n, runners[n].settings[0])]
                                               for a in p if a.get("acceptance_source")), None)
            entry["timing"] = next((a.get("timing") for p in runs[(n, runners[n].settings[0])] for a in p
                                    if a.get("timing")), None)
        if n in PEERS:
            entry["pinned"] = PEERS[n]["packages"] + COMMON_PINS
            if n not in problems or venv_python(n).exists():
                entry["pip_freeze"] = freeze(venv_python(n))
        if n in problems:
            entry["error"] = problems[n]
        runtimes[n] = entry
    machine = machine_info()
    result = {
        "schema_version": SCHEMA_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine,
        "blas": {n: r.info.get("blas") for n, r in runners.items()},
        "dtype": "float32",
        "pair": {"name": args.pair, **build, "check_against_demo": check},
        "repository": git_state(),
        **({"before": git_state(before)} if before is not None else {}),
        "settings": {"max_tokens": args.max_tokens, "repeats": args.repeats, "suite": "code",
                     "prompts": len(prompts), "greedy": True, "order": "every repeat, every prompt: all runtimes "
                     "and settings in a fresh random order (seeded)", "seed": args.seed,
                     "decode_timing": "from the first token handed over to the last (runners/_common.py)"},
        "runtimes": runtimes,
        "summary": (summary := summarise(runs, keys, len(prompts))),
        "head_to_head": head_to_head(summary),
        "prompts": [{"text": t, "prompt_tokens": len(i)} for t, i in zip(texts, prompts)],
        "runs": {f"{n}/{s}": [[{k: v for k, v in a.items() if k not in ("acceptance_source", "timing")} for a in p]
                              for p in runs[(n, s)]] for n, s in keys},
    }
    print(f"\n{args.pair} pair: {machine['chip']}, {machine['cores']} cores, MLX {machine['mlx']} "
          f"{machine['backend']}, BLAS {blas}, float32, {len(prompts)} code prompts x {args.repeats} repeats, "
          f"{args.max_tokens} tokens\n")
    print(table(result))
    for n, e in runtimes.items():
        if e.get("error"):
            print(f"- {LABELS[n]}: not run: {e['error']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
