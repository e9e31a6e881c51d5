"""Training a DFlash drafter for a target, on the target's own outputs.

1. Data is on-policy: the target answers the prompts (greedy or sampled);
   the drafter learns to predict exactly what the target will verify.
2. Each step takes one sequence, runs the frozen target once for its tapped
   hidden states, picks random anchors in the response and trains all blocks
   `[anchor token, MASK x (b-1)]` in one pass (`block_mask`).
3. Loss: cross-entropy on the b-1 masked positions, position k weighted by
   exp(-(k-1)/gamma). AdamW, warmup then cosine decay, gradient clipping.
4. DFlash 2 drafters (`arch="dflash2"`) add their candidate selector's
   objective (`CandidateSelector.loss`): cross-entropy of its scores over the
   draft head's top-k candidates at each position, the true previous token as
   predecessor, positions whose label is not a candidate skipped, with the
   same position weights. It trains the codebooks and the projection only
   (the body's hidden states and logits enter it without gradient).
"""

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .target import baseline
from .target.adapter import TargetAdapter, model_dims
from .config import DrafterConfig, check_pair, default_target_layer_ids
from .draft.drafter import DFlashDrafter
from .draft.drafter2 import DFlash2Drafter, drafter_class
from .errors import DFlashError

GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size in GAMMAS:
        return GAMMAS[block_size]
    return max(1.0, 0.375 * block_size + 1.0)


@dataclass
class TrainConfig:
    block_size: int = 16
    layers: int = 5
    target_layers: Optional[List[int]] = None
    steps: Optional[int] = None
    epochs: int = 1
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    blocks_per_seq: int = 16
    max_new_tokens: int = 256
    temp: float = 0.0
    heldout: float = 0.05
    save_every: int = 200
    eval_every: int = 50
    seed: int = 0
    gamma: Optional[float] = None
    mask_token_id: Optional[int] = None
    arch: str = "dflash"  # or "dflash2": convolutions, sliding windows and a candidate selector
    sliding_window: int = 512  # DFlash 2's window over the committed context
    selector_top_k: int = 8
    init: Optional[str] = None  # a drafter folder whose weights start the run (fine-tuning)


@dataclass
class Example:
    prompt: List[int]
    response: List[int]

    @property
    def tokens(self):
        return self.prompt + self.response


# --- data ---------------------------------------------------------------------


def read_prompts(path: Path, tokenizer, chunk_tokens: int = 64) -> List[List[int]]:
    """Prompt ids from a .jsonl file ("prompt", "text" or chat "messages") or
    a directory of text files (split into ~chunk_tokens pieces at line ends)."""
    path = Path(path)
    prompts = []
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                continue
            piece = []
            for line in text.splitlines(keepends=True):
                piece.append(line)
                ids = tokenizer.encode("".join(piece))
                if len(ids) >= chunk_tokens:
                    prompts.append(ids)
                    piece = []
    elif path.is_file():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise DFlashError(f"--data {path} is not UTF-8 text; give a prompts .jsonl file.")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                raise DFlashError(f"{path}:{n} is not valid JSON; each line must be an object with 'prompt'.")
            if not isinstance(row, dict):
                raise DFlashError(f"{path}:{n} must be a JSON object with 'prompt', 'text' or 'messages'.")
            if "messages" in row and getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
                prompts.append(tokenizer.encode(text, add_special_tokens=False))
            elif isinstance(row.get("prompt") or row.get("text"), str):
                prompts.append(tokenizer.encode(row.get("prompt") or row.get("text")))
            else:
                raise DFlashError(f"{path}:{n} has no 'prompt' (or 'text'/'messages') string.")
    else:
        raise DFlashError(f"--data {path} does not exist; give a prompts .jsonl file or a directory of text files.")
    prompts = [p for p in prompts if p]
    if len(prompts) < 2:
        raise DFlashError(f"--data {path} yields {len(prompts)} prompt{'' if len(prompts) == 1 else 's'}; at least 2 are needed.")
    return prompts


