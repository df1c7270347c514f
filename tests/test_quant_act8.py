"""Integer activations (`--quant_type w8a8|w4a8`): the reference (ir/quant.py's qlinear with
act_bits 8), the C kernel against it (npucrt/src/kernels_i8.c, through ctypes, on whatever
path this host takes: AVX-512 VNNI, AVX-VNNI, AVX2 or plain C), the quantize pass's graph,
and whole models on both executors."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from npuc.ir import DType, TensorType, get_op
from npuc.ir.ops import ShapeError
from npuc.ir.quant import ACT_BLOCK, dequantize_ref, quantize_activations, quantize_rtn

GEN = torch.Generator().manual_seed(34)


def _weight(n: int, k: int, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=GEN) * 0.05
    return quantize_rtn(w, bits, group, symmetric=bits == 8, f16_scale=True)


def test_activation_quantization_is_symmetric_int8_per_block() -> None:
    x = torch.randn(3, 96, generator=GEN)
    x[1, 32:64] = 0  # an all-zero block: codes 0, scale 0
    codes, scale = quantize_activations(x)
    assert scale.shape == (3, 3) and float(codes.abs().max()) == 127
    assert bool((codes == codes.round()).all()) and float(scale[1, 1]) == 0 and not codes[1, 32:64].any()
    back = codes * scale.repeat_interleave(ACT_BLOCK, -1)
    assert bool(((back - x).abs() <= scale.repeat_interleave(ACT_BLOCK, -1) / 2 + 1e-7).all())


def test_int8_activation_reference_is_blockwise_integer_dots() -> None:
    """act_bits 8 computes sum_b sx_b * sw_b * (int dot of block b) (docs/quantization.md),
    checked here in float64 against the codes, and close to the float-activation product."""
    q, s, z = _weight(8, 128, 4, 64)
    x = torch.randn(5, 128, generator=GEN)
    got = get_op("qlinear").run([x, q, s, z], {"bits": 4, "group_size": 64, "act_bits": 8})[0]
    qx, sx = quantize_activations(x)
    w = dequantize_ref(q, torch.ones_like(s, dtype=torch.float32), z, 4, 64).double()  # codes - zero
    sw = s.double().repeat_interleave(64 // ACT_BLOCK, -1)
    want = torch.zeros(5, 8, dtype=torch.float64)
    for b in range(128 // ACT_BLOCK):
        c = slice(b * ACT_BLOCK, (b + 1) * ACT_BLOCK)
        want += (qx[:, c].double() @ w[:, c].t()) * sx[:, b:b + 1].double() * sw[:, b]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    floaty = get_op("qlinear").run([x, q, s, z], {"bits": 4, "group_size": 64})[0]
    assert float((got - floaty).norm() / floaty.norm()) < 0.02  # int8 activations lose little


@pytest.mark.parametrize("attrs, scale_dt, msg", [
    ({"bits": 8, "group_size": 32, "act_bits": 8}, DType.f16, None),
    ({"bits": 8, "group_size": 32, "act_bits": 8}, DType.f32, "f16 scales"),
    ({"bits": 8, "group_size": 32, "act_bits": 4}, DType.f16, "act_bits=4"),
])
def test_qlinear_act_bits_shape_rule(attrs: dict[str, int], scale_dt: DType, msg: str | None) -> None:
    ins = [TensorType((2, 64), DType.f32), TensorType((8, 64), DType.i8), TensorType((8, 2), scale_dt),
           TensorType((8, 2), DType.i8)]
    if msg is None:
        assert get_op("qlinear").infer_types(ins, attrs) == [TensorType((2, 8), DType.f32)]
    else:
        with pytest.raises(ShapeError, match=msg):
            get_op("qlinear").infer_types(ins, attrs)


# -- the C kernel ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    from npuc.runtime.native import library

    lib = library()
    if lib is None:
        pytest.skip("no C compiler: the native library is not built here")
    return lib


def _c_i8linear(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int,
                group: int, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    n, k = s.shape[0], x.shape[-1]
    packed = torch.zeros(lib.npuc_i8_packed_bytes(bits, n, k), dtype=torch.uint8)
    assert lib.npuc_i8_pack(q.data_ptr(), bits, s.data_ptr(), z.data_ptr(), n, k, group, packed.data_ptr()) == 0
    m = x.shape[0]
    y = torch.full((m, n), float("nan"), dtype=x.dtype)
    scratch = torch.empty(lib.npuc_i8linear_scratch_bytes(m, k), dtype=torch.uint8)
    rc = lib.npuc_i8linear(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, packed.data_ptr(), bits, n, k,
                           bias.data_ptr() if bias is not None else None, y.data_ptr(), int(y.dtype == torch.bfloat16),
                           n, scratch.data_ptr(), threads)
    assert rc == 0
    return y


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m, n, k, group", [(1, 37, 64, 32), (3, 64, 256, 64), (9, 21, 96, 32), (16, 8, 128, 128)])
def test_c_kernel_matches_the_reference(lib: ctypes.CDLL, bits: int, m: int, n: int, k: int, group: int) -> None:
    q, s, z = _weight(n, k, bits, group)
    x = torch.randn(m, k, generator=GEN)
    x[0, :ACT_BLOCK] = 0  # a zero block
    bias = torch.randn(n, generator=GEN)
    want = get_op("qlinear").run([x, q, s, z, bias], {"bits": bits, "group_size": group, "act_bits": 8})[0]
    for threads in (1, 2):
        got = _c_i8linear(lib, x, q, s, z, bits, group, bias, threads)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=f"path {lib.npuc_i8_path().decode()}")


def test_c_kernel_bf16_rounds_the_f32_sum_once(lib: ctypes.CDLL) -> None:
    q, s, z = _weight(24, 128, 4, 32)
    x = torch.randn(4, 128, generator=GEN).to(torch.bfloat16)
    want = get_op("qlinear").run([x, q, s, z], {"bits": 4, "group_size": 32, "act_bits": 8})[0]
    got = _c_i8linear(lib, x, q, s, z, 4, 32, None, 2)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of nearly the same f32: at most one ulp apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_c_pack_refuses_a_group_it_cannot_hold(lib: ctypes.CDLL) -> None:
    q, s, z = _weight(8, 64, 8, 32)
    packed = torch.zeros(lib.npuc_i8_packed_bytes(8, 8, 64), dtype=torch.uint8)
    assert lib.npuc_i8_pack(q.data_ptr(), 8, s.data_ptr(), z.data_ptr(), 8, 64, 48, packed.data_ptr()) != 0


# -- the pass and whole models -----------------------------------------------------------------------

def _linear_graph(k: int) -> object:
    from npuc.ir import TensorSource, parse_graph

    g = parse_graph(f"""graph main(%x : f32[1,3,{k}]) {{
  const @w : f32[64,{k}]
  const @head : f32[16,64]
  %y : f32[1,3,64] = linear(%x, @w)
  %z : f32[1,3,16] = linear(%y, @head)
  return %z
}}
""")
    for c in g.constants.values():
        c.const = TensorSource(torch.randn(c.type.shape, generator=GEN) * 0.1)
    return g


def test_quantize_pass_emits_int8_activation_products() -> None:
    from npuc.ir import print_graph, verify
    from npuc.passes.quant_fusion import QuantFusion
    from npuc.passes.quantize import Quantize, check_quant

    bits, group, act = check_quant("w4a8", None)
    assert (bits, group, act) == (4, 32, 8)
    g = _linear_graph(96)
    res = Quantize(bits, group, act_bits=act)(g)
    QuantFusion()(g)
    verify(g)
    text = print_graph(g)
    assert "qlinear[act_bits=8, bits=4, group_size=32](%x, @w.q, @w.scale, @w.zero)" in text, text
    assert "qlinear[act_bits=8, bits=8, group_size=32](%y, @head.q" in text, text  # the LM head: 8 bits
    assert "@w.scale : f16[64,3]" in text, text
    assert not res.details["float activations"] and all("int8 activations" in d for d in res.details["quantized"])


def test_a_k_that_is_no_multiple_of_32_keeps_float_activations() -> None:
    from npuc.ir import print_graph
    from npuc.passes.quant_fusion import QuantFusion
    from npuc.passes.quantize import Quantize

    g = _linear_graph(48)  # K=48: int8 per channel for w, float activations
    res = Quantize(8, 32, act_bits=8)(g)
    QuantFusion()(g)
    assert res.details["float activations"] == ["y: K=48, group 48"]
    text = print_graph(g)
    assert text.count("act_bits=8") == 1 and "qlinear[bits=8, group_size=48](%x" in text, text


@pytest.fixture(scope="module")
def act8_models(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from npuc.compiler.driver import compile_model

    root = tmp_path_factory.mktemp("act8")
    return {q: Path(compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=32,
                                  output=str(root / q), quant_type=q, precision_mode="force_fp32"))
            for q in ("w8a8", "w4a8")}


def _logits(sess: object, prompt: list[int], new: int) -> list[tuple[int, np.ndarray]]:
    from npuc.apps.generate import steps

    return [(t, np.asarray(lg, dtype=np.float32).copy()) for t, lg in steps(sess, prompt, new, ignore_eos=True)]


@pytest.mark.parametrize("quant", ["w8a8", "w4a8"])
def test_both_executors_agree_with_the_reference(quant: str, act8_models: dict[str, Path]) -> None:
    """The C executor, the Python executor's native launchers and the torch reference run
    the same integer products; the scales in another order only."""
    from npuc.runtime import Session
    from npuc.runtime.native_session import NativeSession

    om = act8_models[quant]
    ref = _logits(Session.load(str(om), use_native=False), [5, 17, 3, 99, 42], 6)
    scale = max(float(np.abs(lg).max()) for _, lg in ref)
    for sess in (NativeSession(str(om)), Session.load(str(om))):
        got = _logits(sess, [5, 17, 3, 99, 42], 6)
        assert [t for t, _ in got] == [t for t, _ in ref], type(sess).__name__
        err = max(float(np.abs(a - b).max()) for (_, a), (_, b) in zip(got, ref, strict=True))
        assert err <= 1e-4 * scale, f"{type(sess).__name__}: {err}"


def test_int8_activations_stay_close_to_the_float_model(act8_models: dict[str, Path], gen_models: dict[str, Path]
                                                        ) -> None:
    from npuc.runtime import Session

    fp = _logits(Session.load(str(gen_models["llama"])), [5, 17, 3, 99, 42], 1)[0][1]
    for quant, tol in (("w8a8", 0.05), ("w4a8", 0.25)):
        got = _logits(Session.load(str(act8_models[quant])), [5, 17, 3, 99, 42], 1)[0][1]
        rel = float(np.linalg.norm(got - fp) / np.linalg.norm(fp))
        assert rel < tol, f"{quant}: {rel}"


def test_the_om_lists_its_int8_activation_products(act8_models: dict[str, Path]) -> None:
    from npuc.runtime import Session

    sess = Session.load(str(act8_models["w4a8"]))
    ops = [s for p in sess.programs.values() for s in p.steps if s.opdef.name == "qlinear"]
    assert ops and all(s.attrs.get("act_bits") == 8 for s in ops)
