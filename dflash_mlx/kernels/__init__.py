"""Custom kernels for the decode loop, each with a plain-MLX reference.

See `guard.py` for when a kernel runs and when its reference does.
"""

from .gdn_replay import gdn_replay, gdn_replay_each
from .gdn_verify import gdn_verify
from .guard import ENV, REGISTRY, backend
from .qmm_verify import qmm_verify
from .verify_accept import verify_accept


def report():
    """[(name, summary, state, reason)] for every kernel, checking each on this backend."""
    return [(k.name, k.summary, k.resolve(), k.reason) for k in REGISTRY.values()]


__all__ = ["ENV", "REGISTRY", "backend", "gdn_replay", "gdn_replay_each", "gdn_verify", "qmm_verify", "report", "verify_accept"]
