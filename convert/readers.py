"""Reading drafter checkpoints without running code.

Safetensors headers are validated before loading. PyTorch checkpoints (the
zip format of `torch.save`) are read by a restricted unpickler that admits
tensors, parameters and plain containers only, and never imports torch.
"""

import json
import pickle
import zipfile
from pathlib import Path
from typing import Dict

import mlx.core as mx
import numpy as np

from dflash_mlx.errors import DFlashError

SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}


def read_safetensors(path: Path) -> Dict[str, mx.array]:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DFlashError(f"{path} is truncated (no safetensors header); download it again.")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > 100_000_000:
            raise DFlashError(f"{path} is truncated or not a safetensors file (header of {n} bytes); download it again.")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DFlashError(f"{path} has a corrupt safetensors header; download it again.")
    data_size = size - 8 - n
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or "dtype" not in info or "data_offsets" not in info:
            raise DFlashError(f"{path} has a corrupt safetensors header entry '{key}'; download it again.")
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise DFlashError(
                f"{path}: tensor '{key}' has dtype {info['dtype']}; only float32, float16 and bfloat16 are supported."
            )
        end = max(end, info["data_offsets"][1])
    if end > data_size:
        raise DFlashError(f"{path} is truncated ({data_size} of {end} data bytes); download it again.")
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise DFlashError(f"{path} could not be read ({str(e).splitlines()[0]}); download it again.")


def read_sharded_safetensors(index: Path) -> Dict[str, mx.array]:
    try:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DFlashError(f"{index} is not a valid safetensors index (no weight_map).")
    weights = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = Path(index).parent / shard
        if not shard_path.is_file():
            raise DFlashError(f"Shard {shard} listed in {index.name} is missing; download it again.")
        weights.update(read_safetensors(shard_path))
    return weights


# --- PyTorch checkpoints ----------------------------------------------------

_TORCH_STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name):
        self.dtype = _TORCH_STORAGES[name]
        self.name = name


class BF16Array:
    """bfloat16 data kept as its uint16 bit pattern (numpy has no bfloat16)."""

    def __init__(self, bits: np.ndarray):
        self.bits = bits


def _rebuild_tensor(storage, offset, size, stride, *args, **kwargs):
    data, is_bf16 = storage
    itemsize = data.itemsize
    view = np.lib.stride_tricks.as_strided(
        data[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    view = np.ascontiguousarray(view)
    return BF16Array(view) if is_bf16 else view


def _rebuild_parameter(data, *args, **kwargs):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): dict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, source: Path):
        super().__init__(file)
        self.archive, self.prefix, self.source = archive, prefix, source

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_STORAGES:
            return _StorageType(name)
        raise DFlashError(
            f"Refusing to load {self.source}: its pickle references {module}.{name}, which is not "
            "a tensor or a plain container; convert it to safetensors with trusted tools first."
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise DFlashError(f"Refusing to load {self.source}: unexpected persistent id in its pickle.")
        storage_type, key = pid[1], pid[2]
        if not isinstance(storage_type, _StorageType):
            raise DFlashError(f"Refusing to load {self.source}: unknown storage type in its pickle.")
        try:
            raw = self.archive.read(f"{self.prefix}data/{key}")
        except KeyError:
            raise DFlashError(f"{self.source} is truncated: tensor data {key} is missing; download it again.")
        if storage_type.dtype == "bfloat16":
            return np.frombuffer(raw, dtype=np.uint16), True
        return np.frombuffer(raw, dtype=storage_type.dtype), False


def read_torch(path: Path) -> dict:
    """The object a `torch.save` zip checkpoint holds, tensors as numpy arrays."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise DFlashError(
            f"{path} is not a zip-format PyTorch checkpoint (legacy or raw pickle files are refused "
            "because they can run code); re-save it with torch>=1.6 or as safetensors."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            pkl = [n for n in names if n.endswith("data.pkl")]
            if not pkl:
                raise DFlashError(f"{path} has no data.pkl; it is not a PyTorch checkpoint.")
            prefix = pkl[0][: -len("data.pkl")]
            order = [n for n in names if n == f"{prefix}byteorder"]
            if order and archive.read(order[0]).strip() != b"little":
                raise DFlashError(f"{path} was saved big-endian, which is not supported.")
            with archive.open(pkl[0]) as f:
                return _RestrictedUnpickler(f, archive, prefix, path).load()
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, ValueError) as e:
        raise DFlashError(f"{path} is corrupt ({e}); download it again.")


def to_mx(value) -> mx.array:
    if isinstance(value, BF16Array):
        return mx.array(value.bits).view(mx.bfloat16)
    return mx.array(value)
