"""Lookup drafts: an exact n-gram index over the prompt and the committed text.

When the last few tokens occurred before, the tokens that followed them then
are a free draft (no model pass): code, quotes and edits repeat. The index
is extended token by token (a dict insert per n-gram order, whatever the
context length) and never rescanned.
"""

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx

from .source import DraftSource

ORDERS = (6, 5, 4, 3)
BULK = 64  # tokens from which `NgramIndex.extend` indexes by slices


class Offer(list):
    """Draft tokens from the index, and the n-gram `order` of the match that gave them."""

    def __init__(self, tokens=(), order: int = 0):
        super().__init__(tokens)
        self.order = order


class NgramIndex:
    """Where each n-gram of the stream last occurred, for n in `orders`.

    `propose(k)` continues the longest recurring suffix with what followed its
    latest earlier occurrence; a copy that runs into the present repeats
    itself (an overlapping copy), so a periodic text gives drafts of any length.
    """

    def __init__(self, tokens: Sequence[int] = (), orders: Sequence[int] = ORDERS):
        if not orders or min(orders) < 1:
            raise ValueError(f"n-gram orders must be positive (got {tuple(orders)}).")
        self.orders = sorted(set(orders), reverse=True)
        self.tokens: List[int] = []
        self.follow: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in self.orders}
        self.heads = set()  # (n - 1)-grams that start an indexed n-gram, n the smallest order
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams the new tokens complete: each n-gram T[j - n : j] maps to j
        (it was last followed by T[j]). A cycle's few tokens go one by one; a prompt's
        many are indexed from shifted slices at C speed (later occurrences overwrite
        earlier ones, as one by one: a 64k-token prompt in about half the time)."""
        T, low = self.tokens, self.orders[-1]
        if len(tokens) < BULK:
            for t in tokens:
                j = len(T)
                for n in self.orders:
                    if j >= n:
                        self.follow[n][tuple(T[j - n : j])] = j
                if j >= low:
                    self.heads.add(tuple(T[j - low : j - 1]))
                T.append(int(t))
            return
        start = len(T)
        T.extend(int(t) for t in tokens)
        end = len(T)

        def grams(n, first, stop):  # (T[j - n : j] for j in first .. stop - 1)
            return zip(*(T[first - n + i : stop - n + i] for i in range(n))) if n else [()]

        for n in self.orders:
            first = max(start, n)
            if first < end:
                self.follow[n].update(zip(grams(n, first, end), range(first, end)))
        first = max(start, low)
        if first < end:  # T[j - low : j - 1] for each new j
            self.heads.update(grams(low - 1, first - 1, end - 1))

    def copy(self) -> "NgramIndex":
        """An index of the same tokens that grows apart from this one (copies of the maps, at C speed)."""
        out = NgramIndex(orders=self.orders)
        out.tokens = list(self.tokens)
        out.follow = {n: f.copy() for n, f in self.follow.items()}
        out.heads = set(self.heads)
        return out

    def propose(self, k: int) -> Offer:
        """Up to k tokens that followed the longest recurring suffix last time (an
        `Offer`: its `order` is that suffix's length); empty when none recurs."""
        T = self.tokens
        if k < 1:
            return Offer()
        for n in self.orders:
            if len(T) < n:
                continue
            j = self.follow[n].get(tuple(T[-n:]))
            if j is not None:
                out = T[j : j + k]
                period = len(T) - j
                while len(out) < k:
                    out.append(out[len(out) - period])
                return Offer(out, n)
        return Offer()

    def may_propose_next(self) -> bool:
        """Whether one more token, whatever it is, could make `propose` find a match."""
        low = self.orders[-1]
        return len(self.tokens) >= low - 1 and tuple(self.tokens[len(self.tokens) - low + 1 :]) in self.heads


class WithLookup(DraftSource):
    """A draft source plus an n-gram lookup over the prompt and committed tokens.

    It offers lookup tokens (`offer`) beside the wrapped source's drafts; the
    block-size policy decides per cycle whether to use them, alone or as the
    first positions of a block the drafter fills. Everything else is the
    wrapped source's.

    The indexes of the last `KEEP` requests whose context a prompt cache kept
    (`save`) are kept too: a request whose tokens start with one of them (a
    conversation's next turn) copies it and indexes only the rest.
    """

    KEEP = 2

    def __init__(self, inner: DraftSource, orders: Sequence[int] = ORDERS):
        self.inner = inner
        self.orders = tuple(orders)
        self._kept: List[NgramIndex] = []
        self.resumed = 0  # tokens the last new index took from a kept one (0: indexed anew)
        self.block_size = inner.block_size
        self.vocab_size = inner.vocab_size

    def new_state(self):
        return {"inner": self.inner.new_state(), "index": None}  # made at the first `commit`

    def add_context(self, state, hidden):
        self.inner.add_context(state["inner"], hidden)

    def arrays(self, state):
        return self.inner.arrays(state["inner"])

    def horizon(self, state):
        return self.inner.horizon(state["inner"])

    def skip(self, state, n):
        self.inner.skip(state["inner"], n)

    def reusable(self, state, n, total):
        return self.inner.reusable(state["inner"], n, total)

    def propose(self, state, last, hidden, width):
        return self.inner.propose(state["inner"], last, hidden, width)

    def propose_path(self, state, *args):
        return self.inner.propose_path(state["inner"], *args)

    def rewind(self, state, n):
        self.inner.rewind(state["inner"], n)

    def pooled(self):
        return self.inner.pooled()

    def context(self, state):
        return self.inner.context(state["inner"])

    def save(self, state):
        if state["index"] is not None:
            kept = [i for i in self._kept if i is not state["index"]] + [state["index"]]
            self._kept = kept[-self.KEEP:]
        return self.inner.save(state["inner"])

    def restore(self, saved):
        return {"inner": self.inner.restore(saved), "index": None}

    def index_for(self, tokens: List[int]) -> NgramIndex:
        """An index of `tokens`: the longest kept one they start with, copied and extended, or a new one."""
        best = max((i for i in self._kept if len(i.tokens) <= len(tokens) and tokens[: len(i.tokens)] == i.tokens),
                   key=lambda i: len(i.tokens), default=None)
        self.resumed = 0 if best is None else len(best.tokens)
        if best is None:
            return NgramIndex(tokens, orders=self.orders)
        out = best.copy()
        out.extend(tokens[len(best.tokens):])
        return out

    def commit(self, state, tokens):
        if state["index"] is None:  # the prompt (and the first token)
            state["index"] = self.index_for(list(tokens))
        else:
            state["index"].extend(tokens)
        self.inner.commit(state["inner"], tokens)

    def offer(self, state, limit):
        return state["index"].propose(limit)

    def may_offer(self, state):
        return state["index"].may_propose_next()


def point_masses(tokens: mx.array, vocab_size: int) -> mx.array:
    """Log probabilities [n, V] of drafts that are certain (a lookup's): 0 at the token, -inf elsewhere.

    Exact speculative sampling then accepts token x with probability p(x) and
    at a rejection draws from p with x removed.
    """
    hit = mx.arange(vocab_size)[None] == tokens[:, None]
    return mx.where(hit, 0.0, -mx.inf).astype(mx.float32)
