"""Weight-only quantization: the stored layout (ir/quant.py), its ops' shape rules, the
round-to-nearest quantizer, and the passes that insert and fuse it."""

from __future__ import annotations

import pytest
import torch

from npuc.ir import DType, Graph, TensorType, get_op
from npuc.ir.ops import ShapeError
from npuc.ir.quant import dequantize_ref, pack4, quantize_rtn, unpack


def test_int4_packing_is_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]])
    packed = pack4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[1 | 2 << 4, 15, 7 | 9 << 4]]
    assert unpack(packed, 4).tolist() == codes.tolist()


def test_dequantize_is_the_documented_formula() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 8), generator=g)
    scale, zero = torch.rand(3, 2, generator=g) + 0.1, torch.randint(0, 16, (3, 2), generator=g).to(torch.uint8)
    w = dequantize_ref(pack4(codes), scale, zero, 4, 4)
    for n in range(3):
        for k in range(8):
            want = (codes[n, k].item() - zero[n, k // 4].item()) * scale[n, k // 4].item()
            assert w[n, k].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("bits, group, symmetric", [(8, 64, True), (8, 256, True), (4, 32, False),
                                                    (4, 128, False), (4, 128, True)])
def test_round_to_nearest_is_within_half_a_step(bits: int, group: int, symmetric: bool) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits + group)) * 0.05
    w[3, :group] = 0  # an all-zero group: no division by zero, and exact zeros back
    q, scale, zero = quantize_rtn(w, bits, group, symmetric)
    codes = unpack(q, bits)
    lo, hi = (-128, 127) if bits == 8 else (0, 15)
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8) and scale.shape == (48, 256 // group)
    err = (dequantize_ref(q, scale, zero, bits, group) - w).abs()
    step = scale.repeat_interleave(group, dim=1)
    assert bool((err <= step / 2 + 1e-7).all())
    assert bool((dequantize_ref(q, scale, zero, bits, group)[3, :group] == 0).all())


def test_values_on_the_grid_come_back_exactly() -> None:
    scale = torch.tensor([[0.5], [0.25]])
    codes = torch.tensor([[-127, 3, 0, 127], [5, -6, 127, 1]])
    w = codes.float() * scale
    q, s, z = quantize_rtn(w, 8, 4, True)
    assert torch.equal(q.to(torch.int64), codes) and torch.equal(s, scale) and not z.any()


def test_a_group_that_does_not_divide_k_is_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn(torch.randn(4, 96), 4, 64, False)


def _t(shape: tuple[int, ...], dt: DType) -> TensorType:
    return TensorType(shape, dt)


@pytest.mark.parametrize("ins, attrs, msg", [
    ([_t((2, 64), DType.f32), _t((8, 32), DType.u8), _t((8, 2), DType.f32), _t((8, 2), DType.u8)],
     {"bits": 4, "group_size": 32}, None),
    ([_t((2, 64), DType.f32), _t((8, 32), DType.i8), _t((8, 2), DType.f32), _t((8, 2), DType.u8)],
     {"bits": 4, "group_size": 32}, "codes and zero points"),
    ([_t((2, 64), DType.f32), _t((8, 64), DType.i8), _t((8, 3), DType.f32), _t((8, 3), DType.i8)],
     {"bits": 8, "group_size": 32}, "must be"),
    ([_t((2, 64), DType.f32), _t((8, 64), DType.i8), _t((8, 1), DType.f32), _t((8, 1), DType.i8)],
     {"bits": 3, "group_size": 64}, "4 or 8"),
    ([_t((2, 48), DType.f32), _t((8, 64), DType.i8), _t((8, 1), DType.f32), _t((8, 1), DType.i8)],
     {"bits": 8, "group_size": 64}, "does not fit"),
    ([_t((2, 64), DType.f32), _t((8, 64), DType.i8), _t((8, 2), DType.f32), _t((8, 2), DType.i8)],
     {"bits": 8, "group_size": 48}, "does not divide"),
])
def test_qlinear_shape_rule(ins: list[TensorType], attrs: dict[str, int], msg: str | None) -> None:
    od = get_op("qlinear")
    if msg is None:
        assert od.infer_types(ins, attrs) == [_t((2, 8), DType.f32)]
    else:
        with pytest.raises(ShapeError, match=msg):
            od.infer_types(ins, attrs)


def test_qlinear_reference_is_dequantize_then_linear() -> None:
    g = torch.Generator().manual_seed(3)
    q, s, z = quantize_rtn(torch.randn(16, 64, generator=g), 4, 32, False)
    x, b = torch.randn(2, 5, 64, generator=g), torch.randn(16, generator=g)
    attrs = {"bits": 4, "group_size": 32}
    w = get_op("dequantize").run([q, s, z], {**attrs, "dtype": DType.f32})[0]
    got = get_op("qlinear").run([x, q, s, z, b], attrs)[0]
    torch.testing.assert_close(got, get_op("linear").run([x, w, b], {})[0], rtol=1e-5, atol=1e-5)
    # bf16 activations: the f32 sum of the bf16 operands, rounded once
    xb = x.to(torch.bfloat16)
    got = get_op("qlinear").run([xb, q, s, z, b.to(torch.bfloat16)], attrs)[0]
    assert got.dtype == torch.bfloat16
    want = (xb.float() @ w.t() + b.to(torch.bfloat16).float()).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- the passes ----------------------------------------------------------------------------------

def _run(g: Graph, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from ir_build import run_graph

    return run_graph(g, feeds)


_MODEL = """graph main(%ids : i64[1,5]) {
  const @emb : f32[64,256]
  const @w1 : f32[128,256]
  const @w2 : f32[128,256]
  const @head : f32[64,256]
  %h : f32[1,5,256] = gather(@emb, %ids)
  %a : f32[1,5,128] = linear(%h, @w1)
  %b : f32[1,5,256] = linear[weight_layout="kn"](%a, @w2)
  %logits : f32[1,5,64] = linear(%b, @head)
  return %logits
}
"""


def _model() -> Graph:
    from npuc.ir import TensorSource, parse_graph

    g = parse_graph(_MODEL)
    gen = torch.Generator().manual_seed(0)
    for _name, c in list(g.constants.items()):
        c.const = TensorSource(torch.randn(c.type.shape, generator=gen) * 0.1)
    return g


@pytest.mark.parametrize("bits, group", [(4, 128), (4, 32), (8, None)])
def test_quantize_then_fuse(bits: int, group: int | None) -> None:
    """Every product reads codes (qlinear), the table lookup gathers codes, the LM head keeps
    8 bits under w4; numerically each weight is its dequantized self."""
    from npuc.ir import print_graph, verify
    from npuc.passes.quant_fusion import QuantFusion
    from npuc.passes.quantize import Quantize

    g = _model()
    ids = torch.tensor([[1, 5, 63, 0, 7]])
    ref_g = _model()
    q = Quantize(bits, group)(g)
    assert len(q.details["quantized"]) == 4 and not q.details["fallback"]
    # the reference: the same graph over each weight's dequantized values
    for name in ("emb", "w1", "w2", "head"):
        c = ref_g.constants[name]
        head = name == "head" and bits == 4
        w = c.const.load()
        wt = w.t() if name == "w2" else w
        k = wt.shape[-1]
        b, grp = (8, k) if head else (bits, group or k)
        qq, s, z = quantize_rtn(wt, b, grp, b == 8)
        d = dequantize_ref(qq, s, z, b, grp)
        c.const = type(c.const)(d.t().contiguous() if name == "w2" else d)
    QuantFusion()(g)
    verify(g)
    text = print_graph(g)
    assert text.count("= qlinear[") == 3 and "linear(" not in text.replace("qlinear(", "")
    head_bits = 8 if bits == 4 else bits
    assert f"qlinear[bits={head_bits}, group_size=256](%b, @head.q" in text, text
    assert "gather[axis=0](@emb.q, %ids)" in text and "gather[axis=0](@emb.scale, %ids)" in text, text
    torch.testing.assert_close(_run(g, {"ids": ids})[0], _run(ref_g, {"ids": ids})[0], rtol=1e-5, atol=1e-5)


def test_quantize_falls_back_or_refuses_where_the_group_does_not_divide_k() -> None:
    from npuc.errors import NpucError
    from npuc.passes.quantize import Quantize

    g = _model()
    res = Quantize(4, 128)(g)  # w2's K is 128 (fits), the others 256: all fit
    assert not res.details["fallback"]
    g = parse_text_model(k=96)
    res = Quantize(4, 64)(g)
    assert res.details["fallback"] and "int8 per channel" in res.details["fallback"][0]
    with pytest.raises(NpucError, match="NPUC-E0131|do not divide"):
        Quantize(4, 64, strict=True)(parse_text_model(k=96))


def parse_text_model(k: int) -> Graph:
    from npuc.ir import TensorSource, parse_graph

    g = parse_graph(f"""graph main(%x : f32[1,2,{k}]) {{
  const @w : f32[16,{k}]
  const @v : f32[8,16]
  %y : f32[1,2,16] = linear(%x, @w)
  %z : f32[1,2,8] = linear(%y, @v)
  return %z
}}
""")
    for c in g.constants.values():
        c.const = TensorSource(torch.randn(c.type.shape))
    return g


def test_excluded_weights_stay_as_they_are() -> None:
    from npuc.passes.quantize import Quantize

    g = _model()
    res = Quantize(4, 128, exclude=frozenset({"a", "head"}))(g)
    assert sorted(res.details["excluded"]) == ["a: w1", "logits: head"]
    assert {n.inputs[1].name for n in g.nodes if n.op == "linear"} >= {"w1", "head"}


def test_constant_folding_keeps_a_quantized_weight_packed() -> None:
    from npuc.passes.constant_folding import ConstantFolding
    from npuc.passes.quantize import Quantize

    g = _model()
    Quantize(8)(g)
    ConstantFolding()(g)
    assert sum(n.op == "dequantize" for n in g.nodes) == 4
