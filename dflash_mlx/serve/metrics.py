"""The server's metrics in Prometheus' text format, read from the worker's counts."""

from .worker import Engine


def text(engine: Engine) -> str:
    """Counters and gauges in Prometheus' text format."""
    t, s, pc = engine.totals, engine.stats, engine.prompt_cache
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
         [({}, engine.queued())]),
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
