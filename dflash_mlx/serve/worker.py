"""The serving engine over DFlash, and the parsing of API requests into its jobs.

Requests are parsed and validated on the HTTP layer's worker threads
(`http_app`); one worker thread owns the model and takes jobs in arrival
order, so all MLX work stays on one thread. A job that finds nothing else
waiting runs alone; jobs that queue up behind others are decoded together
(`batch.BatchStreams`), each with its own caches, sampling settings, logits
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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx

from ..batch.engine import Asks, batch_width
from ..batch.streams import BatchStreams, Joining
from ..policy.batch import BatchWidths, FixedBatchWidth
from ..decode import stream_generate
from ..cache.prompt_cache import PromptCache
from ..errors import DFlashError
from ..prompt import build_chat_prompt
from ..sampling import SamplingParams, make_processors
from . import messages_api
from .tools import ToolError, check_tools, template_messages, tool_choice

MAX_STOP = 4  # stop strings per request: OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (and completions' logprobs)
# Requests decoded together at most: mlx-lm's BatchGenerator's default completion batch is 32;
# beyond a few dozen rows per target pass a CPU's or GPU's pass costs in proportion.
MAX_BATCH = 32
# Fields the speculative path cannot honour yet: refused (400) when set to
# anything but their neutral value, never silently ignored. mlx-lm's server
# accepts the penalties, logit_bias and XTC; it treats repetition_penalty 0 as
# off, and 1 is the multiplicative identity, so both count as unset.
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "xtc_probability": lambda v: v not in (None, 0, 0.0),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v is not None,
}


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # the handler has seen the engine's last event (None)
    usage_chunk: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices


class Engine:
    """Owns the pair; runs the queued jobs on its own thread, alone or batched (`_run`)."""

    def __init__(self, pair, model_id: str, block_size: Optional[int] = None,
                 enable_thinking: Optional[bool] = None, max_prompt_tokens: int = 32768,
                 default_temp: float = 0.0, max_tokens_limit: int = 32768, default_max_tokens: int = 256,
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
        self.default_max_tokens = min(default_max_tokens, max_tokens_limit)
        # One lock for every use of the tokenizer, on any thread (see the module docstring).
        self.tokenizer_lock = threading.RLock()
        self.tokenizer = pair.tokenizer
        self.pair = pair
        if pair.tokenizer is not None:
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
        self.stats = {"completed": 0, "cancelled": 0, "failed": 0, "active": 0, "generated_tokens": 0}
        # Totals over finished requests, for /metrics.
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "cycles": 0, "draft_cycles": 0, "committed": 0,
                       "batch_cycles": 0, "batch_rows": 0, "batch_committed": 0}
        self.thread = threading.Thread(target=self._run, daemon=True, name="dflash-engine")
        self.thread.start()

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def _run(self):
        """Jobs in arrival order. A job that finds the engine idle and nothing queued runs
        alone (`stream_generate`: the prompt cache and the adaptive block size); jobs that
        queue up behind others are decoded together (`_run_batch`) where they can be."""
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
            elif len(waiting) > 1 and self._batchable(job) and self._batchable(waiting[1]):
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

    def _run_batch(self, waiting, adopted=None) -> None:
        """Decode the batchable jobs at the head of `waiting` together (and `adopted`, a job
        `stream_generate` handed over), letting in those that queue up while it runs, until
        the batch is empty; a job that cannot join waits for it (arrival order is kept)."""
        batch = BatchStreams(self.pair, self.batch_width, self.batch_policy, self.prompt_cache,
                             lookup=self.block_size == "auto")
        jobs = {}
        if adopted is not None:
            jobs[batch.adopt(adopted[1])] = adopted[0]
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
            for uid, job in list(jobs.items()):
                if job.cancelled.is_set():
                    batch.remove(uid)
                    self._ended(jobs.pop(uid), cancelled=True)
            if not jobs:
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

    def _join(self, batch: "BatchStreams", jobs: dict, joining: List[Job]) -> None:
        """Prefill the joining jobs (together where their prompts are short) and let them in."""
        try:
            firsts = batch.add_many([Joining(job.prompt, job.max_tokens, job.stop,
                                             Asks(job.params, make_processors(job.processor_args), job.logprobs))
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
            if event is not None:  # None: its prompt is prefilled between the batch's cycles
                self._deliver(jobs, uid, event)

    def _deliver(self, jobs: dict, uid: int, event) -> None:
        job = jobs[uid]
        self.stats["generated_tokens"] += len(event.tokens)
        job.events.put(event)
        if event.finish_reason is not None:
            self._count(event.stats)
            self._ended(jobs.pop(uid))

    def _ended(self, job: Job, cancelled: bool = False) -> None:
        self.stats["cancelled" if cancelled else "completed"] += 1
        self.stats["active"] = max(self.stats["active"] - 1, 0)
        job.events.put(None)

    def _failed(self, job: Job, error: APIError) -> None:
        self.stats["failed"] += 1
        job.events.put(error)
        job.events.put(None)

    def _run_alone(self, job: Job) -> None:
        """One job through `stream_generate`; if a job that can join it arrives meanwhile (and
        this one can be batched), it goes on in a batch with the newcomers (`_run_batch`)."""
        self.stats["active"] = 1
        handed = None

        def others_wait() -> bool:
            self._drain(self.waiting)
            return bool(self.waiting) and self.waiting[0] is not None and self._batchable(self.waiting[0])

        try:
            if self.channel is not None:
                self._mirror(job)
            events = stream_generate(self.pair, job.prompt, max_tokens=job.max_tokens,
                                     sampling=job.params, block_size=self.block_size, stop=job.stop,
                                     prompt_cache=self.prompt_cache, logprobs=job.logprobs,
                                     logits_processors=make_processors(job.processor_args),
                                     hand_over=others_wait if self._batchable(job) else None)
            while True:
                try:
                    event = next(events)
                except StopIteration as done:
                    handed = done.value
                    break
                self.stats["generated_tokens"] += len(event.tokens)
                if event.finish_reason is not None:
                    self._count(event.stats)
                job.events.put(event)
                stop = job.cancelled.is_set()
                if self.channel is not None:
                    stop = not self.channel.keep_going(stop)
                if stop:
                    break
            if handed is None:
                self.stats["cancelled" if job.cancelled.is_set() else "completed"] += 1
        except DFlashError as e:
            self.stats["failed"] += 1
            job.events.put(APIError(400, str(e)))
        except Exception as e:  # keep serving whatever one request did
            self.stats["failed"] += 1
            job.events.put(APIError(500, f"generation failed: {e}", "server_error"))
        finally:
            if handed is None:
                self.stats["active"] = 0
                job.events.put(None)
        if handed is not None:
            self._run_batch(self.waiting, (job, handed))

    def _mirror(self, job: Job) -> None:
        """Send the request to the other ranks. An unseeded sampled one gets a seed for
        MLX's generator on every rank (so all draw the same numbers) that is not the
        request's own: it still counts as unseeded and learns from the requests before it."""
        seed = None
        if job.params.temp > 0 and job.params.seed is None:
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        self.channel.send({"prompt": list(job.prompt), "max_tokens": job.max_tokens,
                           "params": dataclasses.asdict(job.params), "stop": list(job.stop),
                           "logprobs": job.logprobs, "processors": job.processor_args, "seed": seed})
        if seed is not None:
            mx.random.seed(seed)

    def _count(self, stats):
        t = self.totals
        t["prompt_tokens"] += stats.prompt_tokens
        t["cached_tokens"] += stats.cached_tokens
        t["cycles"] += stats.cycles
        t["draft_cycles"] += stats.draft_cycles
        t["committed"] += sum(stats.acceptance_lengths)

    def metrics(self) -> str:
        """Counters and gauges in Prometheus' text format."""
        t, s, pc = self.totals, self.stats, self.prompt_cache
        rows = [
            ("requests_total", "counter", "Requests by outcome.",
             [({"outcome": k}, s[k]) for k in ("completed", "cancelled", "failed")]),
            ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, t["prompt_tokens"])]),
            ("prompt_cached_tokens_total", "counter", "Prompt tokens taken from the prompt cache.",
             [({}, t["cached_tokens"])]),
            ("generated_tokens_total", "counter", "Tokens generated.", [({}, s["generated_tokens"])]),
            ("cycles_total", "counter", "Verify cycles of finished requests.", [({}, t["cycles"])]),
            ("draft_cycles_total", "counter", "Cycles that verified a draft.", [({}, t["draft_cycles"])]),
            ("committed_tokens_total", "counter", "Tokens committed by the cycles of finished requests.",
             [({}, t["committed"])]),
            ("tokens_per_cycle", "gauge", "Committed tokens per cycle, over all finished requests.",
             [({}, t["committed"] / t["cycles"] if t["cycles"] else 0.0)]),
            ("queue_length", "gauge", "Requests waiting for the engine.",
             [({}, self.queued())]),
            ("active_requests", "gauge", "Requests being generated.", [({}, s["active"])]),
            ("batch_cycles_total", "counter", "Cycles that decoded several requests in one target pass.",
             [({}, t["batch_cycles"])]),
            ("batch_sequences_total", "counter", "Requests in those cycles, summed over the cycles.",
             [({}, t["batch_rows"])]),
            ("batch_size", "gauge", "Requests per batched cycle, over all batched cycles.",
             [({}, t["batch_rows"] / t["batch_cycles"] if t["batch_cycles"] else 0.0)]),
            ("batch_tokens_per_cycle", "gauge", "Tokens a batched cycle committed per request.",
             [({}, t["batch_committed"] / t["batch_rows"] if t["batch_rows"] else 0.0)]),
        ]
        if pc is not None:
            rows += [
                ("prompt_cache_requests_total", "counter", "Requests that looked in the prompt cache, by result.",
                 [({"result": "hit"}, pc.hits), ({"result": "miss"}, pc.misses)]),
                ("prompt_cache_bytes", "gauge", "Bytes the prompt cache holds.", [({}, pc.nbytes)]),
                ("prompt_cache_entries", "gauge", "Entries the prompt cache holds.", [({}, len(pc))]),
            ]
        if pc is not None and pc.disk is not None:
            d = pc.disk
            rows += [
                ("prompt_cache_disk_hits_total", "counter", "Requests that read a prefix back from disk.",
                 [({}, d.hits)]),
                ("prompt_cache_disk_bytes", "gauge", "Bytes of the prompt cache's files on disk.", [({}, d.nbytes)]),
                ("prompt_cache_disk_entries", "gauge", "Prompt cache entries on disk.", [({}, len(d))]),
            ]
        lines = []
        for name, kind, help_, samples in rows:
            lines += [f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} {kind}"]
            for labels, value in samples:
                tag = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"dflash_{name}{{{tag}}} {value}" if tag else f"dflash_{name} {value}")
        return "\n".join(lines) + "\n"

    def close(self):
        """Stop the engine after the queued requests; with a disk tier, wait until memory
        is spilled to it; under mlx.launch, until the other ranks are told to stop."""
        self.jobs.put(None)
        if (self.prompt_cache is not None and self.prompt_cache.disk is not None) or self.channel is not None:
            self.thread.join()


