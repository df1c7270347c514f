"""libnpucrt's attention variants, convolutions and rotary embeddings (npucrt/src/ops_attention.c)
against the registry's torch kernels.

One-op cases are packed into a few `.om` files (one graph of many independent ops), each run
by the C executor (NativeSession) and by the torch interpreter (Session, use_native=False):
f32 within 1e-5, bf16/f16 within 2 ulps, NaN where the reference gives NaN. Then positions
outside the cache (NPUC-E0108 from NativeSession.run), the refusals (NPUC-E0413), and tiny
HF models of the families that use these ops, compiled and generated greedily by both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph, TensorType, get_op
from npuc.ir.fused_ops import quantize_kv_rows
from npuc.runtime.session import Session

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
I64, I32, BOOL = torch.int64, torch.int32, torch.bool
HALF = (BF16, F16)
_G = torch.Generator().manual_seed(7)


def randn(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=_G).to(dtype)


def randbool(*shape: int, p: float = 0.7) -> torch.Tensor:
    return torch.rand(*shape, generator=_G) < p


def addmask(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    m = torch.randn(*shape, generator=_G)
    return m.masked_fill(~randbool(*shape), float("-inf")).to(dtype)


@dataclass
class Case:
    id: str
    op: str
    args: list[torch.Tensor]
    attrs: dict[str, Any]


CASES: list[Case] = []


def case(id: str, op: str, args: list[torch.Tensor], attrs: dict[str, Any] | None = None) -> None:
    CASES.append(Case(id, op, args, attrs or {}))


def qkv(b: int, hq: int, hkv: int, s: int, keys: int, d: int = 8, dv: int = 8,
        dt: torch.dtype = F32) -> list[torch.Tensor]:
    return [randn(b, hq, s, d, dtype=dt), randn(b, hkv, keys, d, dtype=dt), randn(b, hkv, keys, dv, dtype=dt)]


SLOPES4 = (0.5, 0.25, 0.125, 0.0625)
for dt in (F32, BF16, F16):
    n = str(dt).split(".")[1]
    A = {"scale": 0.35}
    # fused_attention: each variant alone, then together; GQA (4 query heads over 2)
    case(f"fused-boolmask-{n}", "fused_attention", [*qkv(2, 4, 2, 5, 7, dt=dt), randbool(5, 7)], A)
    case(f"fused-addmask-{n}", "fused_attention", [*qkv(2, 4, 2, 5, 7, dt=dt), addmask(2, 1, 5, 7, dtype=dt)], A)
    case(f"fused-causal-mask-{n}", "fused_attention", [*qkv(1, 4, 2, 6, 6, dt=dt), addmask(1, 4, 6, 6)],
         {**A, "causal": True})
    case(f"fused-window-{n}", "fused_attention", qkv(1, 4, 2, 9, 9, dt=dt), {**A, "causal": True, "window": 3})
    case(f"fused-softcap-{n}", "fused_attention", qkv(1, 4, 1, 5, 5, dt=dt), {**A, "causal": True, "softcap": 1.5})
    case(f"fused-alibi-{n}", "fused_attention", qkv(1, 4, 4, 5, 6, dt=dt), {**A, "alibi": SLOPES4})
    case(f"fused-sinks-{n}", "fused_attention", [*qkv(1, 4, 2, 5, 5, dt=dt), torch.zeros((), dtype=dt),
                                                 randn(4)], {**A, "causal": True})
    case(f"fused-all-{n}", "fused_attention", [*qkv(2, 4, 2, 7, 7, dt=dt), randbool(2, 1, 7, 7), randn(4, dtype=dt)],
         {**A, "causal": True, "window": 4, "softcap": 2.0, "alibi": SLOPES4})
    # cached_attention over a cache of 40 rows
    pos = torch.tensor([11, 12, 13])
    case(f"cached-window-{n}", "cached_attention", [*qkv(1, 4, 2, 3, 40, dt=dt), pos], {**A, "window": 5})
    case(f"cached-softcap-{n}", "cached_attention", [*qkv(1, 4, 2, 3, 40, dt=dt), pos], {**A, "softcap": 3.0})
    case(f"cached-alibi-{n}", "cached_attention", [*qkv(1, 4, 4, 3, 40, dt=dt), pos], {**A, "alibi": SLOPES4})
    case(f"cached-sinks-{n}", "cached_attention", [*qkv(1, 4, 2, 3, 40, dt=dt), pos, randn(4)], A)
    case(f"cached-all-bs-i32-{n}", "cached_attention",
         [*qkv(2, 4, 2, 2, 40, dt=dt), torch.tensor([[3, 4], [30, 39]], dtype=I32), randn(4, dtype=dt)],
         {**A, "window": 6, "softcap": 2.5, "alibi": SLOPES4})
    # sdpa
    case(f"sdpa-mask-{n}", "sdpa", [*qkv(2, 4, 4, 5, 6, dt=dt), addmask(5, 6)], {"scale": 0.3})
    case(f"sdpa-causal-gqa-{n}", "sdpa", qkv(1, 4, 2, 6, 6, dt=dt), {"causal": True, "gqa": True})

# fully masked rows: 0 where the reference runs torch's sdpa, NaN where it runs softmax
_rows = randbool(6, 8)
_rows[2] = False
_add = torch.zeros(6, 8)
_add[4] = float("-inf")
case("fused-masked-row-bool", "fused_attention", [*qkv(1, 2, 2, 6, 8), _rows], {"scale": 0.4})
case("fused-masked-row-add", "fused_attention", [*qkv(1, 2, 2, 6, 8), _add], {"scale": 0.4})
case("fused-masked-row-softcap", "fused_attention", [*qkv(1, 2, 2, 6, 8), _rows], {"scale": 0.4, "softcap": 5.0})
case("fused-masked-row-sinks", "fused_attention", [*qkv(1, 2, 2, 6, 8), _add, randn(2)], {"scale": 0.4})
case("fused-window-past-keys", "fused_attention", qkv(1, 2, 1, 8, 4), {"scale": 0.4, "causal": True, "window": 2})
# shapes: a long prefill (several query blocks), decode over a long cache, odd head sizes, sdpa ranks
case("fused-prefill-blocks", "fused_attention", [*qkv(1, 8, 2, 40, 40, d=16, dv=16), randbool(40, 40)],
     {"scale": 0.25, "causal": True})
case("cached-decode-long", "cached_attention", [*qkv(2, 8, 2, 1, 700, d=32, dv=32), torch.tensor([[650], [11]])],
     {"scale": 0.18, "window": 512, "softcap": 30.0})
case("cached-prefill-blocks", "cached_attention", [*qkv(1, 4, 1, 20, 48, d=5, dv=3), torch.arange(20) + 3,
                                                   randn(4)], {"scale": 0.4, "window": 7})
# caches of another layout than q's (--kv_cache_dtype, issue 35): f16, or packed int8 rows of d + 4
# bytes (an f32 scale, then d codes); plain (exec.c's flash-decoding kernel) and with a window,
# soft-capping, sinks or ALiBi (this file's kernel); q f32 or bf16, GQA, slots at their own depths
def kv_cache(b: int, h: int, keys: int, d: int, dt: torch.dtype) -> torch.Tensor:
    rows = randn(b, h, keys, d)
    return quantize_kv_rows(rows) if dt == torch.int8 else rows.to(dt)


for cdt in (F16, torch.int8):
    for qdt in (F32, BF16):
        n = f"{str(cdt).split('.')[1]}-q{str(qdt).split('.')[1]}"
        kv = [kv_cache(2, 2, 70, 16, cdt), kv_cache(2, 2, 70, 24, cdt)]
        case(f"cached-{n}", "cached_attention", [randn(2, 4, 1, 16, dtype=qdt), *kv, torch.tensor([[69], [3]])],
             {"scale": 0.3})
        case(f"cached-{n}-window-sinks", "cached_attention", [randn(2, 4, 2, 16, dtype=qdt), *kv,
                                                              torch.tensor([[40, 41], [0, 1]]), randn(4)],
             {"scale": 0.3, "window": 9, "softcap": 4.0})
        case(f"cached-{n}-alibi", "cached_attention", [randn(2, 4, 3, 16, dtype=qdt), *kv, torch.tensor([5, 6, 7])],
             {"scale": 0.3, "alibi": SLOPES4})
case("fused-scalar-mask-dv", "fused_attention", [*qkv(1, 2, 1, 3, 4, d=6, dv=10), torch.tensor(0.5)], {"scale": 1.0})
case("fused-full-mask-shape", "fused_attention", [*qkv(2, 2, 1, 3, 4), addmask(2, 2, 3, 4)], {"scale": 0.5})
case("sdpa-rank3", "sdpa", [randn(3, 5, 4), randn(3, 6, 4), randn(3, 6, 2), randbool(3, 5, 6)], {})
case("sdpa-rank2", "sdpa", [randn(5, 4), randn(6, 4), randn(6, 3)], {"causal": True})
case("sdpa-rank5", "sdpa", [randn(2, 3, 2, 4, 8), randn(2, 3, 2, 5, 8), randn(2, 3, 2, 5, 8),
                            addmask(2, 3, 1, 4, 5)], {"scale": 0.3})

# convolutions: LFM2's depthwise short conv over the cached rows, and conv1d
for dt in (F32, BF16, F16):
    n = str(dt).split(".")[1]
    case(f"cached_conv1d-depthwise-{n}", "cached_conv1d",
         [randn(2, 1, 10, 6, dtype=dt), randn(6, 1, 3, dtype=dt), torch.tensor([4]), randn(6, dtype=dt)], {"groups": 6})
    case(f"conv1d-pads-stride-{n}", "conv1d", [randn(2, 6, 11, dtype=dt), randn(4, 3, 3, dtype=dt), randn(4, dtype=dt)],
         {"pads": (2, 1), "stride": 2, "dilation": 2, "groups": 2})
case("cached_conv1d-start-bs-i32", "cached_conv1d",
     [randn(2, 1, 8, 4), randn(6, 2, 3), torch.tensor([[0], [7]], dtype=I32)], {"groups": 2, "dilation": 2})
case("cached_conv1d-f32-cache-bf16-w", "cached_conv1d", [randn(1, 1, 8, 4), randn(4, 1, 4, dtype=BF16),
                                                         torch.tensor([5])], {"groups": 4})
case("conv1d-causal-depthwise", "conv1d", [randn(1, 8, 9), randn(8, 1, 3)], {"pads": (2, 0), "groups": 8})
case("conv1d-dense", "conv1d", [randn(2, 5, 7), randn(3, 5, 2), randn(3)], {"pads": (0, 0)})
# f32 depthwise without padding (a recurrent layer's conv window): ops_recurrent.c's kernel, on one
# thread for a decode step's few rows and shared out for a long one
case("conv1d-depthwise-window", "conv1d", [randn(2, 40, 7), randn(40, 1, 4), randn(40)], {"pads": (0, 0), "groups": 40})
case("conv1d-depthwise-long", "conv1d", [randn(2, 64, 600), randn(64, 1, 4)], {"pads": (0, 0), "groups": 64})

# rotary embeddings: rope_lut where exec.c's does not take it (half tables or x, i32 positions), and ONNX's
for dt, lay in ((BF16, "half"), (F16, "interleaved"), (BF16, "deinterleave"), (F32, "half")):
    n = str(dt).split(".")[1]
    _pos = torch.tensor([[0, 4, 7, 9, 2], [1, 1, 3, 8, 5]], dtype=I32)
    case(f"rope_lut-{lay}-{n}-i32", "rope_lut",
         [randn(2, 3, 5, 10, dtype=dt), _pos, randn(12, 4, dtype=dt), randn(12, 4, dtype=dt)], {"layout": lay})
case("rope_lut-bf16-shared-f32-tables", "rope_lut", [randn(1, 2, 4, 8, dtype=BF16), torch.tensor([3, 4, 5, 6]),
                                                     randn(9, 4), randn(9, 4)])
for dt in (F32, BF16, F16):
    n = str(dt).split(".")[1]
    _pos = torch.tensor([[0, 5, 9, 15], [2, 2, 3, 4]])
    case(f"rotary-4d-pos-{n}", "rotary_embedding",
         [randn(2, 3, 4, 8, dtype=dt), randn(16, 4, dtype=dt), randn(16, 4, dtype=dt), _pos],
         {})
    case(f"rotary-3d-partial-interleaved-{n}", "rotary_embedding",
         [randn(2, 4, 24, dtype=dt), randn(2, 4, 2, dtype=dt), randn(2, 4, 2, dtype=dt)],
         {"num_heads": 2, "rotary_dim": 4, "interleaved": True})


# -- building, running, comparing --------------------------------------------------------------------

def _ttype(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(t.shape), DType.from_torch(t.dtype))


def _build(cases: list[Case], path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    g = Graph("main")
    outs: dict[str, str] = {}
    feeds: dict[str, torch.Tensor] = {}
    results = []
    for k, c in enumerate(cases):
        vals = []
        for i, a in enumerate(c.args):
            v = g.add_input(f"c{k}_in{i}", _ttype(a))
            feeds[v.name] = a
            vals.append(v)
        types = get_op(c.op).infer_types([v.type for v in vals], c.attrs)
        node = g.add_node(c.op, vals, types, c.attrs, names=f"c{k}_out")
        outs[c.id] = node.outputs[0].name
        results.append(node.outputs[0])
    g.set_outputs(results)
    write_om(lower(g, get_target("cpu")), str(path))
    return outs, feeds


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == BF16 else t.numpy()


def _from_native(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.view(torch.int16).view(BF16) if like.dtype == BF16 else t


def compare(nat: torch.Tensor, ref: torch.Tensor) -> None:
    assert nat.dtype == ref.dtype and nat.shape == ref.shape, (nat.dtype, nat.shape, ref.dtype, ref.shape)
    if ref.dtype in HALF:
        a, b = nat.double(), ref.double()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(torch.finfo(ref.dtype).tiny)))
                         - (7 if ref.dtype == BF16 else 10))
        bad = ~((a == b) | (a.isnan() & b.isnan()) | ((a - b).abs() <= 2 * ulp))
        assert not bad.any(), f"{int(bad.sum())} beyond 2 ulps: {a[bad][:6].tolist()} vs {b[bad][:6].tolist()}"
        return
    torch.testing.assert_close(nat, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.fixture(scope="module")
def native_lib() -> None:
    from npuc.runtime.native_session import runtime_library

    if runtime_library() is None:
        pytest.skip("the native runtime cannot be built here (no C compiler, or NPUC_NATIVE=0)")


@pytest.fixture(scope="module")
def results(native_lib: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from npuc.runtime.native_session import NativeSession

    path = tmp_path_factory.mktemp("npucrt_attention") / "cases.om"
    names, feeds = _build(CASES, path)
    ref = Session.load(str(path), use_native=False).run(feeds)
    nat = NativeSession.load(str(path), threads=2).run({k: _to_numpy(v) for k, v in feeds.items()})
    return {c.id: (_from_native(nat[names[c.id]], ref[names[c.id]]), ref[names[c.id]]) for c in CASES}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_op(c: Case, results: dict[str, Any]) -> None:
    nat, ref = results[c.id]
    compare(nat, ref)


def test_masked_rows_as_reference(results: dict[str, Any]) -> None:
    """The reference's own convention, which the cases above hold the kernel to."""
    assert (results["fused-masked-row-bool"][1][0, :, 2] == 0).all()
    assert (results["fused-masked-row-add"][1][0, :, 4] == 0).all()
    assert results["fused-masked-row-softcap"][1][0, :, 2].isnan().all()
    assert results["fused-masked-row-sinks"][1][0, :, 4].isfinite().all()


