"""`dflash-mlx serve` over real HTTP on loopback, with the official openai client."""

import copy
import re
import http.client
import json
import socket
import threading
import time

import prometheus_client
import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app
from dflash_mlx.serve.http_server import make_server

openai = pytest.importorskip("openai")
MODEL = "tiny-qwen3"
ENGINES = {}  # the module's served engine, for tests that reach into it


def start(pair, **kw):
    server = make_server(pair, MODEL, "127.0.0.1", 0, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def served(targets, drafters):
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    server, url = start(pair, max_prompt_tokens=200, max_tokens_limit=20000)
    ENGINES["served"], ENGINES["server"] = server.engine, server
    yield pair, url
    server.shutdown()
    server.engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def expected_chat(targets, drafters, text, max_tokens, *args):
    """What the `generate` command prints for the same prompt."""
    r = CliRunner().invoke(app, ["generate", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                 "--prompt", text, "-m", str(max_tokens), *args])
    assert r.exit_code == 0, r.output
    return r.stdout[:-1]


def test_chat_matches_the_generate_command(client, targets, drafters):
    want = expected_chat(targets, drafters, "def add(a, b):", 24)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
    assert r.usage.model_extra["dflash"]["mean_acceptance_length"] >= 1
    assert r.usage.model_extra["dflash"]["cycles"] >= 1

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                            max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_stream_and_not(client, served):
    pair = served[0]
    want, _ = dflash_mlx.generate(pair, "import math", max_tokens=16)
    r = client.completions.create(model=MODEL, prompt="import math", max_tokens=16, temperature=0)
    assert r.choices[0].text == want
    parts = list(client.completions.create(model=MODEL, prompt="import math", max_tokens=16,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == want
    stopped = client.completions.create(model=MODEL, prompt="import math", max_tokens=16, temperature=0,
                                        stop=[want[4:7]])
    assert stopped.choices[0].text == want[: want.index(want[4:7])]
    assert stopped.choices[0].finish_reason == "stop"


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list()] == [MODEL]
    conn = http.client.HTTPConnection(served[1][7:])
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"


def test_32_concurrent_clients(client, served):
    pair = served[0]
    prompts = ["def add(a, b):", "The quick brown fox", "import math", "for i in range(10):"]
    want = {p: dflash_mlx.generate(pair, p, max_tokens=12)[0] for p in prompts}
    results, errors = {}, []

    def ask(i):
        p = prompts[i % len(prompts)]
        try:
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=i % 2 == 0)
            text = "".join(c.choices[0].text for c in r) if i % 2 == 0 else r.choices[0].text
            results[i] = (p, text)
        except Exception as e:  # collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert len(results) == 32
    assert all(text == want[p] for p, text in results.values())


def metric(url, name):
    conn = http.client.HTTPConnection(url[7:])
    conn.request("GET", "/metrics")
    lines = conn.getresponse().read().decode().splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith(f"dflash_{name} ")))


def test_requests_that_queue_up_are_decoded_together(client, served):
    """Requests that arrive while another runs are batched: one target pass per cycle for all
    of them, each answer what it is alone, streamed or not: greedy, sampled with a seed,
    with penalties and logit bias, with log probabilities and with stop strings."""
    pair, url = served
    prompts = ["class Stack:", "def fib(n):", "import os", "while True:", "x = [1, 2, 3]", "print('hi')"]
    asks = [{"temperature": 0}, {"temperature": 0}, {"temperature": 0.8, "seed": 4},
            {"temperature": 0, "frequency_penalty": 0.8, "logit_bias": {"17": 3}},
            {"temperature": 1.1, "top_p": 0.9, "seed": 5, "presence_penalty": 0.5},
            {"temperature": 0, "logprobs": 2}]

    def ask(i, stream, **kw):
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, stream=stream, **asks[i], **kw)
        if not stream:
            return r.choices[0].text, r.choices[0].logprobs
        chunks = list(r)
        return "".join(c.choices[0].text for c in chunks), None

    want = [ask(i, False) for i in range(len(prompts))]  # one at a time: each runs alone
    stop = want[1][0][5:8]
    cut = want[1][0][: want[1][0].index(stop)]
    before = metric(url, "batch_cycles_total"), metric(url, "batch_sequences_total")
    results, errors = {}, []

    def run(i):
        try:
            results[i] = ask(i, i % 2 == 0 and i != 5, **(dict(stop=[stop]) if i == 1 else {}))
        except Exception as e:  # collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert {i: text for i, (text, _) in results.items()} == {
        i: cut if i == 1 else text for i, (text, _) in enumerate(want)}
    lps, alone = results[5][1], want[5][1]
    assert lps.tokens == alone.tokens and len(lps.top_logprobs[0]) == 2
    assert all(abs(a - b) < 1e-3 for a, b in zip(lps.token_logprobs, alone.token_logprobs))
    cycles = metric(url, "batch_cycles_total") - before[0]
    rows = metric(url, "batch_sequences_total") - before[1]
    assert cycles > 0 and rows / cycles > 1.5  # several requests per target pass


