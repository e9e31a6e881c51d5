"""OpenAI's answer shapes for chat and text completions: whole answers, stream chunks, usage and log probabilities.

What is generated arrives as the engine's events; a thinking model's reasoning
is split off a chat answer (`reasoning`, and `reasoning_content` as vLLM and
llama.cpp name it) and tool calls are parsed out of the rest
(`reasoning.AnswerParts`). Decoding tokens for log probabilities and parsing
tool calls use the tokenizer, which holds its lock.
"""

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .reasoning import AnswerParts


@dataclass
class Answer:
    """A whole answer, gathered from its events."""
    text: str = ""
    stats: Any = None  # the final event's GenerationStats
    finish: Optional[str] = None
    tokens: List[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (logprob, top) per token

    def add(self, event) -> None:
        self.text += event.text
        self.stats, self.finish = event.stats, event.finish_reason
        self.tokens += event.tokens
        self.logprobs += event.logprobs or []


def usage(stats) -> Dict[str, Any]:
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "dflash": {"mean_acceptance_length": round(stats.mean_acceptance, 3), "cycles": stats.cycles,
                   "generation_tps": round(stats.generation_tps, 2)},
    }


def logprobs(tok, tokens, lps, chat: bool):
    """OpenAI's logprobs object: chat's `content` list, or the completions API's parallel lists."""
    text = [tok.decode([t]) for t in tokens]
    if chat:
        def entry(s, lp):
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(entry(s, lp), top_logprobs=[entry(tok.decode([i]), v) for i, v in top])
                            for s, (lp, top) in zip(text, lps)], "refusal": None}
    offsets, at = [], 0
    for s in text:
        offsets.append(at)
        at += len(s)
    return {"tokens": text, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{tok.decode([i]): v for i, v in top} for _, top in lps], "text_offset": offsets}


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def completion(model: str, job, chat: bool, answer: Answer, tok) -> Dict[str, Any]:
    """The whole answer: a `chat.completion` or a `text_completion`."""
    content, finish = answer.text, answer.finish
    lps = None if job.logprobs is None else logprobs(tok, answer.tokens, answer.logprobs, chat)
    reasoning, calls = "", []
    if chat:
        reasoning, content, calls = AnswerParts(tok, job).feed(content, final=True, cut=finish == "length")
        finish = "tool_calls" if calls and finish == "stop" else finish
    message = {"role": "assistant", "content": content or None, "tool_calls": calls} if calls else \
        {"role": "assistant", "content": content}
    if reasoning:
        message.update(reasoning=reasoning, reasoning_content=reasoning)
    choice = ({"index": 0, "message": message, "logprobs": lps, "finish_reason": finish}
              if chat else {"index": 0, "text": content, "finish_reason": finish, "logprobs": lps})
    return {"id": _id(chat), "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(answer.stats)}


class Chunks:
    """A streamed answer's chunks, event by event (`start`, then `feed` each event)."""

    def __init__(self, model: str, job, chat: bool, tok):
        self.model, self.job, self.chat, self.tok = model, job, chat, tok
        self.id, self.created = _id(chat), int(time.time())
        self.parts = AnswerParts(tok, job) if chat else None
        self.tokens, self.lps = [], []  # held until a chunk carries them (text may lag its tokens)

    def start(self) -> List[dict]:
        return [self._chunk("", None, first=True)] if self.chat else []

    def feed(self, event) -> List[dict]:
        self.tokens += event.tokens
        self.lps += event.logprobs or []
        reasoning, text, calls, finish = "", event.text, [], event.finish_reason
        parts = self.parts
        if parts is not None:
            reasoning, text, calls = parts.feed(text, final=finish is not None, cut=finish == "length")
            calls = [dict(c, index=parts.called - len(calls) + i) for i, c in enumerate(calls)]
            if finish == "stop" and parts.called:
                finish = "tool_calls"
        out = []
        if reasoning:
            out.append(self._chunk("", None, reasoning=reasoning))
        if text or calls or finish:
            lps = None if self.job.logprobs is None or not self.tokens else logprobs(self.tok, self.tokens, self.lps,
                                                                                     self.chat)
            last = usage(event.stats) if finish and not self.job.usage_chunk else None
            out.append(self._chunk(text, finish, usage=last, logprobs=lps, calls=calls))
            self.tokens, self.lps = [], []
        if finish and self.job.usage_chunk:  # OpenAI's form: one more chunk, its choices empty
            out.append({"id": self.id, "object": self._object(), "created": self.created, "model": self.model,
                        "choices": [], "usage": usage(event.stats)})
        return out

    def failed(self) -> dict:
        """The last chunk of an answer that could not go on: finish reason "error" (the error follows)."""
        return self._chunk("", "error")

    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, text, finish, first=False, usage=None, logprobs=None, calls=(), reasoning=""):
        if self.chat:
            delta = {"content": text} if text or not first else {"role": "assistant", "content": ""}
            if calls:
                delta = dict(delta if text else {}, tool_calls=calls)
            if reasoning:
                delta = {"reasoning": reasoning, "reasoning_content": reasoning}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = {"id": self.id, "object": self._object(), "created": self.created, "model": self.model,
               "choices": [choice]}
        if usage is not None:
            obj["usage"] = usage
        return obj
