"""Reuse of computed prompt prefixes across requests.

A `PromptCache` belongs to one pair. After a request it keeps the target's
caches and the drafter's committed context, keyed by the tokens they hold;
the next request starts from the longest kept prefix of its prompt and
prefills only the rest. The prefix search is mlx-lm's `PromptTrie`, with its
`LRUPromptCache`'s choice of entry (`adapter.nearest_prefix`) and trimming; the bound (entries
and bytes, least recently stored or used first) is `_Lru`'s, which also hands
what it evicts to the disk tier. An entry is the target's cache list followed
by the draft source's saved context (`DraftSource.save`).

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
from collections import OrderedDict
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from ..target.adapter import nearest_prefix
from ..errors import DFlashError
from ..hub import cache_root
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


class _Entry(NamedTuple):
    cache: list
    nbytes: int
    kind: str  # "user": kept at the end of a prompt; "assistant": at the end of an answer


class _Lru:
    """Entries in a `PromptTrie`, at most `max_entries` of them and `max_bytes`;
    the least recently stored or used go first, into `evicted` as (model,
    tokens, entry). A trimmable entry replaces the entries of its prefixes,
    which it serves as well."""

    def __init__(self, max_entries: int, max_bytes: int, evicted: list):
        self.max_entries, self.max_bytes, self.evicted = max_entries, max_bytes, evicted
        self.trie = PromptTrie()
        self.order = OrderedDict()  # (model, tuple of tokens), least recent first
        self.nbytes = 0

    def __len__(self):
        return len(self.order)

    def insert(self, model, tokens: List[int], cache: list, kind: str = "assistant") -> None:
        entry = _Entry(cache, sum(c.nbytes for c in cache), kind)
        prev = self.trie.add(model, tokens, entry)
        if prev is not None:
            self.nbytes -= prev.nbytes
        self.nbytes += entry.nbytes
        self.order[(model, tuple(tokens))] = None
        self.order.move_to_end((model, tuple(tokens)))
        if can_trim_prompt_cache(cache):
            for n, old in self.trie.pop_prefixes(model, tokens):
                self.nbytes -= old.nbytes
                del self.order[(model, tuple(tokens[:n]))]
        self.trim_to(self.max_entries, self.max_bytes)

    def trim_to(self, entries: int, nbytes: int) -> None:
        while self.order and (len(self.order) > entries or self.nbytes > nbytes):
            (model, tokens), _ = self.order.popitem(last=False)
            entry = self.trie.pop(model, list(tokens))
            self.nbytes -= entry.nbytes
            self.evicted.append((model, list(tokens), entry))

    def holds(self, model, tokens: List[int]) -> bool:
        return (model, tuple(tokens)) in self.order

    def nearest(self, model, tokens: List[int]):
        """(a copy of the cache of the nearest entry, trimmed to the prefix it serves, the
        tokens left to run), or (None, tokens)."""
        n, found = nearest_prefix(self.trie, model, tokens, lambda e: can_trim_prompt_cache(e.cache))
        if found is None:
            return None, tokens
        self.order.move_to_end((model, tuple(found)))
        cache = copy.deepcopy(self.trie.get(model, found).cache)
        if len(found) > n:
            trim_prompt_cache(cache, len(found) - n)
        return cache, tokens[n:]


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
        self._lru = _Lru(max_entries, max_bytes, self._evicted)
        self._n_target = len(pair.target.make_cache())
        self._sources = {}  # keeps the draft sources keyed by id alive
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0
        self.disk: Optional[PromptStore] = None
        if disk_bytes > 0:
            key = model_key(pair)
            folder = Path(disk_dir) if disk_dir else cache_root() / "prompt-cache"
            layout = [type(c).__name__ for c in pair.target.make_cache()]
            layout += ["ContextRows"] * len(pair.drafter.make_cache())
            self.disk = PromptStore(folder / key, key, disk_bytes, _Exact, layout)
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
        """`_Lru.nearest` over both tiers: a longer prefix on disk is read into memory first."""
        if self._on_disk(key):
            ram, _ = nearest_prefix(self._lru.trie, key, query, lambda e: can_trim_prompt_cache(e.cache))
            n, tokens = nearest_prefix(self.disk.trie, self.disk.key, query, lambda f: f.trimmable)
            if n > ram:
                loaded = self.disk.load(tokens)
                if loaded is not None:
                    objs, kind = loaded
                    if sum(o.nbytes for o in objs) > self._lru.max_bytes:  # too big to keep in memory
                        alone = _Lru(1, sum(o.nbytes for o in objs), [])
                        alone.insert(key, tokens, objs)
                        return alone.nearest(key, query)
                    self._lru.insert(key, tokens, objs, kind)
        return self._lru.nearest(key, query)

    def _key(self, target, source):
        if target is not self.pair_target:
            raise DFlashError("This prompt cache belongs to another model; make one PromptCache per pair.")
        self._sources.setdefault(id(source), source)
        return id(source)

    def reach(self, target, source, prompt: Sequence[int]) -> int:
        """How many tokens of `prompt` a `fetch` would start from (nothing is copied or read)."""
        key, query = self._key(target, source), list(prompt)
        n, _ = nearest_prefix(self._lru.trie, key, query, lambda e: can_trim_prompt_cache(e.cache))
        if self._on_disk(key):
            n = max(n, nearest_prefix(self.disk.trie, self.disk.key, query, lambda f: f.trimmable)[0])
        return n

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
        target_cache = [c.cache if isinstance(c, _Exact) else c for c in entry[: self._n_target]]
        state = source.restore(entry[self._n_target :])
        # Rows a long prompt's prefill skipped are missing from the drafter's context: where the
        # first draft would read them, the prefix is cut back and they run again.
        m = source.reusable(state, reused, len(prompt))
        if m < reused and can_trim(target_cache):
            if m == 0:
                self.misses += 1
                return target.make_cache(), source.new_state(), 0
            trim_prompt_cache(target_cache, reused - m)
            source.rewind(state, reused - m)
            reused = m
        self.hits += 1
        self.cached_tokens += reused
        return target_cache, state, reused

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
            self._lru.insert(key, list(tokens[:n]), _keep(early) + rows, "user")
        self._lru.insert(key, list(tokens), _keep(cache) + list(saved), "assistant")
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
            if self._on_disk(key) and not self._lru.holds(key, tokens):  # not kept again since
                written += self.disk.save(tokens, entry.cache, entry.kind)
        return written

    def spill(self) -> int:
        """Move every entry in memory to disk (e.g. when the server stops); how many were written."""
        if self.disk is None:
            return 0
        self._lru.trim_to(0, 0)
        return self.flush()
