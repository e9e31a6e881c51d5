"""Long prompts: the model's window is enforced with a clear error."""

import pytest

import dflash_mlx
from dflash_mlx.errors import DFlashError


def test_a_prompt_beyond_the_window_is_one_clear_error(pairs):
    pair = pairs["qwen3"]
    window = pair.target.args.max_position_embeddings
    with pytest.raises(DFlashError, match=f"{window + 1} tokens but the model reads at most {window} "):
        dflash_mlx.generate(pair, [5] * (window + 1), max_tokens=4)
    text, stats = dflash_mlx.generate(pair, [5] * 8, max_tokens=4)  # within it: fine
    assert stats.generation_tokens == 4
