"""The runtime's native CPU kernels (npucrt/src/kernels.c) against the registry's
reference kernels, op by op and through whole programs; their build, fallback and
refusals. Speed is measured in bench/run.py, never here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from npuc.errors import NpucError
from npuc.ir import DType, get_op
from npuc.ir.fused_ops import quantize_kv_rows
from npuc.runtime import Session, native
from npuc.runtime.launch import GEMV_MAX_ROWS, Bound, Launchers, tail_rows_read

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the runtime uses its torch kernels (tested below too)")


@pytest.fixture(scope="module", params=["host", "portable"])
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The kernels as the runtime builds them (-march=native: AVX2 paths on x86), and built
    for no particular CPU (the plain C paths an ARM host or an old x86 runs)."""
    if request.param == "host":
        lib = native.library()
    else:
        mp = pytest.MonkeyPatch()
        mp.setattr(native, "_VARIANTS", ((),))
        mp.setenv("NPUC_CACHE_DIR", str(tmp_path_factory.mktemp("portable")))
        native.reset()
        try:
            lib = native.library()
        finally:
            native.reset()
            mp.undo()
    assert lib is not None, "a C compiler is present, so the native kernels must build"
    return lib


def _launch(lib: Any, name: str, ins: list[torch.Tensor], attrs: dict[str, Any], out_like: list[torch.Tensor]
            ) -> tuple[str, list[torch.Tensor]]:
    """Run op `name` through the kernel the runtime would choose; (its kind, outputs)."""
    od = get_op(name)
    outs = [torch.full_like(t, float("nan")) if t.is_floating_point() else torch.empty_like(t) for t in out_like]
    if od.inplace is not None:
        outs = [ins[od.inplace]]
    ls = Launchers(lib)
    b = Bound(od, od.full_attrs(attrs), ins, outs, None)
    kind, f = ls._choose(b)
    assert f is not None
    f()
    return kind, outs


def _ref(name: str, ins: list[torch.Tensor], attrs: dict[str, Any]) -> torch.Tensor:
    return get_op(name).run([t.clone() for t in ins], attrs)[0]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * max(1.0, want.abs().max().item()), rtol=tol)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(64, 768), (37, 19), (1030, 2048)])
