"""Tool calls over real HTTP with the official openai client.

The target is a tiny qwen3 built from mlx-lm's class whose weights make it a
bigram chain (attention and MLP outputs zeroed, the head mapping each token to
its successor), so after the chat template's assistant turn it writes one
tool call in the json_tools format; its tokenizer's chat template renders tools
as Qwen-style templates do, and mlx-lm infers the tool parser from it.
"""

import json
import threading

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx.serve.http_server import make_server

openai = pytest.importorskip("openai")
MODEL = "tiny-tools"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls %}{% set tool_call = c.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


def build_tool_pair(root, template: str, call: str, markers=("<tool_call>", "</tool_call>"), extra=(), window=4096,
                    before=(), after=(), layers=6):
    """A bigram-chain target (see the module's docstring) of `layers` layers whose assistant turn is
    the tool call `call` (one added token) between the `markers`, with the tokens `before` and
    `after` it (each added, each once), under chat template `template`; it reads `window` tokens."""
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    tiny.train_tokenizer(root / "tok")
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    tok.add_tokens([*markers, *extra, *before, *after, call, "<|tool|>"])
    target = root / "target"
    target.mkdir()
    tok.save(str(target / "tokenizer.json"))
    cfg = json.loads((root / "tok" / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    V = tok.get_vocab_size()
    ids = tok.get_vocab()
    chain = [ids[t] for t in ["<|assistant|>", *before, markers[0], call, markers[1], *after, "<|end|>"]]

    config = dict(tiny.target_config("qwen3", V), tie_word_embeddings=False, max_position_embeddings=window,
                  num_hidden_layers=layers)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(3)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    params = {k: mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v
              for k, v in params.items()}
    emb = mx.random.normal((V, config["hidden_size"]))
    normed = emb * mx.rsqrt((emb * emb).mean(-1, keepdims=True) + 1e-6)
    head = mx.zeros((V, config["hidden_size"]))
    for a, b in zip(chain, chain[1:]):
        head[b] = normed[a] * (20.0 / config["hidden_size"])
    params.update({"model.embed_tokens.weight": emb, "lm_head.weight": head})
    mx.save_safetensors(str(target / "model.safetensors"), params)
    (target / "config.json").write_text(json.dumps(config))
    drafter = tiny.build_drafter(root / "drafter",
                                 tiny.drafter_config("old", V, layers, mask_token_id=ids["<|mask|>"],
                                                     layer_ids=(1, 3) if layers > 3 else (0, layers - 1)))
    return dflash_mlx.load(str(target), str(drafter))


@pytest.fixture(scope="module")
def tool_pair(tmp_path_factory):
    return build_tool_pair(tmp_path_factory.mktemp("tools"), TEMPLATE, CALL)


def serving(pair):
    """An openai client of a server on `pair`, for a module fixture to yield from."""
    server = make_server(pair, MODEL, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0,
                        timeout=120)
    server.shutdown()
    server.engine.close()


@pytest.fixture(scope="module")
def client(tool_pair):
    yield from serving(tool_pair)


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          max_tokens=16, temperature=0, **kw)


def test_the_model_writes_a_call_and_the_server_returns_it_as_tool_calls(client):
    r = ask(client, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # Without tools nothing is parsed: the text is the model's.
    plain = ask(client)
    assert plain.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    # tool_choice "none" does not show the tools, nor parse calls.
    assert ask(client, tools=TOOLS, tool_choice="none").choices[0].message.tool_calls is None


def test_streamed_tool_call_deltas(client):
    chunks = list(ask(client, tools=TOOLS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == ""  # the call's text is not streamed as content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_a_tool_result(client, tool_pair):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    rendered = tool_pair.tokenizer.apply_chat_template(
        [messages[0], dict(messages[1], content="", tool_calls=[{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]), messages[2]],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert f"<tool_call>{CALL}</tool_call>" in rendered and "<|tool|>sunny, 21 C<|end|>" in rendered
    assert r.usage.prompt_tokens == len(tool_pair.tokenizer.encode(rendered, add_special_tokens=False))
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": "any"}, "'tool_choice' must be"),
    ({"tools": [{"type": "function"}]}, "'tools' must be a list of"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "Tool call arguments of 'f' are not valid JSON"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "Only text content parts"),
])
def test_bad_tool_requests_are_clear_400s(client, extra, words):
    body = dict({"tools": TOOLS}, **{k: v for k, v in extra.items() if k != "messages"})
    messages = extra.get("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **body)
    assert words in e.value.message


def test_a_model_without_tool_calling_refuses_tools(served_plain):
    with pytest.raises(openai.BadRequestError, match="has no tool calling"):
        served_plain.chat.completions.create(model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}],
                                             tools=TOOLS, max_tokens=4)


@pytest.fixture(scope="module")
def served_plain(pairs):
    server = make_server(pairs["qwen3"], "tiny-qwen3", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)
    server.shutdown()
    server.engine.close()


def test_the_splitter_holds_back_split_markers_and_keeps_bad_calls_as_text():
    from mlx_lm.tool_parsers import json_tools

    from dflash_mlx.serve.tools import ToolCallSplitter

    text = (f"Let me check.<tool_call>{CALL}</tool_call> and <tool_call>"
            '{"name": "get_time", "arguments": {}}</tool_call><tool_call>not json</tool_call> done <tool_')
    for size in (1, 3, 7, len(text)):
        split = ToolCallSplitter(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                                 TOOLS)
        content, calls = "", []
        pieces = [text[i: i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            c, k = split.feed(piece, final=i == len(pieces) - 1)
            assert "<tool_call>{" not in c
            content += c
            calls += k
        assert content == "Let me check. and <tool_call>not json done <tool_"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})]


CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now", "strict": True,
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}


def ask_long(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          max_tokens=80, temperature=0, **kw)


def test_a_forced_tool_call_is_made_in_the_models_format(client):
    """The model writes a get_weather call by itself; forced to call get_time, whose call is all
    forced tokens, it makes that call instead; "required" lets it make its own."""
    r = ask_long(client, tools=TOOLS + [CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    assert r.choices[0].finish_reason == "tool_calls"
    r = ask_long(client, tools=TOOLS + [CLOCK], tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    stream = ask_long(client, tools=TOOLS + [CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                      stream=True)
    calls = [c for chunk in stream for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert [c.function.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tool_choice": "always"}, "'tool_choice' must be"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "both constrain"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "The schema of tool 'f' has an unknown type 'strin' for property 'a'"),
])
def test_bad_forced_tool_calls_are_400s(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, **{"tools": TOOLS, **extra})
    assert words in e.value.body["message"]


def tool(name, parameters, strict=False):
    return {"type": "function", "function": {"name": name, "strict": strict, "parameters": parameters}}


BIG = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(1400)}}


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("tools, words", [
    ([tool("loop", {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]})],
     ["The schema of tool 'loop'", "required property 'x'", "never end"]),
    ([tool("rooms", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}}})],
     ["The schema of tool 'rooms'", "minimum 5 above maximum 3 for property 'n'"]),
    ([tool("odd", {"type": "object", "properties": {"a": {"type": "objekt"}}})],
     ["The schema of tool 'odd'", "unknown type 'objekt'"]),
    ([tool("mail", {"type": "object", "properties": {"to": {"type": "string", "format": "emial"}}}, strict=True)],
     ["The schema of tool 'mail' cannot be used: Unknown format: emial"]),
    ([tool("huge", BIG)], [f"The schema of tool 'huge' is {len(json.dumps(BIG, separators=(',', ':'))):,} bytes"]),
    ([tool("a", BIG["properties"] and {"type": "object", "properties": dict(list(BIG["properties"].items())[:700])}),
      tool("b", {"type": "object", "properties": dict(list(BIG["properties"].items())[700:])})],
     ["The tools' schemas come to", "bytes of grammar together", "fewer or smaller tools"]),
])
def test_a_tool_schema_that_cannot_be_kept_to_is_a_400_naming_the_tool(client, choice, tools, words):
    if choice == "auto":  # strict tools under "auto" are kept to as well
        tools = [dict(t, function=dict(t["function"], strict=True)) for t in tools]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, tools=tools, tool_choice=choice)
    message = e.value.body["message"]
    assert all(w in message for w in words), message
    assert "%json" not in message and "start:" not in message and "'arguments'" not in message, message


