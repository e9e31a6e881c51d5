"""`dflash-mlx doctor`: the custom kernels and target families on this machine."""

from rich.console import Console
from rich.markup import escape

from dflash_mlx.cli.common import err


def main():
    """List the custom kernels and whether each runs on this machine, and the supported target families."""
    import os
    import platform

    from rich.table import Table

    from dflash_mlx.cli.progress import progress

    # Loading MLX and mlx-lm takes seconds and each kernel's first-use self-check
    # more on a GPU: progress goes to stderr from the start.
    with progress(err, "loading MLX and the kernels") as update:
        import mlx.core as mx

        from dflash_mlx import kernels
        from dflash_mlx.machine import blas_name
        from dflash_mlx.target.caches import CI_TESTED, supported_families

        checks = list(kernels.REGISTRY.values())
        rows = []
        for i, k in enumerate(checks):
            update(i, len(checks) + 1, f"checking kernel {k.name}")
            rows.append((k.name, k.summary, k.resolve(), k.reason))
        update(len(checks), len(checks) + 1, "checking the target families")
        families = supported_families()
        update(len(checks) + 1, len(checks) + 1, "checked the kernels and the target families")
    out = Console(highlight=False, soft_wrap=True)
    device = "metal" if kernels.backend() == "metal" else str(mx.default_device())
    out.print(escape(f"MLX {mx.__version__} on {device}, {platform.system()} {platform.machine()}, "
                     f"BLAS: {blas_name()}"))
    if os.environ.get(kernels.ENV):
        out.print(escape(f"{kernels.ENV}={os.environ[kernels.ENV]}"))
    table = Table("kernel", "status", "why", "what it does")
    colours = {"active": "green", "fallback": "yellow", "unavailable": "dim", "reference": "cyan"}
    for name, summary, state, reason in rows:
        table.add_row(name, f"[{colours.get(state, 'white')}]{state}[/]", escape(reason), escape(summary))
    out.print(table)
    # Target families: every mlx-lm family whose caches all have a rollback rule.
    groups = {}
    for family, caches in families.items():
        groups.setdefault(caches, []).append(family)
    out.print(f"Target families ({len(families)} of mlx-lm's, by the cache rollback rule; "
              "others are refused at load with the reason):")
    for caches, names in sorted(groups.items(), key=lambda g: (len(g[0]), g[0])):
        out.print(f"  {escape(caches)}: {', '.join(names)}")
    out.print(f"  tested in CI against plain mlx-lm decoding: {', '.join(CI_TESTED)}")

