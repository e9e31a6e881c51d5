"""A thinking model's reasoning split off its answer in every API: OpenAI chat (`reasoning` and
`reasoning_content`, whole and streamed), Anthropic `thinking` blocks (with a signature, taken
back unchecked), Responses `reasoning` items; tool calls read from the answer, never from the
reasoning."""

import threading

import pytest
from test_tools import CALL, TEMPLATE, TOOLS, build_tool_pair

from dflash_mlx.serve.http_server import make_server
from dflash_mlx.serve.reasoning import ReasoningSplitter

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
THOUGHT = "The user wants the weather, so I call the tool."
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def serve(pair):
    server = make_server(pair, "tiny-think", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """It thinks, then calls get_weather."""
    pair = build_tool_pair(tmp_path_factory.mktemp("think"), TEMPLATE, CALL, before=("<think>", THOUGHT, "</think>"))
    server, url = serve(pair)
    yield url
    server.shutdown()
    server.engine.close()


@pytest.fixture(scope="module")
def muser(tmp_path_factory):
    """It writes a call inside its thinking, then answers in words."""
    pair = build_tool_pair(tmp_path_factory.mktemp("muse"), TEMPLATE, CALL, before=("<think>",),
                           after=("</think>", "No call needed."))
    server, url = serve(pair)
    yield url
    server.shutdown()
    server.engine.close()


@pytest.mark.parametrize("inside", [False, True])
def test_the_splitter_holds_back_markers_split_anywhere(inside):
    text = ("" if inside else "<think>") + "a < b</think>\n\nAnswer <thin"
    for cut in range(len(text) + 1):
        split = ReasoningSplitter("<think>", "</think>", inside)
        parts = [split.feed(text[:cut]), split.feed(text[cut:], final=True)]
        assert "".join(p[0] for p in parts) == "a < b" and "".join(p[1] for p in parts) == "Answer <thin"


def test_chat_reasoning_is_its_own_field_and_the_call_is_read_from_the_answer(thinker):
    client = openai.OpenAI(base_url=thinker + "/v1", api_key="x", max_retries=0)
    ask = dict(model="tiny-think", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=16,
               temperature=0, tools=TOOLS)
    r = client.chat.completions.create(**ask)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == THOUGHT
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == THOUGHT
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert not any("<think>" in (d.content or "") or THOUGHT in (d.content or "") for d in deltas)
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]


def test_a_call_inside_the_reasoning_is_not_a_call(muser):
    client = openai.OpenAI(base_url=muser + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny-think", messages=[{"role": "user", "content": "Weather?"}],
                                       max_tokens=16, temperature=0, tools=TOOLS)
    message = r.choices[0].message
    assert message.tool_calls is None and message.content == "No call needed."
    assert message.model_extra["reasoning"] == f"<tool_call>{CALL}</tool_call>"
    assert r.choices[0].finish_reason == "stop"


def test_anthropic_thinking_blocks_with_a_signature_taken_back(thinker):
    claude = anthropic.Anthropic(base_url=thinker, api_key="x", max_retries=0)
    ask = dict(model="tiny-think", max_tokens=16, temperature=0, tools=ANTHROPIC_TOOLS,
               thinking={"type": "enabled", "budget_tokens": 1024},
               messages=[{"role": "user", "content": "Weather in Paris?"}])
    msg = claude.messages.create(**ask)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == THOUGHT and msg.content[0].signature
    with claude.messages.stream(**ask) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds and ("content_block_delta", "signature_delta") in kinds
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[0].thinking == THOUGHT
    again = claude.messages.create(**dict(ask, messages=ask["messages"] + [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[1].id, "content": "sunny"}]}]))
    assert again.type == "message"


def test_responses_reasoning_items(thinker):
    client = openai.OpenAI(base_url=thinker + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    r = client.responses.create(model="tiny-think", input="Weather in Paris?", tools=tools, max_output_tokens=16,
                                temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == THOUGHT and r.output[1].name == "get_weather"
    with client.responses.stream(model="tiny-think", input="Weather in Paris?", tools=tools, max_output_tokens=16,
                                 temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    again = client.responses.create(model="tiny-think", tools=tools, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"}, r.output[0].model_dump(exclude_none=True),
        {"type": "function_call", "call_id": r.output[1].call_id, "name": "get_weather",
         "arguments": r.output[1].arguments},
        {"type": "function_call_output", "call_id": r.output[1].call_id, "output": "sunny"}])
    assert again.status in ("completed", "incomplete")
