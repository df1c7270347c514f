"""The C executor (libnpucrt, runtime/native_session.py) against the torch reference
interpreter (runtime/session.py, the registry's kernels): the same logits within 1e-5 at
prefill and every decode step, the same greedy tokens, at batch 1 and over 4 slots, with
--decode_tokens, in bf16 and quantized within docs/precision.md's tolerances; and its
refusals: a position, slot or token id out of range is NPUC-E0108, a damaged file the
Python side's code."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from hf_models import GEN_ARCHS, GEN_MAX_SEQ, GEN_PREFILL

from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime.native_session import NativeSession, runtime_library
from npuc.runtime.session import Session

pytestmark = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")

NEW = 32
PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 11], [1, 2, 3], [9] * 12, [100, 50, 25, 12, 6, 3], [7, 7],
           list(range(20, 40)), [2, 3, 4, 5, 6]]
LIMITS = [12, 5, 9, 16, 3, 7, 10]


def _ref(om: Path) -> Session:
    return Session.load(str(om), use_native=False)  # the registry's torch kernels only


def _steps(s: object, prompt: list[int], new: int) -> list[tuple[int, np.ndarray]]:
    from npuc.apps.generate import steps

    return [(t, np.asarray(lg, dtype=np.float32).copy()) for t, lg in steps(s, prompt, new, ignore_eos=True)]


def _compare(om: Path, atol: float, prompts: list[list[int]] = PROMPTS[:2], new: int = NEW) -> None:
    c, ref = NativeSession(str(om)), _ref(om)
    for prompt in prompts:
        got, want = _steps(c, prompt, new), _steps(ref, prompt, new)
        assert [t for t, _ in got] == [t for t, _ in want]
        err = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(got, want, strict=True))
        assert err <= atol, f"{om.name}: logits differ by {err}"


@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_same_logits_and_tokens_as_the_reference(arch: str, gen_models: dict[str, Path]) -> None:
    _compare(gen_models[arch], 1e-5)


def test_prefill_logits_of_every_row(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    om = Path(compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(tmp_path / "m")))
    ids = np.random.default_rng(0).integers(0, 128, (1, 16), dtype=np.int64)
    got = NativeSession(str(om)).run({"input_ids": ids})["logits"]
    want = _ref(om).run({"input_ids": ids})["logits"].numpy()
    assert got.shape == want.shape == (1, 16, 128)
    assert float(np.abs(got - want).max()) <= 1e-5


@pytest.fixture(scope="module")
def slotted(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slots")
    out = {}
    for name, extra in (("slots", {}), ("chunks", {"decode_tokens": 4})):
        out[name] = Path(compile_model(str(hf_checkpoints["llama"]), input_shape=f"input_ids:4,{GEN_PREFILL}",
                                       max_seq_len=GEN_MAX_SEQ, output=str(root / name), **extra))
    return out


@pytest.mark.parametrize("kind", ["slots", "chunks"])
def test_many_sequences_over_slots(kind: str, slotted: dict[str, Path]) -> None:
    """Seven prompts over 4 slots (joining and leaving mid-run): tokens and each token's logits
    as the reference gives them, also with 4 decode tokens a step (chunked prefill)."""
    from npuc.apps.scheduler import Scheduler

    def run(s: object) -> dict[int, list[tuple[int, np.ndarray]]]:
        sched = Scheduler(s, keep_logits=True)
        ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, LIMITS, strict=True)]
        got: dict[int, list[tuple[int, np.ndarray]]] = {i: [] for i in ids}
        while not sched.idle:
            for e in sched.step():
                got[e.request].append((e.token, np.asarray(e.logits, dtype=np.float32)))
        return got

    om = slotted[kind]
    got, want = run(NativeSession(str(om))), run(_ref(om))
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]]
        for (_, a), (_, b) in zip(got[rid], want[rid], strict=True):
            assert float(np.abs(a - b).max()) <= 1e-5


def _c_generate(om: Path, prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
    """The C API's own decode loop (npuc_generate), called as a C program would."""
    s = NativeSession(str(om))

    from npuc.runtime.native_session import _Sequence as Seq

    keep = []
    seqs = (Seq * len(prompts))()
    for q, (p, n) in enumerate(zip(prompts, limits, strict=True)):
        pa, out = (ctypes.c_int64 * len(p))(*p), (ctypes.c_int64 * n)()
        keep += [pa, out]
        seqs[q] = Seq(pa, len(p), n, 1, out, 0, 0, None)
    seen: list[tuple[int, int]] = []
    cb_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64)
    cb = cb_type(lambda user, seq, tok: seen.append((seq, tok)) or 0)
    from npuc.runtime.native_session import _Error, _raise

    err = _Error()
    rc = s.lib.npuc_generate(s._session, ctypes.cast(seqs, ctypes.c_void_p), len(prompts),
                             ctypes.cast(cb, ctypes.c_void_p), None, ctypes.byref(err))
    if rc:
        _raise(err, rc)
    out = [[int(seqs[q].out_tokens[i]) for i in range(seqs[q].n_out)] for q in range(len(prompts))]
    assert out == [[t for sq, t in seen if sq == q] for q in range(len(prompts))]  # the callback saw each
    return out


@pytest.mark.parametrize("kind", ["one", "slots", "chunks"])
def test_the_c_decode_loop_generates_the_schedulers_tokens(kind: str, gen_models: dict[str, Path],
                                                           slotted: dict[str, Path]) -> None:
    from npuc.apps.scheduler import generate_many

    om = gen_models["llama"] if kind == "one" else slotted[kind]
    want = generate_many(_ref(om), PROMPTS, max(LIMITS), ignore_eos=True)
    want = [w[:n] for w, n in zip(want, LIMITS, strict=True)]
    assert _c_generate(om, PROMPTS, LIMITS) == want


