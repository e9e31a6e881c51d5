"""Everything that touches mlx-lm internals lives here (and in `caches`).

The target is an unmodified mlx-lm model run by its own forward pass (its
embedding scale, MoE routing, tied or untied head and logit soft-capping stay
mlx-lm's). We wrap *instances* (never classes): tapped decoder layers record
their outputs, the final norm records its output where the last layer is
tapped, the LM head is reached through the adapter (so a prefill pays it for
the last row only), and Gated DeltaNet mixers record an update tape during
verification so their recurrent state can be rolled back to any accepted
length. Which cache types can be rolled back, and so which families are
supported, is decided per cache in `caches`. Where every cache is a KV
cache, every layer, its attention and its RoPE are wrapped too: a tree pass
(`draft/tree.py`) gives the layers its mask and rotates each run of nodes at
its own positions (`keep_rows` then keeps the accepted branch's K/V rows).
Where every layer has a cache of its own (K/V, a sliding window or a Gated
DeltaNet state), each attention is wrapped (`GroupedAttention`), and the tape's
mixer splits too: a batch's sequences each attend over caches of their own
(`target/sequences.py`), and another sequence's prefill chunk can ride in a
pass (`Rider`), its rows sharing the pass's projections and MLPs and
attending over, or updating, their own caches. Two adapters in one process
share nothing.

Under mlx-lm's pipeline parallelism (`model.model.pipeline(group)`) a rank
holds only its own layers (the others are None) and caches for them alone;
it returns its share of the taps: its own layers' outputs, zeros for the
others' (`distributed` sums the shares over the ranks).
"""

import inspect
from contextlib import contextmanager
from itertools import accumulate
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as cache_lib
from mlx_lm.models import rope_utils
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.gated_delta import compute_g, normalize_qk
from mlx_lm.models.rope_utils import initialize_rope as _mlx_lm_rope
from mlx_lm.utils import load_model, load_tokenizer

from ..errors import DFlashError
from ..kernels import backend, gdn_replay, gdn_replay_each, gdn_verify, qmm_verify
from .caches import DEFAULT_SLACK, WindowCache, family_verdict, gdn_layout, keep_rows, rollback_kind
from .ragged import RaggedKVCache
from .sequences import SequenceKV


def initialize_rope(dims, base, scaling_config, max_position_embeddings):
    return _mlx_lm_rope(
        dims,
        base=base,
        traditional=False,
        scaling_config=scaling_config,
        max_position_embeddings=max_position_embeddings,
    )


def cache_classes() -> Dict[str, type]:
    """mlx-lm's cache classes by name (its private `_BaseCache` is their common base)."""
    return {n: c for n, c in vars(cache_lib).items() if isinstance(c, type) and issubclass(c, cache_lib._BaseCache)}


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (its private `_tokenizer`), or
    `tokenizer` itself where it is not wrapped: the grammar engine builds its vocabulary from it."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def nearest_prefix(trie: cache_lib.PromptTrie, model, tokens: List[int], trimmable) -> tuple:
    """(tokens reused, tokens of the entry that serves them; 0, None for none) for `tokens`
    in mlx-lm's `PromptTrie`, by the choice `LRUPromptCache.fetch_nearest_cache` makes
    (`trimmable(entry)`: whether an entry may be trimmed to a shorter prefix).

    That method copies and trims the entry it chooses and says neither which entry it
    was nor what it evicts; a prompt cache with a disk tier must compare both tiers'
    reach before copying anything, and hand evicted entries to disk, so the rule is
    applied here, next to mlx-lm's other internals."""
    r = trie.search(model, tokens)
    if r.exact is not None:
        return len(tokens), r.exact
    short = len(r.shorter) if r.shorter is not None else 0
    if r.longer is not None and r.common_prefix > short and trimmable(trie.get(model, r.longer)):
        return min(len(tokens) - 1, r.common_prefix), r.longer
    return (short, r.shorter) if short else (0, None)


