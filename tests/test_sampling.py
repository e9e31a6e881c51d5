"""Speculative sampling draws exactly from the target's distribution.

On a 5-token vocabulary we enumerate every 4-token continuation, compute its
exact probability under the (filtered, tempered) target, and compare with the
sequences DFlash samples using a chi-square goodness-of-fit test. The test is
seeded; with a fresh seed its false-alarm rate is 0.1% (alpha = 1e-3).
"""

import dataclasses
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

import conftest
import dflash_mlx
from dflash_mlx import sampling
from dflash_mlx.decode import passes
from conftest import ScriptedWidths
from dflash_mlx.policy.plan import Plan
from dflash_mlx.draft.drafter import DFlashDrafter
from dflash_mlx.draft.source import DFlashDraftSource, DraftSource
from dflash_mlx.policy.proposal import SCALES, ProposalScales, rescale
from dflash_mlx.sampling import SamplingParams, log_probs

V, N_TOKENS, BLOCK, SAMPLES, ALPHA = conftest.SMALL_V, 4, 4, 2000, 1e-3
PROMPT = [1, 3, 2]


def chi2_sf(x, k):
    """Upper tail of the chi-square law (Wilson-Hilferty; ample for alpha 1e-3)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_pair():
    """The 5-token target and a random DFlash drafter."""
    return conftest.build_small_pair(DFlashDrafter, DFlashDraftSource, {
        "architectures": ["DFlashDraftModel"], "block_size": BLOCK,
        "dflash_config": {"mask_token_id": 4, "target_layer_ids": [0, 1]},
    })


class TemperedTarget(DraftSource):
    """A drafter that is good but not perfect: q = softmax(logits / 2) of the
    target itself along its greedy path from the prompt and `last`."""

    block_size = BLOCK

    def __init__(self, model):
        self.model = model

    def new_state(self):
        return None

    def add_context(self, state, hidden):
        pass

    def propose(self, state, last, hidden, width):
        seq = PROMPT + [last.item()]
        rows = []
        for _ in range(width - 1):
            row = self.model(mx.array([seq]))[0, -1]
            rows.append(row * 0.5)
            seq.append(mx.argmax(row).item())
        return mx.stack(rows)


def exact_distribution(model, params):
    seqs = list(itertools.product(range(V), repeat=N_TOKENS))
    x = mx.array([PROMPT + list(s) for s in seqs])
    lp = log_probs(model(x)[:, len(PROMPT) - 1 : -1], params)
    picked = mx.take_along_axis(lp, mx.array(seqs)[..., None], axis=-1)[..., 0].sum(-1)
    return seqs, np.exp(np.array(picked))


def sample_counts(pair, params, n, source=None, block_size=BLOCK, seeded=False, **kw):
    """n texts of N_TOKENS, and how often the first draft was accepted; `seeded`: the
    i-th text with seed i (`sampling.Draws`), else rejection sampling after one seed."""
    mx.random.seed(1234)
    counts, accepted_first, cycles = {}, 0, 0
    for i in range(n):
        toks, events = [], []
        p = dataclasses.replace(params, seed=i) if seeded else params
        for ev in dflash_mlx.stream_generate(pair, PROMPT, max_tokens=N_TOKENS, sampling=p,
                                             block_size=block_size, draft_source=source, **kw):
            toks += ev.tokens
            events.append(ev)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        accepted_first += events[1].accepted >= 1
        cycles += 1
    return counts, accepted_first / cycles


def gof_pvalue(counts, seqs, probs, n):
    expected = probs * n
    observed = np.array([counts.get(s, 0) for s in seqs], dtype=float)
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:
        obs = np.append(obs, observed[~big].sum())
        exp = np.append(exp, expected[~big].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, len(obs) - 1)


@pytest.mark.parametrize("params", [
    SamplingParams(temp=1.0),
    SamplingParams(temp=1.3, top_p=0.9, top_k=4, min_p=0.05),
])
def test_random_drafter_samples_follow_the_target_distribution(small_pair, params):
    pair, model = small_pair
    seqs, probs = exact_distribution(model, params)
    assert abs(probs.sum() - 1) < 1e-4
    counts, _ = sample_counts(pair, params, SAMPLES)
    assert sum(counts.values()) == SAMPLES
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA


def test_good_drafter_is_exact_and_accepted_more_than_independent_matching(small_pair):
    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    source = TemperedTarget(model)
    seqs, probs = exact_distribution(model, params)
    counts, accept_rate = sample_counts(pair, params, SAMPLES, source)
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA

    # First draft token: accepted with probability E[sum min(p, q)], which
    # beats E[sum p q], the rate at which an independent draw from q matches
    # one from p.
    p1 = mx.exp(log_probs(model(mx.array([PROMPT]))[0, -1], params))
    spec = indep = 0.0
    for t1 in range(V):
        p2 = mx.exp(log_probs(model(mx.array([PROMPT + [t1]]))[0, -1], params))
        q2 = mx.exp(log_probs(source.propose(None, mx.array([t1]), None, 2)[0], params))
        spec += p1[t1].item() * mx.minimum(p2, q2).sum().item()
        indep += p1[t1].item() * (p2 * q2).sum().item()
    assert spec > indep + 0.05
    sigma = math.sqrt(spec * (1 - spec) / SAMPLES)
    assert abs(accept_rate - spec) < 4 * sigma + 1e-3
    assert accept_rate > indep + 4 * sigma


class FixedLookup(DFlashDraftSource):
    """The drafter, plus a lookup that always offers the same tokens (a certain draft, right or wrong)."""

    def __init__(self, pair, tokens):
        super().__init__(pair.drafter, pair.target)
        self.tokens = tokens

    def offer(self, state, limit):
        return self.tokens[:limit]

    def may_offer(self, state):
        return True


@pytest.mark.parametrize("plan", [Plan(4, 3), Plan(4, 1)])
def test_lookup_drafts_sample_the_target_distribution(small_pair, plan):
    """A looked-up token is a point mass q: accepted with probability p(x), and a
    rejection draws from p without x. Lookup-only and lookup-then-drafter blocks
    both sample exactly, and the first looked-up token is accepted at rate p(x)."""
    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    seqs, probs = exact_distribution(model, params)
    source = FixedLookup(pair, [2, 3, 1])
    counts, accept_rate = sample_counts(pair, params, SAMPLES, source, ScriptedWidths([plan]))
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA
    # The offer follows the prompt's sampled token t1: P(accept) = sum_t1 p(t1) p(2 | t1).
    p1 = mx.exp(log_probs(model(mx.array([PROMPT]))[0, -1], params))
    p_first = sum(p1[t1].item() * mx.exp(log_probs(model(mx.array([PROMPT + [t1]]))[0, -1], params))[2].item()
                  for t1 in range(V))
    sigma = math.sqrt(p_first * (1 - p_first) / SAMPLES)
    assert abs(accept_rate - p_first) < 4 * sigma + 1e-3


def test_the_check_catches_a_wrong_acceptance_rule(small_pair, monkeypatch):
    """Negative control: accepting every draft token must fail the test."""
    pair, model = small_pair
    params = SamplingParams(temp=1.0)

    def accept_all(draft, logits, params, q_lp=None):
        return mx.array(draft.shape[0]), mx.random.categorical(log_probs(logits[-1], params))

    monkeypatch.setattr(passes, "verify_accept", accept_all)
    seqs, probs = exact_distribution(model, params)
    # A quarter of the samples the tests above take already rejects it: they have the power to.
    n = SAMPLES // 4
    counts, _ = sample_counts(pair, params, n, TemperedTarget(model))
    assert gof_pvalue(counts, seqs, probs, n) < ALPHA


def gumbel_coupled(p: np.ndarray, q: np.ndarray) -> float:
    """P(argmax(log p + G) == argmax(log q + G)) for one Gumbel vector G: the
    event X = Y = i is a race of weights max(p_j / p_i, q_j / q_i), won by i
    with probability 1 / sum_j max(p_j / p_i, q_j / q_i)."""
    total = 0.0
    for i in np.flatnonzero((p > 0) & (q > 0)):
        total += 1.0 / np.maximum(p / p[i], q / q[i]).sum()
    return total


def test_seeded_draws_follow_the_target_distribution_and_couple_the_drafts(small_pair):
    """A seeded request draws each token with its position's Gumbel noise
    (`sampling.Draws`): over many seeds its texts follow the target's exact
    distribution, and a draft drawn with the same noise is accepted at the
    Gumbel coupling's rate, well above an independent draw's."""
    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    source = TemperedTarget(model)
    seqs, probs = exact_distribution(model, params)
    counts, accept_rate = sample_counts(pair, params, SAMPLES, source, seeded=True)
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA

    p1 = np.array(mx.exp(log_probs(model(mx.array([PROMPT]))[0, -1], params)))
    coupled = indep = 0.0
    for t1 in range(V):
        p2 = np.array(mx.exp(log_probs(model(mx.array([PROMPT + [t1]]))[0, -1], params)))
        q2 = np.array(mx.exp(log_probs(source.propose(None, mx.array([t1]), None, 2)[0], params)))
        coupled += p1[t1] * gumbel_coupled(p2, q2)
        indep += p1[t1] * (p2 * q2).sum()
    sigma = math.sqrt(coupled * (1 - coupled) / SAMPLES)
    assert abs(accept_rate - coupled) < 4 * sigma + 1e-3
    assert accept_rate > indep + 4 * sigma


def batched_draws_fit(small_pair, seeded: bool, n: int, first_seed: int, check=lambda dec: None) -> None:
    """`SAMPLES` texts sampled `n` at a time in one decoder (each with its own seed from `first_seed`, or
    unseeded) follow the target's exact distribution; `check(dec)` once each batch has joined."""
    from dflash_mlx.decode.decoder import Asks, Decoder

    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    seqs, probs = exact_distribution(model, params)
    counts = {}
    mx.random.seed(first_seed * 2)
    for start in range(first_seed, first_seed + SAMPLES, n):
        asks = [Asks(dataclasses.replace(params, seed=s) if seeded else params) for s in range(start, start + n)]
        dec = Decoder(pair, BLOCK)
        out = {f.uid: list(f.tokens) for f in dec.add_many([PROMPT] * n, [N_TOKENS] * n, asks=asks)}
        check(dec)
        while len(dec):
            for c in dec.step():
                out[c.uid] += c.tokens
        for toks in out.values():
            counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    assert sum(counts.values()) == SAMPLES and all(len(t) == N_TOKENS for t in counts)
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA


