"""libnpucrt's generic ops (npucrt/src/ops_*.c) against the registry's torch kernels.

Every case is one op over its own program inputs. The cases are packed into a few `.om`
files (one graph of many independent ops each, built once per module: writing a `.om`
costs ~0.1 s), each run by the C executor (NativeSession) and by the torch interpreter
(Session, use_native=False); each test compares one op's outputs:

    exact    data movement, integers, bool, comparisons, casts
    math     f32 within 1e-6 (relative, and absolute near 0); bf16/f16 within 1 ulp
    reduce   f32 within 1e-5 (sums in another order); bf16/f16 within 1 ulp

Index tensors go through an `add` of zeros first, so that they are computed values, which
the op's kernel checks (an index out of range: NPUC-E0412), not program inputs, which the
executors check on the way in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, Value, get_op
from npuc.runtime.session import Session

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
I64, I32, I16, I8, U8, BOOL = torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool
HALF = (BF16, F16)

_G = torch.Generator().manual_seed(20240611)


def randn(*shape: int, dtype: torch.dtype = F32, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(shape, generator=_G, dtype=F64) * scale).to(dtype)


def uniform(lo: float, hi: float, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return (torch.rand(shape, generator=_G, dtype=F64) * (hi - lo) + lo).to(dtype)


def randint(lo: int, hi: int, *shape: int, dtype: torch.dtype = I64) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=_G).to(dtype)


def randbool(*shape: int) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=_G).bool()


def sample(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Values every op of that dtype takes (integers small, u8 non-negative)."""
    if dtype == BOOL:
        return randbool(*shape)
    if dtype.is_floating_point:
        return randn(*shape, dtype=dtype)
    return randint(0 if dtype == U8 else -20, 40, *shape, dtype=dtype)


@dataclass
class Case:
    id: str
    op: str
    args: list[torch.Tensor]
    attrs: dict[str, Any] = field(default_factory=dict)
    tol: str = "exact"
    computed: tuple[int, ...] = ()  # operands fed through add(x, 0): index tensors


CASES: list[Case] = []


def case(id: str, op: str, args: list[torch.Tensor], attrs: dict[str, Any] | None = None, tol: str = "exact",
         computed: tuple[int, ...] = ()) -> None:
    CASES.append(Case(id, op, args, attrs or {}, tol, computed))


def dname(dt: torch.dtype) -> str:
    return str(DType.from_torch(dt))


# -- elementwise ------------------------------------------------------------------------------

_POS, _UNIT, _ACOSH = (0.05, 5.0), (-0.95, 0.95), (1.05, 5.0)
FLOAT_UNARY: dict[str, tuple[float, float] | None] = {
    "rsqrt": _POS, "sqrt": _POS, "log": _POS, "exp": None, "cos": None, "sin": None, "tan": (-1.2, 1.2),
    "tanh": None, "sigmoid": None, "silu": None, "reciprocal": None, "erf": None, "floor": None, "ceil": None,
    "round": None, "sinh": None, "cosh": None, "asin": _UNIT, "acos": _UNIT, "atan": None, "asinh": None,
    "acosh": _ACOSH, "atanh": _UNIT, "softplus": None, "softsign": None, "mish": None, "hardswish": None,
    "expm1": None, "log1p": (-0.9, 4.0), "neg": None, "abs": None, "relu": None, "sign": None,
}
ACTIVATIONS: list[tuple[str, dict[str, Any]]] = [
    ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("elu", {}), ("elu", {"alpha": 0.5}), ("celu", {"alpha": 0.7}),
    ("selu", {"alpha": 1.6732632423543772, "gamma": 1.0507009873554805}), ("leaky_relu", {}),
    ("leaky_relu", {"alpha": 0.2}), ("hard_sigmoid", {}), ("hard_sigmoid", {"alpha": 0.25, "beta": 0.4}),
    ("thresholded_relu", {"alpha": 0.5}),
]

for _dt in (F32, BF16, F16):
    for _op, _dom in FLOAT_UNARY.items():
        _x = randn(4, 9, dtype=_dt) if _dom is None else uniform(*_dom, 4, 9, dtype=_dt)
        if _op == "round":
            _x = torch.cat([_x.flatten(), torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5], dtype=_dt)])
        if _op == "softplus":
            _x = torch.cat([_x.flatten(), torch.tensor([19.0, 21.0, 40.0, -30.0], dtype=_dt)])
        case(f"{_op}-{dname(_dt)}", _op, [_x], tol="math")
    for _op, _attrs in ACTIVATIONS:
        case(f"{_op}{list(_attrs.values())}-{dname(_dt)}", _op, [randn(5, 7, dtype=_dt)], _attrs, tol="math")