def test_strict_tools_keep_calls_the_model_makes_of_its_own_accord(client):
    """Under tool_choice "auto", a strict tool's calls keep to its schema: the model's own call
    (city Paris) is not in it, so the call it makes is the one the schema allows."""
    rome = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Rome"]}}, "required": ["city"],
                       "additionalProperties": False}}}
    r = ask_long(client, tools=[rome])
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    loose = dict(rome, function=dict(rome["function"], strict=False))
    r = ask_long(client, tools=[loose])  # not strict: the model's own call stands
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


# -- a model whose calls are XML parameters (qwen3_coder's format: Qwen3-Coder, Qwen3.5) ------------

CALL_XML = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
TEMPLATE_XML = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROME = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def xml_pair(tmp_path_factory):
    return build_tool_pair(tmp_path_factory.mktemp("xml-tools"), TEMPLATE_XML, CALL_XML)


@pytest.fixture(scope="module")
def xml_client(xml_pair):
    yield from serving(xml_pair)


@pytest.mark.parametrize("fmt, parser", [("xml", "qwen3_coder"), ("gemma", "gemma4")])
def test_forced_and_strict_calls_in_the_models_own_format(request, fmt, parser):
    """mlx-lm reads this model's calls with its qwen3_coder (XML parameters) or gemma4 parser; a
    forced call and a strict tool's call are written in that format, and come back as OpenAI
    tool calls."""
    client, pair = request.getfixturevalue(f"{fmt}_client"), request.getfixturevalue(f"{fmt}_pair")
    assert pair.tokenizer.tool_parser.__module__.endswith(parser)
    (call,) = ask_long(client, tools=TOOLS).choices[0].message.tool_calls  # the model's own call
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    r = ask_long(client, tools=TOOLS + [CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    for choice in ("auto", "required"):
        (call,) = ask_long(client, tools=[ROME], tool_choice=choice).choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}


@pytest.mark.parametrize("param, words", [
    ({"type": "string", "pattern": "^[A-Z]"}, "cannot enforce on a string"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "needs one \\\"type\\\""),
    ({"type": ["string", "null"]}, "needs one \\\"type\\\""),
])
def test_xml_parameters_the_format_cannot_enforce_are_400s_when_strict(xml_client, param, words):
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": param}, "required": ["a"], "additionalProperties": False}}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(xml_client, tools=[tool], tool_choice="required")
    assert words.replace("\\", "") in e.value.body["message"]
    loose = {"type": "function", "function": dict(tool["function"], strict=False)}
    assert ask(xml_client, tools=[loose], tool_choice="required").choices[0].finish_reason in ("tool_calls", "length")


def grammar_takes(pair, grammar, text: str) -> bool:
    """Whether `text` (as the pair's tokenizer writes it) is a whole output of `grammar`."""
    c = pair.grammars.constraint(grammar)
    ids = pair.tokenizer.encode(text, add_special_tokens=False)
    if c.allows(ids) < len(ids):
        return False
    c.commit(ids)
    return c.accepting


def test_the_xml_call_grammar_takes_exactly_the_calls_the_parser_reads_as_valid(xml_pair):
    """Each parameter's value in the XML format: raw text for a string (its bounds kept, never
    `</parameter>` nor `null`), an enum's values, either case of a boolean, JSON for the rest;
    a required parameter cannot be left out and an optional one can; what the grammar takes, the
    model's parser reads as the arguments."""
    from dflash_mlx.serve.tool_grammars import call_format, call_grammar, json_body, xml_body
    from dflash_mlx.serve.tools import ToolError

    tok = xml_pair.tokenizer
    params = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}, "hourly": {"type": "boolean"},
        "tags": {"$ref": "#/$defs/tags"}}, "required": ["city", "days"],
        "$defs": {"tags": {"type": "array", "items": {"type": "string"}}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    grammar = call_grammar(tok, xml_pair.grammars.tokenizer.is_special_token, tools, True, False)

    def takes(text):
        return grammar_takes(xml_pair, grammar, text)

    def call(**values):
        return "<tool_call>\n<function=get_weather>\n" + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items()) + "</function>\n</tool_call>"

    good = call(city="Paris, <France>\n", unit="c", days=3, hourly="True", tags='["a", "b"]')
    assert takes(good)
    assert tok.tool_parser(good[len("<tool_call>"):-len("</tool_call>")], tools) == {"name": "get_weather", "arguments": {
        "city": "Paris, <France>\n", "unit": "c", "days": 3, "hourly": True, "tags": ["a", "b"]}}
    assert takes(call(city="", days=9))  # optional parameters left out
    for bad in (call(city="Paris</parameter>", days=3), call(city="null", days=3), call(city="x" * 21, days=3),
                call(city="Paris", days=10), call(city="Paris", unit="k", days=3), call(days=3),
                call(city="Paris", days=3, hourly="yes"), call(city="Paris", days=3, tags="[1]"),
                call(days=3, city="Paris")):
        assert not takes(bad), bad
    assert call_format(tok.tool_parser) is xml_body
    from mlx_lm.tool_parsers import json_tools, pythonic
    assert call_format(json_tools.parse_tool_call) is json_body and call_format(pythonic.parse_tool_call) is None

    class Pythonic:  # a model whose calls are Python calls: no grammar for them, a clear refusal
        tool_parser, tool_call_start, tool_call_end = pythonic.parse_tool_call, "<|tool_call_start|>", "<|tool_call_end|>"

    with pytest.raises(ToolError, match="none of them. Use tool_choice \"auto\""):
        call_grammar(Pythonic(), xml_pair.grammars.tokenizer.is_special_token, tools, True, False)