def test_a_running_request_is_joined_by_one_that_arrives(client, served):
    """A request running alone goes on in a batch when another arrives: the newcomer's first
    token comes while the first request still runs, and both answers are what they are alone."""
    pair, url = served
    long_text, short_text = "def main():", "import sys"
    want_long = dflash_mlx.generate(pair, long_text, max_tokens=160)[0]
    want_short = dflash_mlx.generate(pair, short_text, max_tokens=30)[0]
    before = metric(url, "batch_cycles_total")
    got, times = {}, {}
    started = threading.Event()

    def run_long():
        parts = []
        for chunk in client.completions.create(model=MODEL, prompt=long_text, max_tokens=160, temperature=0,
                                               stream=True):
            parts.append(chunk.choices[0].text)
            started.set()
        times["long_done"] = time.monotonic()
        got["long"] = "".join(parts)

    t = threading.Thread(target=run_long)
    t.start()
    assert started.wait(60)
    stream = client.completions.create(model=MODEL, prompt=short_text, max_tokens=30, temperature=0, stream=True)
    parts = []
    for chunk in stream:
        times.setdefault("short_first", time.monotonic())
        parts.append(chunk.choices[0].text)
    t.join(120)
    assert "".join(parts) == want_short and got["long"] == want_long
    assert times["short_first"] < times["long_done"]
    assert metric(url, "batch_cycles_total") > before


def health(url):
    conn = http.client.HTTPConnection(url[7:])
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def test_disconnect_mid_stream_stops_generation(served, client):
    url = served[1]
    before = health(url)
    host, port = url[7:].split(":")
    body = json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4000, "stream": True})
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.0 200") or received.startswith(b"HTTP/1.1 200")
    sock.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        h = health(url)
        if h["cancelled"] > before["cancelled"] and h["active"] == 0:
            break
        time.sleep(0.1)
    assert h["cancelled"] == before["cancelled"] + 1
    assert h["completed"] == before["completed"]
    r = client.completions.create(model=MODEL, prompt="import math", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def raw_post(url, path, body, headers=None):
    conn = http.client.HTTPConnection(url[7:], timeout=60)  # a request wrongly accepted must not hang the suite
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "JSON object"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "'n' is not supported"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 3}}, 400,
         "'logit_bias' key 'abc' is not a token id of this model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "maximum context length is 200 tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20001}, 400,
         "'max_tokens' is too large: 20001. This server generates at most 20000"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 9}, 400,
         "'max_completion_tokens' is too large"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}, 400,
         "'chat_template_kwargs' must be an object"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"}, 400,
         "'chat_template_kwargs' must be an object"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"enable_thinking": "no"}}, 400, "'enable_thinking' must be a boolean"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"tokenize": True}}, 400, "may not set tokenize"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, 400,
         "'repetition_penalty' must be a positive number"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400,
         "'presence_penalty' must be a number from -2 to 2"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": "x"}, 400,
         "'frequency_penalty' must be a number from -2 to 2"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -101}}, 400,
         "'logit_bias' values must be numbers from -100 to 100"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}, 400,
         "'logit_bias' key '99999' is not a token id"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.2,
          "repetition_context_size": 0}, 400, "'repetition_context_size' must be a positive integer"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "xtc_probability": 0.5}, 400,
         "'xtc_probability' is not supported yet"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400,
         "'response_format' must be"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "needs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "strin"}}}}, 400,
         "unknown type 'strin'"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                   "schema": {"type": "array", "uniqueItems": True}}}}, 400,
         "uniqueItems"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
         "'top_logprobs' needs 'logprobs': true"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
         400, "'top_logprobs' must be an integer from 0 to 20"),
    ],
)
def test_bad_requests_get_openai_style_errors(served, body, status, words):
    url = served[1]
    got, err = raw_post(url, "/v1/chat/completions", body)
    assert got == status
    assert words in err["error"]["message"] and err["error"]["type"]
    if isinstance(body, dict) and status == 400 and "messages" not in words:
        assert err["error"]["param"] in body
    assert health(url)["status"] == "ok"


