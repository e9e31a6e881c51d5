"""What the adaptive policies learn, kept across requests and processes.

A pair has one `--block-size auto` sizer per sampling settings (a drafter's
acceptance when sampling is not its greedy one, so sampled requests do not
teach greedy ones; all share one cost curve) and one set of learned proposal
scales per settings. The sizers' shared rates are written beside the cost
curve, so a later process starts from them.
"""

import json
import time
from pathlib import Path
from typing import Callable, Dict, Optional

from .. import kept_files
from .proposal import ProposalScales
from ..sampling import SamplingParams
from .costs import CostCurve
from .sizer import BlockSizer

RATES_VERSION = 2
RATES_KIND = "dflash_mlx.rates"
RATES_EVERY = 10.0  # seconds between writes of the learnt rates (the first write is at once)


def settings_name(params: SamplingParams) -> str:
    """The rates file's name for the sampling settings acceptance depends on (`SamplingParams.key`)."""
    return "greedy" if params.greedy else json.dumps(list(params.key))


class Learned:
    """A pair's learned state: its sizers and proposal scales per sampling settings.

    `curve(progress=...)` gives the cost curve (measured on first use);
    `rates_path()` is where the shared rates are kept."""

    def __init__(self, curve: Callable[..., CostCurve], rates_path: Callable[[], Path], max_width: int):
        self.curve, self.rates_path, self.max_width = curve, rates_path, max_width
        self.greedy: Optional[BlockSizer] = None
        self.sampled: Dict[tuple, BlockSizer] = {}
        self.scales: Dict[tuple, ProposalScales] = {}
        self.kept: Optional[dict] = None  # the learnt-rates file, per sampling settings
        self.kept_at = float("-inf")  # when this process last wrote it

    def sizer(self, params: Optional[SamplingParams] = None, progress=lambda done, total: None) -> BlockSizer:
        """The auto sizer at these sampling settings (default: greedy)."""
        if self.greedy is None:
            self.greedy = self.learnt(BlockSizer(self.curve(progress=progress), self.max_width), SamplingParams())
        if params is None or params.greedy:
            return self.greedy
        if params.key not in self.sampled:
            self.sampled[params.key] = self.learnt(self.greedy.fresh(), params)
        return self.sampled[params.key]

    def proposal_scales(self, params: SamplingParams) -> ProposalScales:
        if params.key not in self.scales:
            self.scales[params.key] = ProposalScales(self.max_width - 1)
        return self.scales[params.key]

    def kept_rates(self) -> dict:
        """What earlier processes learnt, per sampling settings (read once; unreadable: nothing)."""
        if self.kept is None:
            path, what = self.rates_path(), "learnt rates"
            kept = kept_files.read(path, RATES_KIND, RATES_VERSION, what)
            if kept is not None and not isinstance(kept, dict):
                kept_files.set_aside(path, what, "not rates per sampling setting")
            self.kept = kept if isinstance(kept, dict) else {}
        return self.kept

    def learnt(self, sizer: BlockSizer, params: SamplingParams) -> BlockSizer:
        """`sizer` with the shared rates an earlier process learnt at these settings, where they fit."""
        kept = self.kept_rates().get(settings_name(params))
        if kept:
            try:
                sizer.load_shared(kept)
            except (KeyError, TypeError, ValueError):
                pass  # another drafter layout or a damaged file: learn anew
        return sizer

    def keep(self, force: bool = False) -> None:
        """Write the sizers' shared rates, per sampling settings: at once the first time,
        then at most every `RATES_EVERY` seconds (`force`: now). Settings this process
        did not use keep what the file held. A failed write is skipped."""
        now = time.monotonic()
        if not force and now - self.kept_at < RATES_EVERY:
            return
        settings = dict(self.kept_rates())
        if self.greedy is not None:
            settings[settings_name(SamplingParams())] = self.greedy.shared_state()
        for key, sizer in self.sampled.items():
            settings[settings_name(SamplingParams(*key))] = sizer.shared_state()
        self.kept, self.kept_at = settings, now
        kept_files.write(self.rates_path(), RATES_KIND, RATES_VERSION, settings)
