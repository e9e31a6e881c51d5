"""The prompt cache's disk tier: entries the memory tier evicts, kept as files.

One folder per model key (`model_key`: everything the cached state depends
on), one safetensors file per entry: its arrays written by MLX, and in the
file's metadata the tokens it holds, how to rebuild each layer (class,
non-array state, `meta_state`, whether it is usable only whole) and the key,
checked again on load. The index (tokens -> file) is rebuilt at start from
the files' headers, so a restarted server reuses what an earlier one wrote;
files are evicted least recently used first beyond the byte bound.

A file is written under a temporary name and renamed, so an entry is whole
or absent. Each carries a sha256 of its tokens, layer descriptions and
arrays; on loading, the checksum, the model's cache layout, every offset
against the entry's tokens and the arrays' finiteness are checked, and an
entry that fails any of them is removed with one warning (the request then
runs cold). Anything in the folder that is not a regular file is left alone.
"""

import hashlib
import json
import os
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.cache import PromptTrie

from ..target.adapter import cache_classes
from ..draft.source import ContextRows
from ..draft.drafter import DraftCache
from ..errors import DFlashError, DFlashWarning
from ..target.caches import WindowCache

FORMAT = "dflash-mlx-prompt-cache/2"  # 2: a checksum in every entry
_SUFFIX = ".safetensors"
_TMP = ".tmp" + _SUFFIX
_STALE_TMP_S = 600  # a temporary file this old is left over from a crash

# Cache classes an entry may hold, by name (never resolved from anything else).
_CLASSES = {**cache_classes(), "WindowCache": WindowCache}


class PromptStoreWarning(DFlashWarning):
    """A file of the disk tier skipped or not written; the cache goes on without it."""


def _fingerprint(path) -> List[str]:
    path = Path(path).resolve()
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    return [str(path)] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]


