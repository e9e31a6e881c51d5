"""A tokenizer's grammar compiler: llguidance's view of the vocabulary (built once, about a second
for a large one) and the grammars compiled for it, kept by their hash in a bounded LRU, so that an
agent's schema sent with every request compiles once.

llguidance rather than xgrammar (`benchmarks/grammar_engines.py` compares them; the figures are
in `benchmarks/README.md`): both fill a mask in microseconds, far below a cycle; llguidance
compiles a schema many times faster (the first request with a new schema waits for it), refuses
what it cannot enforce instead of ignoring it, and answers what speculation asks directly
(`validate_tokens`: how much of a draft the grammar allows; `compute_ff_tokens`: the forced
tokens; `rollback`).
"""

import re
import threading
from collections import OrderedDict
from typing import List, Optional

import llguidance
import llguidance.hf
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ..errors import DFlashError, printable
from .grammar import JSON_OPTIONS, Grammar
from .matcher import Constraint

# Compiled grammars kept per tokenizer: an agent's few schemas stay, a stream of one-off ones
# cannot grow memory without bound (a compiled JSON grammar is tens to hundreds of kB).
GRAMMAR_CACHE = 64

# The engine's work limits while compiling and per mask: a schema that would explode (deep
# nesting, huge enums or patterns) is refused instead of run. llguidance's defaults, with the
# grammar size a fifth of its default: no schema an agent sends comes near it.
LIMITS = dict(max_grammar_size=100_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              max_lexer_states=250_000, verbose_errors=False)


class Grammars:
    """Grammars compiled for one Hugging Face tokenizer, whose masks cover `vocab_size` tokens (the
    logits') or the tokenizer's, whichever is more."""

    def __init__(self, hf, vocab_size: int, eos: List[int]):
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=max(vocab_size, len(hf)),
                                                          eos_token=list(eos) or None)
        except ValueError as e:
            raise DFlashError(f"Structured output needs a fast (Rust) Hugging Face tokenizer: {e}") from None
        self.vocab_size = vocab_size
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self._compiled: "OrderedDict[str, llguidance.LLMatcher]" = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """The grammar's matcher at its start (cached; a `DFlashError` if the engine refuses it)."""
        key = grammar.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        matcher = llguidance.LLMatcher(self.tokenizer, engine_grammar(grammar), limits=self.limits, log_level=0)
        if matcher.is_error():
            raise DFlashError(engine_message(grammar, matcher.get_error()))
        # The engine builds the grammar lazily: one that allows no text at all (a rule that never
        # ends in text) is found at its first mask, here rather than at a request's first token.
        probe = matcher.deep_copy()
        fill_next_token_bitmask(probe, allocate_token_bitmask(1, self.tokenizer.vocab_size), 0)
        if probe.is_error():
            raise DFlashError(f"{grammar.name} allows no text at all: none of its rules ever ends in text. "
                              "Fix its rules.")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh constraint for one sequence (a copy of the compiled matcher)."""
        return Constraint(self.compile(grammar).deep_copy(), self.tokenizer.vocab_size, self.tokenizer.eos_tokens)

    def __len__(self) -> int:
        return len(self._compiled)


def engine_grammar(grammar: Grammar) -> str:
    """The grammar in llguidance's form."""
    try:
        if grammar.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(grammar.text,
                                                                 defaults=dict(JSON_OPTIONS, lenient=grammar.lenient))
        if grammar.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if grammar.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(grammar.text)
        return llguidance.grammar_from("grammar", grammar.text)
    except ValueError as e:
        raise DFlashError(engine_message(grammar, str(e))) from None


def engine_message(grammar: Grammar, message: str) -> str:
    """The engine's refusal in the user's terms: a regex's own parse error, a grammar's line and
    column, a schema's reason (the engine's own position in the grammar it made is left out)."""
    regex = re.search(r"regex parse error:\n\s*(.*?)\n.*?^error: (.*?)$", message, re.S | re.M)
    if regex:
        pattern, reason = printable(regex.group(1)), printable(regex.group(2)).strip()
        if grammar.kind == "regex":
            return f"The regex {pattern!r} does not parse: {reason}."
        return f"{grammar.name} has a pattern {pattern!r} that does not parse: {reason}."
    at = re.match(r"at (\d+)\((\d+)\): (.*)", message, re.S)
    if at and grammar.kind == "lark":
        return (f"The grammar has an error at line {at.group(1)} column {at.group(2)}: "
                f"{first_line(at.group(3).splitlines()[0])}.")
    reason = first_line(at.group(3).splitlines()[0] if at else message)
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", reason)
    if keys:
        names = keys.group(1).replace('"', "")
        return (f"{grammar.name} uses {names}, which the grammar engine cannot enforce while decoding; drop "
                f"{'them' if ',' in names else 'it'}, or leave \"strict\" off (where the API has it) to have "
                f"{'them' if ',' in names else 'it'} ignored.")
    return f"{grammar.name} cannot be used: {reason.removeprefix('failed to compile JSON schema: ')}."


def first_line(message: Optional[str]) -> str:
    """The engine's message on one line (its first two lines: a regex error's detail is on the second)."""
    lines = [line.strip() for line in (message or "").replace("<non-verbose/>", "").splitlines() if line.strip()][:2]
    return printable(" ".join(lines).rstrip(".") or "unknown error")[:300]
