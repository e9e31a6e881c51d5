"""Loading a target + drafter pair and checking that they belong together."""

import functools
import hashlib
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from safetensors import SafetensorError

from .policy.costs import CONTEXTS, CostCurve, curve_key, load_or_measure, tree_shapes
from .policy.sizer import BlockSizer
from .policy.store import Learned
from .target.adapter import TargetAdapter, hf_tokenizer, load_target, materialize, model_dims
from .constrain.compiler import Grammars
from .config import CONVERSION, DrafterConfig, check_pair
from .draft.drafter import DFlashDrafter
from .draft.drafter2 import draft_source, drafter_class, published_keys
from .errors import DFlashError
from . import kept_files
from .draft import tree as tree_lib
from .decode.timing import cycle_parts
from .draft.source import DraftSource
from .draft.lookup import WithLookup
from .policy.proposal import ProposalScales
from .sampling import SamplingParams
from .hub import Resolved, aliases, cache_root, check_name, fetch, resolve

# Safetensors dtypes a converted drafter's tensors may have (quantized weights are packed into U32).
FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass
class DFlashPair:
    target: TargetAdapter
    drafter: DFlashDrafter
    tokenizer: Any
    draft_source: DraftSource  # the drafter, with an n-gram lookup beside it
    target_path: Path
    draft_path: Path
    resolved: Optional[Resolved] = None
    group: Any = None  # the mx.distributed group the target is sharded over (None: one process)
    learned: Optional[Learned] = field(default=None, init=False, repr=False)  # what `auto` learns (`policy.store`)

    def __post_init__(self):
        self.learned = Learned(lambda **kw: self.cost_curve(**kw), lambda: self.rates_path(),
                               self.draft_source.block_size)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammars compiled for this pair's tokenizer (`constrain`), built on first use."""
        if self.tokenizer is None:
            raise DFlashError("Structured output needs the model's tokenizer; this pair was loaded without one.")
        return Grammars(hf_tokenizer(self.tokenizer), self.target.vocab_size, sorted(self.tokenizer.eos_token_ids))

    @property
    def draft_context(self) -> Optional[int]:
        """The last context rows a draft reads, when bounded (`load(draft_context=N)`); None: all
        the checkpoint's layers attend to (every row, or their windows)."""
        bound = self.drafter.context_bound
        return None if bound is None else bound[1]

    def cost_curve(self, budget: float = 10.0, progress=lambda done, total: None) -> CostCurve:
        """This machine's cycle costs per width (and of a few trees, where the target can
        verify them), measured within `budget` seconds on first use, then cached."""
        W = self.draft_source.block_size

        def trees():  # asked only when a curve is measured from scratch
            ok = self.target.can_verify_tree(self.target.make_cache()) and tree_lib.works(self.target)
            return tree_shapes(W) if ok else ()

        return load_or_measure(curve_key(self), partial(cycle_parts, self), W, cache_root(), budget=budget,
                               progress=progress, trees=trees, contexts=self.curve_contexts())

    def curve_contexts(self) -> List[int]:
        """The context lengths the cost curve times: those that leave room for the widest cycle in the window."""
        window = getattr(self.target.args, "max_position_embeddings", None)
        W = self.draft_source.block_size
        return [c for c in CONTEXTS if not window or c + W < window] or list(CONTEXTS[:1])

    def auto_sizer(self, params: Optional[SamplingParams] = None,
                   progress=lambda done, total: None) -> BlockSizer:
        """The `--block-size auto` policy at these sampling settings (default: greedy); its
        acceptance statistics last across requests (and processes) with the same settings."""
        return self.learned.sizer(params, progress)

    def proposal_scales(self, params: SamplingParams) -> ProposalScales:
        """The drafter's learned proposal scales at these sampling settings; they last across requests."""
        return self.learned.proposal_scales(params)

    def keep_rates(self, force: bool = False) -> None:
        """Write what the auto sizers learnt, for later processes (`policy.store.Learned.keep`); one rank writes."""
        if self.group is None or self.group.rank() == 0:
            self.learned.keep(force)

    def rates_path(self) -> Path:
        return cache_root() / "costs" / f"{curve_key(self)}-w{self.draft_source.block_size}-rates.json"


def converted_path(path: Path) -> Path:
    """Where the MLX conversion of the drafter at `path` is cached."""
    path = Path(path).resolve()
    h = hashlib.sha256(f"{CONVERSION}|{path}".encode())
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "converted" / f"{path.name}-{h.hexdigest()[:16]}"


def load_drafter(path: Path) -> DFlashDrafter:
    """Load an MLX drafter; a PyTorch/z-lab one is converted once and cached.
    A cached conversion that fails its checks is set aside and converted again."""
    from .convert import convert_drafter, is_converted

    path = Path(path)
    if is_converted(path):
        return load_converted(path)
    cached = converted_path(path)
    if is_converted(cached):
        try:
            return load_converted(cached)
        except DFlashError as e:
            kept_files.set_aside(cached, "converted drafter", str(e))
    convert_drafter(str(path), str(cached), force=2)  # our own cache entry
    return load_converted(cached)


