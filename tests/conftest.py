import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Drafter conversions cached by the runtime go to a throwaway directory.
os.environ["DFLASH_MLX_CACHE"] = tempfile.mkdtemp(prefix="dflash-mlx-cache-")

import tiny  # noqa: E402

FAMILIES = ["qwen3", "llama", "qwen3_5"]


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

    layout = {"qwen3": "old", "llama": "new", "qwen3_5": "new"}
    return {f: dflash_mlx.load(str(targets[f]), str(drafters[layout[f]])) for f in FAMILIES}


@pytest.fixture(scope="session")
def baselines(targets):
    from mlx_lm import load

    return {f: load(str(targets[f]))[0] for f in FAMILIES}


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
