"""Structured output: a grammar's output is exactly plain constrained decoding's (mlx-lm with the
grammar's logits processor), drafted or not, alone or in a batch; drafts the grammar forbids never
reach the target; forced tokens are verified as certain drafts; bad grammars are refused first."""

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import conftest
import dflash_mlx
from conftest import Counted, OracleSource
from test_lossless import dflash_tokens
from dflash_mlx.constrain import Grammar
from dflash_mlx.constrain.compiler import GRAMMAR_CACHE, Grammars
from dflash_mlx.constrain.grammar import MAX_GRAMMAR_BYTES
from dflash_mlx.constrain.processor import GrammarProcessor
from dflash_mlx.decode.running import Asks
from dflash_mlx.decode.streams import Joining, Streams
from dflash_mlx.errors import DFlashError
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.adapter import hf_tokenizer

SUITE = [json.loads(line) for line in
         (Path(dflash_mlx.__file__).parent / "suites" / "json.jsonl").read_text().splitlines()]
SCHEMAS = {row["name"]: row["schema"] for row in SUITE}
WEATHER = Grammar.json_schema(SCHEMAS["weather_call"])
GRAMMARS = {
    "schema": WEATHER,
    "refs": Grammar.json_schema(SCHEMAS["edit_call"]),
    "anyOf": Grammar.json_schema(SCHEMAS["server_config"]),
    "json_object": Grammar.json_object(),
    "regex": Grammar.regex(r"(yes|no), because [a-z ]{3,30}\."),
    "lark": Grammar.lark('start: "x = " num " + " num\nnum: /[0-9]{1,4}/'),
}
PROMPT = "Answer in JSON: the weather in Paris"


@pytest.fixture(scope="module")
def demo():
    return dflash_mlx.load("demo")


def constrained_ref(model, pair, grammar, prompt, max_tokens):
    """mlx-lm's `generate_step` with the grammar's logits processor, to the first EOS."""
    proc = GrammarProcessor(pair.grammars.constraint(grammar), len(prompt))
    return conftest.plain_greedy(model, prompt, max_tokens, pair.tokenizer.eos_token_ids, [proc])


def run(pair, prompt, grammar, max_tokens=256, **kw):
    """(tokens, events) of one constrained request."""
    return dflash_tokens(pair, prompt, max_tokens, grammar=grammar, **kw)


# -- grammars and their compiler -------------------------------------------------------------------


def test_compiled_grammars_are_cached_by_hash_and_bounded(demo):
    grammars = Grammars(hf_tokenizer(demo.tokenizer), demo.target.vocab_size, [0])
    first = grammars.compile(Grammar.json_schema(SCHEMAS["person"]))
    assert grammars.compile(Grammar.json_schema(json.dumps(SCHEMAS["person"]))) is first  # same schema, same key
    assert len(grammars) == 1
    for i in range(GRAMMAR_CACHE + 5):
        grammars.compile(Grammar.regex(f"a{{{i + 1}}}"))
    assert len(grammars) == GRAMMAR_CACHE
    assert grammars.compile(Grammar.json_schema(SCHEMAS["person"])) is not first  # evicted, compiled again
    # Each sequence gets its own matcher: one's tokens do not move another's.
    a, b = grammars.constraint(WEATHER), grammars.constraint(WEATHER)
    a.commit(a.forced(4))
    assert b.forced(4) == a.forced(0) + grammars.constraint(WEATHER).forced(4)


@pytest.mark.parametrize("grammar, message", [
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.json_schema([1, 2]), "must be a JSON object"),
    (lambda: Grammar.json_schema({"type": "strin"}), "unknown type 'strin'"),
    (lambda: Grammar.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (lambda: Grammar.regex("a(b"), "regex"),
    (lambda: Grammar.lark("start: foo"), "foo"),
    (lambda: Grammar.json_schema({"enum": ["x" * MAX_GRAMMAR_BYTES]}), "Shorten"),
    (lambda: Grammar("yaml", ""), "Unknown grammar kind"),
])
def test_bad_grammars_get_one_line_before_any_model_work(demo, grammar, message):
    counted = Counted(demo.target)
    pair = dataclass_copy(demo, target=counted)
    with pytest.raises(DFlashError) as e:
        run(pair, PROMPT, grammar())
    assert message in str(e.value) and "\n" not in str(e.value)
    assert counted.passes == 0