@pytest.mark.parametrize("seeded", [True, False])
def test_batched_draws_follow_the_target_distribution(small_pair, seeded):
    """Sequences sampled together (`decode.decoder.Decoder`: one drafter pass and one verify pass
    for 250 of them) follow the target's exact distribution: each with its own seed (checked
    against its draws), or unseeded (rejection sampling against the proposal its drafts were
    drawn from, learned scales included)."""
    batched_draws_fit(small_pair, seeded, 250, 10_000)  # seeds the tests above do not use


@pytest.mark.parametrize("seeded", [True, False])
def test_sequences_verifying_fewer_rows_than_the_batch_follow_the_target_distribution(small_pair, monkeypatch,
                                                                                      seeded):
    """Half the sequences of each batch held apart and verifying only their last token in every
    drafted cycle (`policy.planner.narrow`) beside the others' whole blocks: every text follows the
    target's exact distribution, seeded or unseeded (rejection sampling over the drafts it verifies)."""
    from dflash_mlx.decode import caches
    from dflash_mlx.policy import planner

    monkeypatch.setattr(caches, "best_groups", lambda lengths, among=None: [[b] for b in sorted(
        range(len(lengths)) if among is None else among)])
    monkeypatch.setattr(planner, "narrow", lambda s, w, share=0.0: 1 if s.uid % 2 else w)

    def apart(dec):
        assert len(dec.caches.groups()) == 125

    batched_draws_fit(small_pair, seeded, 125, 50_000, apart)


