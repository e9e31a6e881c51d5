"""Parsing and validating API requests into the worker's jobs.

OpenAI's chat and text completions (`parse_request`) and Anthropic's Messages
API, read as the equivalent chat request (`parse_messages`, `count_tokens`).
Parsing runs on the HTTP layer's threads (`http_app`), before the job is
queued: a request that must be refused is refused before any byte of its
answer. `engine` is the worker (`worker.Engine`): its limits and defaults, and
its tokenizer, used under the worker's tokenizer lock (see `worker`).
"""

from typing import Any, List, Optional

from ..prompt import build_chat_prompt
from ..sampling import SamplingParams
from . import messages_api, responses_api
from ..constrain.grammar import Grammar
from ..decode.request import check_prompt
from ..errors import DFlashError, PromptTooLong
from .harmony import is_harmony
from .reasoning import budget, gate, thinking
from .tool_grammars import call_grammar
from .tools import ToolError, check_tools, forced_tool, strict_tools, template_messages, tool_choice
from .api_errors import APIError, too_long
from .worker import Engine, Job

MAX_STOP = 4  # stop strings per request: OpenAI's limit
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (and completions' logprobs)
# Fields the speculative path cannot honour yet: refused (400) when set to
# anything but their neutral value, never silently ignored. mlx-lm's server
# accepts the penalties, logit_bias and XTC; it treats repetition_penalty 0 as
# off, and 1 is the multiplicative identity, so both count as unset.
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "xtc_probability": lambda v: v not in (None, 0, 0.0),
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v is not None,
}


def _get(body, name, types, default=None, check=None, what=""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    if not isinstance(value, types) or (check is not None and not check(value)):
        raise APIError(400, f"'{name}' must be {what}.", param=name)
    return value


# Arguments of apply_chat_template itself, which chat_template_kwargs may not set.
_TEMPLATE_RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                      "return_tensors", "chat_template", "tools", "documents", "continue_final_message",
                      "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _chat_prompt(tok, messages, thinking, extra) -> List[int]:
    if not extra:
        return build_chat_prompt(tok, messages, thinking)
    # As build_chat_prompt, with the client's other template variables (mlx-lm passes them on too).
    kwargs = dict(extra)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def _tokenize(engine: Engine, body, chat: bool, tools: Optional[list] = None) -> List[int]:
    tok = engine.tokenizer
    if chat:
        messages = _get(body, "messages", list, None, lambda v: len(v) > 0, "a non-empty list of messages")
        if messages is None:
            raise APIError(400, "'messages' is required.", param="messages")
        try:
            messages = template_messages(messages)
            shown = tool_choice(body.get("tool_choice"), tools)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param)
        extra = body.get("chat_template_kwargs")
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object.", param="chat_template_kwargs")
        reserved = sorted(set(extra) & _TEMPLATE_RESERVED)
        if reserved:
            raise APIError(400, f"'chat_template_kwargs' may not set {', '.join(reserved)}.",
                           param="chat_template_kwargs")
        extra = dict(extra, **shown)
        thinking, where = extra.pop("enable_thinking", None), "chat_template_kwargs"
        if body.get("enable_thinking") is not None:
            thinking, where = body["enable_thinking"], "enable_thinking"
        if thinking is not None and not isinstance(thinking, bool):
            raise APIError(400, "'enable_thinking' must be a boolean.", param=where)
        if thinking is None:
            thinking = engine.enable_thinking
        with engine.tokenizer_lock:
            if getattr(tok, "chat_template", None):
                try:
                    return _chat_prompt(tok, messages, thinking, extra)
                except Exception as e:  # the template refused these messages (jinja's raise_exception)
                    if type(e).__module__.startswith("jinja2"):
                        raise APIError(400, f"The chat template rejected the messages: {e}", param="messages")
                    raise
            return tok.encode("\n".join(m["content"] for m in messages))
    text = body.get("prompt")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise APIError(400, "'prompt' must be a string.", param="prompt")
    with engine.tokenizer_lock:
        return tok.encode(text)