def build_dataset(model, tokenizer, prompts, max_new_tokens, temp, out: Path, seed: int,
                  progress: Callable[[int, int], None] = lambda i, n: None) -> List[Example]:
    """Target responses to `prompts` from mlx-lm's own decoding loop on `model`
    (as loaded: no adapter wrappers), cached in out/data.jsonl (resumable)."""
    path = out / "data.jsonl"
    done = []
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done.append(Example(row["prompt"], row["response"]))
    with open(path, "a") as f:
        for i in range(len(done), len(prompts)):
            mx.random.seed(seed + i)
            response = baseline.generate(model, tokenizer, prompts[i], max_new_tokens, temp)["tokens"]
            ex = Example(list(prompts[i]), response)
            f.write(json.dumps(asdict(ex)) + "\n")
            f.flush()
            done.append(ex)
            progress(i + 1, len(prompts))
    return done


# --- model ----------------------------------------------------------------------


def find_mask_token(tokenizer, vocab_size: int) -> int:
    for tok, i in sorted(tokenizer.get_vocab().items(), key=lambda x: x[1]):
        if "mask" in tok.lower() and tok.startswith("<") and i < vocab_size:
            return i
    if len(tokenizer.get_vocab()) < vocab_size:
        return len(tokenizer.get_vocab())  # an embedding row no text token uses
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return pad
    raise DFlashError("The target's tokenizer has no mask, spare or pad token; pass --mask-token-id.")