def test_an_unseeded_request_joined_mid_stream_follows_the_target_distribution(small_pair):
    """A request sampling alone (its own policy's cycles, on its own caches) that another joins
    after its first token, or after its first cycle, goes on beside it in one batch: its texts
    and its joiner's follow the target's exact distribution (rejection sampling alone and in the
    batch, the pair's learned proposal scales included)."""
    from dflash_mlx.decode.decoder import Asks, Decoder

    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    seqs, probs = exact_distribution(model, params)
    counts, joined, groups = {}, {}, SAMPLES // 2
    mx.random.seed(30_000)
    for i in range(groups):
        dec = Decoder(pair, BLOCK)
        first = dec.add(PROMPT, N_TOKENS, asks=Asks(params))
        out = {first.uid: list(first.tokens)}
        if i % 2:  # a cycle alone first
            for c in dec.step():
                out[c.uid] += c.tokens
        other = dec.add(PROMPT, N_TOKENS, asks=Asks(params))
        out[other.uid] = list(other.tokens)
        while len(dec):
            for c in dec.step():
                out[c.uid] += c.tokens
        for toks in out.values():
            counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        joined[tuple(out[first.uid])] = joined.get(tuple(out[first.uid]), 0) + 1
    assert all(len(t) == N_TOKENS for t in counts)
    assert gof_pvalue(counts, seqs, probs, 2 * groups) > ALPHA
    assert gof_pvalue(joined, seqs, probs, groups) > ALPHA


