"""Multi-token prediction (compiler/mtp.py, apps/mtp_draft.py): a checkpoint's MTP layer
compiled into the `.om` with --mtp, its programs against the layer computed in transformers,
its drafts against that layer's chained argmax, greedy output unchanged by it, and the
refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compile_pool import CompilePool
from hf_models import GEN_ARCHS, save_checkpoint
from mtp_checkpoint import ReferenceMTP, save_mtp_checkpoint
from program_log import record_programs

from npuc.apps.mtp_draft import MTP_DECODE, MTP_PREFILL, MTP_VERIFY, MTPDrafter
from npuc.apps.sampling import GREEDY, SamplingParams
from npuc.apps.scheduler import Scheduler
from npuc.apps.speculative import SpeculativeConfig
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.runtime.native_session import NativeSession, runtime_library

native = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")
K, PREFILL, MAX_SEQ = 3, 20, 64
ALWAYS = SpeculativeConfig(method="mtp", min_gain=0.0)  # verify whenever there are drafts
PROMPTS = [[5, 17, 3, 99, 42, 5, 17, 3, 99, 42, 5, 17], [1, 15, 27, 100, 42, 7, 64, 11, 80, 2], [9, 4],
           list(range(20, 44))]  # the last longer than the prefill: its rest goes through the steps


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(checkpoint, .om) of each test architecture: DeepSeek-V3 (latent attention, a routed-expert
    MTP layer), Llama with a prefix pool and a mixed step, and the others (their own decoder
    layer as the MTP layer's, as a checkpoint so laid out would have it)."""
    root = tmp_path_factory.mktemp("mtp")
    with CompilePool() as pool:  # in worker processes, while this one saves the next checkpoint
        oms = {}
        for arch in GEN_ARCHS:
            save_mtp_checkpoint(arch, str(root / arch))
            oms[arch] = pool.compile(str(root / arch), input_shape=f"input_ids:2,{PREFILL}", max_seq_len=MAX_SEQ,
                                     speculative_tokens=K, mtp=True, prefix_cache=2 if arch == "llama" else None,
                                     mixed_tokens=4 if arch == "llama" else None, output=str(root / f"{arch}_mtp"))
        return {arch: (root / arch, Path(om.result())) for arch, om in oms.items()}


def _session(om: Path, executor: str) -> Any:
    return NativeSession(str(om)) if executor == "native" else Session.load(str(om), use_native=False)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float32)


