"""The benchmark pairs `benchmarks/peers/widen.py` builds load as they are: the float32
drafter copy carries its own checksum, so `dflash_mlx.load` accepts it."""

import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import dflash_mlx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

import widen  # noqa: E402


def test_the_demo_benchmark_pair_loads_in_float32(tmp_path):
    pair_dir = widen.prepare("demo", tmp_path)
    pair = dflash_mlx.load(str(pair_dir / "target"), str(pair_dir / "drafter"))
    assert {v.dtype for _, v in tree_flatten(pair.drafter.parameters())} == {mx.float32}
    _, stats = dflash_mlx.generate(pair, pair.tokenizer.encode("def add(a, b):"), max_tokens=4, block_size=4)
    assert stats.generation_tokens == 4