def test_an_exploding_schema_is_refused_quickly(demo):
    deep = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(DFlashError, match="levels deep"):
        demo.grammars.compile(Grammar.json_schema(deep))


def test_tree_masks_are_each_nodes_grammar_after_its_own_path(demo):
    """A tree's node masks: the best path's as a block's rows, each branch node's the grammar's
    after the best path above its fork and the branch's tokens to it (itself included); a free
    sequence's rows allow everything, and the matchers are left where they were."""
    from types import SimpleNamespace

    from dflash_mlx.decode.constrained import TreeMasks

    prompt = demo.tokenizer.encode(PROMPT)
    ref = constrained_ref(demo.target.model, demo, WEATHER, prompt, 12)
    W, L = 5, 3
    constrained = SimpleNamespace(constraint=demo.grammars.constraint(WEATHER))
    free = SimpleNamespace(constraint=None)
    # Branch 0 forks at depth 2 and branch 1 at depth 1, each with the tokens the text has there.
    tokens = [0] + ref[: W - 1] + ref[1:4] + ref[0:3]
    bits = np.array(TreeMasks([constrained, free], [tokens, tokens], [[2, 1], [2, 1]], W, L).fill()).view(np.int32)
    along = demo.grammars.constraint(WEATHER).masks(ref[:6]).bits  # row i: after the text's first i tokens
    assert (bits[0, :W] == along[:W]).all()
    assert (bits[0, W : W + L] == along[2:5]).all() and (bits[0, W + L :] == along[1:4]).all()
    assert (bits[1] == -1).all()
    assert constrained.constraint.masks().bits.tolist() == along[:1].tolist()  # rolled back


@pytest.mark.parametrize("name", ["refs", "anyOf", "json_object", "regex"])
def test_greedy_trees_under_a_grammar_equal_mlx_lm(demo, name):
    """Trees verify under a grammar, each node's row masked by the grammar after its own path:
    greedy ids equal mlx-lm's with the grammar's processor, where a branch's token is committed
    too (the `refs` and `anyOf` texts take a branch)."""
    prompt = demo.tokenizer.encode(PROMPT)
    grammar = GRAMMARS[name]
    out, events = run(demo, prompt, grammar, max_tokens=80, block_size=8, tree=2)
    assert out == constrained_ref(demo.target.model, demo, grammar, prompt, 80)
    assert events[-1].stats.tree_cycles > 0
    assert events[-1].stats.branch_cycles > 0 or name not in ("refs", "anyOf")


def test_a_batch_of_trees_with_constrained_and_free_sequences_equals_each_alone(demo):
    from dflash_mlx.policy.batch import FixedBatchWidth

    prompts = [demo.tokenizer.encode(p) for p in (PROMPT, "Write a config file", "def parse_args(argv):")]
    grammars = [WEATHER, Grammar.json_schema(SCHEMAS["server_config"]), None]
    alone = [run(demo, p, g, max_tokens=40, block_size=4, tree=2)[0] for p, g in zip(prompts, grammars)]
    streams = Streams(demo, 4, FixedBatchWidth(4), block_size=4)
    firsts = streams.add_many([Joining(p, 40, asks=Asks(tree=2, grammar=g)) for p, g in zip(prompts, grammars)])
    got = {uid: list(ev.tokens) for uid, ev in firsts}
    stats = {}
    while len(streams):
        for uid, ev in streams.step():
            got[uid] += ev.tokens
            stats[uid] = ev.stats
    assert [got[uid] for uid, _ in firsts] == alone
    assert all(s.tree_cycles > 0 for s in stats.values())