def drafter_config_for(target_model, tokenizer, cfg: TrainConfig) -> dict:
    """A z-lab layout config for a new drafter sized like the target."""
    lm = getattr(target_model, "language_model", target_model)
    args = lm.args
    n_target = len(lm.model.layers)
    taps = cfg.target_layers or default_target_layer_ids(n_target, cfg.layers)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else find_mask_token(tokenizer, args.vocab_size)
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    rope_theta = getattr(args, "rope_theta", None) or 10000.0
    if cfg.arch not in ("dflash", "dflash2"):
        raise DFlashError(f"--arch must be dflash or dflash2 (got {cfg.arch}).")
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.rms_norm_eps,
        "attention_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": getattr(args, "max_position_embeddings", 32768),
        "rope_theta": float(rope_theta),
        "rope_scaling": None,
        "layer_types": ["full_attention"] * cfg.layers,
        "sliding_window": None,
        "num_target_layers": n_target,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": mask, "target_layer_ids": taps},
    }
    if cfg.arch == "dflash2":
        group = next(g for g in (16, 8, 4, 2, 1) if args.hidden_size % g == 0)
        config.update(architectures=["DFlash2DraftModel"], is_causal=False, use_sliding_window=True,
                      layer_types=["sliding_attention"] * cfg.layers, sliding_window=cfg.sliding_window)
        config["dflash_config"].update(conv_kernel_size=2, conv_group_size=group,
                                       selector_rank=min(256, args.hidden_size // 4),
                                       selector_top_k=cfg.selector_top_k)
    return config


def sample_anchors(example: Example, block_size: int, count: int, rng) -> Optional[np.ndarray]:
    """Random anchor positions in the response with a full block of labels."""
    lo, hi = len(example.prompt), len(example.tokens) - block_size
    if hi < lo:
        return None
    return np.sort(rng.choice(np.arange(lo, hi + 1), size=min(count, hi - lo + 1), replace=False))


def block_batch(target: TargetAdapter, example: Example, anchors: np.ndarray, dcfg: DrafterConfig):
    """(target taps, block embeddings, anchor positions, labels [N, b-1], predecessors [N, b-1])."""
    tokens = mx.array(example.tokens)
    a = mx.array(anchors)
    offs = mx.arange(dcfg.block_size)
    labels = tokens[a[:, None] + offs[None, 1:]]
    prev = tokens[a[:, None] + offs[None, :-1]]
    blocks = mx.concatenate(
        [tokens[a][:, None], mx.full((len(anchors), dcfg.block_size - 1), dcfg.mask_token_id)], axis=1
    )
    emb = target.embed(blocks)
    if dcfg.input_embedding_scale != 1.0:
        emb = emb * dcfg.input_embedding_scale
    _, hidden = target(tokens[None], None)
    return mx.stop_gradient(hidden), mx.stop_gradient(emb), a, labels, prev


def block_loss(drafter, target, hidden, emb, anchors, labels, prev, weights):
    h = drafter.forward_blocks(emb, hidden, anchors)[:, 1:]
    logits = drafter.finish_logits(target.head(h))
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    loss = (ce * weights).sum() / (weights.sum() * labels.shape[0])
    if isinstance(drafter, DFlash2Drafter):
        selector = drafter.candidate_selector
        loss = loss + selector.loss(mx.stop_gradient(h), mx.stop_gradient(logits), prev, labels, weights)
    return loss


def guesses(drafter, target, hidden, emb, anchors, labels, prev):
    """The drafter's greedy draft for each block [N, b-1] (DFlash 2: its selector's path)."""
    h = drafter.forward_blocks(emb, hidden, anchors)[:, 1:]
    logits = drafter.finish_logits(target.head(h))
    if isinstance(drafter, DFlash2Drafter):
        return drafter.candidate_selector.greedy_paths(h, logits, prev[:, 0])
    return mx.argmax(logits, axis=-1)


def acceptance_estimate(drafter, target, examples: List[Example], dcfg: DrafterConfig, limit: int = 256) -> float:
    """Mean greedy acceptance length per cycle on held-out target outputs.

    The drafter's guesses for every anchor come from one batched pass; then
    each response is walked as the decode loop would: from the first
    generated token, a cycle commits 1 + its leading correct guesses and the
    next cycle starts there. (Averaging over all anchors instead would weight
    long accepted runs by their length and overstate the per-cycle figure.)
    """
    committed = cycles = 0
    for ex in examples:
        lo, hi = len(ex.prompt), len(ex.tokens) - dcfg.block_size
        if hi < lo:
            continue
        anchors = np.arange(lo, min(hi, lo + limit - 1) + 1)
        batch = block_batch(target, ex, anchors, dcfg)
        guess, labels = guesses(drafter, target, *batch), batch[3]
        runs = mx.cumprod((guess == labels).astype(mx.int32), axis=1).sum(axis=1).tolist()
        pos = 0
        while pos < len(runs):
            committed += runs[pos] + 1
            cycles += 1
            pos += runs[pos] + 1
    return committed / cycles if cycles else float("nan")


# --- checkpoints ------------------------------------------------------------------


def initial_weights(path: str, dcfg: DrafterConfig) -> Dict[str, mx.array]:
    """The weights of the drafter at `path`, which must have the shape this run trains."""
    from .pair import load_drafter

    start = load_drafter(Path(path))
    have = start.args
    for name in ("is_dflash2", "hidden_size", "num_hidden_layers", "block_size", "mask_token_id",
                 "target_layer_ids", "vocab_size"):
        if getattr(have, name) != getattr(dcfg, name):
            raise DFlashError(f"--init {path} has {name}={getattr(have, name)} but this run trains "
                              f"{name}={getattr(dcfg, name)}; pass matching --layers/--block-size/--target-layers/"
                              "--arch, or train from scratch.")
    return {k: v.astype(mx.float32) for k, v in tree_flatten(start.parameters())}


def save_zlab(path: Path, drafter: DFlashDrafter, config: dict) -> None:
    """The z-lab layout: config.json + model.safetensors, keys as published."""
    params = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))


