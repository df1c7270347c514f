"""Speculative decoding (apps/speculative.py): the verify program --speculative_tokens
compiles, n-gram drafts, and the output unchanged token for token, greedy and seeded
sampled: each row's token is plain decode's own choice there, a draft kept while it equals it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compile_pool import CompilePool
from hf_models import GEN_ARCHS, save_checkpoint
from program_log import record_programs

from npuc.apps.sampling import GREEDY, SamplingParams, TokenChooser
from npuc.apps.scheduler import Scheduler
from npuc.apps.speculative import VERIFY, NgramIndex, SpeculativeConfig, StepTimes, cost_average
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.runtime.native_session import NativeSession, runtime_library

native = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")
K, MAX_SEQ = 4, 64
# one prompt that repeats itself (drafts are found and mostly right), one that does not
PROMPTS = [[5, 17, 3, 99, 42, 5, 17, 3, 99, 42, 5, 17], [1, 15, 27, 100, 42, 7, 64, 11, 80, 2]]
ALWAYS = SpeculativeConfig(min_gain=0.0)  # verify whenever there are drafts: every draft is checked
# the tiny random models' logits lie close together: at 0.03 the draws often continue the
# prompt's repeats (drafts kept), not always (drafts rejected)
COOL = SamplingParams(temperature=0.03, top_k=8, seed=11)


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    with CompilePool() as pool:  # in worker processes, while this one saves the next checkpoint
        oms = {}
        for arch in GEN_ARCHS:
            save_checkpoint(arch, str(root / arch))
            slots = 2 if arch == "llama" else 1
            oms[arch] = pool.compile(str(root / arch), input_shape=f"input_ids:{slots},8", max_seq_len=MAX_SEQ,
                                     speculative_tokens=K, output=str(root / f"{arch}_spec"))
        return {arch: Path(om.result()) for arch, om in oms.items()}


def _run(s: Any, prompts: list[list[int]], config: SpeculativeConfig, sampling: SamplingParams = GREEDY,
         n: int = 40) -> tuple[list[list[int]], Any]:
    sched = Scheduler(s, speculative=config)
    ids = [sched.submit(p, n, True, sampling) for p in prompts]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids], sched.stats


def test_the_verify_program_runs_k_plus_one_tokens_of_each_slot(spec_models: dict[str, Path]) -> None:
    s = Session.load(str(spec_models["llama"]), use_native=False)
    verify = s.programs[VERIFY]
    ids = next(t for t in verify.inputs if t.name == "input_ids")
    assert tuple(ids.shape) == (2, K + 1) and tuple(verify.outputs[0].shape[:2]) == (2, K + 1)


def test_verify_rows_are_decode_steps(spec_models: dict[str, Path]) -> None:
    """Row i of a verify step gives the logits decode gives after feeding tokens 0..i one by one."""
    s = Session.load(str(spec_models["llama"]), use_native=False)
    prompt = PROMPTS[1][:8]
    s.reset_state()
    s.run({"input_ids": np.array([prompt]), "last_token": np.array([7]), "slot": np.array([0])}, "prefill")
    feed = [9, 33, 4, 71, 2]
    got = s.run({"input_ids": np.array([feed, feed]), "position": np.array([list(range(8, 13))] * 2)},
                VERIFY)["logits"][0]
    s.reset_state()
    s.run({"input_ids": np.array([prompt]), "last_token": np.array([7]), "slot": np.array([0])}, "prefill")
    for i, t in enumerate(feed):
        want = s.run({"input_ids": np.array([[t], [t]]), "position": np.array([8 + i, 8 + i])}, "decode")["logits"]
        torch.testing.assert_close(torch.as_tensor(np.asarray(got[i])), torch.as_tensor(np.asarray(want[0, -1])),
                                   rtol=1e-4, atol=1e-5)


@native
@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_greedy_output_is_unchanged_by_speculation(arch: str, spec_models: dict[str, Path]) -> None:
    s = NativeSession(str(spec_models[arch]))
    want, plain = _run(s, PROMPTS, SpeculativeConfig(method="off"))
    got, stats = _run(s, PROMPTS, ALWAYS)
    assert got == want
    assert plain.drafted == 0 and stats.verify_steps > 0 and stats.drafted > 0
    assert stats.tokens == plain.tokens and stats.steps < plain.steps or stats.accepted == 0


def c_generate(om: Path, prompts: list[list[int]], n: int, spec: tuple[int, int, int, float] | None = None,
               sampling: list[SamplingParams | None] | None = None) -> tuple[list[list[int]], Any]:
    """The C API's own decode loop (NativeSession.generate: npuc_generate_speculative): each
    prompt's tokens, and the speculation counts."""
    choosers = [TokenChooser(sp, p, n, 1 << 20, ()) if sp else None
                for sp, p in zip(sampling or [None] * len(prompts), prompts, strict=True)]
    return NativeSession(str(om)).generate(prompts, n, spec, [c._c if c else None for c in choosers])


