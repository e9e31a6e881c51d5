"""Train the demo chat target (`--model demo-chat`): a small Gemma 4-architecture model whose four layers
all attend over a sliding window of 2,048 tokens, on the synthetic agent conversations of chat_data.py.

The window bounds what the model reads, so agent prompts of any length (Claude Code's first request is
about 20k tokens) look to it as its training did. Its chat template (chat_template.jinja) is ChatML
with JSON tool calls as Qwen3 writes them; it repeats the tools' names after the last user message.
The loss is taken on the assistant turns only. Writes an mlx-lm model folder and a training summary.
Run with OpenBLAS on Linux (see benchmarks/demo/README.md).
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import List

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat_data  # noqa: E402
from train_target import schedule  # noqa: E402

HERE = Path(__file__).resolve().parent
SPECIAL = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Tokens of one padded batch: small batches give a short run more updates for the same time.
BATCH_TOKENS = 4096
# Sequence lengths are padded up to a multiple of this, so that batches take few distinct shapes.
LENGTH_STEP = 256


def train_tokenizer(texts: List[str], vocab_size: int, out: Path):
    """A byte-level BPE over the conversations' own text; the chat markers are whole tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Reasoning and tool-call markers stay in decoded text (as Qwen3's do): the server reads them there.
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=131072)
    fast.chat_template = (HERE / "chat_template.jinja").read_text()
    fast.save_pretrained(str(out))
    # Named here, so that loading the tokenizer does not read the model's config.json.
    cfg_path = out / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), tokenizer_class="PreTrainedTokenizerFast"),
                                   indent=2))
    return fast


def corpus(examples: List[chat_data.Example]) -> List[str]:
    """Every text a conversation holds, markers left out."""
    texts, seen = [], set()
    for ex in examples:
        key = json.dumps([t["function"]["name"] for t in ex.tools])
        if key not in seen:
            seen.add(key)
            texts.append(json.dumps(ex.tools, ensure_ascii=False))
        for m in ex.messages:
            texts += [m.get("content") or "", m.get("reasoning_content") or ""]
            texts += [json.dumps(c["function"], ensure_ascii=False) for c in m.get("tool_calls", [])]
    return [t for t in texts if t]


def encode(tok, ex: chat_data.Example, max_len: int, anchored: float, rng: random.Random):
    """Token ids and, per next-token target, whether it is learned. At most the last `max_len` + 1
    tokens; a share `anchored` of conversations starts a little before its request, which spends
    the steps on the part a turn depends on."""
    ids, learned, user = [], [], None
    for piece in chat_data.pieces(tok, ex):
        p = tok.encode(piece.text, add_special_tokens=False)
        if user is None:  # the request: the last user message before the first answer
            head = piece.text[:max(0, piece.text.rfind("<|im_start|>user"))]
            user = len(ids) + len(tok.encode(head, add_special_tokens=False))
        ids += p
        learned += [piece.learned] * len(p)
    start = max(0, len(ids) - max_len - 1)
    if rng.random() < anchored:
        start = max(start, user - rng.randint(0, 256))
    return np.array(ids[start:], np.int32), np.array(learned[start + 1:], np.float32)