case("exp-f32-parallel", "exp", [randn(300, 257)], tol="math")
case("sigmoid-f32-rank0", "sigmoid", [randn()], tol="math")

for _dt in (I64, I32, I8):
    for _op in ("neg", "abs", "relu", "sign"):
        _x = torch.cat([randint(-50, 50, 12, dtype=_dt), torch.tensor([torch.iinfo(_dt).min, 0], dtype=_dt)])
        case(f"{_op}-{dname(_dt)}", _op, [_x])
case("neg-u8", "neg", [randint(0, 255, 9, dtype=U8)])

_SPECIAL = torch.tensor([0.0, -0.0, 1.5, -2.0, math.inf, -math.inf, math.nan, 3e-3])
for _dt in (F32, BF16, F16):
    case(f"is_nan-{dname(_dt)}", "is_nan", [_SPECIAL.to(_dt)])
    for _neg, _pos in ((True, True), (True, False), (False, True)):
        case(f"is_inf-{_neg}-{_pos}-{dname(_dt)}", "is_inf", [_SPECIAL.to(_dt)],
             {"detect_negative": _neg, "detect_positive": _pos})
    case(f"logical_not-{dname(_dt)}", "logical_not", [_SPECIAL.to(_dt)])
for _dt in (I64, I32, U8, BOOL):
    case(f"logical_not-{dname(_dt)}", "logical_not", [sample(_dt, 3, 4)])
    case(f"bitwise_not-{dname(_dt)}", "bitwise_not", [sample(_dt, 3, 4)])

_SHAPES = [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (3, 1)), ((4, 1, 3), (5, 1)), ((), (3,)), ((2, 1), ()), ((), ())]


def _pair(dt: torch.dtype, i: int, positive: bool = False) -> list[torch.Tensor]:
    sa, sb = _SHAPES[i % len(_SHAPES)]
    a, b = sample(dt, *sa), sample(dt, *sb)
    if positive:
        a = a.abs() + 0.5
    return [a, b]


_k = 0
for _op, _dts in {
    "add": (F32, BF16, F16, I64, I32, U8, BOOL), "sub": (F32, BF16, F16, I64, I32, U8),
    "mul": (F32, BF16, F16, I64, I32, I8, BOOL), "div": (F32, BF16, F16),
    "maximum": (F32, BF16, F16, I64, I32, U8, BOOL), "minimum": (F32, BF16, F16, I64, I32, U8, BOOL),
    "bitwise_and": (I64, I32, U8, BOOL), "bitwise_or": (I64, I32, U8, BOOL), "bitwise_xor": (I64, I32, U8, BOOL),
    "eq": (F32, BF16, I64, I32, BOOL), "ne": (F32, BF16, I64, BOOL), "lt": (F32, BF16, F16, I64, U8, BOOL),
    "le": (F32, BF16, I64, BOOL), "gt": (F32, F16, I64, I32, BOOL), "ge": (F32, BF16, I64, BOOL),
}.items():
    for _dt in _dts:
        for _rep in range(2):
            _k += 1
            _a, _b = _pair(_dt, _k)
            if _op in ("eq", "ne", "le", "ge") and _a.shape == _b.shape:
                _b = torch.where(randbool(*_b.shape), _a, _b)  # some equal pairs
            case(f"{_op}-{dname(_dt)}-{_rep}-{list(_a.shape)}{list(_b.shape)}", _op, [_a, _b],
                 tol="exact" if _op in ("eq", "ne", "lt", "le", "gt", "ge") or not _dt.is_floating_point else "math")
case("add-f32-parallel", "add", [randn(300, 257), randn(257)], tol="math")
case("maximum-f32-nan", "maximum", [torch.tensor([math.nan, 1.0, 2.0]), torch.tensor([0.0, math.nan, 3.0])])
case("minimum-bf16-nan", "minimum", [torch.tensor([math.nan, 1.0, 2.0], dtype=BF16),
                                     torch.tensor([0.0, math.nan, 3.0], dtype=BF16)])