@pytest.mark.parametrize("executor", [pytest.param("native", marks=native), "reference"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_programs_match_the_layer_in_transformers(arch: str, executor: str,
                                                  mtp_models: dict[str, tuple[Path, Path]]) -> None:
    ckpt, om = mtp_models[arch]
    ref, s = ReferenceMTP(str(ckpt)), _session(om, executor)
    assert {MTP_PREFILL, MTP_DECODE, MTP_VERIFY} <= set(s.programs)
    ids = torch.randint(0, 128, (1, 26), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ref.hidden(ids)
        want, want_h = ref.mtp(ids[:, 1:], torch.arange(25)[None], h[:, :25])
    out = s.run({"input_ids": ids[:, :PREFILL].numpy(), "slot": np.array([1]), "last_token": np.array([PREFILL - 1])},
                "prefill")
    got_h = _np(out["hidden"])
    assert np.abs(got_h - h[:, :PREFILL].numpy()).max() < 1e-4  # the main model's hidden state, every row
    out = s.run({"input_ids": ids[:, 1:PREFILL + 1].numpy(), "hidden": got_h, "slot": np.array([1])}, MTP_PREFILL)
    assert np.abs(_np(out["logits"]) - want[:, :PREFILL].numpy()).max() < 1e-4
    assert np.abs(_np(out["mtp_hidden"]) - want_h[:, :PREFILL].numpy()).max() < 1e-4
    # slot 1 goes on at positions 20.. from its cache; slot 0 writes a row nobody reads
    ids1, h1 = np.zeros((2, 1), dtype=np.int64), np.zeros((2, 1, h.shape[-1]), dtype=np.float32)
    ids1[1, 0], h1[1, 0] = ids[0, PREFILL + 1], h[0, PREFILL]
    out = s.run({"input_ids": ids1, "hidden": h1, "position": np.array([30, PREFILL])}, MTP_DECODE)
    assert np.abs(_np(out["logits"])[1, 0] - want[0, PREFILL].numpy()).max() < 1e-4
    idsv, hv = np.zeros((2, K + 1), dtype=np.int64), np.zeros((2, K + 1, h.shape[-1]), dtype=np.float32)
    idsv[1], hv[1] = ids[0, PREFILL + 2:PREFILL + 3 + K], h[0, PREFILL + 1:PREFILL + 2 + K]
    pos = np.array([[30] * (K + 1), list(range(PREFILL + 1, PREFILL + 2 + K))])
    out = s.run({"input_ids": idsv, "hidden": hv, "position": pos}, MTP_VERIFY)
    assert np.abs(_np(out["logits"])[1] - want[0, PREFILL + 1:PREFILL + 2 + K].numpy()).max() < 1e-4


def _reference_drafts(ref: ReferenceMTP, seq: list[int], n: int) -> list[int]:
    """The layer's chained argmax after `seq`: rows (token p + 1, hidden p) for p = 0..N-2,
    then each draft with the layer's own hidden output of the row before."""
    with torch.no_grad():
        h = ref.hidden(torch.tensor([seq[:-1]]))[0]
        toks, hs, out = list(seq[1:]), list(h), []
        for _ in range(n):
            logits, x = ref.mtp(torch.tensor([toks]), torch.arange(len(toks))[None], torch.stack(hs)[None])
            out.append(int(logits[0, -1].argmax()))
            toks.append(out[-1])
            hs.append(x[0, -1])
    return out


@native
def test_drafts_are_the_layers_chained_argmax(mtp_models: dict[str, tuple[Path, Path]]) -> None:
    """Every proposal, through admissions, catch-ups after verify steps, a prompt longer than
    the prefill, a prompt fed through mixed steps, a prefix loaded from the pool and a slot
    reused."""
    ckpt, om = mtp_models["llama"]
    ref, s = ReferenceMTP(str(ckpt)), NativeSession(str(om))
    ran = record_programs(s)
    sched = Scheduler(s, speculative=ALWAYS)
    drafter = sched._draft
    assert isinstance(drafter, MTPDrafter)
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = drafter.propose

    def recorded(wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        got = propose(wants)
        seen.extend((list(seq), n, got[k]) for k, (seq, n) in wants.items())
        return got

    drafter.propose = recorded  # type: ignore[method-assign]
    shared = list(range(30, 30 + PREFILL))
    prompts = [[*shared, 7, 8, 9], PROMPTS[0], [*shared, 50, 51]]  # the third loads the first's prefix
    sched.submit(prompts[0], 12, True)
    for _ in range(3):
        sched.step()
    sched.submit(prompts[1], 10, True)  # admitted while the first streams: through mixed steps
    while not sched.idle:
        sched.step()
    sched.submit(prompts[2], 10, True)
    while not sched.idle:
        sched.step()
    assert sched.prefixes is not None and sched.prefixes.stats.hits >= 1
    assert {"mixed", MTP_PREFILL, MTP_DECODE, MTP_VERIFY} <= set(ran)
    assert len(seen) >= 6
    for seq, n, got in seen:
        assert got == _reference_drafts(ref, seq, n), seq


def _run(s: Any, config: SpeculativeConfig, n: int = 30,
         sampling: SamplingParams = GREEDY) -> tuple[list[list[int]], Any]:
    sched = Scheduler(s, speculative=config)
    ids = [sched.submit(p, n, True, sampling) for p in PROMPTS]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids], sched.stats


@pytest.mark.parametrize("arch,executor", [*[pytest.param(a, "native", marks=native) for a in GEN_ARCHS],
                                           ("deepseek_v3", "reference"), ("llama", "reference")])
def test_greedy_output_is_unchanged_by_mtp(arch: str, executor: str, mtp_models: dict[str, tuple[Path, Path]]) -> None:
    s = _session(mtp_models[arch][1], executor)
    plain, _ = _run(s, SpeculativeConfig(method="off"))
    got, stats = _run(s, ALWAYS)
    assert got == plain
    assert stats.verify_steps > 0 and stats.drafted > 0


@native
def test_seeded_sampling_is_unchanged_by_mtp(mtp_models: dict[str, tuple[Path, Path]]) -> None:
    """Each row's token is the request's own seeded draw, an MTP draft kept while it equals it:
    the tokens without speculation."""
    s = NativeSession(str(mtp_models["llama"][1]))
    cool = SamplingParams(temperature=0.03, top_k=8, seed=3)
    plain, _ = _run(s, SpeculativeConfig(method="off"), sampling=cool)
    got, stats = _run(s, ALWAYS, sampling=cool)
    assert got == plain
    assert stats.verify_steps > 0 and stats.drafted > 0


@native
def test_auto_drafts_with_the_mtp_layer_where_the_model_has_one(mtp_models: dict[str, tuple[Path, Path]]) -> None:
    assert isinstance(Scheduler(NativeSession(str(mtp_models["llama"][1])))._draft, MTPDrafter)


def test_refusals(tmp_path: Path, mtp_models: dict[str, tuple[Path, Path]]) -> None:
    ckpt = mtp_models["llama"][0]
    with pytest.raises(NpucError, match="verify program") as e:
        compile_model(str(ckpt), input_shape="input_ids:1,8", max_seq_len=32, mtp=True, output=str(tmp_path / "a"))
    assert e.value.code == "NPUC-E0164"
    plain = tmp_path / "plain"
    save_checkpoint("llama", str(plain))
    with pytest.raises(NpucError, match="no multi-token-prediction layer") as e:
        compile_model(str(plain), input_shape="input_ids:1,8", max_seq_len=32, speculative_tokens=2, mtp=True,
                      output=str(tmp_path / "b"))
    assert e.value.code == "NPUC-E0164"
    assert not list(tmp_path.glob("*.om"))
    om = compile_model(str(plain), input_shape="input_ids:1,8", max_seq_len=32, speculative_tokens=2,
                       output=str(tmp_path / "c"))
    with pytest.raises(NpucError, match="no multi-token-prediction programs") as e:
        Scheduler(Session.load(om, use_native=False), speculative=SpeculativeConfig(method="mtp"))
    assert e.value.code == "NPUC-E0163"
