"""Resolving --model/--draft (alias, repo id or directory) and downloading."""

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, Optional

from .config import DrafterConfig
from .errors import DFlashError

TARGET_FILES = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
]
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
TORCH_FILES = [f"*{s}" for s in TORCH_SUFFIXES]
PATTERNS = {"model": TARGET_FILES, "config": ["config.json"]}


@dataclass
class Resolved:
    target: str  # repo id or local directory
    draft: Optional[str]
    alias: Optional[str] = None
    enable_thinking: Optional[bool] = None


def aliases() -> Dict[str, dict]:
    text = resources.files("dflash_mlx").joinpath("aliases.json").read_text()
    return json.loads(text)


DEFAULT_MODEL = "demo"


def cache_root() -> Path:
    """Where converted drafters and measured cost curves are cached."""
    return Path(os.environ.get("DFLASH_MLX_CACHE", Path.home() / ".cache" / "dflash-mlx"))


def builtin_path(relative: str) -> str:
    """A pair shipped inside the package (the demo)."""
    return str(Path(str(resources.files("dflash_mlx"))) / relative)


def resolve(model: str, draft: Optional[str] = None) -> Resolved:
    """Map --model/--draft to a target and drafter (repo ids or directories)."""
    registry = aliases()
    entry, alias = None, None
    if model.lower() in registry:
        alias = model.lower()
        entry = registry[alias]
        if entry.get("builtin"):
            entry = dict(entry, target=builtin_path(entry["target"]), draft=builtin_path(entry["draft"]))
        target = entry["target"]
    else:
        target = model
        if not Path(model).exists():
            for name, e in registry.items():
                if e["target"].lower() == model.lower():
                    entry, alias = e, name
                    break
    if draft is not None:
        draft_entry = registry.get(draft.lower())
        draft = draft_entry["draft"] if draft_entry else draft
    elif entry is not None:
        draft = entry["draft"]
    return Resolved(
        target=target,
        draft=draft,
        alias=alias,
        enable_thinking=None if entry is None else entry.get("enable_thinking"),
    )


def check_name(name: str, kind: str) -> Optional[Path]:
    """The local directory `name` names, None for a repo id, or a clear error."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{name} is a file; pass the {kind} directory (holding config.json).")
        return path
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
        valid = "/" in name  # a bare word here is a mistyped alias, not a repo
    except HFValidationError:
        valid = False
    if not valid:
        known = ", ".join(sorted(aliases()))
        raise DFlashError(
            f"'{name}' is not a directory, a Hugging Face repo id (org/name) or a known alias ({known})."
        )
    return None


def _repo_files(name: str) -> list:
    """The files of a Hub repo; offline or unreachable, those of its cached snapshot."""
    from huggingface_hub import constants, list_repo_files, try_to_load_from_cache
    from huggingface_hub import errors as hf_errors

    if not constants.HF_HUB_OFFLINE:
        try:
            return list_repo_files(name)
        except hf_errors.RepositoryNotFoundError:
            raise
        except Exception:
            pass  # no connection (its error type depends on the client version)
    config = try_to_load_from_cache(name, "config.json")
    if not isinstance(config, str):
        return []
    snapshot = Path(config).parent
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def draft_patterns(name: str) -> list:
    """Configs plus the safetensors weights where the repo has them, else its torch checkpoints."""
    files = _repo_files(name)
    if any(f.endswith(".safetensors") for f in files):
        return ["*.json", "*.safetensors"]
    if any(f.endswith(TORCH_SUFFIXES) for f in files):
        return ["*.json", *TORCH_FILES]
    # No weights listed (nothing cached): ask for either, the download says what is missing.
    return ["*.json", "*.safetensors", *TORCH_FILES]


def fetch(name: str, kind: str) -> Path:
    """A local directory for `name`: as given, or from the Hugging Face cache/hub."""
    path = check_name(name, kind)
    if path is not None:
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    try:
        if kind == "draft":
            # The config first: a drafter that cannot run is refused before its weights download.
            DrafterConfig.from_file(Path(snapshot_download(name, allow_patterns=["config.json"])) / "config.json")
            patterns = draft_patterns(name)
        else:
            patterns = PATTERNS[kind]
        return Path(snapshot_download(name, allow_patterns=patterns))
    except hf_errors.GatedRepoError:
        raise DFlashError(
            f"{name} is gated on Hugging Face: accept its licence on the model page, then run `hf auth login`."
        )
    except hf_errors.RepositoryNotFoundError:
        raise DFlashError(f"Hugging Face has no repo {name} (or it is private); check the {kind} name.")
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled):
        raise DFlashError(
            f"Cannot download {name}: offline (or HF_HUB_OFFLINE=1) and it is not in the Hugging Face "
            f"cache; connect and run again, or `hf download {name}` elsewhere and pass its directory."
        )
    except hf_errors.HfHubHTTPError as e:
        raise DFlashError(f"Downloading {name} failed ({str(e).splitlines()[0]}); try again later.")
