"""What the loop drafts from: the `DraftSource` interface and the DFlash drafter behind it.

A source keeps its own per-request state (`new_state`), is given the
target's taps of committed tokens (`add_context`) and the committed token ids
(`commit`, the prompt first), and proposes a block: logits from a model
(`propose`), and optionally tokens it has for free (`offer`, e.g. a lookup),
which the block-size policy may use instead of, or before, the model's.
"""

import copy
from typing import List, Optional, Tuple

import mlx.core as mx


class DraftSource:
    """What the loop needs from a drafter. `DFlashDraftSource` is the real one."""

    block_size: int = 16
    vocab_size: int = 0

    def new_state(self):
        raise NotImplementedError

    def add_context(self, state, hidden: mx.array) -> None:
        raise NotImplementedError

    def arrays(self, state) -> list:
        """Arrays of `state` to evaluate during prefill."""
        return []

    def horizon(self, state) -> Optional[Tuple[int, int]]:
        """(first, last): a draft reads at most the first `first` and the last `last`
        committed context rows, so rows between them that have fallen behind the
        last `last` may be `skip`ped; None: it may read any row."""
        return None

    def skip(self, state, n: int) -> None:
        """Commit n context rows that no draft will read (see `horizon`), without their taps."""
        raise NotImplementedError

    def reusable(self, state, n: int, total: int) -> int:
        """How many of the n committed context rows of `state` (a prompt cache
        entry's) to keep when the context grows to `total` rows before the first
        draft: at most n, and no kept row a draft then reads may be one `state`
        lacks (a long prompt's prefill skipped it, or a window dropped it)."""
        return n

    def propose(self, state, last: mx.array, hidden: Optional[mx.array], width: int) -> mx.array:
        """Logits [width - 1, V] for the block after `last`, committing `hidden` first."""
        raise NotImplementedError

    def rewind(self, state, n: int) -> None:
        """Forget the last n committed context rows (the cost measurement repeats a cycle)."""
        raise NotImplementedError

    def commit(self, state, tokens: List[int]) -> None:
        """Token ids committed since the last call (the prompt's first)."""

    def pooled(self) -> Optional["DFlashDraftSource"]:
        """The DFlash source whose drafter can draft this source's blocks together with other
        sequences' in one pass (`pool.py`), or None: each sequence drafts on its own."""
        return None

    def context(self, state) -> list:
        """The drafter layers' `DraftCache`s of `state` (for a `pooled` source; the list
        itself, so a batch can hand the context back in place)."""
        raise NotImplementedError

    def propose_path(self, state, last, hidden, width, params, prefix=(), process=None, scales=None, noise=None):
        """For sources whose positions depend on the drafts before them (DFlash 2's
        selector): tokens [width - 1 - len(prefix)] after `prefix` and the log
        probabilities each was drawn from (None when greedy), `process(row,
        before)` applied to each position's logits, and when sampling, draft
        position i drawn at `scales[i]` (`proposal.rescale`), or with `noise`
        (`sampling.Draws` rows [width - 1, V]) as the draw at its position.
        None: the loop samples `propose`'s logits itself (and nothing has been committed)."""
        return None

    def offer(self, state, limit: int) -> List[int]:
        """Up to `limit` draft tokens available without a model pass (none here)."""
        return []

    def may_offer(self, state) -> bool:
        """Whether `offer` could have tokens after one more committed token."""
        return False

    def save(self, state) -> Optional[list]:
        """The committed context of `state` as trimmable cache objects (`trim`,
        `is_trimmable`, `nbytes`) for a prompt cache, or None if it cannot be kept."""
        return None

    def restore(self, saved: list):
        """A new state whose committed context is `saved` (from `save`, copied)."""
        raise NotImplementedError


class ContextRows:
    """One drafter layer's committed context as a prompt cache holds it: trimming
    drops rows from the end without a copy."""

    def __init__(self, cache):
        self.cache = cache

    def __copy__(self):  # a view that trims apart from this one (same buffers)
        return ContextRows(copy.copy(self.cache))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.cache.trim(n)
        return n

    @property
    def nbytes(self) -> int:
        c = self.cache
        return 0 if c.keys is None else c.keys.nbytes + c.values.nbytes


class DFlashDraftSource(DraftSource):
    def __init__(self, drafter, target):
        self.drafter = drafter
        self.target = target
        self.block_size = drafter.args.block_size
        self.vocab_size = target.vocab_size
        self.mask_token_id = drafter.args.mask_token_id
        self.scale = drafter.args.input_embedding_scale

    def new_state(self):
        return self.drafter.make_cache()

    def add_context(self, state, hidden):
        self.drafter.add_context(hidden, state)

    def horizon(self, state):
        return self.drafter.horizon

    def skip(self, state, n):
        for c in state:
            c.skip(n)

    def reusable(self, state, n, total):
        if self.drafter.horizon is None:
            return n
        first, last = self.drafter.horizon
        # A draft at `total` reads rows [0, first) and [total - last, total); those before n come from
        # `state`: keep rows up to the first it lacks (the rest run again).
        gaps = [r for c in state for r in (c.absent(0, min(first, n)), c.absent(max(first, total - last), n))
                if r is not None]
        return min(gaps + [n])

    def arrays(self, state):
        return [(c.keys, c.values) for c in state if c.keys is not None]

    def rewind(self, state, n):
        for c in state:
            c.trim(n)

    def pooled(self):
        return self if self.drafter.batchable else None

    def context(self, state):
        return state

    def save(self, state):
        return [ContextRows(c) for c in state]

    def restore(self, saved):
        return [r.cache for r in saved]

    def block_rows(self, width: int) -> int:
        """Rows of the block drafted for a verify of `width`: the block the drafter was trained
        on (`block_size`), however few positions are verified. A shorter block of masks is a
        context it never saw, and its guesses there are worse (docs/adaptive-block-size.md)."""
        return max(width, self.block_size)

    def draft_states(self, state, last, hidden, width: int) -> mx.array:
        """The drafter's hidden states [1, width - 1, D] at the first draft positions
        (a block of `block_rows(width)` rows; the LM head runs on the verified ones only)."""
        n = self.block_rows(width)
        block = mx.concatenate([last, mx.full((n - 1,), self.mask_token_id, last.dtype)])
        emb = self.target.embed(block[None])
        if self.scale != 1.0:
            emb = emb * self.scale
        return self.drafter(emb, hidden, state)[:, 1:width]

    def propose(self, state, last, hidden, width):
        h = self.draft_states(state, last, hidden, width)
        return self.drafter.finish_logits(self.target.head(h))[0]
