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

With a disk tier (`disk_bytes`, `prompt_store.PromptStore`), entries the
memory bound evicts are written to files under the cache folder, one folder
per model key, when the request that evicted them has finished (`store`, or
`flush`); a later request whose longest kept prefix is on disk, longer than
any in memory, reads it back into memory. `spill` writes everything (at
shutdown), so a restarted server starts from what an earlier one kept.
"""

import copy
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (LRUPromptCache, PromptTrie, RotatingKVCache, can_trim_prompt_cache,
                                 trim_prompt_cache)

from .errors import DFlashError
from .hub import cache_root
from .prompt_store import PromptStore, model_key


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


class _EvictingTrie(PromptTrie):
    """mlx-lm's trie; an entry the LRU evicts (`pop`) is also kept in `evicted`."""

    def __init__(self, evicted: list):
        super().__init__()
        self.evicted = evicted

    def pop(self, model, tokens):
        value = super().pop(model, tokens)
        self.evicted.append((model, list(tokens), value))
        return value


def _reach(trie: PromptTrie, model, tokens: List[int], trimmable):
    """(tokens reused, tokens of the entry used) for `tokens` by the choice
    `LRUPromptCache.fetch_nearest_cache` makes over `trie`."""
    r = trie.search(model, tokens)
    if r.exact is not None:
        return len(tokens), r.exact
    short = len(r.shorter) if r.shorter is not None else 0
    if r.longer is not None and r.common_prefix > short and trimmable(trie.get(model, r.longer)):
        return min(len(tokens) - 1, r.common_prefix), r.longer
    return (short, r.shorter) if short else (0, None)


class PromptCache:
    """Target caches and drafter context of earlier requests, bounded by bytes (LRU).

    Pass it to `stream_generate(..., prompt_cache=...)` (the server keeps one).
    It is never shared between pairs: using it with another pair's model or
    draft source is an error. With `disk_bytes` > 0, evicted entries of the
    pair's own draft source go to files under `disk_dir` (default: the cache
    folder's prompt-cache/), in a folder keyed by the model, at most
    `disk_bytes` of them (LRU).
    """

    def __init__(self, pair, max_bytes: int = 4 << 30, max_entries: int = 64, disk_bytes: int = 0,
                 disk_dir: Optional[str] = None):
        self.pair_target = pair.target
        self._evicted = []
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self._lru._trie = _EvictingTrie(self._evicted)
        self._n_target = len(pair.target.make_cache())
        self._sources = {}  # keeps the draft sources keyed by id alive
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0
        self.disk: Optional[PromptStore] = None
        if disk_bytes > 0:
            key = model_key(pair)
            folder = Path(disk_dir) if disk_dir else cache_root() / "prompt-cache"
            self.disk = PromptStore(folder / key, key, disk_bytes, _Exact)
            self._disk_source = pair.draft_source
            self._sources[id(pair.draft_source)] = pair.draft_source

    def __len__(self):
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def _on_disk(self, key) -> bool:
        return self.disk is not None and key == id(self._disk_source)

    def _nearest(self, key, query: List[int]):
        """`fetch_nearest_cache` over both tiers: a longer prefix on disk is read into memory first."""
        if self._on_disk(key):
            ram, _ = _reach(self._lru._trie, key, query, lambda e: can_trim_prompt_cache(e.prompt_cache))
            n, tokens = _reach(self.disk.trie, self.disk.key, query, lambda f: f.trimmable)
            if n > ram:
                loaded = self.disk.load(tokens)
                if loaded is not None:
                    objs, cache_type = loaded
                    if sum(o.nbytes for o in objs) > self._lru.max_bytes:  # too big to keep in memory
                        lru = LRUPromptCache(max_size=1)
                        lru.insert_cache(key, tokens, objs)
                        return lru.fetch_nearest_cache(key, query)
                    self._lru.insert_cache(key, tokens, objs, cache_type=cache_type)
        return self._lru.fetch_nearest_cache(key, query)

    def _key(self, target, source):
        if target is not self.pair_target:
            raise DFlashError("This prompt cache belongs to another model; make one PromptCache per pair.")
        self._sources.setdefault(id(source), source)
        return id(source)

    def fetch(self, target, source, prompt: Sequence[int]):
        """(target cache, draft state, tokens reused) for `prompt`; at least its last token is left to run."""
        key = self._key(target, source)
        query = list(prompt)
        entry, rest = self._nearest(key, query)
        if entry is not None and not rest:  # all of it is kept: its last token runs again
            if can_trim([c.cache if isinstance(c, _Exact) else c for c in entry]):
                trim_prompt_cache(entry, 1)
                rest = query[-1:]
            else:
                query = query[:-1]
                entry, rest = self._nearest(key, query)
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
        self.flush()
        return True

    def flush(self) -> int:
        """Write the entries memory evicted since the last call to disk (those
        of the disk's model; others are dropped); how many were written.

        `store` calls it, so writes happen when a request has finished: after
        its last token is handed over, before the next request starts."""
        evicted, self._evicted[:] = list(self._evicted), []
        written = 0
        for key, tokens, entry in evicted:
            if self._on_disk(key) and self._lru_lacks(key, tokens):
                written += self.disk.save(tokens, entry.prompt_cache, entry.cache_type)
        return written

    def spill(self) -> int:
        """Move every entry in memory to disk (e.g. when the server stops); how many were written."""
        if self.disk is None:
            return 0
        self._lru.trim_to(n_sequences=0)
        return self.flush()

    def _lru_lacks(self, key, tokens) -> bool:
        try:
            self._lru._trie.get(key, tokens)
            return False  # evicted, then kept again since
        except KeyError:
            return True
