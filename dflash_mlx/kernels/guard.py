"""First-use self-check and fallback shared by every custom kernel.

A kernel is used only when the running backend has a build for it, the build
compiles, and it matches its plain-MLX reference on small random inputs.
Otherwise one warning is logged and the reference runs from then on.
`DFLASH_MLX_REFERENCE_KERNELS=1` (or a comma-separated list of kernel names)
forces the reference.
"""

import logging
import os
from typing import Callable, Dict, Optional

import mlx.core as mx

log = logging.getLogger("dflash_mlx")
ENV = "DFLASH_MLX_REFERENCE_KERNELS"


def backend() -> Optional[str]:
    """'metal' on an Apple GPU, 'cuda' on MLX's CUDA backend, None on CPU."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def failure(e: BaseException) -> str:
    """A one-line reason for a check that raised: the exception's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def forced_reference(name: str) -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    return value in ("1", "true", "yes", "all") or name in {v.strip() for v in value.split(",")}


class GuardedKernel:
    """A custom kernel with its reference, checked once per process and backend."""

    def __init__(self, name: str, summary: str, build: Callable[[str], Callable], check: Callable[[Callable], None]):
        self.name = name
        self.summary = summary
        self._build = build  # backend -> callable with the reference's signature (raises when unsupported)
        self._check = check  # callable -> None, raises AssertionError on a mismatch
        self._fn: Optional[Callable] = None
        self._key = None  # (backend, forced) the state was decided for
        self.state = "unchecked"
        self.reason = ""

    def reset(self) -> None:
        self._fn, self._key, self.state, self.reason = None, None, "unchecked", ""

    def resolve(self) -> str:
        be, forced = backend(), forced_reference(self.name)
        if self.state != "unchecked" and (be, forced) == self._key:
            return self.state
        self._key, self._fn = (be, forced), None
        if forced:
            self.state, self.reason = "reference", f"forced by {ENV}"
        elif be is None:
            self.state, self.reason = "unavailable", f"no Metal or CUDA back-end (MLX runs on {mx.default_device()})"
        else:
            try:
                fn = self._build(be)
                self._check(fn)
                self._fn, self.state, self.reason = fn, "active", f"{be} kernel matches its reference"
            except Exception as e:  # a compile error or a mismatch: never fatal
                self.state, self.reason = "fallback", failure(e)
                log.warning("dflash-mlx: kernel %s disabled on %s, using its reference (%s)", self.name, be, self.reason)
        return self.state

    def kernel(self) -> Optional[Callable]:
        """The checked kernel, or None when the reference must run.

        Called on every decode step (once per layer for some kernels): after the
        first decision only the backend is compared; `resolve` re-reads the
        environment variable as well.
        """
        if self.state == "unchecked" or self._key[0] != backend():
            self.resolve()
        return self._fn


REGISTRY: Dict[str, GuardedKernel] = {}


def register(kernel: GuardedKernel) -> GuardedKernel:
    REGISTRY[kernel.name] = kernel
    return kernel
