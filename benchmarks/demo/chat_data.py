"""Synthetic agent conversations for the demo chat target (`--model demo-chat`).

Each conversation is a small task in a folder of made-up files: list the files, read one, answer, or
chat without tools. The model reasons briefly in <think>, calls a tool in the JSON format, reads the
result and answers. Four kinds of request shell carry the same tasks:
- `claude`: Claude Code's own first request (system prompt, 24 tools, reminders) as captured in
  tests/fixtures/clients/, turned into chat messages by the server's own Anthropic translation;
- `codex`: Codex CLI's (developer instructions, environment context, exec_command), likewise;
- `agents`: an OpenAI Agents SDK agent with list_files and read_file;
- `synthetic`: made-up system prompts, tool sets and reminder blocks, for variety.
An assistant turn is one training example: the prompt as the chat template renders it for the
answer, and the answer's text.
"""

import copy
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "fixtures" / "clients"
SHELL_TOOLS = {"Bash": "command", "bash": "command", "shell_command": "command", "exec_command": "cmd",
               "run_command": "command", "run_shell": "command", "terminal": "command", "execute": "command",
               "run": "cmd", "sh": "script"}
LIST_TOOLS = {"list_files": None, "list_dir": "path", "ls": "path", "list_directory": "directory",
              "LS": "path", "get_files": None}
READ_TOOLS = {"read_file": "path", "Read": "file_path", "cat": "path", "open_file": "filename",
              "view_file": "path", "get_file_contents": "file"}
OTHER_TOOLS = {"get_weather": ["city"], "send_email": ["to", "subject", "body"], "search_web": ["query"],
               "create_task": ["title"], "write_file": ["path", "content"], "edit_file": ["path", "old", "new"],
               "WebFetch": ["url", "prompt"], "WebSearch": ["query"], "Agent": ["description", "prompt"],
               "TaskCreate": ["subject", "description"], "view_image": ["path"], "write_stdin": ["session_id"],
               "update_plan": ["plan"], "apply_patch": ["input"], "calculator": ["expression"],
               "get_time": [], "translate": ["text", "target"], "Write": ["file_path", "content"],
               "Edit": ["file_path", "old_string", "new_string"], "Skill": ["skill"], "delete_file": ["path"],
               "git_status": [], "http_get": ["url"], "remember": ["fact"]}
WORDS = ("apple river stone cloud paper green quick slow north light music table window garden silver "
         "orange planet rocket forest summer winter bread coffee market travel friend simple pocket "
         "castle dragon pencil yellow purple number letter button mirror candle shadow ticket bottle "
         "engine memory signal bridge island valley thunder pepper butter honey cotton marble copper "
         "lemon tiger rabbit turtle falcon parrot wolf otter panda koala zebra camel spider beetle").split()
NAMES = ["README.md", "main.py", "notes.txt", "setup.py", "app.js", "todo.md", "config.toml", "data.csv",
         "LICENSE", "Makefile", "index.html", "utils.py", "test_main.py", "requirements.txt", "Cargo.toml",
         "style.css", "server.go", "lib.rs", "package.json", "CHANGELOG.md", "run.sh", "hello.c", "report.txt",
         "plan.md", "schema.sql", "model.py", "cli.py", "Dockerfile", ".gitignore", "draft.txt"]
NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven"]

LIST = ["list the files here", "what files are in this folder?", "show me the files here", "ls",
        "which files are here?", "list the files in this directory", "what is in this folder?",
        "can you list the files?", "list files", "tell me which files this project has"]
LIST_READ_ONE = ["list the files here, read one and tell me what it says",
                 "list the files, then read one of them and tell me what it holds",
                 "look at the files here and tell me what one of them says",
                 "list the files here, read one, answer", "what files are here? read one of them for me",
                 "list the files and show me what is in one"]
LIST_READ = ["list the files here, then read {f}", "list the files and read {f}",
             "what files are here? also show me {f}", "list the files here and tell me what {f} says"]
READ = ["what does {f} say?", "read {f}", "show me {f}", "cat {f}", "what is in {f}?",
        "open {f} and tell me what it says", "print the contents of {f}"]
CHAT = [("hi", "Hello! How can I help you today?"), ("hello", "Hello! What can I do for you?"),
        ("who are you?", "I am a small demo model. I can list and read the files in this folder."),
        ("what can you do?", "I can list the files in this folder, read one and tell you what it says."),
        ("thanks", "You are welcome!"), ("thank you!", "You are welcome!"),
        ("how are you?", "I am fine, thank you. What can I do for you?"),
        ("say hello", "Hello!"), ("what is 2 + 2?", "2 + 2 is 4."), ("ping", "pong")]