case("lt-f32-nan", "lt", [torch.tensor([math.nan, 1.0]), torch.tensor([0.0, math.nan])])
for _dt in (F32, BF16, F16):
    case(f"pow-{dname(_dt)}", "pow", _pair(_dt, 1, positive=True), tol="math")
for _dt in (I64, I32):
    case(f"pow-{dname(_dt)}", "pow", [randint(-3, 4, 4, 5, dtype=_dt), randint(-2, 6, 5, dtype=_dt)])
case("pow-i64-wrap", "pow", [torch.tensor([3, -1, -1, 1, 2]), torch.tensor([40, -3, -4, -7, -1])])
for _dt in (F32, BF16, I64, I32, I8):
    _a = sample(_dt, 3, 8) if _dt.is_floating_point else randint(-30, 30, 3, 8, dtype=_dt)
    _b = torch.cat([torch.tensor([0, 3, -3, 7, -7, 1, -1, 2]).to(_dt).reshape(1, 8)]).expand(3, 8).contiguous()
    if _dt.is_floating_point:
        _b = _b + sample(_dt, 3, 8) * 0.1 * (_b != 0)
    for _op, _attrs in (("floor_div", {}), ("mod", {}), ("mod", {"fmod": True})):
        case(f"{_op}{list(_attrs)}-{dname(_dt)}", _op, [_a, _b], _attrs,
             tol="math" if _dt.is_floating_point else "exact")
for _dt in (F32, BF16, F16, I64, I32, BOOL):
    case(f"where-{dname(_dt)}", "where", [randbool(3, 1), sample(_dt, 3, 4), sample(_dt, 4)])
case("where-f32-rank0", "where", [randbool(), randn(), randn(2)])
for _dt in (BF16, F16):
    case(f"swiglu-{dname(_dt)}", "swiglu", [randn(3, 8, dtype=_dt), randn(3, 8, dtype=_dt)], tol="math")

_CASTS = (F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL)
for _src in _CASTS:
    for _dst in _CASTS:
        if _src == _dst:
            continue
        if _src.is_floating_point:  # in range of every integer dtype (negative to u8 is torch's own wrap)
            _lo = 0.0 if _dst == U8 else -120.0
            _x = torch.cat([uniform(_lo, 120.0, 12, dtype=F64), torch.tensor([0.0, 0.1, 2.5, -0.0]).abs()]).to(_src)
        elif _src == BOOL:
            _x = randbool(10)
        else:
            _x = torch.cat([randint(0 if _src == U8 else -120, 120, 10, dtype=_src),
                            torch.tensor([0, 1, torch.iinfo(_src).max], dtype=_src)])
        case(f"cast-{dname(_src)}-{dname(_dst)}", "cast", [_x], {"dtype": DType.from_torch(_dst)})
case("cast-i64-wide", "cast", [torch.tensor([300, -129, 70000, 2**40 + 5, 16777217])], {"dtype": DType.i16})
case("cast-i64-bf16-round", "cast", [torch.tensor([16777217, 0x1008001, -(2**40) - 1])], {"dtype": DType.bf16})
case("cast-f64-bf16-twice", "cast", [torch.tensor([0.1, 1 + 2**-8 + 2**-30, 1e-45], dtype=F64)],
     {"dtype": DType.bf16})

# -- data movement -------------------------------------------------------------------------------

for _dt in (F32, BF16, I64, BOOL):
    case(f"reshape-{dname(_dt)}", "reshape", [sample(_dt, 2, 3, 4)], {"shape": (4, 6)})
case("reshape-rank0", "reshape", [randn()], {"shape": (1, 1)})
case("reshape-to-rank0", "reshape", [randn(1)], {"shape": ()})
for _dt, _shape, _perm in ((F32, (2, 3, 4), (2, 0, 1)), (I64, (5, 7), (1, 0)), (BF16, (2, 3, 1, 4, 2), (4, 2, 0, 3, 1)),
                           (BOOL, (3, 4, 2), (0, 2, 1)), (F16, (2, 1, 2, 3, 1, 2), (5, 3, 1, 0, 2, 4)),
                           (I32, (6,), (0,)), (F32, (2, 3, 4, 5), (0, 2, 1, 3)), (U8, (), ())):
    case(f"transpose-{dname(_dt)}-{list(_perm)}", "transpose", [sample(_dt, *_shape)], {"perm": _perm})