def model_key(pair) -> str:
    """What a cached state depends on: both models' files (path, sizes, times; a
    Hub snapshot's path holds its revision), the drafter conversion, quantization, dtypes, cache layout,
    drafter context bound, draft source, backend, MLX, mlx-lm and BLAS."""
    import mlx_lm

    from ..machine import blas_name
    from ..config import CONVERSION

    if pair.target_path is None or pair.draft_path is None:
        raise DFlashError("The prompt cache's disk tier needs a pair loaded from files (dflash_mlx.load); "
                          "set disk_bytes=0 for this one.")
    source = pair.draft_source
    parts = [FORMAT, str(CONVERSION), *_fingerprint(pair.target_path), *_fingerprint(pair.draft_path),
             json.dumps(pair.target.quantization, sort_keys=True),
             json.dumps(pair.drafter.args.quantization, sort_keys=True), str(pair.target.dtype),
             str(sorted({str(v.dtype) for _, v in tree_flatten(pair.drafter.parameters())})),
             str([type(c).__name__ for c in pair.target.make_cache()]), str(pair.drafter.context_bound),
             type(source).__name__, type(getattr(source, "inner", source)).__name__,
             str(mx.default_device()), mx.__version__, mlx_lm.__version__, blas_name()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


# -- one entry <-> arrays and metadata -----------------------------------------

# A position, offset or size in an entry's metadata beyond this is damage.
MAX_POSITION = 2**31 - 1


def checksum(tokens: Sequence[int], layers: list, arrays: dict) -> str:
    """sha256 of an entry: its tokens, layer descriptions and every array's name,
    dtype, shape and bytes (row-major, as the file stores them)."""
    h = hashlib.sha256(json.dumps([list(tokens), layers]).encode())
    names = sorted(arrays)
    values = [mx.contiguous(arrays[k]) for k in names]
    mx.eval(values)
    for k, v in zip(names, values):
        h.update(f"|{k}|{v.dtype}|{v.shape}|".encode())
        h.update(memoryview(v))
    return h.hexdigest()


def _position(value, most: int = MAX_POSITION) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ValueError(f"a position of {str(value)[:20]}")
    return value


def check_entry(tokens: Sequence[int], layers, arrays: dict, layout: Sequence[str]) -> None:
    """ValueError unless the entry has the model's layout (`layout`: its target
    caches' classes, then drafter layers) and every offset fits its tokens."""
    if not isinstance(layers, list) or len(layers) != len(layout):
        raise ValueError(f"{len(layers) if isinstance(layers, list) else 'no'} layers for a model with {len(layout)}")
    n = len(tokens)
    for i, (layer, want) in enumerate(zip(layers, layout)):
        if not isinstance(layer, dict):
            raise ValueError(f"layer {i} is not described")
        mine = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.split(".", 1)[0] == str(i)}
        if want == "ContextRows":
            rows = layer.get("rows")
            if not isinstance(rows, list) or len(rows) != 5:
                raise ValueError(f"layer {i} is not a drafter layer")
            window, bound, offset, start, holes = rows
            if window is not None:
                _position(window)
            if bound is not None and (not isinstance(bound, list) or len(bound) != 2):
                raise ValueError(f"layer {i} has a malformed bound")
            for b in bound or []:
                _position(b)
            _position(offset, n)
            _position(start, offset)
            if not isinstance(holes, list) or any(not isinstance(h, list) or len(h) != 2 for h in holes):
                raise ValueError(f"layer {i} has malformed holes")
            for a, b in holes:
                _position(a, _position(b, offset))
            if layer.get("arrays"):
                keys = mine.get("keys")
                if keys is None or "values" not in mine or keys.ndim != 4 or keys.shape[2] < offset - start:
                    raise ValueError(f"layer {i} holds fewer rows than its offset")
            continue
        if layer.get("class") != want:
            raise ValueError(f"layer {i} is a {str(layer.get('class'))[:40]}, not a {want}")
        if not isinstance(layer.get("leaves", {}), dict) or not isinstance(layer.get("meta", []), list):
            raise ValueError(f"layer {i} is not described")
        for value in list(layer.get("leaves", {}).values()) + list(layer.get("meta", [])):
            if isinstance(value, str) and value.lstrip("-").isdigit() or isinstance(value, int) \
                    and not isinstance(value, bool):
                _position(int(value))
    floats = [v for v in arrays.values() if mx.issubdtype(v.dtype, mx.floating)]
    if floats and not mx.all(mx.stack([mx.all(mx.isfinite(v)) for v in floats])).item():
        raise ValueError("an array holds NaN or infinite values")

def encode(objs: Sequence, exact: type) -> Optional[Tuple[dict, list]]:
    """(arrays, layer descriptions) of an entry's layers, or None if one cannot be written.

    Target layers are mlx-lm caches (or ours), some wrapped in `exact` (usable
    only whole, `exact(cache).cache`); the drafter's are `ContextRows`."""
    arrays, layers = {}, []
    for i, o in enumerate(objs):
        if isinstance(o, ContextRows):
            c = o.cache
            if c.keys is not None:  # the whole buffer, as the memory tier keeps it
                arrays[f"{i}.keys"], arrays[f"{i}.values"] = c.keys, c.values
            layers.append({"rows": [c.window, c.bound, c.offset, c.start, [list(h) for h in c.holes]],
                           "arrays": c.keys is not None})
            continue
        whole = isinstance(o, exact)
        c = o.cache if whole else o
        name = type(c).__name__
        if _CLASSES.get(name) is not type(c):
            return None
        leaves = {}
        for path, v in tree_flatten(c.state):
            if isinstance(v, mx.array):
                arrays[f"{i}.{path}"] = v
            elif v is None or isinstance(v, (bool, int, float, str)):
                leaves[path] = v
            else:
                return None
        layer = {"class": name, "exact": whole, "leaves": leaves}
        if hasattr(c, "meta_state"):
            layer["meta"] = list(c.meta_state)
        layers.append(layer)
    return arrays, layers


