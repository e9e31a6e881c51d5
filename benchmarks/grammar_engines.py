"""llguidance against xgrammar on the `json` suite's schemas and a set of harder JSON-Schema
features: compile time, mask time per token along an output the grammar allows, and which
schemas each engine takes.

The vocabulary matters for mask time: `--vocab N` trains a byte-level BPE of N tokens on the
Python standard library's sources (offline, about a minute), a stand-in for a model's 150k-token
vocabulary; `--tokenizer DIR` uses a model's own. Each schema's output is a seeded walk through
llguidance's masks (up to `--tokens` tokens); both engines replay the same tokens.

    pip install "xgrammar>=0.2.8,<0.3"   # not a dependency of dflash-mlx
    python benchmarks/grammar_engines.py --vocab 100000 --out benchmarks/results/grammar-engines.json
"""

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

SUITE = Path(__file__).resolve().parents[1] / "dflash_mlx" / "suites" / "json.jsonl"

# Features beyond the suite's: each engine is asked to compile these, and to walk them.
FEATURES = {
    "recursive_ref": {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "oneOf": {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                         "required": ["kind", "r"], "additionalProperties": False},
                        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                         "required": ["kind", "side"], "additionalProperties": False}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "string_lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["code"], "additionalProperties": False},
    "format_date": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                    "required": ["when"], "additionalProperties": False},
    "pattern_properties": {"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
                           "additionalProperties": False},
    "min_max_items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "big_enum": {"type": "string", "enum": [f"value_{i:04d}" for i in range(2000)]},
    "unique_items": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "number_bounds": {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
                      "required": ["p"], "additionalProperties": False},
}


def train_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens trained on the standard library's Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    files = [str(p) for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")][:3000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def walk(tokenizer, schema, n: int, seed: int):
    """A seeded walk through llguidance's masks: tokens the schema allows, up to `n` (or to its end)."""
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    lt = llguidance.hf.from_tokenizer(tokenizer)
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(schema))
    rng, bits, out = random.Random(seed), allocate_token_bitmask(1, lt.vocab_size), []
    eos = tokenizer.eos_token_id
    for _ in range(n):
        fill_next_token_bitmask(m, bits)
        allowed = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: lt.vocab_size])
        allowed = [t for t in allowed.tolist() if t != eos]
        if not allowed:
            break
        # Prefer closing what is open now and then, so walks end: a random token otherwise.
        t = rng.choice(allowed)
        m.consume_token(t)
        out.append(t)
        if m.is_stopped():
            break
    return out


def time_llguidance(tokenizer, schema, tokens):
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    lt = llguidance.hf.from_tokenizer(tokenizer)
    tic = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - tic
    if m.is_error():
        return {"error": m.get_error()[:200]}
    bits, masks = allocate_token_bitmask(1, lt.vocab_size), []
    for t in tokens:
        tic = time.perf_counter()
        fill_next_token_bitmask(m, bits)
        masks.append(time.perf_counter() - tic)
        if not m.consume_token(t):
            return {"error": "rejected the walk: " + m.get_error()[:200]}
    return {"compile_s": compile_s, "mask_us": [s * 1e6 for s in masks]}


def time_xgrammar(tokenizer, schema, tokens):
    import xgrammar as xg
    info = xg.TokenizerInfo.from_huggingface(tokenizer)
    tic = time.perf_counter()
    try:
        compiled = xg.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema))
    except Exception as e:  # an unsupported schema
        return {"error": str(e).splitlines()[0][:200]}
    compile_s = time.perf_counter() - tic
    m = xg.GrammarMatcher(compiled)
    bits, masks = xg.allocate_token_bitmask(1, info.vocab_size), []
    for t in tokens:
        tic = time.perf_counter()
        m.fill_next_token_bitmask(bits)
        masks.append(time.perf_counter() - tic)
        if not m.accept_token(t):
            return {"error": "rejected the walk"}
    return {"compile_s": compile_s, "mask_us": [s * 1e6 for s in masks]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=100000)
    ap.add_argument("--tokenizer", help="a model folder whose tokenizer to use instead")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        print(f"training a {a.vocab}-token byte-level BPE ...", file=sys.stderr)
        tokenizer = train_tokenizer(a.vocab)
    schemas = {json.loads(line)["name"]: json.loads(line)["schema"] for line in SUITE.read_text().splitlines()}
    schemas.update(FEATURES)
    rows = {}
    for name, schema in schemas.items():
        try:
            tokens = walk(tokenizer, schema, a.tokens, a.seed)
        except Exception:  # llguidance refuses it: nothing to replay
            tokens = []
        rows[name] = {"tokens": len(tokens), "llguidance": time_llguidance(tokenizer, schema, tokens),
                      "xgrammar": time_xgrammar(tokenizer, schema, tokens)}
        cells = []
        for engine in ("llguidance", "xgrammar"):
            r = rows[name][engine]
            cells.append(f"refused ({r['error'][:60]})" if "error" in r else
                         f"{r['compile_s'] * 1e3:.1f} ms, {np.median(r['mask_us']):.0f} us/token")
        print(f"{name:20s} {len(tokens):4d} tokens | " + " | ".join(cells), file=sys.stderr)
    meta = {"vocab": len(tokenizer), "machine": os.uname().machine, "cpus": os.cpu_count(),
            "llguidance": version("llguidance"), "xgrammar": version("xgrammar")}
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "schemas": rows}, indent=1))


if __name__ == "__main__":
    main()
