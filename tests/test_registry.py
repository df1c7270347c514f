"""Tests for the op registry: every op's reference kernel agrees with its shape and
dtype rule, the cost model, and the shape rules' refusals.

`CASES` holds at least one concrete case per registered op; declaring an op
without adding a case here fails `test_every_op_has_a_case`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from npuc.ir import DType, Graph, OpDef, TensorType, all_ops, get_op, parse_graph, print_graph, verify
from npuc.ir.ops import ShapeError

_TYPE_RE = re.compile(r"^(\w+)\[([\d,]*)\]$")


def ty(spec: str) -> TensorType:
    """`"f32[2,3]"` -> TensorType((2, 3), f32)."""
    m = _TYPE_RE.match(spec)
    assert m, spec
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    return TensorType(dims, DType(m.group(1)))


@dataclass(frozen=True)
class Idx:
    """An integer index operand whose values are drawn from [0, high)."""

    spec: str
    high: int


Arg = str | Idx


@dataclass(frozen=True)
class Case:
    args: tuple[Arg, ...]
    attrs: dict[str, Any]

    def types(self) -> list[TensorType]:
        return [ty(a.spec if isinstance(a, Idx) else a) for a in self.args]


def case(*args: Arg, **attrs: Any) -> Case:
    return Case(args, attrs)


def tensor(arg: Arg, gen: torch.Generator) -> torch.Tensor:
    t = ty(arg.spec if isinstance(arg, Idx) else arg)
    if isinstance(arg, Idx):
        return torch.randint(0, arg.high, t.shape, generator=gen, dtype=t.dtype.torch)
    if t.dtype.is_float:
        return torch.randn(t.shape, generator=gen).to(t.dtype.torch)
    if t.dtype == DType.bool:
        return torch.randint(0, 2, t.shape, generator=gen).bool()
    return torch.randint(-8, 8, t.shape, generator=gen).to(t.dtype.torch)


_FLOAT_UNARY = ["neg", "rsqrt", "sqrt", "exp", "log", "cos", "sin", "tanh", "sigmoid", "silu", "relu",
                "reciprocal", "abs", "erf", "floor", "ceil", "round", "sign", "tan", "sinh", "cosh", "asin",
                "acos", "atan", "asinh", "acosh", "atanh", "softplus", "softsign", "mish", "hardswish",
                "expm1", "log1p"]
_ARITH = ["add", "sub", "mul", "div", "pow", "maximum", "minimum"]
_COMPARE = ["eq", "ne", "lt", "le", "gt", "ge"]

CASES: dict[str, list[Case]] = {
    **{name: [case("f32[2,3]"), case("f16[4]")] for name in _FLOAT_UNARY},
    "logical_not": [case("bool[2,3]")],
    "gelu": [case("f32[2,3]"), case("f32[5]", approximate="tanh")],
    "cast": [case("f32[2,3]", dtype=DType.i64), case("i32[4]", dtype=DType.f16), case("f32[3]", dtype=DType.bool)],
    **{name: [case("f32[2,3]", "f32[3]"), case("f32[2,1,3]", "f32[4,1]")] for name in _ARITH},
    "bitwise_and": [case("i64[2,3]", "i64[2,3]"), case("bool[4]", "bool[1]")],
    "bitwise_or": [case("i32[2,3]", "i32[3]"), case("bool[4]", "bool[4]")],
    "bitwise_xor": [case("i64[2,3]", "i64[3]"), case("bool[4]", "bool[4]")],
    "is_nan": [case("f32[2,3]"), case("f16[4]")],
    "is_inf": [case("f32[2,3]"), case("f16[4]", detect_negative=False)],
    "bitwise_not": [case("i64[2,3]"), case("u8[4]"), case("bool[3]")],
    "elu": [case("f32[2,3]"), case("f16[4]", alpha=0.5)],
    "celu": [case("f32[2,3]"), case("f32[4]", alpha=2.0)],
    "selu": [case("f32[2,3]", alpha=1.67, gamma=1.05)],
    "leaky_relu": [case("f32[2,3]"), case("f16[4]", alpha=0.2)],
    "hard_sigmoid": [case("f32[2,3]"), case("f32[4]", alpha=0.5, beta=0.1)],
    "thresholded_relu": [case("f32[2,3]"), case("f16[4]", alpha=0.5)],
    "floor_div": [case("i64[2,3]", "i64[3]"), case("f32[4]", "f32[4]"), case("i32[2,1,3]", "i32[4,1]")],
    "mod": [case("i64[2,3]", "i64[3]"), case("f32[4]", "f32[4]", fmod=True), case("i32[2,1,3]", "i32[4,1]", fmod=True)],
    "gather_elements": [case("f32[3,4]", Idx("i64[2,4]", 3)), case("f32[3,4]", Idx("i32[3,2]", 4), axis=1)],
    "scatter_elements": [case("f32[4,3]", Idx("i64[2,3]", 4), "f32[2,3]"),
                         case("f32[3,5]", Idx("i64[3,2]", 5), "f32[3,2]", axis=1, reduction="add")],
    "pad": [case("f32[2,3]", pads=(1, 0, 0, 2)), case("f32[2,3]", "f32[]", pads=(0, -1, 1, 1)),
            case("i64[4,3]", pads=(2, 1, 1, 2), mode="reflect"), case("f32[3]", pads=(2, 4), mode="wrap"),
            case("f16[2,3]", pads=(1, 1, 1, 1), mode="edge")],
    "topk": [case("f32[3,5]", k=2), case("i64[4,3]", k=3, axis=0, largest=False)],
    "conv1d": [case("f32[2,4,9]", "f32[4,1,3]", pads=(2, 0), groups=4),
               case("f32[1,4,10]", "f32[6,2,3]", "f32[6]", pads=(1, 2), stride=2, dilation=2, groups=2)],
    "einsum": [case("f32[2,3]", "f32[3,4]", equation="ij,jk->ik"), case("f32[2,3,4]", equation="...ij->...ji"),
               case("f32[3]", "f32[3]", equation="i,i")],
    "reduce_min": [case("f32[2,3,4]", axes=(1,)), case("i64[2,3]", axes=(0,), keepdim=True)],
    "reduce_prod": [case("f32[2,3,4]", axes=(0, 2)), case("i64[2,3]", axes=(1,), keepdim=True)],
    "argmax": [case("f32[2,3,4]", axis=1), case("f32[5]", axis=0, keepdim=False, select_last=True)],
    "argmin": [case("f32[2,3,4]", axis=-1, keepdim=False), case("i64[3,2]")],
    "gather_nd": [case("f32[5,4,3]", Idx("i64[2,2]", 4)), case("f32[2,3,4]", Idx("i64[2,1]", 3), batch_dims=1)],
    "scatter_nd": [case("f32[5,4]", Idx("i64[2,1]", 5), "f32[2,4]"),
                   case("f32[4,4]", Idx("i64[3,2]", 4), "f32[3]", reduction="add")],
    "trilu": [case("f32[3,4]"), case("f32[2,4,4]", upper=False, k=-1)],
    "swiglu": [case("f32[2,3,8]", "f32[2,3,8]")],
    "fused_moe": [case("f32[6,16]", "f32[8,16]", "f32[8,12,16]", "f32[8,16,6]", "f32[8]", top_k=2, n_group=4,
                       topk_group=2, norm_topk=True, routed_scale=2.5),
                  case("f32[1,16]", "f32[6,16]", "f32[6,8,16]", "f32[6,16,4]", top_k=3, n_group=3, topk_group=2,
                       scoring="softmax", group_score="max"),
                  case("f32[5,8]", "f32[4,8]", "f32[4,4,8]", "f32[4,8,2]", top_k=1),
                  # expert parallel: experts 4..7 of 8 here; the out-kernel must agree with the reference
                  case("f32[6,16]", "f32[8,16]", "f32[4,12,16]", "f32[4,16,6]", "f32[8]", top_k=2, n_group=4,
                       topk_group=2, norm_topk=True, routed_scale=2.5, expert_offset=4)],
    # One rank (no peers): the sum of one part, the concatenation of one part.
    "all_reduce": [case("f32[2,3]", world=1)],
    "all_gather": [case("f32[2,3]", axis=1, world=1), case("f32[1,4,5]", axis=-1, world=1)],
    "fused_attention": [case("f32[1,4,8,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", scale=0.25, causal=True),
                        case("f32[2,2,8,16]", "f32[2,2,6,16]", "f32[2,2,6,16]", "bool[8,6]", scale=0.5),
                        case("f32[1,4,8,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", scale=0.25, causal=True, window=3),
                        case("bf16[1,4,8,16]", "bf16[1,2,8,16]", "bf16[1,2,8,8]", scale=0.25, causal=True,
                             softcap=2.0),
                        case("f32[1,4,8,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", "f32[]", "f32[4]", scale=0.25,
                             causal=True, window=5),
                        case("f32[1,4,8,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", scale=0.25, causal=True,
                             alibi=(0.5, 0.25, 0.125, 0.0625))],
    "cached_conv1d": [case("f32[1,1,8,6]", "f32[6,1,3]", Idx("i64[1]", 8), groups=6),
                      case("f32[2,1,8,4]", "f32[4,2,2]", Idx("i64[1]", 8), "f32[4]", groups=2, dilation=2),
                      case("bf16[1,1,4,4]", "bf16[4,4,4]", Idx("i64[1]", 4))],
    # recurrences (ir/recurrent_ops.py): pure, prefill (last, slot) and decode (from the state)
    "selective_scan": [case("f32[1,5,8]", "f32[1,5,2]", "f32[2]", "f32[1,5,1,4]", "f32[1,5,1,4]", "f32[8]"),
                       case("f32[2,3,6]", "f32[2,3,6]", "f32[6,4]", "f32[2,3,2,4]", "f32[2,3,2,4]", "f32[6]")],
    "selective_scan_state": [case("f32[3,8,4]", "f32[1,5,8]", "f32[1,5,2]", "f32[2]", "f32[1,5,1,4]", "f32[1,5,1,4]",
                                  "f32[8]", Idx("i64[1]", 5), Idx("i64[1]", 3)),
                             case("f32[2,6,4]", "f32[2,1,6]", "f32[2,1,6]", "f32[6,4]", "f32[2,1,2,4]",
                                  "f32[2,1,2,4]", "f32[6]")],
    "gated_delta_rule": [case("f32[1,4,2,8]", "f32[1,4,2,8]", "f32[1,4,2,6]", "f32[1,4,2]", "f32[1,4,2]"),
                         case("f32[2,3,1,4]", "f32[2,3,1,4]", "f32[2,3,1,4]", "f32[2,3,1,4]", "f32[2,3,1]")],
    "gated_delta_rule_state": [case("f32[2,2,8,6]", "f32[1,4,2,8]", "f32[1,4,2,8]", "f32[1,4,2,6]", "f32[1,4,2]",
                                    "f32[1,4,2]", Idx("i64[1]", 4), Idx("i64[1]", 2)),
                               case("f32[2,1,4,4]", "f32[2,1,1,4]", "f32[2,1,1,4]", "f32[2,1,1,4]", "f32[2,1,1,4]",
                                    "f32[2,1,1]")],
    "wkv": [case("f32[1,5,8]", "f32[1,5,8]", "f32[8]", "f32[8]")],
    "wkv_state": [case("f32[2,3,8]", "f32[1,5,8]", "f32[1,5,8]", "f32[8]", "f32[8]", Idx("i64[1]", 5),
                       Idx("i64[1]", 2)),
                  case("f32[2,3,4]", "f32[2,1,4]", "f32[2,1,4]", "f32[4]", "f32[4]")],
    "linear_attention": [case("f32[1,4,2,8]", "f32[1,4,2,8]", "f32[1,4,2,6]", "f32[1,4,2]")],
    "linear_attention_state": [case("f32[2,2,8,6]", "f32[1,4,2,8]", "f32[1,4,2,8]", "f32[1,4,2,6]", "f32[1,4,2]",
                                    Idx("i64[1]", 4), Idx("i64[1]", 2)),
                               case("f32[2,1,4,4]", "f32[2,1,1,4]", "f32[2,1,1,4]", "f32[2,1,1,4]", "f32[2,1,1]")],
    "linear_recurrence": [case("f32[1,5,8]", "f32[1,5,8]")],
    "linear_recurrence_state": [case("f32[3,8]", "f32[1,5,8]", "f32[1,5,8]", Idx("i64[1]", 5), Idx("i64[1]", 3)),
                                case("f32[2,4]", "f32[2,1,4]", "f32[2,1,4]")],
    "kv_write": [case("f32[1,2,8,4]", "f32[1,2,3,4]", Idx("i64[3]", 8)), case("f16[2,1,6,8]", "f16[2,1,1,8]",
                                                                           Idx("i32[1]", 6))],
    "cached_attention": [case("f32[1,4,1,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", Idx("i64[1]", 8), scale=0.25),
                         case("f32[2,2,3,8]", "f32[2,2,6,8]", "f32[2,2,6,8]", Idx("i64[3]", 6), scale=0.5),
                         case("f32[1,4,2,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", Idx("i64[2]", 8), scale=0.25,
                              window=4),
                         case("f32[1,4,1,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", Idx("i64[1]", 8), scale=0.25,
                              softcap=1.5, window=3),
                         case("f32[1,4,2,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", Idx("i64[2]", 8), "f32[4]",
                              scale=0.25),
                         case("bf16[1,4,1,16]", "bf16[1,2,8,16]", "bf16[1,2,8,8]", Idx("i64[1]", 8), scale=0.25,
                              alibi=(0.5, 0.25, 0.125, 0.0625)),
                         case("f32[1,4,2,16]", "f32[1,2,8,16]", "f32[1,2,8,8]", Idx("i64[2]", 8), scale=0.25,
                              window=3, alibi=(0.5, 0.25, 0.125, 0.0625))],
    # decode over a cache (absorbed, out-kernel), a short prefill (absorbed), a long one (expanded heads)
    "mla_attention": [case("f32[1,4,1,8]", "f32[1,4,1,4]", "f32[1,1,9,20]", "f32[4,8,16]", "f32[4,16,8]",
                           Idx("i64[1]", 9), scale=0.3),
                      case("f32[2,2,3,8]", "f32[2,2,3,4]", "f32[2,1,7,20]", "f32[2,8,16]", "f32[2,16,6]",
                           Idx("i64[3]", 7), scale=0.3),
                      case("f32[1,2,5,8]", "f32[1,2,5,4]", "f32[1,1,5,20]", "f32[2,8,16]", "f32[2,16,8]",
                           scale=0.3, causal=True),
                      case("f32[1,2,16,8]", "f32[1,2,16,4]", "f32[1,1,16,36]", "f32[2,8,32]", "f32[2,32,8]",
                           scale=0.3, causal=True)],
    "rope_lut": [case("f32[1,2,5,8]", Idx("i64[5]", 9), "f32[9,4]", "f32[9,4]"),
                 case("f32[2,2,5,8]", Idx("i64[2,5]", 9), "f32[9,2]", "f32[9,2]", layout="interleaved"),
                 case("f32[1,2,5,8]", Idx("i64[5]", 9), "f32[9,4]", "f32[9,4]", layout="deinterleave")],
    "rms_norm": [case("f32[2,3,8]", "f32[8]", eps=1e-6), case("f16[4,8]", "f16[8]", axis=0)],
    "layer_norm": [case("f32[2,3,8]", "f32[8]", "f32[8]"), case("f32[4,8]", "f32[4,8]", axis=0)],
    "rotary_embedding": [case("f32[1,2,5,8]", "f32[1,5,4]", "f32[1,5,4]"),
                         case("f32[2,5,16]", "f32[9,2]", "f32[9,2]", Idx("i64[2,5]", 9), num_heads=2,
                              rotary_dim=4, interleaved=True)],
    **{name: [case("f32[2,3]", "f32[3]"), case("i64[4,1]", "i64[1,5]")] for name in _COMPARE},
    "where": [case("bool[2,3]", "f32[3]", "f32[2,1]"), case("bool[1]", "i64[4]", "i64[4]")],
    "reduce_mean": [case("f32[2,3,4]", axes=(1,)), case("f32[2,3,4]", axes=(-1, 0), keepdim=True)],
    "reduce_sum": [case("f32[2,3,4]", axes=(2,)), case("i64[2,3]", axes=(0, 1), keepdim=True)],
    "reduce_max": [case("f32[2,3,4]", axes=(0,)), case("f16[2,3]", axes=(-1,), keepdim=True)],
    "cumsum": [case("f32[2,3]", axis=-1), case("i64[5]", axis=0, exclusive=True, reverse=True)],
    "softmax": [case("f32[2,3,4]", axis=-1), case("f32[2,3]", axis=0)],
    "log_softmax": [case("f32[2,3,4]", axis=-1), case("f16[2,3]", axis=0)],
    "reshape": [case("f32[2,3,4]", shape=(6, 4)), case("i64[6]", shape=(1, 2, 1, 3)), case("f32[1]", shape=())],
    "transpose": [case("f32[2,3,4]", perm=(2, 0, 1)), case("f32[5]", perm=(0,))],
    "expand": [case("f32[3,1]", shape=(2, 3, 4)), case("f32[4]", shape=(4,))],
    "slice": [case("f32[2,6]", axis=1, start=1, end=5, step=2), case("f32[7,2]", axis=0, start=-3, end=2**62),
              case("f32[4,2]", axis=-2, end=0)],
    "slice_scatter": [case("f32[2,6]", "f32[2,3]", axis=1, start=0, end=6, step=2),
                      case("f32[5,2]", "f32[2,2]", axis=0, start=3, end=5)],
    "concat": [case("f32[2,3]", "f32[2,1]", "f32[2,2]", axis=-1), case("i64[4]", axis=0),
               case("f32[1,3]", "f32[2,3]", axis=0)],
    "split": [case("f32[2,6]", axis=1, sizes=(1, 2, 3)), case("f32[4,2]", axis=-2, sizes=(4,))],
    "gather": [case("f32[5,3]", Idx("i64[2,4]", 5)), case("f32[2,6]", Idx("i32[3]", 6), axis=-1)],
    "index": [case("f32[5,4,3]", Idx("i64[2]", 5), Idx("i64[3,1]", 4)), case("f32[6,2]", Idx("i32[4]", 6))],
    "arange": [case(end=16, dtype=DType.f32), case(start=1, end=2, step=0.1, dtype=DType.f32),
               case(start=10, end=0, step=-3, dtype=DType.i64)],
    "full": [case(shape=(2, 3), value=1.5, dtype=DType.f16), case(shape=(), value=0, dtype=DType.i64)],
    "matmul": [case("f32[2,3,4]", "f32[4,5]"), case("f32[4]", "f32[4,5]"), case("f32[2,1,3,4]", "f32[5,4,6]"),
               case("f32[3,4]", "f32[4]"), case("f32[4]", "f32[4]")],
    "linear": [case("f32[2,3,4]", "f32[5,4]"), case("f32[3,4]", "f32[5,4]", "f32[5]"),
               case("f32[2,3,4]", "f32[4,5]", "f32[5]", weight_layout="kn")],
    "qlinear": [case("f32[2,3,64]", "i8[5,64]", "f32[5,1]", "i8[5,1]", bits=8, group_size=64),
                case("bf16[3,64]", "u8[5,32]", "f32[5,2]", "u8[5,2]", "bf16[5]", bits=4, group_size=32),
                case("f32[1,16,64]", "u8[5,32]", "f16[5,4]", "u8[5,4]", bits=4, group_size=16, valid_rows=3)],
    "qmoe": [case("f32[6,16]", "f32[8,16]", "i8[8,12,16]", "f32[8,12,1]", "i8[8,12,1]", "i8[8,16,6]", "f32[8,16,1]",
                  "i8[8,16,1]", "f32[8]", top_k=2, n_group=4, topk_group=2, norm_topk=True, routed_scale=2.5, bits=8,
                  group_size=16, down_group_size=6),
             case("f32[5,32]", "f32[4,32]", "u8[4,8,16]", "f32[4,8,2]", "u8[4,8,2]", "u8[4,32,2]", "f32[4,32,1]",
                  "u8[4,32,1]", top_k=1, bits=4, group_size=16, down_group_size=4)],
    "dequantize": [case("i8[5,64]", "f32[5,2]", "i8[5,2]", bits=8, group_size=32),
                   case("u8[2,5,32]", "bf16[2,5,1]", "u8[2,5,1]", bits=4, group_size=64, dtype=DType.bf16)],
    "sdpa": [case("f32[1,2,8,16]", "f32[1,2,8,16]", "f32[1,2,8,16]"),
             case("f32[1,4,8,16]", "f32[1,2,6,16]", "f32[1,2,6,8]", gqa=True, scale=0.5),
             case("f32[2,8,16]", "f32[2,8,16]", "f32[2,8,16]", "f32[8,8]"),
             case("f32[2,8,16]", "f32[2,8,16]", "f32[2,8,16]", causal=True)],
}


def _run_case(od: OpDef, c: Case) -> None:
    gen = torch.Generator().manual_seed(0)
    types = c.types()
    assert od.arity_ok(len(types)), (od.inputs, types)
    assert od.check_attrs(c.attrs) == []
    inferred = od.infer_types(types, c.attrs)
    with torch.no_grad():
        outs = od.run([tensor(a, gen) for a in c.args], c.attrs)
    got = [TensorType(tuple(t.shape), DType.from_torch(t.dtype)) for t in outs]
    assert got == inferred, f"kernel gives {[str(t) for t in got]}, shape rule {[str(t) for t in inferred]}"


def _case_params() -> list[Any]:
    return [pytest.param(name, c, id=f"{name}-{i}") for name, cs in CASES.items() for i, c in enumerate(cs)]


def test_every_op_has_a_case() -> None:
    ops = set(all_ops())
    assert sorted(ops - set(CASES)) == [], "ops without a case in tests/test_registry.py::CASES"
    assert sorted(set(CASES) - ops) == [], "cases for ops that are not registered"


@pytest.mark.parametrize("name, c", _case_params())
def test_kernel_agrees_with_shape_rule(name: str, c: Case) -> None:
    _run_case(get_op(name), c)


@pytest.mark.parametrize("name, c", _case_params())
def test_case_as_a_one_node_graph_verifies_and_roundtrips(name: str, c: Case) -> None:
    od = get_op(name)
    g = Graph()
    ins = [g.add_state(f"in{i}", t) if i == od.inplace else g.add_input(f"in{i}", t)  # in place: a state
           for i, t in enumerate(c.types())]
    node = g.add_node(name, ins, od.infer_types(c.types(), c.attrs), c.attrs, names="out")
    g.set_outputs(node.outputs)
    verify(g)
    text = print_graph(g)
    g2 = parse_graph(text)
    assert print_graph(g2) == text
    verify(g2)


# Operands for which torch's kernel would change the dtype or rank behind the rule's
# back (int -> float promotion, axes=() meaning "all"): the rules refuse them.
KERNEL_WOULD_DIVERGE = [
    pytest.param("exp", case("i64[3]"), id="exp-i64"),
    pytest.param("sqrt", case("i32[3]"), id="sqrt-i32"),
    pytest.param("silu", case("i64[3]"), id="silu-i64"),
    pytest.param("div", case("i64[3]", "i64[3]"), id="div-i64: true division"),
    pytest.param("sub", case("bool[3]", "bool[3]"), id="sub-bool"),
    pytest.param("neg", case("bool[3]"), id="neg-bool"),
    pytest.param("bitwise_and", case("f32[3]", "f32[3]"), id="bitwise_and-f32"),
    pytest.param("softplus", case("i64[3]"), id="softplus-i64"),
    pytest.param("elu", case("i32[3]"), id="elu-i32"),
    pytest.param("is_inf", case("i64[3]"), id="is_inf-i64"),
    pytest.param("bitwise_not", case("f32[3]"), id="bitwise_not-f32"),
    pytest.param("reduce_sum", case("f32[2,3]", axes=()), id="reduce_sum-axes=[]"),
    pytest.param("reduce_max", case("f32[2,3]", axes=()), id="reduce_max-axes=[]"),
]


@pytest.mark.parametrize("name, c", KERNEL_WOULD_DIVERGE)
def test_rule_refuses_operands_the_kernel_would_retype(name: str, c: Case) -> None:
    with pytest.raises(ShapeError):
        get_op(name).infer_types(c.types(), c.attrs)


@pytest.mark.parametrize("dtype", ["f32", "i64", "bool"])
def test_logical_not_is_bool_for_any_operand(dtype: str) -> None:
    _run_case(get_op("logical_not"), case(f"{dtype}[3]"))


# --- cost model --------------------------------------------------------------------


@pytest.mark.parametrize("name, ins, mnk", [
    ("matmul", ["f32[3,4]", "f32[4,5]"], (3, 5, 4)),
    ("matmul", ["f32[2,3,4]", "f32[2,4,5]"], (2 * 3, 5, 4)),
    ("matmul", ["f32[4]", "f32[4,5]"], (1, 5, 4)),
    ("linear", ["f32[3,4]", "f32[5,4]"], (3, 5, 4)),
    ("linear", ["f32[2,3,4]", "f32[5,4]", "f32[5]"], (2 * 3, 5, 4)),
])
def test_matmul_flops(name: str, ins: list[str], mnk: tuple[int, int, int]) -> None:
    od = get_op(name)
    types = [ty(s) for s in ins]
    outs = od.infer_types(types, {})
    m, n, k = mnk
    assert od.flops(types, outs, {}) == 2 * m * n * k
    assert od.unit == "cube"


def test_bytes_default_to_inputs_plus_outputs() -> None:
    od = get_op("add")
    ins = [ty("f32[2,3]"), ty("f32[3]")]
    outs = od.infer_types(ins, {})
    assert od.bytes(ins, outs) == 4 * (6 + 3 + 6)
    assert od.flops(ins, outs, {}) == 6


def test_every_op_has_a_unit() -> None:
    units = {name: od.unit for name, od in all_ops().items()}
    assert {n: u for n, u in units.items() if u not in {"cube", "vector", "dma"}} == {}
    assert units["matmul"] == units["linear"] == units["sdpa"] == "cube"
    assert units["reshape"] == units["transpose"] == units["concat"] == "dma"
    assert units["add"] == units["softmax"] == "vector"


@pytest.mark.parametrize("name, c", _case_params())
def test_cost_is_a_non_negative_int(name: str, c: Case) -> None:
    od = get_op(name)
    types = c.types()
    outs = od.infer_types(types, c.attrs)
    flops = od.flops(types, outs, od.full_attrs(c.attrs))
    assert isinstance(flops, int) and flops >= 0
    if od.unit == "dma":
        assert flops == 0
    whole = sum(t.nbytes for t in types) + sum(t.nbytes for t in outs)
    moved = od.bytes(types, outs, c.attrs)
    assert isinstance(moved, int) and (moved == whole if od.traffic is None else 0 < moved <= whole)


# --- shape rules refuse bad operands -------------------------------------------------

REFUSALS = {
    "broadcast_mismatch": ("add", ["f32[2,3]", "f32[4,3]"], {}),
    "broadcast_mismatch_compare": ("lt", ["f32[2,3]", "f32[2]"], {}),
    "binary_dtype_mismatch": ("mul", ["f32[3]", "f16[3]"], {}),
    "where_cond_not_bool": ("where", ["f32[3]", "f32[3]", "f32[3]"], {}),
    "reshape_wrong_numel": ("reshape", ["f32[2,3]"], {"shape": (4, 2)}),
    "reshape_negative_dim": ("reshape", ["f32[2,3]"], {"shape": (-1, 3)}),
    "transpose_not_a_permutation": ("transpose", ["f32[2,3]"], {"perm": (0, 0)}),
    "expand_incompatible": ("expand", ["f32[2,3]"], {"shape": (4, 3)}),
    "expand_lower_rank": ("expand", ["f32[2,3]"], {"shape": (3,)}),
    "concat_mismatch_off_axis": ("concat", ["f32[2,3]", "f32[3,3]"], {"axis": 1}),
    "concat_rank_mismatch": ("concat", ["f32[2,3]", "f32[2]"], {"axis": 0}),
    "concat_dtype_mismatch": ("concat", ["f32[2,3]", "f16[2,3]"], {"axis": 0}),
    "split_sizes_not_summing": ("split", ["f32[2,6]"], {"axis": 1, "sizes": (2, 3)}),
    "axis_out_of_range": ("softmax", ["f32[2,3]"], {"axis": 2}),
    "reduce_axis_out_of_range": ("reduce_sum", ["f32[2,3]"], {"axes": (-3,)}),
    "slice_step_not_positive": ("slice", ["f32[4]"], {"axis": 0, "end": 4, "step": 0}),
    "slice_scatter_source_wrong": ("slice_scatter", ["f32[4]", "f32[3]"], {"axis": 0, "end": 4, "step": 2}),
    "gather_float_indices": ("gather", ["f32[4]", "f32[2]"], {}),
    "index_too_many": ("index", ["f32[4]", "i64[1]", "i64[1]"], {}),
    "matmul_contraction_mismatch": ("matmul", ["f32[2,3]", "f32[4,5]"], {}),
    "matmul_scalar": ("matmul", ["f32[]", "f32[4]"], {}),
    "linear_weight_mismatch": ("linear", ["f32[2,4]", "f32[5,3]"], {}),
    "linear_weight_not_2d": ("linear", ["f32[2,4]", "f32[4]"], {}),
    "linear_bias_mismatch": ("linear", ["f32[2,4]", "f32[5,4]", "f32[4]"], {}),
    "sdpa_head_dim_mismatch": ("sdpa", ["f32[2,8,16]", "f32[2,8,8]", "f32[2,8,16]"], {}),
    "sdpa_gqa_heads": ("sdpa", ["f32[1,3,8,16]", "f32[1,2,8,16]", "f32[1,2,8,16]"], {"gqa": True}),
    "sdpa_mask_shape": ("sdpa", ["f32[2,8,16]", "f32[2,8,16]", "f32[2,8,16]", "f32[8,7]"], {}),
    "mod_bool": ("mod", ["bool[3]", "bool[3]"], {}),
    "gather_elements_rank_mismatch": ("gather_elements", ["f32[3,4]", "i64[4]"], {}),
    "gather_elements_index_larger_off_axis": ("gather_elements", ["f32[3,4]", "i64[4,2]"], {"axis": 1}),
    "scatter_elements_updates_mismatch": ("scatter_elements", ["f32[3,4]", "i64[2,4]", "f32[2,3]"], {}),
    "pad_wrong_length": ("pad", ["f32[2,3]"], {"pads": (1, 1)}),
    "pad_crops_too_much": ("pad", ["f32[2,3]"], {"pads": (0, -2, 0, -2)}),
    "pad_reflect_empty": ("pad", ["f32[0,3]"], {"pads": (1, 0, 0, 0), "mode": "reflect"}),
    "topk_k_too_large": ("topk", ["f32[3,5]"], {"k": 6}),
    "attention_alibi_slopes_per_head": ("fused_attention", ["f32[1,4,8,16]", "f32[1,2,8,16]", "f32[1,2,8,8]"],
                                        {"scale": 0.25, "causal": True, "alibi": (0.5, 0.25)}),
    "conv1d_groups_mismatch": ("conv1d", ["f32[1,4,8]", "f32[4,3,3]"], {"groups": 2}),
    "conv1d_kernel_too_long": ("conv1d", ["f32[1,4,2]", "f32[4,1,5]"], {"groups": 4}),
    "conv1d_bias_wrong": ("conv1d", ["f32[1,4,8]", "f32[4,1,3]", "f32[3]"], {"groups": 4}),
    "einsum_contraction_mismatch": ("einsum", ["f32[2,3]", "f32[4,5]"], {"equation": "ij,jk->ik"}),
    "einsum_dtype_mismatch": ("einsum", ["f32[2,3]", "f16[3,5]"], {"equation": "ij,jk->ik"}),
}


@pytest.mark.parametrize("label", sorted(REFUSALS))
def test_shape_rule_refuses(label: str) -> None:
    name, ins, attrs = REFUSALS[label]
    with pytest.raises(ShapeError):
        get_op(name).infer_types([ty(s) for s in ins], attrs)


def test_expand_refuses_negative_dims() -> None:
    with pytest.raises(ShapeError):
        get_op("expand").infer_types([ty("f32[1,3]")], {"shape": (-1, 3)})


@pytest.mark.parametrize("name, c", [p for p in _case_params() if get_op(p.values[0]).out_kernel is not None])
def test_out_kernel_agrees_with_the_reference_kernel(name: str, c: Case) -> None:
    """The runtime's allocation-free form writes what the reference kernel returns, or declines."""
    od = get_op(name)
    gen = torch.Generator().manual_seed(0)
    ins = [tensor(a, gen) for a in c.args]
    types = c.types()
    outs_t = od.infer_types(types, c.attrs)
    with torch.no_grad():
        want = od.run(ins, c.attrs)
        outs = [torch.full(t.shape, float("nan")).to(t.dtype.torch) if t.dtype.is_float
                else torch.zeros(t.shape, dtype=t.dtype.torch) for t in outs_t]
        ws_bytes = od.workspace_bytes(types, outs_t, c.attrs)
        ws = torch.full((ws_bytes,), 0xFF, dtype=torch.uint8) if ws_bytes else None
        assert od.out_kernel is not None
        if not od.out_kernel(ins, od.full_attrs(c.attrs), outs, ws):
            # Declined (f16 norms, negative gather indices, ...): the runtime runs the
            # reference kernel instead, which the tests above cover.
            assert all(bool(o.isnan().all()) for o in outs if o.is_floating_point()), "declined after writing"
            return
    for got, w in zip(outs, want, strict=True):
        assert got.dtype == w.dtype and got.shape == w.shape
        assert torch.allclose(got, w, rtol=1e-6, atol=1e-6, equal_nan=True), (got, w)


def test_the_decode_hot_path_has_out_kernels() -> None:
    for name in ("linear", "rms_norm", "rope_lut", "cached_attention", "mla_attention", "swiglu", "add", "mul", "gather", "pad",
                 "concat", "cast"):
        assert get_op(name).out_kernel is not None, name
