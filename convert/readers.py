"""Reading drafter checkpoints without running code.

Safetensors headers are validated before loading. PyTorch checkpoints (the
zip format of `torch.save`) are read by a restricted unpickler that admits
tensors, parameters and plain containers only, and never imports torch.
"""

import io
import json
import math
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import mlx.core as mx
import numpy as np
from safetensors import SafetensorError, safe_open

from dflash_mlx.errors import DFlashError

SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}


def safetensors_header(path: Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Each tensor's (dtype, shape) from a safetensors file's header, checked by
    `safetensors.safe_open` (offsets inside the file, no overlaps); nothing is loaded."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except SafetensorError as e:
        reason = (str(e).split(": ", 1)[-1].splitlines() or ["no header"])[0]
        # Messages differ across safetensors versions ("incomplete metadata",
        # "MetadataIncompleteBuffer", "header too small", "InvalidHeaderLength").
        if any(w in reason.lower() for w in ("incomplete", "small", "length")):
            raise DFlashError(f"{path} is truncated or damaged ({reason}); download it again.")
        raise DFlashError(f"{path} has a corrupt safetensors header ({reason}); download it again.")
    except OSError as e:
        raise DFlashError(f"Cannot read {path} ({e.strerror or e}).")


def shard_paths(index: Path) -> List[Path]:
    """The shards a sharded safetensors index names: file names in the index's own folder."""
    index = Path(index)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise DFlashError(f"{index} is not a valid safetensors index (no weight_map); download it again.")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DFlashError(f"{index}: weight_map must map tensor names to shard file names; download it again.")
    shards = []
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise DFlashError(f"{index} names shard {shard!r} outside its folder; download it again.")
        shard_path = index.parent / shard
        if not shard_path.is_file():
            raise DFlashError(f"Shard {shard} listed in {index.name} is missing; download it again.")
        shards.append(shard_path)
    return shards


def read_safetensors(path: Path) -> Dict[str, mx.array]:
    path = Path(path)
    dtypes = {k: dtype for k, (dtype, _) in safetensors_header(path).items()}
    for key, dtype in dtypes.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise DFlashError(
                f"{path}: tensor '{key}' has dtype {dtype}; only float32, float16 and bfloat16 are supported."
            )
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise DFlashError(f"{path} could not be read ({str(e).splitlines()[0]}); download it again.")


def read_sharded_safetensors(index: Path) -> Dict[str, mx.array]:
    weights = {}
    for shard_path in shard_paths(index):
        weights.update(read_safetensors(shard_path))
    return weights


# --- PyTorch checkpoints ----------------------------------------------------

_TORCH_STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16,  # numpy has no bfloat16: kept as bit patterns
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
NESTED_KEYS = ("state_dict", "model", "module")


class _StorageType:
    def __init__(self, name):
        self.name = name


class BF16Array(NamedTuple):
    """bfloat16 data kept as its uint16 bit pattern (numpy has no bfloat16)."""

    bits: np.ndarray


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits tensors, parameters and plain containers; never imports torch."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, source: Path):
        super().__init__(file)
        self.archive, self.prefix, self.source = archive, prefix, source
        # Storages by key, as (1-D array, is_bf16) tuples: immutable, and only
        # persistent_load makes them, so a pickle cannot forge one.
        self.storages = {}

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict  # not dict: state_dict() pickles a `_metadata` attribute
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self.rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
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
        if not (isinstance(storage_type, _StorageType) and isinstance(key, str)):
            raise ValueError("malformed storage reference")
        if key not in self.storages:
            dtype = _TORCH_STORAGES[storage_type.name]
            try:
                raw = read_entry(self.archive, f"{self.prefix}data/{key}", self.source)
            except KeyError:
                raise ValueError(f"tensor data {key} is missing")
            self.storages[key] = (np.frombuffer(raw, dtype=dtype), dtype is np.uint16)
        return self.storages[key]

    def rebuild_tensor(self, storage, offset, size, stride, *args, **kwargs):
        if not any(storage is s for s in self.storages.values()):
            raise ValueError("a tensor without storage")
        data, is_bf16 = storage
        if not (
            type(offset) is int
            and type(size) is tuple
            and type(stride) is tuple
            and len(size) == len(stride)
            and all(type(n) is int for n in size + stride)
        ):
            raise ValueError("tensor offset, size and stride must be integers")
        if min((offset, *size, *stride)) < 0:
            raise ValueError("negative tensor offset, size or stride")
        numel = math.prod(size)
        end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride)) if numel else offset
        if end > data.size:
            raise ValueError(f"tensor view ends at element {end} of a storage of {data.size}")
        # A view with more elements than its storage (stride 0) could make a
        # small file allocate without bound; checkpoints never hold one.
        if numel > data.size:
            raise ValueError(f"tensor of {numel} elements over a storage of {data.size}")
        view = np.lib.stride_tricks.as_strided(
            data[offset:], shape=size, strides=tuple(s * data.itemsize for s in stride), writeable=False
        ).copy()
        return BF16Array(view) if is_bf16 else view


def read_entry(archive: zipfile.ZipFile, name: str, source) -> bytes:
    """An archive entry, refused before it is inflated if it says it is larger than the
    whole archive on disk: torch.save stores entries uncompressed, so only a crafted
    archive (a small file inflating to gigabytes) declares more."""
    info = archive.getinfo(name)
    size = Path(archive.filename).stat().st_size
    if info.file_size > size:
        raise DFlashError(f"{source}: entry {name} inflates to {info.file_size} bytes from a {size}-byte archive; "
                          "it is not a torch.save checkpoint (re-save it with torch.save or as safetensors).")
    return archive.read(info)


def _rebuild_parameter(data, *args, **kwargs):
    return data


def _check_memo(data: bytes) -> None:
    """The C unpickler sizes its memo by the largest index a PUT names (a
    crafted one asks for gigabytes): refuse indices no pickle this size needs."""
    ops = list(pickletools.genops(data))
    for op, arg, pos in ops:
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and arg > len(ops):
            raise ValueError(f"memo index {arg} at byte {pos}")


def _unwrap(obj) -> dict:
    """The tensor dict inside a training checkpoint (state_dict/model/module)."""
    while isinstance(obj, dict):
        inner = next((obj[k] for k in NESTED_KEYS if isinstance(obj.get(k), dict)), None)
        if inner is None:
            break
        obj = inner
    if not isinstance(obj, dict):
        raise ValueError("it does not hold a state dict of tensors")
    return {k: v for k, v in obj.items() if isinstance(v, (np.ndarray, BF16Array))}


def to_mx(value) -> mx.array:
    if isinstance(value, BF16Array):
        return mx.array(value.bits).view(mx.bfloat16)
    return mx.array(value)


def read_torch(path: Path) -> Dict[str, mx.array]:
    """The tensors of a `torch.save` zip checkpoint (nested state dicts unwrapped)."""
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
            if order and read_entry(archive, order[0], path).strip() != b"little":
                raise DFlashError(f"{path} was saved big-endian, which is not supported.")
            data = read_entry(archive, pkl[0], path)
            _check_memo(data)
            obj = _RestrictedUnpickler(io.BytesIO(data), archive, prefix, path).load()
            return {str(k): to_mx(v) for k, v in _unwrap(obj).items()}
    except DFlashError:
        raise
    except Exception as e:
        # A crafted pickle can raise almost anything (TypeError, IndexError,
        # struct.error, RecursionError, ...): every one is a bad file.
        reason = (str(e).splitlines() or [""])[0] or type(e).__name__
        raise DFlashError(
            f"{path} is not a valid checkpoint: {reason}; download it again or re-save it with torch.save."
        )