case("transpose-f32-parallel", "transpose", [randn(200, 300)], {"perm": (1, 0)})
for _i, (_attrs) in enumerate([
    {"axis": 1, "start": 1, "end": 4}, {"axis": -1, "start": -3, "end": -1}, {"axis": 0, "start": 0, "end": 100},
    {"axis": 1, "start": 0, "end": 6, "step": 2}, {"axis": 2, "start": -100, "end": 100, "step": 3},
    {"axis": 1, "start": 4, "end": 2}, {"axis": 0, "start": 1, "end": 2},
    {"axis": 1, "start": -9223372036854775807, "end": 9223372036854775807, "step": 4},
]):
    _dt = (F32, BF16, I64, BOOL)[_i % 4]
    case(f"slice-{_i}-{dname(_dt)}", "slice", [sample(_dt, 3, 6, 5)], _attrs)
    _want = get_op("slice").infer_types([TensorType((3, 6, 5), DType.from_torch(_dt))], _attrs)[0].shape
    case(f"slice_scatter-{_i}-{dname(_dt)}", "slice_scatter", [sample(_dt, 3, 6, 5), sample(_dt, *_want)], _attrs)
for _dt in (F32, BF16, I64, BOOL):
    case(f"pad-constant-{dname(_dt)}", "pad", [sample(_dt, 2, 3, 4)], {"pads": (0, 1, 2, 1, 0, 3)})
    case(f"pad-value-{dname(_dt)}", "pad", [sample(_dt, 2, 3), sample(_dt)], {"pads": (1, -1, 2, 2)})
for _mode in ("reflect", "edge", "wrap"):
    case(f"pad-{_mode}", "pad", [randn(3, 4)], {"pads": (2, 3, 1, 2), "mode": _mode})
    case(f"pad-{_mode}-crop-i64", "pad", [sample(I64, 2, 5, 4)], {"pads": (0, -1, 3, 1, 1, -2), "mode": _mode})
case("pad-reflect-one", "pad", [randn(2, 1)], {"pads": (0, 2, 0, 3), "mode": "reflect"})
case("pad-rank1-crop-all", "pad", [randn(4)], {"pads": (-2, -2)})
for _dt, _ax in ((F32, 1), (BF16, -1), (I64, 0), (BOOL, 2)):
    _shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for _j, _s in enumerate(_shapes):
        _s[_ax] = _j + 1
    case(f"concat-{dname(_dt)}-{_ax}", "concat", [sample(_dt, *s) for s in _shapes], {"axis": _ax})
case("concat-one", "concat", [randn(3)], {"axis": 0})
case("split-2", "split", [randn(4, 6)], {"axis": 1, "sizes": (2, 4)})
case("split-3-bf16", "split", [randn(5, 2, dtype=BF16)], {"axis": -2, "sizes": (1, 0, 4)})
case("split-4-i64", "split", [sample(I64, 2, 8, 3)], {"axis": 1, "sizes": (1, 2, 2, 3)})
for _dt, _x, _shape in ((F32, (3, 1), (2, 3, 4)), (BF16, (), (2, 2)), (BOOL, (1, 4), (3, 4)),
                        (I64, (2, 1, 3), (2, 5, 3))):
    case(f"expand-{dname(_dt)}-{list(_shape)}", "expand", [sample(_dt, *_x)], {"shape": _shape})
for _dt, _x, _idx, _ax in ((F32, (4, 5), (2, 3), 1), (BF16, (6, 3), (4,), -1), (I64, (3, 4, 2), (), 1),
                           (BOOL, (5, 2), (3,), 0), (F32, (7, 3), (2, 2), 0)):
    _n = (_x[_ax])
    for _idt in (I64, I32):
        case(f"gather-{dname(_dt)}-{_ax}-{dname(_idt)}", "gather",
             [sample(_dt, *_x), randint(-_n, _n, *_idx, dtype=_idt)], {"axis": _ax}, computed=(1,))
case("gather_elements", "gather_elements", [randn(3, 4), randint(-4, 4, 3, 5)], {"axis": 1}, computed=(1,))
case("gather_elements-i32-axis0", "gather_elements", [sample(I64, 4, 3), randint(-4, 4, 2, 3, dtype=I32)],
     computed=(1,))
_nd = torch.stack([randint(-3, 3, 2, 2), randint(-4, 4, 2, 2)], dim=-1)
case("gather_nd", "gather_nd", [randn(3, 4, 5), _nd], computed=(1,))
case("gather_nd-batch-i32", "gather_nd", [sample(BF16, 2, 4, 5), randint(-4, 4, 2, 3, 1, dtype=I32)],
     {"batch_dims": 1}, computed=(1,))
