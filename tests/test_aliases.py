"""The alias registry: every published z-lab pair, its quantized MLX target variants, and `dflash-mlx list`."""

import hashlib
import re

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import validate_repo_id
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.errors import DFlashError
from dflash_mlx.hub import aliases, check_name, resolve
from dflash_mlx.target.caches import family_verdict, supported_families

REGISTRY = aliases()
HUB = {name: e for name, e in REGISTRY.items() if not e.get("builtin")}
VARIANTS = [(name, v, repo) for name, e in HUB.items() for v, repo in sorted(e.get("variants", {}).items())]

# Every z-lab drafter whose target mlx-lm loads and a 128 GB Mac holds at 4-bit.
REQUIRED = {
    "qwen3-4b", "qwen3-8b", "llama3.1-8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
    "qwen3.5-122b-a10b", "qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3-coder-30b-a3b", "qwen3-coder-next",
    "gemma-4-12b", "gemma-4-26b-a4b", "gemma-4-31b", "gpt-oss-20b", "gpt-oss-120b",
    "qwen3.8-27b", "muse-glimmer-30b",
}


def test_every_required_alias_is_there():
    assert REQUIRED <= set(HUB)
    assert {HUB[n]["dflash"] for n in ("qwen3.8-27b", "muse-glimmer-30b")} == {2}
    assert all(HUB[n]["dflash"] == 1 for n in REQUIRED - {"qwen3.8-27b", "muse-glimmer-30b"})


@pytest.mark.parametrize("name", sorted(HUB))
def test_every_alias_resolves_to_its_pair(name):
    e = HUB[name]
    for repo in [e["target"], e["draft"], *e.get("variants", {}).values()]:
        validate_repo_id(repo)
        assert check_name(repo, "model") is None  # an org/name repo id, not a path or a bad name
    assert e["draft"].startswith("z-lab/")
    r = resolve(name)
    assert (r.target, r.draft, r.alias, r.variant) == (e["target"], e["draft"], name, None)
    assert resolve(name.upper()).target == e["target"]
    # The target's repo id finds the same drafter.
    assert resolve(e["target"]).draft == e["draft"] and resolve(e["target"]).alias == name


@pytest.mark.parametrize("name, variant, repo", VARIANTS)
def test_variants_resolve_to_their_repo_with_the_same_drafter(name, variant, repo):
    r = resolve(f"{name}:{variant}")
    assert (r.target, r.draft, r.alias, r.variant) == (repo, HUB[name]["draft"], name, variant)
    assert r.enable_thinking == HUB[name].get("enable_thinking")
    assert resolve(f"{name.upper()}:{variant.upper()}").target == repo
    # The variant's repo id, given as --model, finds the alias's drafter too.
    by_id = resolve(repo)
    assert (by_id.target, by_id.draft, by_id.alias, by_id.variant) == (repo, HUB[name]["draft"], name, variant)
    # --draft takes alias:variant and means the alias's drafter.
    assert resolve("some/target", f"{name}:{variant}").draft == HUB[name]["draft"]


def test_every_alias_has_4bit_and_8bit_mlx_variants():
    for name, e in HUB.items():
        assert set(e["variants"]) == {"4bit", "8bit"}, name
        assert all(r.startswith("mlx-community/") for r in e["variants"].values()), name
    assert resolve("qwen3.5-27b:4bit").target == "mlx-community/Qwen3.5-27B-4bit"


def test_unknown_variant_is_one_line_naming_the_variants():
    with pytest.raises(DFlashError) as e:
        resolve("qwen3.5-27b:3bit")
    msg = str(e.value)
    assert "\n" not in msg and "no variant '3bit'" in msg
    assert "qwen3.5-27b:4bit" in msg and "qwen3.5-27b:8bit" in msg
    with pytest.raises(DFlashError, match="its variants: none") as e:
        resolve("demo:4bit")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["qwen3.5-28b:4bit", "Qwen/Qwen3.5-27B:4bit", ":4bit"])
