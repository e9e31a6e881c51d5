"""The server's Prometheus metrics, read from the worker at each scrape.

Each server has a registry of its own (`registry`), not prometheus_client's
global one, so servers in one process keep their counts apart; `/metrics`
serves it with `prometheus_client.generate_latest`. The counts live where
they are made: the worker's `stats` and `totals` (which `/health` reports
too) and the prompt cache's own. `EngineCollector` turns them into metric
families when Prometheus asks, so nothing is counted twice. Counters are
named without their `_total`, which prometheus_client adds.
"""

from typing import Iterator, Optional, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..cache.prompt_cache import PromptCache
from .worker import Engine

PREFIX = "dflash_"


def _counter(name: str, doc: str, value: Optional[float] = None,
             labels: Optional[Sequence[str]] = None) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value, labels=labels)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


class EngineCollector:
    """A prometheus_client collector over one worker (`Engine`)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._batches()
        pc = self.engine.prompt_cache
        if pc is not None:
            yield from self._prompt_cache(pc)

    def _requests(self) -> Iterator[Metric]:
        s, t = self.engine.stats, self.engine.totals
        outcomes = _counter("requests", "Requests by outcome.", labels=["outcome"])
        for outcome in ("completed", "cancelled", "failed", "refused"):
            outcomes.add_metric([outcome], s[outcome])
        yield outcomes
        refusals = _counter("refusals", "Requests refused (4xx) before they reached the engine, by HTTP status.",
                            labels=["status"])
        for status, n in sorted(self.engine.refusals.items()):
            refusals.add_metric([str(status)], n)
        yield refusals
        yield _counter("prompt_tokens", "Prompt tokens of finished requests.", t["prompt_tokens"])
        yield _counter("prompt_cached_tokens", "Prompt tokens taken from the prompt cache.", t["cached_tokens"])
        yield _counter("generated_tokens", "Tokens generated.", s["generated_tokens"])
        yield _counter("cycles", "Verify cycles of finished requests.", t["cycles"])
        yield _counter("draft_cycles", "Cycles that verified a draft.", t["draft_cycles"])
        yield _counter("committed_tokens", "Tokens committed by the cycles of finished requests.", t["committed"])
        yield _gauge("tokens_per_cycle", "Committed tokens per cycle, over all finished requests.",
                     _ratio(t["committed"], t["cycles"]))
        yield _gauge("queue_length", "Requests waiting for the engine.", self.engine.queued())
        yield _gauge("active_requests", "Requests being generated.", s["active"])

    def _batches(self) -> Iterator[Metric]:
        t = self.engine.totals
        yield _counter("batch_cycles", "Cycles that decoded several requests in one target pass.",
                       t["batch_cycles"])
        yield _counter("batch_sequences", "Requests in those cycles, summed over the cycles.", t["batch_rows"])
        yield _gauge("batch_size", "Requests per batched cycle, over all batched cycles.",
                     _ratio(t["batch_rows"], t["batch_cycles"]))
        yield _gauge("batch_tokens_per_cycle", "Tokens a batched cycle committed per request.",
                     _ratio(t["batch_committed"], t["batch_rows"]))

    def _prompt_cache(self, pc: PromptCache) -> Iterator[Metric]:
        lookups = _counter("prompt_cache_requests", "Requests that looked in the prompt cache, by result.",
                           labels=["result"])
        lookups.add_metric(["hit"], pc.hits)
        lookups.add_metric(["miss"], pc.misses)
        yield lookups
        yield _gauge("prompt_cache_bytes", "Bytes the prompt cache holds.", pc.nbytes)
        yield _gauge("prompt_cache_entries", "Entries the prompt cache holds.", len(pc))
        if pc.disk is not None:
            d = pc.disk
            yield _counter("prompt_cache_disk_hits", "Requests that read a prefix back from disk.", d.hits)
            yield _gauge("prompt_cache_disk_bytes", "Bytes of the prompt cache's files on disk.", d.nbytes)
            yield _gauge("prompt_cache_disk_entries", "Prompt cache entries on disk.", len(d))


def registry(engine: Engine) -> CollectorRegistry:
    """A registry of its own for one server: its worker's metrics."""
    out = CollectorRegistry(auto_describe=True)
    out.register(EngineCollector(engine))
    return out
