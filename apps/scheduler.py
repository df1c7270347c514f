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

A model compiled with `--mixed_tokens C` has a `mixed` program of B + C rows (B the slots),
each row of its own slot at its own position. A request admitted while other slots decode
then skips the prefill: each step runs one row for every decoding slot and the prompt's next
tokens in the rows left (a mixed step), so the slots decoding wait for C prompt rows a step,
not for a whole prefill; once no prompt is being fed, steps are plain decode again.

A model compiled with `--decode_tokens C` decodes C tokens of each slot a step. A request
admitted while other slots decode then skips the prefill: its prompt goes through the
decode steps C tokens at a time (chunked prefill), so the slots decoding never wait for a
whole prompt; a slot with fewer than C tokens to feed repeats its last one.

The feeds are buffers allocated once, so a step allocates nothing beyond what the
session's run does (nothing, for decode) and the tokens chosen. Each request's tokens are
the ones it gets decoded alone: greedy, or sampled under its own parameters
(apps/sampling.py), whose draws depend on its seed and its logits only.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from npuc.apps.draft_model import DraftModel
from npuc.apps.generate import (
    SLOT,
    GenerationInfo,
    check_prompt,
    copy_row,
    generation_info,
    logits_f32,
    prefill_feeds,
    program_rows,
)
from npuc.apps.mtp_draft import HIDDEN, MTPDrafter, has_mtp
from npuc.apps.prefix_cache import PrefixBook
from npuc.apps.sampling import GREEDY, SamplingParams, TokenChooser, token_logprobs
from npuc.apps.speculative import (
    VERIFY,
    NgramIndex,
    RequestSpeculation,
    SpeculationStats,
    SpeculativeConfig,
    StepTimes,
    cost_average,
)
from npuc.errors import EXIT_USAGE, NpucError

MIXED = "mixed"  # the program --mixed_tokens compiles (compiler/flag_checks.py)


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    chooser: TokenChooser | None = None
    logprobs: int = -1  # the chosen token's log-probability and this many alternatives; -1: none
    prompt_logprobs: bool = False  # each prompt token's (after the first), under `logprobs` alternatives
    prompt_lp: list[Any] = field(default_factory=list)
    siblings: list[Request] = field(default_factory=list)  # the other continuations of this prompt (n > 1)
    leader: Request | None = None  # a sibling's: the request whose prefill it shares
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (end of sequence), "length", "cache_full", "cancelled"
    slot: int = -1
    pos: int = 0  # the position the next fed token is written at
    feed: list[int] = field(default_factory=list)  # tokens to feed: the prompt's rest, then the last chosen
    spec: RequestSpeculation | None = None  # its drafter, where the model has a verify program


@dataclass(frozen=True)
class Event:
    """A token a request got in a step (None where it ended without one: cancelled), and
    why it ended after it, if it did. `logits`: the row it was chosen from, with keep_logits."""

    request: int
    token: int | None
    finish_reason: str | None = None
    logits: Any = None  # numpy (C executor) or torch (reference interpreter)
    logprobs: Any = None  # (the token's log-probability, ((id, log-probability), ...) the most likely)
    prompt_logprobs: Any = None  # with the request's first event: [None, (lp, top), ...] per prompt token


