"""The README's tables are checked against the code they describe."""

from pathlib import Path

from dflash_mlx.hub import aliases

README = Path(__file__).resolve().parent.parent / "README.md"


def alias_table() -> str:
    rows = ["| alias | target (mlx-lm family) | `:4bit` / `:8bit` target | drafter | DFlash | ids confirmed by |",
            "|---|---|---|---|---|---|"]
    for name, e in aliases().items():
        if e.get("builtin"):
            continue
        variants = " / ".join(e.get("variants", {}).values()) or "-"
        draft = e["draft"] + (" (thinking off by default)" if e.get("enable_thinking") is False else "")
        rows.append(f"| {name} | {e['target']} ({e['family']}) | {variants} | {draft} | {e['dflash']} | "
                    f"{e['confirmed']} |")
    return "\n".join(rows)


def block(text: str, name: str) -> str:
    start, end = f"<!-- {name} -->\n", f"\n<!-- /{name} -->"
    assert start in text and end in text, f"README.md lacks the {name} markers"
    return text[text.index(start) + len(start): text.index(end)]


def test_the_alias_table_is_the_registry():
    want = alias_table()
    assert block(README.read_text(), "aliases") == want, (
        "README.md's alias table differs from dflash_mlx/aliases.json; replace it with:\n" + want)


def test_the_families_said_to_be_tested_are_built_and_supported():
    import tiny
    from dflash_mlx.target.caches import supported_families

    said = [f.strip(" `") for f in block(README.read_text(), "tested-families").split(",")]
    supported = supported_families()
    for family in said:
        assert tiny.target_config(family, 320)["model_type"] == family  # a tiny model of it is built in tests
        assert family in supported, family
