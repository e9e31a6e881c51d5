"""gpt-oss's harmony format: analysis is reasoning, final and preambles the answer's text, messages
to functions tool calls, read as the text streams (`serve/harmony.py`); a grammar applies from the
final answer's start and a thinking budget forces the way there (`constrain/gate.py`)."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from conftest import serving
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx.constrain.gate import AfterReasoning, Free, Reasoning
from dflash_mlx.serve.harmony import CLOSE, FINAL, HarmonySplitter, harmony_gate, is_harmony

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
THOUGHT = "The user wants the weather, so I look."
ANSWER = "It is sunny in Paris."
ARGS = '{"city": "Paris"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL_ANSWER = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALL_AFTER = f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
CALL_BEFORE = f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}"
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|return|>", "<|call|>", "<|constrain|>"]
# gpt-oss's template, short: the system message names the channels, tools are a developer message.
TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def split(pieces, tools=TOOLS, cut=False):
    """(reasoning, text, calls) of the text fed in `pieces`, the last one final."""
    s = HarmonySplitter(tools)
    parts = [s.feed(p, final=i == len(pieces) - 1, cut=cut) for i, p in enumerate(pieces)]
    calls = [c for p in parts for c in p[2]]
    assert s.calls == len(calls)
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts), calls


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# -- the splitter ------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["", "<|return|>"])
def test_analysis_then_final_split_anywhere(end):
    text = ANALYSIS + FINAL_ANSWER + end
    for at in range(len(text) + 1):
        assert split([text[:at], text[at:]]) == (THOUGHT, ANSWER, []), at
    assert split(list(text)) == (THOUGHT, ANSWER, [])


@pytest.mark.parametrize("call", [CALL_AFTER, CALL_BEFORE])
@pytest.mark.parametrize("end", ["", "<|call|>"])
def test_a_call_after_the_analysis_split_anywhere(call, end):
    text = ANALYSIS + call + end
    for at in range(len(text) + 1):
        reasoning, content, calls = split([text[:at], text[at:]])
        assert (reasoning, content, named(calls)) == (THOUGHT, "", [("get_weather", {"city": "Paris"})]), at
        assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_a_call_is_read_as_its_end_marker_arrives():
    s = HarmonySplitter(TOOLS)
    assert s.feed(ANALYSIS + CALL_AFTER)[:2] == (THOUGHT, "") and s.calls == 0
    assert named(s.feed("<|call|>")[2]) == [("get_weather", {"city": "Paris"})]
    assert s.feed("", final=True) == ("", "", []) and s.calls == 1


def test_a_preamble_is_text_and_the_call_follows_it():
    text = "<|channel|>commentary<|message|>Let me check.<|end|>" + CALL_AFTER + "<|call|>"
    for at in range(len(text) + 1):
        reasoning, content, calls = split([text[:at], text[at:]])
        assert (reasoning, content, named(calls)) == ("", "Let me check.", [("get_weather", {"city": "Paris"})]), at


def test_messages_of_one_kind_are_joined_by_a_blank_line():
    text = ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis to=python code"
            "<|message|>print(1)<|call|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
            + FINAL_ANSWER + "<|return|>")
    assert split(list(text)) == ("First.\n\nprint(1)", "Checking.\n\n" + ANSWER, [])


def test_without_tools_a_call_is_not_read_and_a_bad_one_is_text():
    assert split([ANALYSIS + CALL_AFTER + "<|call|>"], tools=None) == (THOUGHT, ARGS, [])
    assert split([CALL_BEFORE[: -len(ARGS)] + "{not json<|call|>"]) == ("", "{not json", [])


def test_a_final_channel_without_the_end_of_the_analysis():
    text = "<|channel|>analysis<|message|>Hm.<|channel|>final<|message|>Yes."
    assert split(list(text)) == ("Hm.", "Yes.", [])
    assert split(["Plain words."]) == ("", "Plain words.", [])  # no harmony at all: the text stands


@pytest.mark.parametrize("text", [ANALYSIS + FINAL_ANSWER + "<|return|>", ANALYSIS + CALL_AFTER + "<|call|>",
                                  ANALYSIS + CALL_BEFORE])
def test_a_cut_answer_leaks_no_markup(text):
    for at in range(len(text) + 1):
        for pieces in ([text[:at]], [text[: at // 2], text[at // 2: at]]):
            reasoning, content, calls = split(pieces, cut=True)
            assert THOUGHT.startswith(reasoning) and ANSWER.startswith(content), (at, reasoning, content)
            # a call only with its end marker
            assert named(calls) == ([("get_weather", {"city": "Paris"})] if text[:at].endswith("<|call|>") else [])


def test_a_spent_budget_forces_the_way_to_the_final_answer():
    """End (c, f, m): `<|channel|>final<|message|>`; close: `<|end|><|start|>assistant` before it.
    Past the budget the rows force the close's rest, or the end marker's once it is begun; the
    grammar sees only the tokens after the end marker."""
    e, s, a, c, f, m = 10, 11, 12, 13, 14, 15
    gate = AfterReasoning(Recorder(), Reasoning(end=(c, f, m), close=(e, s, a, c, f, m), inside=True, budget=3))
    assert gate.forced(8) == [] and gate.allows([1, 2, 3, 4]) == 3
    gate.commit([1, 2, 3])
    assert gate.forced(8) == [e, s, a, c, f, m] and gate.forced(2) == [e, s]
    rows = gate.masks([e, s, a, c, f, m, 5]).bits
    assert [allowed(r) for r in rows] == [[e], [s], [a], [c], [f], [m], [5], [7]]
    assert gate.allows([e, s, 9]) == 2 and gate.allows([e, s, a, c, f, m, 5, 7]) == 8
    gate.commit([e, s, a, c, f, m, 5])
    assert gate.inner.committed == [5] and gate.at.state == "answer"
    begun = AfterReasoning(Recorder(), Reasoning(end=(c, f, m), close=(e, s, a, c, f, m), inside=True, budget=2))
    begun.commit([1, c])
    assert begun.forced(8) == [f, m]  # the end marker, begun: not the close from its start
    halfway = AfterReasoning(Recorder(), Reasoning(end=(c, f, m), close=(e, s, a, c, f, m), inside=True, budget=3))
    halfway.commit([1, e, s])
    assert halfway.forced(8) == [a, c, f, m]


def test_the_end_marker_alone_starts_the_grammar():
    c, f, m = 13, 14, 15
    gate = AfterReasoning(Recorder(), Reasoning(end=(c, f, m), close=(10, 11, 12, c, f, m), inside=True))
    rows = gate.masks([1, c, f, m, 5]).bits
    assert [allowed(r) for r in rows] == ["all"] * 4 + [[5], [7]]
    gate.commit([c, 2, c, f, m, 5, 6])
    assert gate.inner.committed == [5, 6]


class Recorder:
    """A grammar that allows token 5 then 7 then anything below 9, and records what it is given."""

    words, eos, error, done, accepting = 1, {0}, None, False, True

    def __init__(self):
        self.committed = []

    def _ok(self, at, t):
        return t == 5 if at == 0 else t == 7 if at == 1 else t < 9

    def allows(self, drafts):
        n = 0
        while n < len(drafts) and self._ok(len(self.committed) + n, drafts[n]):
            n += 1
        return n

    def masks(self, drafts=(), valid=None):
        from dflash_mlx.constrain.matcher import Masks

        rows = [pack([t for t in range(32) if self._ok(len(self.committed) + i, t)]) for i in range(len(drafts) + 1)]
        return Masks(np.stack(rows), self.allows(drafts) if valid is None else valid)

    def forced(self, limit):
        return []

    def commit(self, tokens):
        self.committed += list(tokens)

    def take_seconds(self):
        return 0.0


def pack(tokens):
    bits = np.zeros((32,), dtype=np.uint8)
    bits[tokens] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def allowed(row):
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return "all" if bits.all() else [int(i) for i in np.flatnonzero(bits)]


def test_a_harmony_budget_gate_without_a_grammar_and_the_rest_unchanged():
    """Free after the reasoning; a close that does not end with the end marker is the end marker."""
    gate = AfterReasoning(Free(32, [0]), Reasoning(end=(3,), close=(1, 2), inside=True, budget=1))
    gate.commit([9])
    assert gate.forced(4) == [3]
    think = AfterReasoning(Free(32, [0]), Reasoning(end=(3,), inside=True, budget=1))
    think.commit([9])
    assert think.forced(4) == [3] and allowed(think.masks().bits[0]) == [3]


# -- a tiny gpt-oss over HTTP ------------------------------------------------------------------


def build_harmony_pair(root, chain):
    """A tiny gpt_oss (tests/tiny.py's) made a bigram chain, each token's successor the next of
    `chain` (attention and expert outputs zeroed, the head mapping each token to its successor),
    after the prompt's last token `assistant`; with the harmony markers as special tokens, the
    harmony TEMPLATE, and `<|return|>` and `<|call|>` as its end tokens."""
    from mlx_lm.utils import _get_classes
    from tokenizers import AddedToken, Tokenizer

    tiny.train_tokenizer(root / "tok")
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens(["assistant", "analysis", "final", *[t for t in chain if t not in SPECIALS]])
    target = root / "target"
    target.mkdir()
    tok.save(str(target / "tokenizer.json"))
    cfg = json.loads((root / "tok" / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=TEMPLATE, eos_token="<|return|>")))
    ids = tok.get_vocab()
    V = tok.get_vocab_size()
    config = dict(tiny.target_config("gpt_oss", V), eos_token_id=[ids["<|return|>"], ids["<|call|>"]])
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(3)
    params = dict(tree_flatten(model_cls(args_cls.from_dict(config)).parameters()))
    params = {k: mx.zeros_like(v) if ".o_proj." in k or ".down_proj." in k else v for k, v in params.items()}
    emb = mx.random.normal((V, config["hidden_size"]))
    normed = emb * mx.rsqrt((emb * emb).mean(-1, keepdims=True) + 1e-6)
    head = mx.zeros((V, config["hidden_size"]))
    chain = [ids[t] for t in ["assistant", *chain]]
    for a, b in zip(chain, chain[1:]):
        head[b] = normed[a] * (20.0 / config["hidden_size"])
    params.update({"model.embed_tokens.weight": emb, "lm_head.weight": head})
    mx.save_safetensors(str(target / "model.safetensors"), params)
    (target / "config.json").write_text(json.dumps(config))
    drafter = tiny.build_drafter(root / "drafter", tiny.drafter_config("new", V, 6, mask_token_id=ids["<|mask|>"],
                                                                       layer_ids=(1, 5), sliding=True))
    return dflash_mlx.load(str(target), str(drafter))


# It reasons, then answers: the final channel's header is one token (the template's markers are
# special tokens the tokenizer keeps apart, so the gate's own markers stay the markers' tokens).
ANSWERING = ["<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|><|start|>assistant<|channel|>final<|message|>",
             ANSWER, "<|return|>"]
CALLING = ["<|channel|>", "analysis", "<|message|>", THOUGHT,
           "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
           ARGS, "<|call|>"]


@pytest.fixture(scope="module")
def answerer(tmp_path_factory):
    pair = build_harmony_pair(tmp_path_factory.mktemp("harmony-answer"), ANSWERING)
    with serving(pair, "tiny-gpt-oss") as (_, url):
        yield pair, url


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    pair = build_harmony_pair(tmp_path_factory.mktemp("harmony-call"), CALLING)
    with serving(pair, "tiny-gpt-oss") as (_, url):
        yield pair, url


def chat(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


ASK = dict(model="tiny-gpt-oss", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=16,
           temperature=0)


def test_the_pair_is_harmony(answerer):
    pair, _ = answerer
    tok = pair.tokenizer
    assert is_harmony(tok) and not tok.has_thinking and not tok.has_tool_calling
    gate = harmony_gate(tok, 4)
    assert [tok.decode([t]) for t in gate.close] == ["<|end|>", "<|start|>", "assistant", "<|channel|>", "final",
                                                     "<|message|>"]
    assert gate.end == tuple(tok.encode(FINAL, add_special_tokens=False)) == gate.close[3:] and gate.inside
    assert tok.decode(list(gate.close)) == CLOSE


def test_chat_reasoning_and_content_are_their_own_fields(answerer):
    _, url = answerer
    r = chat(url).chat.completions.create(**ASK)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THOUGHT
    assert message.content == ANSWER and r.choices[0].finish_reason == "stop"
    deltas = [c.choices[0].delta for c in chat(url).chat.completions.create(**ASK, stream=True) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_anthropic_thinking_block_and_text(answerer):
    _, url = answerer
    msg = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
        model="tiny-gpt-oss", max_tokens=16, messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == THOUGHT and msg.content[1].text == ANSWER


def test_a_call_in_commentary_is_a_tool_call(caller):
    _, url = caller
    r = chat(url).chat.completions.create(**ASK, tools=TOOLS)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content is None
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    deltas = [c for c in chat(url).chat.completions.create(**ASK, tools=TOOLS, stream=True) if c.choices]
    calls = [tc for c in deltas for tc in c.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert not any(c.choices[0].delta.content for c in deltas) and deltas[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:  # no call grammar in harmony's format
        chat(url).chat.completions.create(**ASK, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_the_response_format_applies_from_the_final_answer(answerer):
    """A budget of four tokens ends the analysis after the thought: the close `<|end|><|start|>
    assistant<|channel|>final<|message|>` is forced, then the schema holds the final answer."""
    _, url = answerer
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "string", "enum": ["Paris"]}}}
    r = chat(url).chat.completions.create(**dict(ASK, max_tokens=32), response_format=schema,
                                          extra_body={"thinking_budget": 4})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == '"Paris"'
    assert r.choices[0].finish_reason == "stop"
    budgeted = chat(url).chat.completions.create(**ASK, extra_body={"thinking_budget": 4})
    assert budgeted.choices[0].message.content == THOUGHT + "\n\n" + ANSWER  # forced final, then the chain


def test_a_start_marker_of_several_tokens_opens_the_reasoning_through_forced_tokens():
    """Gemma 4 opens its reasoning with `<|channel>thought` (tokens o, t) when the prompt did not:
    the first row allows the grammar's first token or o; after o, only t (forced); the grammar
    starts after the end marker (e). Without o first, the grammar holds from the first token."""
    o, t, e = 20, 21, 22
    gate = AfterReasoning(Recorder(), Reasoning(end=(e,), start=(o, t)))
    assert gate.at.state == "maybe" and gate.forced(4) == []
    rows = gate.masks([o, t, 1, e, 5]).bits
    assert [allowed(r) for r in rows] == [[5, o], [t], "all", "all", [5], [7]]
    assert gate.allows([o, 3]) == 1 and gate.allows([o, t, 1, e, 5, 7]) == 6
    gate.commit([o])
    assert gate.at.state == "opening" and gate.forced(4) == [t]
    gate.commit([t, 1, 2, e, 5])
    assert gate.at.state == "answer" and gate.inner.committed == [5]
    direct = AfterReasoning(Recorder(), Reasoning(end=(e,), start=(o, t)))
    assert direct.allows([5, 7]) == 2 and direct.allows([6]) == 0
    direct.commit([5])
    assert direct.at.state == "answer" and direct.inner.committed == [5]