def test_masks_cover_each_block_row_and_leave_the_matcher_where_it_was(demo):
    c = demo.grammars.constraint(WEATHER)
    forced = c.forced(16)
    assert demo.tokenizer.decode(forced).startswith('{"location":')  # up to where tokenising is ambiguous
    bad = demo.tokenizer.eos_token_ids.copy().pop()
    m = c.masks(forced + [bad, 5])
    assert m.valid == len(forced) and m.bits.shape[0] == len(forced) + 3
    assert (m.bits[len(forced) + 1 :] == -1).all()  # rows past the first forbidden draft: no mask needed
    again = c.masks()
    assert (again.bits[0] == m.bits[0]).all() and c.forced(16) == forced
    for i, t in enumerate(forced):  # row i allows draft i (and forced rows allow only it)
        row = np.unpackbits(m.bits[i].view(np.uint8), bitorder="little")
        assert row[t] == 1 and row.sum() == 1


# -- exactness ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 8, "auto"])
@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_equals_mlx_lm_with_the_grammars_processor(demo, name, block_size):
    grammar, prompt = GRAMMARS[name], demo.tokenizer.encode(PROMPT)
    ref = constrained_ref(demo.target.model, demo, grammar, prompt, 60)
    out, events = run(demo, prompt, grammar, max_tokens=60, block_size=block_size)
    assert out == ref
    text = demo.tokenizer.decode(out)
    if events[-1].finish_reason == "stop" and grammar.schema() is not None:
        jsonschema.validate(json.loads(text), grammar.schema())


@pytest.mark.parametrize("family", conftest.FAMILIES)
@pytest.mark.parametrize("block_size", [4, "auto"])
def test_greedy_equals_mlx_lm_across_families(pairs, baselines, family, block_size):
    pair = pairs[family]
    prompt = pair.tokenizer.encode("the quick brown fox")
    for grammar in (WEATHER, GRAMMARS["regex"], Grammar.json_schema(SCHEMAS["invoice"])):
        ref = constrained_ref(baselines[family], pair, grammar, prompt, 40)
        out, _ = run(pair, prompt, grammar, max_tokens=40, block_size=block_size)
        assert out == ref, family


@pytest.mark.parametrize("variant", ["bfloat16"])
def test_greedy_equals_mlx_lm_in_bfloat16(zoo, variant):
    pair, base = zoo.pair("qwen3", variant), zoo.baseline("qwen3", variant)
    prompt = pair.tokenizer.encode("the quick brown fox")
    for grammar in (WEATHER, GRAMMARS["lark"]):
        assert run(pair, prompt, grammar, max_tokens=40, block_size=8)[0] == \
            constrained_ref(base, pair, grammar, prompt, 40)


@pytest.mark.parametrize("block_size", [4, 8])
def test_rollback_at_every_position_under_a_grammar(demo, block_size):
    """Drafts of the constrained answer corrupted at each position in turn (to a token the grammar
    may or may not allow): output equals plain constrained decoding, and no forbidden draft reaches
    the target."""
    prompt = demo.tokenizer.encode(PROMPT)
    grammar = Grammar.json_schema(SCHEMAS["invoice"])
    ref = constrained_ref(demo.target.model, demo, grammar, prompt, 64)
    feature_dim = len(demo.target.tap_ids) * demo.target.hidden_size
    for corrupt in conftest.ROLLBACK_SCHEDULES.values():
        source = OracleSource(prompt + ref, demo.target.vocab_size, feature_dim, corrupt)
        seen = Recorded(demo.target)
        out, events = run(dataclass_copy(demo, target=seen), prompt, grammar, max_tokens=len(ref),
                          block_size=block_size, draft_source=source)
        assert out == ref
        check_no_forbidden_rows(demo, grammar, out, events, seen)


