"""What a request brings before any model work: its checks, the policy its cycles are planned
by alone and its proposal scales; and its text stream, which holds back text a stop string may
start."""

from typing import List, Optional, Sequence


from ..policy.sizer import BlockSizer
from ..policy.plan import FixedWidth, Policy
from ..errors import DFlashError, PromptTooLong
from ..policy.proposal import FixedScale, ProposalScales
from ..sampling import SamplingParams


class TextStream:
    """Detokenizes committed tokens and holds back text that may start a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: List[int] = []  # committed so far (kept only when there are stop strings)
        self.text = ""
        self.emitted = 0
        self.matched: Optional[str] = None  # the stop string found

    def add(self, tokens: List[int], final: bool):
        """Returns (new text, how many of `tokens` to keep, whether a stop string ended the text)."""
        if self.detok is None:
            return "", len(tokens), False
        for t in tokens:
            self.detok.add_token(t)
        if final:
            self.detok.finalize()
        self.text = self.detok.text
        if self.stop:
            for s in self.stop:
                i = self.text.find(s, max(0, self.emitted - len(s)))
                if i >= 0:
                    self.text, self.matched = self.text[:i], s
                    return self._flush(i), self._needed(tokens, s), True
            self.ids += tokens
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        return self._flush(end), len(tokens), False

    def _needed(self, tokens: List[int], stop: str) -> int:
        """How many of `tokens` it took to complete `stop` (the detokenizer may show text a few tokens late)."""
        for n in range(1, len(tokens)):
            if stop in self.tokenizer.decode(self.ids + tokens[:n]):
                return n
        return len(tokens)

    def _flush(self, end):
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def block_policy(pair, source, block_size, tree: int = 0, params: Optional[SamplingParams] = None) -> Policy:
    """The policy that picks each cycle's plan: a size (with `tree` branches),
    'auto' (measured costs and acceptance, learnt per sampling settings
    `params`; needs `pair`) or an object that keeps the `policy.plan.Policy`
    protocol."""
    if not isinstance(block_size, (int, float, str, type(None))):
        return block_size
    if block_size == "auto":
        shared = pair.auto_sizer(params)  # the pair's drafter keeps acceptance across requests
        return shared if source is pair.draft_source else BlockSizer(shared.curve, source.block_size)
    block_size = block_size or source.block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise DFlashError(f"--block-size must be a positive integer or 'auto' (got {block_size}).")
    return FixedWidth(block_size, tree)


def check_options(max_tokens: int, params: SamplingParams, tree: Optional[int], logprobs: Optional[int],
                  proposal_scale) -> None:
    if tree is not None and (not isinstance(tree, int) or tree < 0):
        raise DFlashError(f"tree must be a number of branches >= 0 (got {tree}).")
    if tree and not params.greedy:
        raise DFlashError("Tree verification is greedy only (temperature 0); use tree=0 to sample.")
    if logprobs is not None and logprobs < 0:
        raise DFlashError(f"logprobs must be >= 0 (got {logprobs}).")
    if (proposal_scale != "auto" if isinstance(proposal_scale, str)
            else isinstance(proposal_scale, (int, float)) and not proposal_scale > 0):
        raise DFlashError(f"--proposal-scale must be 'auto' or a number > 0 (got {proposal_scale}).")
    if proposal_scale != "auto" and params.seed is not None and not params.greedy:
        raise DFlashError("--proposal-scale shapes unseeded sampling; a seeded request draws its drafts with "
                          "its seed's noise. Drop --seed or --proposal-scale.")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1 (got {max_tokens}).")


def check_prompt(prompt: Sequence[int], target, limit: Optional[int] = None) -> None:
    """The one check of a prompt's length: not empty, within the model's window (its
    `max_position_embeddings`) and within `limit` (a server's own bound), else `PromptTooLong`."""
    if len(prompt) == 0:
        raise DFlashError("The prompt is empty.")
    window = getattr(target.args, "max_position_embeddings", None)
    if window and len(prompt) > window:
        raise PromptTooLong(len(prompt), window)
    if limit and len(prompt) > limit:
        raise PromptTooLong(len(prompt), limit, "this server accepts")


def proposal_scaler(pair, source, params: SamplingParams, proposal_scale):
    """The request's proposal scales (`policy/proposal.py`): an object's, a fixed number,
    or 'auto': the pair's learned ones for its own drafter, fresh ones otherwise."""
    if isinstance(proposal_scale, (int, float)):
        scaler = FixedScale(proposal_scale)
    elif proposal_scale != "auto":
        scaler = proposal_scale
    elif source is pair.draft_source:
        scaler = pair.proposal_scales(params)  # the pair's drafter keeps them across requests
    else:
        scaler = ProposalScales(source.block_size - 1)
    return scaler