def test_linear_f32(lib: Any, layout: str, rows: int, bias: bool, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(1, rows, k, generator=g)
    w = torch.randn(n, k, generator=g) if layout == "nk" else torch.randn(k, n, generator=g)
    ins = [x, w] + ([torch.randn(n, generator=g)] if bias else [])
    attrs = {"weight_layout": layout}
    want = _ref("linear", ins, attrs)
    kind, (got,) = _launch(lib, "linear", ins, attrs, [want])
    assert kind == "native"
    _close(got, want)


def test_linear_with_more_rows_is_torchs(lib: Any) -> None:
    x, w = torch.randn(2, GEMV_MAX_ROWS, 64), torch.randn(32, 64)
    want = _ref("linear", [x, w], {})
    kind, (got,) = _launch(lib, "linear", [x, w], {}, [want])
    assert kind == "out"
    _close(got, want)


@pytest.mark.parametrize("lead", [1, 3])
def test_linear_valid_rows_computes_only_those(lib: Any, lead: int) -> None:
    """A tile-padded input: rows past valid_rows are padding, left unwritten (NaN here)."""
    x, w = torch.randn(lead, 16, 48), torch.randn(32, 48)
    attrs = {"valid_rows": 2}
    want = _ref("linear", [x, w], attrs)
    kind, (got,) = _launch(lib, "linear", [x, w], attrs, [want])
    assert kind == "native"
    _close(got[:, :2], want[:, :2])
    assert got[:, 2:].isnan().all()


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_prepacked_for_many_rows(layout: str, bias: bool, dtype: torch.dtype) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    x, w = torch.randn(1, 40, 96), torch.randn(72, 96) if layout == "nk" else torch.randn(96, 72)
    ins = [t.to(dtype) for t in [x, w] + ([torch.randn(72)] if bias else [])]
    attrs = {"weight_layout": layout}
    want = _ref("linear", [t.float() for t in ins], attrs)  # the f32 sum of the same operands
    od = get_op("linear")
    ls = Launchers(None, prepack=True)
    out = torch.full(want.shape, float("nan"), dtype=dtype)
    kind, f = ls._choose(Bound(od, od.full_attrs(attrs), ins, [out], None))
    assert kind == "prepacked" and f is not None and ls.packed_bytes >= 72 * 96 * 2
    f()
    _close(out, want, dtype)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m, n, k", [(GEMV_MAX_ROWS + 1, 16, 8), (40, 72, 96), (131, 1030, 1100)])
def test_linear_native_gemm_for_many_rows(lib: Any, layout: str, bias: bool, m: int, n: int, k: int) -> None:
    """Rows and columns that are no multiple of the 6x16 tile, and K over several blocks."""
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(1, m, k, generator=g)
    w = torch.randn(n, k, generator=g) if layout == "nk" else torch.randn(k, n, generator=g)
    ins = [x, w] + ([torch.randn(n, generator=g)] if bias else [])
    attrs = {"weight_layout": layout}
    want = _ref("linear", ins, attrs)
    od = get_op("linear")
    ls = Launchers(lib, prepack=True)
    out = torch.full(want.shape, float("nan"))
    kind, f = ls._choose(Bound(od, od.full_attrs(attrs), ins, [out], None))
    assert kind == "native-gemm" and f is not None and ls.packed_bytes >= n * k * 4
    f()
    _close(out, want)
    w[:] = float("nan")  # the packed copy is what runs, not the mapped weight
    out[:] = float("nan")
    f()
    _close(out, want)


def test_linear_native_gemm_bf16(lib: Any) -> None:
    """bf16 weights are widened at load; the bf16 output is the f32 sum rounded once."""
    xdt = torch.bfloat16  # what the precision pass makes: one dtype for every operand
    g = torch.Generator().manual_seed(7)
    x, w, bias = torch.randn(1, 37, 200, generator=g), torch.randn(50, 200, generator=g), torch.randn(50, generator=g)
    ins = [x.to(xdt), w.to(torch.bfloat16), bias.to(torch.bfloat16)]
    want = ins[0].float() @ ins[1].float().t() + ins[2].float()
    od = get_op("linear")
    out = torch.empty(1, 37, 50, dtype=xdt)
    ls = Launchers(lib, prepack=True)  # owns the packed weight: kept while its launcher runs
    kind, f = ls._choose(Bound(od, od.full_attrs({}), ins, [out], None))
    assert kind == "native-gemm" and f is not None
    f()
    _close(out, want, xdt)


@pytest.mark.parametrize("lead", [1, 3])
def test_linear_native_gemm_computes_only_valid_rows(lib: Any, lead: int) -> None:
    x, w = torch.randn(lead, 32, 48), torch.randn(40, 48)
    attrs = {"valid_rows": 20}
    want = _ref("linear", [x, w], attrs)
    od = get_op("linear")
    out = torch.full(want.shape, float("nan"))
    ls = Launchers(lib, prepack=True)
    kind, f = ls._choose(Bound(od, od.full_attrs(attrs), [x, w], [out], None))
    assert kind == "native-gemm" and f is not None
    f()
    _close(out[:, :20], want[:, :20])
    assert out[:, 20:].isnan().all()


@pytest.mark.parametrize("bits, group, symmetric", [(8, None, True), (8, 32, True), (4, 128, False), (4, 32, True)])
@pytest.mark.parametrize("rows", [1, 5, GEMV_MAX_ROWS + 1, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear(lib: Any, bits: int, group: int | None, symmetric: bool, rows: int, dtype: torch.dtype) -> None:
    """The quantized GEMV (few rows) and GEMM (more) against the reference's dequantize-then-product."""
    from npuc.ir.quant import quantize_rtn

    g = torch.Generator().manual_seed(bits * rows)
    n, k = 70, 256
    q, scale, zero = quantize_rtn(torch.randn(n, k, generator=g), bits, group or k, symmetric)
    ins = [torch.randn(1, rows, k, generator=g).to(dtype), q, scale, zero, torch.randn(n, generator=g).to(dtype)]
    attrs = {"bits": bits, "group_size": group or k}
    want = _ref("qlinear", ins, attrs)
    kind, (got,) = _launch(lib, "qlinear", ins, attrs, [want])
    assert kind == "native"
    _close(got, want, dtype)


@pytest.mark.parametrize("bits, group", [(4, 128), (4, 64), (8, None), (8, 32), (8, 2048 + 64)])
def test_qlinear_bf16_activations_against_an_exact_product(lib: Any, bits: int, group: int | None) -> None:
    """bf16 x, f32 y: the error against an exact product of the same bf16 x stays under
    1e-4 of the output's size (small values beside large ones in a group, and a group
    longer than 2048, included)."""
    from npuc.ir.quant import dequantize_ref, quantize_rtn

    g = torch.Generator().manual_seed(bits)
    n, k = 36, 2 * (2048 + 64)
    q, scale, zero = quantize_rtn(torch.randn(n, k, generator=g), bits, group or k, bits == 8)
    x = torch.randn(1, 1, k, generator=g)
    x[..., :40] *= 1e-3
    x = x.to(torch.bfloat16)
    G = group or k
    want = x.double() @ dequantize_ref(q, scale, zero, bits, G).double().T
    got = torch.full((1, 1, n), float("nan"))  # f32, so that no output rounding hides the error
    ws = torch.empty(int(lib.npuc_qlinear_scratch_floats(1, k, G)))
    sf, zf = scale.float().contiguous(), zero.float().contiguous()
    assert lib.npuc_qlinear(x.data_ptr(), 1, 1, k, q.data_ptr(), bits, sf.data_ptr(), zf.data_ptr(), n, k, G, None,
                            got.data_ptr(), 0, n, ws.data_ptr(), 2) == 0
    assert (got.double() - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("k, group", [(200, None), (200, 40), (24, None)])
def test_qlinear_int8_k_past_the_vector_width(lib: Any, k: int, group: int | None) -> None:
    """int8 codes whose groups end inside a 16-wide step: the scalar tail of each group."""
    from npuc.ir.quant import quantize_rtn

    g = torch.Generator().manual_seed(k)
    q, scale, zero = quantize_rtn(torch.randn(36, k, generator=g), 8, group or k, True)
    ins = [torch.randn(1, 1, k, generator=g), q, scale, zero]
    attrs = {"bits": 8, "group_size": group or k}
    want = _ref("qlinear", ins, attrs)
    kind, (got,) = _launch(lib, "qlinear", ins, attrs, [want])
    assert kind == "native"
    _close(got, want, torch.float32)


def test_qlinear_valid_rows(lib: Any) -> None:
    from npuc.ir.quant import quantize_rtn

    q, scale, zero = quantize_rtn(torch.randn(40, 64), 4, 32, False)
    for m in (16, 32):  # the GEMV and the GEMM
        x = torch.randn(2, m, 64)
        attrs = {"bits": 4, "group_size": 32, "valid_rows": 3 if m == 16 else 20}
        want = _ref("qlinear", [x, q, scale, zero], attrs)
        kind, (got,) = _launch(lib, "qlinear", [x, q, scale, zero], attrs, [want])
        v = attrs["valid_rows"]
        assert kind == "native"
        _close(got[:, :v], want[:, :v])
        assert got[:, v:].isnan().all()


@pytest.mark.parametrize("k", [768, 27])
def test_linear_bf16_weights(lib: Any, k: int) -> None:
    xdt = ydt = torch.bfloat16  # what the precision pass makes: one dtype for every operand
    g = torch.Generator().manual_seed(k)
    x, w, bias = torch.randn(1, 2, k, generator=g), torch.randn(70, k, generator=g), torch.randn(70, generator=g)
    wb = w.to(torch.bfloat16)
    ins = [x.to(xdt), wb, bias.to(torch.bfloat16)]
    # the sum over bf16 operands, in f32, rounded once: what a bf16 kernel owes
    want = (x.to(xdt).float() @ wb.float().t() + bias.to(torch.bfloat16).float())
    od = get_op("linear")
    outs = [torch.empty(1, 2, 70, dtype=ydt)]
    ls = Launchers(lib)
    kind, f = ls._choose(Bound(od, od.full_attrs({}), ins, outs, None))
    assert kind == "native" and f is not None
    f()
    _close(outs[0], want, ydt)


def test_rms_norm(lib: Any) -> None:
    x, scale = torch.randn(3, 5, 768), torch.randn(768)
    attrs = {"axis": -1, "eps": 1e-6}
    want = _ref("rms_norm", [x, scale], attrs)
    kind, (got,) = _launch(lib, "rms_norm", [x, scale], attrs, [want])
    assert kind == "native"
    _close(got, want)


@pytest.mark.parametrize("layout", ["half", "interleaved", "deinterleave"])
@pytest.mark.parametrize("d, half", [(64, 32), (96, 16)])
def test_rope_lut(lib: Any, layout: str, d: int, half: int) -> None:
    x, pos = torch.randn(2, 4, 3, d), torch.tensor([7, 0, 11])
    ang = torch.arange(12)[:, None] * torch.rand(half)[None, :]
    ins = [x, pos, ang.cos(), ang.sin()]
    attrs = {"layout": layout}
    want = _ref("rope_lut", ins, attrs)
    kind, (got,) = _launch(lib, "rope_lut", ins, attrs, [want])
    assert kind == "native"
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write(lib: Any, dtype: torch.dtype) -> None:
    cache = torch.randn(1, 4, 32, 16).to(dtype)
    new, pos = torch.randn(1, 4, 3, 16).to(dtype), torch.tensor([5, 6, 31])
    want = _ref("kv_write", [cache, new, pos], {})
    kind, (got,) = _launch(lib, "kv_write", [cache, new, pos], {}, [])
    assert kind == "native" and got.data_ptr() == cache.data_ptr()
    assert torch.equal(got, want)


@pytest.mark.parametrize("qdt, cdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("s, pos", [(1, [40]), (3, [0, 17, 63])])
@pytest.mark.parametrize("d, dv", [(64, 48), (64, 64), (32, 64)])  # 64: the head dim held in registers
def test_cached_attention(lib: Any, qdt: torch.dtype, cdt: torch.dtype, s: int, pos: list[int], d: int, dv: int
                          ) -> None:
    q = torch.randn(2, 8, s, d).to(qdt)
    kc, vc = torch.randn(2, 2, 64, d).to(cdt), torch.randn(2, 2, 64, dv).to(cdt)
    ins = [q, kc, vc, torch.tensor(pos)]
    attrs = {"scale": 0.125}
    want = _ref("cached_attention", [q.float(), kc.float(), vc.float(), torch.tensor(pos)], attrs)
    kind, (got,) = _launch(lib, "cached_attention", ins, attrs, [torch.empty(2, 8, s, dv, dtype=qdt)])
    assert kind == "native"
    _close(got, want, torch.bfloat16 if torch.bfloat16 in (qdt, cdt) else torch.float32)


# -- KV caches of every layout (issue 35): f32, bf16, f16, packed int8 rows of D + 4 bytes -------

_KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def _cache(b: int, h: int, length: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A cache of random rows in `dtype`'s layout (int8: quantized by the reference)."""
    rows = torch.randn(b, h, length, d, generator=g)
    return quantize_kv_rows(rows) if dtype == torch.int8 else rows.to(dtype)


@pytest.mark.parametrize("cdt", _KV_DTYPES)
@pytest.mark.parametrize("ndt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_seq, slot", [(False, None), (True, None), (False, 2)])
def test_kv_write_every_layout(lib: Any, cdt: torch.dtype, ndt: torch.dtype, per_seq: bool, slot: int | None
                               ) -> None:
    """Rows f32 or bf16 into each layout: bit-identical to the reference's rounding and
    quantization (half to even), for all sequences, each at its own positions, or one slot."""
    g = torch.Generator().manual_seed(35)
    d, b = 19, 1 if slot is not None else 3  # an odd row: no vector width divides it
    cache = _cache(3, 2, 40, d, cdt, g)
    new = (torch.randn(b, 2, 3, d, generator=g) * 3).to(ndt)
    new[0, 0, 0] = 0.0  # a zero row: scale 0, codes 0
    new[0, 1, 1, :4] = torch.tensor([2.5, -2.5, 0.5, 127.0])  # ties (half to even) and the row's max
    pos = torch.tensor([[5, 6, 39], [0, 1, 2], [37, 38, 39]])[:b] if per_seq else torch.tensor([5, 6, 39])
    ins = [cache, new, pos] + ([torch.tensor([slot])] if slot is not None else [])
    want = _ref("kv_write", ins, {})
    kind, (got,) = _launch(lib, "kv_write", ins, {}, [])
    assert kind == "native" and got.data_ptr() == cache.data_ptr()
    assert torch.equal(got.view(torch.uint8) if cdt == torch.int8 else got, want.view(torch.uint8)
                       if cdt == torch.int8 else want)


def test_kv_write_int8_ties_round_half_to_even(lib: Any) -> None:
    """x / scale exactly on .5: codes of a row with max 127 are x itself, so 2.5 -> 2, 3.5 -> 4."""
    cache = torch.zeros(1, 1, 2, 8 + 4, dtype=torch.int8)
    row = torch.tensor([2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 127.0, -126.5]).reshape(1, 1, 1, 8)
    kind, (got,) = _launch(lib, "kv_write", [cache, row, torch.tensor([1])], {}, [])
    assert kind == "native"
    assert got[0, 0, 1, 4:].tolist() == [2, 4, -2, -4, 0, 2, 127, -126]
    assert got[0, 0, 1, :4].view(torch.float32).item() == 1.0


def _attention_case(b: int, hq: int, hkv: int, s: int, length: int, d: int, dv: int, cdt: torch.dtype,
                    qdt: torch.dtype, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, s, d, generator=g)).to(qdt)
    return [q, _cache(b, hkv, length, d, cdt, g), _cache(b, hkv, length, dv, cdt, g)], torch.empty(b, hq, s, dv,
                                                                                                   dtype=qdt)


@pytest.mark.parametrize("cdt", _KV_DTYPES)
@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, hq, hkv, s, length, d, dv, pos", [
    (1, 12, 12, 1, 64, 64, 64, [63]),                      # the 125M's decode, at the cache's last row
    (2, 8, 2, 1, 300, 64, 64, [[299], [7]]),               # GQA 4:1, two slots at their own depths
    (1, 4, 1, 3, 50, 24, 40, [0, 17, 49]),                 # three queries, MQA, head dims 24 / 40
    (2, 6, 3, 2, 33, 19, 13, [[0, 32], [5, 6]]),           # odd dims: the scalar paths
    (1, 2, 1, 1, 1500, 64, 64, [1499]),                    # long: split across threads and merged
    (2, 6, 2, 1, 77, 32, 32, [[75], [76]]),                # GQA 3:1, keys not a multiple of 4
    (2, 6, 2, 1, 77, 64, 64, [[75], [76]]),                # GQA 3:1 at head dim 64 (the 125M bench's)
    (1, 32, 1, 2, 90, 16, 16, [40, 89]),                   # 64 query rows of one kv head: two blocks
])
def test_cached_attention_every_layout(lib: Any, cdt: torch.dtype, qdt: torch.dtype, b: int, hq: int, hkv: int,
                                       s: int, length: int, d: int, dv: int, pos: list) -> None:
    ins, out = _attention_case(b, hq, hkv, s, length, d, dv, cdt, qdt, seed=b * 1000 + length + d)
    ins.append(torch.tensor(pos))
    attrs = {"scale": d ** -0.5}
    want = _ref("cached_attention", ins, attrs)
    kind, (got,) = _launch(lib, "cached_attention", ins, attrs, [out])
    assert kind == "native"
    _close(got, want, torch.bfloat16 if qdt == torch.bfloat16 else torch.float32)


@pytest.mark.parametrize("nt", [1, 2, 3, 8])
@pytest.mark.parametrize("cdt", _KV_DTYPES)
def test_cached_attention_splits_merge_as_one(lib: Any, nt: int, cdt: torch.dtype) -> None:
    """Flash-decoding: however many threads (so splits) a long cache is cut into, the merged
    partial softmaxes give the reference's output; slots at different depths, the shallow one
    with splits past its keys."""
    b, hq, hkv, length, d = 2, 4, 1, 2100, 64
    ins, out = _attention_case(b, hq, hkv, 1, length, d, d, cdt, torch.float32, seed=nt)
    pos = torch.tensor([[2099], [300]])
    want = _ref("cached_attention", [*ins, pos], {"scale": 0.125})
    kind = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}[cdt]
    ws = torch.empty(lib.npuc_cached_attention_scratch_floats(b, hq, 1, d, hkv, length, d, nt))
    q, kc, vc = ins
    rc = lib.npuc_cached_attention(q.data_ptr(), 0, kc.data_ptr(), vc.data_ptr(), kind, pos.data_ptr(), 1,
                                   out.data_ptr(), 0, b, hq, 1, d, hkv, length, d, 0.125, ws.data_ptr(), nt)
    assert rc == 0
    _close(out, want)


def test_cached_attention_refuses_a_bad_layout_or_position(lib: Any) -> None:
    q, kc = torch.ones(1, 2, 1, 8), torch.ones(1, 1, 8, 8)
    out, ws = torch.empty(1, 2, 1, 8), torch.empty(lib.npuc_cached_attention_scratch_floats(1, 2, 1, 8, 1, 8, 8, 2))
    for kind, pos in [(4, 0), (-1, 0), (0, 8), (0, -1), (3, 8)]:
        p = torch.tensor([pos])
        assert lib.npuc_cached_attention(q.data_ptr(), 0, kc.data_ptr(), kc.data_ptr(), kind, p.data_ptr(), 0,
                                         out.data_ptr(), 0, 1, 2, 1, 8, 1, 8, 8, 1.0, ws.data_ptr(), 2) != 0
    assert lib.npuc_kv_write(kc.data_ptr(), 5, q.data_ptr(), 0, torch.tensor([0]).data_ptr(), 0, -1, 1, 1, 8, 1,
                             8) != 0


@pytest.mark.parametrize("s, length, causal", [(128, 128, True), (300, 300, True), (40, 700, False),
                                               (530, 530, True)])
def test_prefill_attention_tiles_match_sdpa(lib: Any, s: int, length: int, causal: bool) -> None:
    """Prefill's GEMM attention over key tiles with an online softmax: lengths across tile
    edges (256 keys), GQA, and all keys (not causal)."""
    g = torch.Generator().manual_seed(s + length)
    q, k, v = torch.randn(1, 4, s, 32, generator=g), torch.randn(1, 2, length, 32, generator=g), \
        torch.randn(1, 2, length, 48, generator=g)
    attrs = {"scale": 0.2, "causal": causal}
    want = _ref("fused_attention", [q, k, v], attrs)
    kind, (got,) = _launch(lib, "fused_attention", [q, k, v], attrs, [torch.empty(1, 4, s, 48)])
    assert kind == "native"
    _close(got, want)


@pytest.mark.parametrize("name", ["swiglu", "add"])
@pytest.mark.parametrize("n", [2048, 1000003])  # decode's size; a prefill's, cut over the pool with a tail
def test_elementwise(lib: Any, name: str, n: int) -> None:
    a, b = torch.randn(1, 1, n) * 30, torch.randn(1, 1, n)
    a.view(-1)[:6] = torch.tensor([100.0, -100.0, 89.0, -89.0, 0.0, -0.0])  # past exp's clamp, either side
    want = _ref(name, [a, b], {})
    kind, (got,) = _launch(lib, name, [a, b], {}, [want])
    assert kind == "native"
    _close(got, want)


def test_swiglu_keeps_nan_and_inf(lib: Any) -> None:
    a = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0] * 4)
    b = torch.ones(16)
    want = _ref("swiglu", [a, b], {})
    _, (got,) = _launch(lib, "swiglu", [a, b], {}, [want])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_cast(lib: Any, src: torch.dtype, dst: torch.dtype) -> None:
    x = (torch.randn(3, 1000) * 100).to(src)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2 ** -8]).to(src)
    attrs = {"dtype": DType.from_torch(dst)}
    want = _ref("cast", [x], attrs)
    od = get_op("cast")
    out = torch.empty(3, 1000, dtype=dst)
    kind, f = Launchers(lib)._choose(Bound(od, od.full_attrs(attrs), [x], [out], None))
    assert kind == "native" and f is not None
    f()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_rms_norm_over_many_rows(lib: Any) -> None:
    x, scale = torch.randn(1, 777, 256), torch.randn(256)
    attrs = {"axis": -1, "eps": 1e-5}
    want = _ref("rms_norm", [x, scale], attrs)
    kind, (got,) = _launch(lib, "rms_norm", [x, scale], attrs, [want])
    assert kind == "native"
    _close(got, want)


