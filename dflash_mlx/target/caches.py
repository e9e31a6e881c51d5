"""Target caches that can be rolled back exactly, and the rule deciding which
mlx-lm cache types (and so which model families) the adapter supports.

Per cache type, after a verify pass the target keeps only the accepted prefix:

- `KVCache`: the offset moves back (no copy); after a tree pass the accepted
  branch's rows are moved in place first (`keep_rows`).
- `RotatingKVCache` (sliding-window layers, e.g. Gemma 4, gpt-oss): replaced by
  `WindowCache`, a ring buffer holding `slack` rows beyond the window, so the
  rows a crop uncovers are still there; the offset moves back (no copy) and
  the mask hides every row older than the window.
- `ArraysCache` of a Gated DeltaNet mixer (qwen3_5, qwen3_next): the update
  tape (see `adapter.TapedGatedDeltaNet`).
- Anything else (Mamba, other recurrent or chunked caches) is refused.

Only mlx-lm's cache module and model sources are read here; the adapter is
the only caller.
"""

import ast
import functools
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.base import create_causal_mask

# The default rows kept beyond a sliding window: the widest verify pass the
# loop runs (a drafter block of 16); a wider recorded pass grows it.
DEFAULT_SLACK = 16

# Families whose tiny random models CI decodes against plain mlx-lm (tests/test_families.py
# checks this list against what it runs); the rule admits more, untested.
CI_TESTED = ("qwen3", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "gemma4", "gemma4_text",
             "gpt_oss")

# Gated DeltaNet projection layouts the update tape knows, by the attributes
# that identify them on a mixer instance.
GDN_LAYOUTS = {
    "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba"),
}
_GDN_COMMON = ("A_log", "dt_bias", "conv1d", "norm", "out_proj")


def gdn_layout(module) -> Optional[str]:
    """The Gated DeltaNet layout of a mixer instance, or None if it is not one the tape knows."""
    if not all(hasattr(module, a) for a in _GDN_COMMON):
        return None
    for name, attrs in GDN_LAYOUTS.items():
        if all(hasattr(module, a) for a in attrs):
            return name
    return None