def test_lookup_copies_under_a_grammar(demo):
    """Cycles that copy a lookup's offer (the constrained answer itself, one position in turn
    corrupted), mixed with drafter cycles and plain steps: output equals plain constrained
    decoding, and copies were verified beside the forced tokens."""
    from dflash_mlx.draft.source import DFlashDraftSource
    from dflash_mlx.policy.plan import Plan

    class AnswerLookup(DFlashDraftSource):
        def __init__(self, pair, prompt, answer):
            super().__init__(pair.drafter, pair.target)
            self.answer, self.seen, self.offers = answer, -len(prompt), 0

        def commit(self, state, tokens):
            super().commit(state, tokens)
            self.seen += len(tokens)

        def offer(self, state, limit):
            tokens = list(self.answer[self.seen : self.seen + limit])
            if tokens:
                k = self.offers % len(tokens)
                tokens[k] = (tokens[k] + 1) % self.vocab_size
            self.offers += 1
            return tokens

        def may_offer(self, state):
            return True

    grammar = Grammar.json_schema(SCHEMAS["person"])
    prompt = demo.tokenizer.encode(PROMPT)
    ref = constrained_ref(demo.target.model, demo, grammar, prompt, 80)
    policy = conftest.ScriptedWidths([Plan(6, 5), Plan(4, 2), 1, 5])
    out, events = run(demo, prompt, grammar, max_tokens=80, block_size=policy,
                      draft_source=AnswerLookup(demo, prompt, ref))
    assert out == ref
    assert events[-1].stats.lookup_cycles > 0 and events[-1].stats.forced_tokens > 0


def test_drafts_the_grammar_forbids_are_cut_before_the_target_sees_them(demo):
    """A drafter that drafts an end-of-sequence token everywhere: every verify pass is the forced
    tokens and the last committed token alone, each forced token accepted."""
    prompt = demo.tokenizer.encode(PROMPT)
    eos = min(demo.tokenizer.eos_token_ids)
    seen = Recorded(demo.target)
    source = Always(eos, demo.target.vocab_size)
    out, events = run(dataclass_copy(demo, target=seen), prompt, WEATHER, max_tokens=40, block_size=8,
                      draft_source=source)
    assert out == constrained_ref(demo.target.model, demo, WEATHER, prompt, 40)
    assert source.calls > 0
    check_no_forbidden_rows(demo, WEATHER, out, events, seen)
    # Each block is a forced run, or nothing but the last token (every draft cut), all of it accepted.
    for ev, tokens in zip(events[1:], seen.verified):
        assert ev.accepted == len(tokens) - 1 and eos not in tokens


def test_forced_tokens_go_through_in_one_pass_even_where_free_text_decodes_plainly(demo):
    prompt = demo.tokenizer.encode(PROMPT)
    counted = Counted(demo.target)
    out, events = run(dataclass_copy(demo, target=counted), prompt, WEATHER, max_tokens=60, block_size=1)
    assert out == constrained_ref(demo.target.model, demo, WEATHER, prompt, 60)
    forced = demo.grammars.constraint(WEATHER).forced(64)
    # The first token is the prefill's pick ('{'); the rest of the key's boilerplate is one cycle.
    assert events[0].tokens == forced[:1]
    assert events[1].tokens[: len(forced) - 1] == forced[1:] and events[1].accepted >= len(forced) - 1
    assert counted.passes < len(out)  # fewer target passes than tokens, at block size 1


def test_forced_run_zero_leaves_forced_tokens_to_the_target_step_by_step(demo):
    """`forced_run=0` (the structured benchmark's "no forced drafts"): the same text, with no
    forced token drafted and a target pass per token at block size 1."""
    prompt = demo.tokenizer.encode(PROMPT)
    counted = Counted(demo.target)
    out, events = run(dataclass_copy(demo, target=counted), prompt, WEATHER, max_tokens=60, block_size=1,
                      forced_run=0)
    assert out == constrained_ref(demo.target.model, demo, WEATHER, prompt, 60)
    assert events[-1].stats.forced_tokens == 0 and counted.passes >= len(out)


def test_a_long_forced_run_goes_through_in_one_pass_whatever_the_width(demo):
    keys = {f"field_number_{i}": {"const": i} for i in range(6)}
    grammar = Grammar.json_schema({"type": "object", "properties": keys, "required": list(keys),
                                   "additionalProperties": False})
    prompt = demo.tokenizer.encode(PROMPT)
    out, events = run(demo, prompt, grammar, max_tokens=200, block_size=4)
    assert out == constrained_ref(demo.target.model, demo, grammar, prompt, 200)
    assert json.loads(demo.tokenizer.decode(out)) == {k: i for i, k in enumerate(keys)}
    assert events[-1].finish_reason == "stop" and len(events) <= 3  # all of it forced: first token, then a pass


