"""The serving engine over DFlash: the thread that owns the model and runs the jobs (`requests` makes them).

Requests are parsed and validated on the HTTP layer's worker threads
(`http_app`); one worker thread owns the model and takes jobs in arrival
order, so all MLX work stays on one thread. A job that finds nothing else
waiting runs alone; jobs that queue up behind others are decoded together
(`decode.streams.Streams`), each with its own caches, sampling settings, logits
processors and log probabilities. A client that disconnects, streaming or
not, cancels its job; the worker stops it at the next cycle.

The tokenizer is shared by request parsing (chat templating, encoding), the
HTTP layer (log probabilities, tool calls) and the worker (detokenising
inside `stream_generate`). Hugging Face fast tokenizers are not thread-safe
(concurrent use fails with "RuntimeError: Already borrowed"), so every use
of it goes through one lock: the worker's pair holds a `_Locked` view of the
tokenizer, and request parsing tokenizes under the same lock.
"""

import copy
import dataclasses
import os
import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional

import mlx.core as mx

from ..cache.prompt_cache import PromptCache
from ..constrain.grammar import Grammar
from ..decode import stream_generate
from ..decode.decoder import Asks, batch_width
from ..decode.streams import Joining, Streams
from ..errors import DFlashError
from ..policy.batch import BatchWidths, FixedBatchWidth
from ..sampling import SamplingParams, make_processors
from .api_errors import APIError

if TYPE_CHECKING:
    from .reasoning import Markers

# Requests decoded together at most: mlx-lm's BatchGenerator's default completion batch is 32;
# beyond a few dozen rows per target pass a CPU's or GPU's pass costs in proportion.
MAX_BATCH = 32


_PLAIN = (str, bytes, int, float, bool, type(None), list, tuple, dict, set, frozenset)


class _Locked:
    """A view of an object whose every attribute read, call and write holds `lock`.

    Objects reached through it (bound methods, the streaming detokenizer, whose
    methods and `text` property may call the tokenizer) are wrapped the same way;
    plain data is returned as is.
    """

    def __init__(self, obj, lock):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_lock", lock)

    def __getattr__(self, name):
        with self._lock:
            value = getattr(self._obj, name)
        return value if isinstance(value, _PLAIN) else _Locked(value, self._lock)

    def __setattr__(self, name, value):
        with self._lock:
            setattr(self._obj, name, value)

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._obj(*args, **kwargs)

    def __len__(self):
        with self._lock:
            return len(self._obj)

    def __bool__(self):
        with self._lock:
            return bool(self._obj)


@dataclass
class Job:
    prompt: List[int]
    max_tokens: int
    params: SamplingParams
    stop: List[str]
    logprobs: Optional[int] = None  # how many top tokens to report per token (None: no log probabilities)
    processor_args: dict = field(default_factory=dict)  # make_logits_processors' arguments (penalties, logit bias)
    tools: Optional[list] = None  # the request's tools: calls in the output are parsed
    grammar: Optional[Grammar] = None  # what the output keeps to (`constrain.Grammar`): a schema, a forced call
    thinking: Optional["Markers"] = None  # a thinking model's markers (`serve.reasoning.thinking`): its reasoning is split off
    reasoning: Any = None  # where its reasoning ends (`constrain.gate.Reasoning`): its grammar or budget follows it
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # the handler has seen the engine's last event (None)
    usage_chunk: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices


class Engine:
    """Owns the pair; runs the queued jobs on its own thread, alone or batched (`_run`)."""

    def __init__(self, pair, model_id: str, block_size: Optional[int] = None,
                 enable_thinking: Optional[bool] = None, max_prompt_tokens: int = 32768,
                 default_temp: float = 0.0, max_tokens_limit: int = 32768, default_max_tokens: Optional[int] = None,
                 prompt_cache_bytes: int = 4 << 30, prompt_cache_disk_bytes: int = 0,
                 prompt_cache_dir: Optional[str] = None, channel=None):
        self.model_id, self.block_size = model_id, block_size
        self.channel = channel  # under mlx.launch: the other ranks mirror every request (distributed.JobChannel)
        # Conversations grow turn by turn: each request starts where an earlier one left off.
        # Disk writes happen on this engine's thread after a request has finished (`PromptCache.store`).
        self.prompt_cache = None
        if prompt_cache_bytes > 0:
            self.prompt_cache = PromptCache(pair, max_bytes=prompt_cache_bytes, disk_bytes=prompt_cache_disk_bytes,
                                            disk_dir=prompt_cache_dir)
        self.default_temp = default_temp
        self.enable_thinking = enable_thinking
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens_limit = max_tokens_limit
        # None: a request that sets no max_tokens may run to the model's context (and `max_tokens_limit`)
        self.default_max_tokens = None if default_max_tokens is None else min(default_max_tokens, max_tokens_limit)
        # One lock for every use of the tokenizer, on any thread (see the module docstring).
        self.tokenizer_lock = threading.RLock()
        self.tokenizer = pair.tokenizer
        self.pair = pair
        if pair.tokenizer is not None:
            try:  # the grammar engine's view of the vocabulary, built now from the tokenizer itself
                pair.grammars
            except DFlashError:
                pass  # a tokenizer it cannot read: structured output requests are refused with why
            self.tokenizer = _Locked(pair.tokenizer, self.tokenizer_lock)
            self.pair = copy.copy(pair)  # the worker's pair: the same models, the locked tokenizer
            object.__setattr__(self.pair, "tokenizer", self.tokenizer)
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.waiting: "deque[Optional[Job]]" = deque()  # taken off `jobs` by the worker, not started yet
        # None: requests run one at a time (the target cannot be batched, or other ranks mirror each request)
        self.batch_width = None if channel is not None else batch_width(pair, block_size)
        # What the batches learn of each width's speed outlives each batch.
        self.batch_policy = FixedBatchWidth(block_size) if isinstance(block_size, int) else None
        if self.batch_width is not None and self.batch_policy is None:
            self.batch_policy = BatchWidths(self.batch_width)
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0, "active": 0, "generated_tokens": 0}
        self.refusals: Counter = Counter()  # refused requests (answered 4xx before any work) by HTTP status
        # Totals over finished requests, for /metrics.
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "cycles": 0, "draft_cycles": 0, "committed": 0,
                       "batch_cycles": 0, "batch_rows": 0, "batch_committed": 0}
        self.thread = threading.Thread(target=self._run, daemon=True, name="dflash-engine")
        self.thread.start()

    def refused(self, status: int) -> None:
        """Count a request answered with a refusal (4xx) before it reached the engine."""
        self.stats["refused"] += 1
        self.refusals[status] += 1

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _run(self):
        """Jobs in arrival order, decoded together (`_run_batch`: a job alone runs as its own
        policy plans, and those that come while it runs join it), or one at a time where the
        target cannot be batched (`_run_alone`)."""
        waiting = self.waiting
        while True:
            if not waiting:
                waiting.append(self.jobs.get())
            self._drain(waiting)
            job = waiting[0]
            if job is None:
                if self.prompt_cache is not None:  # a restarted server starts from what this one kept
                    self.prompt_cache.spill()
                if self.channel is not None:
                    self.channel.send(None)
                return
            if job.cancelled.is_set():
                waiting.popleft()
                self.stats["cancelled"] += 1
                job.events.put(None)
            elif self._batchable(job):
                self._run_batch(waiting)
            else:
                self._run_alone(waiting.popleft())

    def queued(self) -> int:
        """Requests not started yet: in the queue, or taken off it by the worker."""
        return self.jobs.qsize() + sum(j is not None for j in list(self.waiting))

    def _drain(self, waiting) -> None:
        """Move every queued job into `waiting`, without blocking."""
        try:
            while True:
                waiting.append(self.jobs.get_nowait())
        except queue.Empty:
            pass

    def _batchable(self, job: Job) -> bool:
        """Whether a job can join a batch: any job, where the engine batches at all (`batch_width`)."""
        return self.batch_width is not None

    def _run_batch(self, waiting) -> None:
        """Decode the batchable jobs at the head of `waiting` together, letting in those that
        queue up while it runs, until the batch is empty; a job that cannot join waits for it
        (arrival order is kept)."""
        try:
            self._batch(waiting)
        finally:
            self.stats["active"] = 0  # nothing runs between batches, whatever ended this one

    def _batch(self, waiting) -> None:
        batch = Streams(self.pair, self.batch_width, self.batch_policy, self.prompt_cache,
                             lookup=self.block_size == "auto",
                             block_size=self.block_size or self.pair.draft_source.block_size)
        jobs = {}
        while True:
            self._drain(waiting)
            joining = []
            while waiting and waiting[0] is not None and len(batch) + len(joining) < MAX_BATCH:
                job = waiting[0]
                if job.cancelled.is_set():
                    waiting.popleft()
                    self.stats["cancelled"] += 1
                    job.events.put(None)
                    continue
                if not self._batchable(job):
                    break
                joining.append(waiting.popleft())
            if joining:
                self._join(batch, jobs, joining)
                self._drain(waiting)
                if waiting and waiting[0] is not None and len(batch) < MAX_BATCH:
                    continue  # requests that came during the prefill join before the next cycle
            for uid, job in list(jobs.items()):
                if job.cancelled.is_set():
                    batch.remove(uid)
                    self._ended(jobs.pop(uid), cancelled=True)
            if not jobs:
                batch.keep()  # what cancelled jobs computed
                return
            self.stats["active"] = len(jobs)
            try:
                events = batch.step()
            except Exception as e:  # keep serving: the batch's requests fail, not the server
                for job in jobs.values():
                    self._failed(job, APIError(500, f"generation failed: {e}", "server_error"))
                return
            t = self.totals
            t["batch_cycles"] += 1
            t["batch_rows"] += len(events)
            t["batch_committed"] += sum(event.accepted + 1 for _, event in events)
            for uid, event in events:
                self._deliver(jobs, uid, event)
            batch.keep()  # after the answers are out

    def _join(self, batch: "Streams", jobs: dict, joining: List[Job]) -> None:
        """Prefill the joining jobs (together where their prompts are short) and let them in."""
        try:
            firsts = batch.add_many([Joining(job.prompt, job.max_tokens, job.stop,
                                             Asks(job.params, make_processors(job.processor_args), job.logprobs,
                                                  grammar=job.grammar, reasoning=job.reasoning))
                                     for job in joining])
        except DFlashError as e:
            if len(joining) > 1:  # find the one at fault: the others go in
                for job in joining:
                    self._join(batch, jobs, [job])
                return
            return self._failed(joining[0], APIError(400, str(e)))
        except Exception as e:
            for job in joining:
                self._failed(job, APIError(500, f"generation failed: {e}", "server_error"))
            return
        for job, (uid, event) in zip(joining, firsts):
            jobs[uid] = job
            if event is not None:  # None: its prompt is prefilled a chunk per cycle of the batch
                self._deliver(jobs, uid, event)

    def _deliver(self, jobs: dict, uid: int, event) -> None:
        job = jobs[uid]
        if self._put(job, event):
            self._ended(jobs.pop(uid), failed=event.finish_reason == "error")

    def _put(self, job: Job, event) -> bool:
        """Hand an event to its job, counted; whether it is the job's last. A request its grammar's
        engine gave up on ends with its text so far, then the error."""
        self.stats["generated_tokens"] += len(event.tokens)
        if event.finish_reason == "error":
            job.events.put(dataclasses.replace(event, finish_reason=None))
            job.events.put(APIError(400, f"The answer stopped after {event.stats.generation_tokens} tokens: "
                                         f"{event.stats.error}. Simplify the schema or grammar.",
                                    code="grammar_failed"))
        else:
            job.events.put(event)
        if event.finish_reason is not None:
            self._count(event.stats)
        return event.finish_reason is not None

    def _ended(self, job: Job, cancelled: bool = False, failed: bool = False) -> None:
        self.stats["cancelled" if cancelled else "failed" if failed else "completed"] += 1
        self.stats["active"] = max(self.stats["active"] - 1, 0)
        job.events.put(None)

    def _failed(self, job: Job, error: APIError) -> None:
        self.stats["failed"] += 1
        job.events.put(error)
        job.events.put(None)

    def _run_alone(self, job: Job) -> None:
        """One job through `stream_generate` (a target that cannot be batched, or ranks that
        mirror each request)."""
        self.stats["active"] = 1
        try:
            if self.channel is not None:
                self._mirror(job)
            events = stream_generate(self.pair, job.prompt, max_tokens=job.max_tokens,
                                     sampling=job.params, block_size=self.block_size, stop=job.stop,
                                     prompt_cache=self.prompt_cache, logprobs=job.logprobs,
                                     logits_processors=make_processors(job.processor_args), grammar=job.grammar,
                                     reasoning=job.reasoning)
            failed = False
            for event in events:
                failed = event.finish_reason == "error"
                self._put(job, event)
                stop = job.cancelled.is_set()
                if self.channel is not None:
                    stop = not self.channel.keep_going(stop)
                if stop:
                    events.close()
                    break
            self.stats["failed" if failed else "cancelled" if job.cancelled.is_set() else "completed"] += 1
        except DFlashError as e:
            self.stats["failed"] += 1
            job.events.put(APIError(400, str(e)))
        except Exception as e:  # keep serving whatever one request did
            self.stats["failed"] += 1
            job.events.put(APIError(500, f"generation failed: {e}", "server_error"))
        finally:
            self.stats["active"] = 0
            job.events.put(None)

    def _mirror(self, job: Job) -> None:
        """Send the request to the other ranks. An unseeded sampled one gets a seed for
        MLX's generator on every rank (so all draw the same numbers) that is not the
        request's own: it still counts as unseeded and learns from the requests before it."""
        seed = None
        if job.params.temp > 0 and job.params.seed is None:
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        self.channel.send({"prompt": list(job.prompt), "max_tokens": job.max_tokens,
                           "params": dataclasses.asdict(job.params), "stop": list(job.stop),
                           "logprobs": job.logprobs, "processors": job.processor_args, "seed": seed,
                           "grammar": None if job.grammar is None else dataclasses.asdict(job.grammar),
                           "reasoning": None if job.reasoning is None else dataclasses.asdict(job.reasoning)})
        if seed is not None:
            mx.random.seed(seed)

    def _count(self, stats):
        t = self.totals
        t["prompt_tokens"] += stats.prompt_tokens
        t["cached_tokens"] += stats.cached_tokens
        t["cycles"] += stats.cycles
        t["draft_cycles"] += stats.draft_cycles
        t["committed"] += sum(stats.acceptance_lengths)

    def close(self):
        """Stop the engine after the queued requests; with a disk tier, wait until memory
        is spilled to it; under mlx.launch, until the other ranks are told to stop."""
        self.jobs.put(None)
        if (self.prompt_cache is not None and self.prompt_cache.disk is not None) or self.channel is not None:
            self.thread.join()
