"""The learned proposal scales (`proposal.py`): which scale each draft position gets."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.policy.proposal import (LEARN_ALWAYS, LEARN_EVERY, SCALES, FixedScale, ProposalScales,
                                 acceptance_by_scale)


def row(best, high=0.5, low=0.2):
    """Gains for one position: `high` at scale `best`, `low` elsewhere."""
    return [high if s == best else low for s in SCALES]


def test_nothing_learned_drafts_at_scale_one():
    assert ProposalScales(7).choose(4) == [1.0] * 4
    assert ProposalScales(7).describe() is None


def test_each_position_drafts_at_its_own_best_scale():
    ps = ProposalScales(3)
    for _ in range(20):
        ps.update(0, [row(2.0), row(1.4), row(4.0)])
    assert ps.choose(3) == [2.0, 1.4, 4.0]
    assert ps.choose(2, start=1) == [1.4, 4.0]
    # Past the last position it knows, the last position's.
    assert ps.choose(5) == [2.0, 1.4, 4.0, 4.0, 4.0]
    assert ps.describe() == "proposal scales per position: 2 1.4 4"


def test_a_position_without_evidence_borrows_the_pooled_mean():
    ps = ProposalScales(4)
    for _ in range(10):
        ps.update(0, [row(2.8), row(2.8)])
    assert ps.choose(4) == [2.8] * 4  # positions 2 and 3 were never reached
    # One weak observation at position 3 does not outweigh the pooled prior.
    ps.update(3, [row(0.7, high=0.3, low=0.25)])
    assert ps.choose(4)[3] == 2.8
    for _ in range(30):
        ps.update(3, [row(0.7)])
    assert ps.choose(4)[3] == 0.7


def test_old_evidence_fades():
    ps = ProposalScales(1, decay=0.9)
    for _ in range(30):
        ps.update(0, [row(2.0)])
    for _ in range(30):
        ps.update(0, [row(1.4)])
    assert ps.choose(1) == [1.4]
    assert ps.weight[0] == pytest.approx(sum(0.9 ** k for k in range(60)))


def test_learning_every_cycle_then_one_in_n():
    ps = ProposalScales(3)
    asked = [ps.learning() for _ in range(LEARN_ALWAYS + 4 * LEARN_EVERY)]
    assert all(asked[:LEARN_ALWAYS])
    assert sum(asked[LEARN_ALWAYS:]) == 4


def test_a_fixed_scale_learns_nothing():
    f = FixedScale(1.7)
    assert f.choose(3) == [1.7] * 3 and not f.learning()


def test_acceptance_by_scale_is_the_overlap_of_p_and_each_scaled_q():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(7), size=3)
    q = rng.dirichlet(np.ones(7) * 0.3, size=3)
    used = [1.0, 2.0, 0.7]  # the drafts were drawn at these: q ** (1 / used), normalised
    drawn = q ** (1 / np.array(used)[:, None])
    drawn /= drawn.sum(axis=1, keepdims=True)
    got = np.array(acceptance_by_scale(mx.array(np.log(p), dtype=mx.float32), mx.array(np.log(drawn), dtype=mx.float32),
                                       used))
    for i in range(3):
        for j, s in enumerate(SCALES):
            qs = q[i] ** (1 / s)
            assert got[i, j] == pytest.approx(np.minimum(p[i], qs / qs.sum()).sum(), abs=1e-5)
    assert got.shape == (3, len(SCALES))
