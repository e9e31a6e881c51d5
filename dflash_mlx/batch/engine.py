"""Greedy speculative decoding of several sequences at once.

Each cycle drafts every active sequence's block (the drafter, per sequence) and
verifies all of them in one target pass over a [B, width] block; each sequence
keeps its own longest agreeing prefix plus the target's token, and its caches
are cropped on their own (`RaggedKVCache.crop`: no copy). One host
synchronisation per cycle reads every sequence's acceptance. A sequence joins
after its own prefill (its caches are merged into the batch's) and leaves when
it finishes (its rows are dropped). Output is each sequence's greedy decoding:
the same tokens as decoding it alone.
"""

from dataclasses import dataclass, field
from itertools import count
from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import DFlashError
from ..policy.batch import WIDTHS
from ..sampling import SamplingParams
from ..decode.passes import PREFILL_STEP, caught_up, draft, joined, prefill
from ..decode.request import HELD_TAPS
from .cache import RaggedKVCache

GREEDY = SamplingParams()
# Prompts joining together are prefilled in one padded pass up to this many tokens in all;
# beyond, each is prefilled alone in mlx-lm's chunks, so a long prompt holds memory as it does alone.
BATCH_PREFILL = 2048


def can_batch(target) -> bool:
    """Whether the target's caches can be batched here: all plain KV caches."""
    return all(type(c) is KVCache for c in target.make_cache())


def batch_width(pair, block_size) -> Optional[int]:
    """The widest cycle a batch of this pair runs (`block_size`, or for 'auto' the widest
    candidate of `policy.batch.WIDTHS`), None where the target cannot be batched."""
    if not can_batch(pair.target):
        return None
    width = block_size if isinstance(block_size, int) else max(WIDTHS)
    return max(1, min(width, pair.draft_source.block_size))


@dataclass
class Running:
    """One sequence of the batch: what its next cycle starts from."""

    uid: int
    max_tokens: int
    source: Any  # its draft source (`draft_source.DraftSource`): the pair's unless it brought one
    dstate: Any  # the source's state for this sequence (the drafter's context)
    last: mx.array  # [1] its last committed token (the next block's first)
    taps: list = field(default_factory=list)  # target taps the drafter has not read yet (lazy)
    generated: int = 0
    history: List[int] = field(default_factory=list)  # prompt and committed tokens (for the prompt cache)


@dataclass
class Committed:
    """What a cycle committed for one sequence, and why it ended, if it did."""

    uid: int
    tokens: List[int]
    finish: Optional[str] = None  # "stop" (EOS) or "length"
    accepted: int = 0  # draft tokens the target accepted


