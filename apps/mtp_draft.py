"""Drafting with the model's own multi-token-prediction layer: `--speculative mtp` on a `.om`
compiled with `--mtp` (compiler/mtp.py; apps/speculative.py).

The MTP layer's row at position p reads token p + 1 and the main model's hidden state at p,
and guesses token p + 2; its output hidden state chains on to the next guess. So the main
programs return their hidden state (`hidden`), and the drafter keeps every slot's by position
(`record`: a [slots, max_seq_len, H] array, allocated once). When a slot drafts, the sequence
holds tokens 0..N-1, the last not yet fed to the main model: hidden states 0..N-2 are known,
and the MTP cache is brought up to them (catch-up rows: token p + 1 with hidden p), whose
last row guesses token N, the first draft. Each draft is fed next with the MTP's own hidden
output of the row before it, guessing the one after it.

Which positions of a slot's MTP cache hold rows computed from the main model's hidden states
is tracked as the tokens they were computed from (`_seq[k]`: tokens 0..m for m such rows), so
nothing is rolled back: rows from drafted tokens (computed from the MTP's own hidden state)
are never counted, and the next catch-up writes over them. Catch-up runs K + 1 rows of every
slot a step (`mtp_verify`) while some slot has more than one to feed, else one (`mtp`). A slot
that is not drafting writes its row at its first position not counted (token 0, a zero hidden
state): nothing reads it before a catch-up writes it again.

Nothing runs at a request's admission: where a slot first drafts (or after a long stretch
without drafts) with more rows to catch up on than one `mtp_verify` step feeds, one
`mtp_prefill` computes its rows 0..S-1 from the recorded hidden states (S the prefill's
length), and the steps the rest. A request whose speculation never pays so never runs the
layer. For a prefix loaded from the pool (apps/prefix_cache.py) the drafter keeps a copy of
each saved entry's hidden states (`saved`, `loaded`); the rows are recomputed from them.

Drafts are the layer's argmax: a point mass, so the target's check (its own greedy choice or
seeded draw, which a draft is kept while it equals: apps/speculative.py) leaves its output
unchanged.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from npuc.apps.draft_model import common_prefix
from npuc.apps.generate import SLOT, generation_info, logits_f32, program_rows
from npuc.errors import EXIT_USAGE, NpucError

MTP_PREFILL, MTP_DECODE, MTP_VERIFY = "mtp_prefill", "mtp", "mtp_verify"  # compiler/mtp.py
HIDDEN, MTP_HIDDEN = "hidden", "mtp_hidden"


def has_mtp(s: Any) -> bool:
    programs = s.programs
    return all(p in programs for p in (MTP_PREFILL, MTP_DECODE, MTP_VERIFY))


def _f32(x: Any) -> np.ndarray:
    x = logits_f32(x)
    return np.asarray(x.float().numpy() if hasattr(x, "numpy") else x, dtype=np.float32)


class MTPDrafter:
    """The MTP programs of session `s`, which has `slots` slots and `prefix_entries` pool entries."""

    def __init__(self, s: Any, slots: int, prefix_entries: int = 0) -> None:
        if not has_mtp(s):
            raise NpucError("NPUC-E0163", "--speculative mtp: the model has no multi-token-prediction programs",
                            "compile it with --mtp (and --speculative_tokens K)", exit_code=EXIT_USAGE)
        self.session = s
        self.info = info = generation_info(s)
        decode = s.programs[MTP_DECODE]
        self._pos_name = next(t.name for t in decode.inputs if t.name not in (info.ids_name, HIDDEN))
        width = next(int(t.shape[-1]) for t in decode.inputs if t.name == HIDDEN)
        self._vrows = program_rows(s, MTP_VERIFY, info.ids_name)
        self._plen = program_rows(s, MTP_PREFILL, info.ids_name)
        self._slotted = SLOT in {t.name for t in s.programs[MTP_PREFILL].inputs}
        want = {MTP_DECODE: (slots, 1), MTP_VERIFY: (slots, self._vrows), MTP_PREFILL: (1, self._plen)}
        for name, (b, rows) in want.items():
            shapes = {t.name: tuple(int(d) for d in t.shape) for t in s.programs[name].inputs}
            if shapes.get(info.ids_name) != (b, rows) or shapes.get(HIDDEN) != (b, rows, width) or rows < 1:
                raise NpucError("NPUC-E0163", f"--speculative mtp: the model's {name} program takes {shapes}, "
                                f"not {b} x {rows} token ids and hidden states of {width}",
                                "recompile the model with --mtp", exit_code=EXIT_USAGE)
        self.slots, n = slots, info.max_seq_len
        self.hidden = np.zeros((slots, n, width), dtype=np.float32)  # the main model's, by slot and position
        self._pool = np.zeros((prefix_entries, n, width), dtype=np.float32)
        self._seq: list[list[int]] = [[] for _ in range(slots)]  # tokens 0..m: m rows from main hidden states
        self._bufs = {rows: (np.zeros((slots, rows), dtype=np.int64), np.zeros((slots, rows), dtype=np.int64),
                             np.zeros((slots, rows, width), dtype=np.float32)) for rows in (1, self._vrows)}
        self._pids = np.zeros((1, self._plen), dtype=np.int64)
        self._ph = np.zeros((1, self._plen, width), dtype=np.float32)
        self._pslot = np.zeros((1,), dtype=np.int64)
        self.prefill_seconds = 0.0

    # -- what the main model computed ----------------------------------------------------------

    def record(self, k: int, positions: Any, rows: Any) -> None:
        """The main model's hidden states `rows` [n, H] of slot k at `positions` [n]."""
        self.hidden[k, np.asarray(positions, dtype=np.int64)] = _f32(rows)

    def admit(self, k: int, prompt: list[int]) -> None:
        """A new request in slot k: what its cache holds stays counted as far as the prompt agrees."""
        del self._seq[k][common_prefix(self._seq[k], prompt):]

    def _prefill(self, k: int, seq: list[int], m: int) -> None:
        """Slot k's MTP rows 0..m-1 (m <= the prefill's length) in one `mtp_prefill`, from the
        sequence's tokens 1..m and the hidden states recorded at 0..m-1."""
        self._pids[:] = 0
        self._pids[0, :m] = seq[1:m + 1]
        self._ph[:] = 0
        self._ph[0, :m] = self.hidden[k, :m]
        feeds = {self.info.ids_name: self._pids, HIDDEN: self._ph}
        if self._slotted:
            self._pslot[0] = k
            feeds[SLOT] = self._pslot
        start = time.perf_counter()
        self.session.run(feeds, MTP_PREFILL, copy_outputs=False)
        self.prefill_seconds += time.perf_counter() - start

    def copied(self, src: int, dst: int) -> None:
        """The runtime copied slot src's states into dst (copy_slot)."""
        self.hidden[dst] = self.hidden[src]
        self._seq[dst] = list(self._seq[src])

    def saved(self, k: int, entry: int, n: int) -> None:
        """The runtime saved slot k's first n positions as pool entry `entry`."""
        if entry < len(self._pool):
            self._pool[entry, :n] = self.hidden[k, :n]

    def loaded(self, entry: int, k: int, m: int) -> None:
        """The runtime loaded pool entry `entry`'s first m positions into slot k: their hidden
        states come from the drafter's copy; the MTP rows are recomputed from them when the
        slot first drafts (the pool's copy of the MTP cache is not counted on)."""
        self._seq[k] = []
        if entry < len(self._pool):
            self.hidden[k, :m] = self._pool[entry, :m]

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """For each slot k in `wants`, (its sequence, n): n tokens drafted after the sequence."""
        # (token, position, hidden or None: the MTP's own output of the row before) to feed
        self.prefill_seconds = 0.0  # of this call: a once-a-request cost the scheduler does not weigh
        pending: dict[int, list[tuple[int, int, Any]]] = {}
        drafts: dict[int, list[int]] = {k: [] for k in wants}
        for k, (seq, _) in wants.items():
            rows = len(seq) - 1  # positions 0..N-2: token p + 1 with hidden state p
            keep = max(min(common_prefix(self._seq[k], seq) - 1, rows - 1), 0)  # the last row is always fed
            if rows - keep > self._vrows and keep < self._plen:  # a prompt, or a long stretch without drafts
                m = min(rows, self._plen)
                self._prefill(k, seq, m)
                keep = min(m, rows - 1)
            self._seq[k] = list(seq[:rows + 1])  # counted once fed below
            pending[k] = [(seq[p + 1], p, self.hidden[k, p]) for p in range(keep, rows)]
        while any(pending.values()):
            rows = self._vrows if self._vrows > 1 and any(len(q) > 1 for q in pending.values()) else 1
            ids, pos, hid = self._bufs[rows]
            program = MTP_VERIFY if rows > 1 else MTP_DECODE
            fed: dict[int, int] = {}
            for k in range(self.slots):
                take = pending.get(k, [])[:rows]
                if take:
                    del pending[k][:rows]
                    fed[k] = len(take) - 1
                else:  # its first position not counted: nothing reads it before a catch-up writes it
                    at = min(max(len(self._seq[k]) - 1, 0), self.info.max_seq_len - 1)
                    del self._seq[k][at + 1:]
                    take = [(0, at, None)]
                for i in range(rows):
                    token, p, h = take[min(i, len(take) - 1)]
                    ids[k, i], pos[k, i] = token, p
                    hid[k, i] = 0 if h is None else h
            pos_in = pos.reshape(self.slots) if rows == 1 else pos
            out = self.session.run({self.info.ids_name: ids, HIDDEN: hid, self._pos_name: pos_in}, program,
                                   copy_outputs=False)
            logits = logits_f32(out["logits"])
            chain = _f32(out[MTP_HIDDEN])
            for k, row in fed.items():
                if not pending[k] and len(drafts[k]) < wants[k][1]:
                    token = int(logits[k].reshape(-1, logits.shape[-1])[row].argmax())
                    drafts[k].append(token)
                    if len(drafts[k]) < wants[k][1]:  # fed next, on this row's hidden output
                        pending[k].append((token, int(pos[k, row]) + 1, chain[k, row].copy()))
        return drafts

