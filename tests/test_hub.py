"""Repo ids and downloads: only the files a drafter needs, online or from the cache."""

import json
import types
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hf_errors

from dflash_mlx.errors import DFlashError
from dflash_mlx.hub import TARGET_FILES, check_name, fetch

REPO = "z-lab/Some-DFlash-b16"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = (Path(__file__).parent / "data" / "qwen3.5-4b-dflash-newer.config.json").read_text()


@pytest.mark.parametrize("name", ["Qwen/Qwen3-4B", "z-lab/Qwen3.5-9B-DFlash", "org/name_with.dots-1"])
def test_repo_ids_are_accepted(name):
    assert check_name(name, "model") is None


@pytest.mark.parametrize(
    "name", ["no such thing", "qwen3-4bb", "a/b/c", "org/na--me", "org/name.", "org/..x", "org/" + "x" * 100]
)
def test_bad_names_fail_with_one_line(name):
    with pytest.raises(DFlashError) as e:
        check_name(name, "model")
    assert "is not a directory, a Hugging Face repo id (org/name) or a known alias" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The Hub's network calls replaced: the repo lists `files`; downloads are recorded."""
    state = types.SimpleNamespace(files=[], listed=[], patterns=[], error=None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))

    def list_repo_files(repo_id, **kwargs):
        state.listed.append(repo_id)
        if state.error is not None:
            raise state.error
        return list(state.files)

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        state.patterns.append(allow_patterns)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").write_text(CONFIG)
    return state


def _cache(tmp_path, files):
    """A Hugging Face cache holding `files` of REPO (the layout the hub client writes)."""
    repo = tmp_path / "hf-cache" / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    for f in files:
        (snapshot / f).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / f).write_text(CONFIG if f == "config.json" else "{}")
    return snapshot


@pytest.mark.parametrize(
    "files, want",
    [
        (["config.json", "model.safetensors", "pytorch_model.bin", "README.md"], ["*.json", "*.safetensors"]),
        (["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "training_state.pt"], ["*.json", "*.safetensors"]),
        (["config.json", "pytorch_model.bin", "README.md"], ["*.json", "*.bin", "*.pt", "*.pth"]),
        (["config.json", "drafter.pt"], ["*.json", "*.bin", "*.pt", "*.pth"]),
    ],
)
def test_drafter_download_fetches_safetensors_or_else_torch_checkpoints(hub, tmp_path, files, want):
    hub.files = files
    assert fetch(REPO, "draft") == tmp_path / "snapshot"
    assert hub.listed == [REPO] and hub.patterns == [["config.json"], want]


def test_target_download_does_not_list_the_repo(hub):
    fetch("Qwen/Qwen3-4B", "model")
    fetch("Qwen/Qwen3-4B", "config")
    assert hub.listed == [] and hub.patterns == [TARGET_FILES, ["config.json"]]


@pytest.mark.parametrize(
    "cached, want",
    [
        (["config.json", "model.safetensors"], ["*.json", "*.safetensors"]),
        (["config.json", "pytorch_model.bin"], ["*.json", "*.bin", "*.pt", "*.pth"]),
    ],
)
def test_offline_the_cache_decides(hub, monkeypatch, tmp_path, cached, want):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.error = AssertionError("listed the repo while offline")
    _cache(tmp_path, cached)
    fetch(REPO, "draft")
    assert hub.listed == [] and hub.patterns == [["config.json"], want]


def test_unreachable_hub_falls_back_to_the_cache(hub, tmp_path):
    hub.error = ConnectionError("Name or service not known")
    _cache(tmp_path, ["config.json", "pytorch_model.bin"])
    fetch(REPO, "draft")
    assert hub.listed == [REPO] and hub.patterns == [["config.json"], ["*.json", "*.bin", "*.pt", "*.pth"]]


def test_nothing_listed_asks_for_any_weights(hub, tmp_path):
    hub.error = ConnectionError("Name or service not known")  # and nothing cached
    fetch(REPO, "draft")
    assert hub.patterns == [["config.json"], ["*.json", "*.safetensors", "*.bin", "*.pt", "*.pth"]]


def test_unknown_repo_is_one_line(hub):
    response = types.SimpleNamespace(headers={}, request=None, status_code=404)
    hub.error = hf_errors.RepositoryNotFoundError("404 Client Error", response=response)
    with pytest.raises(DFlashError, match=f"Hugging Face has no repo {REPO}"):
        fetch(REPO, "draft")
    assert hub.patterns == [["config.json"]]


def test_incomplete_dflash2_drafter_is_refused_before_its_weights_download(hub, tmp_path):
    cfg = json.loads(CONFIG)
    cfg["architectures"] = ["DFlash2DraftModel"]  # without the DFlash 2 fields of dflash_config
    (tmp_path / "snapshot" / "config.json").write_text(json.dumps(cfg))
    hub.files = ["config.json", "model.safetensors"]
    with pytest.raises(DFlashError, match="it is not a complete DFlash 2 config"):
        fetch(REPO, "draft")
    assert hub.patterns == [["config.json"]] and hub.listed == []


def test_offline_and_uncached_is_one_line_from_the_real_client(monkeypatch, tmp_path):
    """No network call is replaced here: offline, the hub client itself refuses."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with pytest.raises(DFlashError, match=f"Cannot download {REPO}: offline"):
        fetch(REPO, "draft")
    snapshot = _cache(tmp_path, ["config.json", "model.safetensors"])
    assert fetch(REPO, "draft") == snapshot
