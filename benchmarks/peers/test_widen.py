"""The widened target decodes exactly as the demo target (greedy ids), so the demo drafter's
acceptance carries over. Builds the pair in a temporary folder (about 420 MB, a minute).

    python -m pytest benchmarks/peers/test_widen.py
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import widen  # noqa: E402


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    return widen.prepare("widened", tmp_path_factory.mktemp("pairs"))


def test_widened_is_large_and_taps_stay_valid(widened):
    info = json.loads((widened / "build.json").read_text())
    assert info["target_parameters"] >= 100e6
    cfg = json.loads((widened / "target" / "config.json").read_text())
    for d in ("drafter", "drafter-zlab"):
        dcfg = json.loads((widened / d / "config.json").read_text())
        ids = dcfg["dflash_config"]["target_layer_ids"]
        assert all(0 <= i < cfg["num_hidden_layers"] for i in ids)
        assert ids[-1] == cfg["num_hidden_layers"] - 1  # the last tap stays on the last layer


def test_widened_greedy_ids_equal_demo(widened):
    prompts = widen.default_prompt_ids(4)
    assert widen.check(widened, prompts, max_tokens=32)["identical"]