@pytest.mark.parametrize("mode", ["bf16", "w8a16", "w4a16"])
def test_reduced_precision_agrees_with_the_reference(mode: str, hf_checkpoints: dict[str, Path],
                                                     tmp_path: Path) -> None:
    """The same .om on both executors: bf16 within 8 bf16 ulps of the logit scale (the
    docs/precision.md tolerance); the quantized products within 1e-4 (both dequantize the
    same codes exactly and sum in f32, in another order)."""
    opts = {"bf16": {"precision_mode": "allow_mix_precision_bf16"},
            "w8a16": {"quant_type": "w8a16", "precision_mode": "force_fp32"},
            "w4a16": {"quant_type": "w4a16", "group_size": 32, "precision_mode": "force_fp32"}}[mode]
    om = Path(compile_model(str(hf_checkpoints["llama"]), input_shape=f"input_ids:1,{GEN_PREFILL}",
                            max_seq_len=GEN_MAX_SEQ, output=str(tmp_path / mode), **opts))
    c, ref = NativeSession(str(om)), _ref(om)
    got, want = _steps(c, PROMPTS[0], 8), _steps(ref, PROMPTS[0], 8)
    scale = max(float(np.abs(b).max()) for _, b in want)
    atol = 8 * 2.0 ** -7 * scale if mode == "bf16" else 1e-4
    err = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(got, want, strict=True))
    assert err <= atol, f"{mode}: {err} > {atol}"
    assert got[0][0] == want[0][0]


def test_inputs_that_index_memory_are_refused(gen_models: dict[str, Path], slotted: dict[str, Path]) -> None:
    s = NativeSession(str(gen_models["llama"]))
    ok = {"input_ids": np.zeros((1, 1), dtype=np.int64), "position": np.array([3], dtype=np.int64)}
    s.run(ok, "decode")
    for feeds, what in (({"position": np.array([GEN_MAX_SEQ], dtype=np.int64)}, "position"),
                        ({"position": np.array([-1], dtype=np.int64)}, "position"),
                        ({"input_ids": np.array([[128]], dtype=np.int64)}, "outside the 128 rows")):
        with pytest.raises(NpucError) as e:
            s.run({**ok, **feeds}, "decode")
        assert e.value.code == "NPUC-E0108" and what in e.value.message
    many = NativeSession(str(slotted["slots"]))
    feeds = {"input_ids": np.zeros((1, GEN_PREFILL), dtype=np.int64), "last_token": np.array([0], dtype=np.int64),
             "slot": np.array([4], dtype=np.int64)}
    with pytest.raises(NpucError) as e:
        many.run(feeds, "prefill")
    assert e.value.code == "NPUC-E0108" and "slot" in e.value.message
    with pytest.raises(NpucError) as e:
        many.run({**feeds, "slot": np.array([0], dtype=np.int64), "last_token": np.array([GEN_PREFILL])}, "prefill")
    assert e.value.code == "NPUC-E0108" and "last_token" in e.value.message
    with pytest.raises(NpucError) as e:
        s.run({"input_ids": np.zeros((1, 2), dtype=np.int64), "position": ok["position"]}, "decode")
    assert e.value.code == "NPUC-E0108"


def test_load_refusals_match_the_python_side(gen_models: dict[str, Path], tmp_path: Path) -> None:
    good = gen_models["llama"].read_bytes()
    cases = {"missing": None, "magic": b"NOTANOM!" + good[8:], "short": good[:40], "table": good[:70] + b"\xff" + good[71:],
             "weights": good[:-10] + bytes(10)}
    for name, data in cases.items():
        path = tmp_path / f"{name}.om"
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(NpucError) as want:
            Session.load(str(path))
        with pytest.raises(NpucError) as got:
            NativeSession(str(path))
        assert got.value.code == want.value.code, name


def test_npuc_load_runs_the_c_executor_and_falls_back_with_a_notice(gen_models: dict[str, Path], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from ir_build import f32, node

    import npuc
    from npuc.backend.lower import lower
    from npuc.backend.targets import get_target
    from npuc.backend.writer import write_om
    from npuc.ir import Graph

    assert isinstance(npuc.load(str(gen_models["llama"])), NativeSession)
    assert isinstance(npuc.load(str(gen_models["llama"]), executor="torch"), Session)
    monkeypatch.setenv("NPUC_EXECUTOR", "torch")
    assert isinstance(npuc.load(str(gen_models["llama"])), Session)
    monkeypatch.delenv("NPUC_EXECUTOR")
    # einsum has no native kernel: the load refuses it, naming it, and npuc.load runs the interpreter
    g = Graph("g")
    a, b = g.add_input("a", f32(2, 3)), g.add_input("b", f32(3, 4))
    g.set_outputs([node(g, "einsum", [a, b], {"equation": "ij,jk->ik"})])
    om = str(tmp_path / "einsum.om")
    write_om(lower(g, get_target("cpu")), om)
    with pytest.raises(NpucError) as e:
        NativeSession(om)
    assert e.value.code == "NPUC-E0413" and "einsum" in e.value.message
    capsys.readouterr()
    s = npuc.load(om)
    assert isinstance(s, Session)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "einsum" in err and "torch interpreter" in err
    x, y = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)
    assert np.allclose(s.run({"a": x, "b": y})[g.outputs[0].name].numpy(), x @ y)
    monkeypatch.setenv("NPUC_EXECUTOR", "native")
    with pytest.raises(NpucError):
        npuc.load(om)