def _get(body, name, types, default=None, check=None, what=""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    if not isinstance(value, types) or (check is not None and not check(value)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    return value


# Arguments of apply_chat_template itself, which chat_template_kwargs may not set.
_TEMPLATE_RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                      "return_tensors", "chat_template", "tools", "documents", "continue_final_message",
                      "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _chat_prompt(tok, messages, thinking, extra) -> List[int]:
    if not extra:
        return build_chat_prompt(tok, messages, thinking)
    # As build_chat_prompt, with the client's other template variables (mlx-lm passes them on too).
    kwargs = dict(extra)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def _tokenize(engine: Engine, body, chat: bool, tools: Optional[list] = None) -> List[int]:
    tok = engine.tokenizer
    if chat:
        messages = _get(body, "messages", list, None, lambda v: len(v) > 0, "a non-empty list of messages")
        if messages is None:
            raise APIError(400, "'messages' is required.", param="messages")
        try:
            messages = template_messages(messages)
            shown = tool_choice(body.get("tool_choice"), tools)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param)
        extra = body.get("chat_template_kwargs")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
        reserved = sorted(set(extra) & _TEMPLATE_RESERVED)
        if reserved:
            raise APIError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)}.",
                           param="chat_template_kwargs")
        extra = dict(extra, **shown)
        thinking, where = extra.pop("enable_thinking", None), "chat_template_kwargs"
        if body.get("enable_thinking") is not None:
            thinking, where = body["enable_thinking"], "enable_thinking"
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, "'enable_thinking' must be a boolean.", param=where)
        if thinking is None:
            thinking = engine.enable_thinking
        with engine.tokenizer_lock:
            if getattr(tok, "chat_template", None):
                try:
                    return _chat_prompt(tok, messages, thinking, extra)
                except Exception as e:  # the template refused these messages (jinja's raise_exception)
                    if type(e).__module__.startswith("jinja2"):
                        raise APIError(400, f"The chat template rejected the messages: {e}", param="messages")
                    raise
            return tok.encode("\n".join(m["content"] for m in messages))
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise APIError(400, "'prompt' must be a string.", param="prompt")
    with engine.tokenizer_lock:
        return tok.encode(text)


