"""Schemas and grammars that cannot give a whole answer, through every door: the Python API, the
command line, OpenAI's chat API and Anthropic's Messages API. Each is refused before any token
with one line in the user's terms (the property's path, the tool's name, the bytes they sent), or,
where only decoding can tell, ends that request alone with a finish reason other than "stop"."""

import json
import re
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app
from dflash_mlx.constrain import Grammar
from dflash_mlx.constrain.grammar import MAX_GRAMMAR_BYTES
from dflash_mlx.constrain.schema import MAX_DEPTH
from dflash_mlx.errors import DFlashError

runner = CliRunner()
SELF = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


def nested(levels: int) -> str:
    return '{"type":"object","required":["a"],"properties":{"a":' * levels + "{}" + "}}" * levels


# The schema, and words its one-line refusal must hold.
BAD = {
    "required self-reference": (SELF, ["required property 'x'", "'#'", "never end"]),
    "$ref loop": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ["'#/$defs/a'", "never end"]),
    "mutual required refs": ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                                              "required": ["b"]},
                                        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                                              "required": ["a"]}},
                              "$ref": "#/$defs/a"}, ["'#/$defs/b'", "never end"]),
    "array that must hold itself": ({"$defs": {"n": {"type": "object", "properties": {"kids": {
        "type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}}, "required": ["kids"]}},
        "$ref": "#/$defs/n"}, ["property 'kids'", "items", "never end"]),
    "minimum above maximum": ({"type": "object", "properties": {"room": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 3}}}}}, ["minimum 5 above maximum 3", "property 'room.n'"]),
    "minLength above maxLength": ({"type": "string", "minLength": 9, "maxLength": 2}, ["minLength 9", "maxLength 2"]),
    "empty enum": ({"type": "object", "properties": {"c": {"enum": []}}}, ["empty enum", "property 'c'"]),
    "empty anyOf": ({"anyOf": []}, ["empty anyOf"]),
    "unknown type": ({"type": "objekt"}, ["unknown type 'objekt'"]),
    "false": (False, ["`false`"]),
    "a list": ([1, 2], ["must be a JSON object", "list"]),
    "a $ref to nothing": ({"$ref": "#/$defs/missing"}, ["'#/$defs/missing'", "points at nothing"]),
    "nested too deep": (json.loads(nested(400)), [f"more than {MAX_DEPTH} levels deep"]),
    # Keywords and formats the engine refuses: its reason, named as the user's schema.
    **{f"{key} (strict)": (schema, [f"uses {key}", "cannot enforce", "strict"]) for key, schema in {
        "uniqueItems": {"type": "array", "uniqueItems": True},
        "contains": {"type": "array", "contains": {"type": "integer"}},
        "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
        "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
        "if": {"if": {"type": "string"}, "then": {"minLength": 2}},
        "not": {"not": {"type": "string"}},
        "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
        "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
        "$dynamicRef": {"$dynamicRef": "#x"},
    }.items()},
    "unknown format": ({"type": "string", "format": "emial"}, ["emial"]),
    "a pattern that does not parse": ({"type": "string", "pattern": "(abc"}, ["pattern '(abc'", "unclosed group"]),
    "a huge enum": ({"enum": ["v%06d" % i for i in range(40000)]}, [f"{MAX_GRAMMAR_BYTES:,}", "bytes"]),
}


@pytest.fixture(scope="module")
def demo():
    return dflash_mlx.load("demo")


def refusal(schema, compile_with=None) -> str:
    with pytest.raises(DFlashError) as e:
        g = Grammar.json_schema(schema)
        if compile_with is not None:
            compile_with.grammars.compile(g)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


