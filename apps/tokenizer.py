"""The tokenizer stored in a `.om`, without transformers: `tokenizers` runs tokenizer.json,
and jinja2 renders the chat template from tokenizer_config.json, as transformers' fast
tokenizers do (the same library underneath, the same template environment).

    encode(text)          tokenizer.json's pipeline with its special tokens (BOS, ...)
    decode(ids)           without the special tokens; spaces cleaned where the config says
    apply_chat_template   the config's template over the messages, then encode without
                          adding special tokens again (the template writes them)

A stored tokenizer without tokenizer.json (a slow, sentencepiece-only one) needs
transformers: `load` returns None and the caller uses transformers where it is installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class StoredTokenizer:
    def __init__(self, files: Mapping[str, bytes]) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        config: dict[str, Any] = {}
        if "tokenizer_config.json" in files:
            loaded = json.loads(files["tokenizer_config.json"])
            config = loaded if isinstance(loaded, dict) else {}
        template = config.get("chat_template")
        if template is None and "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode("utf-8")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self._clean = bool(config.get("clean_up_tokenization_spaces", False))

    def backend_json(self) -> str:
        """tokenizer.json as the tokenizers library serialises it (what llguidance reads)."""
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return _clean_up(text) if self._clean else text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: list[dict[str, Any]] | None = None) -> Any:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise ValueError("the stored tokenizer has no chat template")

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                       ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **{k: v for k, v in self._special.items() if v is not None})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load(files: Mapping[str, bytes]) -> StoredTokenizer | None:
    """The stored files as a StoredTokenizer; None where they need transformers (no
    tokenizer.json) or the tokenizers library is not installed."""
    if "tokenizer.json" not in files:
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    return StoredTokenizer(files)