class BatchDecoder:
    """Sequences decoded together, each cycle at a width of at most `width` (1: plain batched
    decoding). Above 1 the target's taps of every committed token reach each sequence's
    drafter, so any cycle may draft."""

    def __init__(self, pair, width: int, prompt_cache=None):
        """With a `prompt_cache`, each sequence starts from the longest prefix it holds and
        what a finished sequence computed is kept there (`keep`)."""
        self.pair, self.target, self.source = pair, pair.target, pair.draft_source
        self.prompt_cache = prompt_cache
        self.finished: list = []  # (sequence, its caches) of finished sequences, for `keep`
        if not can_batch(self.target):
            raise DFlashError(f"Batched decoding needs a target whose caches are all KV caches; "
                              f"'{self.target.model_type}' has others (sliding windows or recurrent states).")
        if width < 1:
            raise DFlashError(f"The batch's block width must be >= 1 (got {width}).")
        self.width = min(width, self.source.block_size)
        self.eos = set(pair.tokenizer.eos_token_ids)
        self.window = getattr(self.target.args, "max_position_embeddings", None)
        self.cache: List[RaggedKVCache] = []
        self.seqs: List[Running] = []
        self._uids = count()

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, prompt: Sequence[int], max_tokens: int, source=None) -> Committed:
        """Prefill `prompt` alone, then join the batch; its first token (and whether it already ended).
        `source`: the sequence's own draft source (default: the pair's drafter)."""
        if not prompt:
            raise DFlashError("The prompt is empty.")
        if self.window and len(prompt) > self.window:
            raise DFlashError(f"The prompt has {len(prompt)} tokens but the model reads at most {self.window}.")
        source = source or self.source
        tcache, dstate, reused = self.target.make_cache(), source.new_state(), 0
        if self.prompt_cache is not None:
            tcache, dstate, reused = self.prompt_cache.fetch(self.target, source, prompt)
        logits, taps = prefill(self.target, source, dstate, mx.array(prompt[reused:]), tcache, PREFILL_STEP,
                               taps=self.width > 1, skip=True, before=reused)
        last = mx.argmax(logits[None], axis=-1).astype(mx.uint32)
        mx.eval(last, [c.state for c in tcache])
        seq, out = self._start(prompt, max_tokens, source, dstate, last, taps)
        if out.finish is None:
            self._join(seq, tcache)
        return out

    def add_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                 sources: Optional[Sequence] = None) -> List[Committed]:
        """`add` for several prompts, prefilled in one target pass where they are short
        (`BATCH_PREFILL` tokens in all): right-padded to the longest, each sequence's
        padding cropped after. Long prompts go one at a time, in chunks."""
        sources = list(sources or [None] * len(prompts))
        if self.prompt_cache is not None and len(prompts) > 1:  # a cached prefix beats a shared pass
            cached = [self.prompt_cache.reach(self.target, s or self.source, p) > 0
                      for p, s in zip(prompts, sources)]
            if any(cached):
                fresh = [i for i, c in enumerate(cached) if not c]
                out = dict(zip(fresh, self.add_many([prompts[i] for i in fresh], [max_tokens[i] for i in fresh],
                                                    [sources[i] for i in fresh])))
                for i in (i for i, c in enumerate(cached) if c):
                    out[i] = self.add(prompts[i], max_tokens[i], sources[i])
                return [out[i] for i in range(len(prompts))]
        lens = [len(p) for p in prompts]
        if len(prompts) < 2 or sum(lens) > BATCH_PREFILL or min(lens) == 0:
            return [self.add(p, m, s) for p, m, s in zip(prompts, max_tokens, sources)]
        if self.window and max(lens) > self.window:
            raise DFlashError(f"A prompt has {max(lens)} tokens but the model reads at most {self.window}.")
        n, L = len(prompts), max(lens)
        block = mx.array([list(p) + [0] * (L - len(p)) for p in prompts])
        cache = [RaggedKVCache([0] * n) for _ in self.target.make_cache()]
        if self.prompt_cache is not None:  # counted as the misses a fetch would count
            self.prompt_cache.misses += n
        logits, hidden = self.target(block, cache, taps=self.width > 1, rows=mx.array(lens) - 1)
        for c in cache:
            c.crop([L - k for k in lens])
        lasts = mx.argmax(logits[:, 0], axis=-1).astype(mx.uint32)
        mx.eval(lasts, [c.state for c in cache])
        out, keep, joined_seqs = [], [], []
        for b, (p, m, source) in enumerate(zip(prompts, max_tokens, sources)):
            source = source or self.source
            taps = [hidden[b : b + 1, : lens[b]]] if self.width > 1 else []
            seq, c = self._start(p, m, source, source.new_state(), lasts[b : b + 1], taps)
            out.append(c)
            if c.finish is None:
                keep.append(b)
                joined_seqs.append(seq)
        if keep:
            for c in cache:
                c.filter(keep)
            if self.cache:
                for batch, c in zip(self.cache, cache):
                    batch.join(c)
            else:
                self.cache = cache
            self.seqs += joined_seqs
        return out

    def _start(self, prompt, max_tokens: int, source, dstate, last: mx.array, taps: list):
        """A prefilled sequence (its first token `last`, evaluated) and that token's `Committed`;
        its budget stops at the model's window."""
        if self.window:
            max_tokens = min(max_tokens, self.window - len(prompt) + 1)
        seq = Running(next(self._uids), max_tokens, source, dstate, last, taps)
        out = Committed(seq.uid, last.tolist())
        out.finish = self._finish(seq, out)
        seq.history = list(prompt) + out.tokens
        source.commit(dstate, seq.history)
        return seq, out

    def adopt(self, tcache: list, source, dstate, last: mx.array, taps: list, max_tokens: int,
              generated: int, history: Sequence[int] = ()) -> int:
        """Take in a sequence another loop decoded so far (its caches hold every committed
        token but `last`; `generated` of its `max_tokens` are committed; `history`: its
        prompt and those tokens); its uid."""
        seq = Running(next(self._uids), max_tokens, source, dstate, last, list(taps), generated, list(history))
        self._join(seq, tcache)
        return seq.uid

    def _join(self, seq: "Running", tcache: list) -> None:
        """Its caches' rows are copied into the batch's."""
        if self.cache:
            for batch, c in zip(self.cache, tcache):
                batch.extend([c])
        else:
            self.cache = [RaggedKVCache.merge([c]) for c in tcache]
        self.seqs.append(seq)

    def step(self, width: Optional[int] = None) -> List[Committed]:
        """One cycle for every sequence in the batch at `width` (default: the largest);
        finished sequences leave it."""
        if not self.seqs:
            return []
        w = self.width if width is None else max(1, min(width, self.width))
        lasts = mx.concatenate([s.last for s in self.seqs])
        if w > 1:
            drafts = mx.stack([self._draft(s, w) for s in self.seqs])
            block = mx.concatenate([lasts[:, None], drafts], axis=1)
        else:
            block = lasts[:, None]
        logits, hidden = self.target(block, self.cache, taps=self.width > 1)
        picks = mx.argmax(logits, axis=-1).astype(mx.uint32)
        if w > 1:
            accepted = mx.cumprod(drafts == picks[:, :-1], axis=1).sum(axis=1)
        else:
            accepted = mx.zeros((len(self.seqs),), mx.uint32)
        mx.eval(accepted, picks, block)  # the cycle's one host synchronisation
        acc, pk, blk = accepted.tolist(), picks.tolist(), block.tolist()
        out, keep, drops = [], [], []
        for b, seq in enumerate(self.seqs):
            a = acc[b]
            tokens = blk[b][1 : 1 + a] + [pk[b][a]]
            c = Committed(seq.uid, tokens, accepted=a)
            c.finish = self._finish(seq, c)
            out.append(c)
            # The caches keep [last, accepted drafts]: a row per committed token but the newest;
            # a finished sequence's, a row per token it committed (its history but the last token).
            rows = a + 1 if c.finish is None else len(c.tokens)
            drops.append(w - rows)
            seq.history += c.tokens
            if self.width > 1 and rows:
                seq.taps.append(hidden[b : b + 1, :rows])
                if len(seq.taps) == HELD_TAPS:  # a long plain run: the drafter reads them in one pass
                    seq.source.add_context(seq.dstate, joined(seq.taps))
                    seq.taps = []
            if c.finish is None:
                keep.append(b)
                seq.last = mx.array([tokens[-1]], mx.uint32)
                seq.source.commit(seq.dstate, tokens)
        for c in self.cache:
            c.crop(drops)
        if self.prompt_cache is not None:
            kept = set(keep)
            self.finished += [(s, [c.extract(b) for c in self.cache])
                              for b, s in enumerate(self.seqs) if b not in kept]
        self._keep_only(keep)
        return out

    def keep(self) -> None:
        """Hand what finished sequences computed to the prompt cache (after their answers are out):
        the caches hold every committed token but the last, the drafter has read their taps."""
        for seq, tcache in self.finished:
            if seq.taps:
                seq.source.add_context(seq.dstate, joined(caught_up(seq.source, seq.dstate, seq.taps)))
                seq.taps = []
            mx.eval([c.state for c in tcache], seq.source.arrays(seq.dstate))
            self.prompt_cache.store(self.target, seq.source, seq.dstate, seq.history[:-1], tcache)
        self.finished = []

    def remove(self, uid: int) -> None:
        """Drop a sequence before it finished (nothing if it is not in the batch)."""
        self._keep_only([b for b, s in enumerate(self.seqs) if s.uid != uid])

    def _keep_only(self, keep: List[int]) -> None:
        """Keep the sequences at indices `keep`; the others' rows are dropped."""
        if len(keep) < len(self.seqs):
            for c in self.cache:
                c.filter(keep)
            self.seqs = [self.seqs[b] for b in keep]

    def _draft(self, seq: Running, width: int) -> mx.array:
        hidden = joined(caught_up(seq.source, seq.dstate, seq.taps)) if seq.taps else None
        seq.taps = []
        return draft(seq.source, seq.dstate, seq.last, hidden, width, GREEDY).tokens

    def _finish(self, seq: "Running", c: Committed) -> Optional[str]:
        """Cut `c`'s tokens at the budget and at EOS; the finish reason, if this ends the sequence."""
        c.tokens = c.tokens[: seq.max_tokens - seq.generated]
        seq.generated += len(c.tokens)
        for i, t in enumerate(c.tokens):
            if t in self.eos:
                c.tokens = c.tokens[:i]
                return "stop"
        return "length" if seq.generated >= seq.max_tokens else None
