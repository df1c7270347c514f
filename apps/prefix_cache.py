"""Prefix reuse across requests: which prompt each entry of the `.om`'s prefix pool holds.

A model compiled with `--prefix_cache P` keeps P prompt prefixes' KV in its state region
(backend/lower.py; the runtime's save_prefix/load_prefix copy n positions between a slot and
an entry). This is the scheduler's book of them:

- after a prefill, the prompt's prefilled tokens are saved into an entry: the one already
  holding a prefix of them, else the least recently used;
- a new prompt is matched token by token against every entry (the longest common prefix,
  not blocks): a match of at least `min_tokens` loads those positions into the request's
  slot, and only the rest of the prompt goes through the decode steps (the verify program's
  K + 1 tokens a step, where the model has one). A prompt that differs inside an entry's
  prefix reuses the positions before the difference only: KV at a position depends on the
  tokens up to it alone (causal attention), so the answer is the one a miss gives.

At least one prompt token is always fed (its logits give the first new token), so a prompt
equal to an entry reuses all but its last position.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0


class PrefixBook:
    """The pool's P entries: each one's tokens (None: empty) and when it was last used."""

    def __init__(self, entries: int, min_tokens: int = 16) -> None:
        self.tokens: list[tuple[int, ...] | None] = [None] * entries
        self._used = [0] * entries
        self._clock = 0
        self.min_tokens = min_tokens
        self.stats = PrefixStats()

    def _touch(self, entry: int) -> None:
        self._clock += 1
        self._used[entry] = self._clock

    def match(self, prompt: list[int], max_rest: int) -> tuple[int, int]:
        """(entry, positions to load) for the entry sharing the longest prefix with `prompt`
        (at most len(prompt) - 1 positions), or (-1, 0) where none shares min_tokens or more
        than `max_rest` tokens would be left to feed through the steps (a prefill is then
        faster). Counts the hit or miss."""
        best, most = -1, 0
        for e, held in enumerate(self.tokens):
            if held is None:
                continue
            n, limit = 0, min(len(held), len(prompt) - 1)
            while n < limit and held[n] == prompt[n]:
                n += 1
            if n > most:
                best, most = e, n
        if best < 0 or most < self.min_tokens or len(prompt) - most > max_rest:
            self.stats.misses += 1
            return -1, 0
        self.stats.hits += 1
        self.stats.tokens_saved += most
        self._touch(best)
        return best, most

    def place(self, tokens: list[int]) -> int:
        """The entry to save these prefilled tokens into (-1: too short to keep): one whose
        prefix they extend or repeat, else an empty one, else the least recently used."""
        if len(tokens) < self.min_tokens:
            return -1
        key = tuple(tokens)
        if any(held is not None and held[:len(key)] == key for held in self.tokens):
            return -1  # an entry holds these already (and maybe more)
        entry = next((e for e, held in enumerate(self.tokens) if held is not None and key[:len(held)] == held), -1)
        if entry < 0:
            entry = min(range(len(self.tokens)), key=lambda e: (self.tokens[e] is not None, self._used[e]))
        self.tokens[entry] = key
        self._touch(entry)
        return entry