def parse_request(engine: Engine, body: Any, chat: bool):
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != engine.model_id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{engine.model_id}'.",
                       param="model", code="model_not_found")
    for name, bad in UNSUPPORTED.items():
        if name in body and bad(body[name]):
            raise APIError(400, f"'{name}' is not supported yet by this DFlash server; remove it "
                                f"(or leave it at its default).", param=name, code="unsupported_parameter")
    # Cheap checks first: a request that fails them costs no tokenizer time.
    # max_completion_tokens (OpenAI's current name, and mlx-lm's first choice) wins over max_tokens.
    limit = engine.max_tokens_limit
    max_tokens, name = None, "max_tokens"
    for name in ("max_completion_tokens", "max_tokens"):
        max_tokens = _get(body, name, int, None, lambda v: v >= 1, "a positive integer")
        if max_tokens is not None:
            break
    # Over the server's limit is refused, as OpenAI refuses a max_tokens over the
    # model's limit, rather than clamped: a client asking for more than it can get
    # should hear so, not find a finish_reason "length" it did not expect.
    if max_tokens is not None and max_tokens > limit:
        raise APIError(400, f"'{name}' is too large: {max_tokens}. This server generates at most {limit} "
                            f"tokens per request.", param=name, code="invalid_value")
    temp = _get(body, "temperature", (int, float), engine.default_temp, lambda v: 0 <= v <= 2,
                "a number in [0, 2]")
    top_p = _get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = _get(body, "top_k", int, 0, lambda v: v >= 0, "a non-negative integer")
    min_p = _get(body, "min_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    seed = _get(body, "seed", int, None, None, "an integer")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP):
        raise APIError(400, f"'stop' must be a string or a list of up to {MAX_STOP} strings.", param="stop")
    stream = _get(body, "stream", bool, False, None, "a boolean")
    if chat:
        top = _get(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                   f"an integer from 0 to {MAX_TOP_LOGPROBS}")
        if not _get(body, "logprobs", bool, False, None, "a boolean"):
            if top is not None:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
            logprobs = None
        else:
            logprobs = top or 0
    else:
        logprobs = _get(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                        f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    params = SamplingParams(temp=float(temp), top_p=float(top_p), top_k=top_k, min_p=float(min_p), seed=seed)
    processors = _processor_args(body, engine)

    tools = None
    if chat and body.get("tools"):
        try:
            tools = check_tools(body["tools"])
        except ToolError as e:
            raise APIError(400, str(e), param=e.param)
        with engine.tokenizer_lock:
            if not (engine.tokenizer.has_tool_calling or is_harmony(engine.tokenizer)):
                raise APIError(400, "This model's chat template has no tool calling (mlx-lm found no tool-call "
                                    "format for it); send the request without 'tools'.", param="tools")
        if body.get("tool_choice") == "none":
            tools = None  # not shown to the model, and its text is not parsed for calls
    grammar = _grammar(engine, body, chat, tools)
    prompt = _tokenize(engine, body, chat, tools)
    try:  # refused before any byte of a response, streamed or not
        check_prompt(prompt, engine.pair.target, engine.max_prompt_tokens)
    except PromptTooLong as e:
        raise too_long(e, "messages" if chat else "prompt")
    except DFlashError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt")
    if max_tokens is None:  # OpenAI's meaning: up to the context (agents such as Codex send none)
        window = getattr(engine.pair.target.args, "max_position_embeddings", None) or limit + len(prompt)
        max_tokens = engine.default_max_tokens or max(1, min(limit, window - len(prompt)))
    job = Job(prompt, max_tokens, params, stop, logprobs, processors, tools, grammar)
    if chat:
        tokens = budget(body)
        with engine.tokenizer_lock:
            job.thinking = thinking(engine.tokenizer, prompt)
            if job.thinking is not None and (grammar is not None or tokens is not None):
                job.reasoning = gate(engine.tokenizer, job.thinking, tokens)  # the grammar follows the reasoning
    options = _get(body, "stream_options", dict, None, None, "an object") if stream else None
    if options is not None:
        job.usage_chunk = _get(options, "include_usage", bool, False, None, "a boolean")
    return job, stream


def _grammar(engine: Engine, body, chat: bool, tools: Optional[list]) -> Optional[Grammar]:
    """What the request constrains its output to (`response_format`, a tool call `tool_choice`
    forces, or under "auto" the calls of strict tools), compiled here: a schema the engine cannot
    take is a 400 before any byte."""
    forced, calls = None, False
    try:
        forced = forced_tool(body.get("tool_choice"), tools) if chat else None
        calls = forced is not None or (chat and strict_tools(body.get("tool_choice"), tools))
        grammar = _response_format(body.get("response_format"))
        if calls and grammar is not None and forced is not None:
            raise APIError(400, "'response_format' and a forced tool call ('tool_choice') both constrain the "
                                "answer; send one of them.", param="response_format")
        calls = calls and grammar is None  # with a response format, strict tools under "auto" are not kept to
        if calls:
            parallel = _get(body, "parallel_tool_calls", bool, True, None, "a boolean")
            grammar = call_grammar(engine.tokenizer, engine.pair.grammars.tokenizer.is_special_token, tools, forced,
                                   parallel)
        if grammar is not None:
            engine.pair.grammars.compile(grammar)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param)
    except DFlashError as e:
        if calls:  # the call's grammar holds the tools' schemas: the error names the tool at fault
            raise APIError(400, _tool_at_fault(engine, tools, forced) or str(e), param="tools")
        raise APIError(400, str(e), param="response_format")
    return grammar


def _tool_at_fault(engine: Engine, tools: list, name) -> Optional[str]:
    """The engine's refusal of the first tool whose schema it refuses alone (compiled only after
    the tools' call grammar was refused), named by the tool."""
    for f in (t["function"] for t in tools):
        if name in (None, True) or f["name"] == name:
            try:
                engine.pair.grammars.compile(Grammar.json_schema(
                    f.get("parameters") or {"type": "object"}, lenient=not f.get("strict"),
                    what=f"The schema of tool '{f['name']}'"))
            except DFlashError as e:
                return str(e)
    return None


def _response_format(value) -> Optional[Grammar]:
    """OpenAI's `response_format`: text, `json_object`, or `json_schema` (strict or not)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                "{...}}}.", param="response_format")
        strict = _get(spec, "strict", bool, False, None, "a boolean")
        return Grammar.json_schema(spec["schema"], lenient=not strict)
    raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"json_schema\": {...}}.", param="response_format")


def _processor_args(body, engine: Engine) -> dict:
    """`make_logits_processors`' arguments for the request's penalties and logit bias (as mlx-lm's server reads them)."""
    number = (int, float)
    penalties = {}
    for name, check, what in (("repetition_penalty", lambda v: v > 0, "a positive number"),
                              ("presence_penalty", lambda v: -2 <= v <= 2, "a number from -2 to 2"),
                              ("frequency_penalty", lambda v: -2 <= v <= 2, "a number from -2 to 2")):
        value = _get(body, name, number, None, check, what)
        neutral = 1 if name == "repetition_penalty" else 0
        if value is not None and value != neutral:
            penalties[name] = float(value)
            size = name.replace("penalty", "context_size")
            penalties[size] = _get(body, size, int, 20, lambda v: v >= 1, "a positive integer")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object mapping token ids to biases.", param="logit_bias")
    vocab = engine.pair.target.vocab_size
    parsed = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab:
            raise APIError(400, f"'logit_bias' key {key!r} is not a token id of this model (0 to {vocab - 1}).",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, number) or not -100 <= value <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers from -100 to 100 (got {value!r}).",
                           param="logit_bias")
        parsed[token] = float(value)
    if not penalties and not parsed:
        return {}
    return dict(penalties, logit_bias=parsed or None)


def parse_messages(engine: Engine, body: Any):
    """An Anthropic Messages API request as the equivalent chat request's job (`parse_request`)."""
    try:
        chat = messages_api.to_chat(body)
    except messages_api.BadRequest as e:
        raise APIError(400, str(e), param=e.param)
    return parse_request(engine, chat, True)


def parse_responses(engine: Engine, body: Any):
    """A Responses API request as the equivalent chat request's job (`parse_request`)."""
    return parse_request(engine, responses_api.to_chat(body), True)


def count_tokens(engine: Engine, body: Any) -> int:
    """The prompt tokens a Messages API request would run (Anthropic's count_tokens)."""
    if isinstance(body, dict):
        body = {**body, "max_tokens": 1}  # not part of a count request
    try:
        chat = messages_api.to_chat(body)
    except messages_api.BadRequest as e:
        raise APIError(400, str(e), param=e.param)
    tools = check_tools(chat["tools"]) if chat.get("tools") else None
    return len(_tokenize(engine, chat, True, tools))
