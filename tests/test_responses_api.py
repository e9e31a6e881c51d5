"""The OpenAI Responses API over real HTTP with the official openai client (`responses.create`,
`responses.stream`), and the requests Codex CLI and the OpenAI Agents SDK send, replayed."""

import json
from pathlib import Path

import pytest
from conftest import serving
from test_messages_api import text_server, tool_server  # noqa: F401 (fixtures)
from test_tools import CALL, TEMPLATE, TOOLS, build_tool_pair, tool_pair  # noqa: F401 (a fixture)


openai = pytest.importorskip("openai")
FIXTURES = Path(__file__).parent / "fixtures" / "clients"
FUNCTIONS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]


def clients(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0, timeout=120)


def test_a_response_equals_the_chat_completion(text_server):  # noqa: F811
    c = clients(text_server)
    r = c.responses.create(model="tiny-qwen3", instructions="Be brief.", input="def add(a, b):",
                           max_output_tokens=12, temperature=0)
    chat = c.chat.completions.create(model="tiny-qwen3", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-qwen3"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text == chat.choices[0].message.content
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12


def test_items_become_the_chat_history(text_server):  # noqa: F811
    c = clients(text_server)
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "return"}]},
             {"type": "message", "role": "user", "content": "more"}]
    r = c.responses.create(model="tiny-qwen3", input=items, max_output_tokens=6, temperature=0)
    chat = c.chat.completions.create(model="tiny-qwen3", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "return", "reasoning_content": "think"}, {"role": "user", "content": "more"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_the_stream_parses_and_equals_the_whole_answer(text_server):  # noqa: F811
    c = clients(text_server)
    whole = c.responses.create(model="tiny-qwen3", input="import math", max_output_tokens=10, temperature=0)
    with c.responses.stream(model="tiny-qwen3", input="import math", max_output_tokens=10, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_text.delta" in kinds
    assert "response.output_item.done" in kinds
    assert final.output_text == whole.output_text and final.usage.output_tokens == 10
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    events = list(c.responses.create(model="tiny-qwen3", input="import math", max_output_tokens=10, temperature=0,
                                     stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_and_a_tool_result_turn(tool_server):  # noqa: F811
    c = clients(tool_server)
    r = c.responses.create(model="tiny-tools", input="Weather in Paris?", tools=FUNCTIONS, max_output_tokens=16,
                           temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert call.call_id.startswith("call_") and r.status == "completed"
    with c.responses.stream(model="tiny-tools", input="Weather in Paris?", tools=FUNCTIONS, max_output_tokens=16,
                            temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", call.name, call.arguments)]
    again = c.responses.create(model="tiny-tools", tools=FUNCTIONS, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert again.usage.input_tokens > r.usage.input_tokens + 2
    # a forced call of another tool, and hosted tools the server leaves to the client
    clock = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}
    r = c.responses.create(model="tiny-tools", input="Weather in Paris?", max_output_tokens=40, temperature=0,
                           tools=FUNCTIONS + [clock, {"type": "web_search"}],
                           tool_choice={"type": "function", "name": "get_time"})
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [("function_call", "get_time", {})]


def test_text_format_keeps_the_answer_to_a_schema(text_server):  # noqa: F811
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = clients(text_server).responses.create(
        model="tiny-qwen3", input="A number as JSON", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"n"}


@pytest.mark.parametrize("body, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "'input' must be"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "'role'"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "'text.format'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "objekt"}}}},
     "unknown type 'objekt'"),
])
def test_bad_requests_are_400s_before_any_byte(text_server, body, words):  # noqa: F811
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            clients(text_server).responses.create(model="tiny-qwen3", stream=stream, **body)
        assert words in e.value.body["message"], e.value.body


def _replayed(path, url, model):
    """A captured request sent again as it was (its model renamed, its budget cut), and its answer."""
    import urllib.request

    x = json.loads(path.read_text())
    body = dict(x["body"], model=model, max_output_tokens=8)
    req = urllib.request.Request(url + x["path"], json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return body, r.read().decode()


@pytest.mark.parametrize("capture", sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*-v1-responses.json")
                                           if "codex" not in str(p)))
def test_the_agents_sdks_requests_are_answered_as_it_parses_them(tool_server, capture):  # noqa: F811
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body, raw = _replayed(FIXTURES / capture, tool_server, "tiny-tools")
    if body.get("stream"):
        events = [TypeAdapter(ResponseStreamEvent).validate_json(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: ")]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        final = events[-1].response
    else:
        final = Response.model_validate_json(raw)
    assert final.status in ("completed", "incomplete") and final.usage.input_tokens > 0


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """The tool-calling pair with a window that holds an agent's prompt (tools and system prompt:
    10-20k tokens of this tokenizer), in two layers: a prefill of that length stays quick."""
    pair = build_tool_pair(tmp_path_factory.mktemp("agent"), TEMPLATE, CALL, window=65536, layers=2)
    with serving(pair, "demo-chat") as (_, url):
        yield url


@pytest.mark.parametrize("capture", sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.json")
                                           if "codex" in str(p) or "claude" in str(p)))
def test_codex_and_claude_code_requests_are_answered_in_the_shape_they_parse(agent_server, capture):
    """Each captured request sent again as the client sent it: a 200 whose stream holds what the
    client needs to finish its turn (Codex: every item's output_item.done and response.completed
    with an id; Claude Code: message_start, the blocks, message_delta with a stop reason)."""
    import urllib.error
    import urllib.request

    x = json.loads((FIXTURES / capture).read_text())
    if x["method"] != "POST":
        return
    budget = "max_tokens" if "messages" in x["path"] else "max_output_tokens"
    body = dict(x["body"], **{budget: 8})
    req = urllib.request.Request(agent_server + x["path"] + (f"?{x['query']}" if x.get("query") else ""),
                                 json.dumps(body).encode(), {k: v for k, v in x["headers"].items() if k.lower() in (
                                     "content-type", "anthropic-version", "anthropic-beta")})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.status == 200
        raw = r.read().decode()
    kinds = [json.loads(line[6:])["type"] for line in raw.splitlines() if line.startswith("data: ")]
    if "codex" in capture:
        from openai.types.responses import ResponseStreamEvent
        from pydantic import TypeAdapter

        events = [TypeAdapter(ResponseStreamEvent).validate_json(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: ")]
        assert kinds[-1] == "response.completed" and events[-1].response.id.startswith("resp_")
        added = [e.item.id for e in events if e.type == "response.output_item.added"]
        assert added and added == [e.item.id for e in events if e.type == "response.output_item.done"]
    else:
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        start = json.loads(next(line for line in raw.splitlines() if '"message_start"' in line)[6:])
        assert start["message"]["usage"]["input_tokens"] + start["message"]["usage"]["cache_read_input_tokens"] > 1000
