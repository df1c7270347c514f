"""Sampling (apps/sampling.py over libnpucrt's npuc_sample, npucrt/src/sample.c).

- the empirical distribution of 20,000 draws from one row against softmax(logits / T) after
  transformers' own top-k, top-p and min-p warpers (a chi-square test);
- the filters on a large vocabulary (where the candidates are found by lowering a bound):
  every draw inside the set transformers keeps;
- the penalties against transformers' RepetitionPenaltyLogitsProcessor and OpenAI's formula;
- the range checks (NPUC-E0160 naming the field), in Python and on the command line;
- reproducibility: a seeded request's tokens alone, in slot 0 and in slot 3 beside three
  other requests, and through the C API's own decode loop (npuc_generate).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from npuc.apps.sampling import SamplingParams, TokenChooser, check
from npuc.apps.scheduler import Scheduler
from npuc.cli.main import main
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime.executor import open_session
from npuc.runtime.native_session import runtime_library
from tests.hf_models import GEN_MAX_SEQ, GEN_PREFILL

pytestmark = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")

DRAWS = 20_000


def _hf_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """softmax after transformers' warpers, in generate's order (temperature, top-k, top-p, min-p)."""
    x = torch.from_numpy(logits.astype(np.float32))[None]
    ids = torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return torch.softmax(x.double(), -1)[0].numpy()


def _draws(logits: np.ndarray, p: SamplingParams, n: int) -> np.ndarray:
    """n draws from one row: one request's tokens 0..n-1 (the draw index is the output's)."""
    ch = TokenChooser(p, [], n, len(logits), ())
    return np.array([ch(logits) for _ in range(n)])


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.15},
    {"temperature": 0.8, "top_k": 9, "top_p": 0.9, "min_p": 0.05},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_follow_the_filtered_softmax(kw: dict[str, Any]) -> None:
    logits = np.random.default_rng(0).normal(0, 1.5, 16).astype(np.float32)
    p = SamplingParams(seed=12345, **kw)
    want = _hf_probs(logits, p)
    got = np.bincount(_draws(logits, p, DRAWS), minlength=len(logits))
    assert not got[want == 0].any(), f"drew filtered ids: {np.nonzero(got * (want == 0))[0]}"
    kept = want > 0
    expected = want[kept] * DRAWS
    chi2 = float(((got[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert pvalue > 0.001, f"chi2 {chi2:.1f} on {df} degrees of freedom: p = {pvalue:.2e} ({got} vs {expected})"


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
                                {"temperature": 1.3, "top_p": 0.8}, {"temperature": 1.0, "min_p": 0.15}],
                         ids=["t1", "topk", "topp", "minp"])
def test_the_distribution_is_the_filtered_softmax(kw: dict[str, Any]) -> None:
    """npuc_sample_probs (TokenChooser.probabilities): the distribution the draws above follow,
    id for id (a drafted token is kept with its probability there)."""
    logits = np.random.default_rng(0).normal(0, 1.5, 16).astype(np.float32)
    p = SamplingParams(seed=1, **kw)
    got = TokenChooser(p, [], 1, len(logits), ()).probabilities(logits)
    np.testing.assert_allclose(got, _hf_probs(logits, p), atol=1e-6)


@pytest.mark.parametrize("kw", [{"top_p": 0.99}, {"top_k": 3000}, {"top_p": 0.99, "min_p": 0.0005}],
                         ids=["top_p", "top_k", "top_p+min_p"])
def test_large_vocabulary_filters_keep_transformers_set(kw: dict[str, Any]) -> None:
    """50,000 ids whose kept set reaches far below the largest probability (to about 2^-16
    of it): the bound the candidates are collected at (2^-8 first) must come down to it."""
    logits = np.random.default_rng(1).normal(0, 3.0, 50_000).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=9, **kw)
    want = _hf_probs(logits, p)
    kept = want > 0
    ratio = want[kept].min() / want.max()
    assert ratio < 2.0 ** -8  # the case that needs the bound lowered
    got = _draws(logits, p, 3000)
    assert kept[got].all(), f"drew ids outside transformers' kept set: {got[~kept[got]][:10]}"
    assert (want[got] / want.max() < 2.0 ** -8).any()  # draws from below the first bound


def test_greedy_is_the_argmax_and_temperature_zero_applies_penalties() -> None:
    logits = np.array([0.5, 3.0, 2.9, -1.0, np.nan, 0.0], dtype=np.float32)
    assert TokenChooser(SamplingParams(), [], 4, 6, ())(logits) == 4  # a NaN is the largest, as torch.argmax
    row = np.array([0.5, 3.0, 2.9, -1.0], dtype=np.float32)
    ch = TokenChooser(SamplingParams(repetition_penalty=1.2), [1], 4, 4, ())
    assert ch(row) == 2  # 3.0 / 1.2 = 2.5 < 2.9
    ch = TokenChooser(SamplingParams(logit_bias={3: 5.0}), [], 4, 4, ())
    assert ch(row) == 3


def test_penalties_match_the_references() -> None:
    rng = np.random.default_rng(3)
    V = 64
    logits = rng.normal(0, 2, V).astype(np.float32)
    prompt = [int(t) for t in rng.integers(0, V, 12)]
    out = [int(t) for t in rng.integers(0, V, 20)]
    p = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.25,
                       logit_bias={5: -100.0, 7: 3.5}, min_tokens=25, seed=1)
    ch = TokenChooser(p, prompt, 64, V, eos=(2,))
    for t in out:  # the output so far, as the chooser records it
        ch._out[ch.n_out] = t
        ch.n_out += 1
    got = ch.processed(logits)
    want = torch.from_numpy(logits.copy())[None]
    want[0, 5] += -100.0
    want[0, 7] += 3.5
    want[0, 2] = -float("inf")  # before min_tokens, the end id is never chosen
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + out]), want)[0].numpy()
    counts = np.bincount(out, minlength=V)
    want = want - counts * -0.25 - (counts > 0) * 0.4  # OpenAI's presence and frequency penalties
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    ch.n_out = 25  # min_tokens reached: the end id is back
    assert np.isfinite(ch.processed(logits)[2])


@pytest.mark.parametrize("field,value,hint", [
    ("temperature", -0.5, "0 (greedy) or above"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"),
    ("top_k", -1, "0 (off)"), ("min_p", 1.5, "[0, 1]"), ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3.0, "[-2, 2]"), ("repetition_penalty", 0.0, "above 0"), ("min_tokens", -1, "0 or above"),
    ("seed", -1, "[0, 2^64)"), ("logit_bias", {999: 1.0}, "token ids"), ("logit_bias", {3: 101.0}, "[-100, 100]"),
    ("stop_token_ids", (1000,), "token ids"), ("temperature", float("nan"), "0 (greedy)"),
])
def test_out_of_range_values_name_their_field(field: str, value: Any, hint: str) -> None:
    kw: dict[str, Any] = {"temperature": 1.0, field: value}
    with pytest.raises(NpucError) as e:
        check(SamplingParams(**kw), 500)
    assert e.value.code == "NPUC-E0160"
    assert e.value.message.split()[0] == field and hint in e.value.hint


@pytest.fixture(scope="module")
def slotted(hf_checkpoints: dict[str, Path], gen_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sampling")
    return {"one": gen_models["llama"],
            "four": Path(compile_model(str(hf_checkpoints["llama"]), input_shape=f"input_ids:4,{GEN_PREFILL}",
                                       max_seq_len=GEN_MAX_SEQ, output=str(root / "four")))}


PROMPT = [5, 9, 33, 7, 2, 81]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=2024)
OTHERS = [([3, 4, 5], SamplingParams(temperature=1.0, seed=1)), ([8] * 9, SamplingParams()),
          ([11, 12], SamplingParams(temperature=0.5, min_p=0.1))]  # the last one unseeded


def _run(om: Path, requests: list[tuple[list[int], SamplingParams]], new: int = 24) -> list[list[int]]:
    sched = Scheduler(open_session(str(om)))
    ids = [sched.submit(p, new, True, q) for p, q in requests]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids]


def test_a_seeded_request_gets_its_tokens_in_any_slot(slotted: dict[str, Path]) -> None:
    alone = _run(slotted["one"], [(PROMPT, SEEDED)])[0]
    assert _run(slotted["four"], [(PROMPT, SEEDED)])[0] == alone  # slot 0 of four
    assert _run(slotted["four"], [*OTHERS, (PROMPT, SEEDED)])[-1] == alone  # slot 3, beside three others
    assert _run(slotted["four"], [(PROMPT, SEEDED), (PROMPT, SEEDED)]) == [alone, alone]
    # and it is sampled: another seed gives other tokens, temperature 0 the greedy ones
    assert _run(slotted["one"], [(PROMPT, SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                            repetition_penalty=1.1, seed=2025))])[0] != alone
    assert _run(slotted["one"], [(PROMPT, SamplingParams())])[0] != alone


def test_min_tokens_and_stop_token_ids(slotted: dict[str, Path]) -> None:
    sess = open_session(str(slotted["one"]))
    sched = Scheduler(sess)
    eos = min(sched.info.eos)
    favour = SamplingParams(temperature=1.0, seed=3, logit_bias={eos: 100.0}, min_tokens=3)
    rid = sched.submit(PROMPT, 10, sampling=favour)
    while not sched.idle:
        sched.step()
    r = sched.requests[rid]
    assert eos not in r.tokens[:3] and r.tokens[3:] == [eos] and r.finish_reason == "stop"
    stop = SamplingParams(temperature=1.0, seed=3, logit_bias={77: 100.0}, stop_token_ids=(77,))
    rid = sched.submit(PROMPT, 10, ignore_eos=True, sampling=stop)
    while not sched.idle:
        sched.step()
    assert sched.requests[rid].tokens == [77] and sched.requests[rid].finish_reason == "stop"


def test_the_c_decode_loop_samples_as_the_scheduler(slotted: dict[str, Path]) -> None:
    """npuc_generate with each sequence's npuc_sampling: the scheduler's tokens, over 4 slots."""
    from npuc.runtime.native_session import NativeSession, _Error, _raise
    from npuc.runtime.native_session import _Sequence as Seq

    requests = [*OTHERS[:2], (PROMPT, SEEDED), ([40, 41, 42], SamplingParams(temperature=1.2, top_k=7, seed=77))]
    want = _run(slotted["four"], requests, new=16)
    s = NativeSession(str(slotted["four"]))
    keep: list[Any] = []
    seqs = (Seq * len(requests))()
    for q, (p, params) in enumerate(requests):
        ch = TokenChooser(params, p, 16, 1 << 20, ())  # its npuc_sampling, as the scheduler's chooser fills it
        pa, out = (ctypes.c_int64 * len(p))(*p), (ctypes.c_int64 * 16)()
        keep += [pa, out, ch]
        seqs[q] = Seq(pa, len(p), 16, 1, out, 0, 0, ctypes.addressof(ch._c) if not params.plain else None)
    err = _Error()
    rc = s.lib.npuc_generate(s._session, ctypes.cast(seqs, ctypes.c_void_p), len(requests), None, None,
                             ctypes.byref(err))
    if rc:
        _raise(err, rc)
    got = [[int(seqs[q].out_tokens[i]) for i in range(seqs[q].n_out)] for q in range(len(requests))]
    assert got == want


def test_generate_command_samples_reproducibly(slotted: dict[str, Path]) -> None:
    args = ["generate", str(slotted["one"]), "--prompt-ids", "5,9,33", "--max-new-tokens", "12", "--ignore-eos",
            "--temperature", "0.8", "--top-p", "0.9"]
    a = CliRunner().invoke(main, [*args, "--seed", "5"])
    b = CliRunner().invoke(main, [*args, "--seed", "5"])
    c = CliRunner().invoke(main, [*args, "--seed", "6"])
    assert a.exit_code == 0, a.output
    assert a.output == b.output != c.output
    bad = CliRunner().invoke(main, [*args, "--top-k", "-2"])
    assert bad.exit_code == 2 and "NPUC-E0160" in bad.output and "top_k is -2" in bad.output


@pytest.mark.parametrize("executor", ["native", "torch"])
def test_n_continuations_share_one_prefill(slotted: dict[str, Path], executor: str) -> None:
    """n = 3 of one prompt: one prefill, its slot copied into two others; continuation i is
    what a single request seeded S + i gets alone."""
    from npuc.runtime import Session

    sess = open_session(str(slotted["four"])) if executor == "native" else Session.load(str(slotted["four"]))
    prefills = []
    run = sess.run

    def counting(inputs: Any, program: Any = None, copy_outputs: bool = True) -> Any:
        prefills.append(program == "prefill")
        return run(inputs, program, copy_outputs)

    sess.run = counting  # type: ignore[method-assign]
    sched = Scheduler(sess)
    other = sched.submit([3, 4, 5], 20, True, SamplingParams(temperature=1.0, seed=5))
    ids = sched.submit_many(PROMPT, 3, 16, True, SEEDED)
    while not sched.idle:
        sched.step()
    assert sum(prefills) == 2  # the other request's and the group's one
    alone = [_run(slotted["one"], [(PROMPT, SamplingParams(**{**SEEDED.__dict__, "seed": 2024 + i}))], 16)[0]
             for i in range(3)]
    assert [sched.requests[i].tokens for i in ids] == alone
    assert sched.requests[other].tokens == _run(slotted["one"], [([3, 4, 5], SamplingParams(temperature=1.0, seed=5))],
                                                20)[0]
    assert len({tuple(t) for t in alone}) == 3  # three different samples


def test_a_group_waits_for_its_slots_and_cancels_cleanly(slotted: dict[str, Path]) -> None:
    sched = Scheduler(open_session(str(slotted["four"])))
    busy = [sched.submit([3, 4], 30, True) for _ in range(2)]
    group = sched.submit_many(PROMPT, 3, 4, True, SEEDED)  # 3 slots, 2 free: it waits
    sched.step()
    assert [sched.requests[i].slot for i in group] == [-1, -1, -1]
    sched.cancel(group[0])  # the queued leader: its siblings go on as a group of two
    sched.step()
    assert all(sched.requests[i].slot >= 0 for i in group[1:])
    while not sched.idle:
        sched.step()
    assert [len(sched.requests[i].tokens) for i in group] == [0, 4, 4]
    assert all(len(sched.requests[i].tokens) == 30 for i in busy)
    with pytest.raises(NpucError) as e:
        sched.submit_many(PROMPT, 5, 4)
    assert e.value.code == "NPUC-E0125" and "4 slot" in e.value.message
