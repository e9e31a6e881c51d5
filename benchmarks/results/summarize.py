"""Markdown tables for block-size study results: python summarize.py FILE.json ..."""

import json
import sys


def table(path: str) -> str:
    d = json.load(open(path))
    m, overall = d["machine"], d["overall"]
    fixed = {k: v["speedup"] for k, v in overall.items() if k != "auto"}
    best = max(fixed, key=fixed.get)
    rows = [f"**{path.split('/')[-1]}** — {m['chip']}, {m['cores']} cores, MLX {m['mlx']} {m['backend']}, "
            f"BLAS: {m['blas']}, {d['settings']['repeats']} repeats", "",
            "| block size | baseline tok/s | DFlash tok/s | speedup | mean acceptance | identical |",
            "|---|---|---|---|---|---|"]
    for k, v in overall.items():
        label = f"{k} (best fixed)" if k == best else k
        rows.append(f"| {label} | {v['baseline_tps']:.1f} | {v['dflash_tps']:.1f} | {v['speedup']:.3f}x | "
                    f"{v['mean_acceptance']:.2f} | {v['identical']}/{v['prompts']} |")
    if "auto" in overall:
        a = overall["auto"]["speedup"]
        rows += ["", f"auto / best fixed = {a / fixed[best]:.3f}"
                 + (f"; auto / trained block 16 = {a / fixed['16']:.2f}" if "16" in fixed else "")]
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
