"""The Anthropic Messages API over real HTTP with the official anthropic client."""

import json
import threading

import pytest
from test_tools import CALL, TOOLS, tool_pair  # noqa: F401 (a fixture)

from dflash_mlx.serve.http_server import make_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


def serve(pair, name, **kw):
    server = make_server(pair, name, "127.0.0.1", 0, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def text_server(pairs):
    server, url = serve(pairs["qwen3"], "tiny-qwen3", api_key="secret")
    yield url
    server.shutdown()
    server.engine.close()


@pytest.fixture(scope="module")
def tool_server(tool_pair):  # noqa: F811
    server, url = serve(tool_pair, "tiny-tools")
    yield url
    server.shutdown()
    server.engine.close()


def test_a_message_equals_the_chat_completion(text_server):
    claude = anthropic.Anthropic(base_url=text_server, api_key="secret", max_retries=0)
    gpt = openai.OpenAI(base_url=text_server + "/v1", api_key="secret", max_retries=0)
    msg = claude.messages.create(model="tiny-qwen3", max_tokens=12, system="Be brief.", temperature=0,
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}])
    chat = gpt.chat.completions.create(model="tiny-qwen3", max_tokens=12, temperature=0,
                                       messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "def add(a, b):"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 12
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens

    stop = chat.choices[0].message.content[3:6]
    cut = claude.messages.create(model="tiny-qwen3", max_tokens=12, temperature=0, stop_sequences=[stop],
                                 system="Be brief.", messages=[{"role": "user", "content": "def add(a, b):"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == chat.choices[0].message.content[:3]


def test_streamed_events(text_server):
    claude = anthropic.Anthropic(base_url=text_server, api_key="secret", max_retries=0)
    whole = claude.messages.create(model="tiny-qwen3", max_tokens=16, temperature=0,
                                   messages=[{"role": "user", "content": "import math"}])
    with claude.messages.stream(model="tiny-qwen3", max_tokens=16, temperature=0,
                                messages=[{"role": "user", "content": "import math"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16


def test_errors_in_anthropic_shape(text_server):
    claude = anthropic.Anthropic(base_url=text_server, api_key="secret", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-qwen3", max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "Content blocks of type 'image' are not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=text_server, api_key="wrong", max_retries=0).messages.create(
            model="tiny-qwen3", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_tool_use_blocks_and_a_tool_result_turn(tool_server):
    claude = anthropic.Anthropic(base_url=tool_server, api_key="x", max_retries=0)
    msg = claude.messages.create(model="tiny-tools", max_tokens=16, temperature=0, tools=ANTHROPIC_TOOLS,
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    (use,) = msg.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")

    with claude.messages.stream(model="tiny-tools", max_tokens=16, temperature=0, tools=ANTHROPIC_TOOLS,
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"

    again = claude.messages.create(model="tiny-tools", max_tokens=16, temperature=0, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ])
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > msg.usage.input_tokens + 8
    plain = claude.messages.create(model="tiny-tools", max_tokens=16, temperature=0,
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert plain.content[0].text == f"<tool_call>{CALL}</tool_call>" and plain.stop_reason == "end_turn"
    assert json.dumps(use.input) in CALL


def test_tool_choice_any_and_tool_force_a_call(tool_server):
    clock = {"name": "get_time", "description": "The time now",
             "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    claude = anthropic.Anthropic(base_url=tool_server, api_key="x", max_retries=0)
    msg = claude.messages.create(model="tiny-tools", max_tokens=80, temperature=0, tools=ANTHROPIC_TOOLS + [clock],
                                 tool_choice={"type": "tool", "name": "get_time"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", "get_time", {})]
    assert msg.stop_reason == "tool_use"
    msg = claude.messages.create(model="tiny-tools", max_tokens=80, temperature=0, tools=ANTHROPIC_TOOLS + [clock],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    bad = dict(clock, input_schema={"type": "object", "properties": {"a": {"type": "strin"}}}, strict=True)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-tools", max_tokens=8, tools=[bad], tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and "parameters cannot be enforced" in e.value.body["error"]["message"]


def test_output_format_constrains_the_text(text_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    claude = anthropic.Anthropic(base_url=text_server, api_key="secret", max_retries=0)
    msg = claude.messages.create(model="tiny-qwen3", max_tokens=40, temperature=0,
                                 messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    assert set(json.loads(msg.content[0].text)) == {"answer"}