def test_an_unseeded_sequence_in_a_batch_of_one_draws_what_it_draws_alone(small_pair):
    """Alone and in a batch an unseeded sampled request makes the same random draws in the same
    order (drafts from the same proposal scales, the same rejection sampling), so under one
    global seed every cycle commits the same tokens."""
    from dflash_mlx.decode.decoder import Asks, Decoder

    import copy

    pair, _ = small_pair
    params = SamplingParams(temp=1.0)
    scales = pair.proposal_scales(params)  # the pair's, which both learn into
    for seed in range(3):
        before = copy.deepcopy(scales.__dict__)
        mx.random.seed(seed)
        alone = [ev.tokens for ev in dflash_mlx.stream_generate(pair, PROMPT, max_tokens=40, sampling=params,
                                                                 block_size=BLOCK, lookup=False)]
        scales.__dict__.update(before)
        mx.random.seed(seed)
        dec = Decoder(pair, BLOCK)
        batched = [dec.add(PROMPT, 40, asks=Asks(params)).tokens]
        while len(dec):
            batched += [c.tokens for c in dec.step()]
        # Alone, a cycle is no wider than the budget left; compare the cycles both ran at full width.
        full = next(i for i in range(len(alone)) if 40 - sum(map(len, alone[:i])) < BLOCK)
        assert full > 3 and batched[:full] == alone[:full], seed


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0, seed=7), SamplingParams(temp=0.7, top_p=0.9, top_k=3, seed=8),
                                    SamplingParams(temp=1.2, min_p=0.1, seed=9)])
def test_a_seed_fixes_the_text_at_every_width(small_pair, params):
    """A seeded request's text depends on the prompt, the settings and the seed alone:
    plain steps, every fixed width, a lookup's certain drafts, the adaptive sizer
    and penalties (processed rows) give the same tokens; another seed does not."""
    pair, model = small_pair
    prompt = [1, 3, 2, 0, 4, 1]

    def text(block_size, seed=params.seed, **kw):
        p = SamplingParams(params.temp, params.top_p, params.top_k, params.min_p, seed)
        return [t for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=24, sampling=p, block_size=block_size,
                                                       **kw) for t in ev.tokens]

    plain = text(1)
    assert len(set(plain)) > 1
    for block_size in (2, 3, BLOCK, "auto"):
        assert text(block_size) == plain, block_size
    assert text(BLOCK, draft_source=FixedLookup(pair, [2, 3, 1])) == plain
    mixed = ScriptedWidths([Plan(1), Plan(BLOCK), Plan(2), Plan(BLOCK, 2), Plan(1), Plan(3)])
    assert text(mixed, draft_source=FixedLookup(pair, [2, 3, 1])) == plain
    penalty = {"repetition_penalty": 1.5, "repetition_context_size": 8}
    processed = text(1, logits_processors=sampling.make_processors(penalty))
    assert text(BLOCK, logits_processors=sampling.make_processors(penalty)) == processed
    assert text(1, seed=params.seed + 100) != plain


def test_invalid_sampling_settings():
    for kw in [dict(temp=-0.1), dict(top_p=0.0), dict(top_p=1.2), dict(top_k=-1), dict(min_p=1.5)]:
        with pytest.raises(dflash_mlx.DFlashError):
            SamplingParams(**kw)


