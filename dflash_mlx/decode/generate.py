"""The DFlash loop: prefill, then cycles (draft -> verify -> accept -> crop)
until EOS, a stop string or the token budget.

`stream_generate` decodes a request as a batch of one through the decoder the
server's requests share (`decode/decoder.py`): alone, each cycle is the one its
policy plans (`policy`), launched on the device before the host reads the one
before it (a plain step from its predecessor's tokens still on the device, as
mlx-lm's `generate_step`; a drafted one once its predecessor is committed), with
one host synchronisation when it settles. The cycles
(`cycle.py`) run the model passes (`passes.py`).
"""

from typing import Generator, Optional, Sequence, Union

from ..cache.prompt_cache import PromptCache
from ..constrain.grammar import Grammar
from ..draft.source import DraftSource
from ..policy.planner import FORCED_RUN
from ..sampling import SamplingParams
from .events import GenerationEvent
from .passes import PREFILL_STEP
from .request import block_policy, check_options
from .running import Asks
from .streams import Joining, Streams


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
    grammar: Optional[Grammar] = None,
    reasoning=None,
    forced_run: int = FORCED_RUN,
    ) -> Generator[GenerationEvent, None, None]:
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

    With a `grammar` (`constrain.Grammar`: a JSON schema, regex or Lark grammar), every token
    keeps to it (with `reasoning`, a `constrain.gate.Reasoning`: every token after a thinking
    model's reasoning): the output is exactly plain decoding's with the grammar's mask applied before
    each pick (`constrain.processor.GrammarProcessor` with mlx-lm). Drafts the grammar forbids
    are cut before the target verifies them, and tokens it forces are drafted as certain copies,
    up to `forced_run` in a cycle (0: forced tokens are decoded as any others).

    A caller that stops early (closes the generator, or drops it) ends the request as a stop
    string would: its caches go to the prompt cache.

    The request is decoded as a batch of one (`decode.decoder.Decoder`, the decoder the server's
    requests share): alone, each cycle is the one its policy plans.
    """
    params = sampling or SamplingParams()
    source = draft_source or pair.draft_source
    check_options(max_tokens, params, tree, logprobs, proposal_scale)
    block_policy(pair, source, block_size, tree or 0, params)  # a bad block size is refused before any work
    if isinstance(prompt, str):
        prompt = pair.tokenizer.encode(prompt)
    width = block_size if isinstance(block_size, int) else source.block_size
    streams = Streams(pair, max(1, min(width, source.block_size)), prompt_cache=prompt_cache,
                      block_size=block_size or source.block_size, forced_run=forced_run)
    asks = Asks(params, logits_processors, logprobs, tree=tree, lookup=lookup, proposal_scale=proposal_scale,
                grammar=grammar, reasoning=reasoning)
    uid, event = streams.add(Joining(list(prompt), max_tokens, stop, asks, source), prefill_step)
    try:
        while True:
            yield event
            if event.finish_reason is not None:
                break
            event = next(e for u, e in streams.step() if u == uid)
    except GeneratorExit:  # the caller stopped early: keep what was computed, as at a stop string
        streams.remove(uid)
        streams.keep()
        raise
    streams.keep()


def generate(pair, prompt, **kwargs):
    """Returns (text, stats)."""
    pieces = []
    stats = None
    for event in stream_generate(pair, prompt, **kwargs):
        pieces.append(event.text)
        stats = event.stats
    return "".join(pieces), stats
