"""`generate`'s structured-output options as one `constrain.Grammar`: `--json-schema` (a file or
the schema's JSON), `--regex` and `--grammar` (a Lark or GBNF file), at most one of them."""

import json
from pathlib import Path
from typing import Optional

from dflash_mlx.constrain.grammar import Grammar, check_size
from dflash_mlx.errors import DFlashError


def grammar_option(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str]) -> Optional[Grammar]:
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise DFlashError(f"{' and '.join(given)} both constrain the output; give one of them.")
    if json_schema is not None:
        return _schema(json_schema)
    if regex is not None:
        return Grammar.regex(regex)
    if grammar is not None:
        return Grammar.lark(_read(grammar, "--grammar", "a Lark or GBNF grammar file"))
    return None


def _schema(value: str) -> Grammar:
    """`--json-schema`: a file where one is, else the schema's JSON itself."""
    text = value.strip()
    if not text:
        raise DFlashError("--json-schema is empty; give a schema file, or the schema's JSON itself.")
    if not text.startswith("{") and not _exists(value) and not _is_json(text):
        raise DFlashError(f"--json-schema {value}: no such file (give a schema file, or the schema's JSON itself).")
    if not text.startswith("{") and _exists(value):
        return Grammar.json_schema(_read(value, "--json-schema", "a JSON schema file"),
                                   what=f"The JSON schema in {value}")
    return Grammar.json_schema(value)


def _exists(path: str) -> bool:
    try:
        return Path(path).expanduser().exists()
    except OSError:  # a name too long to be a file's: JSON, or a mistake
        return False


def _is_json(text: str) -> bool:
    """Whether `text` is a JSON value other than an object (true, false, [...], a number, a string)."""
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return text.startswith("[")  # JSON meant as an array, badly written: reported as JSON


def _read(path: str, option: str, what: str) -> str:
    p = Path(path).expanduser()
    if p.is_dir():
        raise DFlashError(f"{option} {path} is a folder; give {what}.")
    if not p.is_file():
        raise DFlashError(f"{option} {path}: no such file; give {what}.")
    check_size(p.stat().st_size, f"{option} {path}")  # in the file's own bytes, before reading it
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"{option} {path}: cannot be read as UTF-8 text ({type(e).__name__}).") from None