def parse_request(engine: Engine, body: Any, chat: bool):
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != engine.model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{engine.model_id}'.",
                       param="model", code="model_not_found")
    for name, bad in UNSUPPORTED.items():
        if name in body and bad(body[name]):
            raise APIError(400, f"'{name}' is not supported yet by this DFlash server; remove it "
                                f"(or leave it at its default).", param=name, code="unsupported_parameter")
    # Cheap checks first: a request that fails them costs no tokenizer time.
    # max_completion_tokens (OpenAI's current name, and mlx-lm's first choice) wins over max_tokens.
    limit = engine.max_tokens_limit
    max_tokens, name = None, "max_tokens"
    for name in ("max_completion_tokens", "max_tokens"):
        max_tokens = _get(body, name, int, None, lambda v: v >= 1, "a positive integer")
        if max_tokens is not None:
            break
    # Over the server's limit is refused, as OpenAI refuses a max_tokens over the
    # model's limit, rather than clamped: a client asking for more than it can get
    # should hear so, not find a finish_reason "length" it did not expect.
    if max_tokens is not None and max_tokens > limit:
        raise APIError(400, f"'{name}' is too large: {max_tokens}. This server generates at most {limit} "
                            f"tokens per request.", param=name, code="invalid_value")
    if max_tokens is None:
        max_tokens = engine.default_max_tokens
    temp = _get(body, "temperature", (int, float), engine.default_temp, lambda v: 0 <= v <= 2,
                "a number in [0, 2]")
    top_p = _get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lambda v: v >= 0, "a non-negative integer")
    min_p = _get(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    seed = _get(body, "seed", int, None, None, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP):
        raise APIError(400, f"'stop' must be a string or a list of up to {MAX_STOP} strings.", param="stop")
    stream = _get(body, "stream", bool, False, None, "a boolean")
    if chat:
        top = _get(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                   f"an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not _get(body, "logprobs", bool, False, None, "a boolean"):
            if top is not None:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
            logprobs = None
        else:
            logprobs = top or 0
    else:
        logprobs = _get(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                        f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    params = SamplingParams(temp=float(temp), top_p=float(top_p), top_k=top_k, min_p=float(min_p), seed=seed)
    processors = _processor_args(body, engine)

    tools = None
    if chat and body.get("tools"):
        try:
            tools = check_tools(body["tools"])
        except ToolError as e:
            raise APIError(400, str(e), param=e.param)
        with engine.tokenizer_lock:
            if not engine.tokenizer.has_tool_calling:
                raise APIError(400, "This model's chat template has no tool calling (mlx-lm found no tool-call "
                                    "format for it); send the request without 'tools'.", param="tools")
        if body.get("tool_choice") == "none":
            tools = None  # not shown to the model, and its text is not parsed for calls
    prompt = _tokenize(engine, body, chat, tools)
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="messages" if chat else "prompt")
    if len(prompt) > engine.max_prompt_tokens:
        raise APIError(400, f"The prompt has {len(prompt)} tokens; this server accepts at most "
                            f"{engine.max_prompt_tokens}.", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    window = getattr(engine.pair.target.args, "max_position_embeddings", None)
    if window and len(prompt) > window:  # refused before any byte of a response, streamed or not
        raise APIError(400, f"The prompt has {len(prompt)} tokens but the model reads at most {window}; "
                            "shorten the prompt.", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    job = Job(prompt, max_tokens, params, stop, logprobs, processors, tools)
    options = _get(body, "stream_options", dict, None, None, "an object") if stream else None
    if options is not None:
        job.usage_chunk = _get(options, "include_usage", bool, False, None, "a boolean")
    return job, stream


def _processor_args(body, engine: Engine) -> dict:
    """`make_logits_processors`' arguments for the request's penalties and logit bias (as mlx-lm's server reads them)."""
    number = (int, float)
    penalties = {}
    for name, check, what in (("repetition_penalty", lambda v: v > 0, "a positive number"),
                              ("presence_penalty", lambda v: -2 <= v <= 2, "a number from -2 to 2"),
                              ("frequency_penalty", lambda v: -2 <= v <= 2, "a number from -2 to 2")):
        value = _get(body, name, number, None, check, what)
        neutral = 1 if name == "repetition_penalty" else 0
        if value is not None and value != neutral:
            penalties[name] = float(value)
            size = name.replace("penalty", "context_size")
            penalties[size] = _get(body, size, int, 20, lambda v: v >= 1, "a positive integer")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object mapping token ids to biases.", param="logit_bias")
    vocab = engine.pair.target.vocab_size
    parsed = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab:
            raise APIError(400, f"'logit_bias' key {key!r} is not a token id of this model (0 to {vocab - 1}).",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, number) or not -100 <= value <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers from -100 to 100 (got {value!r}).",
                           param="logit_bias")
        parsed[token] = float(value)
    if not penalties and not parsed:
        return {}
    return dict(penalties, logit_bias=parsed or None)


def parse_messages(engine: Engine, body: Any):
    """An Anthropic Messages API request as the equivalent chat request's job (`parse_request`)."""
    try:
        chat = messages_api.to_chat(body)
    except messages_api.BadRequest as e:
        raise APIError(400, str(e), param=e.param)
    return parse_request(engine, chat, True)


def count_tokens(engine: Engine, body: Any) -> int:
    """The prompt tokens a Messages API request would run (Anthropic's count_tokens)."""
    if isinstance(body, dict):
        body = {**body, "max_tokens": 1}  # not part of a count request
    try:
        chat = messages_api.to_chat(body)
    except messages_api.BadRequest as e:
        raise APIError(400, str(e), param=e.param)
    tools = check_tools(chat["tools"]) if chat.get("tools") else None
    return len(_tokenize(engine, chat, True, tools))