def save_checkpoint(out: Path, step: int, drafter, optimizer, config: dict, state: dict) -> Path:
    from .convert.convert import write_atomic

    ckpt = out / "checkpoints" / f"step-{step:07d}"

    def write(tmp: Path):
        save_zlab(tmp, drafter, config)
        opt = dict(tree_flatten(optimizer.state))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), {k: v for k, v in opt.items() if isinstance(v, mx.array)})
        (tmp / "state.json").write_text(json.dumps(dict(state, step=step)))

    write_atomic(ckpt, True, write)
    for old in sorted((out / "checkpoints").glob("step-*"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return ckpt


def latest_checkpoint(out: Path) -> Optional[Path]:
    ckpts = sorted((out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else []
    return ckpts[-1] if ckpts else None


# --- the loop ---------------------------------------------------------------------


def schedule(cfg: TrainConfig, total: int):
    warm = max(1, int(cfg.warmup * total))
    return optim.join_schedules(
        [optim.linear_schedule(cfg.lr * 1e-3, cfg.lr, warm),
         optim.cosine_decay(cfg.lr, max(1, total - warm), cfg.lr * 0.1)],
        [warm],
    )


def train(target_model, tokenizer, prompts, out: Path, cfg: TrainConfig, resume: bool = False,
          on_data=lambda i, n: None, on_step=lambda step, total, loss, acc: None) -> Dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = out / "train_config.json"
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not resume:
        raise DFlashError(f"{out} already holds checkpoints; pass --resume to continue, or choose another --out.")
    if resume and ckpt is not None:
        saved = json.loads(settings.read_text())
        cfg = TrainConfig(**saved["train"])
        config = saved["drafter"]
    else:
        config = drafter_config_for(target_model, tokenizer, cfg)
        settings.write_text(json.dumps({"train": asdict(cfg), "drafter": config}, indent=2))
    dcfg = DrafterConfig.from_dict(config)
    check_pair(dcfg, *model_dims(target_model))  # before the data is generated
    init = initial_weights(cfg.init, dcfg) if cfg.init and ckpt is None else None
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    weights = mx.exp(-mx.arange(cfg.block_size - 1) / gamma)

    # The target's outputs come from plain mlx-lm, before the adapter wraps the model.
    examples = build_dataset(target_model, tokenizer, prompts, cfg.max_new_tokens, cfg.temp, out, cfg.seed, on_data)
    target = TargetAdapter(target_model, dcfg.target_layer_ids)
    order = np.random.default_rng(cfg.seed).permutation(len(examples))
    n_held = max(1, int(round(cfg.heldout * len(examples))))
    held = [examples[i] for i in order[:n_held]]
    train_set = [examples[i] for i in order[n_held:]]
    if not train_set:
        raise DFlashError("Too few prompts: all went to the held-out set; give more prompts.")
    total = cfg.steps or cfg.epochs * len(train_set)

    mx.random.seed(cfg.seed)
    drafter = drafter_class(dcfg)(dcfg)
    if init is not None:
        drafter.load_weights(list(init.items()), strict=True)
    elif isinstance(drafter, DFlash2Drafter):
        drafter.init_for_training()
    optimizer = optim.AdamW(learning_rate=schedule(cfg, total), weight_decay=cfg.weight_decay)
    optimizer.init(drafter.trainable_parameters())
    start = 0
    if resume and ckpt is not None:
        drafter.load_weights(str(ckpt / "model.safetensors"))
        opt_state = mx.load(str(ckpt / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(opt_state.items()))
        start = json.loads((ckpt / "state.json").read_text())["step"]
    mx.eval(drafter.parameters(), optimizer.state)

    loss_and_grad = nn.value_and_grad(drafter, lambda m, *a: block_loss(m, target, *a, weights))
    acc = float("nan")
    loss = float("nan")
    for step in range(start, total):
        epoch, i = divmod(step, len(train_set))
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(len(train_set))
        ex = train_set[perm[i]]
        anchors = sample_anchors(ex, cfg.block_size, cfg.blocks_per_seq, np.random.default_rng([cfg.seed, step]))
        if anchors is not None:
            batch = block_batch(target, ex, anchors, dcfg)
            value, grads = loss_and_grad(drafter, *batch)
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            optimizer.update(drafter, grads)
            mx.eval(drafter.parameters(), optimizer.state, value)
            loss = value.item()
        done = step + 1
        if done % cfg.eval_every == 0 or done == total:
            acc = acceptance_estimate(drafter, target, held, dcfg)
        if done % cfg.save_every == 0 or done == total:
            save_checkpoint(out, done, drafter, optimizer, config, {"loss": loss, "acceptance": acc})
        on_step(done, total, loss, acc)

    final = latest_checkpoint(out)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(final / name, out / name)
    from .convert import convert_drafter

    # From the checkpoint: out/mlx lies inside out, which convert refuses.
    convert_drafter(str(final), str(out / "mlx"), dtype="float16", force=2)
    summary = {"steps": total, "loss": loss, "heldout_acceptance": acc, "examples": len(examples),
               "heldout_examples": len(held), "gamma": gamma}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
