"""`generate`'s structured-output options as one `constrain.Grammar`: `--json-schema` (a file or
the schema's JSON), `--regex` and `--grammar` (a Lark or GBNF file), at most one of them."""

from pathlib import Path
from typing import Optional

from dflash_mlx.constrain.grammar import Grammar
from dflash_mlx.errors import DFlashError


def grammar_option(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str]) -> Optional[Grammar]:
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise DFlashError(f"{' and '.join(given)} both constrain the output; give one of them.")
    if json_schema is not None:
        text = json_schema if json_schema.lstrip().startswith("{") else _read(json_schema, "--json-schema")
        return Grammar.json_schema(text)
    if regex is not None:
        return Grammar.regex(regex)
    if grammar is not None:
        return Grammar.lark(_read(grammar, "--grammar"))
    return None


def _read(path: str, option: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DFlashError(f"{option} {path}: no such file (give a file, or for --json-schema the schema's JSON).")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"{option} {path}: cannot be read as UTF-8 text ({type(e).__name__}).") from None
