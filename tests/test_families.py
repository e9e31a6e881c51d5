"""Target families beyond the first four: Qwen3-MoE, Qwen3-Next (Gated DeltaNet
in the in_proj_qkvz layout), Gemma 4 (sliding windows, KV sharing, per-layer
inputs, logit soft-capping; and its MoE / K = V variant) and gpt-oss (sliding
windows with attention sinks, MoE). Tiny random models built from mlx-lm's own
classes; sliding windows of 8 rows, so every request wraps them. Greedy output
must equal plain mlx-lm decoding token for token."""

import json

import mlx.core as mx
import pytest
from conftest import (ScriptedWidths, check_rollback_at_every_position, decode_turn, greedy_ref, joined_mid_stream,
                      plain_greedy)
from test_lossless import PROMPTS

import dflash_mlx
import tiny
from dflash_mlx.target.adapter import TargetAdapter, load_target
from dflash_mlx.errors import DFlashError
from dflash_mlx.prompt import build_prompt
from dflash_mlx.target.caches import CI_TESTED, WindowCache, family_verdict, supported_families

NEW = ["qwen3_moe", "qwen3_next", "gemma4_text", "gemma4_text_moe", "gpt_oss"]
SLIDING = {"gemma4", "gemma4_text", "gemma4_text_moe", "gpt_oss"}
# Real Gemma 4 checkpoints: model_type "gemma4", the multimodal wrapper around gemma4_text.
WRAPPED = ["gemma4"]

# Gemma's turn format; gpt-oss's harmony format (system preamble, developer
# instructions, `<|start|>role<|message|>...<|end|>`), as their tokenizers' templates write them.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first %}{{ prefix }}{% endif %}{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n# Valid channels: analysis, commentary, final.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "<|start|>developer<|message|># Instructions\n\n{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TEMPLATES = {"gemma4_text": GEMMA_TEMPLATE, "gpt_oss": HARMONY_TEMPLATE}


class Families:
    """Each new family's target (built once), loaded as a DFlash pair and as plain mlx-lm."""

    def __init__(self, root, tokenizer_dir, vocab, drafter):
        self.root, self.tokenizer_dir, self.vocab, self.drafter = root, tokenizer_dir, vocab, drafter
        self.paths, self.pairs, self.baselines = {}, {}, {}

    def path(self, family):
        if family not in self.paths:
            p = tiny.build_target(self.root / f"family-{family}", family, self.tokenizer_dir, self.vocab[0])
            if family in TEMPLATES:
                cfg = json.loads((p / "tokenizer_config.json").read_text())
                cfg["chat_template"] = TEMPLATES[family]
                (p / "tokenizer_config.json").write_text(json.dumps(cfg))
            self.paths[family] = p
        return self.paths[family]

    def pair(self, family):
        if family not in self.pairs:
            self.pairs[family] = dflash_mlx.load(str(self.path(family)), str(self.drafter))
        return self.pairs[family]

    def baseline(self, family):
        from mlx_lm import load

        if family not in self.baselines:
            self.baselines[family] = load(str(self.path(family)))[0]
        return self.baselines[family]


@pytest.fixture(scope="module")
def fams(root, tokenizer_dir, vocab):
    V, mask = vocab
    # Taps layer 1 and the last layer (its entry is the final norm's output, as HF reports it).
    drafter = tiny.build_drafter(root / "draft-taps-1-5",
                                 tiny.drafter_config("new", V, 6, mask_token_id=mask, layer_ids=(1, 5), sliding=True))
    return Families(root, tokenizer_dir, vocab, drafter)


def tokens_of(pair, prompt, max_tokens, **kw):
    out, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, **kw):
        out += ev.tokens
        events.append(ev)
    return out, events


def test_ci_tested_families_are_admitted_and_exercised():
    """The families the rule admits include every tested one; doctor's tested list is what CI runs."""
    families = supported_families()
    assert set(CI_TESTED) <= set(families)
    assert set(CI_TESTED) - {"qwen3", "llama", "qwen3_5", "qwen3_5_moe"} == set(NEW + WRAPPED) - {"gemma4_text_moe"}
    assert "window cache" in families["gemma4_text"] and "window cache" in families["gpt_oss"]
    assert "update tape" in families["qwen3_next"] and families["qwen3_moe"] == "KV cache (offset)"
    # Real Gemma 4 checkpoints say model_type "gemma4" (the multimodal wrapper).
    assert family_verdict("gemma4")[0]
    ok, why = family_verdict("mamba")
    assert not ok and "ArraysCache" in why
    ok, why = family_verdict("llama4")
    assert not ok and "ChunkedKVCache" in why
    assert not family_verdict("no_such_family")[0]