@pytest.mark.parametrize("shape, perm", [((1, 128, 12, 64), (0, 2, 1, 3)), ((2, 3, 5, 7), (3, 1, 0, 2)),
                                         ((33, 70), (1, 0)), ((4, 9, 6), (1, 0, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_transpose(lib: Any, shape: tuple[int, ...], perm: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * 100).to(dtype)
    want = _ref("transpose", [x], {"perm": perm}).contiguous()
    kind, (got,) = _launch(lib, "transpose", [x], {"perm": perm}, [want])
    assert kind == "native"
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits, group", [(8, 768), (8, 32), (4, 128), (4, 2)])
@pytest.mark.parametrize("sdt, odt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                      (torch.float32, torch.bfloat16)])
def test_dequantize(lib: Any, bits: int, group: int, sdt: torch.dtype, odt: torch.dtype) -> None:
    """Looked-up rows of a quantized table: bit-identical to the reference (the same f32
    operations in the same order, one rounding to the output dtype)."""
    from npuc.ir.quant import quantize_rtn

    q, scale, zero = quantize_rtn(torch.randn(1, 3, 768) * 3, bits, group, symmetric=False)
    attrs = {"bits": bits, "group_size": group, "dtype": DType.from_torch(odt)}
    ins = [q, scale.to(sdt), zero]
    want = _ref("dequantize", ins, attrs)
    kind, (got,) = _launch(lib, "dequantize", ins, attrs, [want])
    assert kind == "native"
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape, pads", [((1, 1, 768), [0, 0, 0, 0, 15, 0]), ((3, 5, 7), [0, 0, 0, 0, 11, 9]),
                                         ((2, 1, 16), [0, 0, 0, 0, 0, 16]), ((6, 4), [0, 0, 12, 4])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pad(lib: Any, shape: tuple[int, ...], pads: list[int], dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * 100).to(dtype)
    want = _ref("pad", [x], {"pads": pads})
    kind, (got,) = _launch(lib, "pad", [x], {"pads": pads}, [want])
    assert kind == "native"
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows_read", [1, 2, 3])
def test_pad_writes_only_the_rows_read(lib: Any, rows_read: int) -> None:
    """A pad read only by products over their valid rows writes those rows (x's, with the
    zeros after each) and leaves the tile padding below them as it was."""
    x, pads = torch.randn(3, 2, 7), [0, 0, 0, 0, 14, 9]
    want = _ref("pad", [x], {"pads": pads})
    out = torch.full_like(want, float("nan"))
    od = get_op("pad")
    kind, f = Launchers(lib)._choose(Bound(od, od.full_attrs({"pads": pads}), [x], [out], None, rows_read))
    assert kind == "native" and f is not None
    f()
    assert torch.equal(out[:, :rows_read], want[:, :rows_read])
    assert out[:, rows_read:].isnan().all()


@pytest.mark.parametrize("pads, value", [([0, 0, 1, 0, 15, 0], None), ([0, 0, 0, 0, 15, 0], torch.tensor(2.0)),
                                         ([0, 0, 0, 1, 15, 0], None)])
def test_pad_elsewhere_is_torchs(lib: Any, pads: list[int], value: torch.Tensor | None) -> None:
    """Padding before the data, on a leading axis, or with another value: the out-kernel's."""
    x = torch.randn(2, 1, 8)
    ins = [x] + ([value] if value is not None else [])
    want = _ref("pad", ins, {"pads": pads})
    kind, (got,) = _launch(lib, "pad", ins, {"pads": pads}, [want])
    assert kind == "out"
    assert torch.equal(got, want)


def test_tail_rows_read_only_where_products_alone_read_the_padding() -> None:
    from types import SimpleNamespace as NS

    def st(op: str, ins: tuple[int, ...], outs: tuple[int, ...], **attrs: Any) -> Any:
        return NS(opdef=get_op(op), inputs=ins, outputs=outs, attrs=attrs)

    steps = [st("pad", (0,), (1,)), st("linear", (1, 9), (2,), valid_rows=1), st("qlinear", (1, 8), (3,), valid_rows=2),
             st("pad", (0,), (4,)), st("linear", (4, 9), (5,), valid_rows=1), st("add", (4, 5), (6,)),  # 4: an add too
             st("pad", (0,), (7,)), st("linear", (7, 9), (10,)),  # no valid_rows: every row is computed
             st("pad", (0,), (11,)), st("linear", (11, 11), (12,), valid_rows=1),  # the padded value as the weight
             st("pad", (0,), (13,)), st("linear", (13, 9), (14,), valid_rows=1)]  # 13: a program output
    assert tail_rows_read(steps, kept={13}) == {0: 2}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s, length, hq, hkv", [(128, 128, 12, 4), (5, 9, 4, 4), (9, 5, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [32, 64])
def test_fused_attention(lib: Any, causal: bool, s: int, length: int, hq: int, hkv: int, dtype: torch.dtype,
                         dv: int) -> None:
    """Prefill's attention: causal with torch's top-left alignment (S < L and S > L too),
    grouped-query heads, bf16 operands computed in f32."""
    q = torch.randn(2, hq, s, 64).to(dtype)
    k, v = torch.randn(2, hkv, length, 64).to(dtype), torch.randn(2, hkv, length, dv).to(dtype)
    attrs = {"scale": 0.125, "causal": causal}
    want = _ref("fused_attention", [q, k, v], attrs)
    kind, (got,) = _launch(lib, "fused_attention", [q, k, v], attrs, [want])
    assert kind == "native"
    _close(got, want, dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s, length, hq, hkv, d, dv", [(128, 128, 12, 4, 64, 64), (37, 37, 2, 1, 80, 16),
                                                       (9, 5, 4, 2, 16, 48), (20, 200, 3, 3, 32, 32)])
def test_attention_as_gemms(lib: Any, causal: bool, s: int, length: int, hq: int, hkv: int, d: int, dv: int
                            ) -> None:
    """Prefill's f32 attention on the GEMM tile (npuc_attention_gemm), called directly: query
    blocks that do not fill the tile, keys that do not fill a 16-wide panel, grouped-query
    heads, and torch's top-left causal alignment when S != L."""
    q = torch.randn(2, hq, s, d)
    k, v = torch.randn(2, hkv, length, d), torch.randn(2, hkv, length, dv)
    attrs = {"scale": d ** -0.5, "causal": causal}
    want = _ref("fused_attention", [q, k, v], attrs)
    pos = torch.tensor([min(i, length - 1) for i in range(s)] if causal else [length - 1] * s, dtype=torch.int64)
    out = torch.full((2, hq, s, dv), float("nan"))
    ws = torch.full((lib.npuc_attention_gemm_scratch_floats(2, hkv, d, length, dv, 2),), float("nan"))
    assert lib.npuc_attention_gemm(q.data_ptr(), k.data_ptr(), v.data_ptr(), pos.data_ptr(), out.data_ptr(), 2, hq,
                                   s, d, hkv, length, dv, attrs["scale"], ws.data_ptr(), 2) == 0
    _close(out, want)
    bad = torch.tensor([length] * s, dtype=torch.int64)  # a position past the keys: refused, nothing read
    assert lib.npuc_attention_gemm(q.data_ptr(), k.data_ptr(), v.data_ptr(), bad.data_ptr(), out.data_ptr(), 2, hq,
                                   s, d, hkv, length, dv, 1.0, ws.data_ptr(), 2) == 1


def test_masked_fused_attention_is_torchs(lib: Any) -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    mask = torch.zeros(4, 4)
    want = _ref("fused_attention", [q, k, v, mask], {"scale": 0.3})
    kind, (got,) = _launch(lib, "fused_attention", [q, k, v, mask], {"scale": 0.3}, [want])
    assert kind != "native"
    _close(got, want)


def test_broadcasting_add_is_not_native(lib: Any) -> None:
    a, b = torch.randn(4, 8), torch.randn(8)
    want = _ref("add", [a, b], {})
    kind, (got,) = _launch(lib, "add", [a, b], {}, [want])
    assert kind == "out"
    _close(got, want)


@pytest.mark.parametrize("name, ins, attrs, out", [
    ("kv_write", [torch.zeros(1, 2, 8, 4), torch.ones(1, 2, 1, 4), torch.tensor([8])], {}, None),
    ("kv_write", [torch.zeros(1, 2, 8, 4), torch.ones(1, 2, 1, 4), torch.tensor([-1])], {}, None),
    ("cached_attention", [torch.ones(1, 2, 1, 4), torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4),
                          torch.tensor([1 << 40])], {"scale": 1.0}, torch.empty(1, 2, 1, 4)),
    ("kv_write", [torch.zeros(1, 2, 8, 4 + 4, dtype=torch.int8), torch.ones(1, 2, 1, 4), torch.tensor([8])], {},
     None),
    ("cached_attention", [torch.ones(1, 2, 1, 4), torch.ones(1, 2, 8, 4, dtype=torch.float16),
                          torch.ones(1, 2, 8, 4, dtype=torch.float16), torch.tensor([8])], {"scale": 1.0},
     torch.empty(1, 2, 1, 4)),
    ("cached_attention", [torch.ones(1, 2, 1, 4), torch.zeros(1, 1, 8, 8, dtype=torch.int8),
                          torch.zeros(1, 1, 8, 8, dtype=torch.int8), torch.tensor([[-1]])], {"scale": 1.0},
     torch.empty(1, 2, 1, 4)),
    ("rope_lut", [torch.ones(1, 2, 1, 8), torch.tensor([9]), torch.ones(4, 4), torch.ones(4, 4)], {},
     torch.empty(1, 2, 1, 8)),
])
def test_positions_outside_the_cache_or_table_are_refused(lib: Any, name: str, ins: list[torch.Tensor],
                                                          attrs: dict[str, Any], out: torch.Tensor | None) -> None:
    """What the runtime's position check guards, the kernel checks again: a corrupt .om's
    positions come from ops, not inputs, and must never index outside the bytes."""
    od = get_op(name)
    outs = [ins[0] if out is None else out]
    kind, f = Launchers(lib)._choose(Bound(od, od.full_attrs(attrs), ins, outs, None))
    assert kind == "native" and f is not None
    with pytest.raises(NpucError, match="NPUC-E0108"):
        f()


# -- whole programs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host_lib() -> Any:
    lib = native.library()
    assert lib is not None
    return lib


@pytest.fixture(scope="module")
def llama_gen(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from npuc.compiler.driver import compile_model

    root = tmp_path_factory.mktemp("native")
    # Every row's logits: the prefill test below checks the LM head's GEMM over all 16 rows too.
    return {soc: Path(compile_model(str(hf_checkpoints["llama"]), input_shape=f"input_ids:1,{PREFILL}",
                                    output=str(root / soc), max_seq_len=32, soc_version=soc, prefill_logits="all"))
            for soc in ("npu", "cpu")}


PREFILL = 16  # more rows than the GEMV takes: prefill's products are GEMMs


def _decode_logits(s: Session, steps: int = 6) -> list[torch.Tensor]:
    s.reset_state()
    s.run({"input_ids": torch.arange(3, 3 + PREFILL).reshape(1, PREFILL)}, "prefill")
    return [s.run({"input_ids": torch.tensor([[7 + i]]), "position": torch.tensor([PREFILL + i])},
                  "decode")["logits"] for i in range(steps)]


@pytest.mark.parametrize("soc", ["npu", "cpu"])
def test_native_decode_matches_the_torch_kernels(host_lib: Any, llama_gen: dict[str, Path], soc: str) -> None:
    fast, ref = Session.load(str(llama_gen[soc])), Session.load(str(llama_gen[soc]), use_native=False)
    assert fast.launchers.kinds.get("native", 0) > 0 and "native" not in ref.launchers.kinds
    pads = [b for b in fast._bound["decode"] if b.opdef.name == "pad"]
    # The npu target's tile padding of decode's one row: each pad writes that row only.
    assert (len(pads) > 0) == (soc == "npu") and all(b.rows_read == 1 for b in pads)
    for a, b in zip(_decode_logits(fast), _decode_logits(ref), strict=True):
        _close(a, b)


def test_prefill_with_packed_weights_matches_the_torch_kernels(llama_gen: dict[str, Path]) -> None:
    fast = Session.load(str(llama_gen["cpu"]), prepack=True)
    slow = Session.load(str(llama_gen["cpu"]), use_native=False)
    lean = Session.load(str(llama_gen["cpu"]), prepack=False)
    assert fast.launchers.kinds.get("native-gemm", 0) > 0 and fast.launchers.packed_bytes > 0
    assert not {"prepacked", "native-gemm"} & set(lean.launchers.kinds) and lean.launchers.packed_bytes == 0
    ids = {"input_ids": torch.arange(3, 3 + PREFILL).reshape(1, PREFILL)}
    want = slow.run(ids, "prefill")["logits"]
    for s in (fast, lean):
        _close(s.run(ids, "prefill")["logits"], want)


def test_padded_and_unpadded_targets_decode_alike(host_lib: Any, llama_gen: dict[str, Path]) -> None:
    """The npu target pads decode's single row to 16; with valid_rows the host kernel
    computes that one row, and the logits are the cpu target's."""
    npu, cpu = Session.load(str(llama_gen["npu"])), Session.load(str(llama_gen["cpu"]))
    lin = [st for st in npu.programs["decode"].steps if st.opdef.name == "linear"]
    assert lin and all(st.attrs["valid_rows"] == 1 for st in lin)
    for a, b in zip(_decode_logits(npu), _decode_logits(cpu), strict=True):
        _close(a, b)


def test_decode_views_run_nothing(llama_gen: dict[str, Path]) -> None:
    """Decode's head transposes ([1,1,h,d] -> [1,h,1,d]) and the padded products' row slices
    are planned on their operand's bytes, so the runtime drops those steps."""
    s = Session.load(str(llama_gen["npu"]))
    ops = [st.opdef.name for st in s.programs["decode"].steps]
    dropped = [op for op, f in zip(ops, s._per_step["decode"], strict=True) if f is None]
    assert dropped.count("slice") == ops.count("slice") > 0
    assert dropped.count("transpose") == ops.count("transpose") > 0


def test_native_decode_allocates_nothing(host_lib: Any, llama_gen: dict[str, Path]) -> None:
    from npuc.tools.alloc_profile import profile_run

    s = Session.load(str(llama_gen["npu"]))
    step = {"input_ids": torch.tensor([[5]]), "position": torch.tensor([PREFILL + 1])}
    s.run(step, "decode")
    r = profile_run(s, step, "decode", copy_outputs=False)
    assert (r.count, r.bytes) == (0, 0)


@pytest.fixture
def fresh_library() -> Any:
    """native.library() looked up anew in the test, and again after it (it is cached per process)."""
    native.reset()
    yield
    native.reset()


def test_without_a_compiler_the_runtime_uses_torch(monkeypatch: pytest.MonkeyPatch, llama_gen: dict[str, Path],
                                                   tmp_path: Path, fresh_library: None) -> None:
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setenv("NPUC_CACHE_DIR", str(tmp_path))
    assert native.library() is None
    s = Session.load(str(llama_gen["cpu"]))
    assert "native" not in s.launchers.kinds
    ref = Session.load(str(llama_gen["cpu"]), use_native=False)
    for a, b in zip(_decode_logits(s), _decode_logits(ref), strict=True):
        assert torch.equal(a, b)


def test_a_broken_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_library: None) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: error' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("NPUC_CACHE_DIR", str(tmp_path / "cache"))
    assert native.library() is None
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # no half-written library left behind


def test_the_library_is_cached_per_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_library: None) -> None:
    """A cache that holds this host's build is used as it is (the build into an empty or
    damaged cache: the test below)."""
    host = native.library()  # the process's own (built once a session)
    assert host is not None
    monkeypatch.setenv("NPUC_CACHE_DIR", str(tmp_path))
    cached = native.cache_dir() / Path(host._name).name
    cached.parent.mkdir(parents=True)
    shutil.copyfile(host._name, cached)
    mtime = cached.stat().st_mtime_ns
    for _ in range(2):
        native.reset()
        lib = native.library()
        assert lib is not None and Path(lib._name) == cached and cached.stat().st_mtime_ns == mtime  # not rebuilt
    assert list((tmp_path / "kernels").glob("libnpucrt-*.so")) == [cached]


def test_a_damaged_cached_library_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_library: None) -> None:
    host = native.library()  # the process's own (built once a session): its file, as a cache holds it
    assert host is not None
    monkeypatch.setenv("NPUC_CACHE_DIR", str(tmp_path))
    built = native.cache_dir() / Path(host._name).name
    built.parent.mkdir(parents=True)
    shutil.copyfile(host._name, built)
    damaged = tmp_path / "damaged"
    damaged.write_bytes(built.read_bytes()[:100])  # truncated, as a full disk or a crash leaves it
    os.replace(damaged, built)  # a new file: the loaded one stays mapped (in place it would SIGBUS)
    # A fresh process: this one would hand back the library it has loaded from that path.
    r = subprocess.run([sys.executable, "-c", "from npuc.runtime import native; print(native.library() is not None)"],
                       capture_output=True, text=True, env={**os.environ, "NPUC_CACHE_DIR": str(tmp_path)})
    assert r.stdout.strip() == "True", r.stderr
    assert built.stat().st_size > 100


def test_npuc_native_0_turns_them_off(monkeypatch: pytest.MonkeyPatch, fresh_library: None) -> None:
    monkeypatch.setenv("NPUC_NATIVE", "0")
    assert native.library() is None


def test_npuc_native_0_for_a_while_does_not_turn_them_off_for_good(monkeypatch: pytest.MonkeyPatch,
                                                                     fresh_library: None) -> None:
    """A CLI invocation with NPUC_NATIVE=0 in its environment (CliRunner(env=...)) may be the
    process's first lookup; the sessions after it must still run the native kernels."""
    from npuc.runtime.native_session import runtime_library

    monkeypatch.setenv("NPUC_NATIVE", "0")
    assert native.library() is None and runtime_library() is None
    monkeypatch.delenv("NPUC_NATIVE")
    assert native.library() is not None and runtime_library() is not None
    monkeypatch.setenv("NPUC_NATIVE", "0")
    assert runtime_library() is None


@pytest.mark.parametrize("kn", [0, 1])
def test_threads_split_the_columns_exactly(lib: Any, kn: int) -> None:
    """Every output column is written once, whatever N and the thread count (chunks of 16
    or 64 columns, the last one short, more threads than chunks)."""
    k = 200  # 200 * N * 4 bytes: over the size at which a call runs on one thread, for N >= 82
    for n in (1, 17, 63, 65, 129, 300):
        for nt in (1, 2, 3, 5):
            x, w = torch.randn(k), torch.randn(n, k)
            wl = w.t().contiguous() if kn else w
            y = torch.full((n,), float("nan"))
            lib.npuc_linear_f32(x.data_ptr(), 1, k, wl.data_ptr(), kn, n, k, None, y.data_ptr(), n, nt)
            torch.testing.assert_close(y, w @ x, atol=1e-4, rtol=1e-5)


def test_the_thread_pool_over_many_back_to_back_calls(host_lib: Any) -> None:
    """Jobs of changing size and thread count, back to back, as decode issues them: each
    chunk runs once, for its own job (a claim of a finished job's chunk would show here)."""
    g = torch.Generator().manual_seed(0)
    k = 256
    w = torch.randn(700, k, generator=g)
    for i in range(600):
        n = int(torch.randint(64, 700, (1,), generator=g))
        x, y = torch.randn(k, generator=g), torch.full((n,), float("nan"))
        host_lib.npuc_linear_f32(x.data_ptr(), 1, k, w.data_ptr(), 0, n, k, None, y.data_ptr(), n, 2 + i % 3)
        torch.testing.assert_close(y, w[:n] @ x, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name, ins, out", [
    ("linear", [torch.randn(1, 1, 64), torch.randn(256, 64)], torch.zeros(1, 1, 16)),  # the rule: [1, 1, 256]
    ("rms_norm", [torch.randn(4, 64), torch.randn(64)], torch.zeros(2, 64)),
    ("add", [torch.randn(64), torch.randn(64)], torch.zeros(64, dtype=torch.float64)),
])
def test_a_slot_unlike_its_shape_rule_is_never_written_natively(lib: Any, name: str, ins: list[torch.Tensor],
                                                                 out: torch.Tensor) -> None:
    """A damaged .om that declares an output other than its op's shape rule makes of the
    operands: the native kernels, which write by pointer, are not chosen for it."""
    od = get_op(name)
    kind, f = Launchers(lib)._choose(Bound(od, od.full_attrs({}), ins, [out], None))
    assert kind != "native" and f is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_gather_rows(lib: Any, dtype: torch.dtype) -> None:
    """The embedding lookup: rows by index, one counted from the end; an index outside the
    table is refused by the reference kernel, as before, and nothing is written."""
    table = (torch.randn(50, 12) * 50).to(dtype)
    idx = torch.tensor([[3, 49, -1, 0]])
    want = _ref("gather", [table, idx], {"axis": 0})
    kind, (got,) = _launch(lib, "gather", [table, idx], {"axis": 0}, [want])
    assert kind == "native" and torch.equal(got, want)
    with pytest.raises(IndexError):
        _launch(lib, "gather", [table, torch.tensor([[3, 50]])], {"axis": 0}, [torch.empty(1, 2, 12, dtype=dtype)])