def test_completion_prompt_over_the_limit(served):
    got, err = raw_post(served[1], "/v1/completions", {"model": MODEL, "prompt": "word " * 400})
    assert got == 400 and "maximum context length is 200 tokens" in err["error"]["message"]
    assert err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "prompt"
    got, err = raw_post(served[1], "/v1/messages", {"model": MODEL, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "word " * 400}]})
    assert got == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 200 maximum", err["error"]["message"]), err


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
        presence_penalty=0, frequency_penalty=0.0, logit_bias={},
        extra_body={"repetition_penalty": 1.0, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.usage.completion_tokens == 3
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0)
    assert r.usage.prompt_tokens < plain.usage.prompt_tokens  # the template saw enable_thinking=True


def raw_exchange(url, head, body=b""):
    """Send raw bytes; return (status, parsed JSON body) of the reply the server closes on."""
    host, port = url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while True:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.parametrize("length", ["abc", "-5", "1.5", "", "+7", "\u0667"])
def test_bad_content_length_gets_a_json_400(served, length):
    url = served[1]
    body = b'{"prompt": "hi", "max_tokens": 2}'
    status, err = raw_exchange(url, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    f"Content-Length: {length}\r\n\r\n", body)
    assert status == 400
    assert "Content-Length" in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    assert health(url)["status"] == "ok"


def test_chunked_body_gets_a_json_411(served):
    status, err = raw_exchange(served[1], "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                          "Transfer-Encoding: chunked\r\n\r\n", b"2\r\n{}\r\n0\r\n\r\n")
    assert status == 411 and "Content-Length" in err["error"]["message"]


def test_api_key(targets, drafters):
    pair = dflash_mlx.load(str(targets["llama"]), str(drafters["new"]))
    server, url = start(pair, api_key="s3cret")
    try:
        status, err = raw_post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, _ = raw_post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                             {"Authorization": "Bearer wrong"})
        assert status == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        server.shutdown()
        server.engine.close()


def wait_for(url, cond, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = health(url)
        if cond(h):
            return h
        time.sleep(0.05)
    return health(url)


def send_raw_request(url, body):
    host, port = url[7:].split(":")
    data = json.dumps(body)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return sock


LONG = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 20000}


def start_long_request(url):
    """The health before, and the socket of a long request once it is generating."""
    before = wait_for(url, lambda h: h["active"] == 0 and h["queued"] == 0)
    sock = send_raw_request(url, LONG)
    wait_for(url, lambda h: h["active"] == 1 and h["generated_tokens"] > before["generated_tokens"])
    return before, sock


def test_disconnect_before_a_complete_answer_stops_generation(served, client, monkeypatch):
    """A non-streaming client that hangs up, while generating or while queued, cancels its job."""
    url = served[1]
    # As for a target that cannot be batched: the second request waits in the queue.
    monkeypatch.setattr(ENGINES["served"], "batch_width", None)
    before, running = start_long_request(url)
    queued = send_raw_request(url, {**LONG, "prompt": "import math", "temperature": 0.7})
    wait_for(url, lambda h: h["queued"] == 1)
    queued.close()
    time.sleep(0.5)  # the handler notices while the job still waits in the queue
    running.close()
    h = wait_for(url, lambda h: h["cancelled"] >= before["cancelled"] + 2 and h["active"] == 0)
    assert h["cancelled"] == before["cancelled"] + 2
    assert h["completed"] == before["completed"]
    assert h["generated_tokens"] - before["generated_tokens"] < 20000 // 4
    tic = time.time()
    r = client.completions.create(model=MODEL, prompt="import math", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 and time.time() - tic < 30


def test_disconnect_from_a_batch_stops_only_that_request(served, client):
    """Of two batched requests, the one whose client hangs up leaves the batch; the other goes on."""
    url = served[1]
    before, first = start_long_request(url)
    second = send_raw_request(url, {**LONG, "prompt": "import math"})
    assert wait_for(url, lambda h: h["active"] == 2)["active"] == 2  # batched together
    first.close()
    h = wait_for(url, lambda h: h["cancelled"] == before["cancelled"] + 1 and h["active"] == 1)
    assert h["cancelled"] == before["cancelled"] + 1 and h["active"] == 1
    second.close()
    h = wait_for(url, lambda h: h["cancelled"] == before["cancelled"] + 2 and h["active"] == 0)
    assert h["completed"] == before["completed"]


def test_seeded_sampling_is_reproducible(client):
    def ask(seed, stream=False, prompt="def add(a, b):"):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0.9,
                  top_p=0.95, stream=stream)
        if seed is not None:
            kw["seed"] = seed
        r = client.chat.completions.create(**kw)
        return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content

    first = ask(11)
    ask(None, prompt="The quick brown fox")  # unseeded sampling in between moves the random state
    client.completions.create(model=MODEL, prompt="import math", max_tokens=5, temperature=0.7, seed=3)
    assert ask(11) == first
    assert ask(11, stream=True) == first
    greedy = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                            max_tokens=24, temperature=0).choices[0].message.content
    assert {first, ask(12), ask(13)} != {greedy}  # it did sample