# Every width 1..16 in one request per family (a policy switching widths from cycle to
# cycle, wide to narrow and back), and whole requests at a fixed size: 16 in every
# family and 1..15 spread over them (each sliding family gets sizes below, at and above
# its 8-row window).
WIDTH_CYCLE = [16, 1, 8, 3, 12, 5, 14, 2, 10, 7, 15, 4, 9, 13, 6, 11]
FIXED = {"qwen3_moe": (1, 6, 11), "qwen3_next": (2, 7, 12), "gemma4_text": (3, 8, 13),
         "gemma4_text_moe": (4, 9, 14), "gpt_oss": (5, 10, 15)}


def test_fixed_sizes_cover_every_block_size():
    assert sorted(b for sizes in FIXED.values() for b in sizes) == list(range(1, 16)) and set(FIXED) == set(NEW)


@pytest.mark.parametrize("family", NEW)
def test_lossless_at_every_block_size(fams, family):
    pair, base = fams.pair(family), fams.baseline(family)
    kinds = set(pair.target._kinds.values())
    assert ("window" in kinds) == (family in SLIDING)
    assert ("tape" in kinds) == (family == "qwen3_next")
    assert pair.target.batchable
    # 6 and 44 tokens: the windows (8 rows, 24 with the slack) wrap while decoding
    # the first, and while prefilling the second.
    # "A": a one-token prompt, so the first blocks are cropped back below the window.
    for text, sizes in ((PROMPTS[0], FIXED[family] + (16, "cycle")), (PROMPTS[2], (1, 16, "cycle")),
                        (PROMPTS[4], (4, 16))):
        prompt = pair.tokenizer.encode(text)
        ref = greedy_ref(base, prompt, 40)
        assert len(ref) == 40 and len(set(ref)) > 10  # the tiny model neither stops nor repeats itself
        for block_size in sizes:
            policy = ScriptedWidths(WIDTH_CYCLE) if block_size == "cycle" else None
            out, events = tokens_of(pair, prompt, 40, block_size=policy or block_size)
            assert out == ref, (family, block_size, text)
            if policy:
                assert [a for _, a in policy.updates] == [e.accepted for e in events[1:]]
                assert all(a < w for w, a in policy.updates)
                assert {w for w, _ in policy.updates} == set(WIDTH_CYCLE), (family, text)  # every width ran
            else:
                assert max(e.accepted + 1 for e in events[1:]) <= block_size


ROLLBACK_CASES = [(f, b) for f in NEW for b in (4, 8, 16)] + [(f, 8) for f in WRAPPED]


@pytest.mark.parametrize("family, block_size", ROLLBACK_CASES, ids=[f"{f}-{b}" for f, b in ROLLBACK_CASES])
def test_rollback_at_every_block_position(fams, family, block_size):
    """A drafter that is right up to a chosen position: every acceptance length
    is exercised, before and after the sliding windows wrap (40 tokens after a
    6-token prompt; 8-row windows, 24 with the slack)."""
    pair, base = fams.pair(family), fams.baseline(family)
    check_rollback_at_every_position(pair, base, pair.tokenizer.encode(PROMPTS[0]), block_size, n=40)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gemma4_text", "gpt_oss"])
def test_batched_sequences_equal_each_alone(fams, family):
    """Every family batches (a routed MoE; qwen3_next's Gated DeltaNet layout, rolled back per
    sequence; sliding windows of 8, which the 6-token prompts and 30 tokens pass): several
    prompts decoded together equal each decoded alone."""
    from dflash_mlx.decode.decoder import Decoder

    pair, base = fams.pair(family), fams.baseline(family)
    prompts = [pair.tokenizer.encode(t) for t in PROMPTS[:3]]
    dec = Decoder(pair, 5)
    out = {}
    for first in dec.add_many(prompts, [30] * len(prompts)):
        out[first.uid] = list(first.tokens)
    widths = [5, 1, 3, 5, 2]
    while len(dec):
        for c in dec.step(widths[len(out[0]) % len(widths)]):
            out[c.uid] += c.tokens
    assert [out[uid] for uid in range(len(prompts))] == [greedy_ref(base, p, 30) for p in prompts]


