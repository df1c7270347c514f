"""Many sequences over the slots of a `.om`: in-flight batching with static shapes.

A model compiled with `--max_seq_len N --input_shape input_ids:B,S` caches B sequences, one
a slot (passes/kv_cache.py). Its prefill fills one slot, the one its `slot` input names,
from position 0; its decode runs one token of every slot, each at its own position
(`position` [B]). A model compiled at batch 1 is one slot, whose prefill takes no `slot`.

Each `step()`:
  1. admits queued requests into free slots: a prefill each, whose last row's logits give
     the request's first token (a prompt longer than the prefill sends the rest through
     decode, one token a step, as `generate` does);
  2. runs one decode step for all slots, and takes each active slot's next token;
  3. frees a slot whose request ended: at an end-of-sequence id (unless ignored), at its
     `max_new_tokens`, when its cache is full, or when cancelled.

A free slot still runs in the decode step (the shapes are static): token 0 at position 0 of
its own cache rows, which no request reads, since a prefill writes a slot's rows before any
query of its request can see them.

A model compiled with `--decode_tokens C` decodes C tokens of each slot a step. A request
admitted while other slots decode then skips the prefill: its prompt goes through the
decode steps C tokens at a time (chunked prefill), so the slots decoding never wait for a
whole prompt; a slot with fewer than C tokens to feed repeats its last one.

The feeds are buffers allocated once, so a step allocates nothing beyond what the
session's run does (nothing, for decode) and the tokens chosen. Greedy only: each request's tokens are the ones it gets decoded alone.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npuc.apps.generate import LAST_TOKEN, GenerationInfo, check_prompt, copy_row, generation_info
from npuc.errors import EXIT_USAGE, NpucError

SLOT = "slot"


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end of sequence), "length", "cache_full", "cancelled"
    slot: int = -1
    pos: int = 0  # the position the next fed token is written at
    feed: list[int] = field(default_factory=list)  # tokens to feed: the prompt's rest, then the last chosen


@dataclass(frozen=True)
class Event:
    """A token a request got in a step (None where it ended without one: cancelled), and
    why it ended after it, if it did. `logits`: the row it was chosen from, with keep_logits."""

    request: int
    token: int | None
    finish_reason: str | None = None
    logits: Any = None  # numpy (C executor) or torch (reference interpreter)


class Scheduler:
    def __init__(self, s: Any, keep_logits: bool = False) -> None:
        self.session = s
        self.info: GenerationInfo = generation_info(s)
        decode = s.programs["decode"]
        self._ids_name = self.info.ids_name
        self._pos_name = next(t.name for t in decode.inputs if t.name != self._ids_name)
        self.slots, self.tokens = next(t.shape for t in decode.inputs if t.name == self._ids_name)
        prefill_inputs = {t.name for t in s.programs["prefill"].inputs}
        self._slotted = SLOT in prefill_inputs
        if self.slots > 1 and not self._slotted:
            raise NpucError("NPUC-E0125", f"the model was compiled for batch {self.slots} by an npuc without "
                            "slots: its prefill fills every sequence at once", "recompile it", exit_code=EXIT_USAGE)
        self.keep_logits = keep_logits
        self._ids = np.zeros((self.slots, self.tokens), dtype=np.int64)
        self._pos = np.zeros((self.slots,) if self.tokens == 1 else (self.slots, self.tokens), dtype=np.int64)
        self._fed = [0] * self.slots  # tokens each slot feeds this step
        self._prompt = np.zeros((1, self.info.prefill_len), dtype=np.int64)
        self._last = np.zeros((1,), dtype=np.int64)
        self._slot = np.zeros((1,), dtype=np.int64)
        self._running: list[Request | None] = [None] * self.slots
        self._queue: deque[Request] = deque()
        self._ids_counter = itertools.count()
        self.requests: dict[int, Request] = {}

    # -- requests ------------------------------------------------------------------------------

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        """What `submit` refuses (NPUC-E0125): an empty prompt, one the cache cannot hold with a
        token after it, an id outside the vocabulary, or max_new_tokens < 1."""
        check_prompt(self.info, prompt)
        if max_new_tokens < 1:
            raise NpucError("NPUC-E0125", f"max_new_tokens is {max_new_tokens}", "ask for at least one token",
                            exit_code=EXIT_USAGE)

    def submit(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> int:
        prompt = [int(t) for t in prompt]
        self.check(prompt, max_new_tokens)
        r = Request(next(self._ids_counter), prompt, max_new_tokens, ignore_eos)
        self.requests[r.id] = r
        self._queue.append(r)
        return r.id

    def cancel(self, rid: int) -> bool:
        """End a request now (its slot is free for the next step); False if it had ended."""
        r = self.requests.get(rid)
        if r is None or r.finish_reason is not None:
            return False
        r.finish_reason = "cancelled"
        if r.slot >= 0:
            self._running[r.slot] = None
        else:
            self._queue.remove(r)
        return True

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._running)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        return not self._queue and not self.active

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        events: list[Event] = []
        for k in range(self.slots):
            if self._running[k] is None and self._queue:
                self._admit(self._queue.popleft(), k, events)
        if not self.active:
            return events
        c = self.tokens
        pos = self._pos.reshape(self.slots, c)
        for k, r in enumerate(self._running):
            # up to C tokens of the slot's feed; the rest of its C rows repeat the last (token,
            # position), which writes the same key and value again: a no-op on the cache
            n = min(c, len(r.feed)) if r is not None else 1
            for i in range(c):
                j = min(i, n - 1)
                self._ids[k, i] = r.feed[j] if r is not None else 0
                pos[k, i] = r.pos + j if r is not None else 0
            self._fed[k] = n
        logits = self.session.run({self._ids_name: self._ids, self._pos_name: self._pos}, "decode",
                                  copy_outputs=False)["logits"]
        for k, r in enumerate(self._running):
            if r is None:
                continue
            n = self._fed[k]
            del r.feed[:n]
            r.pos += n
            if not r.feed:
                self._choose(r, logits[k, n - 1 if logits.shape[1] == c else -1], events)
        return events

    def _admit(self, r: Request, k: int, events: list[Event]) -> None:
        info = self.info
        if self.tokens > 1 and self.active:
            # Slots are decoding: the prompt goes through the decode steps, C tokens a step,
            # rather than a prefill the decoding slots would wait for (chunked prefill).
            r.slot, r.pos, r.feed = k, 0, list(r.prompt)
            self._running[k] = r
            return
        n = min(len(r.prompt), info.prefill_len)
        self._prompt[:] = 0
        self._prompt[0, :n] = np.asarray(r.prompt[:n], dtype=np.int64)
        feeds = {info.ids_name: self._prompt}
        if info.last_token:
            self._last[0] = n - 1
            feeds[LAST_TOKEN] = self._last
        if self._slotted:
            self._slot[0] = k
            feeds[SLOT] = self._slot
        logits = self.session.run(feeds, "prefill", copy_outputs=False)["logits"][0, 0 if info.last_token else n - 1]
        r.slot, r.pos, r.feed = k, n, list(r.prompt[n:])
        self._running[k] = r
        if not r.feed:
            self._choose(r, logits, events)

    def _choose(self, r: Request, logits: Any, events: list[Event]) -> None:
        token = int(logits.argmax())
        r.tokens.append(token)
        if token in self.info.eos and not r.ignore_eos:
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.max_new_tokens:
            r.finish_reason = "length"
        elif r.pos >= self.info.max_seq_len:
            r.finish_reason = "cache_full"
        else:
            r.feed.append(token)
        if r.finish_reason is not None:
            self._running[r.slot] = None
        events.append(Event(r.id, token, r.finish_reason, copy_row(logits) if self.keep_logits else None))


def generate_many(s: Any, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False
                  ) -> list[list[int]]:
    """Greedy tokens for each prompt, decoded over the model's slots together."""
    sched = Scheduler(s)
    for p in prompts:
        sched.check(list(p), max_new_tokens)  # every prompt before any runs
    ids = [sched.submit(list(p), max_new_tokens, ignore_eos) for p in prompts]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids]
