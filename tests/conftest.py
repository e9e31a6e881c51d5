import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx.adaptive import Plan

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Drafter conversions cached by the runtime go to a throwaway directory.
os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix="dflash-mlx-cache-")

import tiny  # noqa: E402

FAMILIES = ["qwen3", "llama", "qwen3_5"]
# The lossless tests also cover these, built on demand by `zoo` (float32 unless a variant says).
LOSSLESS_FAMILIES = FAMILIES + ["qwen3_5_moe"]
DRAFTER_LAYOUT = {"qwen3": "old", "llama": "new", "qwen3_5": "new", "qwen3_5_moe": "new"}
# Variants written by mlx-lm's own converter from the float32 target.
VARIANTS = {
    "float32": None,
    "bfloat16": dict(dtype="bfloat16"),
    "4bit": dict(dtype="bfloat16", quantize=True, q_bits=4, q_group_size=64),
}


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tokenizer_dir(root):
    d = root / "tokenizer"
    tiny.train_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def vocab(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return len(tok), tok.convert_tokens_to_ids("<|mask|>")


@pytest.fixture(scope="session")
def targets(root, tokenizer_dir, vocab):
    return {f: tiny.build_target(root / f, f, tokenizer_dir, vocab[0]) for f in FAMILIES}


@pytest.fixture(scope="session")
def drafters(root, vocab):
    V, mask = vocab
    return {
        "old": tiny.build_drafter(root / "draft-old", tiny.drafter_config("old", V, 6, mask_token_id=mask)),
        "new": tiny.build_drafter(
            root / "draft-new", tiny.drafter_config("new", V, 6, mask_token_id=mask, sliding=True)
        ),
    }


@pytest.fixture(scope="session")
def pairs(targets, drafters):
    import dflash_mlx

    return {f: dflash_mlx.load(str(targets[f]), str(drafters[DRAFTER_LAYOUT[f]])) for f in FAMILIES}


@pytest.fixture(scope="session")
def baselines(targets):
    from mlx_lm import load

    return {f: load(str(targets[f]))[0] for f in FAMILIES}


class Zoo:
    """Targets of every lossless family and variant, each built, loaded as a
    DFlash pair and as a plain mlx-lm model once, on first use."""

    def __init__(self, root, tokenizer_dir, vocab, targets, drafters):
        self.root, self.tokenizer_dir, self.vocab = root, tokenizer_dir, vocab
        self.paths = {(f, "float32"): p for f, p in targets.items()}
        self.drafters = drafters
        self.pairs, self.baselines = {}, {}

    def path(self, family, variant="float32"):
        key = (family, variant)
        if key not in self.paths:
            if variant == "float32":
                self.paths[key] = tiny.build_target(self.root / family, family, self.tokenizer_dir, self.vocab[0])
            else:
                src = self.path(family)
                self.paths[key] = tiny.convert_target(src, self.root / f"{family}-{variant}", **VARIANTS[variant])
        return self.paths[key]

    def pair(self, family, variant="float32"):
        import dflash_mlx

        key = (family, variant)
        if key not in self.pairs:
            self.pairs[key] = dflash_mlx.load(str(self.path(family, variant)),
                                              str(self.drafters[DRAFTER_LAYOUT[family]]))
        return self.pairs[key]

    def baseline(self, family, variant="float32"):
        from mlx_lm import load

        key = (family, variant)
        if key not in self.baselines:
            self.baselines[key] = load(str(self.path(family, variant)))[0]
        return self.baselines[key]


@pytest.fixture(scope="session")
def zoo(root, tokenizer_dir, vocab, targets, drafters):
    return Zoo(root, tokenizer_dir, vocab, targets, drafters)


def plain_greedy(model, prompt, max_tokens, eos=(0,)):
    """Greedy tokens from mlx-lm's own generate_step, stopping after EOS."""
    from mlx_lm.generate import generate_step

    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


class ScriptedWidths:
    """A block-size policy (the object form `stream_generate(block_size=...)` takes):
    each request's run plays `widths` in turn (a width, or a `Plan` copying from
    the lookup offer), cycling, and records what the loop reports back."""

    def __init__(self, widths):
        self.widths = [w if isinstance(w, Plan) else Plan(w) for w in widths]

    def start(self, seeded=False):
        self.chosen, self.updates, self.offers, self.plans = [], [], [], []
        return self

    def choose(self, context, offer=()):
        plan = self.widths[len(self.chosen) % len(self.widths)]
        self.chosen.append((context, plan.width))
        self.offers.append(list(offer))
        return plan

    def update(self, plan, accepted, tokens=()):
        self.updates.append((plan.width, accepted))
        self.plans.append(plan)

    def lookup_pays(self, context):
        return any(p.copied for p in self.widths)
