import contextlib
import os
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx.policy.plan import Plan
from dflash_mlx.draft.source import DraftSource

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


class Counted:
    """A target that counts its passes."""

    def __init__(self, target):
        self._target, self.passes = target, 0

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self._target(*args, **kwargs)


def decode_turn(pair, prompts, max_tokens, prompt_cache=None, eos=None, width=None):
    """Each prompt's tokens, decoded together by one `Decoder` of width 4 until all have ended (each
    step at `width`, default the batch policy's); with `prompt_cache`, each starts from it and what
    it computed is kept there as it ends. `eos`: the ids that end a sequence (default the tokenizer's)."""
    from dflash_mlx.decode.decoder import Decoder

    dec = Decoder(pair, 4, prompt_cache=prompt_cache)
    if eos is not None:
        dec.eos = set(eos)
    firsts = dec.add_many(prompts, [max_tokens] * len(prompts))
    out = {f.uid: list(f.tokens) for f in firsts}
    while len(dec):
        for c in dec.step(width):
            out[c.uid] += c.tokens
        dec.keep()
    return [out[f.uid] for f in firsts]


def plain_greedy(model, prompt, max_tokens, eos=(0,), processors=None):
    """Greedy tokens from mlx-lm's own generate_step (with its `logits_processors`), stopping after EOS."""
    from mlx_lm.generate import generate_step

    out = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors)
    for (tok, _), _ in zip(steps, range(max_tokens)):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


_GREEDY = {}


def greedy_ref(model, prompt, max_tokens):
    """`plain_greedy`, each (model, prompt) decoded once at the longest length asked
    for: a shorter answer is its prefix. For the shared fixtures' models, which no
    test changes (the cache holds the model, so its id is not reused)."""
    key = (id(model), tuple(prompt))
    held = _GREEDY.get(key)
    if held is None or held[0] is not model or held[1] < max_tokens:
        held = _GREEDY[key] = (model, max_tokens, plain_greedy(model, prompt, max_tokens))
    return held[2][:max_tokens]


class OracleSource(DraftSource):
    """Drafts the target's own greedy continuation, corrupted at a chosen index.

    `corrupt(cycle, width)` returns the draft index to corrupt, or None for a
    perfect draft. It also checks that the loop hands over exactly the taps of
    the committed tokens, each once.
    """

    def __init__(self, sequence, vocab_size, feature_dim, corrupt):
        self.seq = sequence
        self.V = vocab_size
        self.feature_dim = feature_dim
        self.corrupt = corrupt
        self.block_size = 16
        self.expected = []

    def new_state(self):
        return {"committed": 0, "cycle": 0}

    def add_context(self, state, hidden):
        assert hidden.shape[-1] == self.feature_dim
        state["committed"] += hidden.shape[1]

    def propose(self, state, last, hidden, width):
        if hidden is not None:
            self.add_context(state, hidden)
        P = state["committed"]
        assert last.item() == self.seq[P]
        draft = list(self.seq[P + 1 : P + width])
        draft += [1] * (width - 1 - len(draft))
        k = self.corrupt(state["cycle"], width)
        if k is not None:
            draft[k] = (draft[k] + 1) % self.V
        self.expected.append(width - 1 if k is None else k)
        state["cycle"] += 1
        return mx.eye(self.V)[mx.array(draft)] * 30.0


ROLLBACK_SCHEDULES = {
    "cycle through positions": lambda c, w: c % w if c % w < w - 1 else None,
    "always full": lambda c, w: None,
    "always first": lambda c, w: 0,
    "always last": lambda c, w: w - 2,
}


def check_rollback_at_every_position(pair, base, prompt, block_size, n=40):
    """Drafts from `OracleSource` (`base`'s plain greedy continuation) corrupted by
    each schedule, so every acceptance length 0 .. block_size - 1 is exercised and
    the target's caches are rolled back at every block position: output equals
    plain greedy decoding, each cycle accepts exactly up to the corrupted draft.
    `n` tokens per schedule; cycling through the positions runs until one whole
    cycle of them (1 + 2 + ... + block_size tokens) fits."""
    import dflash_mlx

    cycle_n = max(n, block_size * (block_size + 1) // 2 + 4)
    full = greedy_ref(base, prompt, cycle_n)
    feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
    for name, corrupt in ROLLBACK_SCHEDULES.items():
        ref = full[: cycle_n if name == "cycle through positions" else n]
        source = OracleSource(prompt + ref, pair.target.vocab_size, feature_dim, corrupt)
        out, events = [], []
        for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=len(ref), block_size=block_size,
                                             draft_source=source):
            out += ev.tokens
            events.append(ev)
        assert out == ref, name
        # Cycles of width 1 (the budget's last token) draft nothing.
        accepted = [e.accepted for e in events[1:]]
        assert accepted[: len(source.expected)] == source.expected, name
        assert len(source.expected) >= len(accepted) - 1, name
        if name == "cycle through positions":
            assert set(source.expected) == set(range(block_size)), name
        if name == "always full":
            assert events[-1].stats.mean_acceptance > block_size * 0.7, name


