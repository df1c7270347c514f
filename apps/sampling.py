"""Sampling parameters, and the choice of each token: greedy, or libnpucrt's `npuc_sample`.

The C library does the choosing (npucrt/src/sample.c: the order of the filters, the
reproducible draw); this module holds a request's parameters, checks them through the
library's own `npuc_sampling_check` (so both sides refuse the same values with the same
words), and keeps what the penalties read: the prompt and the tokens chosen so far.

A seeded request's tokens depend only on its logits and its seed: the draw for output token
i is a hash of (seed, i). Without a seed, a request draws one from the OS.

Sampling needs libnpucrt: where it cannot be built (no C compiler, NPUC_NATIVE=0) plain
greedy decoding still works, and a request that sets any other sampling field is refused
with NPUC-E0160.
"""

from __future__ import annotations

import ctypes
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npuc.errors import EXIT_USAGE, NpucError

E_SAMPLING = "NPUC-E0160"


class _Sampling(ctypes.Structure):
    """include/npucrt.h's npuc_sampling."""

    _fields_ = [("struct_size", ctypes.c_uint32), ("temperature", ctypes.c_float), ("top_p", ctypes.c_float),
                ("top_k", ctypes.c_int32), ("min_p", ctypes.c_float), ("presence_penalty", ctypes.c_float),
                ("frequency_penalty", ctypes.c_float), ("repetition_penalty", ctypes.c_float),
                ("seed", ctypes.c_uint64), ("n_bias", ctypes.c_int32), ("bias_ids", ctypes.c_void_p),
                ("bias_values", ctypes.c_void_p), ("n_banned", ctypes.c_int32), ("banned", ctypes.c_void_p),
                ("n_allowed_words", ctypes.c_int64), ("allowed", ctypes.c_void_p)]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the choice of its tokens (docs/serving.md: each field's range)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = None  # llguidance's grammar (apps/structured.py) the output must match

    @property
    def plain(self) -> bool:
        """Every sampling field at its default: the plain argmax of the model's row, which
        needs no library (a greedy request with, say, top_k set goes through the library's
        checks and greedy choice, with the same result)."""
        return (self.temperature == 0 and self.top_p == 1 and self.top_k == 0 and self.min_p == 0
                and self.presence_penalty == 0 and self.frequency_penalty == 0 and self.repetition_penalty == 1
                and not self.logit_bias and self.min_tokens == 0 and self.grammar is None)


GREEDY = SamplingParams()


def _library() -> Any:
    from npuc.runtime.native_session import runtime_library

    return runtime_library()


def host_row(row: Any) -> np.ndarray:
    """A logits row as contiguous float32 numpy on the host: the C executor's arena view as
    it is, or the reference interpreter's torch tensor (a GPU's copied over: vocab x 4 bytes)."""
    if hasattr(row, "detach"):
        row = row.detach().float().cpu().numpy()
    return np.ascontiguousarray(row, dtype=np.float32)


def _field_error(message: str, hint: str) -> NpucError:
    return NpucError(E_SAMPLING, message, hint, exit_code=EXIT_USAGE)


def check(params: SamplingParams, vocab: int) -> None:
    """NPUC-E0160 naming the field (the message's first word) for a value out of its range."""
    if params.min_tokens < 0:
        raise _field_error(f"min_tokens is {params.min_tokens}", "min_tokens is 0 or above")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise _field_error(f"seed is {params.seed}", "seed is an integer in [0, 2^64)")
    for t in params.stop_token_ids:
        if not 0 <= t < vocab:
            raise _field_error(f"stop_token_ids names token id {t}; the vocabulary is 0..{vocab - 1}",
                               "stop_token_ids are token ids of the model")
    if params.plain:
        return
    TokenChooser(params, [], 1, vocab, ())  # the library's own check of every other field


class TokenChooser:
    """One request's choice of tokens: call it with each logits row, in order."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], max_new_tokens: int, vocab: int,
                 eos: Sequence[int] | frozenset[int], matcher: Any = None) -> None:
        self.params = params
        self.matcher = matcher  # apps/structured.Matcher where params.grammar is set
        self.n_out = 0
        self._out = np.zeros(max(max_new_tokens, 1), dtype=np.int64)
        if params.plain:
            self._lib = None
            return
        lib = _library()
        if lib is None:
            raise _field_error("sampling needs the native runtime library, which is not built here (no C compiler, "
                               "or NPUC_NATIVE=0)", "install a C compiler, or decode greedily (temperature 0)")
        self._lib = lib
        self._prompt = np.ascontiguousarray(np.asarray(list(prompt), dtype=np.int64))
        bias = sorted(params.logit_bias.items())
        self._bias_ids = np.array([int(k) for k, _ in bias], dtype=np.int64)
        self._bias_values = np.array([float(v) for _, v in bias], dtype=np.float32)
        # min_tokens: the end ids (and stop_token_ids) are never chosen before it
        self._banned = np.array(sorted({*eos, *params.stop_token_ids}), dtype=np.int64)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        c = self._c = _Sampling()
        c.struct_size = ctypes.sizeof(_Sampling)
        c.temperature, c.top_p, c.top_k, c.min_p = params.temperature, params.top_p, params.top_k, params.min_p
        c.presence_penalty, c.frequency_penalty = params.presence_penalty, params.frequency_penalty
        c.repetition_penalty, c.seed = params.repetition_penalty, seed
        c.n_bias, c.bias_ids, c.bias_values = len(bias), self._bias_ids.ctypes.data, self._bias_values.ctypes.data
        c.n_banned, c.banned = 0, self._banned.ctypes.data
        from npuc.runtime.native_session import _Error, _raise

        self._err = _Error()
        self._raise = _raise
        rc = lib.npuc_sampling_check(ctypes.byref(c), vocab, ctypes.byref(self._err))
        if rc:
            _raise(self._err, rc)
        self._work: np.ndarray | None = None  # npuc_sample's, on the first draw (check() makes none)
        self._token = ctypes.c_int64()
        self.vocab = vocab

    def _arm(self) -> Any:
        """The npuc_sampling for the next token: min_tokens' ban while it lasts."""
        self._c.n_banned = len(self._banned) if self.n_out < self.params.min_tokens else 0
        return self._c

    def processed(self, row: Any) -> Any:
        """The row after logit_bias, the banned ids and the penalties, at this point of the
        output (npuc_sampling_process): what temperature and the filters then read."""
        x = host_row(row)
        if self._lib is None:
            return x.copy()
        out = np.empty_like(x)
        rc = self._lib.npuc_sampling_process(x.ctypes.data, min(self.vocab, x.shape[-1]), ctypes.byref(self._arm()),
                                             self._prompt.ctypes.data, len(self._prompt), self._out.ctypes.data,
                                             self.n_out, out.ctypes.data, ctypes.byref(self._err))
        if rc:
            self._raise(self._err, rc)
        return out

    def __call__(self, row: Any) -> int:
        """The next token from this row of logits (numpy, or a torch tensor on any device; not
        modified)."""
        if self._lib is None:
            token = int(row.argmax())
        else:
            x = host_row(row)
            c = self._arm()
            if self._work is None:
                self._work = np.empty(self._lib.npuc_sample_work_bytes(self.vocab), dtype=np.uint8)
            if self.matcher is not None:  # the ids the grammar allows next
                mask = self.matcher.fill()
                c.n_allowed_words, c.allowed = len(mask), mask.ctypes.data
            rc = self._lib.npuc_sample(x.ctypes.data, min(self.vocab, x.shape[-1]), ctypes.byref(c),
                                       self._prompt.ctypes.data, len(self._prompt), self._out.ctypes.data,
                                       self.n_out, self._work.ctypes.data, self._work.nbytes,
                                       ctypes.byref(self._token), ctypes.byref(self._err))
            if rc:
                self._raise(self._err, rc)
            token = int(self._token.value)
            if self.matcher is not None:
                self.matcher.consume(token)
        self.record(token)
        return token

    def record(self, token: int) -> None:
        """`token` is the next output token (what the penalties and the next draw's index read)."""
        if self.n_out < len(self._out):
            self._out[self.n_out] = token
        self.n_out += 1

    def probabilities(self, row: Any) -> np.ndarray:
        """The distribution the next draw takes its token from (npuc_sample_probs): every id's
        probability after the penalties, temperature and filters."""
        assert self._lib is not None
        x = host_row(row)
        if self._work is None:
            self._work = np.empty(self._lib.npuc_sample_work_bytes(self.vocab), dtype=np.uint8)
        v = min(self.vocab, x.shape[-1])
        out = np.empty(v, dtype=np.float32)
        rc = _probs_function(self._lib)(x.ctypes.data, v, ctypes.byref(self._arm()), self._prompt.ctypes.data,
                                        len(self._prompt), self._out.ctypes.data, self.n_out, self._work.ctypes.data,
                                        self._work.nbytes, out.ctypes.data, ctypes.byref(self._err))
        if rc:
            self._raise(self._err, rc)
        return out


def _probs_function(lib: Any) -> Any:
    f = lib.npuc_sample_probs
    if f.argtypes is None:
        P = ctypes.c_void_p
        f.argtypes = [P, ctypes.c_int64, P, P, ctypes.c_int32, P, ctypes.c_int32, P, ctypes.c_size_t, P, P]
        f.restype = ctypes.c_int
    return f


def token_logprobs(row: Any, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """`token`'s log-probability in this row of logits (the model's log-softmax, before any
    sampling transform) and the `top` most likely ids with theirs, most likely first (ties:
    the lower id)."""
    x = host_row(row).astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, x.shape[-1])
        part = np.argpartition(-x, k - 1)[:k]
        order = sorted(part.tolist(), key=lambda i: (-x[i], i))
        best = tuple((int(i), float(x[i] - lse)) for i in order)
    return float(x[token] - lse), best
