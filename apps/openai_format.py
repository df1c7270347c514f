"""The parts of an OpenAI response that need the text, not the ids: stop strings over the
detokenized output, and the logprobs objects of completions and chat.

Stop strings (`stop`): the output ends at the first match of any of them, even one that
spans token boundaries; the match and everything after it are cut. A stream sends only the
text that can no longer become part of a match: a tail of the text that is a prefix of some
stop string is held back until the next token decides it (and a trailing U+FFFD, a
character whose bytes are not all decoded yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[list[int]], str]


class StopStrings:
    """Feed the whole text so far after each token; get back what may be sent, and whether
    a stop string matched."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of the text already released
        self.stopped = False

    def update(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        at = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if at >= 0:
            out = text[self.sent:at] if at > self.sent else ""
            self.sent = max(self.sent, at)
            self.stopped = True
            return out, True
        hold = 0
        for s in self.stops:  # the longest tail of the text that starts some stop string
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        end = len(text) - hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, False

    def flush(self, text: str) -> str:
        """What is still held back, once the output has ended without a match."""
        out = text[self.sent:] if not self.stopped else ""
        self.sent = len(text)
        return out


def token_text(decode: Decode | None, token: int) -> str:
    """One token as text (vLLM's `token_id:N` where the model holds no tokenizer)."""
    return decode([token]) if decode is not None else f"token_id:{token}"


def completion_logprobs(decode: Decode | None, tokens: Sequence[int], lps: Sequence[Any],
                        offset: int = 0) -> dict[str, Any]:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs ({text: lp}) and
    text_offset, for tokens whose (lp, top) are in lps (None for a prompt's first token)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = offset
    for t, lp in zip(tokens, lps, strict=True):
        s = token_text(decode, t)
        out["tokens"].append(s)
        out["text_offset"].append(at)
        at += len(s)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp[0])
        top: dict[str, float] = {}
        for i, v in lp[1]:
            top.setdefault(token_text(decode, i), v)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(decode: Decode | None, tokens: Sequence[int], lps: Sequence[Any]) -> dict[str, Any]:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def entry(t: int, v: float) -> dict[str, Any]:
        s = token_text(decode, t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp[0]), "top_logprobs": [entry(i, v) for i, v in lp[1]]}
                        for t, lp in zip(tokens, lps, strict=True)]}