@native
@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_the_c_decode_loop_speculates_with_the_greedy_tokens(arch: str, spec_models: dict[str, Path]) -> None:
    """npuc_generate_speculative: the tokens npuc_generate gives, with drafts checked and kept
    (every draft found is verified at min_gain 0; at 1 the step times decide)."""
    want, plain = c_generate(spec_models[arch], PROMPTS, 40)
    assert plain.verify_steps == 0 and plain.tokens == 80
    got, stats = c_generate(spec_models[arch], PROMPTS, 40, (K, 2, 4, 0.0))
    assert got == want
    assert stats.verify_steps > 0 and stats.accepted > 0 and stats.steps < plain.steps
    assert stats.tokens == plain.tokens and 0 < stats.accepted <= stats.drafted
    got, _ = c_generate(spec_models[arch], PROMPTS, 40, (2, 1, 3, 1.0))
    assert got == want


@native
@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_the_c_decode_loop_speculates_with_the_sampled_draws(arch: str, spec_models: dict[str, Path]) -> None:
    """Seeded sequences that speculate get npuc_generate's draws, token for token, with drafts
    checked and kept: alone, and a hotter one beside a greedy one in the same steps."""
    want, _ = c_generate(spec_models[arch], PROMPTS, 40, sampling=[COOL, COOL])
    got, stats = c_generate(spec_models[arch], PROMPTS, 40, (K, 2, 4, 0.0), sampling=[COOL, COOL])
    assert got == want
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    hot = SamplingParams(temperature=0.9, top_k=30, seed=5)
    want, _ = c_generate(spec_models[arch], PROMPTS, 30, sampling=[None, hot])
    got, stats = c_generate(spec_models[arch], PROMPTS, 30, (K, 1, 3, 0.0), sampling=[None, hot])
    assert got == want and stats.verify_steps > 0


@native
def test_the_c_decode_loop_refuses_speculation_it_cannot_run(spec_models: dict[str, Path],
                                                            gen_models: dict[str, Path]) -> None:
    with pytest.raises(NpucError, match="no verify program") as e:
        c_generate(gen_models["llama"], PROMPTS[:1], 4, (2, 2, 4, 1.0))
    assert e.value.code == "NPUC-E0111" and "--speculative_tokens" in e.value.hint
    for bad, why in [((K + 1, 2, 4, 1.0), "checks 1..4"), ((2, 0, 4, 1.0), "n-gram sizes"),
                     ((2, 3, 2, 1.0), "n-gram sizes"), ((2, 2, 4, -1.0), "min_gain")]:
        with pytest.raises(NpucError, match=why):
            c_generate(spec_models["llama"], PROMPTS[:1], 4, bad)
    assert c_generate(gen_models["llama"], PROMPTS[:1], 4, (0, 2, 4, 1.0))[0] == c_generate(
        gen_models["llama"], PROMPTS[:1], 4)[0]  # tokens 0: no speculation, any model


