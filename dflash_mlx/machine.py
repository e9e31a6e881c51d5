"""Facts about the machine a process runs on: its BLAS and its peak memory."""

import platform
import resource
import sys
from pathlib import Path

import mlx.core as mx


def blas_name() -> str:
    """Which BLAS this process runs on (Linux: read from the loaded libraries)."""
    if platform.system() != "Linux":
        return "Accelerate" if platform.system() == "Darwin" else "unknown"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return _blas_of(line.split()[-1] for line in maps.splitlines() if "/" in line)


def _blas_of(paths) -> str:
    """The BLAS among loaded library `paths`. Only libraries MLX can resolve BLAS
    symbols from count: a copy a wheel bundles in its `<package>.libs` folder
    (numpy's and scipy's OpenBLAS) is private to that package, whichever test or
    import loaded it. And only by the library's own name or folder: MLX's
    JIT-compiled kernels are loaded too, and their names spell out ops
    ("...MinimumKL..." holds "mkl")."""
    found = set()
    for path in paths:
        p = Path(path.lower())
        if (not p.name.startswith("lib") or ".so" not in p.name or "numpy" in path.lower()
                or p.parent.name.endswith(".libs")):
            continue
        if "openblas" in p.name or "openblas" in p.parent.name:  # Debian's: openblas-pthread/libblas.so.3
            found.add("openblas")
        elif p.name.startswith("libmkl"):
            found.add("mkl")
        elif p.name.startswith("libblis"):
            found.add("blis")
    for name in ("openblas", "mkl", "blis"):
        if name in found:
            return name
    return "reference (stock mlx[cpu])"


def peak_memory_gb() -> float:
    peak = mx.get_peak_memory()
    if peak == 0:  # the CPU backend does not track it: use the process peak
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = rss if sys.platform == "darwin" else rss * 1024
    return peak / 1e9
