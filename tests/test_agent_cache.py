"""The prompt cache across an agent's turns: each client's captured session (tests/fixtures/clients/) replayed,
its second turn starting from the first one's prompt; a new Claude Code session starting from the last one's,
its billing line left out of the prompt; and the cached tokens as each API reports them, streamed and not."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import serving
from test_tools import CALL, TEMPLATE, build_tool_pair

from dflash_mlx.serve import messages_api
from dflash_mlx.serve.requests import parse_messages, parse_request, parse_responses

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
FIXTURES = Path(__file__).parent / "fixtures" / "clients"
CLAUDE = "claude-code-2.1.197/02-v1-messages.json"
SESSIONS = {  # each client's turns, in the order it sent them
    "claude-code": [CLAUDE, "claude-code-2.1.197/03-v1-messages.json"],
    "codex": ["codex-0.171.0/01-v1-responses.json", "codex-0.171.0/02-v1-responses.json"],
    **{f"agents-{kind}": [f"openai-agents-0.24.0/{kind}/0{n}-v1-{path}.json" for n in (1, 2)]
       for kind, path in [("responses", "responses"), ("responses-stream", "responses"),
                          ("chat", "chat-completions"), ("chat-stream", "chat-completions")]},
}
PARSE = {"/v1/messages": parse_messages, "/v1/responses": parse_responses,
         "/v1/chat/completions": lambda engine, body: parse_request(engine, body, True)}
BUDGET = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_tokens"}


@pytest.fixture(scope="module")
def agent_pair(tmp_path_factory):
    """The tool-calling pair with a window for an agent's prompt, in two layers (see test_responses_api)."""
    return build_tool_pair(tmp_path_factory.mktemp("agent-cache"), TEMPLATE, CALL, window=65536, layers=2)


@pytest.fixture
def server(agent_pair):
    """A server of its own: its prompt cache starts empty."""
    with serving(agent_pair, "demo-chat") as (srv, url):
        yield srv, url


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int


def _usage(u: dict) -> Usage:
    """Each API's usage; Anthropic's `input_tokens` are those the cache did not hold."""
    if "cache_read_input_tokens" in u:
        assert u["cache_creation_input_tokens"] == 0
        return Usage(u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"])
    if "input_tokens" in u:
        return Usage(u["input_tokens"], u["input_tokens_details"]["cached_tokens"])
    return Usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])


def capture(name: str, **edits) -> dict:
    """A captured request, its model renamed, its answer's budget cut, its body changed by `edits`."""
    x = json.loads((FIXTURES / name).read_text())
    x["body"] = dict(x["body"], model="demo-chat", **{BUDGET[x["path"]]: 8}, **edits)
    return x


def rendered(engine, x: dict) -> list:
    """The prompt the server runs for a captured request."""
    job, _ = PARSE[x["path"]](engine, x["body"])
    return job.prompt


def replayed(url: str, x: dict) -> Usage:
    """A captured request sent as the client sent it; the usage of its answer (streamed: of each event that
    has one, all alike)."""
    import urllib.request

    headers = {k: v for k, v in x["headers"].items() if k.lower() in ("anthropic-version", "anthropic-beta")}
    req = urllib.request.Request(url + x["path"] + (f"?{x['query']}" if x.get("query") else ""),
                                 json.dumps(x["body"]).encode(), dict(headers, **{"Content-Type": "application/json"}))
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read().decode()
    if not x["body"].get("stream"):
        return _usage(json.loads(raw)["usage"])
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    found = [e.get("usage") or (e.get("message") or {}).get("usage") or (e.get("response") or {}).get("usage")
             for e in events]
    found = [_usage(u) for u in found if u]
    assert found and all(u == found[0] for u in found), found
    return found[0]


@pytest.mark.parametrize("client", sorted(SESSIONS))
def test_a_clients_second_turn_starts_from_the_first_ones_prompt(server, client):
    srv, url = server
    first, second = [capture(name) for name in SESSIONS[client]]
    p1, p2 = rendered(srv.engine, first), rendered(srv.engine, second)
    assert replayed(url, first) == Usage(len(p1), 0)
    again = replayed(url, second)
    # This template renders the answer right after the generation prompt, so the whole of turn 1's prompt
    # begins turn 2's (a template that renders it otherwise keeps all but its last few tokens); the cache
    # holds it, and at least turn 2's last token runs.
    assert again.prompt_tokens == len(p2) and len(p1) <= again.cached_tokens < len(p2), (len(p1), again)