class WindowCache(cache_lib.RotatingKVCache):
    """A sliding-window KV cache with `slack` rows beyond the window.

    Rows are stored at slot `position mod (window + slack)`. A pass of up to
    `slack + 1` rows writes in place and attends over the whole ring, with a
    mask that shows each query exactly the `window` positions mlx-lm's
    `RotatingKVCache` shows it (itself and the `window - 1` before): rows older
    than that, and rows a crop left behind, stay in the ring but are hidden.
    So the last `window + slack` positions are always intact and a crop of up
    to `slack` rows is exact by moving the offset alone: nothing is copied.
    A longer pass (a prefill chunk) attends, as mlx-lm's does, over the last
    `window - 1` rows followed by its own, and keeps its last rows in the ring.
    """

    def __init__(self, window: int, slack: int = DEFAULT_SLACK):
        super().__init__(max_size=window, keep=0)
        self.window = window
        self.slack = slack
        self.keys = self.values = None
        self.offset = 0
        self._floor = 0  # positions below this may be overwritten

    @property
    def capacity(self) -> int:
        return self.window + self.slack

    @classmethod
    def holding(cls, keys: mx.array, values: mx.array, start: int, window: int, slack: int) -> "WindowCache":
        """A cache whose last rows are `keys`/`values` [B, H, n, D], of positions start..start+n-1
        (n at most the capacity, and every position a query after them can see)."""
        c = cls(window, slack)
        c.offset = c._floor = start
        if keys.shape[2]:
            c.update_and_fetch(keys, values)
        return c

    def rows_from_zero(self):
        """(keys, values) [B, H, offset, D]: column p holds position p where the ring still
        has it (every position a later query can see), zeros before."""
        kept = min(self.offset - self._floor, self.capacity, self.offset)
        start = self.offset - kept
        k, v = self._read(self.keys, start, kept), self._read(self.values, start, kept)
        if start == 0:
            return k, v
        B, H, _, D = k.shape
        return (mx.concatenate([mx.zeros((B, H, start, D), k.dtype), k], axis=2),
                mx.concatenate([mx.zeros((B, H, start, v.shape[3]), v.dtype), v], axis=2))

    # -- layout -----------------------------------------------------------

    def _mode(self, n: int) -> str:
        if self.offset + n <= self.capacity:
            return "linear"  # nothing is overwritten: slot = position
        return "ring" if n <= self.slack + 1 else "long"

    def _write(self, buf, start: int, rows):
        """Write `rows` (positions start..) into the ring `buf` at slot position mod capacity."""
        M = self.capacity
        n = rows.shape[2]
        s = start % M
        first = min(n, M - s)
        buf[..., s : s + first, :] = rows[..., :first, :]
        if first < n:
            buf[..., : n - first, :] = rows[..., first:, :]

    def _read(self, buf, start: int, n: int):
        """Rows of positions start..start+n-1 (all in the ring), in order."""
        M = self.capacity
        s = start % M
        if s + n <= M:
            return buf[..., s : s + n, :]
        return mx.concatenate([buf[..., s:, :], buf[..., : s + n - M, :]], axis=2)

    def _reserve(self, keys, values, rows: int):
        """Grow the buffers (linear phase: slot = position) to hold `rows` rows."""
        size = 0 if self.keys is None else self.keys.shape[2]
        if rows <= size:
            return
        new = min(self.capacity, -(-rows // self.step) * self.step)
        B, H, _, Dk = keys.shape
        grow_k = mx.zeros((B, H, new - size, Dk), keys.dtype)
        grow_v = mx.zeros((B, H, new - size, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = grow_k, grow_v
        else:
            self.keys = mx.concatenate([self.keys, grow_k], axis=2)
            self.values = mx.concatenate([self.values, grow_v], axis=2)

    def grow_slack(self, slack: int):
        """Keep at least `slack` rows beyond the window from now on (one copy of
        the ring, where it already wrapped; only for passes wider than ever)."""
        if slack <= self.slack:
            return
        if self.keys is None or self.offset <= self.keys.shape[2] and self.offset <= self.capacity:
            self.slack = slack  # linear so far: positions are slots in any larger ring
            return
        kept = min(self.offset - self._floor, self.capacity)
        start = self.offset - kept
        k, v = self._read(self.keys, start, kept), self._read(self.values, start, kept)
        self.slack = slack
        B, H, _, Dk = self.keys.shape
        keys = mx.zeros((B, H, self.capacity, Dk), self.keys.dtype)
        values = mx.zeros((B, H, self.capacity, self.values.shape[3]), self.values.dtype)
        self._write(keys, start, k)
        self._write(values, start, v)
        self.keys, self.values = keys, values

    # -- mlx-lm's cache interface -------------------------------------------

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        E = self.offset
        mode = self._mode(n)
        if mode == "linear":
            self._reserve(keys, values, E + n)
            self.keys[..., E : E + n, :] = keys
            self.values[..., E : E + n, :] = values
            self.offset = E + n
            return self.keys[..., : E + n, :], self.values[..., : E + n, :]
        self._reserve(keys, values, self.capacity)
        if mode == "ring":
            self._write(self.keys, E, keys)
            self._write(self.values, E, values)
            out = self.keys, self.values
        else:
            old = min(E, self.window - 1)
            out = (
                mx.concatenate([self._read(self.keys, E - old, old), keys], axis=2),
                mx.concatenate([self._read(self.values, E - old, old), values], axis=2),
            )
            M = self.capacity
            if n > M:  # only the last M positions fit
                E, keys, values = E + n - M, keys[..., -M:, :], values[..., -M:, :]
            self._write(self.keys, E, keys)
            self._write(self.values, E, values)
            E = self.offset
        self.offset = E + n
        self._floor = max(self._floor, self.offset - self.capacity)
        return out

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask for a pass of N rows, given before `update_and_fetch` (as mlx-lm asks for it)."""
        W = window_size or self.window
        E = self.offset
        mode = self._mode(N)
        if mode == "linear":
            if E + N > W or return_array:
                return create_causal_mask(N, E, window_size=W)
            return "causal" if N > 1 else None
        if mode == "long":
            return create_causal_mask(N, min(E, self.window - 1), window_size=W)
        # Ring: slot s holds the latest position p < E + N with p = s (mod capacity).
        M = self.capacity
        last = E + N - 1
        held = last - mx.remainder(last - mx.arange(M), M)
        query = mx.arange(E, E + N)[:, None]
        return (held <= query) & (held > query - W) & (held >= 0)

    def keys_and_values(self):
        if self.offset <= self.capacity:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def size(self):
        return min(self.offset, self.window)

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        self.keys, self.values = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.window, self.slack, self.offset, self._floor)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.slack, self.offset, self._floor = map(int, v)
        self.max_size, self.keep = self.window, 0

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n positions; exact while the window before the new end is intact."""
        n = min(self.offset, n)
        if max(0, self.offset - n - self.window + 1) < self._floor:
            raise ValueError(
                f"Cannot crop {n} rows of a sliding-window cache with {self.slack} rows of slack."
            )
        self.offset -= n
        return n

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


# -- the rule, per cache instance -------------------------------------------

def keep_rows(cache, rows, width: int) -> None:
    """After a tree pass over `width` tokens, keep the K/V rows of tokens
    `rows` (ascending) as the pass's first rows and drop the others.

    Only rows out of place are copied, one slice per contiguous run. The
    copy is evaluated on its own first: a slice update whose source is a
    view of the same buffer would copy the whole cache."""
    moves, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        if rows[i] != i:
            moves.append((i, rows[i], j + 1 - i))
        i = j + 1
    bases = [c.offset - width for c in cache]
    parts = [[(mx.contiguous(c.keys[..., b + s : b + s + n, :]), mx.contiguous(c.values[..., b + s : b + s + n, :]))
              for _, s, n in moves] for c, b in zip(cache, bases)]
    if moves:
        mx.async_eval(parts)
    for c, b, layer_parts in zip(cache, bases, parts):
        for (d, _, n), (k, v) in zip(moves, layer_parts):
            c.keys[..., b + d : b + d + n, :] = k
            c.values[..., b + d : b + d + n, :] = v
        c.offset = b + len(rows)


def rollback_kind(cache, mixer=None) -> Optional[str]:
    """How a cache of the target is rolled back: "offset" (KVCache), "window"
    (RotatingKVCache, replaced by a WindowCache), "tape" (the ArraysCache of a
    Gated DeltaNet mixer the tape knows), or None: it cannot be."""
    t = type(cache)
    if t is cache_lib.KVCache:
        return "offset"
    if t is cache_lib.RotatingKVCache and cache.keep == 0:
        return "window"
    if t is cache_lib.ArraysCache and mixer is not None and gdn_layout(mixer) is not None:
        return "tape"
    return None


# -- the rule, per model family (read from mlx-lm's sources) -----------------

_MODELS = Path(cache_lib.__file__).parent
_CACHE_TYPES = {
    name for name, obj in vars(cache_lib).items() if isinstance(obj, type) and name.endswith("Cache")
}
_NOT_FAMILIES = {"base", "cache", "rope_utils", "switch_layers", "activations", "gated_delta", "pipeline",
                 "bitlinear_layers", "mla", "ssm", "__init__"}


def _imported_modules(tree: ast.Module) -> List[str]:
    """Sibling model modules a module imports (`from .x import ...`, `from . import x`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.append(node.module)
            else:
                out += [a.name for a in node.names]
    return [m for m in out if m not in _NOT_FAMILIES and (_MODELS / f"{m}.py").exists()]


@functools.lru_cache(maxsize=None)
def _parse(name: str) -> ast.Module:
    return ast.parse((_MODELS / f"{name}.py").read_text())


def _chain(name: str) -> List[ast.Module]:
    seen, todo, trees = set(), [name], []
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        tree = _parse(m)
        trees.append(tree)
        todo += _imported_modules(tree)
    return trees


def _self_attrs(cls: ast.ClassDef) -> set:
    return {
        t.attr for node in ast.walk(cls) if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def family_verdict(model_type: str) -> Tuple[bool, str]:
    """Whether the adapter supports an mlx-lm model family, and why (or why not).

    Read from the family's source (and the model modules it imports): the
    cache types its `make_cache` builds (none: mlx-lm's default `KVCache`),
    each of which must have a rollback rule, and the standard layout the
    adapter taps (`embed_tokens`, decoder `layers`, a final `norm`).
    """
    try:
        from mlx_lm.utils import MODEL_REMAPPING
    except ImportError:  # pragma: no cover
        MODEL_REMAPPING = {}
    name = MODEL_REMAPPING.get(model_type, model_type)
    if name in _NOT_FAMILIES or not (_MODELS / f"{name}.py").exists():
        return False, f"mlx-lm has no model family '{model_type}'"
    try:
        trees = _chain(name)
    except (OSError, SyntaxError) as e:  # pragma: no cover
        return False, f"cannot read mlx-lm's {name}.py ({e})"
    classes = [c for t in trees for c in ast.walk(t) if isinstance(c, ast.ClassDef)]
    used, keeps = set(), []
    for t in trees:
        for f in ast.walk(t):
            if isinstance(f, ast.FunctionDef) and f.name == "make_cache":
                for node in ast.walk(f):
                    ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
                    if ident in _CACHE_TYPES:
                        used.add(ident)
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RotatingKVCache":
                        keeps += [k.value for k in node.keywords if k.arg == "keep"]
    if not any(isinstance(f, ast.FunctionDef) and f.name == "make_cache" for t in trees for f in ast.walk(t)):
        used = {"KVCache"}
    if not used:
        return False, "its make_cache builds no cache type the adapter knows"
    refused = sorted(used - {"KVCache", "RotatingKVCache", "ArraysCache"})
    if refused:
        return False, f"its layers use {', '.join(refused)}, which cannot be rolled back exactly"
    if "RotatingKVCache" in used and any(not (isinstance(k, ast.Constant) and k.value == 0) for k in keeps):
        return False, "its RotatingKVCache keeps leading tokens (keep > 0), which the window cache does not"
    if "ArraysCache" in used:
        gdn = any(all(a in _self_attrs(c) for a in _GDN_COMMON + attrs_)
                  for c in classes for attrs_ in GDN_LAYOUTS.values())
        if not gdn:
            return False, "its recurrent layers (ArraysCache) are not a Gated DeltaNet the update tape knows"
    attrs = set().union(*(_self_attrs(c) for c in classes)) if classes else set()
    missing = [a for a in ("embed_tokens", "layers", "norm") if a not in attrs]
    if missing:
        return False, f"its model has no {'/'.join(missing)} (the layout the adapter taps)"
    kinds = {"KVCache": "KV cache (offset)", "RotatingKVCache": "sliding window (window cache)",
             "ArraysCache": "Gated DeltaNet (update tape)"}
    return True, ", ".join(kinds[u] for u in sorted(used))


def supported_families() -> Dict[str, str]:
    """Every mlx-lm model family the rule admits, with the rollback each cache type gets."""
    out = {}
    for f in sorted(_MODELS.glob("*.py")):
        if f.stem in _NOT_FAMILIES:
            continue
        ok, why = family_verdict(f.stem)
        if ok:
            out[f.stem] = why
    return out