_BAD = [
    Case("attention-past-end", "cached_attention", [*qkv(1, 2, 1, 2, 40), torch.tensor([3, 40])],
         {"scale": 0.5, "window": 4}),
    Case("attention-negative", "cached_attention", [*qkv(2, 2, 1, 2, 40), torch.tensor([[0, 1], [-1, 0]], dtype=I32)],
         {"scale": 0.5}),
    Case("rope-past-end", "rope_lut", [randn(1, 2, 2, 8), torch.tensor([0, 9]), randn(9, 4), randn(9, 4)], {}),
    Case("rotary-negative", "rotary_embedding", [randn(1, 2, 2, 8), randn(9, 4), randn(9, 4),
                                                 torch.tensor([[0, -1]], dtype=I32)], {}),
    Case("conv-past-end", "cached_conv1d", [randn(1, 1, 8, 4), randn(4, 1, 3), torch.tensor([8])], {"groups": 4}),
]


@pytest.mark.parametrize("c", _BAD, ids=[c.id for c in _BAD])
def test_position_outside_cache(c: Case, native_lib: None, tmp_path: Path) -> None:
    from npuc.runtime.native_session import NativeSession

    _, feeds = _build([c], tmp_path / "bad.om")
    s = NativeSession.load(str(tmp_path / "bad.om"), threads=1)
    with pytest.raises(NpucError) as e:
        s.run({k: _to_numpy(v) for k, v in feeds.items()})
    assert e.value.code == "NPUC-E0108"


