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
    variant: Optional[str] = None  # the alias's quantized target variant ("4bit"), if one was named


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


def _split_variant(name: str, registry: Dict[str, dict]):
    """`alias:variant` -> (alias, variant); anything else -> (name, None).

    Only a name that is not an existing path and whose part before the last
    colon is not a repo id is read this way (repo ids cannot hold a colon).
    """
    if ":" not in name or Path(name).exists():
        return name, None
    base, variant = name.rsplit(":", 1)
    if base.lower() not in registry:
        known = ", ".join(sorted(registry))
        raise DFlashError(f"'{base}' in '{name}' is not a known alias ({known}); "
                          f"a :variant follows an alias, as in qwen3.5-27b:4bit.")
    return base, variant.lower()


def variant_target(alias: str, variant: str, registry: Optional[Dict[str, dict]] = None) -> str:
    """The target repo of `alias`'s quantized `variant`, or a one-line error naming those it has."""
    entry = (registry or aliases())[alias]
    variants = entry.get("variants") or {}
    if variant not in variants:
        have = ", ".join(f"{alias}:{v}" for v in sorted(variants)) or "none"
        raise DFlashError(f"Alias '{alias}' has no variant '{variant}'; its variants: {have}.")
    return variants[variant]


def resolve(model: str, draft: Optional[str] = None) -> Resolved:
    """Map --model/--draft to a target and drafter (repo ids or directories).

    `--model` takes an alias (`qwen3.5-27b`), an alias with a quantized MLX
    target variant (`qwen3.5-27b:4bit`; the drafter is the same for every
    variant), a repo id (a known target's, or a variant's, finds its drafter
    through the registry) or a directory.
    """
    registry = aliases()
    entry, alias, variant = None, None, None
    name, variant = _split_variant(model, registry)
    if name.lower() in registry:
        alias = name.lower()
        entry = registry[alias]
        if entry.get("builtin"):
            entry = dict(entry, target=builtin_path(entry["target"]), draft=builtin_path(entry["draft"]))
        target = entry["target"] if variant is None else variant_target(alias, variant, registry)
    else:
        target = model
        if not Path(model).exists():
            for n, e in registry.items():
                repos = {e["target"].lower(): None}
                repos.update({r.lower(): v for v, r in (e.get("variants") or {}).items()})
                if model.lower() in repos:
                    entry, alias, variant = e, n, repos[model.lower()]
                    break
    if draft is not None:
        draft_name, _ = _split_variant(draft, registry)  # the variant does not change the drafter
        draft_entry = registry.get(draft_name.lower())
        draft = draft_entry["draft"] if draft_entry else draft
    elif entry is not None:
        draft = entry["draft"]
    return Resolved(
        target=target,
        draft=draft,
        alias=alias,
        enable_thinking=None if entry is None else entry.get("enable_thinking"),
        variant=variant,
    )


def cached_repos() -> Dict[str, str]:
    """Repo ids in the Hugging Face cache, read by huggingface_hub's own scan: 'cached' where a
    snapshot holds config.json and weights, 'partial' where it holds less."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return {}
    out = {}
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        state = "partial"
        for rev in repo.revisions:
            names = {f.file_name for f in rev.files}
            if "config.json" in names and any(n.endswith((".safetensors", *TORCH_SUFFIXES)) for n in names):
                state = "cached"
        out[repo.repo_id.lower()] = state
    return out


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