def new_session(body: dict) -> dict:
    """Claude Code's turn 1 as another session sends it: another billing suffix, another session id."""
    system = [dict(b, text=b["text"].replace("cc_version=2.1.197.8a5;", "cc_version=2.1.197.3f1;"))
              for b in body["system"]]
    assert system != body["system"]
    user = dict(json.loads(body["metadata"]["user_id"]), session_id="00000000-0000-4000-8000-000000000001")
    return {"system": system, "metadata": {"user_id": json.dumps(user)}}


def test_a_new_claude_code_session_starts_from_the_last_ones_prompt(server):
    srv, url = server
    first = capture(CLAUDE)
    other = capture(CLAUDE, **new_session(first["body"]))
    prompt = rendered(srv.engine, first)
    assert rendered(srv.engine, other) == prompt  # the billing line is not in the prompt
    assert replayed(url, first) == Usage(len(prompt), 0)
    assert replayed(url, other) == Usage(len(prompt), len(prompt) - 1)


def test_only_the_billing_line_is_left_out_of_the_system_prompt():
    line = "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=sdk-cli;"
    blocks = [{"type": "text", "text": line}, {"type": "text", "text": "You are an agent."}]
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": line}]}

    def system(value):
        chat = messages_api.to_chat(dict(body, system=value))["messages"]
        return chat[0]["content"] if chat[0]["role"] == "system" else None

    assert system(blocks) == "You are an agent."
    assert system(blocks[:1]) is None
    assert system([blocks[1], blocks[0]]) == "You are an agent."  # wherever it is among the blocks
    kept = [line + "\nYou are an agent.", "Note: " + line]  # a prompt that starts with it, one that quotes it
    assert [system([{"type": "text", "text": t}]) for t in kept] == kept
    assert system(line) == line  # a string is the client's own prompt
    assert messages_api.to_chat(dict(body, system=blocks))["messages"][1]["content"] == line


def test_every_api_reports_the_cached_tokens_streamed_and_not(server):
    srv, url = server
    system, user = "Answer in one word.", "Which city has the Eiffel tower?"
    chat = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = rendered(srv.engine, {"path": "/v1/chat/completions", "body": {"messages": chat}})
    assert rendered(srv.engine, {"path": "/v1/responses", "body": {"instructions": system, "input": user}}) == prompt
    assert rendered(srv.engine, {"path": "/v1/messages", "body": {
        "max_tokens": 8, "system": system, "messages": [{"role": "user", "content": user}]}}) == prompt
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    cold = gpt.chat.completions.create(model="demo-chat", messages=chat, max_tokens=8)
    assert (cold.usage.prompt_tokens, cold.usage.prompt_tokens_details.cached_tokens) == (len(prompt), 0)
    # The same prompt again: all of it but its last token from the cache, in each API's own fields.
    warm = Usage(len(prompt), len(prompt) - 1)
    for stream in (False, True):
        if stream:
            chunks = list(gpt.chat.completions.create(model="demo-chat", messages=chat, max_tokens=8, stream=True,
                                                      stream_options={"include_usage": True}))
            u = chunks[-1].usage
        else:
            u = gpt.chat.completions.create(model="demo-chat", messages=chat, max_tokens=8).usage
        assert Usage(u.prompt_tokens, u.prompt_tokens_details.cached_tokens) == warm, stream

        kwargs = dict(model="demo-chat", instructions=system, input=user, max_output_tokens=8)
        if stream:
            with gpt.responses.stream(**kwargs) as s:
                u = s.get_final_response().usage
        else:
            u = gpt.responses.create(**kwargs).usage
        assert Usage(u.input_tokens, u.input_tokens_details.cached_tokens) == warm, stream

        kwargs = dict(model="demo-chat", system=system, messages=[{"role": "user", "content": user}], max_tokens=8)
        if stream:
            events = list(claude.messages.create(stream=True, **kwargs))
            found = [e.message.usage for e in events if e.type == "message_start"]
            found += [e.usage for e in events if e.type == "message_delta"]
        else:
            found = [claude.messages.create(**kwargs).usage]
        assert len(found) == (2 if stream else 1)
        for u in found:  # Anthropic's input_tokens: those the cache did not hold
            assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens) == (1, warm.cached_tokens,
                                                                                                0), stream