@pytest.mark.parametrize("c", [
    Case("fused-f64", "fused_attention", [t.double() for t in qkv(1, 2, 1, 3, 3)], {"scale": 0.5, "softcap": 1.0}),
    Case("sdpa-batch-broadcast", "sdpa", [randn(2, 2, 3, 4), randn(1, 2, 3, 4), randn(1, 2, 3, 4)], {}),
], ids=lambda c: c.id)
def test_refused_at_load(c: Case, native_lib: None, tmp_path: Path) -> None:
    from npuc.runtime.native_session import NativeSession

    _build([c], tmp_path / "refused.om")
    with pytest.raises(NpucError) as e:
        NativeSession.load(str(tmp_path / "refused.om"))
    assert e.value.code == "NPUC-E0413"
    assert f"({c.op})" in e.value.message


# -- whole models: families that use these ops, compiled and generated by both executors -------------

FAMILIES = {  # family -> the ops of this file its programs must hold
    "gemma2": {"fused_attention", "cached_attention"},  # sliding window, soft-capping (eager)
    "gpt_oss": {"fused_attention", "cached_attention"},  # sinks, sliding window
    "bloom": {"fused_attention", "cached_attention"},  # ALiBi
    "lfm2": {"cached_conv1d", "conv1d"},  # short convolutions
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_generates_as_reference(family: str, native_lib: None, tmp_path: Path) -> None:
    tf = pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from model_matrix import tiny_config

    from npuc.apps.generate import steps
    from npuc.compiler.driver import compile_model
    from npuc.runtime.native_session import NativeSession

    cfg = tiny_config(family)
    if family == "lfm2":
        cfg.layer_types = ["conv", "full_attention"]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(tmp_path / "hf"))
    om = compile_model(str(tmp_path / "hf"), input_shape="input_ids:1,8", output=str(tmp_path / "m"), max_seq_len=48,
                       prefill_logits="all")
    ref = Session.load(om, use_native=False)
    ops = {st.opdef.name for p in ref.programs.values() for st in p.steps}
    assert FAMILIES[family] <= ops, ops
    prompt = [(7 * i + 3) % 90 + 4 for i in range(8)]
    want = list(steps(ref, prompt, 16, ignore_eos=True))
    got = list(steps(NativeSession(om), prompt, 16, ignore_eos=True))
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