@pytest.mark.parametrize("name", list(BAD))
def test_each_bad_schema_is_one_line_naming_its_fault(demo, name):
    schema, words = BAD[name]
    message = refusal(schema, demo)
    for w in words:
        assert w in message, (w, message)
    assert not re.search(r"at \d+\(\d+\)|%json|start:|<non-verbose/>", message), message  # no engine internals


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional recursion: {} ends it
    {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["x"]},
    {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                     "required": ["kids"]}}, "$ref": "#/$defs/n"},  # a tree: an empty list of kids ends it
    json.loads(nested(MAX_DEPTH // 2 - 1)),
    True,
    {"$defs": {"x": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"},  # an anchor: the engine's to resolve
])
def test_schemas_that_can_end_are_taken(demo, schema):
    demo.grammars.compile(Grammar.json_schema(schema))


def test_nesting_past_pythons_own_limit_is_one_line():
    message = refusal(nested(1000))
    assert f"nests objects and arrays more than {MAX_DEPTH} levels deep" in message


@pytest.mark.parametrize("grammar, words", [
    (Grammar.regex("(abc"), ["The regex '(abc' does not parse: unclosed group."]),
    (Grammar.regex("x{2,1}"), ["does not parse", "repetition"]),
    (Grammar.lark('start: x\nx: x "a"'), ["allows no text at all"]),
    (Grammar.lark('start: call\ncall: "x" foo'), ["line 2 column 7", 'unknown name: "foo"']),
])
def test_regexes_and_grammars_are_refused_in_their_own_terms(demo, grammar, words):
    with pytest.raises(DFlashError) as e:
        demo.grammars.compile(grammar)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("pattern", ["(a+)+$", "(a|a)*b", "(x+x+)+y", "(.*){1000}", "(a{100}){100}", "[^a]{5000}"])
def test_pathological_regexes_compile_within_the_engines_limits_and_keep_to_themselves(demo, pattern):
    """Patterns that make backtracking engines explode: the engine's automaton takes them, and
    every token of an answer keeps to the pattern."""
    grammar = Grammar.regex(pattern)
    events = list(dflash_mlx.stream_generate(demo, "x", max_tokens=12, grammar=grammar, block_size=4))
    walked = demo.grammars.constraint(grammar)
    walked.commit([t for e in events for t in e.tokens])
    assert walked.error is None and events[-1].finish_reason in ("stop", "length")


# -- what only decoding can tell -----------------------------------------------------------------


def unchecked(schema) -> Grammar:
    """A schema straight to the engine, past the checks (as a grammar they cannot read would be)."""
    return Grammar("json_schema", json.dumps(schema, separators=(",", ":")))


@pytest.mark.parametrize("block_size", [1, 8])
def test_an_engine_that_gives_up_ends_the_request_with_finish_reason_error(demo, block_size):
    events = list(dflash_mlx.stream_generate(demo, "hello", max_tokens=2000, grammar=unchecked(SELF),
                                             block_size=block_size))
    last = events[-1]
    assert last.finish_reason == "error" and "grammar engine gave up" in last.stats.error
    assert last.stats.generation_tokens < 2000


def test_only_the_failing_request_of_a_batch_ends(demo):
    from dflash_mlx.decode.running import Asks
    from dflash_mlx.decode.streams import Joining, Streams

    free = "def fibonacci(n):"
    alone = "".join(e.text for e in dflash_mlx.stream_generate(demo, free, max_tokens=24, block_size=4))
    streams = Streams(demo, 4, block_size=4)
    ids = [demo.tokenizer.encode(t) for t in ("hello", free)]
    firsts = streams.add_many([Joining(ids[0], 400, [], Asks(grammar=unchecked(SELF))),
                               Joining(ids[1], 24, [], Asks())])
    texts, finish = {uid: e.text for uid, e in firsts}, {uid: e.finish_reason for uid, e in firsts}
    (bad, _), (good, _) = firsts
    while any(f is None for f in finish.values()):
        for uid, e in streams.step():
            texts[uid] += e.text
            finish[uid] = e.finish_reason
    assert finish == {bad: "error", good: "length"}
    assert texts[good] == alone


def test_the_cli_says_when_the_engine_gave_up(demo, monkeypatch):
    from dflash_mlx.cli import grammar_options

    monkeypatch.setattr(grammar_options, "grammar_option", lambda *a: unchecked(SELF))
    r = runner.invoke(app, ["generate", "-p", "hello", "--json-schema", "{}", "-m", "500"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and lines[-1].startswith("error: the answer stopped after"), r.output
    assert "grammar engine gave up" in lines[-1] and "Traceback" not in r.output


# -- the command line ----------------------------------------------------------------------------


def one_error_line(r, *words):
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert lines and lines[-1].startswith("error:") and sum(line.startswith("error:") for line in lines) == 1, r.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])
    return lines[-1]


@pytest.mark.parametrize("name", ["required self-reference", "$ref loop", "minimum above maximum", "unknown type",
                                  "nested too deep", "false", "a list", "uniqueItems (strict)", "a huge enum",
                                  "a pattern that does not parse"])
@pytest.mark.parametrize("how", ["inline", "file"])
def test_the_cli_refuses_bad_schemas_in_one_line(tmp_path, name, how):
    schema, words = BAD[name]
    text = json.dumps(schema)
    if how == "file":
        (tmp_path / "s.json").write_text(text)
        text = str(tmp_path / "s.json")
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", text]), *words)


def test_the_cli_reads_json_that_is_not_an_object_as_json_not_as_a_file_name():
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", "false"]), "`false`")
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", "[1,2]"]), "JSON object")
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", json.dumps(list(range(5000)))]),
                   "JSON object")  # longer than any file name


def test_the_cli_names_a_missing_file_and_a_folder_for_what_they_are(tmp_path):
    line = one_error_line(runner.invoke(app, ["generate", "-p", "x", "--grammar", str(tmp_path / "g.lark")]),
                          "no such file")
    assert "--json-schema" not in line
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--grammar", str(tmp_path)]), "is a folder")
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", str(tmp_path / "s.json")]),
                   "no such file")