def test_sliding_windows_batch_with_the_prompt_cache_and_joins_mid_stream(fams):
    """A sliding-window target's sequences leave a batch as window caches the prompt cache keeps
    (a later batch's requests start from them), and a request running alone on its own window
    cache is joined by another and goes on in a batch with its window's rows: every output is
    the target's greedy decoding."""
    from dflash_mlx.decode.streams import Streams

    pair, base = fams.pair("gpt_oss"), fams.baseline("gpt_oss")
    cache = dflash_mlx.PromptCache(pair)
    first = [pair.tokenizer.encode(t) for t in PROMPTS[:2]]

    def run(prompts, n):
        return decode_turn(pair, prompts, n, cache)

    answers = run(first, 20)
    assert answers == [greedy_ref(base, p, 20) for p in first]
    second = [p + a + pair.tokenizer.encode(" and") for p, a in zip(first, answers)]
    assert run(second, 12) == [greedy_ref(base, p, 12) for p in second] and cache.hits == 2

    prompt = pair.tokenizer.encode(PROMPTS[2])
    got, theirs = joined_mid_stream(Streams(pair, 4), prompt, 5, first[0], 30)
    assert len(prompt) + 5 > 8  # the newcomer joins past the window of 8
    assert got == greedy_ref(base, prompt, 30) and theirs == greedy_ref(base, first[0], 20)


@pytest.mark.parametrize("family", ["gemma4_text", "gpt_oss", "qwen3_next"])
def test_chunked_prefill_and_long_prompt(fams, family):
    pair, base = fams.pair(family), fams.baseline(family)
    prompt = pair.tokenizer.encode(" ".join(PROMPTS) * 3)
    ref = plain_greedy(base, prompt, 24)
    for step in (7, 20, 2048):  # chunks within the slack, wider than it, the whole prompt
        out, _ = tokens_of(pair, prompt, 24, block_size=5, prefill_step=step)
        assert out == ref, step


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gemma4_text", "gpt_oss"])
def test_verify_rows_equal_mlx_lm_one_row_steps(fams, family):
    """A 16-row verify pass (over a wrapped window) gives mlx-lm's one-row logits:
    bit for bit where the layers are KV caches and Gated DeltaNets (as for the
    first four families); to rounding where a sliding window attends over its
    ring (the window's rows are summed in another order than mlx-lm's)."""
    from mlx_lm.models.cache import make_prompt_cache

    pair, base = fams.pair(family), fams.baseline(family)
    prompt = pair.tokenizer.encode(PROMPTS[2])
    block = prompt[-1:] + list(range(20, 35))
    cache = make_prompt_cache(base)
    base(mx.array([prompt[:-1]]), cache=cache)
    steps = mx.stack([base(mx.array([[t]]), cache=cache)[0, -1] for t in block])
    tcache = pair.target.make_cache()
    pair.target(mx.array([prompt[:-1]]), tcache)
    logits = pair.target(mx.array([block]), tcache, record=True)[0][0]
    if family in SLIDING:
        assert any(isinstance(c, WindowCache) and c.offset > c.capacity for c in tcache)
        assert mx.allclose(logits, steps, atol=1e-4, rtol=1e-4).item()
    else:
        assert mx.array_equal(logits, steps).item()


@pytest.mark.parametrize("family", NEW + WRAPPED)
def test_logits_are_the_models_own_and_prefill_pays_the_head_once(fams, family):
    """Logits come from the model's own forward pass (Gemma's soft-capping
    included); `last_only` runs the LM head on one row; the last tapped layer's
    entry is the final norm's output, on every row."""
    pair, base = fams.pair(family), fams.baseline(family)
    target = pair.target
    tokens = mx.array([pair.tokenizer.encode(PROMPTS[2])])
    L = tokens.shape[1]
    want = base(tokens)
    logits, taps = target(tokens, target.make_cache())
    assert mx.allclose(logits, want, atol=1e-4).item()
    head, rows = target.head, []
    target.head = lambda h: (rows.append(h.shape[1]), head(h))[1]
    try:
        last, taps_last = target(tokens, target.make_cache(), last_only=True)
    finally:
        target.head = head
    assert rows == [1] and last.shape == (1, 1, target.vocab_size)
    assert mx.allclose(last[:, -1], want[:, -1], atol=1e-4).item()
    H = target.hidden_size
    assert taps.shape == taps_last.shape == (1, L, 2 * H)
    inner = getattr(base, "language_model", base).model
    assert mx.allclose(taps[..., H:], inner(tokens), atol=1e-4).item()
    assert mx.allclose(taps_last, taps, atol=1e-5).item()
    if family.startswith("gemma4"):
        # final_logit_softcapping (30) is applied after the head, by the model: with a
        # head scaled up to saturate it, the logits are 30 tanh(raw / 30), never raw.
        target.head = lambda h: head(h) * 1000.0
        try:
            capped = target(tokens, target.make_cache())[0]
        finally:
            target.head = head
        raw = head(inner(tokens)) * 1000.0
        assert mx.abs(raw).max().item() > 60.0 and mx.abs(capped).max().item() <= 30.0
        assert mx.allclose(capped, 30.0 * mx.tanh(raw / 30.0), atol=1e-3).item()