class Scheduler:
    def __init__(self, s: Any, keep_logits: bool = False, speculative: SpeculativeConfig | None = None,
                 draft: Any | None = None) -> None:
        self.session = s
        self.info: GenerationInfo = generation_info(s)
        decode = s.programs["decode"]
        self._ids_name = self.info.ids_name
        self._pos_name = next(t.name for t in decode.inputs if t.name != self._ids_name)
        self.slots, self.tokens = next(t.shape for t in decode.inputs if t.name == self._ids_name)
        logits_out = next((t for t in decode.outputs if t.name == "logits"), None)
        self._decode_rows = logits_out.shape[1] if logits_out is not None and len(logits_out.shape) == 3 else 1
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
        self._grammar_tokenizer: Any = None  # apps/structured.GrammarTokenizer, built on first need
        # Speculative decoding (apps/speculative.py): where the model has a verify program
        self.speculative = speculative or SpeculativeConfig()
        self.speculative.check()
        self.stats = SpeculationStats()
        self._times = StepTimes()
        self._vrows = program_rows(s, VERIFY, self._ids_name)
        # verify also feeds a prompt's rest K + 1 tokens a step (after a prefix hit), drafts or not.
        # A recurrent model's verify keeps its states after each row: a slot whose rows were not
        # all kept has its states rolled back to its last kept row (Session.rollback)
        self._rollback = self.info.rollback
        self._can_verify = self._vrows > 1 and (not self.info.recurrent or self._rollback)
        method = self.speculative.method
        if method == "auto":  # the model's own MTP layer where it has one, else n-grams
            method = "mtp" if has_mtp(s) else "ngram"
        self._spec_on = self._can_verify and method != "off"
        self._k = min(self.speculative.tokens or self._vrows - 1, self._vrows - 1)
        self._vids = np.zeros((self.slots, self._vrows), dtype=np.int64)
        self._vpos = np.zeros((self.slots, self._vrows), dtype=np.int64)
        self._drafts: dict[int, list[int]] = {}
        # A draft model (apps/draft_model.py) where the method is "draft": its session, checked
        self._draft: DraftModel | MTPDrafter | None = None
        self._draft_time: float | None = None  # seconds of drafting a verify step (moving average)
        self._drafted = False  # a proposal was made (the first is not timed)
        # The model's own MTP layer (apps/mtp_draft.py) where the method is "mtp": it keeps the
        # hidden states each step returns
        self._mtp: MTPDrafter | None = None
        if method == "mtp" and (self._spec_on or not has_mtp(s)):  # (refused without one)
            self._mtp = MTPDrafter(s, self.slots, int(getattr(s, "prefix_entries", 0) or 0))
            self._draft = self._mtp
        if method == "draft":
            if draft is None:
                raise NpucError("NPUC-E0163", "--speculative draft needs a draft model",
                                "give --draft small.om (a model of the same vocabulary)", exit_code=EXIT_USAGE)
            if self._spec_on:
                self._draft = DraftModel(draft, self.slots, self.info.vocab, self.info.max_seq_len)
        # The mixed step: where the model has one (and no recurrent state, which only a prefill resets)
        self._mrows = program_rows(s, MIXED, self._ids_name)
        self._mixed_on = bool(self._mrows) and self._slotted and not self.info.recurrent
        self._mids = np.zeros((1, self._mrows), dtype=np.int64)
        self._mpos = np.zeros((1, self._mrows), dtype=np.int64)
        self._mslot = np.zeros((self._mrows,), dtype=np.int64)
        self._mix_admitted = False
        # Prefix reuse (apps/prefix_cache.py): where the model has a prefix pool
        entries = int(getattr(s, "prefix_entries", 0) or 0)
        self.prefixes = PrefixBook(entries) if entries and not self.info.recurrent else None

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the model's stored tokenizer (NPUC-E0126 without one)."""
        if self._grammar_tokenizer is None:
            from npuc.apps.generate import load_tokenizer_object
            from npuc.apps.structured import GrammarTokenizer

            self._grammar_tokenizer = GrammarTokenizer(load_tokenizer_object(self.session), self.info.vocab,
                                                       self.info.eos)
        return self._grammar_tokenizer

    # -- requests ------------------------------------------------------------------------------

    def check(self, prompt: list[int], max_new_tokens: int, prompt_logprobs: bool = False) -> None:
        """What `submit` refuses (NPUC-E0125): an empty prompt, one the cache cannot hold with a
        token after it, an id outside the vocabulary, or max_new_tokens < 1 (0 is allowed with
        prompt_logprobs: the prompt scored, nothing generated)."""
        check_prompt(self.info, prompt)
        if prompt_logprobs and self.info.last_token and self.info.recurrent:
            # scoring the prompt would feed it through the decode steps, from a slot whose
            # recurrent state only a prefill resets
            raise NpucError("NPUC-E0125", "prompt log-probabilities of a model with recurrent layers need every "
                            "prompt row's logits from its prefill", "recompile with --prefill_logits all",
                            exit_code=EXIT_USAGE)
        if max_new_tokens < (0 if prompt_logprobs else 1):
            raise NpucError("NPUC-E0125", f"max_new_tokens is {max_new_tokens}", "ask for at least one token",
                            exit_code=EXIT_USAGE)

    def submit(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False,
               sampling: SamplingParams = GREEDY, logprobs: int = -1, prompt_logprobs: bool = False) -> int:
        """Queue a request. logprobs >= 0: each token's log-probability (the model's
        log-softmax, before any sampling transform) and that many most likely alternatives;
        prompt_logprobs: the same for each prompt token after the first."""
        return self.submit_many(prompt, 1, max_new_tokens, ignore_eos, sampling, logprobs, prompt_logprobs)[0]

    def submit_many(self, prompt: list[int], n: int, max_new_tokens: int, ignore_eos: bool = False,
                    sampling: SamplingParams = GREEDY, logprobs: int = -1, prompt_logprobs: bool = False
                    ) -> list[int]:
        """n continuations of one prompt (OpenAI's `n`): admitted together into n slots, one
        prefill whose slot is then copied into the others. With a seed S, continuation i draws
        with seed S + i: the tokens a single request seeded S + i gets."""
        prompt = [int(t) for t in prompt]
        self.check(prompt, max_new_tokens, prompt_logprobs)
        if not 1 <= n <= self.slots:
            raise NpucError("NPUC-E0125", f"{n} continuations of one prompt; the model has {self.slots} slot(s)",
                            f"ask for 1 to {self.slots}, or compile more slots (--input_shape input_ids:N,S)",
                            exit_code=EXIT_USAGE)
        if sampling.grammar is not None:
            self.grammar_tokenizer().check(sampling.grammar)
        group: list[Request] = []
        for i in range(n):
            q = sampling if sampling.seed is None or i == 0 else replace(sampling, seed=(sampling.seed + i) % 2**64)
            matcher = self.grammar_tokenizer().matcher(q.grammar) if q.grammar is not None else None
            chooser = TokenChooser(q, prompt, max_new_tokens, self.info.vocab, self.info.eos, matcher)
            r = Request(next(self._ids_counter), prompt, max_new_tokens, ignore_eos, chooser, logprobs,
                        prompt_logprobs, leader=group[0] if group else None)
            if self._spec_on and matcher is None:
                r.spec = RequestSpeculation(NgramIndex(self.speculative.ngram_min, self.speculative.ngram_max))
                r.spec.index.extend(prompt)
            self.requests[r.id] = r
            group.append(r)
        group[0].siblings = group[1:]
        self._queue.append(group[0])
        return [r.id for r in group]

    def cancel(self, rid: int) -> bool:
        """End a request now (its slot is free for the next step); False if it had ended."""
        r = self.requests.get(rid)
        if r is None or r.finish_reason is not None:
            return False
        r.finish_reason = "cancelled"
        if r.slot >= 0:
            self._running[r.slot] = None
        elif r.leader is not None:  # waits with its leader: it will not be admitted
            r.leader.siblings.remove(r)
        else:  # a queued leader: its waiting siblings take its place
            i = self._queue.index(r)
            if r.siblings:
                heir, *rest = r.siblings
                heir.leader, heir.siblings = None, rest
                for q in rest:
                    q.leader = heir
                self._queue[i] = heir
            else:
                del self._queue[i]
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
        free = [k for k in range(self.slots) if self._running[k] is None]
        # Prompts go through mixed steps where slots streamed tokens before this step (what a
        # mixed step keeps steady) and this step admits one request: several admitted at once
        # (a burst) are prefilled, since feeding them one after another, C tokens a step, would
        # run many steps of few rows (a burst's throughput), while a prefill delays the streaming
        # slots once.
        self._mix_admitted = (any(r is not None and r.tokens for r in self._running)
                              and not (len(self._queue) > 1 and len(free) > 1))
        while self._queue and len(free) > len(self._queue[0].siblings):  # in order: a group waits for its slots
            lead = self._queue.popleft()
            taken, free = free[:1 + len(lead.siblings)], free[1 + len(lead.siblings):]
            self._admit(lead, taken[0], events, taken[1:])
        if not self.active:
            return events
        if self._mixed_on and any(r is not None and len(r.feed) > 1 for r in self._running):
            self._mixed_step(events)
            return events
        program = self._plan()
        c = self._vrows if program == VERIFY else self.tokens
        ids, pos_in = (self._vids, self._vpos) if program == VERIFY else (self._ids, self._pos)
        pos = pos_in.reshape(self.slots, c)
        for k, r in enumerate(self._running):
            # up to C tokens of the slot's feed (and its drafts, on a verify step); the rest of
            # its C rows repeat the last (token, position), which writes the same key and value
            # again: a no-op on the cache. A prompt scored through decode steps that give only
            # their last row goes 1 a step.
            n = min(c, len(r.feed)) if r is not None else 1
            if r is not None and r.prompt_logprobs and self._decode_rows != c and r.pos < len(r.prompt) \
                    and program != VERIFY:
                n = 1
            seq = [*r.feed[:n], *self._drafts.get(k, ())] if r is not None else [0]
            # (a recurrent model's rows past its last go on to the next positions: they advance
            # the states, which the rollback undoes, and at the last's position they would write
            # over its key and value with ones computed from the advanced states)
            ahead = self._rollback and program == VERIFY
            for i in range(c):
                j = min(i, len(seq) - 1)
                ids[k, i] = seq[j]
                pos[k, i] = 0 if r is None else min(r.pos + i, self.info.max_seq_len - 1) if ahead else r.pos + j
            self._fed[k] = n
        start = time.perf_counter()
        ran = {k: (r, r.pos) for k, r in enumerate(self._running) if r is not None}
        out = self.session.run({self._ids_name: ids, self._pos_name: pos_in}, program, copy_outputs=False)
        logits = logits_f32(out["logits"])
        if self._mtp is not None:
            for k, r in enumerate(self._running):
                if r is not None:
                    self._mtp.record(k, pos[k], out[HIDDEN][k])
        self._times.add(program, time.perf_counter() - start)
        self.stats.steps += 1
        self.stats.verify_steps += program == VERIFY
        every_row = logits.shape[1] == c
        for k, r in enumerate(self._running):
            if r is None:
                continue
            n = self._fed[k]
            if not self._advance(r, n, logits[k], every_row):
                continue
            before = len(r.tokens)
            drafts = self._drafts.get(k)
            if drafts:
                self._check_drafts(r, logits[k], drafts, events)
            else:
                self._choose(r, logits[k, n - 1 if every_row else -1], events)
            self.stats.tokens += len(r.tokens) - before
        self._drafts.clear()
        if program == VERIFY and self._rollback:
            for k, (r, at) in ran.items():  # rows 0..kept-1 are the sequence's, the rest undone
                if self._running[k] is r and r.pos - at < c:
                    self.session.rollback(k, r.pos - at - 1)
        return events

    def _mixed_step(self, events: list[Event]) -> None:
        """One step of the mixed program: a row for each decoding slot, then the prompts being
        fed, as many of their tokens as the rows left hold; the rows after repeat the last
        (token, position, slot), which writes the same key and value again."""
        rows: list[tuple[int, int, int]] = []  # (slot, token, position)
        fed: dict[int, list[int]] = {}  # slot -> the rows it fed
        for phase in (0, 1):  # the decoding slots first: none of them waits for a prompt
            for k, r in enumerate(self._running):
                if r is None or (len(r.feed) > 1) != bool(phase):
                    continue
                n = min(len(r.feed), self._mrows - len(rows))
                if n <= 0:
                    continue
                fed[k] = list(range(len(rows), len(rows) + n))
                rows += [(k, r.feed[i], r.pos + i) for i in range(n)]
        for i in range(self._mrows):
            k, token, pos = rows[min(i, len(rows) - 1)]
            self._mids[0, i], self._mpos[0, i], self._mslot[i] = token, pos, k
        out = self.session.run({self._ids_name: self._mids, self._pos_name: self._mpos, SLOT: self._mslot}, MIXED,
                               copy_outputs=False)
        logits = logits_f32(out["logits"])[0]
        self.stats.steps += 1
        if self._mtp is not None:
            for k, at in fed.items():
                self._mtp.record(k, self._mpos[0, at], out[HIDDEN][0, at])
        for k, at in fed.items():
            r = self._running[k]
            assert r is not None
            if self._advance(r, len(at), logits[at[0]:at[-1] + 1], True):
                before = len(r.tokens)
                self._choose(r, logits[at[-1]], events)
                self.stats.tokens += len(r.tokens) - before

    @staticmethod
    def _advance(r: Request, n: int, rows: Any, every_row: bool) -> bool:
        """Request r's next n fed tokens ran, `rows` the logits after each (`every_row`), else
        after the last only: the prompt tokens they score (row i the one after the token fed
        at r.pos + i) and r's place moved on. Whether its feed is done (the last row gives its
        next token)."""
        if r.prompt_logprobs:
            for i in range(n):
                if r.pos + i + 1 < len(r.prompt):
                    row = rows[i if every_row else -1]
                    r.prompt_lp.append(token_logprobs(row, r.prompt[r.pos + i + 1], r.logprobs))
        del r.feed[:n]
        r.pos += n
        return not r.feed

    def _plan(self) -> str:
        """The program of this step: verify (with each decoding slot's drafts in self._drafts)
        where it is expected to give more tokens a second than plain decode, else decode."""
        if not self._can_verify:
            return "decode"
        info, k_max = self.info, self._k
        calibrating = self._times.decode is None  # no drafts before plain decode's cost is measured
        plain = speculated = 0.0
        drafts: dict[int, list[int]] = {}
        wants: dict[int, tuple[Request, int]] = {}  # a drafter's (draft model, MTP): each slot's request and room
        for k, r in enumerate(self._running):
            if r is None:
                continue
            if len(r.feed) != 1 or r.spec is None or not self._spec_on or calibrating or (
                    r.prompt_logprobs and r.pos < len(r.prompt)):
                plain += min(self.tokens, len(r.feed))  # a prompt's tokens fed a step
                speculated += min(self._vrows, len(r.feed))
                continue
            room = min(k_max, r.max_new_tokens - len(r.tokens) - 1, info.max_seq_len - 1 - r.pos)
            if self._draft is not None:  # drafted below, once verify is chosen: expect a full draft
                plain += 1
                if room > 0:
                    wants[k] = (r, room)
                    speculated += 1 + r.spec.expected(room)
                else:
                    speculated += 1
                continue
            d = r.spec.index.draft(room) if room > 0 else []
            plain += 1
            speculated += 1 + (r.spec.expected(len(d)) if d else 0.0)
            if d:
                drafts[k] = d
        probe = bool(drafts or wants) and self._times.probe_due()
        ratio = self._times.ratio()
        if self._draft is not None and self._draft_time is not None and self._times.decode:
            # drafting's cost, in decode steps (nothing is drafted before decode is timed)
            ratio += self._draft_time / self._times.decode
        pays = speculated > plain and speculated / ratio >= plain * self.speculative.min_gain
        if drafts or wants:
            self._times.chose(pays or probe, not pays)
        if not pays and not probe:
            for k, d in drafts.items():  # checked against the token the step chooses (acceptance)
                spec = self._running[k].spec  # type: ignore[union-attr]
                assert spec is not None
                spec.shadow = d[:1]
            return "decode"
        if self._draft is not None:
            start = time.perf_counter()
            seqs = {k: ([*r.prompt, *r.tokens], room) for k, (r, room) in wants.items()}
            drafts = {k: d for k, d in self._draft.propose(seqs).items() if d}
            # a drafter's catch-up on a whole prompt is paid once a request, not each step; its
            # first proposal (its programs' first runs) is not counted, as a program's first step
            took = time.perf_counter() - start - getattr(self._draft, "prefill_seconds", 0.0)
            if self._drafted:
                self._draft_time = cost_average(self._draft_time, took)
            self._drafted = True
            if not drafts:
                return "decode"
        self._drafts = drafts
        return VERIFY

    def _check_drafts(self, r: Request, rows: Any, drafts: list[int], events: list[Event]) -> None:
        """Row 0 chose the token after the slot's last; row i + 1's logits hold while the token
        row i chose is draft i (fed at the next position). Stops at the first that is not, or
        where the request ends."""
        spec = r.spec
        assert spec is not None
        for i in range(len(drafts) + 1):
            draft = drafts[i] if i < len(drafts) else None
            self._choose(r, rows[i], events)
            if r.finish_reason is not None or draft is None:
                return
            self.stats.drafted += 1
            spec.drafted += 1
            ok = r.tokens[-1] == draft
            spec.observe(ok)
            if not ok:
                return
            self.stats.accepted += 1
            spec.accepted += 1
            r.feed.pop()  # the draft is in the cache at r.pos already (row i + 1 fed it)
            r.pos += 1

    def _admit(self, r: Request, k: int, events: list[Event], sibling_slots: list[int] | None = None) -> None:
        info = self.info
        group = list(zip([r, *r.siblings], [k, *(sibling_slots or [])], strict=True))
        self._times.admitted()  # a new request's drafts may pay: probes at their first rate
        if self._draft is not None:
            for q, kq in group:
                if q.spec is not None:
                    self._draft.admit(kq, q.prompt)
        scored = r.prompt_logprobs and (info.last_token or self._decode_rows != self.tokens)
        chunked = (self.tokens > 1 and self.active) or (self._mixed_on and self._mix_admitted)
        if (chunked and not scored and not r.siblings) or (r.prompt_logprobs and info.last_token):
            # Slots are decoding: the prompt goes through the mixed steps (or the decode steps, C
            # tokens a step), rather than a prefill the decoding slots would wait for. (Mixed
            # steps only where a slot streamed before this step: requests admitted together,
            # whose first tokens nobody waits between, are prefilled: that costs no latency and
            # keeps a burst's throughput.) A
            # prompt to score whose prefill keeps only its last row of logits goes that way
            # too: each step's rows score the prompt tokens after the ones fed (each of a group
            # its own: the one case where a group's prompt runs more than once).
            for q, kq in group:
                q.slot, q.pos, q.feed = kq, 0, list(q.prompt)
                self._running[kq] = q
            return
        if self.prefixes is not None and not r.siblings and not r.prompt_logprobs:
            # the rest goes K + 1 (or C) tokens a step: at most 8 steps of it, else a prefill
            entry, m = self.prefixes.match(r.prompt, 8 * (self._vrows if self._can_verify else self.tokens))
            if entry >= 0:  # its first m positions from the pool; the rest through the steps
                self.session.load_prefix(entry, k, m)
                if self._mtp is not None:
                    self._mtp.loaded(entry, k, m)
                r.slot, r.pos, r.feed = k, m, list(r.prompt[m:])
                self._running[k] = r
                return
        feeds, n = prefill_feeds(info, r.prompt, (self._prompt, self._last, self._slot), k if self._slotted else None)
        out = self.session.run(feeds, "prefill", copy_outputs=False)
        rows = logits_f32(out["logits"][0])
        if self._mtp is not None:
            self._mtp.record(k, np.arange(n), out[HIDDEN][0, :n])
        if self.prefixes is not None and (entry := self.prefixes.place(r.prompt[:n])) >= 0:
            self.session.save_prefix(k, entry, n)
            if self._mtp is not None:
                self._mtp.saved(k, entry, n)
        logits = rows[0 if info.last_token else n - 1]
        if r.prompt_logprobs:  # row i scores prompt token i + 1
            r.prompt_lp = [token_logprobs(rows[i], r.prompt[i + 1], r.logprobs) for i in range(min(n, len(r.prompt) - 1))]
        for q, kq in group:  # the others continue from a copy of this slot: one prefill for all
            if kq != k:
                self.session.copy_slot(k, kq)
                if self._mtp is not None:
                    self._mtp.copied(k, kq)
            q.slot, q.pos, q.feed, q.prompt_lp = kq, n, list(q.prompt[n:]), list(r.prompt_lp)
            self._running[kq] = q
        for q, _ in group:
            if not q.feed:
                self._choose(q, logits, events)

    def _choose(self, r: Request, logits: Any, events: list[Event]) -> None:
        first = not r.tokens
        prompt_lp = [None, *r.prompt_lp] if r.prompt_logprobs and first else None
        if r.max_new_tokens == 0:  # the prompt scored, nothing generated
            r.finish_reason = "length"
            self._running[r.slot] = None
            events.append(Event(r.id, None, r.finish_reason, prompt_logprobs=prompt_lp))
            return
        if r.chooser is None:
            token = int(logits.argmax())
        else:
            token = r.chooser(logits)
        r.tokens.append(token)
        if r.spec is not None:
            r.spec.index.extend([token])
            if r.spec.shadow:  # the draft a plain step did not check: was it right?
                r.spec.observe(token == r.spec.shadow[0])
                r.spec.shadow = []
        constrained = r.chooser is not None and r.chooser.matcher is not None
        if (token in self.info.eos and (not r.ignore_eos or constrained)) or (
                r.chooser is not None and token in r.chooser.params.stop_token_ids):
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.max_new_tokens:
            r.finish_reason = "length"
        elif r.pos >= self.info.max_seq_len:
            r.finish_reason = "cache_full"
        else:
            r.feed.append(token)
        if r.finish_reason is not None:
            self._running[r.slot] = None
        events.append(Event(r.id, token, r.finish_reason, copy_row(logits) if self.keep_logits else None,
                            token_logprobs(logits, token, r.logprobs) if r.logprobs >= 0 else None, prompt_lp))


def generate_many(s: Any, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = False,
                  sampling: SamplingParams = GREEDY, speculative: SpeculativeConfig | None = None,
                  stats: SpeculationStats | None = None, draft: Any | None = None) -> list[list[int]]:
    """The tokens of each prompt (greedy, or sampled under the same parameters: with a seed S,
    prompt i draws with seed S + i, so that two equal prompts get their own samples),
    decoded over the model's slots together. `speculative`: how to draft where the model has a
    verify program (with `draft`, a draft model's session, for its method "draft"); `stats`
    receives the steps' counts."""
    sched = Scheduler(s, speculative=speculative, draft=draft)
    if stats is not None:
        sched.stats = stats
    for p in prompts:
        sched.check(list(p), max_new_tokens)  # every prompt before any runs
    seeded = [sampling if sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % 2**64)
              for i in range(len(prompts))]
    ids = [sched.submit(list(p), max_new_tokens, ignore_eos, q) for p, q in zip(prompts, seeded, strict=True)]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids]