class BorrowChecked:
    """A tokenizer that, like a Hugging Face fast tokenizer's Rust core, fails with
    "Already borrowed" when two threads use it at once (here: deterministically,
    each use holding it a little while)."""

    def __init__(self, obj, busy=None):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_busy", busy or threading.Lock())

    def _use(self, fn, *args, **kwargs):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("Already borrowed")
        try:
            time.sleep(0.0005)
            return fn(*args, **kwargs)
        finally:
            self._busy.release()

    def __getattr__(self, name):
        value = self._use(getattr, self._obj, name)
        if name == "detokenizer":
            return BorrowChecked(value, self._busy)
        if callable(value):
            return lambda *a, **k: self._use(value, *a, **k)
        return value

    def __setattr__(self, name, value):
        self._use(setattr, self._obj, name, value)

    def __len__(self):
        return self._use(len, self._obj)


def test_concurrent_tokenization_while_generating(served):
    """Handler threads template and encode while the engine detokenises: no errors, right answers."""
    pair = copy.copy(served[0])
    pair.tokenizer = BorrowChecked(served[0].tokenizer)
    server, url = start(pair)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        turns = [{"role": r, "content": f"def f{i}(x): return x * {i}"}
                 for i, r in zip(range(12), ["user", "assistant"] * 6)]
        requests = []
        for i in range(3):
            messages = turns[: 7 + i * 2] + [{"role": "user", "content": "for i in range(10):"}]
            requests.append(("chat", messages))
            requests.append(("completion", "The quick brown fox " * (i + 1)))

        def ask(kind, what, stream):
            if kind == "chat":
                r = client.chat.completions.create(model=MODEL, messages=what, max_tokens=4, temperature=0,
                                                   stream=stream)
                return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
            r = client.completions.create(model=MODEL, prompt=what, max_tokens=4, temperature=0, stream=stream)
            return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

        want = [ask(kind, what, False) for kind, what in requests]  # one at a time: nothing to race with
        results, errors = {}, []

        def worker(i):
            kind, what = requests[i % len(requests)]
            try:
                results[i] = ask(kind, what, i % 3 == 0)
            except Exception as e:  # collected and reported below
                errors.append(f"{e!r} (caused by {e.__cause__!r})")

        # A long stream keeps the engine detokenising while the others are templated and encoded.
        background = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=200, temperature=0,
                                               stream=True)
        first = next(iter(background))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        rest = "".join(c.choices[0].text for c in background)
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert len(results) == 24
        assert all(results[i] == want[i % len(requests)] for i in results)
        assert len(first.choices[0].text + rest) > 0
    finally:
        server.shutdown()
        server.engine.close()