def load_target(path, tokenizer_config: Optional[dict] = None):
    """Load an mlx-lm model and tokenizer from a local directory."""
    from pathlib import Path

    from .files import check_target_files, read_target_config

    cfg = read_target_config(path)
    ok, why = family_verdict(cfg["model_type"])
    if not ok:
        raise DFlashError(
            f"Target family '{cfg['model_type']}' is not supported: {why} "
            "(`dflash-mlx doctor` lists the supported families)."
        )
    check_target_files(path, cfg)
    try:
        model, config = load_model(Path(path))
    except (ValueError, FileNotFoundError, KeyError, TypeError, RuntimeError) as e:
        raise DFlashError(f"Could not load the target from {path}: {failure_line(e)}; download the model again.")
    try:
        with _config_warnings_off():
            tokenizer = load_tokenizer(Path(path), tokenizer_config or {}, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # the tokenizers library raises plain Exceptions for damaged files
        raise DFlashError(f"Could not load the target's tokenizer from {path}: {failure_line(e)}; "
                          "download the model again.")
    return model, tokenizer, config


@contextmanager
def _config_warnings_off():
    """transformers reads config.json to pick a tokenizer and checks it as a config of its own models
    (a Gemma 4 config whose layers all use sliding windows is warned about and changed in its copy);
    MLX builds the model from the file itself, so those warnings do not apply to it."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def failure_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0] if str(e) else type(e).__name__


def model_class(path, config: dict) -> type:
    """mlx-lm's model class for a target's config (its `_get_classes`, private: mlx-lm's internals stay here)."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)[0]
    except ValueError as e:
        raise DFlashError(f"Could not load the target from {path}: {str(e).splitlines()[0]}")


def materialize(model: nn.Module) -> None:
    """Evaluate every array a model holds, private ones (e.g. RoPE frequencies)
    included, so the model can run on any thread."""
    arrays = [v for _, v in tree_flatten(model.parameters())]
    for _, m in model.named_modules():
        # Modules keep arrays as dict entries; "_"-prefixed ones are not parameters.
        arrays += [v for v in list(m.values()) + list(vars(m).values()) if isinstance(v, mx.array)]
    mx.eval(arrays)


def pipeline_span(inner: nn.Module):
    """(first, end) of the layers this rank runs, and whether the model is pipelined.

    mlx-lm's PipelineMixin sets layers[:first] to None and cuts the list at end."""
    if getattr(inner, "pipeline_size", 1) > 1:
        return inner.start_idx, inner.end_idx, True
    return 0, len(inner.layers), False


def model_dims(model: nn.Module):
    """(hidden size, vocabulary, layers) of an mlx-lm model (all its layers, pipelined or not)."""
    lm = getattr(model, "language_model", model)
    pipelined = pipeline_span(lm.model)[2]
    return lm.args.hidden_size, lm.args.vocab_size, lm.args.num_hidden_layers if pipelined else len(lm.model.layers)


class _Taps:
    """Holds the tapped hidden states of one forward pass (not module state)."""

    def __init__(self):
        self.values: Dict[int, mx.array] = {}
        self.recording = False
        self.last_only = False
        self.head_calls = 0
        self.tape: Dict[int, tuple] = {}
        self.tree_mask = None  # during a tree pass: [N, offset + N] bool, True = attend
        self.tree_runs = None  # during a tree pass: (start, end, depth of start) per RoPE run
        self.rows = None  # [B]: the one row per sequence whose logits a pass wants (a ragged batch's last)
        self.groups = None  # during a pass with a rider: ((B, L) of the main rows, (1, L) of the rider's)
        self.head_rows = None  # during a pass with a rider: the flat rows that reach the LM head
        self.group_tree = None  # during a tree pass with a rider: the tree's (mask, runs), its own rows'
        self.shared = None  # during a grouped attention call: what its parts share (`_Shared`)
        self.narrow = None  # during a pass over a batch in parts: each sequence's rows that attend (the rest pad)


class _Wrapper(nn.Module):
    """Base for instance wrappers: unknown attributes resolve on the wrapped module."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__("inner")
            return getattr(inner, name)


class TappedLayer(_Wrapper):
    """A decoder layer that records its output (the hidden state, where a layer
    returns more) when `record` is set, and during a tree pass attends with the
    tree's mask in place of the causal one the model made."""

    def __init__(self, inner: nn.Module, index: int, taps: _Taps, record: bool = True):
        super().__init__()
        self.inner = inner
        self._index = index
        self._taps = taps
        self._record = record

    def __call__(self, x, *args, **kwargs):
        mask = self._taps.tree_mask
        if mask is not None:
            if "mask" in kwargs or not args:
                kwargs["mask"] = mask
            else:
                args = (mask, *args[1:])
        out = self.inner(x, *args, **kwargs)
        if self._record:
            self._taps.values[self._index] = out[0] if isinstance(out, tuple) else out
        return out


# RoPE modules whose rotation of a row depends on its position alone, so a
# tree pass can rotate each run of nodes with its own offset.
TREE_ROPES = (nn.RoPE, rope_utils.Llama3RoPE, rope_utils.YarnRoPE, rope_utils.SuScaledRoPE,
              rope_utils.ProportionalRoPE)


class TreeRoPE(_Wrapper):
    """An attention's RoPE: during a tree pass each run of nodes (consecutive
    depths) is rotated by the model's own RoPE at the run's positions."""

    def __init__(self, inner: nn.Module, taps: _Taps):
        super().__init__()
        self.inner = inner
        self._taps = taps

    def __call__(self, x, offset=0, **kwargs):
        runs = self._taps.tree_runs
        if runs is None:
            return self.inner(x, offset=offset, **kwargs)
        return mx.concatenate(
            [self.inner(x[..., s:e, :], offset=offset + d, **kwargs) for s, e, d in runs], axis=-2)


@dataclass
class Rider:
    """A prefill chunk of another sequence that rides in a pass (`TargetAdapter.__call__`): its
    rows go through the layers' projections and MLPs together with the pass's own, and attend
    over its own caches. The adapter sets `hidden` (its taps, or None where not asked for)."""

    tokens: mx.array  # [1, L]
    cache: list  # its own caches, per layer
    taps: bool = True
    hidden: Optional[mx.array] = None


# A rider's own caches (a sequence's): K/V, a sliding window, a Gated DeltaNet state.
RIDER_CACHES = (cache_lib.KVCache, WindowCache, cache_lib.ArraysCache)


class _Grouped:
    """One layer's caches during a pass with a rider: the pass's own and the rider's. The mask
    the model asks the first for is each group's own, as the model would have made it."""

    def __init__(self, caches: tuple, groups: tuple):
        self.caches, self.groups = caches, groups

    def make_mask(self, N: int, **kwargs):
        return tuple(c.make_mask(L, **kwargs) for c, (_, L) in zip(self.caches, self.groups))


@dataclass
class _Part:
    """One sequence's rows (or a group's, held in one array) in a grouped attention call: rows
    [start, start + B * L) of the pass, as [B, L], with their own mask and caches; or, where a
    group's sequences are not next to each other in the batch, the rows at `index`."""

    start: int
    B: int
    L: int
    mask: Any
    cache: Any
    runs: Optional[tuple] = None  # a tree's RoPE runs, where these rows are its nodes
    index: Optional[mx.array] = None  # [B * L] the pass's rows this part holds, in its order
    rows: Optional[int] = None  # a sequence's first rows that attend and are cached (the others pad)


class _Shared:
    """What a grouped attention call shares among its parts: every row of the pass ([1, N, D]),
    the part running, and each input projection's output over every row (made on first use)."""

    def __init__(self, x: mx.array, defer: bool):
        self.x, self.part, self.start, self.index, self.outs = x, None, 0, None, {}
        self.defer = defer  # the output projection hands its input back, to run once after every part
        self.deferred = None  # what it handed back last


class _Projection(_Wrapper):
    """One of an attention's linear projections, shared by the parts of a grouped call (`_Shared`)."""

    def __init__(self, inner: nn.Module, taps: "_Taps"):
        super().__init__()
        self.inner = inner
        self._taps = taps


class _SharedInput(_Projection):
    """An attention's input projection (q, k, v, ...): in a grouped call, it projects every part's
    rows at once, and each part gets its slice (one read of the weights for all)."""

    def __call__(self, x):
        s = self._taps.shared
        if s is None or x is not s.part:
            return self.inner(x)
        full = s.outs.get(id(self))
        if full is None:
            full = s.outs[id(self)] = self.inner(s.x)
        B, L = x.shape[:2]
        rows = full[:, s.start : s.start + B * L] if s.index is None else mx.take(full, s.index, axis=1)
        return rows.reshape(B, L, -1)


class _SharedOutput(_Projection):
    """An attention's output projection: in a grouped call, it hands its input back unprojected,
    and `GroupedAttention` projects every part's rows at once after the last."""

    def __call__(self, x):
        s = self._taps.shared
        if s is None or not s.defer:
            return self.inner(x)
        s.deferred = x
        return x


# The output projection's name in mlx-lm's attention modules.
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "wo", "c_proj")
LINEARS = (nn.Linear, nn.QuantizedLinear)


class GroupedAttention(_Wrapper):
    """A layer's attention, for a pass over several sequences held in caches of their own: a
    batch's `SequenceKV`, or a rider's (`Rider`) beside the pass's own rows. Each sequence's rows
    attend over its own caches, with its own mask and positions (the model's own attention,
    called per sequence); the input projections run once over every row and the output
    projection once after (`_SharedInput`, `_SharedOutput`)."""

    def __init__(self, inner: nn.Module, taps: "_Taps"):
        super().__init__()
        self.inner = inner
        self._taps = taps
        self._defer: Optional[bool] = None  # whether the output projection runs once after the parts
        for name in list(inner):
            child = inner[name]
            if isinstance(child, LINEARS):
                if name in OUTPUT_PROJECTIONS:
                    setattr(inner, name, _SharedOutput(child, taps))
                else:
                    setattr(inner, name, _SharedInput(child, taps))
        self._output = next((n for n in OUTPUT_PROJECTIONS if isinstance(inner.get(n), _SharedOutput)), None)

    def __call__(self, x, mask=None, cache=None, **kwargs):
        found = self._parts(x, mask, cache)
        if found is None:
            return self.inner(x, mask, cache, **kwargs)
        parts, order = found
        if self._defer is None:
            self._defer = self._defers(x, kwargs)
        taps = self._taps
        B, L, D = x.shape
        rows = x.reshape(1, B * L, D)
        shared = _Shared(rows, self._defer)
        outs, runs = [], taps.tree_runs
        for p in parts:
            n = p.L if p.rows is None else p.rows
            flat = rows[:, p.start : p.start + p.B * n] if p.index is None else mx.take(rows, p.index, axis=1)
            part = flat.reshape(p.B, n, D)
            shared.part, shared.start, shared.index = part, p.start, p.index
            taps.shared, taps.tree_runs = shared, p.runs
            try:
                out = self.inner(part, p.mask, p.cache, **kwargs)
            finally:
                taps.shared, taps.tree_runs = None, runs
            out = out.reshape(1, p.B * n, -1)
            if n < p.L:  # rows that do not attend: zeros, never read
                out = mx.concatenate([out, mx.zeros((1, p.L - n, out.shape[-1]), out.dtype)], axis=1)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        if order is not None:  # the parts' rows back in the pass's order
            out = mx.take(out, order, axis=1)
        if self._defer:
            out = self.inner[self._output].inner(out)
        return out.reshape(B, L, -1)

    def _defers(self, x, kwargs) -> bool:
        """Whether the attention returns its output projection's output as it is, so that the
        projection can run once after every part (checked once, on a row of `x` and a fresh cache:
        the graph it builds is never evaluated)."""
        if self._output is None:
            return False
        probe = x[:1, :1]
        shared = _Shared(probe, True)
        shared.part = probe
        taps, runs = self._taps, self._taps.tree_runs
        taps.shared, taps.tree_runs = shared, None
        try:
            out = self.inner(probe, None, cache_lib.KVCache(), **kwargs)
        except Exception:  # a layout the probe does not fit: project each part on its own
            return False
        finally:
            taps.shared, taps.tree_runs = None, runs
        return out is shared.deferred

    def _parts(self, x, mask, cache) -> Optional[Tuple[List[_Part], Optional[mx.array]]]:
        """The pass's parts (each part of a `SequenceKV` batch, a batch held in one array as one
        part, and a rider) and, where their rows follow each other in another order than the
        pass's, where each of the pass's rows is among them; None for a pass over one cache (the
        attention runs as the model's)."""
        taps = self._taps
        if taps.groups is not None:
            groups, masks, caches = taps.groups, mask, cache.caches
        elif isinstance(cache, SequenceKV):
            groups, masks, caches = (x.shape[:2],), (mask,), (cache,)
        else:
            return None
        parts, order, start = [], [], 0
        for i, ((B, L), m, c) in enumerate(zip(groups, masks, caches)):
            runs = taps.tree_runs if i == 0 else None  # the pass's own rows may be a tree's nodes
            if i == 0 and taps.group_tree is not None:
                m, runs = taps.group_tree
            if isinstance(c, SequenceKV):
                each = m if isinstance(m, (tuple, list)) else [m] * len(c.parts)
                narrow = taps.narrow if i == 0 else None
                for mp, cp, members in zip(each, c.parts, c.members):
                    first, n = members[0], len(members)
                    rows = [start + b * L + j for b in members for j in range(L)]
                    apart = members != list(range(first, first + n))
                    w = narrow[first] if narrow is not None and n == 1 and narrow[first] < L else None
                    if w is not None:  # its own mask for the rows that attend
                        mp = cp.make_mask(w, **getattr(m, "kwargs", {}))
                    parts.append(_Part(start + first * L, n, L, mp, cp, _runs_of(runs, members),
                                       mx.array(rows) if apart else None, w))
                    order += rows
            else:
                parts.append(_Part(start, B, L, m, c, runs))
                order += range(start, start + B * L)
            start += B * L
        if order == list(range(len(order))):
            return parts, None
        inverse = [0] * len(order)
        for at, r in enumerate(order):
            inverse[r] = at
        return parts, mx.array(inverse)


def _runs_of(runs: Optional[list], members: List[int]) -> Optional[list]:
    """The RoPE runs of a batch's tree for the sequences `members` (`draft.tree.Tree.runs`: a
    branch's depth is an array, each sequence's own)."""
    if runs is None:
        return None
    first, n = members[0], len(members)
    if members == list(range(first, first + n)):
        return [(s, e, d if isinstance(d, int) else d[first : first + n]) for s, e, d in runs]
    index = mx.array(members)
    return [(s, e, d if isinstance(d, int) else mx.take(d, index, axis=0)) for s, e, d in runs]


def _tree_mask(tree: tuple, cache) -> mx.array:
    """A tree pass's attention mask [B, 1, N, columns]: every node sees its sequence's cached
    prefix, and the nodes its row of the tree's mask [B, N, N] says. A batch's caches
    (`target.ragged`) hold sequence b's nodes from its own end, so its row of the tree's mask is
    read at those columns."""
    mask = tree[0]
    B, N, _ = mask.shape
    c = cache[0]
    if isinstance(c, SequenceKV):  # each part's own mask, from its sequences' rows of the tree's
        return tuple(_tree_mask((mx.take(mask, mx.array(m), axis=0),), [part]) for part, m in zip(c.parts, c.members))
    if isinstance(c.offset, int):  # one sequence's own caches
        return mx.concatenate([mx.ones((B, N, c.offset), dtype=mx.bool_), mask], axis=2)[:, None]
    rel = mx.arange(max(c.ends) + N)[None, None] - c.offset[:, None, None]  # column - the sequence's end
    nodes = mx.take_along_axis(mask, mx.broadcast_to(mx.clip(rel, 0, N - 1), (B, N, rel.shape[2])), axis=2)
    return ((rel < 0) | ((rel < N) & nodes))[:, None]


def _rope_owners(layer: nn.Module) -> List[nn.Module]:
    """The modules of a decoder layer that hold a `rope` child."""
    return [m for _, m in layer.named_modules() if isinstance(m.get("rope"), nn.Module)]


def _takes_mask(layer: nn.Module) -> bool:
    params = list(inspect.signature(type(layer).__call__).parameters)
    return len(params) > 2 and params[2] == "mask"


def tree_capable(kinds: Dict[int, str], layers) -> bool:
    """Whether a tree pass can run: every cache a plain KVCache (trimmed and
    row-copied), every layer taking the mask second and holding exactly
    one RoPE of a kind that rotates by position alone."""
    if any(k != "offset" for k in kinds.values()) or len(kinds) != len(layers):
        return False
    for layer in layers:
        owners = _rope_owners(layer)
        if not _takes_mask(layer) or len(owners) != 1 or type(owners[0].rope) not in TREE_ROPES:
            return False
    return True


def ride_capable(kinds: Dict[int, str], layers) -> bool:
    """Whether a prefill chunk can ride in a pass: every cache K/V (full or a sliding window,
    each group's own mask made by its own caches) or a Gated DeltaNet state (the tape's
    wrapper runs each group on its own), and every attention layer's attention a child of
    the layer taking the mask second, holding the one RoPE (`GroupedAttention` wraps it)."""
    if any(k not in ("offset", "window", "tape") for k in kinds.values()) or len(kinds) != len(layers):
        return False
    for i, layer in enumerate(layers):
        if kinds[i] == "tape":  # a Gated DeltaNet mixer: the tape's wrapper splits the groups
            continue
        owners = _rope_owners(layer)
        if len(owners) != 1 or not any(layer[n] is owners[0] for n in layer) or not _takes_mask(owners[0]):
            return False
    return True


class _FinalNorm(_Wrapper):
    """The model's final norm: records its output, HF's entry for the last layer."""

    def __init__(self, inner: nn.Module, index: int, taps: _Taps):
        super().__init__()
        self.inner = inner
        self._index = index
        self._taps = taps

    def __call__(self, x):
        out = self.inner(x)
        self._taps.values[self._index] = out
        return out


class _HeadHook(_Wrapper):
    """Stands in the model for its LM head (an untied `lm_head`, or a tied
    embedding's `as_linear`): the model's own forward calls it, it calls the
    adapter's `head` (the raw head the drafter borrows), on the last row only
    when the adapter asks for the last position's logits."""

    def __init__(self, inner: nn.Module, adapter, taps: _Taps, tied: bool):
        super().__init__()
        self.inner = inner
        self._adapter = adapter
        self._taps = taps
        self._tied = tied

    def _head(self, x):
        self._taps.head_calls += 1
        if self._taps.head_rows is not None:
            x = x[:, self._taps.head_rows]
        elif self._taps.last_only:
            x = x[:, -1:]
        elif self._taps.rows is not None:  # one row per sequence
            x = mx.take_along_axis(x, self._taps.rows[:, None, None], axis=1)
        return self._adapter.model_head(x)

    def __call__(self, x):
        # A tied head wraps the embedding: calling it embeds.
        return self.inner(x) if self._tied else self._head(x)

    def as_linear(self, x):
        return self._head(x) if self._tied else self.inner.as_linear(x)


def _gdn_inputs(g, inputs):
    """A Gated DeltaNet mixer's projections: (mixed qkv, z, b, a), for either layout."""
    B, S, _ = inputs.shape
    if gdn_layout(g) == "qwen3_next":
        q, k, v, z, b, a = g.fix_query_key_value_ordering(g.in_proj_qkvz(inputs), g.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    qkv = g.in_proj_qkv(inputs)
    z = g.in_proj_z(inputs).reshape(B, S, g.num_v_heads, g.head_v_dim)
    return qkv, z, g.in_proj_b(inputs), g.in_proj_a(inputs)


class TapedGatedDeltaNet(_Wrapper):
    """A Gated DeltaNet mixer that, while recording, keeps an update tape.

    The tape (the block's k, gates and per-step deltas, the conv input and the
    state before the block) lets `rollback` rebuild the exact state after any
    prefix with the state updates alone: no projections, no reductions. Both
    mlx-lm layouts are handled: qwen3_5's (in_proj_qkv, _z, _b, _a) and
    qwen3_next's (in_proj_qkvz, in_proj_ba, regrouped per key head).
    """

    def __init__(self, inner: nn.Module, index: int, taps: _Taps):
        super().__init__()
        self.inner = inner
        self._index = index
        self._taps = taps

    def __call__(self, inputs, mask=None, cache=None):
        if self._taps.groups is not None:
            return self._grouped(inputs, mask, cache)
        if not self._taps.recording or cache is None or mask is not None:
            return self.inner(inputs, mask, cache)
        g = self.inner
        B, S, _ = inputs.shape
        qkv, z, b, a = _gdn_inputs(g, inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, g.conv_kernel_size - 1, g.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = conv_input[:, -(g.conv_kernel_size - 1) :, :]
        conv_out = nn.silu(g.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [g.key_dim, 2 * g.key_dim], -1),
                [g.num_k_heads, g.num_k_heads, g.num_v_heads],
                [g.head_k_dim, g.head_k_dim, g.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=g.head_k_dim**-0.5, eps=1e-6)
        state0 = cache[1]
        if state0 is None:
            state0 = mx.zeros((B, g.num_v_heads, g.head_v_dim, g.head_k_dim), dtype=mx.float32)
        # The same gates mlx-lm's gated_delta_update computes.
        gate, beta = compute_g(g.A_log, a, g.dt_bias), mx.sigmoid(b)
        out, state, delta = gdn_verify(q, k, v, gate, beta, state0)
        self._taps.tape[self._index] = (k, gate, delta, conv_input, state0)
        cache[1] = state
        cache.advance(S)
        out = g.out_proj(g.norm(out, z).reshape(B, S, -1))
        if getattr(g, "sharding_group", None) is not None:  # tensor parallel: heads split across ranks
            out = mx.distributed.all_sum(out, group=g.sharding_group)
        return out

    def _grouped(self, inputs, masks, cache):
        """During a pass with a rider: each group of rows (the pass's own [B, L], the rider's
        [1, L]) through the mixer on its own states, only the pass's own taped."""
        taps = self._taps
        groups, recording = taps.groups, taps.recording
        outs, start = [], 0
        for i, ((B, L), m, c) in enumerate(zip(groups, masks, cache.caches)):
            taps.groups, taps.recording = None, recording and i == 0
            try:
                outs.append(self(inputs[:, start : start + B * L].reshape(B, L, -1), m, c).reshape(1, B * L, -1))
            finally:
                taps.groups, taps.recording = groups, recording
            start += B * L
        return mx.concatenate(outs, axis=1)

    def rollback(self, cache, keep: int):
        """Set `cache` to the state after the first `keep` tokens of the taped block."""
        k, gate, delta, conv_input, state0 = self._taps.tape[self._index]
        g = self.inner
        cache[1] = gdn_replay(state0, k, gate, delta, keep) if keep else state0
        cache[0] = conv_input[:, keep : keep + g.conv_kernel_size - 1, :]

    def rollback_each(self, cache, keeps: Sequence[int]):
        """`rollback` for a batched block: sequence b keeps its first `keeps[b]` tokens."""
        k, gate, delta, conv_input, state0 = self._taps.tape[self._index]
        cache[1] = gdn_replay_each(state0, k, gate, delta, keeps)
        rows = mx.array(keeps)[:, None] + mx.arange(self.inner.conv_kernel_size - 1)[None]
        cache[0] = mx.take_along_axis(conv_input, rows[..., None], axis=1)


def _mixer(layer: nn.Module) -> Optional[nn.Module]:
    """The Gated DeltaNet mixer of a decoder layer, if it has one the tape knows."""
    for name in ("linear_attn", "mixer", "linear_attention"):
        m = getattr(layer, name, None) if name in layer else None
        if isinstance(m, nn.Module) and gdn_layout(m) is not None:
            return m
    return None


class VerifyQuantizedLinear(_Wrapper):
    """A 4/8-bit affine QuantizedLinear whose 2-16 row calls go through `qmm_verify`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        q = self.inner
        if not 2 <= rows <= 16:
            return q(x)
        y = qmm_verify(x.reshape(rows, x.shape[-1]), q["weight"], q["scales"], q["biases"], q.group_size, q.bits)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y + q["bias"] if "bias" in q else y


def wrap_quantized_linears(model: nn.Module) -> int:
    """Route verify-width calls of the model's affine 4/8-bit linears through `qmm_verify`."""
    wrapped = [
        (path, VerifyQuantizedLinear(m)) for path, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine"
        and m.bits in (4, 8) and m.get("biases") is not None
    ]
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))
    return len(wrapped)


class TargetAdapter:
    """Runs an mlx-lm model and returns logits plus the tapped hidden states."""

    def __init__(self, model: nn.Module, tap_ids: Sequence[int], model_type: str = "",
                 quantization: Optional[dict] = None, slack: int = DEFAULT_SLACK):
        self.model = model
        self.quantization = quantization  # the checkpoint's, as mlx-lm's config.json gives it
        self.model_type = model_type or getattr(model, "model_type", "")
        lm = getattr(model, "language_model", model)
        self.inner = inner = getattr(lm, "model", None)
        if inner is not None and any(isinstance(m, _Wrapper) for m in [
                *inner.get("layers", []), inner.get("norm"), inner.get("embed_tokens"), lm.get("lm_head")]):
            raise DFlashError("This model instance is already wrapped by another adapter; load it again.")
        first, end, self.pipelined = pipeline_span(inner) if inner is not None and "layers" in inner else (0, 0, False)
        # The cache rule first: a family is refused for the cache it cannot roll back.
        # Caches are this rank's layers' only: cache e is layer first + e.
        self._kinds = self._rollback_kinds(
            inner.layers[first:end] if self.pipelined else getattr(lm, "layers", None) or getattr(inner, "layers", []))
        if inner is None or not all(a in inner for a in ("embed_tokens", "layers", "norm")):
            raise DFlashError(
                f"Target family '{self.model_type}' is not supported: its model has no "
                "embed_tokens/layers/norm (the layout the adapter taps)."
            )
        self.args = lm.args
        layers = inner.layers
        self.embed_tokens = inner.embed_tokens
        tied = bool(getattr(self.args, "tie_word_embeddings", False)) or "lm_head" not in lm
        self._raw_head = self.embed_tokens.as_linear if tied else lm.lm_head
        self._head_group = group = None if tied else getattr(lm, "sharding_group", None)
        # A head split by vocabulary (tensor parallel): the model gathers its own
        # logits after it; the drafter borrows a head that gathers them too.
        self.head = self._raw_head if group is None else (lambda x: gather_last_axis(self._raw_head(x), group))
        self.num_layers = model_dims(model)[2]
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.tap_ids = list(tap_ids)
        bad = [i for i in self.tap_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"The drafter taps target layer(s) {bad} but the target has {self.num_layers} "
                "layers; use the drafter trained for this target."
            )
        self._taps = _Taps()
        self.slack = slack
        self._gdn: Dict[int, TapedGatedDeltaNet] = {}
        self.supports_tree = not self.pipelined and tree_capable(self._kinds, layers)
        self._riders = not self.pipelined and ride_capable(self._kinds, layers)  # a prefill chunk can ride in a pass
        last = self.num_layers - 1
        # Taps this rank computes; under pipeline parallelism the last layer's
        # (HF's final-norm entry) is its output normed here, so that no tap
        # waits on the pipeline's all_gather.
        self.local_taps = [i for i in self.tap_ids if first <= i < end]
        self._final_norm = inner.norm if self.pipelined and last in self.local_taps else None
        for i in range(first, end):
            layer, e = layers[i], i - first  # e: the layer's cache
            if self._kinds.get(e) == "tape":
                mixer = _mixer(layer)
                name = next(n for n in layer if layer[n] is mixer)
                wrapped = TapedGatedDeltaNet(mixer, e, self._taps)
                setattr(layer, name, wrapped)
                self._gdn[e] = wrapped
            for owner in _rope_owners(layer) if self.supports_tree or self._riders else ():
                if self.supports_tree:
                    owner.rope = TreeRoPE(owner.rope, self._taps)
                if self._riders:
                    setattr(layer, next(n for n in layer if layer[n] is owner), GroupedAttention(owner, self._taps))
            tapped = i in self.local_taps and (i != last or self.pipelined)
            if tapped or self.supports_tree:
                layers[i] = TappedLayer(layer, i, self._taps, record=tapped)
        if last in self.tap_ids and not self.pipelined:
            # HF reports the last layer's entry after the final norm: match it.
            inner.norm = _FinalNorm(inner.norm, self.num_layers - 1, self._taps)
        if tied:
            inner.embed_tokens = _HeadHook(self.embed_tokens, self, self._taps, tied=True)
        else:
            lm.lm_head = _HeadHook(lm.lm_head, self, self._taps, tied=False)
        self._checked = False
        # Only where a kernel can run: elsewhere the stock op is all qmm_verify would call.
        self.verify_linears = wrap_quantized_linears(model) if backend() is not None else 0

    def _rollback_kinds(self, layers) -> Dict[int, str]:
        """Each cache's rollback rule (`caches.rollback_kind`); refuses what has none."""
        kinds = {}
        caches = cache_lib.make_prompt_cache(self.model)
        if len(caches) > len(layers):
            raise DFlashError(
                f"Target family '{self.model_type}' is not supported: its caches do not map onto its layers."
            )
        for i, c in enumerate(caches):
            kind = rollback_kind(c, _mixer(layers[i]))
            if kind is None:
                raise DFlashError(
                    f"Target layer {i} ({type(layers[i]).__name__}) uses a {type(c).__name__}, which cannot "
                    f"be rolled back exactly; target family '{self.model_type}' is not supported."
                )
            kinds[i] = kind
        return kinds

    def can_verify_tree(self, cache) -> bool:
        """Whether a tree pass can run over these caches (all plain KV caches, a sequence's own or
        a batch's: not quantized, not sliding windows)."""
        return self.supports_tree and all(
            type(c) is cache_lib.KVCache or (type(c) in (RaggedKVCache, SequenceKV) and c.window is None)
            for c in cache)

    def can_carry(self, cache) -> bool:
        """Whether a prefill chunk over these caches (a sequence's own) can ride in a pass
        (`Rider`): every layer's attention is wrapped to split the groups and every cache is a
        K/V cache, a sliding window or a Gated DeltaNet state; after the first pass has checked the
        model's layout."""
        return self._riders and self._checked and all(type(c) in RIDER_CACHES for c in cache)

    def model_head(self, x):
        """The head as the model's own forward calls it: `head`, or where the
        vocabulary is split across ranks, this rank's slice (the model gathers)."""
        return self.head(x) if self._head_group is None else self._raw_head(x)

    @property
    def dtype(self) -> mx.Dtype:
        """The model's float dtype (a quantized embedding's scales carry it)."""
        return getattr(self.embed_tokens, "scales", self.embed_tokens.weight).dtype

    def make_cache(self) -> List[Any]:
        """mlx-lm's caches for the model, sliding-window ones replaced by `WindowCache`s
        with `slack` rows beyond the window (so a crop after a wrap is exact)."""
        cache = cache_lib.make_prompt_cache(self.model)
        return [
            WindowCache(c.max_size, self.slack) if self._kinds[i] == "window" else c
            for i, c in enumerate(cache)
        ]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def __call__(self, tokens: mx.array, cache, last_only: bool = False, record: bool = False,
                 tree: Optional[tuple] = None, taps: Union[bool, str] = True, rows: Optional[mx.array] = None,
                 rider: Optional[Rider] = None, narrow: Optional[Sequence[int]] = None):
        """`_pass`; with `narrow`, over a batch in parts (`target.sequences`), only the first
        narrow[b] rows of a sequence held apart attend and are cached (its other rows pad the
        block: their logits and taps are never read; `crop_each` takes the rows each holds)."""
        if narrow is not None and rider is None and tree is None and rows is None and not last_only:
            packed = self._packed(tokens, cache, narrow, record, taps)
            if packed is not None:
                return packed
        self._taps.narrow = narrow
        try:
            return self._pass(tokens, cache, last_only, record, tree, taps, rows, rider)
        finally:
            self._taps.narrow = None

    def _packed(self, tokens: mx.array, cache, narrow: Sequence[int], record: bool, wanted):
        """`__call__` with `narrow` over a batch whose every layer is K/V in parts (`SequenceKV`):
        each part's rows packed into one flat pass with no padding (a narrow sequence's own rows
        only), each part a group over its own caches (as a rider's), so that the rows a narrow
        sequence does not verify skip the projections and MLPs too. The logits [B, L, V] and taps
        come back in the batch's order, a narrow sequence's rows past its own repeating its last
        (never read). None where there is nothing to pack or the layout does not allow it."""
        if not all(isinstance(c, SequenceKV) for c in cache):
            return None
        B, L = tokens.shape
        members = cache[0].members
        widths = [narrow[m[0]] if len(m) == 1 and narrow[m[0]] < L else L for m in members]
        if min(widths) == L:
            return None
        where, pieces, start = [0] * (B * L), [], 0
        for m, w in zip(members, widths):
            for i, b in enumerate(m):
                where[b * L : (b + 1) * L] = [start + i * w + min(j, w - 1) for j in range(L)]
            rows = tokens[m[0] : m[0] + 1] if len(m) == 1 else mx.take(tokens, mx.array(m), axis=0)
            pieces.append(rows[:, :w].reshape(1, -1))
            start += len(m) * w
        groups = tuple((len(m), w) for m, w in zip(members, widths))
        flat, index = mx.concatenate(pieces, axis=1), mx.array(where)
        layers = [_Grouped(tuple(c.parts), groups) for c in cache]
        logits, feats = self._flat(flat, groups, layers, index, record, None)
        if not self._checked:
            self._check(flat, logits, feats)
        logits = logits.reshape(B, L, -1)
        if wanted == "layers":
            return logits, tuple(mx.take(f, index, axis=1).reshape(B, L, -1) for f in feats)
        return logits, mx.take(mx.concatenate(feats, axis=-1), index, axis=1).reshape(B, L, -1) if wanted else None

    def _pass(self, tokens: mx.array, cache, last_only: bool = False, record: bool = False,
              tree: Optional[tuple] = None, taps: Union[bool, str] = True, rows: Optional[mx.array] = None,
              rider: Optional[Rider] = None):
        """Logits (all positions, or the last only) and the concatenated taps
        (None with `taps=False`: a plain step that no drafter will read; with
        `taps="layers"`, the tapped outputs as a tuple, for the caller to join
        once for many steps: one op less per plain step).

        The logits are the model's own forward pass; with `last_only` its LM
        head sees only the last row (a prefill chunk pays the head once).
        `tree` = (mask [N, N] bool, runs) makes it a tree pass over the N
        tokens (`supports_tree` targets only): token i attends to the cached
        prefix and the tokens j with mask[i, j], and each run (start, end,
        depth) of tokens is at positions offset + depth onwards. `rows` [B]: only row
        rows[b] of sequence b reaches the LM head (logits [B, 1, V]).

        A `rider` (`can_carry` its caches) goes through the same pass: its rows
        share every projection and MLP with the pass's own (one read of the weights for both),
        attend over its own caches, and never reach the head; its taps are left in
        `rider.hidden`. What the pass returns is what it returns without the rider."""
        if tree is not None and not self.supports_tree:
            raise DFlashError(f"Target family '{self.model_type}' cannot verify a tree.")
        if rider is not None:
            return self._carrying(tokens, cache, rider, last_only, record, taps, rows, tree)
        wanted, taps = taps, self._taps
        taps.values.clear()
        taps.recording, taps.last_only, taps.head_calls, taps.rows = record, last_only, 0, rows
        if tree is not None:
            taps.tree_mask, taps.tree_runs = _tree_mask(tree, cache), tree[1]
        self._slack_for(tokens, cache, record)
        try:
            logits = self.model(tokens, cache=cache)
        finally:
            taps.recording = taps.last_only = False
            taps.tree_mask = taps.tree_runs = taps.rows = None
        feats = [self._tap(i, tokens) for i in self.tap_ids]
        taps.values.clear()
        if not self._checked:
            self._check(tokens, logits, feats)
        if wanted == "layers":
            return logits, tuple(feats)
        return logits, mx.concatenate(feats, axis=-1) if wanted else None

    def _carrying(self, tokens, cache, rider: Rider, last_only: bool, record: bool, wanted, rows, tree):
        """`__call__` with a rider: the rows of both flattened into one [1, B * L + L'] pass (a tree's
        mask and RoPE runs, with `tree`, for the pass's own rows only)."""
        B, L = tokens.shape
        groups = ((B, L), tuple(rider.tokens.shape))
        if rows is not None:
            heads = rows + mx.arange(B) * L
        else:
            heads = mx.arange(B * L).reshape(B, L)[:, -1 if last_only else slice(None)].reshape(-1)
        self._slack_for(tokens, cache, record)
        flat = mx.concatenate([tokens.reshape(1, -1), rider.tokens.astype(tokens.dtype)], axis=1)
        tree = None if tree is None else (_tree_mask(tree, cache), tree[1])
        logits, feats = self._flat(flat, groups, [_Grouped(pair, groups) for pair in zip(cache, rider.cache)],
                                   heads, record, tree)
        logits = logits.reshape(B, -1, logits.shape[-1])
        rider.hidden = mx.concatenate([f[:, B * L :] for f in feats], axis=-1) if rider.taps else None
        own = [f[:, : B * L].reshape(B, L, -1) for f in feats]
        if wanted == "layers":
            return logits, tuple(own)
        return logits, mx.concatenate(own, axis=-1) if wanted else None

    def apart(self, blocks: Sequence[mx.array], caches: Sequence[list], taps: bool = True):
        """One pass over several sequences' blocks of different lengths, each over its own caches
        (a `splits` target's, every cache one `can_carry` takes), with no padding: the rows go
        through every projection and MLP together and each sequence's attend over its own caches.
        Returns the logits of each block's last row [B, 1, V] and, with `taps`, each block's
        taps [1, L_b, D] (None without)."""
        lengths = [int(b.shape[-1]) for b in blocks]
        groups = tuple((1, n) for n in lengths)
        flat = mx.concatenate([b.reshape(1, -1) for b in blocks], axis=1)
        starts = list(accumulate([0] + lengths[:-1]))
        layers = [_Grouped(tuple(c[i] for c in caches), groups) for i in range(len(caches[0]))]
        lasts = mx.array([a + n - 1 for a, n in zip(starts, lengths)])
        logits, feats = self._flat(flat, groups, layers, lasts, False, None)
        if not self._checked:
            self._check(flat, logits, feats)
        if not taps:
            return logits.reshape(len(blocks), 1, -1), None
        joined = mx.concatenate(feats, axis=-1)
        return logits.reshape(len(blocks), 1, -1), [joined[:, a : a + n] for a, n in zip(starts, lengths)]

    def _flat(self, flat: mx.array, groups: tuple, cache: list, heads: mx.array, record: bool, tree):
        """The model over `flat` [1, N], its rows in `groups` ((B, L) each, every group's own caches
        in `cache`'s `_Grouped`s, the first's a tree's nodes with `tree`): the logits of rows `heads`
        and the taps [1, N, D] per tapped layer."""
        taps = self._taps
        taps.values.clear()
        taps.recording, taps.head_calls = record, 0
        taps.groups, taps.head_rows, taps.group_tree = groups, heads, tree
        try:
            logits = self.model(flat, cache=cache)
        finally:
            taps.recording = False
            taps.groups = taps.head_rows = taps.group_tree = None
        feats = [self._tap(i, flat) for i in self.tap_ids]
        taps.values.clear()
        return logits, feats

    def _slack_for(self, tokens: mx.array, cache, record: bool) -> None:
        """A recorded pass wider than the windows' slack: keep enough to crop it."""
        if record and tokens.shape[1] > self.slack:
            self.slack = tokens.shape[1]
            for c in cache:
                if isinstance(c, WindowCache):
                    c.grow_slack(self.slack)

    def _tap(self, i: int, tokens: mx.array) -> mx.array:
        """Tap `i` of this pass: zeros where another rank of a pipeline runs layer i."""
        if i not in self.local_taps:
            return mx.zeros((*tokens.shape[:2], self.hidden_size), dtype=self.dtype)
        out = self._taps.values[i]
        return self._final_norm(out) if self._final_norm is not None and i == self.num_layers - 1 else out

    def _check(self, tokens, logits, feats):
        """Once: the model reached its head through the adapter and the taps are hidden states."""
        want = (*tokens.shape[:2], self.hidden_size)
        if self._taps.head_calls != 1 or any(tuple(f.shape) != want for f in feats) or logits.shape[-1] != self.vocab_size:
            raise DFlashError(
                f"Target family '{self.model_type}' is not supported: its forward pass does not have the "
                "layout the adapter taps (decoder layer outputs, final norm, LM head)."
            )
        self._checked = True

    def crop(self, cache, keep: int, width: int, before: Optional[dict] = None):
        """Keep the first `keep` of the last `width` positions (after a recorded pass, or
        given the recurrent states from before it, `states`, none of a pass that was not)."""
        drop = width - keep
        if drop == 0:
            self._taps.tape.clear()
            return
        for i, c in enumerate(cache):
            if i not in self._gdn:
                c.trim(drop)
            elif before is None:
                self._gdn[i].rollback(c, keep)
            else:
                c.cache = list(before[i])
        self._taps.tape.clear()

    def crop_each(self, cache, keeps: Sequence[int], width: Union[int, Sequence[int]], before: Optional[dict] = None):
        """`crop` for a batch (`target.ragged.RaggedKVCache` and batched recurrent states):
        sequence b keeps the first `keeps[b]` of the last `width` positions (per sequence, where
        a pass was `narrow`: the rows it verified, which its K/V took where it is a part of its own
        and every row of the block in a padded array: `SequenceKV.taken`). A pass that was not recorded can only keep
        them all, or, given the recurrent states from before it (`states`, taken before a plain
        step), none."""
        widths = [width] * len(keeps) if isinstance(width, int) else width
        undone = [max(widths) - k for k in keeps]  # a recurrent state ran every row of the block
        for i, c in enumerate(cache):
            if i not in self._gdn:
                taken = c.taken(widths) if isinstance(c, SequenceKV) else [max(widths)] * len(keeps)
                drops = [t - k for t, k in zip(taken, keeps)]
                if any(drops):
                    c.crop(drops)
            elif not any(undone):
                continue
            elif before is None:
                self._gdn[i].rollback_each(c, keeps)
            elif all(undone):
                c.cache = list(before[i])
            else:
                back = mx.array(undone) > 0
                c.cache = [mx.where(back.reshape(-1, *[1] * (now.ndim - 1)), old, now)
                           for old, now in zip(before[i], c.cache)]
        self._taps.tape.clear()

    def states(self, cache) -> Optional[dict]:
        """The recurrent layers' states as they are now (references: arrays are not changed in
        place), for `crop_each(before=)` to undo the plain step that comes next; None where
        the target has none."""
        return {i: list(cache[i].cache) for i in self._gdn} or None

    @property
    def batchable(self) -> bool:
        """Whether `decode.decoder.Decoder` can decode several sequences of this target at once:
        KV caches and sliding windows (made ragged, `target/ragged.py`) and Gated DeltaNet states
        (rolled back per sequence by `crop_each`); every kind the adapter rolls back."""
        return all(k in ("offset", "window", "tape") for k in self._kinds.values())

    @property
    def splits(self) -> bool:
        """Whether a batch can hold each sequence's K/V in caches of its own (`target.sequences`;
        `decode.caches` chooses by the lengths): every attention runs per sequence
        (`GroupedAttention`). Else a batch's K/V is always one padded array (`target.ragged`):
        layers that share caches."""
        return self._riders

    @property
    def recurrent(self) -> bool:
        """Whether a cropped pass must be recorded (`record=True`): the target has recurrent states."""
        return bool(self._gdn)

    def keep_rows(self, cache, rows: Sequence[int], width: int):
        """After a tree pass over `width` tokens, keep the K/V rows of tokens `rows` (ascending)
        as the pass's first rows and drop the others (`caches.keep_rows`)."""
        keep_rows(cache, rows, width)

    def keep_rows_each(self, cache, rows: Sequence[Sequence[int]], width: int):
        """`keep_rows` for a batch's caches (`target.ragged`, `target.sequences`): sequence b keeps
        rows `rows[b]`."""
        if cache and isinstance(cache[0], SequenceKV):
            cache[0].keep_rows_each(cache, rows, width, keep_rows)
            return
        for c in cache:
            c.keep_rows(rows, width)
