"""Op declarations: schema, shape/dtype rule, reference kernel, cost and unit.

Conventions shared by every op:
- binary arithmetic takes operands of one dtype (frontends insert `cast`), and
  broadcasts shapes like numpy;
- axes are normalised to be non-negative by the shape rules;
- kernels take a list of torch tensors and the attributes with defaults filled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from npuc.ir.registry import Attr, op
from npuc.ir.types import DType, TensorType

T = Sequence[TensorType]
A = Mapping[str, Any]


class ShapeError(ValueError):
    """A shape rule refused its operands (the verifier turns it into a message)."""


def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ShapeError(f"shapes {list(shapes)} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def norm_axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise ShapeError(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def _same_dtype(ins: T) -> DType:
    dts = {t.dtype for t in ins}
    if len(dts) != 1:
        raise ShapeError(f"operands have different dtypes {sorted(str(d) for d in dts)}")
    return dts.pop()


# -- elementwise --------------------------------------------------------------

# Float-only math: torch would silently promote integers to float, which breaks
# "the shape rule says what the kernel returns"; frontends cast first.
_FLOAT_UNARY = {
    "rsqrt": torch.rsqrt, "sqrt": torch.sqrt, "exp": torch.exp, "log": torch.log, "cos": torch.cos,
    "sin": torch.sin, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu,
    "reciprocal": torch.reciprocal, "erf": torch.erf,
}
_NUMERIC_UNARY = {"neg": torch.neg, "relu": torch.relu, "abs": torch.abs}


def _float_unary_infer(ins: T, attrs: A) -> list[TensorType]:
    if not ins[0].dtype.is_float:
        raise ShapeError(f"needs a float operand, got {ins[0].dtype}")
    return [ins[0]]


def _numeric_unary_infer(ins: T, attrs: A) -> list[TensorType]:
    if ins[0].dtype == DType.bool:
        raise ShapeError("needs a numeric operand, got bool")
    return [ins[0]]


for _name, _fn in _FLOAT_UNARY.items():
    op(_name, ("x",), kernel=lambda xs, a, _fn=_fn: _fn(xs[0]))(_float_unary_infer)
for _name, _fn in _NUMERIC_UNARY.items():
    op(_name, ("x",), kernel=lambda xs, a, _fn=_fn: _fn(xs[0]))(_numeric_unary_infer)

op("gelu", ("x",), {"approximate": Attr("str", "none")},
   kernel=lambda xs, a: F.gelu(xs[0], approximate=a["approximate"]))(_float_unary_infer)


@op("logical_not", ("x",), kernel=lambda xs, a: torch.logical_not(xs[0]))
def _logical_not(ins: T, attrs: A) -> list[TensorType]:
    return [ins[0].with_dtype(DType.bool)]


@op("cast", ("x",), {"dtype": Attr("dtype")}, kernel=lambda xs, a: xs[0].to(a["dtype"].torch))
def _cast(ins: T, attrs: A) -> list[TensorType]:
    return [ins[0].with_dtype(attrs["dtype"])]


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
}
# Which operand dtypes each binary op takes (the kernel's dtype is then the operands').
_BINARY_DTYPES = {
    "sub": lambda d: d != DType.bool, "pow": lambda d: d != DType.bool, "div": lambda d: d.is_float,
    "bitwise_and": lambda d: not d.is_float, "bitwise_or": lambda d: not d.is_float,
}
_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


def _binary_infer_for(name: str) -> Callable[[T, A], list[TensorType]]:
    ok = _BINARY_DTYPES.get(name, lambda d: True)

    def infer(ins: T, attrs: A) -> list[TensorType]:
        dt = _same_dtype(ins)
        if not ok(dt):
            raise ShapeError(f"{name} does not take {dt} operands")
        return [TensorType(broadcast(ins[0].shape, ins[1].shape), dt)]

    return infer


def _compare_infer(ins: T, attrs: A) -> list[TensorType]:
    _same_dtype(ins)
    return [TensorType(broadcast(ins[0].shape, ins[1].shape), DType.bool)]


for _name, _fn in _BINARY.items():
    op(_name, ("a", "b"), kernel=lambda xs, a, _fn=_fn: _fn(xs[0], xs[1]))(_binary_infer_for(_name))
for _name, _fn in _COMPARE.items():
    op(_name, ("a", "b"), kernel=lambda xs, a, _fn=_fn: _fn(xs[0], xs[1]))(_compare_infer)


@op("where", ("cond", "a", "b"), kernel=lambda xs, a: torch.where(xs[0], xs[1], xs[2]))
def _where(ins: T, attrs: A) -> list[TensorType]:
    if ins[0].dtype != DType.bool:
        raise ShapeError("where's condition must be bool")
    return [TensorType(broadcast(*(t.shape for t in ins)), _same_dtype(ins[1:]))]


# -- reductions and normalisations -----------------------------------------------

def _reduce_infer(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    if not attrs["axes"]:
        raise ShapeError("reductions name their axes explicitly (torch would reduce all axes)")
    axes = {norm_axis(a, x.rank) for a in attrs["axes"]}
    if attrs["keepdim"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return [x.with_shape(shape)]


def _amax(x: torch.Tensor, axes: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    return torch.amax(x, dim=axes, keepdim=keepdim)


_REDUCE = {
    "reduce_mean": lambda x, ax, k: torch.mean(x, dim=ax, keepdim=k),
    "reduce_sum": lambda x, ax, k: torch.sum(x, dim=ax, keepdim=k, dtype=x.dtype),
    "reduce_max": _amax,
}
for _name, _fn in _REDUCE.items():
    op(_name, ("x",), {"axes": Attr("ints"), "keepdim": Attr("bool", False)},
       kernel=lambda xs, a, _fn=_fn: _fn(xs[0], tuple(a["axes"]), a["keepdim"]))(_reduce_infer)


@op("cumsum", ("x",), {"axis": Attr("int")},
    kernel=lambda xs, a: torch.cumsum(xs[0], dim=a["axis"], dtype=xs[0].dtype))
def _cumsum(ins: T, attrs: A) -> list[TensorType]:
    norm_axis(attrs["axis"], ins[0].rank)
    return [ins[0]]


@op("softmax", ("x",), {"axis": Attr("int")}, kernel=lambda xs, a: torch.softmax(xs[0], dim=a["axis"]),
    flops=lambda i, o, a: 5 * o[0].numel)
def _softmax(ins: T, attrs: A) -> list[TensorType]:
    norm_axis(attrs["axis"], ins[0].rank)
    return [ins[0]]


# -- data movement ----------------------------------------------------------------

_dma = {"unit": "dma", "flops": lambda i, o, a: 0}


@op("reshape", ("x",), {"shape": Attr("ints")}, kernel=lambda xs, a: xs[0].reshape(a["shape"]), **_dma)
def _reshape(ins: T, attrs: A) -> list[TensorType]:
    shape = tuple(attrs["shape"])
    if any(d < 0 for d in shape) or math.prod(shape) != ins[0].numel:
        raise ShapeError(f"cannot reshape {ins[0]} to {list(shape)}")
    return [ins[0].with_shape(shape)]


@op("transpose", ("x",), {"perm": Attr("ints")}, kernel=lambda xs, a: xs[0].permute(a["perm"]), **_dma)
def _transpose(ins: T, attrs: A) -> list[TensorType]:
    perm = attrs["perm"]
    if sorted(perm) != list(range(ins[0].rank)):
        raise ShapeError(f"perm {list(perm)} is not a permutation of rank {ins[0].rank}")
    return [ins[0].with_shape(tuple(ins[0].shape[p] for p in perm))]


@op("expand", ("x",), {"shape": Attr("ints")}, kernel=lambda xs, a: xs[0].expand(a["shape"]), **_dma)
def _expand(ins: T, attrs: A) -> list[TensorType]:
    shape = tuple(attrs["shape"])
    x = ins[0].shape
    if any(d < 0 for d in shape) or len(shape) < len(x) or any(d != s and d != 1 for d, s in zip(x[::-1], shape[::-1], strict=False)):
        raise ShapeError(f"cannot expand {ins[0]} to {list(shape)}")
    return [ins[0].with_shape(shape)]


def _slice_range(dim: int, start: int, end: int, step: int) -> range:
    return range(dim)[slice(start, end, step)]


def _slice_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    idx = [slice(None)] * x.dim()
    idx[a["axis"]] = slice(a["start"], a["end"], a["step"])
    return x[tuple(idx)]


_slice_attrs = {"axis": Attr("int"), "start": Attr("int", 0), "end": Attr("int"), "step": Attr("int", 1)}


@op("slice", ("x",), _slice_attrs, kernel=_slice_kernel, **_dma)
def _slice(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    if attrs["step"] < 1:
        raise ShapeError("slice step must be positive")
    n = len(_slice_range(x.shape[ax], attrs["start"], attrs["end"], attrs["step"]))
    return [x.with_shape(x.shape[:ax] + (n,) + x.shape[ax + 1:])]


def _slice_scatter_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    return torch.slice_scatter(xs[0], xs[1], dim=a["axis"], start=a["start"], end=a["end"], step=a["step"])


@op("slice_scatter", ("x", "src"), _slice_attrs, kernel=_slice_scatter_kernel, **_dma)
def _slice_scatter(ins: T, attrs: A) -> list[TensorType]:
    want = _slice([ins[0]], attrs)[0]
    if ins[1].shape != want.shape or ins[1].dtype != ins[0].dtype:
        raise ShapeError(f"slice_scatter source {ins[1]} does not fit slice {want}")
    return [ins[0]]


@op("concat", ("*xs",), {"axis": Attr("int")}, kernel=lambda xs, a: torch.cat(xs, dim=a["axis"]), **_dma)
def _concat(ins: T, attrs: A) -> list[TensorType]:
    dt = _same_dtype(ins)
    ax = norm_axis(attrs["axis"], ins[0].rank)
    for t in ins:
        if t.rank != ins[0].rank or any(t.shape[i] != ins[0].shape[i] for i in range(t.rank) if i != ax):
            raise ShapeError(f"concat operands {[str(t) for t in ins]} disagree off axis {ax}")
    total = sum(t.shape[ax] for t in ins)
    return [TensorType(ins[0].shape[:ax] + (total,) + ins[0].shape[ax + 1:], dt)]


@op("split", ("x",), {"axis": Attr("int"), "sizes": Attr("ints")},
    kernel=lambda xs, a: list(torch.split(xs[0], list(a["sizes"]), dim=a["axis"])), **_dma)
def _split(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    if sum(attrs["sizes"]) != x.shape[ax]:
        raise ShapeError(f"split sizes {list(attrs['sizes'])} do not add up to {x.shape[ax]}")
    return [x.with_shape(x.shape[:ax] + (s,) + x.shape[ax + 1:]) for s in attrs["sizes"]]


@op("gather", ("x", "indices"), {"axis": Attr("int", 0)},
    kernel=lambda xs, a: _gather(xs[0], xs[1], a["axis"]), **_dma)
def _gather_infer(ins: T, attrs: A) -> list[TensorType]:
    x, idx = ins
    if idx.dtype not in (DType.i64, DType.i32):
        raise ShapeError("gather indices must be i64 or i32")
    ax = norm_axis(attrs["axis"], x.rank)
    return [x.with_shape(x.shape[:ax] + idx.shape + x.shape[ax + 1:])]


def _gather(x: torch.Tensor, idx: torch.Tensor, axis: int) -> torch.Tensor:
    flat = torch.index_select(x, axis, idx.reshape(-1).long())
    ax = axis % x.dim()
    return flat.reshape(x.shape[:ax] + idx.shape + x.shape[ax + 1:])


@op("index", ("x", "*indices"), kernel=lambda xs, a: xs[0][tuple(i.long() for i in xs[1:])], **_dma)
def _index(ins: T, attrs: A) -> list[TensorType]:
    """Advanced indexing of the leading axes by broadcast index tensors (x[i0, i1, ...])."""
    x, idx = ins[0], ins[1:]
    if not idx or len(idx) > x.rank:
        raise ShapeError(f"index takes 1..{x.rank} index tensors")
    for t in idx:
        if t.dtype not in (DType.i64, DType.i32):
            raise ShapeError("index tensors must be i64 or i32")
    return [x.with_shape(broadcast(*(t.shape for t in idx)) + x.shape[len(idx):])]


# -- sources ---------------------------------------------------------------------

@op("arange", (), {"start": Attr("float", 0), "end": Attr("float"), "step": Attr("float", 1), "dtype": Attr("dtype")},
    kernel=lambda xs, a: torch.arange(a["start"], a["end"], a["step"], dtype=a["dtype"].torch))
def _arange(ins: T, attrs: A) -> list[TensorType]:
    n = max(0, math.ceil((attrs["end"] - attrs["start"]) / attrs["step"]))
    return [TensorType((n,), attrs["dtype"])]


@op("full", (), {"shape": Attr("ints"), "value": Attr("float"), "dtype": Attr("dtype")},
    kernel=lambda xs, a: torch.full(a["shape"], a["value"], dtype=a["dtype"].torch))
def _full(ins: T, attrs: A) -> list[TensorType]:
    return [TensorType(tuple(attrs["shape"]), attrs["dtype"])]


# -- matrix unit -------------------------------------------------------------------

def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ShapeError("matmul operands must have rank >= 1")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"matmul contraction mismatch {list(a)} @ {list(b)}")
    out = broadcast(a2[:-2], b2[:-2]) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _matmul_flops(ins: T, outs: T, attrs: A) -> int:
    return 2 * outs[0].numel * ins[0].shape[-1]


@op("matmul", ("a", "b"), kernel=lambda xs, a: torch.matmul(xs[0], xs[1]), flops=_matmul_flops, unit="cube")
def _matmul(ins: T, attrs: A) -> list[TensorType]:
    return [TensorType(_matmul_shape(ins[0].shape, ins[1].shape), _same_dtype(ins))]


@op("linear", ("x", "weight", "bias?"), kernel=lambda xs, a: F.linear(*xs), flops=_matmul_flops, unit="cube",
    doc="y = x @ weight^T + bias, weight stored [out, in] as in torch")
def _linear(ins: T, attrs: A) -> list[TensorType]:
    x, w = ins[0], ins[1]
    if w.rank != 2 or x.rank < 1 or x.shape[-1] != w.shape[1]:
        raise ShapeError(f"linear weight {w} does not fit input {x}")
    if len(ins) == 3 and ins[2].shape != (w.shape[0],):
        raise ShapeError(f"linear bias {ins[2]} does not fit weight {w}")
    return [TensorType(x.shape[:-1] + (w.shape[0],), _same_dtype(ins))]


def _sdpa_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) > 3 else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=a["causal"], scale=a["scale"],
                                          enable_gqa=a["gqa"])


def _sdpa_flops(ins: T, outs: T, attrs: A) -> int:
    q, k, v = ins[:3]
    return 2 * q.numel * k.shape[-2] + 2 * outs[0].numel * k.shape[-2]


@op("sdpa", ("q", "k", "v", "mask?"),
    {"scale": Attr("float", None, optional=True), "causal": Attr("bool", False), "gqa": Attr("bool", False)},
    kernel=_sdpa_kernel, flops=_sdpa_flops, unit="cube",
    doc="softmax(q @ k^T * scale + mask) @ v over [..., heads, seq, dim]")
def _sdpa(ins: T, attrs: A) -> list[TensorType]:
    q, k, v = ins[:3]
    if q.rank < 2 or k.rank != q.rank or v.rank != q.rank:
        raise ShapeError("sdpa operands must share a rank >= 2")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"sdpa q {q}, k {k}, v {v} do not fit")
    if attrs["gqa"] and q.rank >= 3 and q.shape[-3] % k.shape[-3]:
        raise ShapeError("sdpa query heads are not a multiple of key heads")
    if len(ins) == 4:
        broadcast(ins[3].shape, q.shape[:-1] + (k.shape[-2],))
    _same_dtype(ins[:3])
    return [TensorType(q.shape[:-1] + (v.shape[-1],), q.dtype)]