def test_length_inside_the_structure_ends_with_length_and_stop_validates(demo):
    prompt = demo.tokenizer.encode(PROMPT)
    grammar = Grammar.json_schema(SCHEMAS["person"])
    out, events = run(demo, prompt, grammar, max_tokens=12, block_size=4)
    assert events[-1].finish_reason == "length" and len(out) == 12
    out, events = run(demo, prompt, WEATHER, max_tokens=200)
    assert events[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(demo.tokenizer.decode(out)), SCHEMAS["weather_call"])


def test_seeded_sampling_under_a_grammar_is_the_same_at_every_width(demo):
    prompt = demo.tokenizer.encode(PROMPT)
    params = SamplingParams(temp=0.8, top_p=0.95, seed=7)
    outs = [run(demo, prompt, GRAMMARS["refs"], max_tokens=50, block_size=w, sampling=params)[0]
            for w in (1, 4, 8)]
    assert outs[0] == outs[1] == outs[2]
    assert demo.grammars.constraint(GRAMMARS["refs"]).masks(outs[0]).valid == len(outs[0])


@pytest.mark.parametrize("sampled", [False, True])
def test_a_batch_of_constrained_and_free_sequences_equals_each_alone(demo, sampled):
    prompts = [demo.tokenizer.encode(p) for p in (PROMPT, "Write a config file", "def parse_args(argv):")]
    grammars = [WEATHER, Grammar.json_schema(SCHEMAS["server_config"]), None]
    params = SamplingParams(temp=0.9, seed=3) if sampled else SamplingParams()
    alone = [run(demo, p, g, max_tokens=40, block_size=4, sampling=params)[0] for p, g in zip(prompts, grammars)]
    streams = Streams(demo, 4, block_size=4)
    got = {}
    firsts = streams.add_many([Joining(p, 40, asks=Asks(params, grammar=g)) for p, g in zip(prompts, grammars)])
    order = [uid for uid, _ in firsts]
    for uid, ev in firsts:
        got[uid] = list(ev.tokens)
    while len(streams):
        for uid, ev in streams.step():
            got[uid] += ev.tokens
    assert [got[u] for u in order] == alone
    if not sampled:
        assert alone[2] == conftest.plain_greedy(demo.target.model, prompts[2], 40, demo.tokenizer.eos_token_ids)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_constrained_sequence_without_a_drafter_verifies_its_forced_tokens_beside_drafting_ones(demo, sampled):
    """A constrained request that keeps no drafter context (`block_size=1`) verifies what its grammar
    forces in the batch's drafted cycles (its copies alone, no drafts after them) while a free one
    drafts; each answer equals its answer alone."""
    from dflash_mlx.decode.decoder import Decoder

    prompts = [demo.tokenizer.encode(p) for p in (PROMPT, "def parse_args(argv):")]
    params = SamplingParams(temp=0.9, seed=3) if sampled else SamplingParams()
    alone = [run(demo, prompts[0], WEATHER, max_tokens=40, block_size=1, sampling=params)[0],
             run(demo, prompts[1], None, max_tokens=40, block_size=4, sampling=params)[0]]
    dec = Decoder(demo, 4)
    firsts = dec.add_many(prompts, [40] * 2, asks=[Asks(params, grammar=WEATHER, block_size=1), Asks(params)])
    assert [s.tapped for s in dec.seqs] == [False, True]
    out = {f.uid: list(f.tokens) for f in firsts}
    bound, plans = firsts[0].uid, []
    while len(dec):
        committed = dec.step()
        for c in committed:
            out[c.uid] += c.tokens
            if len(committed) > 1:
                plans.append((c.uid == bound, c.plan, c.forced))
    assert {plan.width for mine, plan, _ in plans if not mine} == {4}  # the free one drafts every cycle
    forced = [(plan, f) for mine, plan, f in plans if mine]
    assert all(plan.width == plan.copied + 1 == f + 1 for plan, f in forced)  # its forced tokens, nothing drafted
    assert any(plan.width > 1 for plan, _ in forced)
    assert [out[f.uid] for f in firsts] == alone


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_plain_steps_in_a_batch_run_one_ahead(demo, sampled):
    """A batch's plain steps launch the next step's target pass before the host reads the current
    one's tokens, constrained sequences too: the pass in flight is picked from once its mask is
    known. Penalties and seeded draws see every token once (no pending token counted twice), and
    each answer equals its answer alone."""
    from mlx_lm.sample_utils import make_logits_processors

    from dflash_mlx.decode.decoder import Decoder

    prompts = [demo.tokenizer.encode(p) for p in (PROMPT, "Write a config file", "def parse_args(argv):")]
    grammars = [WEATHER, Grammar.json_schema(SCHEMAS["server_config"]), None]
    params = SamplingParams(temp=0.9, seed=3) if sampled else SamplingParams()
    procs = lambda: make_logits_processors(repetition_penalty=1.3, repetition_context_size=16)  # noqa: E731
    alone = [run(demo, p, g, max_tokens=40, block_size=1, sampling=params, logits_processors=procs())[0]
             for p, g in zip(prompts, grammars)]
    dec = Decoder(demo, 4)
    firsts = dec.add_many(prompts, [40] * 3, asks=[Asks(params, procs(), grammar=g) for g in grammars])
    out = {f.uid: list(f.tokens) for f in firsts}
    ahead = []
    while len(dec):
        for c in dec.step(1):
            out[c.uid] += c.tokens
        ahead.append(dec._ahead is not None)
    assert sum(ahead) >= len(ahead) - 3  # a step in flight but where a sequence ended
    assert [out[f.uid] for f in firsts] == alone
    assert demo.grammars.constraint(WEATHER).masks(alone[0]).valid == len(alone[0])


