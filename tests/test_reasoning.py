"""A thinking model's reasoning split off its answer in every API: OpenAI chat (`reasoning` and
`reasoning_content`, whole and streamed), Anthropic `thinking` blocks (with a signature, taken
back unchecked), Responses `reasoning` items; tool calls read from the answer, never from the
reasoning."""

import json

import pytest
from conftest import serving
from test_tools import CALL, TEMPLATE, TOOLS, build_tool_pair

from dflash_mlx.serve.reasoning import ReasoningSplitter

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
THOUGHT = "The user wants the weather, so I call the tool."
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """It thinks, then calls get_weather."""
    pair = build_tool_pair(tmp_path_factory.mktemp("think"), TEMPLATE, CALL, before=("<think>", THOUGHT, "</think>"))
    with serving(pair, "tiny-think") as (_, url):
        yield url


@pytest.fixture(scope="module")
def muser(tmp_path_factory):
    """It writes a call inside its thinking, then answers in words."""
    pair = build_tool_pair(tmp_path_factory.mktemp("muse"), TEMPLATE, CALL, before=("<think>",),
                           after=("</think>", "No call needed."))
    with serving(pair, "tiny-think") as (_, url):
        yield url


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


# -- a grammar after the reasoning, exactly -------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    import dflash_mlx

    return dflash_mlx.load("demo")


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_a_grammar_after_the_reasoning_equals_mlx_lm_with_the_same_gate(demo, block_size):
    """The reasoning ends at the token greedy decoding writes at a position (an end marker, as
    `</think>` is a token); the grammar follows it. Greedy ids equal mlx-lm's `generate_step` with
    the gated grammar as its logits processor, and cycles whose drafts cross the marker are verified
    with the free rows before it and the grammar's after it."""
    from conftest import plain_greedy
    from test_lossless import dflash_tokens

    from dflash_mlx.constrain import Grammar
    from dflash_mlx.constrain.gate import AfterReasoning, Reasoning
    from dflash_mlx.constrain.processor import GrammarProcessor

    prompt = demo.tokenizer.encode("def fibonacci(n):")
    free = plain_greedy(demo.target.model, prompt, 40, demo.tokenizer.eos_token_ids)
    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    crossings = 0
    for at in sorted({next(i for i in range(a, len(free)) if free[i] not in free[:i]) for a in (2, 5, 9, 13)}):
        reasoning = Reasoning(end=(free[at],), inside=True)
        gated = AfterReasoning(demo.grammars.constraint(grammar), reasoning)
        ref = plain_greedy(demo.target.model, prompt, 60, demo.tokenizer.eos_token_ids,
                           [GrammarProcessor(gated, len(prompt))])
        assert ref[: at + 1] == free[: at + 1] and ref[at + 1:] != free[at + 1: len(ref)]  # free, then the grammar
        out, events = dflash_tokens(demo, prompt, 60, grammar=grammar, reasoning=reasoning, block_size=block_size)
        assert out == ref, at
        done = 0
        for e in events:
            crossings += done <= at < done + len(e.tokens) - 1  # the marker and tokens after it in one cycle
            done += len(e.tokens)
    assert crossings > 0 or block_size == 1


def test_the_budget_forces_the_end_of_the_reasoning(demo):
    from test_lossless import dflash_tokens

    from dflash_mlx.constrain import Grammar
    from dflash_mlx.constrain.gate import Reasoning

    prompt = demo.tokenizer.encode("def fibonacci(n):")
    end = demo.tokenizer.encode("#")[-1]
    grammar = Grammar.regex("[0-9]{3}")
    out, events = dflash_tokens(demo, prompt, 40, grammar=grammar, block_size=8,
                                reasoning=Reasoning(end=(end,), inside=True, budget=6))
    assert out[6] == end and end not in out[:6]  # six reasoning tokens, then the marker, forced
    assert demo.tokenizer.decode(out[7:]).isdigit() and events[-1].finish_reason == "stop"


def test_a_forced_call_follows_the_thinking_instead_of_forbidding_it(thinker):
    """Under `tool_choice: "required"` the model still thinks first (its first row also allows the
    reasoning's start marker), then makes the call the grammar keeps to."""
    client = openai.OpenAI(base_url=thinker + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny-think", messages=[{"role": "user", "content": "Weather?"}],
                                       max_tokens=24, temperature=0, tools=TOOLS, tool_choice="required")
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == THOUGHT
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_thinking_budget_ends_the_reasoning_with_the_end_marker(muser):
    claude = anthropic.Anthropic(base_url=muser, api_key="x", max_retries=0)
    free = claude.messages.create(model="tiny-think", max_tokens=16, temperature=0,
                                  messages=[{"role": "user", "content": "Weather?"}])
    assert free.content[0].thinking == f"<tool_call>{CALL}</tool_call>"
    cut = claude.messages.create(model="tiny-think", max_tokens=16, temperature=0,
                                 thinking={"type": "enabled", "budget_tokens": 1},
                                 messages=[{"role": "user", "content": "Weather?"}])
    assert [b.type for b in cut.content] == ["thinking", "text"]
    assert cut.content[0].thinking == "<tool_call>" and cut.content[1].text == "No call needed."
    client = openai.OpenAI(base_url=muser + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-think", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, reasoning_effort="enormous")
    assert "reasoning_effort" in e.value.body["message"]
