"""Speculative decoding: guess a few tokens cheaply, check them in one step.

Decode reads every weight once per step, whatever the rows, so a step of K + 1 rows costs
little more than a step of one on a host bound by memory bandwidth. A model compiled with
`--speculative_tokens K` has a third program, `verify`: the decode step at K + 1 tokens of
each slot, every row's logits. A slot feeds its last token and up to K drafted ones; row i's
logits choose the token after row i's. The drafts are checked in order: while the token
chosen from row i equals draft i + 1, that draft is already in the cache at the right
position and row i + 1's logits are valid too. The first token that differs (or the token
after the last draft) ends the step. A step thus yields 1 to K + 1 tokens, each chosen from
the logits a plain decode would have computed for it.

- Greedy (and any temperature-0 choice): the token chosen is the argmax, as without drafts,
  so the output is the same token for token (up to the rounding of a K + 1-row product
  against a one-row one: the tests compare).
- Sampled: the token is the request's own seeded draw from row i (TokenChooser, as a plain
  step draws it: the same uniform number, the token's index in the output), and a draft is
  kept while it equals it. Every drafter here proposes a point mass (one token), so a draft is
  kept with probability p(draft), as rejection sampling keeps it, and the output is plain
  decode's draws token for token: a seeded request's tokens do not depend on speculation or
  on when the scheduler chose to verify.

Rollback is free: a rejected draft's key and value stay in the cache past the slot's position,
where no query reads them (each row attends to positions up to its own), and the next step
writes over them. A model with recurrent state, whose state a rejected draft has advanced,
keeps its states after each verify row (passes/recurrent_state.py): the scheduler copies a
slot's back from its last kept row (Session.rollback), one state a layer whatever the
sequence's length, and pads a slot's rows at the positions after its last.

Drafters:
- n-gram (prompt lookup): the sequence's own tokens. The last n tokens (n from `ngram_max`
  down to `ngram_min`) are looked up at their latest earlier occurrence, and the tokens that
  followed it are the draft. Free, and right wherever the output copies its input.
- a draft model (`--draft small.om`, apps/draft_model.py): a small `.om` of the same
  vocabulary, as many slots, decodes each drafting slot's next tokens greedily, all slots in
  one step of its decode program; its cost is weighed with verify's.
- MTP (apps/mtp_draft.py): the model's own multi-token-prediction layer, compiled into the
  same `.om` with `--mtp`, chained on the main model's hidden states; weighed as a draft
  model is.

The scheduler (apps/scheduler.py) runs `verify` only when it pays: it keeps each request's
acceptance rate (also measured on steps without drafts checked, from what the drafter would
have proposed) and both programs' step times, and runs verify when the expected tokens per
second beat plain decode's. On text the drafts do not predict, speculation so switches
itself off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from npuc.errors import EXIT_USAGE, NpucError

VERIFY = "verify"  # the program --speculative_tokens compiles (compiler/flag_checks.py)
METHODS = ("auto", "ngram", "draft", "mtp", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the scheduler drafts: `method` "ngram" (prompt lookup), "draft" (a draft model's
    `.om`: apps/draft_model.py), "mtp" (the model's own multi-token-prediction layer:
    apps/mtp_draft.py), "auto" (mtp where the `.om` has it, else ngram) or "off"; `tokens`: drafted
    tokens a step, at most the verify program's K (None: K); n-grams of `ngram_min` to
    `ngram_max` tokens; `min_gain`: the expected speed-up below which a step runs plain decode."""

    method: str = "auto"
    tokens: int | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    min_gain: float = 1.0

    def check(self) -> None:
        if self.method not in METHODS:
            raise NpucError("NPUC-E0162", f"speculative method {self.method!r} is not one of "
                            + ", ".join(METHODS), "use auto, ngram, draft, mtp or off", exit_code=EXIT_USAGE)
        if self.tokens is not None and not 1 <= self.tokens <= 64:
            raise NpucError("NPUC-E0162", f"speculative tokens {self.tokens} is not from 1 to 64",
                            "give the drafted tokens a step checks", exit_code=EXIT_USAGE)
        if not 1 <= self.ngram_min <= self.ngram_max <= 32:
            raise NpucError("NPUC-E0162", f"n-gram sizes {self.ngram_min}..{self.ngram_max} are not 1 <= min <= "
                            "max <= 32", "e.g. --ngram-min 2 --ngram-max 4", exit_code=EXIT_USAGE)