for _red, _dt in (("none", F32), ("add", F32), ("mul", BF16), ("max", I64), ("min", F32), ("add", I32),
                  ("none", BOOL)):
    _idx = torch.stack([torch.randperm(3, generator=_G)[:2] - 3 * (_j % 2) for _j in range(5)], dim=1)
    if _red != "none":
        _idx[1, :2] = _idx[0, :2]  # duplicates
    case(f"scatter_elements-{_red}-{dname(_dt)}", "scatter_elements", [sample(_dt, 3, 5), _idx, sample(_dt, 2, 5)],
         {"axis": 0, "reduction": _red}, computed=(1,))
    case(f"scatter_nd-{_red}-{dname(_dt)}", "scatter_nd",
         [sample(_dt, 4, 3), torch.tensor([[1], [-1], [5], [1]]), sample(_dt, 4, 3)], {"reduction": _red},
         computed=(1,))
case("scatter_nd-k2", "scatter_nd", [randn(3, 4, 2), torch.tensor([[0, 1], [2, -1]]), randn(2, 2)], computed=(1,))
case("index-1", "index", [randn(5, 3), randint(-5, 5, 4)], computed=(1,))
case("index-2-broadcast", "index", [sample(BF16, 4, 6, 2), randint(-4, 4, 3, 1), randint(-6, 6, 5)], computed=(1, 2))
case("index-i32-all-axes", "index", [sample(I64, 3, 4), randint(0, 3, 2, dtype=I32), randint(-4, 4, 2, dtype=I32)],
     computed=(1, 2))
case("index-rank0-index", "index", [randn(4, 2), torch.tensor(-1)], computed=(1,))
for _attrs in ({"shape": (2, 3), "value": 1.5, "dtype": DType.f32}, {"shape": (4,), "value": 3, "dtype": DType.i64},
               {"shape": (2, 2), "value": -2.7, "dtype": DType.i32}, {"shape": (3,), "value": 0.1, "dtype": DType.bf16},
               {"shape": (), "value": 1.0, "dtype": DType.bool}, {"shape": (2,), "value": -9223372036854775808,
                                                                   "dtype": DType.i64},
               {"shape": (1, 2), "value": -math.inf, "dtype": DType.f16}):
    case(f"full-{_attrs['dtype']}-{_attrs['value']}", "full", [], _attrs)
for _attrs in ({"start": 0, "end": 5, "step": 0.5, "dtype": DType.f32},
               {"start": 2, "end": 11, "step": 3, "dtype": DType.i64},
               {"start": 0, "end": 4, "step": 0.25, "dtype": DType.bf16},
               {"start": 10, "end": 0, "step": -3, "dtype": DType.i32},
               {"start": -1.5, "end": 2.5, "step": 0.5, "dtype": DType.f32}, {"end": 6, "dtype": DType.f16}):
    case(f"arange-{list(_attrs.values())}", "arange", [], _attrs)
for _dt, _shape in ((F32, (4, 5)), (I64, (2, 3, 3)), (BOOL, (3, 2)), (BF16, (5, 4))):
    for _upper in (True, False):
        for _kk in (0, -1, 2, 100):
            case(f"trilu-{dname(_dt)}-{_upper}-{_kk}", "trilu", [sample(_dt, *_shape)], {"upper": _upper, "k": _kk})

# -- reductions, along an axis, norms, matmul ------------------------------------------------------

for _op in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"):
    for _dt in (F32, BF16, F16, I64, I32, BOOL):
        if _op == "reduce_mean" and not _dt.is_floating_point:
            continue
        for _axes, _keep in (((1,), False), ((0, 2), True), ((-1,), False), ((0, 1, 2), False)):
            if _op == "reduce_prod" and _dt in HALF and len(_axes) > 1:
                continue  # torch rounds after each axis
            _x = sample(_dt, 3, 4, 5)
            if _op == "reduce_prod" and _dt.is_floating_point:
                _x = uniform(0.5, 1.5, 3, 4, 5, dtype=_dt)
            case(f"{_op}-{dname(_dt)}-{list(_axes)}-{_keep}", _op, [_x], {"axes": _axes, "keepdim": _keep},
                 tol="reduce" if _dt.is_floating_point else "exact")
    for _dt in (F32, I64, BOOL):
        if _op == "reduce_mean" and _dt != F32:
            continue
        case(f"{_op}-empty-{dname(_dt)}", _op, [sample(_dt, 2, 0, 3)], {"axes": (1,)}, tol="reduce")