SMALL_V = 5  # the small pair's vocabulary


def build_small_pair(drafter_cls, source_cls, drafter_config, init=None):
    """A tiny qwen3 target over a 5-token vocabulary (seed 11, its embedding scaled
    down so its distributions are not peaked) tapped at layers 0 and 1, and a
    one-layer drafter of `drafter_cls` built right after it from its dimensions and
    `drafter_config`, then passed to `init`; (the DFlash pair, the plain target)."""
    from mlx_lm.models import qwen3

    from dflash_mlx.target.adapter import TargetAdapter
    from dflash_mlx.config import DrafterConfig
    from dflash_mlx.pair import DFlashPair

    mx.random.seed(11)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=32, num_hidden_layers=3, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                           vocab_size=SMALL_V, max_position_embeddings=512, tie_word_embeddings=True,
                           rope_theta=10000.0)
    target = qwen3.Model(args)
    target.update({"model": {"embed_tokens": {"weight": mx.random.normal((SMALL_V, 32)) * 0.2}}})
    adapter = TargetAdapter(target, [0, 1])
    drafter = drafter_cls(DrafterConfig.from_dict({
        "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "vocab_size": SMALL_V, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, **drafter_config}))
    if init:
        init(drafter)
    return DFlashPair(adapter, drafter, None, source_cls(drafter, adapter), None, None), target


def joined_mid_stream(streams, prompt, after: int, newcomer, max_tokens: int, newcomer_tokens: int = 20, asks=None):
    """A request decoding alone in `streams` (a `Streams`: its own policy's cycles) is joined
    after its `after`-th event by `newcomer`: (its tokens, the newcomer's)."""
    from dflash_mlx.decode.streams import Joining

    kwargs = {} if asks is None else {"asks": asks}
    uid, event = streams.add(Joining(list(prompt), max_tokens, **kwargs))
    got, seen = list(event.tokens), 1
    while seen < after and event.finish_reason is None:
        (_, event), = streams.step()
        got += event.tokens
        seen += 1
    theirs = []
    if newcomer is not None:
        (_, first), = streams.add_many([Joining(list(newcomer), newcomer_tokens)])
        theirs = list(first.tokens)
    while len(streams):
        for u, event in streams.step():
            (got if u == uid else theirs).extend(event.tokens)
    return got, theirs


class ScriptedWidths:
    """A block-size policy (the object form `stream_generate(block_size=...)` takes):
    each request's run plays `widths` in turn (a width, or a `Plan` copying from
    the lookup offer), cycling, and records what the loop reports back."""

    learns_branches = False
    default_branches = 0

    def __init__(self, widths):
        self.widths = [w if isinstance(w, Plan) else Plan(w) for w in widths]

    def start(self, branches=0):
        self.chosen, self.updates, self.offers, self.plans, self.unseen = [], [], [], [], []
        return self

    def choose(self, context, offer=(), unseen=0, left=0):
        plan = self.widths[len(self.chosen) % len(self.widths)]
        self.chosen.append((context, plan.width))
        self.offers.append(list(offer))
        self.unseen.append(unseen)
        return plan

    def update(self, plan, outcome):
        self.updates.append((plan.width, outcome.accepted))
        self.plans.append(plan)

    def lookup_pays(self, context):
        return any(p.copied for p in self.widths)

    def drafter_pays(self, first, last):
        return True


@contextlib.contextmanager
def serving(pair, name: str, **kw):
    """A server on `pair` (`make_server`'s options `kw`) on a free loopback port: (server, its base URL)."""
    from dflash_mlx.serve.http_server import make_server

    server = make_server(pair, name, "127.0.0.1", 0, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.engine.close()


@pytest.fixture(scope="session")
def more(root, tokenizer_dir, vocab, drafters):
    """(pair, plain mlx-lm model) of a family beyond the session's, built on first use."""
    import tiny
    from mlx_lm import load

    import dflash_mlx

    built = {}

    def get(family):
        if family not in built:
            path = tiny.build_target(root / f"more-{family}", family, tokenizer_dir, vocab[0])
            built[family] = dflash_mlx.load(str(path), str(drafters["new"])), load(str(path))[0]
        return built[family]

    return get