def test_each_function_is_kept_as_strictly_as_it_asks(client):
    """Beside a non-strict tool, a strict one's keyword the engine cannot enforce is still refused;
    the non-strict one's is left unchecked."""
    params = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    strict = {"type": "function", "function": {"name": "tag", "strict": True, "parameters": params}}
    loose = {"type": "function", "function": {"name": "label", "parameters": params}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, tools=[strict, loose], tool_choice="required")
    assert "The schema of tool 'tag' uses uniqueItems, which the grammar engine cannot enforce" in e.value.body["message"]
    r = ask_long(client, tools=[loose, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("tool_calls", "length")


# -- a model whose calls are Gemma 4's call:NAME{key:value} ---------------------------------------

QUOTE = '<|"|>'
CALL_GEMMA = f"call:get_weather{{city:{QUOTE}Paris{QUOTE}}}"
TEMPLATE_GEMMA = TEMPLATE.replace("<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
                                  "{{ tool_call.arguments | tojson }}}</tool_call>",
                                  "<|tool_call>call:{{ tool_call.name }}{{ tool_call.arguments | tojson }}<tool_call|>")


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    assert "<|tool_call>" in TEMPLATE_GEMMA
    return build_tool_pair(tmp_path_factory.mktemp("gemma-tools"), TEMPLATE_GEMMA, CALL_GEMMA,
                           ("<|tool_call>", "<tool_call|>"), [QUOTE])


@pytest.fixture(scope="module")
def gemma_client(gemma_pair):
    yield from serving(gemma_pair)


def test_the_gemma_call_grammar_takes_exactly_the_calls_the_parser_reads_as_valid(gemma_pair):
    """Gemma 4's notation: bare keys in the schema's order (required ones always), strings between
    the quote marker (bounds kept, never the marker itself), enums, `$ref`s and `anyOf`, numbers,
    booleans and null as JSON kept to their schemas, no spaces; what the grammar takes, the
    model's parser reads as the arguments."""
    from dflash_mlx.serve.tool_grammars import call_format, call_grammar, gemma_body

    tok, q = gemma_pair.tokenizer, QUOTE
    params = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f", 3]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9}, "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "where": {"$ref": "#/$defs/point"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["city", "days"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x", "y"]}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    grammar = call_grammar(tok, gemma_pair.grammars.tokenizer.is_special_token, tools, True, False)

    def takes(args):
        return grammar_takes(gemma_pair, grammar, f"<|tool_call>call:get_weather{{{args}}}<tool_call|>")

    good = f"city:{q}Paris, {{France}}{q},unit:3,days:3,hourly:true,tags:[{q}a{q},{q}b{q}],where:{{x:1.5,y:-2}},note:null"
    assert takes(good)
    assert tok.tool_parser(f"call:get_weather{{{good}}}") == {"name": "get_weather", "arguments": {
        "city": "Paris, {France}", "unit": 3, "days": 3, "hourly": True, "tags": ["a", "b"],
        "where": {"x": 1.5, "y": -2}, "note": None}}
    assert takes(f"city:{q}{q},days:9") and takes(f"city:{q}P{q},unit:{q}c{q},days:1,note:{q}hi{q}")
    for bad in ("days:3", f"city:{q}P{q},days:10", f"days:3,city:{q}P{q}", f"city:{q}P{q},days:3,unit:{q}k{q}",
                f"city:{q}P{q},days:3,tags:[{q}a{q},{q}b{q},{q}c{q},{q}d{q}]", 'city:"P",days:3',
                f"city:{q}P{q}, days:3", f"city:{q}{'x' * 21}{q},days:3", f"city:{q}P{q},days:3,where:{{x:1}}"):
        assert not takes(bad), bad
    assert call_format(tok.tool_parser) is gemma_body


@pytest.mark.parametrize("param, words", [
    ({"type": "string", "pattern": "^[A-Z]"}, "cannot enforce"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "needs a \"type\""),
    ({"type": "object", "properties": {"file-path": {"type": "string"}}}, "cannot be written"),
])
def test_gemma_arguments_the_format_cannot_enforce_are_400s_when_strict(gemma_client, param, words):
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": param}, "required": ["a"], "additionalProperties": False}}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(gemma_client, tools=[tool], tool_choice="required")
    assert words in e.value.body["message"]


def test_a_recursive_schema_is_a_recursive_rule_in_gemmas_notation(gemma_pair):
    from dflash_mlx.serve.tool_grammars import call_grammar

    node = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["v"]}
    params = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
              "$defs": {"node": node}}
    tools = [{"type": "function", "function": {"name": "plant", "parameters": params}}]
    grammar = call_grammar(gemma_pair.tokenizer, gemma_pair.grammars.tokenizer.is_special_token, tools, True, False)
    deep = "{v:1,kids:[{v:2},{v:3,kids:[{v:4,kids:[{v:5,kids:[{v:6,kids:[{v:7,kids:[{v:8}]}]}]}]}]}]}"
    assert grammar_takes(gemma_pair, grammar, f"<|tool_call>call:plant{{root:{deep}}}<tool_call|>")
    assert gemma_pair.tokenizer.tool_parser(f"call:plant{{root:{deep}}}")["arguments"]["root"]["kids"][1]["v"] == 3
    assert not grammar_takes(gemma_pair, grammar, "<|tool_call>call:plant{root:{kids:[]}}<tool_call|>")