def test_unknown_alias_with_a_variant_is_one_line(name):
    with pytest.raises(DFlashError) as e:
        resolve(name)
    msg = str(e.value)
    assert "\n" not in msg and "is not a known alias" in msg and "qwen3.5-27b" in msg


def test_plain_names_keep_their_behaviour(tmp_path):
    d = tmp_path / "weird:name"  # a directory may hold a colon: it is a directory, not alias:variant
    d.mkdir()
    assert resolve(str(d)).target == str(d) and resolve(str(d)).draft is None
    assert resolve("me/my-model").target == "me/my-model" and resolve("me/my-model").draft is None
    assert resolve("qwen3-4bb").target == "qwen3-4bb"  # refused later by check_name, with the alias list
    with pytest.raises(DFlashError, match="or a known alias"):
        check_name("qwen3-4bb", "model")


@pytest.fixture(scope="module")
def supported():
    return supported_families()  # reads every mlx-lm family's source: once


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_target_family_is_supported_by_the_runtime(name, supported):
    e = REGISTRY[name]
    assert e["family"] in supported, f"{name}: mlx-lm family {e['family']} is not supported"
    assert family_verdict(e["family"])[0]
    if "model_type" in e:  # a config model_type mlx-lm remaps onto the family
        from mlx_lm.utils import MODEL_REMAPPING

        assert MODEL_REMAPPING.get(e["model_type"], e["model_type"]) == e["family"]
        assert family_verdict(e["model_type"])[0]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_alias_says_how_its_ids_were_confirmed(name):
    confirmed = REGISTRY[name]["confirmed"]
    assert isinstance(confirmed, str) and confirmed.strip()
    assert REGISTRY[name]["dflash"] in (1, 2)


# --- dflash-mlx list -------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache, repo_id, files):
    """`files` of `repo_id` in a Hugging Face cache, laid out as the hub client writes it (blobs + symlinks)."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    (root / "blobs").mkdir()
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in files:
        data = f"{repo_id}/{f}".encode()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f).symlink_to(blob)


def _rows(output):
    """The table's rows as {alias: [cells of the alias's first line]}."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 7 and cells[0] and cells[0] != "alias":
            rows[cells[0]] = cells
    return rows


@pytest.fixture
def hf_cache(monkeypatch, tmp_path):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _list():
    r = CliRunner().invoke(app, ["list"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    return r.output


def test_list_prints_every_alias_with_nothing_cached(hf_cache):
    out = _list()  # the cache directory does not even exist
    rows = _rows(out)
    assert set(rows) == set(REGISTRY)
    for name, e in HUB.items():
        assert rows[name][1] == e["target"] and rows[name][2] == e["draft"]
        assert rows[name][3] == str(e["dflash"]) and rows[name][4].startswith(e["family"])
        assert rows[name][6] == "-"
        for repo in e["variants"].values():
            assert repo in out
    assert rows["demo"][6] == "built in"
    assert "(cached)" not in out


def test_list_marks_what_is_cached(hf_cache):
    _cache_repo(hf_cache, "mlx-community/Qwen3.5-27B-4bit", ["config.json", "model.safetensors", "tokenizer.json"])
    _cache_repo(hf_cache, "z-lab/Qwen3.5-27B-DFlash", ["config.json", "model.safetensors"])
    _cache_repo(hf_cache, "Qwen/Qwen3-4B", ["config.json"])  # only the config: not the model
    _cache_repo(hf_cache, "z-lab/gpt-oss-20b-DFlash", ["config.json", "pytorch_model.bin"])
    rows = _rows(_list())
    assert rows["qwen3.5-27b"][6] == ":4bit, drafter"
    assert rows["gpt-oss-20b"][6] == "drafter"
    assert rows["qwen3-4b"][6] == "-" and "(partly cached)" in rows["qwen3-4b"][1]
    assert "(cached)" in rows["qwen3.5-27b"][2] and "(cached)" not in rows["qwen3.5-27b"][1]
    assert all(rows[n][6] == "-" for n in HUB if n not in ("qwen3.5-27b", "gpt-oss-20b"))
    out = _list()
    assert re.search(r":4bit mlx-community/Qwen3\.5-27B-4bit \(cached\)", out)