def near_tie_bf16():
    """199,999 logits of 2.0 and one of 2.015625 (one bf16 ulp above), last."""
    return mx.concatenate([mx.full((199_999,), 2.0, dtype=mx.bfloat16), mx.array([2.015625], dtype=mx.bfloat16)])


def mlx_lm_greedy(logits):
    """mlx-lm's generate_step pick for one row: its greedy sampler on its log probabilities."""
    from mlx_lm.sample_utils import greedy_sampler

    row = logits[None]
    return greedy_sampler(row - mx.logsumexp(row, keepdims=True))[0]


def test_greedy_pick_uses_mlx_lm_log_probabilities_in_the_model_dtype():
    logits = near_tie_bf16()
    # The raw argmax is the lone larger logit; in bf16 both log probabilities round
    # to the same value and mlx-lm's argmax takes the first of them.
    assert mx.argmax(logits).item() == 199_999
    want = mlx_lm_greedy(logits).item()
    assert want == 0
    assert sampling.pick(logits, SamplingParams()).item() == want
    # Rows of a batch are picked the same way, each on its own.
    rows = mx.stack([logits, logits[::-1]])
    assert sampling.pick(rows, SamplingParams()).tolist() == [want, mlx_lm_greedy(logits[::-1]).item()]


def test_penalties_keep_sampling_exact(small_pair):
    """With mlx-lm's repetition and presence penalties, each position's p (and
    the drafter's q) is processed after the tokens before it, drafts included:
    DFlash samples exactly the processed target's sequences."""
    from mlx_lm.sample_utils import make_logits_processors

    pair, model = small_pair
    params = SamplingParams(temp=1.0)
    settings = dict(repetition_penalty=1.8, presence_penalty=0.8)
    seqs = list(itertools.product(range(V), repeat=N_TOKENS))
    logits = model(mx.array([PROMPT + list(s) for s in seqs]))
    procs = make_logits_processors(**settings)
    # Position i's processed distribution depends on the prefix s[:i] alone: one row per distinct prefix.
    rows = {}
    for j, s in enumerate(seqs):
        for i in range(N_TOKENS):
            if s[:i] not in rows:
                row = logits[j : j + 1, len(PROMPT) - 1 + i]
                for p in procs:
                    row = p(mx.array(PROMPT + list(s[:i])), row)
                rows[s[:i]] = log_probs(row, params)[0]
    assert len(rows) == sum(V**i for i in range(N_TOKENS))
    lp = {prefix: np.array(row) for prefix, row in rows.items()}
    probs = np.array([math.exp(sum(lp[s[:i]][s[i]] for i in range(N_TOKENS))) for s in seqs])
    assert abs(probs.sum() - 1) < 1e-4
    plain_seqs, plain = exact_distribution(model, params)
    assert np.abs(plain - probs).max() > 0.01  # the penalties matter here
    counts, accepted = sample_counts(pair, params, SAMPLES, TemperedTarget(model),
                                     logits_processors=make_logits_processors(**settings))
    assert accepted > 0.3  # drafts are accepted, so processed rows after drafts are exercised
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA


class SureTarget(TemperedTarget):
    """A drafter surer than the target: q = softmax(3 * logits) along the target's greedy path."""

    def propose(self, state, last, hidden, width):
        return super().propose(state, last, hidden, width) * 6.0


def first_acceptance(model, source, params, scale):
    """E[sum_x min(p(x), q_scale(x))] at the first draft position, over the prompt's sampled token."""
    p1 = mx.exp(log_probs(model(mx.array([PROMPT]))[0, -1], params))
    total = 0.0
    for t1 in range(V):
        p2 = mx.exp(log_probs(model(mx.array([PROMPT + [t1]]))[0, -1], params))
        q2 = mx.exp(rescale(log_probs(source.propose(None, mx.array([t1]), None, 2)[0], params), scale))
        total += p1[t1].item() * mx.minimum(p2, q2).sum().item()
    return total


@pytest.mark.parametrize("scale", [0.5])  # flatter scales: the learned test below
def test_drafts_at_any_fixed_scale_sample_the_target_distribution(small_pair, scale):
    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    seqs, probs = exact_distribution(model, params)
    counts, _ = sample_counts(pair, params, SAMPLES, proposal_scale=scale)
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA


def test_learned_scales_sample_exactly_and_flatten_a_drafter_surer_than_the_target(small_pair):
    """`auto` scales learn that a too-sure drafter is accepted more when flattened; the
    drafts stay exact, and the first is accepted at the learned scale's exact rate."""
    pair, model = small_pair
    params = SamplingParams(temp=1.0, top_k=4)
    source = SureTarget(model)
    seqs, probs = exact_distribution(model, params)
    learned = ProposalScales(BLOCK - 1)
    counts, rate = sample_counts(pair, params, SAMPLES, source, proposal_scale=learned)
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA
    chosen = learned.choose(1)[0]
    rates = {s: first_acceptance(model, source, params, s) for s in SCALES}
    assert chosen > 1 and rates[chosen] > rates[1.0] + 0.05
    assert rates[chosen] >= max(rates.values()) - 0.02  # the best scale, or all but
    sigma = math.sqrt(rates[chosen] * (1 - rates[chosen]) / SAMPLES)
    assert abs(rate - rates[chosen]) < 4 * sigma + 0.01  # the first requests drafted at 1 while it learned
    assert rate > rates[1.0] + 4 * sigma


def test_the_scales_learn_from_the_drafters_positions_each_verify_reached(small_pair):
    """With one looked-up token first (the target's own greedy pick), the drafter's positions
    are 1 and 2 of a width-4 block: each cycle teaches positions 1 .. min(accepted, 2) (the
    first rejected included), one cycle later (read at the next cycle's one synchronisation)."""
    pair, model = small_pair

    class GreedyLookup(TemperedTarget):
        """Offers the target's greedy next token; drafts after it along the greedy path."""

        history, vocab_size = [], V

        def commit(self, state, tokens):
            self.history = self.history + list(tokens)

        def offer(self, state, limit):
            return [mx.argmax(model(mx.array([self.history]))[0, -1]).item()]

        def may_offer(self, state):
            return True

        def propose(self, state, last, hidden, width):
            seq, rows = list(self.history), []
            for _ in range(width - 1):
                row = model(mx.array([seq]))[0, -1]
                rows.append(row * 0.5)
                seq.append(mx.argmax(row).item())
            return mx.stack(rows)

    class Recording(ProposalScales):
        def update(self, start, gains):
            self.seen.append((start, len(gains)))
            super().update(start, gains)

    rec = Recording(BLOCK - 1)
    rec.seen = []
    mx.random.seed(5)
    events = list(dflash_mlx.stream_generate(pair, PROMPT, max_tokens=60, sampling=SamplingParams(temp=0.5),
                                             block_size=ScriptedWidths([Plan(4, 1)]),
                                             draft_source=GreedyLookup(model),
                                             proposal_scale=rec))
    # Fewer cycles than LEARN_ALWAYS: each is learned from. The last cycles are narrowed to the
    # tokens left; the one after the last is never learned from.
    reached = [(1, min(ev.accepted, 2)) for ev in events[1:-3] if ev.accepted >= 1]
    assert len(reached) > 10 and any(n == 2 for _, n in reached) and any(n == 1 for _, n in reached)
    assert rec.seen[: len(reached)] == reached


def test_a_request_ended_by_a_stop_string_reports_its_proposal_scales(pairs):
    """An unseeded sampled request reports the proposal scales it learnt in its last event's
    stats however it ends: at its budget, and at a stop string too."""
    import copy

    pair = pairs["qwen3"]
    params = SamplingParams(temp=1.0)
    prompt = pair.tokenizer.encode("def main():")
    scales = pair.proposal_scales(params)
    before = copy.deepcopy(scales.__dict__)
    mx.random.seed(5)
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=40, sampling=params, block_size=4,
                                             lookup=False))
    text = "".join(ev.text for ev in events)
    assert events[-1].finish_reason == "length" and events[-1].stats.proposal_scales
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    scales.__dict__.update(before)
    mx.random.seed(5)  # the same draws: the text reaches the stop string
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=40, sampling=params, block_size=4,
                                             lookup=False, stop=[stop]))
    last = events[-1]
    assert last.finish_reason == "stop" and last.stats.stop_sequence == stop
    assert last.stats.proposal_scales == scales.describe()
