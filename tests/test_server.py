"""`dflash-mlx serve` over real HTTP on loopback, with the official openai client."""

import http.client
import json
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app
from dflash_mlx.server import make_server

openai = pytest.importorskip("openai")
MODEL = "tiny-qwen3"


def start(pair, **kw):
    server = make_server(pair, MODEL, "127.0.0.1", 0, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def served(targets, drafters):
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    server, url = start(pair, max_prompt_tokens=200)
    yield pair, url
    server.shutdown()
    server.engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def expected_chat(targets, drafters, text, max_tokens):
    """What the `generate` command prints for the same prompt."""
    r = CliRunner().invoke(app, ["generate", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                 "--prompt", text, "-m", str(max_tokens)])
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
    conn = http.client.HTTPConnection(url[7:])
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
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 3}}, 400,
         "logit_bias"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "at most 200"),
    ],
)
def test_bad_requests_get_openai_style_errors(served, body, status, words):
    url = served[1]
    got, err = raw_post(url, "/v1/chat/completions", body)
    assert got == status
    assert words in err["error"]["message"] and err["error"]["type"]
    assert health(url)["status"] == "ok"


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
