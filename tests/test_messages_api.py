"""The Anthropic Messages API over real HTTP with the official anthropic client."""

import json

import pytest
from conftest import serving
from test_tools import CALL, TOOLS, tool_pair  # noqa: F401 (a fixture)


anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def text_server(pairs):
    with serving(pairs["qwen3"], "tiny-qwen3", api_key="secret") as (_, url):
        yield url


@pytest.fixture(scope="module")
def tool_server(tool_pair):  # noqa: F811
    with serving(tool_pair, "tiny-tools") as (_, url):
        yield url


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
                               messages=[{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "Content blocks of type 'container_upload' are not supported" in e.value.body["error"]["message"]
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
    assert e.value.body["type"] == "error"
    assert "The schema of tool 'get_time' has an unknown type 'strin'" in e.value.body["error"]["message"]


def test_a_forced_call_cut_by_max_tokens_says_max_tokens_and_leaks_no_markup(tool_server):
    claude = anthropic.Anthropic(base_url=tool_server, api_key="x", max_retries=0)
    gpt = openai.OpenAI(base_url=tool_server + "/v1", api_key="x", max_retries=0)
    clock = {"name": "get_time", "description": "The time now",
             "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
    for budget in (1, 2, 3, 5):
        ask = dict(model="tiny-tools", max_tokens=budget, temperature=0, tools=[clock],
                   tool_choice={"type": "tool", "name": "get_time"}, messages=[{"role": "user", "content": "Time?"}])
        msg = claude.messages.create(**ask)
        with claude.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
        for m in (msg, streamed):
            assert m.stop_reason == "max_tokens", (budget, m)
            assert all(b.type == "tool_use" or ("<" not in b.text and b.text.strip()) for b in m.content), m.content
        chat = gpt.chat.completions.create(model="tiny-tools", max_tokens=budget, temperature=0, messages=[
            {"role": "user", "content": "Time?"}], tools=[{"type": "function", "function": {
                "name": "get_time", "parameters": clock["input_schema"]}}],
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert chat.choices[0].finish_reason == "length" and "<" not in (chat.choices[0].message.content or "")


def test_claude_codes_message_shapes_are_taken(tool_server):
    """What Claude Code sends beyond the basics: system entries inside `messages`, thinking
    settings and blocks, effort, cache_control, context_management, metadata, a beta query and
    headers, images (a screenshot's tool result) and `is_error`."""
    import urllib.request

    body = {"model": "tiny-tools", "max_tokens": 8, "stream": False, "temperature": 0,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; nonce=ab12"},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u"}, "tools": ANTHROPIC_TOOLS,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Reminder: be brief."},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "They want weather.", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [
                        {"type": "text", "text": "no network"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}
    req = urllib.request.Request(tool_server + "/v1/messages?beta=true", json.dumps(body).encode(), {
        "Content-Type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": "x",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    assert r.status == 200 and answer["type"] == "message", answer


def test_messages_become_the_chat_messages_templates_read():
    from dflash_mlx.serve.messages_api import IMAGE_NOTE, to_chat

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    chat = to_chat({"max_tokens": 8, "system": "S", "messages": [
        {"role": "system", "content": "S2"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, image]},
        {"role": "system", "content": [{"type": "text", "text": "R1"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "system", "content": "R2"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}, image]}]},
        {"role": "assistant", "content": "done"},
        {"role": "system", "content": "R3"}]})["messages"]
    assert chat[0] == {"role": "system", "content": "S\n\nS2"}
    assert chat[1] == {"role": "user", "content": f"hi{IMAGE_NOTE}\n\nR1"}
    assert chat[2]["reasoning_content"] == "hmm" and chat[2]["tool_calls"][0]["function"]["name"] == "f"
    assert chat[3] == {"role": "tool", "tool_call_id": "t", "content": f"Error: boom{IMAGE_NOTE}"}
    assert chat[4] == {"role": "assistant", "content": "done"}
    assert chat[5] == {"role": "user", "content": "R2\n\nR3"} or chat[5]["content"].endswith("R3")
    assert [m["role"] for m in chat].count("system") == 1


def test_output_format_constrains_the_text(text_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    claude = anthropic.Anthropic(base_url=text_server, api_key="secret", max_retries=0)
    msg = claude.messages.create(model="tiny-qwen3", max_tokens=40, temperature=0,
                                 messages=[{"role": "user", "content": "hi"}],
                                 extra_body={"output_format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    assert set(json.loads(msg.content[0].text)) == {"answer"}