def load_converted(path: Path) -> DFlashDrafter:
    """A drafter in the MLX layout, every tensor checked against its config (name,
    shape, dtype) and every header by safetensors before anything is loaded."""
    from .convert.convert import FORMAT, file_digest
    from .convert.readers import safetensors_header

    config = DrafterConfig.from_file(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"No *.safetensors weights in {path}; convert the drafter with `dflash-mlx convert`.")
    written = json.loads((path / "config.json").read_text()).get(FORMAT, {}).get("sha256")
    if written is not None and (not (path / "model.safetensors").is_file()
                                or file_digest(path / "model.safetensors") != written):
        raise DFlashError(f"{path / 'model.safetensors'} does not match the checksum written when it was converted; "
                          "convert it again.")
    header = {}
    for f in files:
        header.update({k[len("model."):] if k.startswith("model.") else k: v for k, v in safetensors_header(f).items()})
    if config.is_dflash2:
        header = published_keys(header)
    model = drafter_class(config)(config)  # lazy: nothing is allocated until the weights replace its arrays
    if config.quantization:
        q = config.quantization
        nn.quantize(
            model,
            group_size=q.get("group_size", 64),
            bits=q.get("bits", 4),
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in header,
        )
    expected = dict(tree_flatten(model.parameters()))
    problem = next((f"unknown tensor {k}" for k in sorted(set(header) - set(expected))), None) or \
        next((f"missing tensor {k}" for k in sorted(set(expected) - set(header))), None) or \
        next((f"tensor {k} has shape {header[k][1]}, not {tuple(v.shape)}" for k, v in expected.items()
              if header[k][1] != tuple(v.shape)), None) or \
        next((f"tensor {k} has dtype {header[k][0]}" for k, v in expected.items()
              if header[k][0] not in (("U32",) if v.dtype == mx.uint32 else FLOAT_DTYPES)), None)
    if problem:
        raise DFlashError(f"Drafter weights in {path} do not match its config: {problem}; convert it again.")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, SafetensorError) as e:
            raise DFlashError(f"Cannot read {f} ({str(e).splitlines()[0]}); the file is corrupt, convert it again.")
    weights = {k[len("model."):] if k.startswith("model.") else k: v for k, v in weights.items()}
    if config.is_dflash2:
        weights = published_keys(weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def check_draft_context(config: DrafterConfig, draft_context: Optional[int]) -> None:
    """A bound on the drafter's context (`--draft-context`) is for drafters whose
    layers all attend to the whole context; one declaring its own windows or
    causal layers keeps its own definition."""
    if draft_context is None:
        return
    if isinstance(draft_context, bool) or not isinstance(draft_context, int) or draft_context < 1:
        raise DFlashError(f"--draft-context must be a positive number of rows, not {draft_context!r}.")
    n = config.num_hidden_layers
    if any(config.layer_is_causal(i) or config.layer_window(i) is not None for i in range(n)):
        raise DFlashError("--draft-context bounds drafters whose layers all attend to the whole context; "
                          "this drafter declares its own windows or causal layers: leave it out.")


def load(model: str, draft: Optional[str] = None, target_loader=None,
         draft_context: Optional[int] = None) -> DFlashPair:
    """Load a target (alias, repo id or directory) and its DFlash drafter.

    `target_loader(path)` -> (model, tokenizer, config) loads the target from
    its local directory (`adapter.load_target` unless given; e.g. a sharded
    loader, `distributed.load_sharded`). The drafter attends to the context as
    its checkpoint defines (every row, or its layers' windows); `draft_context`
    N lets its blocks read only the first `CONTEXT_SINKS` and the last N rows
    instead, which keeps a draft's cost flat on long contexts and changes the
    drafts beyond N rows (output stays exact)."""
    resolved = resolve(model, draft)
    check_name(resolved.target, "model")
    if resolved.draft is None:
        raise DFlashError(
            f"No DFlash drafter is known for '{model}'; pass one with --draft (repo id or directory)."
        )
    # The drafter's config first: one that cannot run is refused before the target downloads.
    config = DrafterConfig.from_file(fetch(resolved.draft, "config") / "config.json")
    check_draft_context(config, draft_context)
    target_path = fetch(resolved.target, "model")
    draft_path = fetch(resolved.draft, "draft")
    model_, tokenizer, target_config = (target_loader or load_target)(target_path)
    check_pair(config, *model_dims(model_))
    adapter = TargetAdapter(model_, config.target_layer_ids, quantization=target_config.get("quantization"))
    drafter = load_drafter(draft_path)
    if not drafter.args.quantization:
        drafter.set_dtype(adapter.dtype)
    if resolved.alias is not None and aliases().get(resolved.alias, {}).get("builtin") \
            and mx.default_device() == mx.cpu:
        # The CPU backend has no fast half-precision matmul; the demo is tiny.
        model_.set_dtype(mx.float32)
        drafter.set_dtype(mx.float32)
    materialize(model_)
    materialize(drafter)
    drafter.bound_context(draft_context)
    return DFlashPair(
        target=adapter,
        drafter=drafter,
        tokenizer=tokenizer,
        draft_source=WithLookup(draft_source(drafter, adapter)),
        target_path=target_path,
        draft_path=draft_path,
        resolved=resolved,
    )
