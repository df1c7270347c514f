"""Structured output: a grammar constrains each token through a token mask that
llguidance computes (`pip install 'npuc[structured]'`), which libnpucrt's sampler applies
(npuc_sampling.allowed) before the penalties, the temperature and the filters.

Why llguidance and not xgrammar: both are well kept and fast; llguidance is a Rust library
with no Python dependencies, while xgrammar requires torch, transformers and triton, and
`npuc serve` must run without torch (docs/serving.md).

A grammar comes from a JSON schema (`response_format`), any JSON object (`json_object`), a
regular expression, a Lark grammar, or a choice among strings (vLLM's `structured_outputs`);
`grammar_for` turns each into llguidance's form and checks it against the model's
tokenizer, so that a bad schema is a 400 naming the field, never an error mid-stream. Once
the grammar is complete the mask allows only the end-of-sequence ids, so a constrained
request ends there (`finish_reason: "stop"`) even with `ignore_eos`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from npuc.errors import EXIT_USAGE, NpucError

E_GRAMMAR = "NPUC-E0161"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise NpucError(E_GRAMMAR, "structured output needs llguidance, which is not installed",
                        "pip install 'npuc[structured]'", exit_code=EXIT_USAGE) from None
    return llguidance


def grammar_for(kind: str, spec: Any) -> str:
    """llguidance's grammar for a constraint: kind is json_schema (spec: the schema),
    json_object, regex, lark or choice (spec: a list of strings). NPUC-E0161 for a spec of
    the wrong type; the grammar itself is checked by GrammarTokenizer.check."""
    lg = _llguidance()
    try:
        if kind == "json_object":
            return str(lg.LLMatcher.grammar_from_json_schema({"type": "object"}))
        if kind == "json_schema":
            if not isinstance(spec, dict | bool):
                raise ValueError("a JSON schema is an object")
            return str(lg.LLMatcher.grammar_from_json_schema(spec))
        if kind == "regex":
            if not isinstance(spec, str):
                raise ValueError("a regular expression is a string")
            return str(lg.LLMatcher.grammar_from_regex(spec))
        if kind == "lark":
            if not isinstance(spec, str):
                raise ValueError("a Lark grammar is a string")
            return str(lg.LLMatcher.grammar_from_lark(spec))
        if kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
                raise ValueError("a choice is a non-empty list of strings")
            return str(lg.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in spec)))
    except ValueError as e:
        raise NpucError(E_GRAMMAR, f"{kind}: {e}", "see docs/serving.md, structured output",
                        exit_code=EXIT_USAGE) from None
    raise NpucError(E_GRAMMAR, f"unknown constraint {kind!r}", "json_schema, json_object, regex, lark or choice",
                    exit_code=EXIT_USAGE)


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer (built once: about a second for a large
    vocabulary), and the matchers of the requests."""

    def __init__(self, tokenizer: Any, vocab: int, eos: Any) -> None:
        lg = _llguidance()
        eos_ids = sorted(int(t) for t in eos)
        if not eos_ids:
            raise NpucError(E_GRAMMAR, "structured output needs an end-of-sequence id, and the model has none",
                            "compile it from a folder whose config names eos_token_id", exit_code=EXIT_USAGE)
        backend = getattr(tokenizer, "backend_json", None)
        text = backend() if backend is not None else tokenizer.backend_tokenizer.to_str()
        self.vocab = vocab
        self._lg = lg
        self.tok = lg.LLTokenizer(text, n_vocab=vocab, eos_token=eos_ids)

    def check(self, grammar: str) -> None:
        """NPUC-E0161 with llguidance's reason where the grammar does not compile."""
        is_error, messages = self._lg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise NpucError(E_GRAMMAR, f"the grammar does not compile: {messages[0] if messages else ''}"[:500],
                            "check the schema, regular expression or grammar", exit_code=EXIT_USAGE)

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(self._lg.LLMatcher(self.tok, grammar, log_level=0), self.vocab)


class Matcher:
    """One request's place in its grammar: the mask of the ids allowed next, then the id
    chosen."""

    def __init__(self, m: Any, vocab: int) -> None:
        self._m = m
        self.mask = np.zeros((vocab + 31) // 32, dtype=np.uint32)

    def fill(self) -> np.ndarray:
        self._m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def consume(self, token: int) -> None:
        self._m.consume_token(token)
