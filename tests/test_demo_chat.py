"""The shipped chat pair (`--model demo-chat`): its chat template, decoding equal to mlx-lm's, and whole agent
turns over HTTP, from the requests Claude Code, Codex CLI and the OpenAI Agents SDK sent in a captured session
(tests/fixtures/clients/), with tool results as their own tools give them. Claude Code's and Codex's requests
keep their messages but only their shell tools and the first `KEEP` characters of their system prompts: the
model reads the last 2,048 tokens, and MLX's CPU backend without a fast BLAS prefills their 10-25k tokens in
minutes (`benchmarks/agents/run_clients.py` runs the clients themselves, whole)."""

import copy
import inspect
import json
from pathlib import Path

import pytest
from conftest import serving

import dflash_mlx

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
FIXTURES = Path(__file__).parent / "fixtures" / "clients"
LISTING = "README.md\nmain.py\nnotes.txt"
FILES = {"README.md": "# Demo\nA tiny project.\n", "main.py": 'print("hello")\n', "notes.txt": "buy milk\n"}
TASK = "list the files here, read one, answer"
KEEP = 1500


def trimmed(request: dict, tools: set) -> dict:
    """A captured request with only `tools` and shorter system prompts (see the module docstring)."""
    request["tools"] = [t for t in request["tools"] if t.get("name") in tools]
    if isinstance(request.get("system"), list):
        request["system"] = [dict(b, text=b["text"][:KEEP]) for b in request["system"]]
    for item in request.get("input", []):
        if item.get("role") == "developer":
            item["content"] = [dict(p, text=p["text"][:KEEP]) for p in item["content"]]
    return request


@pytest.fixture(scope="module")
def pair():
    return dflash_mlx.load("demo-chat")


@pytest.fixture(scope="module")
def server(pair):
    with serving(pair, "demo-chat") as (srv, url):
        yield srv, url


def body(name: str) -> dict:
    return copy.deepcopy(json.loads((FIXTURES / name).read_text())["body"])


def render(tok, messages, tools=None, **kw) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)


def tool(name, required):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in required}, "required": required}}}


def test_the_template_lists_the_tools_again_after_the_last_user_message(pair):
    tools = [tool("Bash", ["command"]), tool("list_files", [])]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list the files"}]
    text = render(pair.tokenizer, messages, tools, add_generation_prompt=True)
    head, tail = text.split("<|im_start|>user\n")
    assert head.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and head.count('{"type": "function"') == 2
    assert "\n{\"type\": \"function\", \"function\": {\"name\": \"Bash\"" in head
    assert tail == ("list the files<|im_end|>\n<|im_start|>system\nTools: Bash(command), list_files()<|im_end|>\n"
                    "<|im_start|>assistant\n")
    quiet = render(pair.tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=False)
    assert quiet == text + "<think>\n\n</think>\n\n"
    assert "Tools:" not in render(pair.tokenizer, messages, add_generation_prompt=True)