case("reduce_sum-f32-parallel", "reduce_sum", [randn(512, 300)], {"axes": (0,)}, tol="reduce")
case("reduce_max-f32-nan", "reduce_max", [torch.tensor([[1.0, math.nan, 3.0], [1.0, 2.0, 0.0]])], {"axes": (1,)})

_TIES = torch.tensor([[1.0, 3.0, 3.0, -1.0, 3.0], [2.0, math.nan, 5.0, math.nan, -2.0], [0.0, -0.0, 0.0, 1.0, 1.0]])
for _op in ("argmax", "argmin"):
    for _dt in (F32, BF16):
        for _attrs in ({"axis": 1}, {"axis": -1, "select_last": True}, {"axis": 0, "keepdim": False}):
            case(f"{_op}-{dname(_dt)}-{list(_attrs.values())}", _op, [_TIES.to(_dt)], _attrs)
    for _dt in (I64, I32, U8):
        case(f"{_op}-{dname(_dt)}", _op, [sample(_dt, 3, 6)], {"axis": 1, "select_last": True})
        case(f"{_op}-{dname(_dt)}-first", _op, [sample(_dt, 4, 3)], {"axis": 0, "keepdim": False})
for _dt in (F32, BF16):
    for _attrs in ({"k": 3}, {"k": 5, "largest": False}, {"k": 2, "axis": 0}, {"k": 0}, {"k": 3, "axis": 0,
                                                                                       "largest": False}):
        case(f"topk-{dname(_dt)}-{list(_attrs.values())}", "topk", [_TIES.to(_dt)], _attrs)
case("topk-i64", "topk", [randint(-3, 3, 4, 9)], {"k": 4})
case("topk-i32-smallest", "topk", [randint(-3, 3, 9, 2, dtype=I32)], {"k": 9, "axis": 0, "largest": False})
case("topk-f32-long", "topk", [randn(2, 1000)], {"k": 50})
for _dt in (F32, BF16, F16, I64, I32):
    for _ex, _rev in ((False, False), (True, False), (False, True), (True, True)):
        for _ax in (0, -1):
            case(f"cumsum-{dname(_dt)}-{_ex}-{_rev}-{_ax}", "cumsum", [sample(_dt, 4, 6)],
                 {"axis": _ax, "exclusive": _ex, "reverse": _rev}, tol="reduce" if _dt.is_floating_point else "exact")
for _op in ("softmax", "log_softmax"):
    for _dt in (F32, BF16, F16):
        for _ax in (-1, 0, 1):
            case(f"{_op}-{dname(_dt)}-{_ax}", _op, [randn(3, 7, 2, dtype=_dt)], {"axis": _ax}, tol="reduce")
    _m = randn(4, 9)
    _m[:, 5:] = -math.inf
    case(f"{_op}-masked", _op, [_m], {"axis": -1}, tol="reduce")
    case(f"{_op}-parallel", _op, [randn(64, 1000)], {"axis": -1}, tol="reduce")
for _dt in (F32, BF16, F16):
    case(f"layer_norm-{dname(_dt)}", "layer_norm",
         [randn(3, 16, dtype=_dt), randn(16, dtype=_dt), randn(16, dtype=_dt)], tol="reduce")
    case(f"layer_norm-nobias-{dname(_dt)}", "layer_norm", [randn(2, 3, 8, dtype=_dt), randn(3, 8, dtype=_dt)],
         {"axis": -2, "eps": 1e-6}, tol="reduce")
    case(f"layer_norm-bcast-{dname(_dt)}", "layer_norm", [randn(2, 3, 8, dtype=_dt), randn(8, dtype=_dt),
                                                          randn(3, 1, dtype=_dt)], {"axis": 1}, tol="reduce")
    case(f"rms_norm-{dname(_dt)}", "rms_norm", [randn(4, 32, dtype=_dt), randn(32, dtype=_dt)], tol="reduce")
    case(f"rms_norm-bcast-{dname(_dt)}", "rms_norm", [randn(2, 3, 8, dtype=_dt), randn(8, dtype=_dt)],
         {"axis": -2, "eps": 0.01}, tol="reduce")