def test_greedy_output_is_unchanged_on_the_reference_executor(spec_models: dict[str, Path]) -> None:
    s = Session.load(str(spec_models["llama"]), use_native=False)
    want, _ = _run(s, PROMPTS, SpeculativeConfig(method="off"), n=24)
    got, stats = _run(s, PROMPTS, ALWAYS, n=24)
    assert got == want and stats.verify_steps > 0


@native
@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_seeded_sampling_is_unchanged_by_speculation(arch: str, spec_models: dict[str, Path]) -> None:
    """The scheduler's sampled tokens with every draft checked equal those without speculation
    (each row's token is the request's own seeded draw, a draft kept while it equals it), with
    drafts kept and rejected: the distribution is plain sampling's (tests/test_sampling.py's
    chi-square tests), whatever the speculation."""
    s = NativeSession(str(spec_models[arch]))
    want, _ = _run(s, PROMPTS, SpeculativeConfig(method="off"), COOL)
    got, stats = _run(s, PROMPTS, ALWAYS, COOL)
    assert got == want
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats


def test_ngram_drafts() -> None:
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3, 4, 9, 1, 2, 3])
    assert idx.draft(3) == [4, 9, 1]  # after the latest earlier [1, 2, 3]
    idx.extend([7])
    assert idx.draft(2) == []  # [3, 7] never occurred before
    cycle = NgramIndex(2, 4)
    cycle.extend([8, 5, 6, 5, 6])
    assert cycle.draft(5) == [5, 6, 5, 6, 5]  # a repeating stretch runs on into its own copy


def test_probes_back_off_while_they_fail() -> None:
    """Speculation switched off is probed after PROBE_EVERY plain steps; each probe that does not
    switch it back on doubles the wait (up to PROBE_MOST); verify paying again, or a new request,
    brings it back."""
    times = StepTimes()
    first = StepTimes.PROBE_EVERY

    def plain_steps(n: int) -> None:
        for _ in range(n):
            times.chose(False, False)
            times.add("decode", 0.01)

    plain_steps(first - 1)
    assert not times.probe_due()
    plain_steps(1)
    assert times.probe_due()
    for wait in (2 * first, 4 * first):
        times.chose(True, True)  # the probe
        times.add(VERIFY, 0.02)
        plain_steps(1)  # ... did not pay: off again
        assert times.probe_every == wait
        plain_steps(wait - 2)
        assert not times.probe_due()
        plain_steps(1)
        assert times.probe_due()
    for _ in range(10):
        times.chose(True, True)
        times.chose(False, False)
    assert times.probe_every == StepTimes.PROBE_MOST
    times.chose(True, True)
    times.chose(True, False)  # the probe found drafts that pay
    assert times.probe_every == first
    times.chose(True, True)
    times.chose(False, False)
    times.admitted()
    assert times.probe_every == first


def test_step_costs_follow_a_faster_step_at_once() -> None:
    """A program's first WARM_RUNS runs are not counted; then a faster step moves the estimate
    half way, a slower one a fifth of the way."""
    times = StepTimes()
    for _ in range(StepTimes.WARM_RUNS):
        times.add("decode", 1.0)
    assert times.decode is None
    times.add("decode", 0.010)
    times.add("decode", 0.006)
    assert times.decode == pytest.approx(0.008)
    times.add("decode", 0.018)
    assert times.decode == pytest.approx(0.010)
    assert cost_average(None, 0.5) == 0.5


def test_nothing_is_drafted_before_decode_is_timed(spec_models: dict[str, Path]) -> None:
    """A scheduler's first steps run plain decode, whatever the drafts: the cost a drafter's
    tokens are weighed against is unknown until then."""
    s = Session.load(str(spec_models["llama"]), use_native=False)
    ran = record_programs(s)
    _run(s, [PROMPTS[0][:8]], ALWAYS, n=16)  # within the prefill: no prompt left to feed
    steps = [p for p in ran if p != "prefill"]
    assert steps[:StepTimes.WARM_RUNS + 1] == ["decode"] * (StepTimes.WARM_RUNS + 1)
    assert VERIFY in steps