def test_serve_command_limits(targets, drafters, tmp_path):
    """The real `serve` command, as a process: --max-tokens bounds requests, --default-max-tokens fills them."""
    import os
    import re
    import shutil
    import subprocess
    import sys

    exe = shutil.which("dflash-mlx")
    cmd = [exe] if exe else [sys.executable, "-m", "dflash_mlx.cli.main"]
    proc = subprocess.Popen(cmd + ["serve", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                   "--port", "0", "--block-size", "4", "--max-tokens", "12",
                                   "--default-max-tokens", "3"],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, DFLASH_MLX_CACHE=str(tmp_path)))
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "serve exited before listening"
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line).group(1)
        chat = {"model": str(targets["qwen3"]), "messages": [{"role": "user", "content": "count"}]}
        status, body = raw_post(url, "/v1/chat/completions", dict(chat, max_tokens=13))
        assert status == 400 and "max_tokens" in json.dumps(body)
        status, body = raw_post(url, "/v1/chat/completions", chat)
        assert status == 200 and body["usage"]["completion_tokens"] <= 3
        assert body["choices"][0]["finish_reason"] == "length" or body["usage"]["completion_tokens"] < 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_request_without_max_tokens_may_run_to_the_context(served):
    """OpenAI's meaning of no max_tokens (agents such as Codex send none): up to the model's window
    or the server's --max-tokens, not a short default."""
    pair, url = served
    window = pair.target.args.max_position_embeddings
    engine = ENGINES["served"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "temperature": 0}
    from dflash_mlx.serve.requests import parse_request

    job, _ = parse_request(engine, chat, True)
    assert job.max_tokens == min(engine.max_tokens_limit, window - len(job.prompt))
    assert engine.default_max_tokens is None



def test_a_growing_conversation_starts_from_the_prompt_cache(targets, drafters):
    """Each turn reuses the previous request's caches (usage says how many
    prompt tokens) and answers exactly as a server without the cache."""
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    runs = []
    for size in (4 << 30, 0):
        server, url = start(pair, prompt_cache_bytes=size)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages, answers, cached = [], [], []
        for turn in ["def add(a, b):", "import math", "for i in range(10):"]:
            messages.append({"role": "user", "content": turn})
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
            answers.append(r.choices[0].message.content)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": answers[-1]})
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        conn.request("GET", "/metrics")
        reply = conn.getresponse()
        assert reply.getheader("Content-Type") == prometheus_client.CONTENT_TYPE_LATEST
        metrics = parse_metrics(reply.read().decode())
        server.shutdown()
        server.engine.close()
        runs.append((answers, cached, health, metrics))
    (warm, cached, health, metrics), (cold, none, plain_health, plain_metrics) = runs
    assert warm == cold
    assert cached[0] == 0 and all(n > 10 for n in cached[1:]) and none == [0, 0, 0]
    assert health["prompt_cache"]["hits"] == 2 and health["prompt_cache"]["bytes"] > 0
    assert "prompt_cache" not in plain_health

    assert metrics['dflash_requests_total{outcome="completed"}'] == 3
    assert metrics['dflash_prompt_cache_requests_total{result="hit"}'] == 2
    assert metrics['dflash_prompt_cache_requests_total{result="miss"}'] == 1
    assert metrics["dflash_prompt_cached_tokens_total"] == sum(cached)
    assert metrics["dflash_generated_tokens_total"] == 3 * 16
    assert metrics["dflash_committed_tokens_total"] == 3 * 16 - 3  # the first token of each comes from prefill
    assert metrics["dflash_tokens_per_cycle"] == pytest.approx(45 / metrics["dflash_cycles_total"])
    assert metrics["dflash_queue_length"] == 0
    assert "dflash_prompt_cache_bytes" not in plain_metrics and plain_metrics["dflash_cycles_total"] > 0
    assert plain_metrics['dflash_requests_total{outcome="completed"}'] == 3  # each server counts its own


def parse_metrics(text):
    """Prometheus text format -> {'name{labels}': value}, each family with HELP and TYPE."""
    out, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            assert key.split("{")[0] in typed
            out[key] = float(value)
    return out


@pytest.mark.parametrize("size", ["lots", "-1GB", "4XB"])
def test_a_bad_prompt_cache_size_is_one_clear_line(size):
    r = CliRunner().invoke(app, ["serve", "--prompt-cache-bytes", size])
    assert r.exit_code == 1
    assert f"--prompt-cache-bytes takes a size such as 8GB, 512MB or 0 (got '{size}')" in r.output