def test_forced_tokens_count_as_certain_in_what_a_batch_expects_of_a_width(demo):
    """The batch's policy weighs each width by the tokens its sequences expect it to commit: a
    sequence whose grammar forces tokens next expects them all, whatever its drafter's rates."""
    from dflash_mlx.decode.decoder import Decoder

    keys = {f"field_number_{i}": {"const": i} for i in range(6)}
    boiler = Grammar.json_schema({"type": "object", "properties": keys, "required": list(keys),
                                  "additionalProperties": False})
    prompts = [demo.tokenizer.encode(p) for p in (PROMPT, "def parse_args(argv):")]
    dec = Decoder(demo, 8, lookup=True, block_size="auto")
    dec.add_many(prompts, [60] * 2, asks=[Asks(grammar=boiler, lookup=False), Asks(lookup=False)])
    constrained, free = dec.seqs
    both = dec.planner.gains(dec.seqs, [1, 2, 4, 8])
    alone = dec.planner.gains([free], [1, 2, 4, 8])
    assert len(constrained.constraint.forced(64)) > 8
    for w in (1, 2, 4, 8):
        assert both[w] == pytest.approx(alone[w] + w)  # the free one's expectation, and w certain tokens


def test_a_prefix_cache_entry_serves_constrained_and_free_requests_alike(demo):
    cache = dflash_mlx.PromptCache(demo)
    prompt = demo.tokenizer.encode(PROMPT + " and in Rome, please, in celsius")
    free = run(demo, prompt, None, max_tokens=20, prompt_cache=cache)[0]
    out, events = run(demo, prompt, WEATHER, max_tokens=40, prompt_cache=cache)
    assert events[0].stats.cached_tokens > 0
    assert out == constrained_ref(demo.target.model, demo, WEATHER, prompt, 40)
    again, events = run(demo, prompt, None, max_tokens=20, prompt_cache=cache)
    assert again == free and events[0].stats.cached_tokens > 0


# -- helpers -----------------------------------------------------------------------------------------


def dataclass_copy(pair, **changes):
    import dataclasses

    copy = dataclasses.replace(pair, **changes)
    copy.__dict__["grammars"] = pair.grammars  # compiled once per tokenizer
    return copy


class Recorded(Counted):
    """A target that records each verify pass's tokens (of a lone sequence)."""

    def __init__(self, target):
        super().__init__(target)
        self.verified = []

    def __call__(self, tokens, *args, **kwargs):
        if kwargs.get("record"):
            self.verified.append(tokens[0].tolist())
        return super().__call__(tokens, *args, **kwargs)


