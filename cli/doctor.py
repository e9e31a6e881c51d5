"""`dflash-mlx doctor`: the custom kernels and target families on this machine."""

from rich.console import Console
from rich.markup import escape

from dflash_mlx.cli.common import err


def main():
    """List the custom kernels and whether each runs on this machine, and the supported target families."""
    import os
    import platform

    import mlx.core as mx
    from rich.table import Table

    from dflash_mlx import kernels
    from dflash_mlx.machine import blas_name

    device = "metal" if kernels.backend() == "metal" else str(mx.default_device())
    err.print(f"MLX {mx.__version__} on {device}, {platform.system()} {platform.machine()}, BLAS: {escape(blas_name())}")
    if os.environ.get(kernels.ENV):
        err.print(f"{kernels.ENV}={os.environ[kernels.ENV]}")
    table = Table("kernel", "status", "why", "what it does")
    colours = {"active": "green", "fallback": "yellow", "unavailable": "dim", "reference": "cyan"}
    for name, summary, state, reason in kernels.report():
        table.add_row(name, f"[{colours.get(state, 'white')}]{state}[/]", reason, summary)
    out = Console(highlight=False, soft_wrap=True)
    out.print(table)
    # Target families: every mlx-lm family whose caches all have a rollback rule.
    from dflash_mlx.target.caches import CI_TESTED, supported_families

    families = supported_families()
    groups = {}
    for family, caches in families.items():
        groups.setdefault(caches, []).append(family)
    out.print(f"Target families ({len(families)} of mlx-lm's, by the cache rollback rule; "
              "others are refused at load with the reason):")
    for caches, names in sorted(groups.items(), key=lambda g: (len(g[0]), g[0])):
        out.print(f"  {escape(caches)}: {', '.join(names)}")
    out.print(f"  tested in CI against plain mlx-lm decoding: {', '.join(CI_TESTED)}")


# `list`'s columns; on a terminal too narrow for all of them, LIST_SPARE are left out