def test_logprobs_chat_and_completions_streamed_or_not(client, served):
    """The numbers are the loop's own (checked against mlx-lm in test_logprobs); here
    every token gets its entry, in OpenAI's shapes, streamed or not."""
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert "".join(c.token for c in content).replace("\ufffd", "") == r.choices[0].message.content.replace("\ufffd", "")
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
        assert c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy takes the best
        assert bytes(c.bytes).decode() == c.token
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]

    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    bare = lambda t: t.replace("\ufffd", "")  # noqa: E731 (a character split over tokens shows in each)
    assert bare("".join(lp.tokens)) == bare(r.choices[0].text) and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_penalties_and_logit_bias_are_mlx_lm_processors(client, served):
    """What the server generates with penalties is what the loop generates with
    mlx-lm's own processors for them (the loop is checked against mlx-lm in test_penalties)."""
    from mlx_lm.sample_utils import make_logits_processors

    pair = served[0]
    prompt = "Once upon a time there was a tiny language model that could count"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.3, "repetition_context_size": 8})
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8, presence_penalty=1.5,
                                   frequency_penalty=0.5)
    want, _ = dflash_mlx.generate(pair, prompt, max_tokens=16, logits_processors=procs)
    plain, _ = dflash_mlx.generate(pair, prompt, max_tokens=16)
    assert r.choices[0].text == want != plain

    token = pair.tokenizer.encode(" fox")[-1]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  logit_bias={str(token): 100})
    assert pair.tokenizer.encode(r.choices[0].text) == [token] * 6 or r.choices[0].text == \
        pair.tokenizer.decode([token] * 6)


def test_stream_usage_chunk_and_prompts_over_the_window(served, client, monkeypatch):
    """`stream_options.include_usage` gets OpenAI's last chunk (usage, no choices); a streamed
    prompt longer than the model's window is refused with a 400 before the stream starts; the
    stream ends as soon as the answer is whole, before the engine keeps its caches."""
    pair, url = served
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"

    engine = ENGINES["served"]
    window = pair.target.args.max_position_embeddings
    monkeypatch.setattr(engine, "max_prompt_tokens", window + 100)
    got, err = raw_post(url, "/v1/completions", {"model": MODEL, "prompt": "a " * (window + 1), "max_tokens": 4,
                                                 "stream": True})
    assert got == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert f"maximum context length is {window} tokens" in err["error"]["message"]

    store = engine.prompt_cache.store

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return store(*args, **kwargs)

    monkeypatch.setattr(engine.prompt_cache, "store", slow)
    tic = time.monotonic()
    parts = list(client.completions.create(model=MODEL, prompt="import os", max_tokens=6, temperature=0,
                                           stream=True))
    assert parts[-1].choices[0].finish_reason == "length" and time.monotonic() - tic < 1.5


def test_a_body_shorter_than_its_length_times_out(served, monkeypatch):
    """A client that sends less than its Content-Length gets a 408 once the read times out,
    and the connection is closed."""
    url = served[1]
    monkeypatch.setattr(ENGINES["server"].settings, "read_timeout_s", 1)
    host, port = url[7:].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{\"prompt\": ".encode())
    tic = time.monotonic()
    answer = b""
    while chunk := sock.recv(65536):  # the server closes the connection after its answer
        answer += chunk
    answer = answer.decode()
    sock.close()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive" in answer and time.monotonic() - tic < 10


def test_anthropic_count_tokens(served):
    """/v1/messages/count_tokens counts what /v1/messages would run."""
    url = served[1]
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "Count these words"}], "system": "Be brief."}
    got, counted = raw_post(url, "/v1/messages/count_tokens", msg)
    assert got == 200
    got, answer = raw_post(url, "/v1/messages", {**msg, "max_tokens": 2})
    assert got == 200 and counted == {"input_tokens": answer["usage"]["input_tokens"]}
    got, err = raw_post(url, "/v1/messages/count_tokens", {"model": MODEL, "messages": []})
    assert got == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_gets_a_413_before_it_is_read(served):
    """A Content-Length over the server's bound is refused before the body is read, in each API's shape."""
    from dflash_mlx.serve.http_app import MAX_BODY

    head = f"Host: x\r\nContent-Type: application/json\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n"
    status, err = raw_exchange(served[1], "POST /v1/completions HTTP/1.1\r\n" + head, b'{"prompt": ')
    assert status == 413 and f"over {MAX_BODY} bytes" in err["error"]["message"]
    status, err = raw_exchange(served[1], "POST /v1/messages HTTP/1.1\r\n" + head, b'{"messages": ')
    assert status == 413 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"