class NgramIndex:
    """A sequence's n-grams (n_min to n_max tokens), each mapped to the index of the token
    after its latest occurrence that has one. Extended as tokens arrive: O(n_max) a token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._at: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for t in tokens:
            seq.append(t)
            end = len(seq) - 1  # the n-grams ending just before the new token now have a follower
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._at[tuple(seq[end - n:end])] = end

    def draft(self, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix found
        (none where no suffix of n_min tokens occurred before). Where that occurrence is less
        than k tokens back, the copy runs on into its own tokens: a repeating stretch is
        drafted as repeating on."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = self._at.get(tuple(seq[end - n:]))
            if at is not None:
                out: list[int] = []
                for i in range(k):
                    j = at + i
                    out.append(seq[j] if j < end else out[j - end])
                return out
        return []


@dataclass
class RequestSpeculation:
    """One request's drafter and acceptance record."""

    index: NgramIndex
    alpha: float = 0.7  # the estimated chance that a draft token is accepted (moving average)
    shadow: list[int] = field(default_factory=list)  # a draft proposed on a step that ran plain decode
    drafted: int = 0
    accepted: int = 0

    def observe(self, accepted: bool) -> None:
        self.alpha += 0.15 * ((1.0 if accepted else 0.0) - self.alpha)

    def expected(self, k: int) -> float:
        """Expected accepted tokens of a k-token draft: each in turn while all before it were."""
        a, total, p = self.alpha, 0.0, 1.0
        for _ in range(k):
            p *= a
            total += p
        return total


@dataclass
class SpeculationStats:
    """What /metrics and `npuc generate --stats` report."""

    steps: int = 0  # decode steps run (either program)
    verify_steps: int = 0
    drafted: int = 0  # draft tokens checked
    accepted: int = 0
    tokens: int = 0  # tokens the steps produced (chosen from their logits)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "verify_steps": self.verify_steps, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted, "acceptance_rate": round(self.acceptance, 4),
                "tokens": self.tokens, "tokens_per_step": round(self.tokens_per_step, 4)}


def cost_average(old: float | None, seconds: float) -> float:
    """A moving average of a step's cost that follows a faster step at once (rate 0.5) and a
    slower one slowly (0.2): a program's time is a floor plus the host's spikes, and its first
    runs, still touching their memory, are the slow ones."""
    if old is None:
        return seconds
    return old + (0.5 if seconds < old else 0.2) * (seconds - old)


class StepTimes:
    """Moving averages of the two programs' step times (cost_average), which decide whether
    verify pays. A program's first WARM_RUNS runs (which touch its arena and pack its weights,
    and run slow for a step or two more) are not counted; the scheduler drafts nothing until
    decode's time is known (a drafter's cost is counted in decode steps)."""

    WARM_RUNS = 2

    # Plain steps with drafts after which verify is run again to re-measure it, whatever the
    # estimate says (a stale or unlucky measurement must not switch speculation off for good);
    # doubled after each probe that does not switch it back on, up to PROBE_MOST (a draft
    # model's probe first catches up on every token since the last: probes that keep failing
    # must not cost a share of the steps), and back at PROBE_EVERY once verify pays again or
    # a request is admitted
    PROBE_EVERY = 64
    PROBE_MOST = 1024

    def __init__(self) -> None:
        self.decode: float | None = None
        self.verify: float | None = None
        self._ran: dict[str, int] = {}
        self.since_verify = 0
        self.probe_every = self.PROBE_EVERY
        self._probed = False  # the last step was a probe

    def probe_due(self) -> bool:
        return self.since_verify >= self.probe_every

    def chose(self, verify: bool, probe: bool) -> None:
        """The plan of a step with drafts: verify or not, and whether only as a probe."""
        if verify and not probe:
            self.probe_every = self.PROBE_EVERY
        elif not verify and self._probed:
            self.probe_every = min(2 * self.probe_every, self.PROBE_MOST)
        self._probed = verify and probe

    def admitted(self) -> None:
        self.probe_every = self.PROBE_EVERY

    def add(self, program: str, seconds: float) -> None:
        self.since_verify = 0 if program == VERIFY else self.since_verify + 1
        self._ran[program] = self._ran.get(program, 0) + 1
        if self._ran[program] <= self.WARM_RUNS:
            return
        old = self.verify if program == VERIFY else self.decode
        new = cost_average(old, seconds)
        if program == VERIFY:
            self.verify = new
        else:
            self.decode = new

    def ratio(self) -> float:
        """verify's step time over decode's (a guess of 1.5 until both ran)."""
        if self.decode is None or self.verify is None or self.decode <= 0:
            return 1.5
        return self.verify / self.decode