case("rms_norm-bf16-f32-scale", "rms_norm", [randn(4, 16, dtype=BF16), randn(16)], tol="reduce")
case("layer_norm-parallel", "layer_norm", [randn(256, 128), randn(128), randn(128)], tol="reduce")
for _dt in (F32, BF16, F16, I64, I32):
    for _a, _b in (((3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((4,), (4, 3)), ((2, 5, 4), (4,)), ((6,), (6,)),
                   ((1, 3, 2), (2, 2, 5))):
        _xa, _xb = (sample(_dt, *_a), sample(_dt, *_b)) if _dt.is_floating_point else \
            (randint(-9, 9, *_a, dtype=_dt), randint(-9, 9, *_b, dtype=_dt))
        case(f"matmul-{dname(_dt)}-{list(_a)}{list(_b)}", "matmul", [_xa, _xb], tol="reduce")
case("matmul-f32-parallel", "matmul", [randn(64, 96), randn(96, 80)], tol="reduce")

# -- building, running, comparing --------------------------------------------------------------------


def _ttype(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(t.shape), DType.from_torch(t.dtype))


def _build(cases: list[Case], path: Path) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """One graph of every case's op; (case id -> its output names, input name -> value)."""
    g = Graph("main")
    outs: dict[str, list[str]] = {}
    feeds: dict[str, torch.Tensor] = {}
    results: list[Value] = []
    for k, c in enumerate(cases):
        vals = []
        for i, a in enumerate(c.args):
            v = g.add_input(f"c{k}_in{i}", _ttype(a))
            feeds[v.name] = a
            if i in c.computed:
                zero = g.add_constant(f"c{k}_zero{i}", _ttype(a), TensorSource(torch.zeros_like(a)))
                v = g.add_node("add", [v, zero], [_ttype(a)], names=f"c{k}_idx{i}").outputs[0]
            vals.append(v)
        types = get_op(c.op).infer_types([v.type for v in vals], c.attrs)
        node = g.add_node(c.op, vals, types, c.attrs, names=f"c{k}_out")
        outs[c.id] = [o.name for o in node.outputs]
        results.extend(node.outputs)
    g.set_outputs(results)
    write_om(lower(g, get_target("cpu")), str(path))
    return outs, feeds


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == BF16 else t.numpy()


def _from_native(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))  # (ascontiguousarray makes a scalar 1-D)
    return t.view(torch.int16).view(BF16) if like.dtype == BF16 else t


def _run(path: Path, feeds: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    from npuc.runtime.native_session import NativeSession

    ref = Session.load(str(path), use_native=False).run(feeds)
    nat = NativeSession.load(str(path), threads=2).run({k: _to_numpy(v) for k, v in feeds.items()})
    return {k: v.clone() for k, v in ref.items()}, nat


def _ulp(ref: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value of a half-precision tensor (as f64)."""
    mant = 7 if ref.dtype == BF16 else 10
    tiny = torch.finfo(ref.dtype).tiny
    r = ref.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(r)) - mant)


def compare(nat: torch.Tensor, ref: torch.Tensor, tol: str) -> None:
    assert nat.dtype == ref.dtype and nat.shape == ref.shape, (nat.dtype, nat.shape, ref.dtype, ref.shape)
    if tol == "exact" or not ref.dtype.is_floating_point:
        torch.testing.assert_close(nat, ref, rtol=0, atol=0, equal_nan=True)
        return
    if ref.dtype in HALF:
        a, b = nat.double(), ref.double()
        same = (a == b) | (a.isnan() & b.isnan())
        bad = ~same & ~((a - b).abs() <= _ulp(ref))
        assert not bad.any(), f"{int(bad.sum())} values beyond 1 ulp: {a[bad][:8].tolist()} vs {b[bad][:8].tolist()}"
        return
    rtol = 1e-6 if tol == "math" else 1e-5
    torch.testing.assert_close(nat, ref, rtol=rtol, atol=rtol, equal_nan=True)


GROUP = 48  # cases per .om


@pytest.fixture(scope="module")
def native_lib() -> None:
    from npuc.runtime.native_session import runtime_library

    if runtime_library() is None:
        pytest.skip("the native runtime cannot be built here (no C compiler, or NPUC_NATIVE=0)")


@pytest.fixture(scope="module")
def results(native_lib: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Case id -> (native outputs, reference outputs), or the error its group's run raised:
    each group of GROUP cases is built and run once, the first time one of its cases is asked."""
    root = tmp_path_factory.mktemp("npucrt_ops")
    cache: dict[str, Any] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, cid: str) -> Any:
            if cid in cache:
                return cache[cid]
            g = next(i for i, c in enumerate(CASES) if c.id == cid) // GROUP
            group = CASES[g * GROUP:(g + 1) * GROUP]
            path = root / f"group{g}.om"
            try:
                names, feeds = _build(group, path)
                ref, nat = _run(path, feeds)
                for c in group:
                    cache[c.id] = ([nat[n] for n in names[c.id]], [ref[n] for n in names[c.id]])
            except NpucError as e:  # one op refused: run each case alone, to say which
                for k, c in enumerate(group):
                    try:
                        names, feeds = _build([c], root / f"group{g}_{k}.om")
                        ref, nat = _run(root / f"group{g}_{k}.om", feeds)
                        cache[c.id] = ([nat[n] for n in names[c.id]], [ref[n] for n in names[c.id]])
                    except NpucError as e1:
                        cache[c.id] = e1
                del e
            return cache[cid]

    return Lazy()


_IDS = [c.id for c in CASES]
assert len(set(_IDS)) == len(_IDS), [i for i in _IDS if _IDS.count(i) > 1]


@pytest.mark.parametrize("c", CASES, ids=_IDS)
def test_op(c: Case, results: dict[str, Any]) -> None:
    r = results[c.id]
    if isinstance(r, Exception):
        raise r
    nat, ref = r
    assert len(nat) == len(ref)
    for n, rt in zip(nat, ref, strict=True):
        compare(_from_native(n, rt), rt, c.tol)


# -- refusals and run-time index checks ----------------------------------------------------------------

_BAD_INDEX = [
    Case("gather-past-end", "gather", [randn(4, 5), torch.tensor([0, 5])], {"axis": 1}, computed=(1,)),
    Case("gather-before-start", "gather", [randn(4, 5), torch.tensor([-6], dtype=I32)], {"axis": -1}, computed=(1,)),
    Case("gather_elements-past-end", "gather_elements", [randn(3, 4), torch.tensor([[0], [4], [1]])], {"axis": 1},
         computed=(1,)),
    Case("gather_nd-past-end", "gather_nd", [randn(3, 4), torch.tensor([[2, 4]])], computed=(1,)),
    Case("scatter_elements-past-end", "scatter_elements", [randn(3, 4), torch.tensor([[3]]), randn(1, 1)],
         computed=(1,)),
    Case("index-past-end", "index", [randn(3, 4), torch.tensor([1, 3])], computed=(1,)),
    Case("index-second-before-start", "index", [randn(3, 4), torch.tensor([0]), torch.tensor([-5])],
         computed=(1, 2)),
]


@pytest.mark.parametrize("c", _BAD_INDEX, ids=[c.id for c in _BAD_INDEX])
def test_index_out_of_range(c: Case, native_lib: None, tmp_path: Path) -> None:
    from npuc.runtime.native_session import NativeSession

    _, feeds = _build([c], tmp_path / "bad.om")
    s = NativeSession.load(str(tmp_path / "bad.om"), threads=1)
    with pytest.raises(NpucError) as e:
        s.run({k: _to_numpy(v) for k, v in feeds.items()})
    assert e.value.code == "NPUC-E0412"


@pytest.mark.parametrize("c", [
    Case("exp-f64", "exp", [randn(3, dtype=F64)]),
    Case("matmul-bool", "matmul", [randbool(2, 3), randbool(3, 2)]),
    Case("reduce_sum-f64", "reduce_sum", [randn(2, 3, dtype=F64)], {"axes": (1,)}),
    Case("argmax-bool", "argmax", [randbool(2, 3)]),  # torch has no kernel for these either
    Case("cumsum-bool", "cumsum", [randbool(2, 3)], {"axis": 0}),
], ids=lambda c: c.id)
def test_refused_at_load(c: Case, native_lib: None, tmp_path: Path) -> None:
    from npuc.runtime.native_session import NativeSession

    _build([c], tmp_path / "refused.om")
    with pytest.raises(NpucError) as e:
        NativeSession.load(str(tmp_path / "refused.om"))
    assert e.value.code == "NPUC-E0413"
    assert f"({c.op})" in e.value.message