PERSONAS = ["You are a helpful assistant.", "You are a helpful assistant. Use tools when they help.",
            "You are a coding assistant working in the user's project folder.",
            "You are an agent that helps with files. Be brief.",
            "You are a careful assistant. Answer in one or two sentences."]


@dataclass
class Client:
    """A request shell: the messages before the task, its tools, and how tools answer."""
    kind: str
    messages: List[dict]
    tools: List[dict]
    shell: Optional[str] = None  # the shell tool's name (its argument in SHELL_TOOLS or `shell_arg`)
    shell_arg: Optional[str] = None
    lister: Optional[str] = None
    reader: Optional[str] = None
    request_at: int = -1  # index of the message whose text is the request


@dataclass
class Example:
    """One conversation to learn: its messages (the assistant turns are learned), tools and whether the
    model thinks."""
    kind: str
    messages: List[dict]
    tools: List[dict]
    thinking: bool

    def turns(self) -> List[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def tool(name: str, params: List[str], description: str = "") -> dict:
    props = {p: {"type": "string", "description": f"The {p.replace('_', ' ')}."} for p in params}
    return {"type": "function", "function": {"name": name, "description": description or name.replace("_", " "),
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": params}}}


def filler(rng: random.Random, corpus: List[str], chars: int) -> str:
    out, n = [], 0
    while n < chars:
        p = rng.choice(corpus)
        out.append(p)
        n += len(p)
    return "\n\n".join(out)


def docstrings() -> List[str]:
    """Paragraphs of English from the standard library's docstrings: filler for system prompts."""
    import ast
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py"))[:120]:
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and 80 < len(doc) < 1200:
                    out.append(doc)
    return out


def fixture(path: str) -> dict:
    return json.loads((CLIENTS / path).read_text())["body"]


def claude_client(rng: random.Random, request: str) -> Client:
    from dflash_mlx.serve import messages_api
    body = copy.deepcopy(fixture("claude-code-2.1.197/02-v1-messages.json"))
    blocks = body["messages"][0]["content"]
    date = f"20{rng.randint(25, 27)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    for b in blocks:
        if b.get("text") == "list the files here":
            b["text"] = request
        elif "Today's date is" in b.get("text", ""):
            b["text"] = b["text"].replace("2026-11-29", date)
    chat = messages_api.to_chat(body)
    return Client("claude", chat["messages"], chat["tools"], shell="Bash", shell_arg="command")


def codex_client(rng: random.Random, request: str) -> Client:
    from dflash_mlx.serve import responses_api
    body = copy.deepcopy(fixture("codex-0.171.0/01-v1-responses.json"))
    cwd = "/" + "/".join(rng.sample(WORDS, rng.randint(1, 3)))
    date = f"20{rng.randint(25, 27)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    for item in body["input"]:
        for part in item.get("content", []):
            if part.get("text") == "list the files here":
                part["text"] = request
            elif "<environment_context>" in part.get("text", ""):
                part["text"] = part["text"].replace("/work/task", cwd).replace("2026-11-29", date)
    chat = responses_api.to_chat(body)
    return Client("codex", chat["messages"], chat["tools"], shell="exec_command", shell_arg="cmd")


def agents_client(rng: random.Random, request: str) -> Client:
    tools = [tool("list_files", [], "List the files in the current working folder.")]
    if rng.random() < 0.7:
        tools.append(tool("read_file", ["path"], "Read a file in the current working folder."))
    rng.shuffle(tools)
    messages = [{"role": "system", "content": "You are a helpful assistant. Use tools when they help."},
                {"role": "user", "content": request}]
    return Client("agents", messages, tools, lister="list_files",
                  reader="read_file" if any(t["function"]["name"] == "read_file" for t in tools) else None)


def synthetic_client(rng: random.Random, request: str, corpus: List[str]) -> Client:
    tools, shell, arg, lister, reader = [], None, None, None, None
    if rng.random() < 0.6:
        shell = rng.choice(list(SHELL_TOOLS))
        arg = SHELL_TOOLS[shell]
        tools.append(tool(shell, [arg], "Run a shell command and return its output."))
    if rng.random() < (0.5 if shell else 0.85):
        lister = rng.choice(list(LIST_TOOLS))
        tools.append(tool(lister, [LIST_TOOLS[lister]] if LIST_TOOLS[lister] else [], "List files."))
    if rng.random() < 0.5:
        reader = rng.choice(list(READ_TOOLS))
        tools.append(tool(reader, [READ_TOOLS[reader]], "Read a file and return its text."))
    for name in rng.sample(list(OTHER_TOOLS), rng.randint(0, 6)):
        tools.append(tool(name, OTHER_TOOLS[name]))
    if rng.random() < 0.05:
        tools, shell, lister, reader = [], None, None, None
    rng.shuffle(tools)
    system = rng.choice(PERSONAS)
    if rng.random() < 0.6:
        system += "\n\n" + filler(rng, corpus, rng.choice([300, 1500, 4000]))
    user = request
    if rng.random() < 0.4:
        tag = rng.choice(["system-reminder", "context", "environment_context", "note"])
        block = f"<{tag}>\n{filler(rng, corpus, rng.choice([200, 800, 3000]))}\n</{tag}>"
        user = f"{block}\n\n{user}" if rng.random() < 0.5 else f"{user}\n\n{block}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return Client("synthetic", messages, tools, shell=shell, shell_arg=arg, lister=lister, reader=reader)


def prose_words(corpus: List[str]) -> List[str]:
    """The lowercase words of 3-10 letters in `corpus`, each once (a few thousand from the docstrings)."""
    return sorted({w for p in corpus for w in re.findall(r"\b[a-z]{3,10}\b", p)})


CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiouy"


def check_shares(prose: float, invented: float) -> None:
    """Raise ValueError (a one-line message naming both options) unless the two shares are a valid split."""
    if not (0 <= prose and 0 <= invented and prose + invented <= 1):
        raise ValueError(f"--prose {prose} --invented {invented}: give shares from 0 to 1 that add up to at most 1")


def invented_words(rng: random.Random, n: int = 24) -> List[str]:
    """`n` made-up words of one to three syllables, new for each conversation, so that they can only be copied."""
    def syllable() -> str:
        return rng.choice(CONSONANTS) + rng.choice(VOWELS) + (rng.choice(CONSONANTS) if rng.random() < 0.4 else "")
    return ["".join(syllable() for _ in range(rng.randint(1, 3))) for _ in range(n)]


def folder(rng: random.Random, words: Sequence[str] = WORDS) -> dict:
    """A few files and their contents, written with `words`: from the short list the model can learn by
    heart, or from thousands (`prose_words`) or made up (`invented_words`), so that answering about a file
    means copying what it read."""
    files = {}
    for name in rng.sample(NAMES, rng.randint(1, 6)):
        w = rng.sample(words, 3)
        if name.endswith(".md"):
            title = w[0].title() if words is not WORDS and rng.random() < 0.5 else f"{w[0].title()} {w[1]}"
            text = f"# {title}\nA {w[2]} project."
        elif name.endswith(".py"):
            text = rng.choice([f'print("{w[0]}")', f"def {w[0]}():\n    return {rng.randint(0, 99)}"])
        elif name.endswith((".txt", "LICENSE")):
            text = rng.choice([f"buy {w[0]}", f"{w[0]} {w[1]} {w[2]}", f"call the {w[0]} shop"])
        elif name.endswith((".json", ".toml")):
            text = f'{{"name": "{w[0]}"}}' if name.endswith(".json") else f'name = "{w[0]}"'
        else:
            text = f"{w[0]} {w[1]}"
        files[name] = text + "\n"
    return files


def listing(names: List[str]) -> str:
    return "\n".join(sorted(names, key=str.lower))


def said_list(names: List[str]) -> str:
    names = sorted(names, key=str.lower)
    n = NUMBERS[len(names)] if len(names) < len(NUMBERS) else str(len(names))
    files = "file" if len(names) == 1 else "files"
    joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"The folder holds {n} {files}: {joined}."


def pick_one(rng: random.Random, names: List[str]) -> str:
    for preferred in ("README.md", "notes.txt", "main.py"):
        if preferred in names:
            return preferred
    return sorted(names, key=str.lower)[0]


class Conversation:
    """Builds one conversation turn by turn, recording each assistant turn as an Example."""

    def __init__(self, rng: random.Random, client: Client, thinking: bool):
        self.rng, self.client, self.thinking = rng, client, thinking
        self.messages = list(client.messages)

    def answer(self, reasoning: str, content: str = "", call: Optional[dict] = None) -> Optional[str]:
        msg = {"role": "assistant", "content": content}
        if self.thinking:
            msg["reasoning_content"] = reasoning
        if call is not None:
            cid = "call_" + "".join(self.rng.choice("0123456789abcdef") for _ in range(16))
            msg["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": call["name"], "arguments": call["arguments"]}}]
        self.messages.append(msg)
        return msg["tool_calls"][0]["id"] if call is not None else None

    def result(self, call_id: str, text: str) -> None:
        if self.client.kind == "codex":
            chunk = "".join(self.rng.choice("0123456789abcdef") for _ in range(6))
            text = (f"Chunk ID: {chunk}\nWall time: 0.{self.rng.randint(0, 9999):04d} seconds\nProcess exited "
                    f"with code 0\nOriginal token count: {max(1, len(text) // 4)}\nOutput:\n{text}\n")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def list_call(self) -> Optional[dict]:
        c = self.client
        if c.lister:
            arg = LIST_TOOLS.get(c.lister)
            return {"name": c.lister, "arguments": {arg: "."} if arg else {}}
        if c.shell:
            return {"name": c.shell, "arguments": self.shell_args("ls")}
        return None

    def read_call(self, name: str) -> Optional[dict]:
        c = self.client
        if c.shell:
            return {"name": c.shell, "arguments": self.shell_args(f"cat {name}")}
        if c.reader:
            return {"name": c.reader, "arguments": {READ_TOOLS.get(c.reader, "path"): name}}
        return None

    def shell_args(self, command: str) -> dict:
        args = {self.client.shell_arg: command}
        if self.client.kind == "claude":
            what = "List files in the current directory" if command == "ls" else f"Show {command[4:]}"
            args["description"] = what
        return args


# How often each request shell is drawn.
KINDS = {"claude": 25, "codex": 20, "agents": 15, "synthetic": 40}
# How often each task is drawn.
TASKS = {"list": 25, "list_read_one": 25, "list_read": 12, "read": 20, "read_missing": 5, "chat": 13}


def one(rng: random.Random, corpus: List[str], kinds: Dict[str, float] = KINDS,
        tasks: Dict[str, float] = TASKS, words: Sequence[str] = WORDS) -> Example:
    """One random conversation, its request shell drawn with the weights `kinds`, its task with `tasks`, its
    files written with `words`."""
    files = folder(rng, words)
    names = list(files)
    kind = rng.choices(list(tasks), list(tasks.values()))[0]
    target = rng.choice(names) if kind in ("list_read", "read") else None
    if kind == "read_missing":
        target = rng.choice([n for n in NAMES if n not in names])
    if kind == "chat":
        request, reply = rng.choice(CHAT)
    else:
        request = rng.choice({"list": LIST, "list_read_one": LIST_READ_ONE, "list_read": LIST_READ,
                              "read": READ, "read_missing": READ}[kind]).format(f=target)
    client_kind = rng.choices(list(kinds), list(kinds.values()))[0]
    client = {"claude": claude_client, "codex": codex_client, "agents": agents_client}.get(client_kind)
    client = client(rng, request) if client else synthetic_client(rng, request, corpus)
    conv = Conversation(rng, client, thinking=rng.random() < 0.8)
    conv_example = Example(client.kind, conv.messages, client.tools, conv.thinking)
    plan = {"list": "The user wants to know which files are here.",
            "list_read_one": "The user wants the files listed and one of them read.",
            "list_read": f"The user wants the files listed and {target} read."}.get(kind)

    if kind == "chat":
        conv.answer("The user is chatting. I will answer briefly.", reply)
        return conv_example
    listed = None
    if kind in ("list", "list_read_one", "list_read"):
        call = conv.list_call()
        if call is None:
            conv.answer("The user wants the files listed, but I have no tool to list them.",
                        "I cannot see the files here: I have no tool to list them.")
            return conv_example
        cid = conv.answer(f"{plan} I will list them with {call['name']}.", call=call)
        conv.result(cid, listing(names))
        listed = said_list(names)
        if kind == "list":
            conv.answer("I have the list of files. I can answer now.", listed)
            return conv_example
        if kind == "list_read_one":
            target = pick_one(rng, names)
    call = conv.read_call(target)
    if call is None:
        text = (listed + " " if listed else "") + f"I have no tool to read {target}."
        conv.answer(f"The user wants {target}, but I have no tool to read files.", text)
        return conv_example
    first = f"I will read {target} with {call['name']}."
    cid = conv.answer((f"The folder holds {', '.join(sorted(names, key=str.lower))}. " if listed else
                       f"The user wants the contents of {target}. ") + first, call=call)
    if target in files:
        conv.result(cid, files[target])
        said = f"{target} says:\n\n{files[target].strip()}"
        conv.answer(f"I have the contents of {target}. I can answer now.", (listed + " " if listed else "") + said)
    else:
        missing = (f"cat: {target}: No such file or directory" if call["name"] == client.shell
                   else f"Error: {target} does not exist.")
        conv.result(cid, missing)
        conv.answer(f"{target} does not exist. I will say so.", f"There is no file named {target} here.")
    return conv_example


def examples(n: int, seed: int = 0, kinds: Dict[str, float] = KINDS, tasks: Dict[str, float] = TASKS,
             prose: float = 0.0, invented: float = 0.0) -> List[Example]:
    """`n` conversations; a share `prose` of them have files written with the docstrings' words, a share
    `invented` with words made up for each conversation."""
    check_shares(prose, invented)
    rng = random.Random(seed)
    corpus = docstrings()
    many = prose_words(corpus) if prose > 0 else WORDS

    def words() -> Sequence[str]:  # no draw at shares of 0 or 1: a stage's conversations stay as they were
        if invented >= 1:
            return invented_words(rng)
        if prose >= 1:
            return many
        draw = rng.random() if prose > 0 or invented > 0 else 1.0
        return invented_words(rng) if draw < invented else many if draw < invented + prose else WORDS

    return [one(rng, corpus, kinds, tasks, words()) for _ in range(n)]


@dataclass
class Piece:
    text: str
    learned: bool  # an assistant turn's own text: the loss is taken on it


ASSISTANT, END = "<|im_start|>assistant\n", "<|im_end|>"
NO_THINKING = "<think>\n\n</think>\n\n"


def pieces(tok, ex: Example) -> List[Piece]:
    """The conversation as the chat template renders it, cut into prompt and learned text. Without
    thinking, each turn starts after the empty reasoning the generation prompt holds."""
    text = tok.apply_chat_template(ex.messages, tools=ex.tools or None, tokenize=False)
    out, at = [], 0
    while True:
        i = text.find(ASSISTANT, at)
        if i < 0:
            break
        j = text.index(END, i) + len(END)
        out.append(Piece(text[at:i + len(ASSISTANT)] + ("" if ex.thinking else NO_THINKING), False))
        out.append(Piece(text[i + len(ASSISTANT):j], True))
        at = j
    return out


def prompts(tok, ex: Example) -> List[str]:
    """The prompt of each assistant turn, as the server renders it."""
    return [tok.apply_chat_template(ex.messages[:i], tools=ex.tools or None, tokenize=False,
                                    add_generation_prompt=True, enable_thinking=ex.thinking)
            for i in ex.turns()]


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Print rendered conversations, or write prompts for `dflash-mlx "
                                             "train`, with the demo chat tokenizer.")
    ap.add_argument("--tokenizer", required=True, help="folder with the demo chat tokenizer")
    ap.add_argument("--prompts", help="write the prompts of N conversations' turns (jsonl, 'prompt') here")
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tail", type=int, default=2048, help="keep the last TAIL tokens of each prompt")
    ap.add_argument("--prose", type=float, default=0.0, help="share of conversations whose files are written "
                                                             "with the docstrings' words")
    ap.add_argument("--invented", type=float, default=0.0, help="share of conversations whose files are "
                                                                "written with made-up words")
    args = ap.parse_args()
    try:
        check_shares(args.prose, args.invented)
    except ValueError as e:
        ap.error(str(e))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = []
    for ex in examples(args.n, args.seed, prose=args.prose, invented=args.invented):
        if args.prompts:
            for p in prompts(tok, ex):
                rows.append({"prompt": tok.decode(tok.encode(p, add_special_tokens=False)[-args.tail:])})
        else:
            parts = pieces(tok, ex)
            print(f"--- {ex.kind} ---\n..." + "".join(p.text if p.learned else p.text[-400:] for p in parts))
    if args.prompts:
        Path(args.prompts).write_text("".join(json.dumps(r) + "\n" for r in rows))
