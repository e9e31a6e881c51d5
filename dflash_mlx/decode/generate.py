"""The DFlash loop: prefill, then cycles (draft -> verify -> accept -> crop)
until EOS, a stop string or the token budget.

Each cycle is launched on the device before the host reads the one before it
where it can be (a plain step runs one step ahead, as mlx-lm's
`generate_step`), and each makes one host synchronisation when it settles.
The request (`request.py`) holds what one generation keeps between cycles;
the cycles (`cycle.py`) run the model passes (`passes.py`); the policy
(`policy`) picks each cycle's plan.
"""

from typing import Callable, Generator, Optional, Sequence, Union

from ..policy.plan import PLAIN
from ..draft.source import DraftSource
from ..cache.prompt_cache import PromptCache
from ..sampling import SamplingParams
from .events import GenerationEvent
from .passes import PREFILL_STEP
from .request import HandOver, Request


def stream_generate(
    pair,
    prompt: Union[str, Sequence[int]],
    max_tokens: int = 256,
    sampling: Optional[SamplingParams] = None,
    block_size: Union[int, str, None, object] = None,
    stop: Sequence[str] = (),
    prefill_step: int = PREFILL_STEP,
    draft_source: Optional[DraftSource] = None,
    lookup: bool = True,
    prompt_cache: Optional[PromptCache] = None,
    logprobs: Optional[int] = None,
    logits_processors: Sequence = (),
    tree: Optional[int] = None,
    proposal_scale: Union[str, float, object] = "auto",
    hand_over: Optional[Callable[[], bool]] = None,
) -> Generator[GenerationEvent, None, Optional[HandOver]]:
    """Generate with DFlash, yielding one event per verify cycle.

    With `lookup`, the policy may draft from the source's free offers (an
    n-gram lookup over the prompt and the text so far) as well as from the
    drafter; a fixed block size always drafts with the drafter alone. With a
    `prompt_cache`, the longest prefix of the prompt it holds is not computed
    again, and this request's caches are kept there when it ends. With
    `logprobs=k`, each event has the log probability of each token and the
    k most likely tokens at its position (mlx-lm's: from the target's logits).
    `logits_processors` (mlx-lm's, e.g. `make_logits_processors` penalties and
    logit bias) apply at every position, drafts included, as in mlx-lm.

    Tree verification (`draft/tree.py`, greedy): with a fixed block size and
    `tree=n`, each drafted cycle verifies the drafter's best path and n
    branches in one target pass; with 'auto' and `tree=n`, the sizer verifies
    trees of up to n branches in the cycles where its costs and acceptance
    say they pay (unset: as many as its cost curve timed, so trees are
    weighed by default where the target can verify them). Verification stays
    linear, silently, where a tree cannot run: sampling (with `tree` unset),
    a target with other caches than KV caches (Gated DeltaNet, sliding
    windows), logits processors, a prompt cache that handed over other caches.

    When sampling, the drafter's drafts are drawn from its distribution made
    flatter or sharper by `proposal_scale` (`policy/proposal.py`; any proposal is
    exact): 'auto' learns the best scale per draft position from the
    acceptance each would have had; a number fixes it (1: the drafter's own q);
    a `ProposalScales` object learns into that object.

    A caller that stops early (closes the generator, or drops it) ends the request as a stop
    string would: its caches go to the prompt cache.

    `hand_over()`, asked after each event, stops the loop early when it says
    so: the cycle in flight is settled and its event yielded, and the
    generator returns the request's state (`HandOver`, in `StopIteration.value`)
    for another loop to go on with, a batch's (`batch.BatchStreams.adopt`).
    """
    req = Request(pair, prompt, max_tokens, sampling or SamplingParams(), block_size, stop,
                  draft_source or pair.draft_source, lookup, prompt_cache, logprobs, logits_processors, tree,
                  proposal_scale)
    out = req.prefill(prefill_step)
    ahead = None
    while True:
        finish = req.commit(out)  # this cycle's tokens, up to EOS and the budget

        # Launch the next cycle before the host detokenizes and hands text
        # over; but the prompt's token first: the first drafted cycle may
        # make the drafter catch up on the whole prompt.
        cycle, plan, deferred = ahead, PLAIN, False  # a plain step may be under way already
        if finish is None and cycle is None:
            plan = req.plan()
            deferred = req.stats.cycles == 0 and plan.width > 1
            cycle = None if deferred else req.launch(plan)

        event = req.event(out, finish)
        try:
            yield event
        except GeneratorExit:  # the caller stopped early: keep what was computed, as at a stop string
            req.finish(cycle)
            raise
        if event.finish_reason is not None:
            req.finish(cycle)
            return
        if hand_over is not None and hand_over():
            if deferred:  # nothing in flight yet: hand the request over as it is
                return req.hand_over()
            out = cycle.settle(also=req.learning())[0]
            req.absorb(cycle, plan, out)
            event = req.event(out, req.commit(out))
            yield event
            if event.finish_reason is not None:
                req.finish(None)
                return None
            return req.hand_over()
        if deferred:
            cycle = req.launch(plan)

        ahead = req.step_ahead(cycle)
        out = cycle.settle(also=req.learning())[0]
        req.absorb(cycle, plan, out)


def generate(pair, prompt, **kwargs):
    """Returns (text, stats)."""
    pieces = []
    stats = None
    for event in stream_generate(pair, prompt, **kwargs):
        pieces.append(event.text)
        stats = event.stats
    return "".join(pieces), stats