def test_each_turns_prompt_starts_with_the_last_turns_prompt_and_answer(pair):
    """Within a tool loop a turn's prompt extends the one before it by the answer and the tool results (as
    the model wrote them: reasoning kept after the last user message), so the prefix cache holds it all."""
    tools = [tool("Bash", ["command"])]
    call = {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}
    turns = [{"role": "user", "content": TASK},
             {"role": "assistant", "content": "", "reasoning_content": "I will list them.", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": LISTING},
             {"role": "assistant", "content": "Three files."}]
    first = render(pair.tokenizer, turns[:1], tools, add_generation_prompt=True)
    written = ('<think>\nI will list them.\n</think>\n\n<tool_call>\n{"name": "Bash", "arguments": '
               '{"command": "ls"}}\n</tool_call><|im_end|>\n')
    second = render(pair.tokenizer, turns[:3], tools, add_generation_prompt=True)
    assert second.startswith(first + written)
    assert second[len(first + written):] == (f"<|im_start|>user\n<tool_response>\n{LISTING}\n</tool_response>"
                                             "<|im_end|>\n<|im_start|>assistant\n")
    later = render(pair.tokenizer, turns + [{"role": "user", "content": "thanks"}], tools)
    assert "I will list them." not in later  # reasoning before the last user message is dropped


@pytest.mark.parametrize("thinking", [True, False])
def test_demo_chat_decodes_as_mlx_lm_does(pair, thinking):
    from dflash_mlx.target.baseline import generate, plain_target

    tools = [tool("Bash", ["command"]), tool("Read", ["file_path"])]
    for task in ["list the files here", "what does notes.txt say?", "hi"]:
        text = render(pair.tokenizer, [{"role": "user", "content": task}], tools, add_generation_prompt=True,
                      enable_thinking=thinking)
        ids = pair.tokenizer.encode(text, add_special_tokens=False)
        want = generate(plain_target(pair), pair.tokenizer, ids, 48)["tokens"]
        got = [t for e in dflash_mlx.stream_generate(pair, ids, max_tokens=48) for t in e.tokens]
        # mlx-lm yields the EOS token it stops on; the stream ends before it
        assert got == want or (got == want[:-1] and want[-1] in pair.tokenizer.eos_token_ids)


def responses_create(client, request: dict):
    """`responses.create` with the captured request; fields this SDK does not name (Codex's
    `client_metadata`) go as they were sent, in `extra_body`."""
    known = set(inspect.signature(client.responses.create).parameters)
    return client.responses.create(**{k: v for k, v in request.items() if k in known},
                                   extra_body={k: v for k, v in request.items() if k not in known})


def anthropic_turn(url: str, request: dict) -> dict:
    client = anthropic.Anthropic(base_url=url, api_key="x")
    return client.messages.create(**request).model_dump()


def test_claude_code_lists_reads_and_answers(server):
    """Claude Code's own first request with the task: the model calls Bash with ls, then cat on a listed file,
    then answers with the listing and what the file says (in words of its own: the demo model does not copy what
    it reads, benchmarks/demo/README.md); each turn's request is the last one's with the answer (its thinking
    blocks too, as Claude Code sends them back) and the tool's result."""
    _, url = server
    request = trimmed(body("claude-code-2.1.197/02-v1-messages.json"), {"Bash", "Read"})
    for block in request["messages"][0]["content"]:
        if block.get("text") == "list the files here":
            block["text"] = TASK
    request.update(model="demo-chat", max_tokens=200, stream=False)
    request.pop("context_management", None)
    commands = []
    for _ in range(3):
        answer = anthropic_turn(url, request)
        calls = [b for b in answer["content"] if b["type"] == "tool_use"]
        if not calls:
            break
        assert answer["stop_reason"] == "tool_use" and calls[0]["name"] == "Bash"
        command = calls[0]["input"]["command"]
        commands.append(command)
        result = LISTING if command == "ls" else FILES.get(command.removeprefix("cat "), "no such file")
        request["messages"] += [{"role": "assistant", "content": answer["content"]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0]["id"],
                                                              "content": result}]}]
    text = "".join(b["text"] for b in answer["content"] if b["type"] == "text")
    assert commands[0] == "ls" and commands[1].startswith("cat ") and len(commands) == 2
    read = commands[1][4:]
    assert read in FILES and f"{read} says:" in text and all(name in text for name in FILES)
    assert answer["stop_reason"] == "end_turn"


def test_codex_lists_and_answers(server):
    """Codex's captured turns: turn 1 calls exec_command with ls; turn 2 (its output in Codex's own shape)
    answers with the three files."""
    _, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    first = trimmed(body("codex-0.171.0/01-v1-responses.json"), {"exec_command"})
    first.update(model="demo-chat", stream=False, max_output_tokens=200)
    calls = [o for o in responses_create(client, first).model_dump()["output"] if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("exec_command", {"cmd": "ls"})]
    second = trimmed(body("codex-0.171.0/02-v1-responses.json"), {"exec_command"})
    second.update(model="demo-chat", stream=False, max_output_tokens=200)
    out = responses_create(client, second)
    assert out.output_text and all(name in out.output_text for name in FILES)
    assert not [o for o in out.output if o.type == "function_call"]


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_the_agents_sdk_lists_and_answers(server, kind):
    _, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    path = "chat-completions" if kind == "chat" else "responses"
    turns = [body(f"openai-agents-0.24.0/{kind}/0{n}-v1-{path}.json") for n in (1, 2)]
    for t in turns:
        t.update(model="demo-chat")
    if kind == "chat":
        first = client.chat.completions.create(**turns[0]).choices[0].message
        assert [c.function.name for c in first.tool_calls] == ["list_files"]
        text = client.chat.completions.create(**turns[1]).choices[0].message.content
    else:
        first = client.responses.create(**turns[0])
        assert [o.name for o in first.output if o.type == "function_call"] == ["list_files"]
        text = client.responses.create(**turns[1]).output_text
    assert all(name in text for name in FILES)