def check_no_forbidden_rows(pair, grammar, out, events, seen: Recorded):
    """At a fixed width every cycle after the first token verifies a block: each block's drafts
    are tokens the grammar allows after the text committed before it."""
    at = len(events[0].tokens)
    assert len(seen.verified) >= len(events) - 2
    for ev, tokens in zip(events[1:], seen.verified):
        assert tokens[0] == out[at - 1]
        c = pair.grammars.constraint(grammar)
        c.commit(out[:at])
        assert c.masks(tokens[1:]).valid == len(tokens) - 1, (at, tokens)
        at += len(ev.tokens)


class Always(OracleSource):
    """Drafts one token at every position."""

    def __init__(self, token, vocab_size):
        self.token, self.V, self.block_size, self.calls = token, vocab_size, 16, 0

    def new_state(self):
        return {}

    def add_context(self, state, hidden):
        pass

    def propose(self, state, last, hidden, width):
        self.calls += 1
        return mx.eye(self.V)[mx.array([self.token] * (width - 1))] * 30.0


# -- sampling exactness on a constrained toy vocabulary ----------------------------------------------

# The small pair's 5 tokens as text: 0 ends the sequence, 1-4 are 'a'-'d'. Position 0 may be a or b,
# position 1 is forced (c), position 2 anything, position 3 b or d: the grammar ends no earlier.
TOY = Grammar.regex("[ab]c[a-d][bd]+")
TOY_MASKS = [[1, 2], [3], [1, 2, 3, 4], [2, 4]]


def toy_tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"))


@pytest.fixture(scope="module")
def toy_pair():
    from dflash_mlx.draft.drafter import DFlashDrafter
    from dflash_mlx.draft.source import DFlashDraftSource

    pair, model = conftest.build_small_pair(DFlashDrafter, DFlashDraftSource, {
        "architectures": ["DFlashDraftModel"], "block_size": 4,
        "dflash_config": {"mask_token_id": 4, "target_layer_ids": [0, 1]}})
    pair.tokenizer = toy_tokenizer()
    return pair, model


def toy_distribution(model, params):
    """Each 4-token continuation of the sampling tests' prompt and its exact probability under
    the grammar: every position's logits masked, then filtered and tempered as mlx-lm does."""
    import itertools

    import test_sampling as ts

    seqs = list(itertools.product(range(ts.V), repeat=ts.N_TOKENS))
    logits = model(mx.array([ts.PROMPT + list(s) for s in seqs]))[:, len(ts.PROMPT) - 1 : -1]
    keep = np.zeros((ts.N_TOKENS, ts.V), dtype=bool)
    for i, allowed in enumerate(TOY_MASKS):
        keep[i, allowed] = True
    lp = ts.log_probs(mx.where(mx.array(keep), logits, -mx.inf), params)
    picked = mx.take_along_axis(lp, mx.array(seqs)[..., None], axis=-1)[..., 0].sum(-1)
    return seqs, np.nan_to_num(np.exp(np.array(picked)))


@pytest.mark.parametrize("drafter, seeded", [("random", False), ("tempered target", False), ("random", True)])
def test_constrained_sampling_follows_the_masked_target_distribution(toy_pair, drafter, seeded):
    import test_sampling as ts

    pair, model = toy_pair
    params = SamplingParams(temp=1.0)
    seqs, probs = toy_distribution(model, params)
    assert abs(probs.sum() - 1) < 1e-4
    source = None
    if drafter != "random":
        source = ts.TemperedTarget(model)
        source.vocab_size = ts.V  # the forced token's point mass spans the vocabulary
    # Twice the usual samples where a cut-off draft's row is a rejection: drawing it from the target's
    # row alone instead is a bias this many samples find.
    n = ts.SAMPLES * (2 if drafter != "random" and not seeded else 1)
    counts, accepted = ts.sample_counts(pair, params, n, source, seeded=seeded, grammar=TOY)
    assert all(TOY_MASKS[i].count(t) for s in counts for i, t in enumerate(s))
    if drafter != "random":
        assert accepted > 0.3  # drafts past the forced token are accepted: masked rows after drafts are exercised
    assert ts.gof_pvalue(counts, seqs, probs, n) > ts.ALPHA
