"""Reuse of computed prompt prefixes across requests.

A `PromptCache` belongs to one pair. After a request it keeps the target's
caches and the drafter's committed context, keyed by the tokens they hold;
the next request starts from the longest kept prefix of its prompt and
prefills only the rest. Storage, the prefix search, trimming and the byte
bound are mlx-lm's `LRUPromptCache`; an entry is the target's cache list
followed by the draft source's saved context (`DraftSource.save`).

Attention caches are trimmed to any shorter prefix. Recurrent states (Gated
DeltaNet) cannot be trimmed, so for such targets a snapshot is kept where a
later request is likely to branch: at the end of the prompt and at the end
of the answer. Output is exactly that of a cold run: the rows reused are the
rows a cold run computes.
"""

import copy
from typing import List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, RotatingKVCache, trim_prompt_cache

from .errors import DFlashError


def can_trim(cache: List) -> bool:
    """Whether every layer's cache can be trimmed back to any shorter prefix: a
    sliding window keeps only a few rows beyond its window, a recurrent state none."""
    return all(c.is_trimmable() and not isinstance(c, RotatingKVCache) for c in cache)


class _Exact:
    """A kept layer cache usable only for its whole prefix (never trimmed)."""

    def __init__(self, cache):
        self.cache = cache

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


def _keep(cache: List) -> List:
    return [c if can_trim([c]) else _Exact(c) for c in cache]


def snapshot(cache: List) -> List:
    """A copy of `cache` that later updates of `cache` leave alone, without copying data.

    Slicing gives new array objects over the same buffers, so the live cache's
    in-place writes (which rebind its own arrays) do not reach the snapshot.
    """
    def fresh(x):
        if isinstance(x, mx.array):
            return x[...]
        if isinstance(x, (list, tuple)):
            return type(x)(fresh(v) for v in x)
        return x

    out = []
    for c in cache:
        copy = type(c).from_state(fresh(c.state))
        if hasattr(c, "meta_state"):
            copy.meta_state = c.meta_state
        out.append(copy)
    return out


class PromptCache:
    """Target caches and drafter context of earlier requests, bounded by bytes (LRU).

    Pass it to `stream_generate(..., prompt_cache=...)` (the server keeps one).
    It is never shared between pairs: using it with another pair's model or
    draft source is an error.
    """

    def __init__(self, pair, max_bytes: int = 4 << 30, max_entries: int = 64):
        self.pair_target = pair.target
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self._n_target = len(pair.target.make_cache())
        self._sources = {}  # keeps the draft sources keyed by id alive
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0

    def __len__(self):
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def _key(self, target, source):
        if target is not self.pair_target:
            raise DFlashError("This prompt cache belongs to another model; make one PromptCache per pair.")
        self._sources.setdefault(id(source), source)
        return id(source)

    def fetch(self, target, source, prompt: Sequence[int]):
        """(target cache, draft state, tokens reused) for `prompt`; at least its last token is left to run."""
        key = self._key(target, source)
        query = list(prompt)
        entry, rest = self._lru.fetch_nearest_cache(key, query)
        if entry is not None and not rest:  # all of it is kept: its last token runs again
            if can_trim([c.cache if isinstance(c, _Exact) else c for c in entry]):
                trim_prompt_cache(entry, 1)
                rest = query[-1:]
            else:
                query = query[:-1]
                entry, rest = self._lru.fetch_nearest_cache(key, query)
        if entry is None:
            self.misses += 1
            return target.make_cache(), source.new_state(), 0
        reused = len(query) - len(rest)
        self.hits += 1
        self.cached_tokens += reused
        target_cache = [c.cache if isinstance(c, _Exact) else c for c in entry[: self._n_target]]
        return target_cache, source.restore(entry[self._n_target :]), reused

    def store(self, target, source, state, tokens: Sequence[int], cache: List, at_prompt=None) -> bool:
        """Keep `cache` (the rows of `tokens`) with the source's context, and
        `at_prompt` ((length, `snapshot` of the cache holding that many prompt
        tokens)) where the target's cache cannot be trimmed back to the prompt."""
        saved = source.save(state)
        if saved is None or not tokens:
            return False
        key = self._key(target, source)
        if at_prompt is not None and at_prompt[0] > 0:
            n, early = at_prompt
            rows = [copy.copy(r) for r in saved]
            for r in rows:
                r.trim(len(tokens) - n)
            self._lru.insert_cache(key, list(tokens[:n]), _keep(early) + rows, cache_type="user")
        self._lru.insert_cache(key, list(tokens), _keep(cache) + list(saved), cache_type="assistant")
        return True
