"""A target folder checked before mlx-lm builds anything from it: its config
(readable, an object, sizes in range), its weights (present, headers intact,
as many layers as the config says) and its tokenizer files. Each problem is one
line that names the file and what to do; mlx-lm would raise a traceback or,
for a config that asks for 10**9 layers, run out of memory first."""

import re
from pathlib import Path
from typing import Dict, List

from ..config import Fields, read_json
from ..convert.readers import safetensors_header, shard_paths
from ..errors import DFlashError

# Far beyond any model mlx-lm loads, and small enough that building the model
# for a damaged config cannot exhaust memory before its weights are compared with it.
LIMITS = {
    "hidden_size": (1, 2**17),
    "num_hidden_layers": (1, 4096),
    "vocab_size": (2, 2**23),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "intermediate_size": (1, 2**21),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
AGAIN = "download the model again"


def weight_files(path: Path) -> List[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return shard_paths(index)
    return sorted(path.glob("*.safetensors"))


def read_target_config(path) -> Dict:
    """The target's config.json: an object naming its family (`model_type`)."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DFlashError(f"No config.json in {path}; --model must be an mlx-lm model directory, repo id or alias.")
    cfg = read_json(cfg_path, AGAIN)
    f = Fields(str(cfg_path))
    if not isinstance(cfg, dict):
        f.fail("the config", "a JSON object", cfg)
    if not isinstance(cfg.get("model_type"), str):
        f.fail("model_type", "a string naming an mlx-lm family", cfg.get("model_type"))
    return cfg


def check_target_files(path, cfg: Dict) -> None:
    """The config's sizes (in range), the weights (present, headers intact, as many
    layers as the config says) and the tokenizer files."""
    path = Path(path)
    cfg_path = path / "config.json"
    f = Fields(str(cfg_path))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    values = {}
    for name, (lo, hi) in LIMITS.items():
        value = text.get(name, cfg.get(name))
        if value is not None:
            values[name] = f.integer(name, value, lo, hi)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in values]
    if missing:
        raise DFlashError(f"{cfg_path} lacks {', '.join(missing)}; it is not a complete model config ({AGAIN}).")

    files = weight_files(path)
    if not files:
        raise DFlashError(f"No weights (*.safetensors) in {path}; {AGAIN}.")
    layers = set()
    for file in files:
        for key in safetensors_header(file):
            m = LAYER_KEY.search(key)
            if m:
                layers.add(int(m.group(1)))
    n = values["num_hidden_layers"]
    if layers and n > max(layers) + 1:
        raise DFlashError(f"{cfg_path} says num_hidden_layers is {n} but the weights hold "
                          f"{max(layers) + 1} layers; {AGAIN}.")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DFlashError(f"No tokenizer files in {path} ({' or '.join(TOKENIZER_FILES[:2])}); {AGAIN}.")
