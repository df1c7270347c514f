"""Weight-only quantization: the stored layout, the quantizer, and the two ops that read it.

A quantized weight W [..., K] (K the reduction axis; `linear`'s layout nk) is three
tensors, grouped along K in groups of `group_size` (K itself: one group per row, per
channel):

    q      bits 8: i8 [..., K]           one signed value per weight
           bits 4: u8 [..., K/2]         two per byte: weight 2i in the low nibble, 2i+1
                                         in the high one (ONNX int4's and MatMulNBits' order)
    scale  float [..., K/group_size]    f32, f16 or bf16
    zero   bits 8: i8 [..., K/group_size]; bits 4: u8 [..., K/group_size] (0..15)

    W[..., k] = (q[..., k] - zero[..., k // g]) * scale[..., k // g]     (computed in f32)

Every importer (GPTQ, AWQ, MatMulNBits, blocked DequantizeLinear) and the compile-time
quantizer (`--quant_type`) produce exactly this, so there is one reference of what a
quantized weight means: `dequantize_ref`. `dequantize` is that reference as an op;
`qlinear` is `linear` over a quantized weight (passes/quant_fusion.py makes it), whose
kernels read the packed bytes without ever forming W; `qmoe` is `fused_moe` over quantized
experts, unpacking only the experts a run's tokens pick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from npuc.ir.fused_ops import moe_experts, moe_route
from npuc.ir.ops import ShapeError
from npuc.ir.registry import REGISTRY, Attr, op
from npuc.ir.types import DType, TensorType

T = Sequence[TensorType]
A = Mapping[str, Any]

BITS = (4, 8)
# Zero points 0..15 for 4 bits (unsigned codes), -128..127 for 8 bits (signed codes).
_QMIN = {4: 0, 8: -128}
_QMAX = {4: 15, 8: 127}


def code_dtype(bits: int) -> DType:
    return DType.i8 if bits == 8 else DType.u8


def packed_k(k: int, bits: int) -> int:
    """Bytes per row of `q` for K weights."""
    return k if bits == 8 else k // 2


def unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes as int32 [..., K]: signed for 8 bits, 0..15 for 4 bits."""
    if bits == 8:
        return q.to(torch.int32)
    b = q.to(torch.int32)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [..., K] (K even) into u8 [..., K/2], low nibble first."""
    c = codes.to(torch.int32)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The one definition of a quantized weight's values (module docstring), in f32, then `dtype`."""
    codes = unpack(q, bits).float()
    k = codes.shape[-1]
    groups = k // group_size
    shape = codes.shape[:-1] + (groups, group_size)
    w = (codes.reshape(shape) - zero.to(torch.int32).float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.reshape(codes.shape).to(dtype)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, f16_scale: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest (q, scale, zero) of w [..., K] in groups along K; scale f32, or
    f16 with `f16_scale` (the codes then rounded against the f16 value).

    Symmetric: scale = max|w| / qmax, zero 0 (8 bits) or 8 (4 bits: codes 0..15 around 8).
    Asymmetric: the group's [min, max] (widened to hold 0) onto the whole code range."""
    k = w.shape[-1]
    if k % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group size {group_size} does not divide K={k}")
    g = w.float().reshape(w.shape[:-1] + (k // group_size, group_size))
    qmin, qmax = _QMIN[bits], _QMAX[bits]
    if symmetric:
        half = (qmax - qmin) // 2  # 127 for 8 bits, 7 for 4 bits
        scale = g.abs().amax(-1) / half
        zero = torch.full_like(scale, 0 if bits == 8 else 8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / (qmax - qmin)
        if f16_scale:
            scale = _to_f16(scale)
        zero = (qmin - lo / torch.where(scale > 0, scale, 1)).round().clamp(qmin, qmax)
    if f16_scale:
        scale = _to_f16(scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    codes = (g / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)
    codes = codes.clamp(qmin, qmax).reshape(w.shape).to(torch.int32)
    zero_t = zero.to(torch.int8 if bits == 8 else torch.uint8)
    q = codes.to(torch.int8) if bits == 8 else pack4(codes)
    return q, scale.half() if f16_scale else scale.float(), zero_t


def _to_f16(scale: torch.Tensor) -> torch.Tensor:
    """Scales as f16 values (in f32), rounded up so that no code leaves its range, and
    within f16's range (a group too small for an f16 scale becomes all zeros)."""
    h = scale.clamp(max=65504.0).half().float()
    return torch.where(h < scale, torch.nextafter(h.half(), torch.tensor(65504.0, dtype=torch.half)).float(), h)


def _check_quantized(q: TensorType, scale: TensorType, zero: TensorType, attrs: A) -> int:
    """K of a quantized weight after checking its three parts against each other."""
    bits, g = attrs["bits"], attrs["group_size"]
    if bits not in BITS:
        raise ShapeError(f"bits={bits}; quantized weights have 4 or 8 bits")
    if q.dtype != code_dtype(bits) or zero.dtype != code_dtype(bits):
        raise ShapeError(f"{bits}-bit codes and zero points are {code_dtype(bits)}, got {q.dtype} and {zero.dtype}")
    if not scale.dtype.is_float or q.rank < 1:
        raise ShapeError(f"scale {scale} must be a float tensor beside codes {q}")
    k = q.shape[-1] * (1 if bits == 8 else 2)
    if g < 1 or k % g or (bits == 4 and g % 2):
        raise ShapeError(f"group_size={g} does not divide K={k}")
    want = q.shape[:-1] + (k // g,)
    if scale.shape != want or zero.shape != want:
        raise ShapeError(f"scale {scale} and zero {zero} must be {list(want)} for codes {q} in groups of {g}")
    return k


_QATTRS = {"bits": Attr("int"), "group_size": Attr("int")}


def _dequantize_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    return dequantize_ref(xs[0], xs[1], xs[2], a["bits"], a["group_size"], a["dtype"].torch)


@op("dequantize", ("q", "scale", "zero"), {**_QATTRS, "dtype": Attr("dtype", DType.f32)},
    kernel=_dequantize_kernel, flops=lambda ins, outs, a: 2 * outs[0].numel, unit="vector",
    doc="W = (q - zero) * scale per group of group_size along the last axis, in f32, then dtype; q holds "
        "i8 codes (bits 8) or two u8 nibbles per byte, low first (bits 4); see docs/quantization.md")
def _dequantize(ins: T, attrs: A) -> list[TensorType]:
    q = ins[0]
    k = _check_quantized(q, ins[1], ins[2], attrs)
    if not attrs["dtype"].is_float:
        raise ShapeError(f"dequantize to {attrs['dtype']}: a float dtype is needed")
    return [TensorType(q.shape[:-1] + (k,), attrs["dtype"])]


ACT_BLOCK = 32  # activations quantized per block of 32 along K (act_bits 8)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along the last axis: (codes as f32 [..., K], scales
    f32 [..., K/32]) with scale = max|x| / 127 and code = round_even(x * (127 / max|x|)),
    clamped to +-127, each step one f32 operation as the C kernel does it (kernels_i8.c)."""
    k = x.shape[-1]
    b = x.float().reshape(x.shape[:-1] + (k // ACT_BLOCK, ACT_BLOCK))
    amax = b.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / torch.where(amax > 0, amax, 1), torch.zeros_like(amax))
    codes = torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127)
    return codes.reshape(x.shape[:-1] + (k,)), amax / 127.0


def _int8_activation_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                            group: int) -> torch.Tensor:
    """qlinear with act_bits 8 (docs/quantization.md): each block's dot of integer codes is
    exact (in f32 below 2^24), then scaled by the weight's and the activations' scales."""
    qx, sx = quantize_activations(x)
    w = unpack(q, bits).float() - zero.to(torch.int32).float().repeat_interleave(group, -1)
    sw = scale.float().repeat_interleave(group // ACT_BLOCK, -1)  # [N, K/32]
    lead, k = qx.shape[:-1], qx.shape[-1]
    qx2, sx2 = qx.reshape(-1, k), sx.reshape(-1, k // ACT_BLOCK)
    y = torch.zeros(qx2.shape[0], w.shape[0])
    for b in range(k // ACT_BLOCK):
        cols = slice(b * ACT_BLOCK, (b + 1) * ACT_BLOCK)
        y += (qx2[:, cols] @ w[:, cols].t()) * sx2[:, b:b + 1] * sw[:, b]
    return y.reshape(lead + (w.shape[0],))


def _qlinear_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    if a.get("act_bits") == 8:
        y = _int8_activation_linear(x, xs[1], xs[2], xs[3], a["bits"], a["group_size"])
    else:
        y = F.linear(x.float(), dequantize_ref(xs[1], xs[2], xs[3], a["bits"], a["group_size"]))
    if len(xs) > 4:
        y = y + xs[4].float()
    return y.to(x.dtype)


def _qlinear_flops(ins: T, outs: T, attrs: A) -> int:
    return 2 * outs[0].numel * ins[0].shape[-1]


@op("qlinear", ("x", "q", "scale", "zero", "bias?"), {**_QATTRS, "valid_rows": Attr("int", None, optional=True),
                                                      "act_bits": Attr("int", None, optional=True)},
    kernel=_qlinear_kernel, flops=_qlinear_flops, unit="cube",
    doc="y = x @ dequantize(q, scale, zero)^T + bias, the weight stored [out, in] as dequantize's codes; the "
        "sum is f32, rounded once to x's dtype. valid_rows as linear's. act_bits 8: x is quantized per row and "
        "block of 32 along K to symmetric int8 and each block's codes multiplied in integers (groups a multiple "
        "of 32; scales f16); see docs/quantization.md")
def _qlinear(ins: T, attrs: A) -> list[TensorType]:
    x, q, scale, zero = ins[0], ins[1], ins[2], ins[3]
    k = _check_quantized(q, scale, zero, attrs)
    if q.rank != 2:
        raise ShapeError(f"qlinear codes {q} must be [out, in]")
    if not x.dtype.is_float or x.rank < 1 or x.shape[-1] != k:
        raise ShapeError(f"qlinear weight of K={k} does not fit input {x}")
    rows = attrs["valid_rows"]
    if rows is not None and (x.rank < 2 or not 1 <= rows <= x.shape[-2]):
        raise ShapeError(f"qlinear valid_rows={rows} does not fit input {x}")
    act = attrs.get("act_bits")
    if act is not None and (act != 8 or k % ACT_BLOCK or attrs["group_size"] % ACT_BLOCK or scale.dtype != DType.f16):
        raise ShapeError(f"qlinear act_bits={act}: int8 activations (act_bits 8) need groups a multiple of "
                         f"{ACT_BLOCK} and f16 scales, got group_size={attrs['group_size']}, K={k}, scale {scale}")
    n = q.shape[0]
    if len(ins) == 5 and (ins[4].shape != (n,) or ins[4].dtype != x.dtype):
        raise ShapeError(f"qlinear bias {ins[4]} does not fit {n} outputs of {x.dtype}")
    return [TensorType(x.shape[:-1] + (n,), x.dtype)]


def _qmoe_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, router = xs[0], xs[1]
    gq, gs, gz, dq, ds, dz = xs[2:8]
    bias = xs[8] if len(xs) > 8 else None
    bits, g, dg = a["bits"], a["group_size"], a["down_group_size"]
    idx, weights = moe_route(F.linear(x.float(), router.float()), bias, a)
    return moe_experts(x, idx, weights, lambda e: dequantize_ref(gq[e], gs[e], gz[e], bits, g, x.dtype),
                       lambda e: dequantize_ref(dq[e], ds[e], dz[e], bits, dg, x.dtype), gq.shape[0],
                       dq.shape[2] * (2 if bits == 4 else 1), a["expert_offset"])


def qmoe_dequantized(ins: T, attrs: A) -> list[TensorType]:
    """fused_moe's operands with the experts' weights as dequantize makes them (in x's dtype)."""
    if len(ins) not in (8, 9):
        raise ShapeError("qmoe takes x, router_weight, gate_up's q/scale/zero, down's q/scale/zero and an optional "
                         "correction_bias")
    x = ins[0]
    k_gu = _check_quantized(ins[2], ins[3], ins[4], attrs)
    k_dn = _check_quantized(ins[5], ins[6], ins[7], {**attrs, "group_size": attrs["down_group_size"]})
    gate_up = TensorType(ins[2].shape[:-1] + (k_gu,), x.dtype)
    down = TensorType(ins[5].shape[:-1] + (k_dn,), x.dtype)
    if ins[2].rank != 3 or ins[5].rank != 3:
        raise ShapeError(f"qmoe's expert codes {ins[2]} and {ins[5]} must be [experts, out, in]")
    return [x, ins[1], gate_up, down, *ins[8:]]


_MOE_ATTRS = {k: v for k, v in REGISTRY["fused_moe"].attrs.items()}


@op("qmoe", ("x", "router_weight", "gate_up_q", "gate_up_scale", "gate_up_zero", "down_q", "down_scale", "down_zero",
             "correction_bias?"), {**_MOE_ATTRS, **_QATTRS, "down_group_size": Attr("int")},
    kernel=_qmoe_kernel, flops=lambda ins, outs, a: REGISTRY["fused_moe"].flops(qmoe_dequantized(ins, a), outs, a),
    unit="cube", doc="fused_moe over quantized experts (gate_up and down each as dequantize's q, scale, zero, "
                     "stacked [E, ...], in groups of group_size and down_group_size); an expert's weight is "
                     "unpacked, to x's dtype, only when a token picks it")
def _qmoe(ins: T, attrs: A) -> list[TensorType]:
    return REGISTRY["fused_moe"].infer_types(qmoe_dequantized(ins, attrs), attrs)


def dequantize_attrs(bits: int, group_size: int, dtype: DType) -> dict[str, Any]:
    return {"bits": bits, "group_size": group_size, "dtype": dtype}


__all__ = ["ACT_BLOCK", "BITS", "code_dtype", "dequantize_attrs", "dequantize_ref", "pack4", "packed_k",
           "quantize_activations", "quantize_rtn", "unpack"]