def batches(encoded, rng: np.random.Generator):
    """Batches of examples of similar length, BATCH_TOKENS at most, in random order."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    out, cur, width = [], [], 0
    for i in order:
        w = -(-(len(encoded[i][0]) - 1) // LENGTH_STEP) * LENGTH_STEP
        if cur and max(width, w) * (len(cur) + 1) > BATCH_TOKENS:
            out.append((cur, width))
            cur, width = [], 0
        cur.append(i)
        width = max(width, w)
    if cur:
        out.append((cur, width))
    rng.shuffle(out)
    return out


def stack(encoded, rows: List[int], width: int):
    x = np.zeros((len(rows), width), np.int32)
    y = np.zeros((len(rows), width), np.int32)
    w = np.zeros((len(rows), width), np.float32)
    for r, i in enumerate(rows):
        ids, learned = encoded[i]
        n = len(ids) - 1
        x[r, :n], y[r, :n], w[r, :n] = ids[:-1], ids[1:], learned
    flat = np.flatnonzero(w.reshape(-1))
    # The learned positions, padded to a multiple of LENGTH_STEP with a weightless position.
    k = -(-len(flat) // LENGTH_STEP) * LENGTH_STEP
    idx = np.concatenate([flat, np.zeros(k - len(flat), np.int64)])
    wk = np.concatenate([np.ones(len(flat), np.float32), np.zeros(k - len(flat), np.float32)])
    return mx.array(x), mx.array(y.reshape(-1)[idx]), mx.array(idx.astype(np.int32)), mx.array(wk)


def loss_fn(model, x, y, idx, w):
    """Cross-entropy on the learned positions only: the head runs on those rows alone."""
    B, L = x.shape
    h = model.model(x).reshape(B * L, -1)[idx]
    logits = model.model.embed_tokens.as_linear(h)
    cap = model.final_logit_softcapping
    logits = mx.tanh(logits / cap) * cap
    return (nn.losses.cross_entropy(logits, y) * w).sum() / w.sum()


def greedy_turns(model, tok, examples: List[chat_data.Example], limit: int) -> float:
    """Share of held-out assistant turns the model writes exactly, greedily, from their prompts."""
    from mlx_lm.generate import generate

    good = total = 0
    for ex in examples:
        for i in ex.turns():
            if total >= limit:
                return good / max(total, 1)
            prompt = tok.apply_chat_template(ex.messages[:i], tools=ex.tools or None, tokenize=False,
                                             add_generation_prompt=True, enable_thinking=ex.thinking)
            want = chat_data.pieces(tok, chat_data.Example(ex.kind, ex.messages[:i + 1], ex.tools, ex.thinking))
            want = want[-1].text[:-len(chat_data.END)]
            ids = tok.encode(prompt, add_special_tokens=False)[-4096:]
            got = generate(model, tok, ids, max_tokens=len(tok.encode(want)) + 8, verbose=False)
            good += got.strip() == want.strip()
            total += 1
    return good / max(total, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="dflash_mlx/demo/chat-target")
    ap.add_argument("--conversations", type=int, default=12000)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=2048, help="keep each conversation's last MAX_LEN tokens")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-turns", type=int, default=60, help="held-out turns written greedily at the end")
    ap.add_argument("--anchored", type=float, default=0.7,
                    help="share of conversations that start shortly before their request, not a window back")
    ap.add_argument("--init", help="go on from this model folder (its weights and tokenizer)")
    ap.add_argument("--kinds", default=",".join(f"{k}={v}" for k, v in chat_data.KINDS.items()),
                    help="request shells and their weights, e.g. agents=1,synthetic=1")
    ap.add_argument("--tasks", default=",".join(f"{k}={v}" for k, v in chat_data.TASKS.items()),
                    help="tasks and their weights, e.g. list_read_one=2,list=1")
    ap.add_argument("--prose", type=float, default=0.0,
                    help="share of conversations whose files are written with the docstrings' thousands of words, "
                         "not the short list (so that answering about a file means copying it)")
    ap.add_argument("--invented", type=float, default=0.0,
                    help="share of conversations whose files are written with words made up for each one")
    ap.add_argument("--summary", help="write the run's figures here (default: training.json in --out)")
    args = ap.parse_args()
    weights = {}
    for name, known in (("kinds", chat_data.KINDS), ("tasks", chat_data.TASKS)):
        try:
            weights[name] = {k: float(v) for k, v in (part.split("=") for part in getattr(args, name).split(","))}
        except ValueError:
            ap.error(f"--{name}: write NAME=WEIGHT pairs joined by commas, e.g. {next(iter(known))}=1")
        unknown = sorted(set(weights[name]) - set(known))
        if unknown:
            ap.error(f"--{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")

    try:
        chat_data.check_shares(args.prose, args.invented)
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(args.seed)
    tic = time.time()
    examples = chat_data.examples(args.conversations, args.seed, weights["kinds"], weights["tasks"],
                                  args.prose, args.invented)
    held = chat_data.examples(40, args.seed + 1000, prose=args.prose, invented=args.invented)
    if args.init:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.init)
        tok.save_pretrained(str(out))
    else:
        tok = train_tokenizer(corpus(examples[:3000]), args.vocab, out)
    crop = random.Random(args.seed)
    encoded = [encode(tok, ex, args.max_len, args.anchored, crop) for ex in examples]
    tokens = sum(len(e[0]) for e in encoded)
    print(f"{len(examples)} conversations, {tokens} tokens, {sum(e[1].sum() for e in encoded):.0f} learned; "
          f"vocab {len(tok)}; {time.time() - tic:.0f} s", flush=True)

    from mlx_lm.models import gemma4_text

    heads = args.hidden // 64
    cfg = dict(model_type="gemma4_text", hidden_size=args.hidden, num_hidden_layers=args.layers,
               intermediate_size=3 * args.hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
               head_dim=64, global_head_dim=64, vocab_size=len(tok), vocab_size_per_layer_input=len(tok),
               num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=args.window,
               layer_types=["sliding_attention"] * args.layers, final_logit_softcapping=30.0,
               use_double_wide_mlp=False, tie_word_embeddings=True, rms_norm_eps=1e-6,
               max_position_embeddings=131072, eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), 0],
               bos_token_id=0, pad_token_id=0, torch_dtype="float16")
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    if args.init:
        model.load_weights(str(Path(args.init) / "model.safetensors"))
        model.set_dtype(mx.float32)
    opt = optim.AdamW(learning_rate=schedule(args.lr, args.steps, max(1, min(50, args.steps // 10))), weight_decay=0.05)
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    rng = np.random.default_rng(args.seed)
    plan, step, losses = [], 0, []
    tic = time.time()
    while step < args.steps:
        if not plan:
            plan = batches(encoded, rng)
        rows, width = plan.pop()
        loss, grads = loss_and_grad(model, *stack(encoded, rows, width))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.state, opt.state, loss)
        losses.append(loss.item())
        step += 1
        if step % 20 == 0 or step == args.steps:
            left = (time.time() - tic) / step * (args.steps - step)
            print(f"step {step}/{args.steps} loss {np.mean(losses[-20:]):.3f} ({time.time() - tic:.0f} s, "
                  f"{left / 60:.0f} min left)", flush=True)
    wall = time.time() - tic

    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())},
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    exact = greedy_turns(model, tok, held, args.eval_turns)  # in float32: the CPU backend's fast matmul
    info = dict(vars(args), python=sys.version.split()[0], mlx=mx.__version__, tokens=int(tokens),
                final_loss=round(float(np.mean(losses[-50:])), 3), wall_seconds=round(wall),
                heldout_turns_exact=round(exact, 3),
                parameters=sum(v.size for _, v in tree_flatten(model.parameters())))
    Path(args.summary or out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
