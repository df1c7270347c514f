"""Drafting with a small model of the same vocabulary: `--draft small.om` (apps/speculative.py).

The draft `.om` is compiled like the target (`--max_seq_len` at least the target's, the same
number of slots, `--decode_tokens 1`), so each of its slots caches one of the target's
sequences. `propose` drafts for many slots at once: every step of the draft's decode program
feeds one token of each drafting slot. A slot first catches up on the tokens of its sequence
that its cache lacks (the target's last accepted tokens; usually one or two), then feeds each
token it drafts to get the next, greedily. A slot that is not drafting feeds its last cached
token at its own position again, which rewrites the same key and value (as the scheduler's
idle rows do). A draft compiled with `--speculative_tokens K'` too catches up through its
`verify` program, K' + 1 tokens of each slot a step (the rows a slot does not fill repeat its
last one): after a stretch of plain decode (speculation switched off, then probed again),
the tokens its cache missed cost a step per K' + 1, not a step each.

What a slot's cache holds is tracked as tokens (`_seq`), so nothing is rolled back: a draft
the target rejected stays in the cache past the common prefix of `_seq` and the sequence,
where the next catch-up writes over it. A prompt is prefilled into the draft's slot when the
target admits it (`admit`); a slot whose cache already holds a prefix of the new prompt
(the request before it in that slot shared it) keeps it.

Drafts are the draft model's argmax: a point mass, so the target's check (its own greedy
choice or seeded draw, which a draft is kept while it equals: apps/speculative.py) leaves its
output unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from npuc.apps.generate import SLOT, generation_info, logits_f32, prefill_feeds, program_rows
from npuc.apps.speculative import VERIFY
from npuc.errors import EXIT_USAGE, NpucError


def _refuse(why: str, hint: str) -> NpucError:
    return NpucError("NPUC-E0163", f"--draft: {why}", hint, exit_code=EXIT_USAGE)


class DraftModel:
    """The draft `.om`'s session `s`, checked against the target's `slots`, `vocab` and
    `max_seq_len`."""

    def __init__(self, s: Any, slots: int, vocab: int, max_seq_len: int) -> None:
        self.session = s
        self.info = info = generation_info(s)
        if info.recurrent:
            raise _refuse("the draft model keeps recurrent state, which a rejected draft would leave advanced",
                          "draft with an attention-only model")
        if info.vocab != vocab:
            raise _refuse(f"the draft model's vocabulary has {info.vocab} tokens, the target's {vocab}",
                          "draft with a model of the same tokenizer")
        if info.max_seq_len < max_seq_len:
            raise _refuse(f"the draft model caches {info.max_seq_len} positions, the target {max_seq_len}",
                          f"compile the draft with --max_seq_len {max_seq_len} or more")
        decode = s.programs["decode"]
        ids = next(t for t in decode.inputs if t.name == info.ids_name)
        if tuple(ids.shape) != (slots, 1):
            raise _refuse(f"the draft model decodes {list(ids.shape)} tokens a step, the target has {slots} slots "
                          "of one", f"compile the draft with --input_shape {info.ids_name}:{slots},S and "
                          "--decode_tokens 1")
        self._pos_name = next(t.name for t in decode.inputs if t.name != info.ids_name)
        self._vrows = program_rows(s, VERIFY, info.ids_name)  # 0: no verify program
        self._vids = np.zeros((slots, self._vrows), dtype=np.int64)
        self._vpos = np.zeros((slots, self._vrows), dtype=np.int64)
        self._slotted = SLOT in {t.name for t in s.programs["prefill"].inputs}
        self.slots = slots
        self._seq: list[list[int]] = [[] for _ in range(slots)]  # the tokens slot k's cache holds, from 0
        self._ids = np.zeros((slots, 1), dtype=np.int64)
        self._pos = np.zeros((slots,), dtype=np.int64)
        self._prompt = np.zeros((1, info.prefill_len), dtype=np.int64)
        self._last = np.zeros((1,), dtype=np.int64)
        self._slot = np.zeros((1,), dtype=np.int64)

    def admit(self, k: int, prompt: list[int]) -> None:
        """Prefill slot k with the prompt's head (the rest is caught up on when drafting),
        unless its cache already holds at least as much of it."""
        n = min(len(prompt), self.info.prefill_len)
        if common_prefix(self._seq[k], prompt) >= n:
            return
        feeds, n = prefill_feeds(self.info, prompt, (self._prompt, self._last, self._slot), k if self._slotted else None)
        self.session.run(feeds, "prefill", copy_outputs=False)
        self._seq[k] = list(prompt[:n])

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """For each slot k in `wants`, (its sequence, n): n tokens drafted after the sequence."""
        pending: dict[int, list[int]] = {}
        drafts: dict[int, list[int]] = {k: [] for k in wants}
        for k, (seq, _) in wants.items():
            keep = min(common_prefix(self._seq[k], seq), len(seq) - 1)  # the last token is always fed: its logits
            del self._seq[k][keep:]
            pending[k] = list(seq[keep:])
        while any(pending.values()):
            # several tokens of a slot a step (verify) while one has more than one to catch up on
            rows = self._vrows if self._vrows > 1 and any(len(q) > 1 for q in pending.values()) else 1
            program, ids, pos_in = (VERIFY, self._vids, self._vpos) if rows > 1 else ("decode", self._ids, self._pos)
            pos = pos_in.reshape(self.slots, rows)
            fed: dict[int, int] = {}  # slot -> the row of its last token fed
            for k in range(self.slots):
                held = self._seq[k]
                if pending.get(k):
                    take = pending[k][:rows]
                    del pending[k][:rows]
                    fed[k] = len(take) - 1
                elif held:
                    take = [held.pop()]  # rewritten where it is: the same key and value
                else:
                    take = [0]
                for i in range(rows):
                    j = min(i, len(take) - 1)
                    ids[k, i], pos[k, i] = take[j], len(held) + j
                held.extend(take)
            out = self.session.run({self.info.ids_name: ids, self._pos_name: pos_in}, program, copy_outputs=False)
            logits = logits_f32(out["logits"])
            for k, row in fed.items():
                if not pending[k] and len(drafts[k]) < wants[k][1]:
                    token = int(logits[k].reshape(-1, logits.shape[-1])[row].argmax())
                    drafts[k].append(token)
                    if len(drafts[k]) < wants[k][1]:
                        pending[k].append(token)  # fed next, for the draft after it
        return drafts


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the prefix a and b share."""
    return len(os.path.commonprefix([a, b]))  # works on any sequences
