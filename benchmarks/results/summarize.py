"""Markdown tables for block-size study results: python summarize.py FILE.json ..."""

import json
import sys


def table(path: str) -> str:
    d = json.load(open(path))
    m, overall = d["machine"], d["overall"]
    rows = [f"**{path.split('/')[-1]}** — {m['chip']}, {m['cores']} cores, MLX {m['mlx']} {m['backend']}, "
            f"BLAS: {m['blas']}, {d['settings']['repeats']} repeats (interleaved)", "",
            "| block size | baseline tok/s | DFlash tok/s | speedup (medians) | speedup (geomeans) "
            "| mean acceptance | identical |",
            "|---|---|---|---|---|---|---|"]
    for stat in ("speedup_geomean", "speedup"):
        fixed = {k: v[stat] for k, v in overall.items() if k != "auto"}
        best = max(fixed, key=fixed.get)
        if stat == "speedup_geomean":
            for k, v in overall.items():
                label = f"{k} (best fixed)" if k == best else k
                rows.append(f"| {label} | {v['baseline_tps']:.1f} | {v['dflash_tps']:.1f} | {v['speedup']:.3f}x | "
                            f"{v['speedup_geomean']:.3f}x | {v['mean_acceptance']:.2f} | "
                            f"{v['identical']}/{v['prompts']} |")
            rows.append("")
        if "auto" in overall:
            a = overall["auto"][stat]
            name = "geometric means over prompts" if stat == "speedup_geomean" else "medians over prompts"
            rows.append(f"- {name}: auto / best fixed ({best}) = {a / fixed[best]:.3f}"
                        + (f"; auto / trained block 16 = {a / fixed['16']:.2f}" if "16" in fixed else ""))
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
