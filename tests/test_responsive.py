"""A server that stays responsive under agents: a long prompt is prefilled in slices even when
nothing else decodes, so a short request that comes meanwhile starts at once and a cancelled one
stops at the next slice; outputs stay those of each request alone."""

import json
import socket
import threading
import time
import urllib.request

import pytest

import dflash_mlx
from dflash_mlx.decode.streams import Joining, Streams
from dflash_mlx.policy import join

SLICE = 64  # tokens per slice in these tests: a long prompt takes many


@pytest.fixture
def slices(monkeypatch):
    monkeypatch.setattr(join.JoinChunks, "slice", lambda self: SLICE)


def long_prompt(pair, n=1500):
    ids = pair.tokenizer.encode("def add(a, b):\n    return a + b\n" * 200)
    return ids[:n]


def alone(pair, prompt, max_tokens):
    return [t for e in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, block_size=4) for t in e.tokens]


def test_a_long_prompt_alone_is_sliced_and_a_short_one_starts_meanwhile(pairs, slices):
    pair = pairs["qwen3"]
    long, short = long_prompt(pair), pair.tokenizer.encode("Once upon a time")
    streams = Streams(pair, 4, block_size=4)
    (uid, first), = streams.add_many([Joining(long, 12)])
    assert first is None  # prefilling, a slice per step
    for _ in range(3):
        assert streams.step() == []
    assert len(streams.decoder.filling) == 1
    (sid, sfirst), = streams.add_many([Joining(short, 12)])
    assert sfirst is not None and sfirst.tokens  # its first token at once, not after the long prefill
    got = {uid: [], sid: list(sfirst.tokens)}
    steps = 0
    while len(streams):
        for u, e in streams.step():
            got[u] += e.tokens
        steps += 1
    assert steps >= len(long) // SLICE - 3  # the long prompt went in slice by slice
    assert got[uid] == alone(pair, long, 12) and got[sid] == alone(pair, short, 12)


def test_a_cancelled_prefill_stops_at_the_next_slice(pairs, slices):
    pair = pairs["qwen3"]
    streams = Streams(pair, 4, block_size=4)
    (uid, first), = streams.add_many([Joining(long_prompt(pair), 12)])
    assert first is None
    streams.step()
    streams.remove(uid)
    assert len(streams) == 0 and len(streams.decoder.filling) == 0
    assert streams.step() == []


@pytest.fixture
def server(pairs):
    from dflash_mlx.serve.http_server import make_server

    srv = make_server(pairs["qwen3"], "tiny", "127.0.0.1", 0, block_size=4)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, srv.server_address[1]
    srv.shutdown()
    srv.engine.close()


def test_an_abandoned_long_request_does_not_hold_up_the_next(server, pairs, slices):
    """A client that sends a long prompt and hangs up during its prefill: the engine stops it at its
    next slice, and a short request sent next is answered while nothing is left active."""
    srv, port = server
    engine = srv.engine
    text = pairs["qwen3"].tokenizer.decode(long_prompt(pairs["qwen3"], 3500))
    body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 8, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 60
    while engine.stats["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats["active"] == 1  # it is prefilling
    s.close()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 30
    while engine.stats["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats["cancelled"] == 1 and engine.stats["active"] == 0
    assert engine.stats["generated_tokens"] == 4  # the long one stopped before its first token
