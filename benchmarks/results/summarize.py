"""Markdown tables for block-size study results: python summarize.py FILE.json ..."""

import json
import sys

STATS = (("speedup_geomean", "geometric means over prompts"), ("speedup", "medians over prompts"))


PAIRED = ("speedup_median_per_prompt", "medians of per-prompt ratios")  # listed where every block size's results hold it


def table(path: str) -> str:
    d = json.load(open(path))
    m, overall = d["machine"], d["overall"]
    stats = STATS + ((PAIRED,) if all(PAIRED[0] in v for v in overall.values()) else ())
    fixed = {k: v for k, v in overall.items() if k != "auto"}
    best = {stat: max(fixed, key=lambda k: fixed[k][stat]) for stat, _ in stats}
    rows = [f"**{path.split('/')[-1]}** — {m['chip']}, {m['cores']} cores, MLX {m['mlx']} {m['backend']}, "
            f"BLAS: {m['blas']}, {d['settings']['repeats']} repeats (interleaved)", "",
            "| block size | baseline tok/s | DFlash tok/s | speedup (medians) | speedup (geomeans) "
            "| mean acceptance | identical |",
            "|---|---|---|---|---|---|---|"]
    for k, v in overall.items():
        label = f"{k} (best fixed)" if k == best["speedup_geomean"] else k
        rows.append(f"| {label} | {v['baseline_tps']:.1f} | {v['dflash_tps']:.1f} | {v['speedup']:.3f}x | "
                    f"{v['speedup_geomean']:.3f}x | {v['mean_acceptance']:.2f} | {v['identical']}/{v['prompts']} |")
    if "auto" in overall:
        rows.append("")
        for stat, name in stats:
            a, b = overall["auto"][stat], fixed[best[stat]][stat]
            rows.append(f"- {name}: auto / best fixed ({best[stat]}) = {a / b:.3f}"
                        + (f"; auto / trained block 16 = {a / fixed['16'][stat]:.2f}" if "16" in fixed else ""))
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