@pytest.mark.parametrize("kwargs,text", [
    ({"speculative_tokens": 4}, "needs --max_seq_len"),
    ({"speculative_tokens": 0, "max_seq_len": 64}, "from 1 to 15"),
    ({"speculative_tokens": 16, "max_seq_len": 64}, "from 1 to 15"),
    ({"prefix_cache": 0, "max_seq_len": 64}, "from 1 to 1024"),
])
def test_flag_values_are_refused(kwargs: dict[str, Any], text: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(str(tmp_path / "missing"), input_shape="input_ids:1,8", output=str(tmp_path / "m"), **kwargs)
    assert e.value.code == "NPUC-E0124" and text in e.value.message and not list(tmp_path.iterdir())


def test_speculative_config_is_checked() -> None:
    with pytest.raises(NpucError) as e:
        SpeculativeConfig(method="medusa").check()
    assert e.value.code == "NPUC-E0162"


# -- prefix reuse (apps/prefix_cache.py) ----------------------------------------------------------

SYSTEM = [(7 * i + 3) % 120 + 5 for i in range(24)]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    save_checkpoint("llama", str(root / "llama"))
    return Path(compile_model(str(root / "llama"), input_shape="input_ids:2,32", max_seq_len=96, speculative_tokens=7,
                              prefix_cache=2, output=str(root / "pooled")))


def _answers(s: Any, prompts: list[list[int]], reuse: bool) -> tuple[list[list[int]], Any]:
    """Each prompt decoded after the ones before it ended, with the prefix pool or without."""
    sched = Scheduler(s, speculative=SpeculativeConfig(method="off"))
    if not reuse:
        sched.prefixes = None
    out = []
    for p in prompts:
        rid = sched.submit(p, 12, True)
        while not sched.idle:
            sched.step()
        out.append(sched.requests[rid].tokens)
    return out, sched.prefixes


@pytest.mark.parametrize("kind", [pytest.param("c", marks=native), "torch"])
def test_a_shared_prefix_is_reused_with_the_same_answers(kind: str, pooled: Path) -> None:
    s = NativeSession(str(pooled)) if kind == "c" else Session.load(str(pooled), use_native=False)
    prompts = [SYSTEM + [9, 8, 7], SYSTEM + [40, 41, 42, 43], SYSTEM[:20] + [1] + SYSTEM[21:] + [6, 6],
               SYSTEM[:10] + [2] + SYSTEM[11:] + [5]]
    want, _ = _answers(s, prompts, reuse=False)
    got, book = _answers(s, prompts, reuse=True)
    assert got == want
    # 2nd: all 24 shared positions; 3rd: the 20 before its changed token; 4th: 10 < min_tokens, a miss
    assert (book.stats.hits, book.stats.misses, book.stats.tokens_saved) == (2, 2, 24 + 20)


def test_prefix_book_entries_and_eviction() -> None:
    from npuc.apps.prefix_cache import PrefixBook

    book = PrefixBook(2, min_tokens=2)
    assert book.place([1, 2, 3]) == 0 and book.place([4, 5, 6]) == 1
    assert book.place([1, 2]) == -1  # entry 0 holds it already
    assert book.match([1, 2, 3, 9], 8) == (0, 3)  # entry 0 is now the most recently used
    assert book.place([7, 8, 9]) == 1  # evicts the least recently used
    assert book.place([1, 2, 3, 4]) == 0  # extends what entry 0 holds
    assert book.match([1, 2, 3, 4], 8) == (0, 3)  # the last prompt token is always fed
    assert book.match([1, 2, 3, 4] + [0] * 20, 8) == (-1, 0)  # too much left to feed: a prefill