@pytest.mark.parametrize("family, marker", [("gemma4_text", "<start_of_turn>model\n"),
                                            ("gpt_oss", "<|start|>assistant")])
def test_chat_template_of_the_tokenizer(fams, family, marker):
    """The tokenizer's own chat template (Gemma's turns; gpt-oss's harmony format) makes the prompt."""
    pair, base = fams.pair(family), fams.baseline(family)
    tok = pair.tokenizer
    ids = build_prompt(tok, "Count to five.", system="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(marker) and "Be brief." in text
    if family == "gpt_oss":
        assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in text
        assert "Reasoning: medium" in text
    assert ids == tok.encode(text, add_special_tokens=False)
    ref = plain_greedy(base, ids, 24)
    for block_size in (1, 5, 16):
        assert tokens_of(pair, ids, 24, block_size=block_size)[0] == ref, block_size


@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss"])
def test_a_wrapped_instance_is_not_wrapped_again(fams, family):
    with pytest.raises(DFlashError, match="already wrapped"):
        TargetAdapter(fams.pair(family).target.model, [1, 3])


def test_gemma4_specifics_are_exercised(fams):
    """The tiny Gemma 4 has what the real small checkpoints have: KV-shared
    layers (no cache of their own), per-layer input embeddings, a wider global
    head, sliding and full layers; its MoE variant has K = V full attention."""
    model = fams.pair("gemma4_text").target.model
    args = model.args
    assert args.num_kv_shared_layers == 2 and len(model.make_cache()) == 4
    assert args.hidden_size_per_layer_input > 0 and model.model.embed_tokens_per_layer is not None
    assert set(args.layer_types) == {"sliding_attention", "full_attention"}
    moe = fams.pair("gemma4_text_moe").target.model
    assert moe.args.enable_moe_block and moe.args.attention_k_eq_v


def test_unsupported_caches_are_refused_in_one_line(tmp_path, vocab):
    """Mamba (recurrent ArraysCache), a chunked cache: refused, naming the layer and cache type."""
    from mlx_lm.models import mamba, qwen3
    from mlx_lm.models.cache import ChunkedKVCache

    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32, intermediate_size=64, state_size=8,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    with pytest.raises(DFlashError) as e:
        TargetAdapter(mamba.Model(args), [0])
    msg = str(e.value)
    assert "\n" not in msg and "layer 0" in msg and "ArraysCache" in msg and "mamba" in msg

    cfg = tiny.target_config("qwen3", vocab[0])
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.make_cache = lambda: [ChunkedKVCache(16) for _ in model.layers]
    with pytest.raises(DFlashError, match="layer 0 .*ChunkedKVCache"):
        TargetAdapter(model, [1, 3])

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(DFlashError) as e:
        load_target(tmp_path)
    assert "\n" not in str(e.value) and "ArraysCache" in str(e.value) and "doctor" in str(e.value)


def test_doctor_lists_the_families():
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    r = CliRunner().invoke(app, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "Target families" in r.output
    for family in CI_TESTED:
        assert family in r.output
    line = next(x for x in r.output.splitlines() if "sliding window" in x)
    assert "gemma4_text" in line and "gpt_oss" in line and "mamba" not in r.output


def test_bfloat16_sliding_window_target_is_lossless(fams):
    """A bfloat16 Gemma 4 (cast by mlx-lm's converter): greedy ids equal mlx-lm's
    although its window rows are attended in ring order (the dense variant: MLX's
    CPU gather_mm runs float32 MoE only)."""
    from mlx_lm import load

    path = tiny.convert_target(fams.path("gemma4_text"), fams.root / "family-gemma4_text-bf16", dtype="bfloat16")
    pair, base = dflash_mlx.load(str(path), str(fams.drafter)), load(str(path))[0]
    assert pair.target.dtype == mx.bfloat16
    for text in (PROMPTS[0], PROMPTS[2], PROMPTS[3]):
        prompt = pair.tokenizer.encode(text)
        ref = plain_greedy(base, prompt, 32)
        assert len(ref) > 16
        for block_size in (1, 4, 16):
            assert tokens_of(pair, prompt, 32, block_size=block_size)[0] == ref, (block_size, text)
