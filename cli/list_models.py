"""`dflash-mlx list`: the model aliases and what the Hugging Face cache holds."""

from typing import List

from rich.console import Console
from rich.markup import escape


# `list`'s columns; on a terminal too narrow for all of them, LIST_SPARE are left out
# in this order before an id is cut. The alias and target columns, what a user types, stay.
LIST_COLUMNS = ("alias", "target (--model ALIAS) and variants (ALIAS:VARIANT)", "drafter", "DFlash",
                "target family", "ids confirmed by", "cached locally")
LIST_SPARE = ("ids confirmed by", "target family", "DFlash", "cached locally", "drafter")


def _stdout() -> Console:
    return Console(highlight=False)


def _alias_table(console: Console, rows: List[List[str]]):
    """(table, headers left out) for `console`.

    Off a terminal (a pipe, a file) the table takes its natural width: no cell
    wraps, nothing is cut. On a terminal too narrow for that, the alias, target
    and drafter columns keep the width of their longest id while the other
    columns wrap; where even that does not fit, the least needed columns are
    left out, and only where the alias and target columns alone do not fit do
    the target's ids fold (every character kept) onto more lines."""
    from rich.measure import Measurement
    from rich.table import Column, Table
    from rich.text import Text

    def widest(i):
        return max(len(w) for row in rows for w in Text.from_markup(row[i]).plain.split())

    def build(headers, fixed=False):
        columns = []
        for h in headers:
            i = LIST_COLUMNS.index(h)
            if i == 0:
                columns.append(Column(h, no_wrap=True, width=widest(0)))
            elif i <= 2:  # rich shrinks only the columns without a set width
                columns.append(Column(h, width=widest(i) if fixed else None, overflow="fold"))
            else:
                columns.append(Column(h, overflow="fold"))
        table = Table(*columns)
        for row in rows:
            table.add_row(*[row[LIST_COLUMNS.index(h)] for h in headers])
        return table

    def needs(table):
        return Measurement.get(console, console.options.update_width(1 << 16), table)

    table = build(LIST_COLUMNS)
    if not console.is_terminal:
        console.width = needs(table).maximum
        return table, []
    if needs(table).maximum <= console.width:
        return table, []
    for n in range(len(LIST_SPARE) + 1):
        headers = [h for h in LIST_COLUMNS if h not in LIST_SPARE[:n]]
        table = build(headers, fixed=True)
        if needs(table).minimum <= console.width:
            return table, list(LIST_SPARE[:n])
    return build(headers), list(LIST_SPARE)


def main():
    """List the model aliases: target and its 4/8-bit MLX variants, drafter, and what is in the Hugging Face cache."""
    from huggingface_hub import constants

    from dflash_mlx.hub import aliases, cached_repos
    from dflash_mlx.target.caches import family_verdict

    cached = cached_repos()
    marks = {"cached": " [green](cached)[/]", "partial": " [yellow](partly cached)[/]"}

    def repo(name: str) -> str:
        return escape(name) + marks.get(cached.get(name.lower()), "")

    rows = []
    for alias, e in aliases().items():
        if e.get("builtin"):
            target, draft, have = f"{e['target']} (in the package)", f"{e['draft']} (in the package)", "built in"
        else:
            lines = [repo(e["target"])]
            lines += [f":{v} {repo(r)}" for v, r in sorted((e.get("variants") or {}).items())]
            target, draft = "\n".join(lines), repo(e["draft"])
            named = [("target", e["target"]), *[(f":{v}", r) for v, r in sorted((e.get("variants") or {}).items())],
                     ("drafter", e["draft"])]
            have = ", ".join(k for k, r in named if cached.get(r.lower()) == "cached") or "-"
        family = e.get("family", "?")
        ok, _ = family_verdict(family)
        family_cell = family + (f" ({e['model_type']})" if e.get("model_type") else "")
        family_cell += "" if ok else " [red](not in this mlx-lm)[/]"
        rows.append([escape(alias), target, draft, str(e.get("dflash", 1)), family_cell,
                     escape(e.get("confirmed", "unconfirmed")), have])
    out = _stdout()
    table, left_out = _alias_table(out, rows)
    out.print(table)
    if left_out:
        out.print(f"Left out to fit this terminal: {', '.join(left_out)}; `dflash-mlx list | cat` prints every "
                  "column.", soft_wrap=True)
    out.print(f"Hugging Face cache: {escape(str(constants.HF_HUB_CACHE))}. "
              "Run `dflash-mlx generate --model ALIAS` (or ALIAS:4bit, ALIAS:8bit for a quantized MLX target).",
              soft_wrap=True)