def decode(arrays: dict, layers: list, exact: type) -> list:
    """The layers `encode` described, rebuilt through their own classes."""
    out = []
    for i, layer in enumerate(layers):
        mine = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.split(".", 1)[0] == str(i)}
        if "rows" in layer:
            window, bound, offset, start, *holes = layer["rows"]
            c = DraftCache(window, tuple(bound) if bound is not None else None)
            c.holes = tuple(tuple(h) for h in holes[0]) if holes else ()
            if layer["arrays"]:
                c.keys, c.values = mine["keys"], mine["values"]
            c.offset, c.start = offset, start
            out.append(ContextRows(c))
            continue
        flat = {**mine, **layer["leaves"]}
        state = tree_unflatten(list(flat.items())) if flat else []
        c = _CLASSES[layer["class"]].from_state(state)
        if "meta" in layer:
            c.meta_state = layer["meta"]
        out.append(exact(c) if layer["exact"] else c)
    return out


def check_offsets(tokens: Sequence[int], objs: list, exact: type) -> None:
    """ValueError unless every rebuilt target cache has seen at most the entry's tokens,
    and a full-attention one holds the rows its offset says."""
    for i, o in enumerate(objs):
        c = o.cache if isinstance(o, exact) else o
        if isinstance(c, ContextRows):
            continue
        offset = getattr(c, "offset", None)
        if offset is not None:
            _position(offset, len(tokens))
        if type(c) is cache_lib.KVCache and offset and (c.keys is None or c.keys.shape[2] < offset):
            raise ValueError(f"layer {i} holds fewer rows than its offset")


# -- the folder ----------------------------------------------------------------

@dataclass
class _File:
    name: str
    tokens: Tuple[int, ...]
    nbytes: int
    trimmable: bool
    cache_type: str