def test_no_route_and_a_wrong_method_get_json_errors(served):
    url = served[1]
    conn = http.client.HTTPConnection(url[7:], timeout=30)
    conn.request("GET", "/v1/nothing?x=1")
    reply = conn.getresponse()
    assert reply.status == 404 and json.loads(reply.read())["error"] == {
        "message": "No route /v1/nothing?x=1.", "type": "invalid_request_error", "param": None, "code": "not_found"}
    conn.request("GET", "/v1/chat/completions")
    reply = conn.getresponse()
    assert reply.status == 405 and reply.getheader("Allow") == "POST"
    assert "GET is not allowed" in json.loads(reply.read())["error"]["message"]


def test_a_body_that_trickles_in_is_read(served, monkeypatch):
    """The read timeout bounds each silence, not the whole body."""
    monkeypatch.setattr(ENGINES["server"].settings, "read_timeout_s", 1)
    host, port = served[1][7:].split(":")
    body = json.dumps({"model": MODEL, "prompt": "import math", "max_tokens": 2}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), len(body) // 3 + 1):
            time.sleep(0.6)
            sock.sendall(body[i: i + len(body) // 3 + 1])
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_stream_whose_client_leaves_while_queued_is_cancelled(served, client, monkeypatch):
    """Starlette notices a streaming client that hangs up before its first event: its job is cancelled
    while it waits in the queue, never runs, and no thread is left waiting on its events."""
    url, engine = served[1], ENGINES["served"]
    monkeypatch.setattr(engine, "batch_width", None)  # the second request waits in the queue
    jobs = []
    monkeypatch.setattr(engine, "submit", lambda job: jobs.append(job) or type(engine).submit(engine, job))
    before, running = start_long_request(url)
    queued = send_raw_request(url, {**LONG, "prompt": "import math", "stream": True})
    wait_for(url, lambda h: h["queued"] == 1)
    queued.close()
    deadline = time.time() + 30
    while not jobs[-1].cancelled.is_set() and time.time() < deadline:
        time.sleep(0.05)
    assert jobs[-1].cancelled.is_set() and health(url)["queued"] == 1 and not jobs[0].cancelled.is_set()
    running.close()
    h = wait_for(url, lambda h: h["cancelled"] == before["cancelled"] + 2 and h["active"] == 0)
    assert h["cancelled"] == before["cancelled"] + 2 and h["completed"] == before["completed"]
    deadline = time.time() + 30
    while any(t.name == "dflash-events" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "dflash-events" for t in threading.enumerate())


def test_the_event_loop_is_free_while_a_request_waits_for_the_tokenizer(served):
    """Parsing runs on a worker thread: while the tokenizer's lock is held elsewhere, other requests are answered."""
    url, engine = served[1], ENGINES["served"]
    result = {}

    def ask():
        result["status"] = raw_post(url, "/v1/completions", {"model": MODEL, "prompt": "import os", "max_tokens": 2})[0]

    with engine.tokenizer_lock:
        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(0.3)
        tic = time.monotonic()
        assert health(url)["status"] == "ok" and time.monotonic() - tic < 5
        assert "status" not in result  # still waiting for the lock
    asking.join(60)
    assert result["status"] == 200


FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit", "days"], "additionalProperties": False}


def test_response_format_constrains_the_answer(client, served, targets, drafters):
    import jsonschema

    messages = [{"role": "user", "content": "The forecast as JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), FORECAST)
    assert r.choices[0].message.content == expected_chat(targets, drafters, "The forecast as JSON", 60,
                                                         "--json-schema", json.dumps(FORECAST))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    # Not strict: a keyword the engine cannot enforce is ignored rather than refused.
    loose = dict(FORECAST, properties=dict(FORECAST["properties"], tags={"type": "array", "uniqueItems": True}))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "f", "schema": loose}})
    assert r.choices[0].finish_reason == "stop" and set(json.loads(r.choices[0].message.content)) == {"unit", "days"}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


def test_constrained_and_free_requests_decoded_together_answer_as_alone(client, served):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    asks = [dict(response_format=fmt), {}, dict(response_format={"type": "json_object"}), dict(response_format=fmt)]
    texts = ["The forecast as JSON", "hello there", "A JSON object please", "Next week's forecast"]

    def answer(i):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": texts[i]}],
                                              max_tokens=50, temperature=0, **asks[i]).choices[0].message.content

    alone = [answer(i) for i in range(4)]
    together = [None] * 4
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, answer(i))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    assert set(json.loads(alone[0])) == {"unit", "days"}