def test_a_huge_schema_file_is_refused_in_its_own_bytes(tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"type": "object", "properties": {f"p{i}": {"description": "x" * 200}
                                                                 for i in range(1500)}}, indent=2))
    size = path.stat().st_size
    one_error_line(runner.invoke(app, ["generate", "-p", "x", "--json-schema", str(path)]), f"{size:,} bytes")


@pytest.mark.parametrize("flag, value, what", [
    ("--json-schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                  "required": ["name"]}), "JSON schema"),
    ("--regex", "[a-z]{40,60}", "regex"),
])
def test_an_answer_cut_by_max_tokens_is_never_silent(flag, value, what):
    r = runner.invoke(app, ["generate", "-p", "x", flag, value, "-m", "5"])
    one_error_line(r, "--max-tokens (5)", what, "raise --max-tokens")
    assert r.stdout.strip(), r.output  # what was generated is still printed


# -- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(demo):
    from dflash_mlx.serve.http_server import make_server
    import threading

    srv = make_server(demo, "demo", "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.engine.close()


def post(url, path, body, stream=False):
    """(status, the body's JSON or its raw bytes for a stream)."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, raw if stream else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(schema, stream=False):
    return {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}}


def message(schema, stream=False):
    return {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "stream": stream,
            "output_format": {"type": "json_schema", "schema": schema}}


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M))


@pytest.mark.parametrize("name", [n for n in BAD if isinstance(BAD[n][0], dict)])
@pytest.mark.parametrize("stream", [False, True])
def test_both_apis_refuse_bad_schemas_with_a_400_before_any_byte(server, name, stream):
    srv, url = server
    schema, words = BAD[name]
    refused = metric(url, 'dflash_requests_total{outcome="refused"}')
    status, body = post(url, "/v1/chat/completions", chat(schema, stream))
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert all(w in body["error"]["message"] for w in words), body
    status, body = post(url, "/v1/messages", message(schema, stream))
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert all(w in body["error"]["message"] for w in words), body
    assert metric(url, 'dflash_requests_total{outcome="refused"}') == refused + 2
    assert metric(url, 'dflash_refusals_total{status="400"}') >= 2


def test_a_body_nested_past_pythons_limit_is_a_400(server):
    srv, url = server
    req = urllib.request.Request(url + "/v1/chat/completions", b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "nests" in json.loads(e.value.read())["error"]["message"]


def test_a_request_the_engine_gives_up_on_fails_alone_and_the_gauges_come_back(server, monkeypatch):
    """Past the checks (a grammar only decoding can find fault with): not streamed, an error object;
    streamed, the text so far, a last chunk whose finish reason says "error", the error, [DONE]."""
    from dflash_mlx.serve import requests as serve_requests

    srv, url = server
    monkeypatch.setattr(serve_requests, "_response_format", lambda value: unchecked(SELF) if value else None)
    failed = metric(url, 'dflash_requests_total{outcome="failed"}')
    status, body = post(url, "/v1/chat/completions", dict(chat({}), max_tokens=400))
    assert status == 400 and body["error"]["code"] == "grammar_failed", body
    assert "grammar engine gave up" in body["error"]["message"]
    status, raw = post(url, "/v1/chat/completions", dict(chat({}, stream=True), max_tokens=400), stream=True)
    data = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]
    assert status == 200 and raw.decode().rstrip().endswith("data: [DONE]")
    assert data[-2]["choices"][0]["finish_reason"] == "error" and data[-1]["error"]["code"] == "grammar_failed"
    status, raw = post(url, "/v1/messages", dict(message({}, stream=True), max_tokens=400), stream=True)
    events = re.findall(r"^event: (\S+)$", raw.decode(), re.M)
    assert events[0] == "message_start" and events[-1] == "error" and "message_stop" not in events
    assert metric(url, 'dflash_requests_total{outcome="failed"}') == failed + 3
    # the server goes on: a free request answers, and nothing is left active
    status, body = post(url, "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
    assert health["active"] == 0 and health["queued"] == 0
    assert metric(url, "dflash_active_requests") == 0


def test_a_failing_batch_leaves_no_active_request_behind(server, monkeypatch):
    srv, url = server
    engine = srv.engine

    def broken(self):
        raise RuntimeError("a bug in a cycle")

    from dflash_mlx.decode.streams import Streams

    monkeypatch.setattr(Streams, "step", broken)
    status, body = post(url, "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 8})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert engine.stats["active"] == 0 and metric(url, "dflash_active_requests") == 0