class PromptStore:
    """Prompt cache entries of one model under `folder`, at most `max_bytes` of files (LRU).

    `exact` is the wrapper marking a layer usable only for its whole prefix."""

    def __init__(self, folder, key: str, max_bytes: int, exact: type, layout: Sequence[str]):
        self.folder = Path(folder)
        self.key, self.max_bytes, self.exact, self.layout = key, max_bytes, exact, list(layout)
        self._files: "OrderedDict[str, _File]" = OrderedDict()  # least recently used first
        self._trie = PromptTrie()
        self.nbytes = 0
        self.hits = self.writes = self.evictions = 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DFlashError(f"Cannot create the prompt cache folder {self.folder} ({e.strerror}); "
                              "choose another with --prompt-cache-dir.")
        self._scan()

    def __len__(self):
        return len(self._files)

    def __contains__(self, tokens) -> bool:
        return _name(tokens) in self._files

    def _warn(self, path, why):
        warnings.warn(f"prompt cache: skipping {path} ({why}); it was removed.", PromptStoreWarning, stacklevel=3)
        _remove(path)

    def _scan(self):
        from safetensors import safe_open

        found = []
        for path in self.folder.iterdir():
            if path.name.endswith(_TMP):
                if time.time() - _mtime(path) > _STALE_TMP_S:
                    _remove(path)
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            if path.is_symlink() or not path.is_file():  # not ours: a FIFO would block the read
                warnings.warn(f"prompt cache: skipping {path} (not a regular file); it was left as it is.",
                              PromptStoreWarning, stacklevel=2)
                continue
            try:
                with safe_open(str(path), framework="numpy") as f:
                    meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("key") != self.key:
                    raise ValueError("written for another model or format")
                tokens = tuple(json.loads(meta["tokens"]))
                if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
                    raise ValueError("its tokens are not token ids")
                layers, cache_type = json.loads(meta["layers"]), meta["cache_type"]
                if not isinstance(layers, list) or not all(isinstance(l, dict) for l in layers):
                    raise ValueError("its layers are not described")
                if path.name != _name(tokens) + _SUFFIX:
                    raise ValueError("its name does not match its tokens")
                st = path.stat()
            except Exception as e:  # anything unreadable is skipped, never fatal
                self._warn(path, str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            trimmable = not any(l.get("exact") for l in layers)
            found.append((st.st_mtime, _File(path.stem, tokens, st.st_size, trimmable, cache_type)))
        for _, f in sorted(found, key=lambda x: x[0]):
            self._add(f)
        self._evict()

    def _add(self, f: _File):
        self._files[f.name] = f
        self._trie.add(self.key, list(f.tokens), f)
        self.nbytes += f.nbytes

    def _drop(self, f: _File, in_trie: bool = True):
        del self._files[f.name]
        if in_trie:
            self._trie.pop(self.key, list(f.tokens))
        self.nbytes -= f.nbytes
        _remove(self._path(f.name))

    def _path(self, name: str) -> Path:
        return self.folder / (name + _SUFFIX)

    def _evict(self):
        while self.nbytes > self.max_bytes and self._files:
            self._drop(next(iter(self._files.values())))
            self.evictions += 1

    @property
    def trie(self):
        """Tokens -> `_File` (its `trimmable`), for the prefix search."""
        return self._trie

    def save(self, tokens: Sequence[int], objs: Sequence, cache_type: str) -> bool:
        """Write an entry (evaluated arrays); False if it cannot be or does not fit."""
        tokens = tuple(tokens)
        name = _name(tokens)
        if name in self._files:
            try:
                os.utime(self._path(name))
                self._files.move_to_end(name)
                return True
            except OSError:  # removed behind our back: write it again
                self._drop(self._files[name])
        encoded = encode(objs, self.exact)
        if encoded is None:
            return False
        arrays, layers = encoded
        if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
            return False
        meta = {"format": FORMAT, "key": self.key, "tokens": json.dumps(list(tokens)),
                "layers": json.dumps(layers), "cache_type": cache_type,
                "sha256": checksum(tokens, layers, arrays)}
        path = self._path(name)
        tmp = self.folder / f"{name}.{os.getpid()}{_TMP}"
        try:
            mx.save_safetensors(str(tmp), arrays, meta)
            os.replace(tmp, path)
            size = path.stat().st_size
        except Exception as e:
            _remove(tmp)
            warnings.warn(f"prompt cache: cannot write {path} ({e}); the entry is kept in memory only.",
                          PromptStoreWarning, stacklevel=2)
            return False
        f = _File(name, tokens, size, not any(l.get("exact") for l in layers), cache_type)
        self._add(f)
        if f.trimmable:  # an entry that can be trimmed serves every prefix: those files are redundant
            for _, old in self._trie.pop_prefixes(self.key, list(tokens)):
                self._drop(old, in_trie=False)
        self.writes += 1
        self._evict()
        return True

    def load(self, tokens: Sequence[int]) -> Optional[Tuple[list, str]]:
        """(layers, cache type) of the entry holding `tokens`, or None if it cannot be read (then removed)."""
        f = self._files.get(_name(tokens))
        if f is None:
            return None
        path = self._path(f.name)
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            if meta.get("key") != self.key or tuple(json.loads(meta["tokens"])) != f.tokens:
                raise ValueError("written for another model or prompt")
            layers = json.loads(meta["layers"])
            mx.eval(list(arrays.values()))  # read now: a truncated file fails here, not mid-request
            if meta.get("sha256") != checksum(f.tokens, layers, arrays):
                raise ValueError("its checksum does not match its contents")
            check_entry(f.tokens, layers, arrays, self.layout)
            objs = decode(arrays, layers, self.exact)
            check_offsets(f.tokens, objs, self.exact)
        except Exception as e:
            self._drop(f)
            warnings.warn(f"prompt cache: skipping {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          "it was removed.", PromptStoreWarning, stacklevel=2)
            return None
        self._files.move_to_end(f.name)
        try:
            os.utime(path)  # the order of use survives a restart
        except OSError:
            pass
        self.hits += 1
        return objs, f.cache_type


def _name(tokens) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:32]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove(path: Path):
    try:
        path.unlink()
    except OSError:
        pass
