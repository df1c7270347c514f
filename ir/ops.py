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


_HALF = (torch.float16, torch.bfloat16)


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
    "reciprocal": torch.reciprocal, "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round,  # half to even, as ONNX Round
    "tan": torch.tan, "sinh": torch.sinh, "cosh": torch.cosh, "asin": torch.asin, "acos": torch.acos,
    "atan": torch.atan, "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh,
    "softplus": F.softplus, "softsign": F.softsign, "mish": F.mish, "hardswish": F.hardswish,
    "expm1": torch.expm1, "log1p": torch.log1p,
}
_NUMERIC_UNARY = {"neg": torch.neg, "relu": torch.relu, "abs": torch.abs, "sign": torch.sign}


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

# Activations with parameters, as ONNX defines them (its defaults are the frontend's business).
_ACTIVATIONS: dict[str, tuple[dict[str, Attr], Callable[[torch.Tensor, A], torch.Tensor]]] = {
    "elu": ({"alpha": Attr("float", 1.0)}, lambda x, a: F.elu(x, a["alpha"])),
    "celu": ({"alpha": Attr("float", 1.0)}, lambda x, a: F.celu(x, a["alpha"])),
    "selu": ({"alpha": Attr("float"), "gamma": Attr("float")},
             lambda x, a: a["gamma"] * torch.where(x > 0, x, a["alpha"] * torch.expm1(x))),
    "leaky_relu": ({"alpha": Attr("float", 0.01)}, lambda x, a: F.leaky_relu(x, a["alpha"])),
    "hard_sigmoid": ({"alpha": Attr("float", 0.2), "beta": Attr("float", 0.5)},
                     lambda x, a: torch.clamp(x * a["alpha"] + a["beta"], 0, 1)),
    "thresholded_relu": ({"alpha": Attr("float", 1.0)}, lambda x, a: torch.where(x > a["alpha"], x, 0)),
}
for _name, (_attrs, _act) in _ACTIVATIONS.items():
    op(_name, ("x",), _attrs, kernel=lambda xs, a, _act=_act: _act(xs[0], a))(_float_unary_infer)


@op("logical_not", ("x",), kernel=lambda xs, a: torch.logical_not(xs[0]))
def _logical_not(ins: T, attrs: A) -> list[TensorType]:
    return [ins[0].with_dtype(DType.bool)]


@op("is_nan", ("x",), kernel=lambda xs, a: torch.isnan(xs[0]))
def _is_nan(ins: T, attrs: A) -> list[TensorType]:
    if not ins[0].dtype.is_float:
        raise ShapeError(f"is_nan needs a float operand, got {ins[0].dtype}")
    return [ins[0].with_dtype(DType.bool)]


def _is_inf_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    pos = torch.isposinf(x) if a["detect_positive"] else torch.zeros_like(x, dtype=torch.bool)
    return (pos | torch.isneginf(x)) if a["detect_negative"] else pos


@op("is_inf", ("x",), {"detect_negative": Attr("bool", True), "detect_positive": Attr("bool", True)},
    kernel=_is_inf_kernel)
def _is_inf(ins: T, attrs: A) -> list[TensorType]:
    if not ins[0].dtype.is_float:
        raise ShapeError(f"is_inf needs a float operand, got {ins[0].dtype}")
    return [ins[0].with_dtype(DType.bool)]


@op("bitwise_not", ("x",), kernel=lambda xs, a: torch.bitwise_not(xs[0]))
def _bitwise_not(ins: T, attrs: A) -> list[TensorType]:
    if ins[0].dtype.is_float:
        raise ShapeError(f"bitwise_not needs an integer or bool operand, got {ins[0].dtype}")
    return [ins[0]]


@op("cast", ("x",), {"dtype": Attr("dtype")}, kernel=lambda xs, a: xs[0].to(a["dtype"].torch))
def _cast(ins: T, attrs: A) -> list[TensorType]:
    return [ins[0].with_dtype(attrs["dtype"])]


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
}
# Which operand dtypes each binary op takes (the kernel's dtype is then the operands').
_BINARY_DTYPES = {
    "sub": lambda d: d != DType.bool, "pow": lambda d: d != DType.bool, "div": lambda d: d.is_float,
    "bitwise_and": lambda d: not d.is_float, "bitwise_or": lambda d: not d.is_float,
    "bitwise_xor": lambda d: not d.is_float,
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


def _mod_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, y = xs
    fn = torch.fmod if a["fmod"] else torch.remainder
    if x.dtype.is_floating_point:
        return fn(x, y)
    zero = y == 0  # torch raises on an integer division by zero; numpy (and ONNX's reference) gives 0
    return torch.where(zero, torch.zeros_like(x), fn(x, torch.where(zero, torch.ones_like(y), y)))


def _floor_div_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, y = xs
    if x.dtype.is_floating_point:
        return torch.div(x, y, rounding_mode="floor")
    zero = y == 0  # as mod's: an integer division by zero gives 0, never a raise
    return torch.where(zero, torch.zeros_like(x),
                       torch.div(x, torch.where(zero, torch.ones_like(y), y), rounding_mode="floor"))


def _numeric_binary(ins: T, attrs: A) -> list[TensorType]:
    """Two numbers (no bools) of one dtype, broadcast."""
    dt = _same_dtype(ins)
    if dt == DType.bool:
        raise ShapeError("does not take bool operands")
    return [TensorType(broadcast(ins[0].shape, ins[1].shape), dt)]


op("floor_div", ("a", "b"), kernel=_floor_div_kernel,
   doc="quotient rounded down (Python //), of integers and floats; an integer division by zero gives 0"
   )(_numeric_binary)
op("mod", ("a", "b"), {"fmod": Attr("bool", False)}, kernel=_mod_kernel,
   doc="remainder; fmod=false: the sign of the divisor (Python %), fmod=true: of the dividend (C fmod)"
   )(_numeric_binary)


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


def _extreme(fn: Callable[..., torch.Tensor], largest: bool) -> Callable[..., torch.Tensor]:
    """amax/amin, and over an empty axis the identity of the reduction (-inf for max, as ONNX),
    where torch refuses."""
    def kernel(x: torch.Tensor, axes: tuple[int, ...], keepdim: bool) -> torch.Tensor:
        if all(x.shape[a] for a in axes):
            return fn(x, dim=axes, keepdim=keepdim)
        if x.dtype == torch.bool:
            fill: Any = not largest
        elif x.dtype.is_floating_point:
            fill = -math.inf if largest else math.inf
        else:
            fill = torch.iinfo(x.dtype).min if largest else torch.iinfo(x.dtype).max
        shape = [1 if i in axes else d for i, d in enumerate(x.shape)] if keepdim else \
            [d for i, d in enumerate(x.shape) if i not in axes]
        return torch.full(shape, fill, dtype=x.dtype)

    return kernel


def _prod(x: torch.Tensor, axes: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    for ax in sorted(axes, reverse=True):
        x = torch.prod(x, dim=ax, keepdim=keepdim, dtype=x.dtype)
    return x


_REDUCE = {
    # Half-precision reductions accumulate in f32 and round once.
    "reduce_mean": lambda x, ax, k: torch.mean(x.float() if x.dtype in _HALF else x, dim=ax, keepdim=k).to(x.dtype),
    "reduce_sum": lambda x, ax, k: torch.sum(x, dim=ax, keepdim=k, dtype=x.dtype),
    "reduce_max": _extreme(torch.amax, largest=True),
    "reduce_min": _extreme(torch.amin, largest=False),
    "reduce_prod": _prod,
}
for _name, _fn in _REDUCE.items():
    op(_name, ("x",), {"axes": Attr("ints"), "keepdim": Attr("bool", False)},
       kernel=lambda xs, a, _fn=_fn: _fn(xs[0], tuple(a["axes"]), a["keepdim"]))(_reduce_infer)


def _cumsum_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, ax = xs[0], a["axis"]
    if a["reverse"]:
        x = torch.flip(x, (ax,))
    y = torch.cumsum(x, dim=ax, dtype=x.dtype)
    if a["exclusive"]:
        y = y - x
    return torch.flip(y, (ax,)) if a["reverse"] else y


@op("cumsum", ("x",), {"axis": Attr("int"), "exclusive": Attr("bool", False), "reverse": Attr("bool", False)},
    kernel=_cumsum_kernel)
def _cumsum(ins: T, attrs: A) -> list[TensorType]:
    norm_axis(attrs["axis"], ins[0].rank)
    return [ins[0]]


@op("softmax", ("x",), {"axis": Attr("int")},
    kernel=lambda xs, a: torch.softmax(xs[0], dim=a["axis"], dtype=torch.float32).to(xs[0].dtype),
    flops=lambda i, o, a: 5 * o[0].numel)
def _softmax(ins: T, attrs: A) -> list[TensorType]:
    norm_axis(attrs["axis"], ins[0].rank)
    return _float_unary_infer(ins, attrs)


# Its own op, not log(softmax): that underflows to -inf where x - max(x) < ~-104 (f32).
op("log_softmax", ("x",), {"axis": Attr("int")}, kernel=lambda xs, a: torch.log_softmax(xs[0], dim=a["axis"]),
   flops=lambda i, o, a: 5 * o[0].numel)(_softmax)


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
    ax = axis % x.dim()
    idx = idx.long()
    idx = torch.where(idx < 0, idx + x.shape[ax], idx)  # negative indices count from the end
    flat = torch.index_select(x, ax, idx.reshape(-1))
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


def _linear_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, w = xs[0], xs[1]
    y = F.linear(x, w) if a["weight_layout"] == "nk" else torch.matmul(x, w)
    return y + xs[2] if len(xs) > 2 else y


def linear_nk(w: TensorType, layout: str) -> tuple[int, int]:
    """(out features, in features) of a linear weight stored in `layout`."""
    return (w.shape[0], w.shape[1]) if layout == "nk" else (w.shape[1], w.shape[0])


@op("linear", ("x", "weight", "bias?"),
    {"weight_layout": Attr("str", "nk"), "valid_rows": Attr("int", None, optional=True)},
    kernel=_linear_kernel, flops=_matmul_flops, unit="cube",
    doc="y = x @ W + bias; the weight is stored [out, in] (layout nk, torch's) or [in, out] (layout kn, "
        "ONNX MatMul's), so no weight is ever transposed. valid_rows (set by target alignment): only the "
        "first valid_rows rows along x's axis -2 carry data, the rest are tile padding whose results no "
        "one reads; a kernel may leave those rows of y unwritten")
def _linear(ins: T, attrs: A) -> list[TensorType]:
    x, w = ins[0], ins[1]
    if attrs["weight_layout"] not in ("nk", "kn") or w.rank != 2:
        raise ShapeError(f"linear weight {w} with layout {attrs['weight_layout']!r}")
    rows = attrs["valid_rows"]
    if rows is not None and (x.rank < 2 or not 1 <= rows <= x.shape[-2]):
        raise ShapeError(f"linear valid_rows={rows} does not fit input {x}")
    n, k = linear_nk(w, attrs["weight_layout"])
    if x.rank < 1 or x.shape[-1] != k:
        raise ShapeError(f"linear weight {w} does not fit input {x}")
    if len(ins) == 3 and ins[2].shape != (n,):
        raise ShapeError(f"linear bias {ins[2]} does not fit weight {w}")
    return [TensorType(x.shape[:-1] + (n,), _same_dtype(ins))]


def _einsum_meta(equation: str, ins: T) -> torch.Tensor:
    try:
        return torch.einsum(equation, *(torch.empty(t.shape, device="meta") for t in ins))
    except (RuntimeError, ValueError) as e:
        raise ShapeError(f"einsum {equation!r} does not fit {[str(t) for t in ins]}: {e}") from None


def _einsum_flops(ins: T, outs: T, attrs: A) -> int:
    """2 * the size of the full index space (every label once, broadcast `...` dims once)."""
    lhs = attrs["equation"].split("->")[0].split(",")
    sizes: dict[str, int] = {}
    ell = 1
    for term, t in zip(lhs, ins, strict=True):
        labels = term.strip().replace("...", ".")
        n_ell = t.rank - (len(labels) - 1) if "." in labels else 0
        dims = iter(t.shape)
        for c in labels:
            if c == ".":
                ell = max(ell, math.prod(next(dims) for _ in range(n_ell)))
            else:
                sizes[c] = max(sizes.get(c, 1), next(dims))
    return 2 * math.prod(sizes.values()) * ell


@op("einsum", ("*xs",), {"equation": Attr("str")}, kernel=lambda xs, a: torch.einsum(a["equation"], *xs),
    flops=_einsum_flops, unit="cube", doc="numpy/ONNX einsum (implicit output, `...` broadcasting)")
def _einsum(ins: T, attrs: A) -> list[TensorType]:
    if not ins:
        raise ShapeError("einsum needs at least one operand")
    dt = _same_dtype(ins)
    return [TensorType(tuple(_einsum_meta(attrs["equation"], ins).shape), dt)]


def _sdpa_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) > 3 else None
    # Half-precision operands are computed in fp32 and rounded once, as fused attention
    # kernels accumulate; torch's fp16 math path rounds every intermediate.
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(wide)
    if mask is not None and mask.dim() < 2:  # torch wants the [.., q, k] axes spelled out
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    y = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide), attn_mask=mask, is_causal=a["causal"],
                                       scale=a["scale"], enable_gqa=a["gqa"])
    return y.to(q.dtype)


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


# -- more data movement -------------------------------------------------------------

def _gather_nd_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    data, idx = xs[0], xs[1].long()
    b = a["batch_dims"]
    k = idx.shape[-1]
    bshape = data.shape[:b]
    nb = math.prod(bshape)
    d = data.reshape((nb,) + data.shape[b:])
    i = idx.reshape((nb, -1, k))
    dims = torch.tensor(data.shape[b:b + k])
    i = torch.where(i < 0, i + dims, i)
    out = torch.stack([d[n][tuple(i[n, :, j] for j in range(k))] for n in range(nb)])
    return out.reshape(tuple(idx.shape[:-1]) + tuple(data.shape[b + k:]))


@op("gather_nd", ("data", "indices"), {"batch_dims": Attr("int", 0)}, kernel=_gather_nd_kernel, **_dma)
def _gather_nd(ins: T, attrs: A) -> list[TensorType]:
    """ONNX GatherND: the last axis of `indices` addresses the leading axes of `data`."""
    data, idx = ins
    b = attrs["batch_dims"]
    if idx.dtype not in (DType.i64, DType.i32) or idx.rank < 1:
        raise ShapeError("gather_nd indices must be i64/i32 of rank >= 1")
    k = idx.shape[-1]
    if b + k > data.rank or data.shape[:b] != idx.shape[:b]:
        raise ShapeError(f"gather_nd indices {idx} do not fit data {data} with batch_dims={b}")
    return [data.with_shape(idx.shape[:-1] + data.shape[b + k:])]


def _scatter_nd_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    data, idx, upd = xs[0].clone(), xs[1].long(), xs[2]
    k = idx.shape[-1]
    flat_idx = idx.reshape(-1, k)
    flat_upd = upd.reshape((flat_idx.shape[0],) + tuple(data.shape[k:]))
    for n in range(flat_idx.shape[0]):
        pos = tuple(int(v) % data.shape[j] for j, v in enumerate(flat_idx[n]))
        red = a["reduction"]
        if red == "none":
            data[pos] = flat_upd[n]
        elif red == "add":
            data[pos] += flat_upd[n]
        elif red == "mul":
            data[pos] *= flat_upd[n]
        elif red == "max":
            data[pos] = torch.maximum(data[pos], flat_upd[n])
        else:
            data[pos] = torch.minimum(data[pos], flat_upd[n])
    return data


@op("scatter_nd", ("data", "indices", "updates"), {"reduction": Attr("str", "none")}, kernel=_scatter_nd_kernel,
    **_dma)
def _scatter_nd(ins: T, attrs: A) -> list[TensorType]:
    data, idx, upd = ins
    if idx.dtype not in (DType.i64, DType.i32) or idx.rank < 1 or idx.shape[-1] > data.rank:
        raise ShapeError(f"scatter_nd indices {idx} do not fit data {data}")
    if upd.shape != idx.shape[:-1] + data.shape[idx.shape[-1]:] or upd.dtype != data.dtype:
        raise ShapeError(f"scatter_nd updates {upd} do not fit indices {idx} and data {data}")
    if attrs["reduction"] not in ("none", "add", "mul", "max", "min"):
        raise ShapeError(f"unknown scatter_nd reduction {attrs['reduction']!r}")
    return [data]


def _elements_index(x: torch.Tensor, idx: torch.Tensor, axis: int) -> torch.Tensor:
    idx = idx.long()
    return torch.where(idx < 0, idx + x.shape[axis], idx)  # negative indices count from the end


def _check_elements(data: TensorType, idx: TensorType, axis: int, what: str) -> int:
    ax = norm_axis(axis, data.rank)
    if idx.dtype not in (DType.i64, DType.i32) or idx.rank != data.rank or \
            any(i > d for n, (i, d) in enumerate(zip(idx.shape, data.shape, strict=True)) if n != ax):
        raise ShapeError(f"{what} indices {idx} do not fit data {data} on axis {ax}")
    return ax


@op("gather_elements", ("x", "indices"), {"axis": Attr("int", 0)},
    kernel=lambda xs, a: torch.gather(xs[0], a["axis"], _elements_index(xs[0], xs[1], a["axis"])), **_dma,
    doc="ONNX GatherElements: out[i][j] = x[i][indices[i][j]] for axis 1 (torch.gather)")
def _gather_elements(ins: T, attrs: A) -> list[TensorType]:
    _check_elements(ins[0], ins[1], attrs["axis"], "gather_elements")
    return [ins[0].with_shape(ins[1].shape)]


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_elements_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, upd, ax = xs[0], xs[2], a["axis"]
    idx = _elements_index(x, xs[1], ax)
    if a["reduction"] == "none":
        return x.scatter(ax, idx, upd)
    return x.scatter_reduce(ax, idx, upd, _SCATTER_REDUCE[a["reduction"]], include_self=True)


@op("scatter_elements", ("data", "indices", "updates"), {"axis": Attr("int", 0), "reduction": Attr("str", "none")},
    kernel=_scatter_elements_kernel, **_dma,
    doc="ONNX ScatterElements: data[i][indices[i][j]] = updates[i][j] for axis 1, or combined by reduction")
def _scatter_elements(ins: T, attrs: A) -> list[TensorType]:
    data, idx, upd = ins
    _check_elements(data, idx, attrs["axis"], "scatter_elements")
    if upd.shape != idx.shape or upd.dtype != data.dtype:
        raise ShapeError(f"scatter_elements updates {upd} do not fit indices {idx} and data {data}")
    if attrs["reduction"] not in ("none", *_SCATTER_REDUCE):
        raise ShapeError(f"unknown scatter_elements reduction {attrs['reduction']!r}")
    return [data]


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _pad_index(n: int, before: int, after: int, mode: str) -> torch.Tensor:
    """Source index of every output position along one axis (non-constant modes)."""
    i = torch.arange(-before, n + after)
    if mode == "edge":
        return i.clamp(0, n - 1)
    if mode == "wrap":
        return i % n
    if n == 1:  # reflect
        return torch.zeros_like(i)
    i = i % (2 * n - 2)
    return torch.where(i >= n, 2 * n - 2 - i, i)


def _pad_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, pads, mode = xs[0], a["pads"], a["mode"]
    r = x.dim()
    for ax in range(r):  # negative pads crop
        lo, hi = max(-pads[ax], 0), x.shape[ax] - max(-pads[ax + r], 0)
        x = x.narrow(ax, lo, hi - lo)
    grow = [(max(pads[ax], 0), max(pads[ax + r], 0)) for ax in range(r)]
    if mode == "constant":
        out = x.new_zeros([d + b + e for d, (b, e) in zip(x.shape, grow, strict=True)])
        if len(xs) > 1:
            out.fill_(xs[1].reshape(()))
        out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, grow, strict=True))] = x
        return out
    for ax, (b, e) in enumerate(grow):
        if b or e:
            x = x.index_select(ax, _pad_index(x.shape[ax], b, e, mode))
    return x


@op("pad", ("x", "value?"), {"pads": Attr("ints"), "mode": Attr("str", "constant")}, kernel=_pad_kernel, **_dma,
    doc="ONNX Pad: pads = [begin_0, ..., begin_r-1, end_0, ..., end_r-1], negative crops; value: a scalar")
def _pad(ins: T, attrs: A) -> list[TensorType]:
    x, pads, mode = ins[0], attrs["pads"], attrs["mode"]
    r = x.rank
    if len(pads) != 2 * r or mode not in _PAD_MODES:
        raise ShapeError(f"pad needs 2*rank pads and a mode in {_PAD_MODES}, got {list(pads)}, {mode!r}")
    shape = tuple(d + pads[ax] + pads[ax + r] for ax, d in enumerate(x.shape))
    for ax, d in enumerate(x.shape):
        kept = d - max(-pads[ax], 0) - max(-pads[ax + r], 0)
        if kept < 0 or (mode != "constant" and kept == 0 and shape[ax] > 0):
            raise ShapeError(f"pad {list(pads)} ({mode}) does not fit {x}")
    if len(ins) > 1 and (ins[1].numel != 1 or ins[1].dtype != x.dtype):
        raise ShapeError(f"pad value {ins[1]} must be one {x.dtype} element")
    return [x.with_shape(shape)]


@op("trilu", ("x",), {"upper": Attr("bool", True), "k": Attr("int", 0)},
    kernel=lambda xs, a: (torch.triu if a["upper"] else torch.tril)(xs[0], a["k"]))
def _trilu(ins: T, attrs: A) -> list[TensorType]:
    if ins[0].rank < 2:
        raise ShapeError("trilu needs rank >= 2")
    return [ins[0]]


def _arg_kernel(fn: Any) -> Any:
    def kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
        x, ax = xs[0], a["axis"]
        if a["select_last"]:
            n = x.shape[ax]
            r = n - 1 - fn(torch.flip(x, (ax,)), dim=ax, keepdim=a["keepdim"])
        else:
            r = fn(x, dim=ax, keepdim=a["keepdim"])
        return r.to(torch.int64)

    return kernel


def _arg_infer(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    shape = tuple(1 if i == ax else d for i, d in enumerate(x.shape)) if attrs["keepdim"] else \
        tuple(d for i, d in enumerate(x.shape) if i != ax)
    return [TensorType(shape, DType.i64)]


for _name, _fn in {"argmax": torch.argmax, "argmin": torch.argmin}.items():
    op(_name, ("x",), {"axis": Attr("int", 0), "keepdim": Attr("bool", True), "select_last": Attr("bool", False)},
       kernel=_arg_kernel(_fn))(_arg_infer)


def _topk_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    # A stable sort keeps equal values in index order: ONNX wants the lower index first.
    vals, idx = torch.sort(xs[0], dim=a["axis"], descending=a["largest"], stable=True)
    return [vals.narrow(a["axis"], 0, a["k"]), idx.narrow(a["axis"], 0, a["k"])]


@op("topk", ("x",), {"k": Attr("int"), "axis": Attr("int", -1), "largest": Attr("bool", True)},
    kernel=_topk_kernel, doc="the k largest (or smallest) along axis, sorted, and their i64 indices")
def _topk(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    ax = norm_axis(attrs["axis"], x.rank)
    if x.dtype == DType.bool or not 0 <= attrs["k"] <= x.shape[ax]:
        raise ShapeError(f"topk k={attrs['k']} does not fit {x} on axis {ax}")
    shape = x.shape[:ax] + (attrs["k"],) + x.shape[ax + 1:]
    return [x.with_shape(shape), TensorType(shape, DType.i64)]


# -- normalisations and position encodings ----------------------------------------------

def _norm_axes(x: TensorType, axis: int) -> tuple[int, ...]:
    ax = norm_axis(axis, x.rank)
    return tuple(range(ax, x.rank))


def _rms_norm_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    axes = tuple(range(a["axis"] % x.dim(), x.dim()))
    xf = x.float()  # accumulate in fp32 whatever the storage dtype
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + a["eps"])
    return (y * xs[1].float()).to(x.dtype)


def _norm_infer(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    normalized = x.shape[norm_axis(attrs["axis"], x.rank):]
    for t in ins[1:]:
        if broadcast(t.shape, normalized) != normalized:
            raise ShapeError(f"norm parameter {t} does not broadcast to the normalised shape {list(normalized)}")
    if not x.dtype.is_float:
        raise ShapeError("norms need float operands")
    return [x]


@op("rms_norm", ("x", "scale"), {"axis": Attr("int", -1), "eps": Attr("float", 1e-5)}, kernel=_rms_norm_kernel,
    flops=lambda i, o, a: 4 * o[0].numel, doc="x / sqrt(mean(x^2 over axis..) + eps) * scale, in fp32")
def _rms_norm(ins: T, attrs: A) -> list[TensorType]:
    return _norm_infer(ins, attrs)


def _layer_norm_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    axes = tuple(range(a["axis"] % x.dim(), x.dim()))
    xf = x.float()
    mu = xf.mean(dim=axes, keepdim=True)
    var = (xf - mu).pow(2).mean(dim=axes, keepdim=True)
    y = (xf - mu) * torch.rsqrt(var + a["eps"]) * xs[1].float()
    if len(xs) > 2:
        y = y + xs[2].float()
    return y.to(x.dtype)


@op("layer_norm", ("x", "scale", "bias?"), {"axis": Attr("int", -1), "eps": Attr("float", 1e-5)},
    kernel=_layer_norm_kernel, flops=lambda i, o, a: 8 * o[0].numel)
def _layer_norm(ins: T, attrs: A) -> list[TensorType]:
    return _norm_infer(ins, attrs)


def _rope_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, cos, sin = xs[:3]
    pos = xs[3] if len(xs) > 3 else None
    shape = x.shape
    if x.dim() == 4:  # [b, heads, s, d] -> [b, s, heads, d]
        x = x.transpose(1, 2)
    else:
        x = x.reshape(shape[0], shape[1], a["num_heads"], -1)
    d = x.shape[-1]
    rd = a["rotary_dim"] or d
    xr, xp = x[..., :rd], x[..., rd:]
    if pos is not None:
        cos, sin = cos[pos.long()], sin[pos.long()]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if a["interleaved"]:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr.chunk(2, dim=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if a["interleaved"]:
        rot = torch.stack((real, imag), dim=-1).reshape(xr.shape)
    else:
        rot = torch.cat((real, imag), dim=-1)
    y = torch.cat((rot, xp), dim=-1).to(x.dtype)
    return y.transpose(1, 2) if len(shape) == 4 else y.reshape(shape)


@op("rotary_embedding", ("x", "cos", "sin", "position_ids?"),
    {"interleaved": Attr("bool", False), "num_heads": Attr("int", 0), "rotary_dim": Attr("int", 0)},
    kernel=_rope_kernel, flops=lambda i, o, a: 6 * o[0].numel,
    doc="ONNX RotaryEmbedding: x [b,h,s,d] or [b,s,h*d]; cos/sin [b,s,r/2], or [max_pos,r/2] with position_ids")
def _rope(ins: T, attrs: A) -> list[TensorType]:
    x, cos, sin = ins[:3]
    if x.rank == 4:
        b, _, s, d = x.shape
    elif x.rank == 3 and attrs["num_heads"] > 0 and x.shape[2] % attrs["num_heads"] == 0:
        b, s, d = x.shape[0], x.shape[1], x.shape[2] // attrs["num_heads"]
    else:
        raise ShapeError("rotary_embedding takes x as [b,h,s,d], or [b,s,h*d] with num_heads")
    rd = attrs["rotary_dim"] or d
    if rd % 2 or rd > d:
        raise ShapeError(f"rotary_dim {rd} must be even and at most the head size {d}")
    want = (b, s, rd // 2)
    if len(ins) == 4:
        pos = ins[3]
        if pos.shape != (b, s) or pos.dtype not in (DType.i64, DType.i32) or cos.rank != 2 or cos.shape[1] != rd // 2:
            raise ShapeError(f"rotary_embedding position_ids {pos} / cache {cos} do not fit x {x}")
    elif cos.shape != want:
        raise ShapeError(f"rotary_embedding cos cache {cos} should be {list(want)}")
    if cos.shape != sin.shape or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ShapeError("rotary_embedding cos and sin caches must match each other and x's dtype")
    return [x]


# -- fused ops (what the fusion passes produce) -------------------------------------------

@op("swiglu", ("gate", "up"), kernel=lambda xs, a: F.silu(xs[0]) * xs[1], flops=lambda i, o, a: 5 * o[0].numel,
    doc="silu(gate) * up")
def _swiglu(ins: T, attrs: A) -> list[TensorType]:
    if ins[0] != ins[1]:
        raise ShapeError(f"swiglu operands {ins[0]} and {ins[1]} differ")
    return _float_unary_infer(ins[:1], attrs)


def window_mask(q_pos: torch.Tensor, k_len: int, window: int) -> torch.Tensor:
    """[s, k_len] bool: query i at q_pos[i] sees keys j with q_pos[i] - window < j <= q_pos[i]
    (causal; with a sliding window of `window` keys, itself included, unless window is 0)."""
    j = torch.arange(k_len, device=q_pos.device)[None, :]
    p = q_pos.reshape(-1, 1).long()
    return (j <= p) & (j > p - window) if window else j <= p


def _attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap * tanh(q @ k^T * scale / softcap) + mask) @ v, in f32 for half operands;
    k/v heads broadcast over groups of q heads. With `sinks` [hq], each head's softmax also
    counts a sink logit that takes no value (gpt-oss's attention sinks)."""
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    g = q.shape[-3] // k.shape[-3]
    k, v = (t.to(wide).repeat_interleave(g, dim=-3) for t in (k, v))
    s = q.to(wide) @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(wide)
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        col = sinks.to(wide).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return (p @ v).to(q.dtype)


def _fused_attention_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, k = xs[0], xs[1]
    gqa = q.shape[-3] != k.shape[-3]
    mask = xs[3] if len(xs) > 3 else None
    sinks = xs[4] if len(xs) > 4 else None
    if not a["window"] and not a["softcap"] and sinks is None:
        return _sdpa_kernel(xs, {"scale": a["scale"], "causal": a["causal"], "gqa": gqa})
    # A sliding window or soft-capped scores: the causal band (top-left aligned, as causal is;
    # all of it without a window), and any mask given.
    if a["causal"]:
        band = window_mask(torch.arange(q.shape[-2], device=q.device), k.shape[-2], a["window"])
        if mask is None:
            mask = band
        else:
            mask = band & mask if mask.dtype == torch.bool else \
                torch.where(band, mask.float(), torch.tensor(float("-inf"), device=band.device))
    if a["softcap"] or sinks is not None:
        return _attention_math(q, k, xs[2], mask, a["scale"], a["softcap"], sinks)
    return _sdpa_kernel([*xs[:3], *([] if mask is None else [mask])], {"scale": a["scale"], "causal": False, "gqa": gqa})


@op("fused_attention", ("q", "k", "v", "mask?", "sinks?"),
    {"scale": Attr("float"), "causal": Attr("bool", False), "window": Attr("int", 0),
     "softcap": Attr("float", 0.0)},
    kernel=_fused_attention_kernel, flops=_sdpa_flops, unit="cube",
    doc="softmax(q @ k^T * scale + mask [+ causal]) @ v; q [b,hq,s,d], k [b,hkv,l,d], v [b,hkv,l,dv], "
        "hq a multiple of hkv (grouped-query attention absorbed); window > 0 (with causal): query i sees "
        "keys i-window+1..i; softcap > 0: scores softcap * tanh(scores / softcap) before the mask; sinks [hq]: "
        "a logit per head that the softmax counts and that takes no value")
def _fused_attention(ins: T, attrs: A) -> list[TensorType]:
    q, k, v = ins[:3]
    if attrs["window"] < 0 or (attrs["window"] and not attrs["causal"]) or attrs["softcap"] < 0:
        raise ShapeError("fused_attention's window is a number of keys (>= 0), on a causal attention; "
                         "its softcap >= 0")
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError("fused_attention takes [batch, heads, seq, dim] operands")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"fused_attention q {q}, k {k}, v {v} do not fit")
    if q.shape[1] % k.shape[1]:
        raise ShapeError("fused_attention query heads are not a multiple of key heads")
    if len(ins) >= 4:
        broadcast(ins[3].shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    if len(ins) == 5 and (ins[4].shape != (q.shape[1],) or not ins[4].dtype.is_float):
        raise ShapeError(f"fused_attention sinks {ins[4]} should be a float [{q.shape[1]}]")
    _same_dtype(ins[:3])
    return [TensorType(q.shape[:3] + (v.shape[-1],), q.dtype)]


def _kv_write_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    cache, new, pos = xs
    return cache.index_copy_(2, pos.reshape(-1).long(), new.to(cache.dtype))


@op("kv_write", ("cache", "new", "position"), kernel=_kv_write_kernel, unit="dma", inplace=0,
    flops=lambda i, o, a: 0,
    doc="the KV cache with new's rows written at the given positions (in place): cache [b,h,max_len,d], "
        "new [b,h,s,d], position i64 [s]")
def _kv_write(ins: T, attrs: A) -> list[TensorType]:
    cache, new, pos = ins
    if cache.rank != 4 or new.rank != 4 or cache.shape[:2] != new.shape[:2] or cache.shape[3] != new.shape[3] \
            or new.shape[2] > cache.shape[2] or cache.dtype != new.dtype:
        raise ShapeError(f"kv_write rows {new} do not fit cache {cache}")
    if pos.shape != (new.shape[2],) or pos.dtype not in (DType.i64, DType.i32):
        raise ShapeError(f"kv_write position {pos} should be i64[{new.shape[2]}]")
    return [cache]


def _cached_attention_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, kc, vc, pos = xs[:4]
    # Query i sees cached keys 0..position[i] (the last `window` of them with a window): the
    # causal mask, offset by where the chunk starts. A half cache is computed in f32 and
    # rounded once (_sdpa_kernel).
    mask = window_mask(pos, kc.shape[-2], a["window"])
    if a["softcap"] or len(xs) > 4:
        return _attention_math(q, kc, vc, mask, a["scale"], a["softcap"], xs[4] if len(xs) > 4 else None)
    return _sdpa_kernel([q, kc, vc, mask], {"scale": a["scale"], "causal": False, "gqa": q.shape[-3] != kc.shape[-3]})


def _cached_attention_flops(ins: T, outs: T, attrs: A) -> int:
    return _sdpa_flops(ins, outs, attrs)


@op("cached_attention", ("q", "k_cache", "v_cache", "position", "sinks?"),
    {"scale": Attr("float"), "window": Attr("int", 0), "softcap": Attr("float", 0.0)},
    kernel=_cached_attention_kernel, flops=_cached_attention_flops, unit="cube",
    doc="causal attention of q over a KV cache: query i at position[i] attends cached keys 0..position[i] "
        "(position[i]-window+1.. with a sliding window; scores soft-capped and sinks as fused_attention's); "
        "q [b,hq,s,d], caches [b,hkv,max_len,d] / [..,dv], position i64 [s]")
def _cached_attention(ins: T, attrs: A) -> list[TensorType]:
    q, kc, vc, pos = ins[:4]
    if len(ins) == 5 and (ins[4].shape != (q.shape[1],) or not ins[4].dtype.is_float):
        raise ShapeError(f"cached_attention sinks {ins[4]} should be a float [{q.shape[1]}]")
    if attrs["window"] < 0 or attrs["softcap"] < 0:
        raise ShapeError("cached_attention's window is a number of keys (>= 0), its softcap >= 0")
    if q.rank != 4 or kc.rank != 4 or vc.rank != 4 or kc.shape[:3] != vc.shape[:3] or q.shape[0] != kc.shape[0] \
            or q.shape[-1] != kc.shape[-1] or q.shape[1] % kc.shape[1]:
        raise ShapeError(f"cached_attention q {q}, caches {kc} / {vc} do not fit")
    if pos.shape != (q.shape[2],) or pos.dtype not in (DType.i64, DType.i32):
        raise ShapeError(f"cached_attention position {pos} should be i64[{q.shape[2]}]")
    _same_dtype(ins[:3])
    return [TensorType(q.shape[:3] + (vc.shape[-1],), q.dtype)]


def _mla_dims(ins: T) -> tuple[int, int, int, int, int, int, int, int]:
    """b, h, s, keys, nope, rope, latent rank, v dim of an mla_attention."""
    q_nope, q_rot, kv, w_uk, w_uv = ins[:5]
    b, h, s, dn = q_nope.shape
    r = w_uk.shape[2]
    return b, h, s, kv.shape[2], dn, q_rot.shape[3], r, w_uv.shape[2]


def mla_absorbed(ins: T) -> bool:
    """Whether mla_attention computes over the latent (W_UK on the queries, W_UV on the
    result) rather than expanding per-head keys and values: whichever needs fewer FLOPs.
    Decode (one query over many cached keys) is always absorbed; a long prefill is not."""
    b, h, s, n, dn, dr, r, dv = _mla_dims(ins)
    absorbed = h * s * (dn * r + n * (2 * r + dr) + r * dv)
    expanded = h * n * r * (dn + dv) + h * s * n * (dn + dr + dv)
    return absorbed <= expanded


def _mla_mask(s: int, n: int, pos: torch.Tensor | None, causal: bool, device: torch.device) -> torch.Tensor | None:
    if pos is not None:  # query i at position[i] sees cached rows 0..position[i]
        return torch.arange(n, device=device)[None, :] <= pos.reshape(-1, 1).long()
    return torch.ones(s, n, dtype=torch.bool, device=device).tril() if causal else None


def _mla_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    # Products with the per-head weights run in the operands' dtype, as a linear does; the
    # scores, softmax and the sum over rows in f32 (a half cache is read widened).
    q_nope, q_rot, kv, w_uk, w_uv = xs[:5]
    pos = xs[5] if len(xs) > 5 else None
    r = w_uk.shape[2]
    lat, k_rot = kv[..., :r].float(), kv[..., r:].float()  # [b, 1, n, r], [b, 1, n, dr]
    mask = _mla_mask(q_nope.shape[2], kv.shape[2], pos, a["causal"], q_nope.device)
    if mla_absorbed([TensorType(tuple(x.shape), DType.f32) for x in xs[:5]]):
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk).float()
        scores = (q_lat @ lat.transpose(-1, -2) + q_rot.float() @ k_rot.transpose(-1, -2)) * a["scale"]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o_lat = torch.softmax(scores, dim=-1) @ lat
        out = torch.einsum("bhsr,hrv->bhsv", o_lat.to(w_uv.dtype), w_uv)
    else:
        c = kv[..., :r]
        k_nope = torch.einsum("bxnr,hdr->bhnd", c, w_uk).float()
        v = torch.einsum("bxnr,hrv->bhnv", c, w_uv).float()
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope.float(), q_rot.float()), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a["scale"])
    return out.to(q_nope.dtype)


def _mla_flops(ins: T, outs: T, attrs: A) -> int:
    b, h, s, n, dn, dr, r, dv = _mla_dims(ins)
    if mla_absorbed(ins):
        return 2 * b * h * s * (dn * r + n * (2 * r + dr) + r * dv)
    return 2 * b * (h * n * r * (dn + dv) + h * s * n * (dn + dr + dv))


@op("mla_attention", ("q_nope", "q_rot", "kv", "w_uk", "w_uv", "position?"),
    {"scale": Attr("float"), "causal": Attr("bool", False)},
    kernel=_mla_kernel, flops=_mla_flops, unit="cube",
    doc="multi-head latent attention (DeepSeek MLA): keys and values are the per-token latent "
        "kv = [c (rank r) | shared rope key (dr)], [b,1,n,r+dr]; head i's key is [c @ W_UK_i^T | rope key], "
        "its value c @ W_UV_i; q_nope [b,h,s,dn], q_rot [b,h,s,dr], w_uk [h,dn,r], w_uv [h,r,dv]. "
        "Without position: causal (query i sees rows 0..i) or not; with position i64 [s]: kv is a cache, "
        "query i sees rows 0..position[i]. Computed over the latent when that is cheaper (decode)")
def _mla_attention(ins: T, attrs: A) -> list[TensorType]:
    q_nope, q_rot, kv, w_uk, w_uv = ins[:5]
    if any(t.rank != 4 for t in (q_nope, q_rot, kv)) or w_uk.rank != 3 or w_uv.rank != 3:
        raise ShapeError("mla_attention takes 4-D queries and latent, 3-D per-head weights")
    b, h, s, n, dn, dr, r, _ = _mla_dims(ins)
    if q_rot.shape[:3] != (b, h, s) or kv.shape[0] != b or kv.shape[1] != 1 or kv.shape[3] != r + dr \
            or w_uk.shape[:2] != (h, dn) or w_uv.shape[:2] != (h, r):
        raise ShapeError(f"mla_attention q {q_nope}/{q_rot}, kv {kv}, w_uk {w_uk}, w_uv {w_uv} do not fit")
    if len(ins) > 5 and (ins[5].shape != (s,) or ins[5].dtype not in (DType.i64, DType.i32)):
        raise ShapeError(f"mla_attention position {ins[5]} should be i64[{s}]")
    if len(ins) == 5 and s != n and attrs.get("causal"):
        raise ShapeError(f"causal mla_attention over its own {n} rows has {s} queries")
    _same_dtype(ins[:5])
    return [TensorType((b, h, s, w_uv.shape[2]), q_nope.dtype)]


def _rope_lut_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, pos, cos_t, sin_t = xs
    half = cos_t.shape[-1]
    r = 2 * half
    c = cos_t[pos.long()].unsqueeze(-3).to(torch.float32)  # [..., 1, s, half] broadcasts over heads
    s = sin_t[pos.long()].unsqueeze(-3).to(torch.float32)
    xr = x[..., :r].float()
    layout = a["layout"]
    if layout == "half":
        x1, x2 = xr[..., :half], xr[..., half:]
    else:  # "interleaved" and "deinterleave" read pairs (x0, x1), (x2, x3), ...
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    real, imag = x1 * c - x2 * s, x2 * c + x1 * s
    if layout == "interleaved":
        rot = torch.stack((real, imag), dim=-1).reshape(xr.shape)
    else:  # "half" and "deinterleave" write halves
        rot = torch.cat((real, imag), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


@op("rope_lut", ("x", "position_ids", "cos_table", "sin_table"), {"layout": Attr("str", "half")},
    kernel=_rope_lut_kernel, flops=lambda i, o, a: 6 * o[0].numel,
    doc="rotary embedding from tables: x [..., heads, s, d], position_ids [s] or [b, s], tables [positions, r/2]; "
        "layout half (rotate_half), interleaved (pairs in and out), deinterleave (pairs in, halves out)")
def _rope_lut(ins: T, attrs: A) -> list[TensorType]:
    x, pos, cos_t, sin_t = ins
    if attrs["layout"] not in ("half", "interleaved", "deinterleave"):
        raise ShapeError(f"unknown rope layout {attrs['layout']!r}")
    if x.rank < 3 or pos.dtype not in (DType.i64, DType.i32) or pos.shape[-1] != x.shape[-2] or pos.rank > 2:
        raise ShapeError(f"rope_lut position_ids {pos} do not fit x {x}")
    if cos_t != sin_t or cos_t.rank != 2 or 2 * cos_t.shape[1] > x.shape[-1] or not x.dtype.is_float:
        raise ShapeError(f"rope_lut tables {cos_t}/{sin_t} do not fit x {x}")
    return [x]


# -- mixture of experts ---------------------------------------------------------------------

# Scoring -> the value a group-masked expert gets before the final top-k: DeepSeek-V3 masks its
# sigmoid scores with -inf, DeepSeek-V2 its softmax probabilities with 0.
MOE_MASK_FILL = {"sigmoid": -math.inf, "softmax": 0.0}
MOE_NORM_EPS = 1e-20  # transformers' DeepSeek-V3 normalises the routed weights by their sum + 1e-20


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, a: A) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router on f32 logits [T, E]: the k experts of each token (i64 [T, k]) and
    their weights (f32 [T, k]). Every top-k is the registry's (a stable sort: of equal
    scores the lower expert wins), so it selects what the traced router selects."""
    scores = torch.sigmoid(logits) if a["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    t, e = choice.shape
    g, kg = a["n_group"], a["topk_group"]
    keep, fill = None, MOE_MASK_FILL[a["scoring"]]
    if kg < g:  # group-limited: only the experts of each token's topk_group best groups compete
        grouped = choice.view(t, g, e // g)
        if a["group_score"] == "top2_sum":
            group_scores = _topk_kernel([grouped], {"axis": 2, "k": 2, "largest": True})[0].sum(dim=2)
        else:
            group_scores = grouped.amax(dim=2)
        best = _topk_kernel([group_scores], {"axis": 1, "k": kg, "largest": True})[1]
        keep = torch.zeros(t, g, dtype=torch.bool, device=choice.device).scatter_(1, best, True).repeat_interleave(e // g, dim=1)
        choice = choice.masked_fill(~keep, fill)
    idx = _topk_kernel([choice], {"axis": 1, "k": a["top_k"], "largest": True})[1]
    weights = scores.gather(1, idx)  # the scores without the correction bias
    if keep is not None:  # a masked expert is picked only when fewer than k others beat the fill
        weights = weights.masked_fill(~keep.gather(1, idx), fill)
    if a["norm_topk"]:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + a["norm_eps"] if a["norm_eps"] else total)
    return idx, weights * a["routed_scale"]


def moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor | Callable[[int], torch.Tensor],
                down: torch.Tensor | Callable[[int], torch.Tensor], experts: int, inter: int) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ swiglu(gate_up[e] @ x[t]) with e = idx[t, j], grouped by
    expert: the token-slots are sorted by expert id and each expert runs one GEMM over its
    contiguous rows (a loop over the experts hit, never over tokens). gate_up and down are
    stacked [E, ...] weights, or a function of the expert id (a quantized expert, unpacked
    only when a token picks it)."""
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    rows = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        gu = gate_up(e) if callable(gate_up) else gate_up[e]
        dn = down(e) if callable(down) else down[e]
        gate, up = F.linear(x[slots // k], gu).split(inter, dim=1)
        rows[slots] = F.linear(F.silu(gate) * up, dn)
    rows *= weights.reshape(-1, 1).to(x.dtype)
    return rows.view(t, k, -1).sum(dim=1)  # each token's k slots, in top-k order


def _fused_moe_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, router, gate_up, down = xs[:4]
    bias = xs[4] if len(xs) > 4 else None
    idx, weights = moe_route(F.linear(x.float(), router.float()), bias, a)
    return moe_experts(x, idx, weights, gate_up, down, gate_up.shape[0], down.shape[2])


def _fused_moe_flops(ins: T, outs: T, attrs: A) -> int:
    # Only the k selected experts of each token: a dense count over all E would overstate it E/k-fold.
    (t, h), e, i, k = ins[0].shape, ins[1].shape[0], ins[3].shape[2], attrs["top_k"]
    router = 2 * t * e * h
    experts = t * k * (2 * h * 2 * i + 2 * i * h)
    return router + experts + t * k * 5 * i + 2 * t * k * h  # + SwiGLU, + weighted combine


def _fused_moe_traffic(ins: T, outs: T, attrs: A) -> int:
    """Activations, router and bias, and the weights of the experts a run can select:
    at most min(E, T*k) of them (all E only once the tokens' picks could cover them)."""
    x, router, gate_up, down = ins[:4]
    e, t = router.shape[0], x.shape[0]
    experts = min(e, t * attrs["top_k"])
    return sum(v.nbytes for v in (x, router, *ins[4:], *outs)) + (gate_up.nbytes + down.nbytes) * experts // e


@op("fused_moe", ("x", "router_weight", "gate_up", "down", "correction_bias?"),
    {"top_k": Attr("int"), "n_group": Attr("int", 1), "topk_group": Attr("int", 1),
     "scoring": Attr("str", "sigmoid"), "group_score": Attr("str", "top2_sum"), "norm_topk": Attr("bool", False),
     "norm_eps": Attr("float", MOE_NORM_EPS), "routed_scale": Attr("float", 1.0), "activation": Attr("str", "silu")},
    kernel=_fused_moe_kernel, flops=_fused_moe_flops, unit="cube", traffic=_fused_moe_traffic,
    doc="DeepSeek's routed experts: x [T,H], router_weight [E,H], gate_up [E,2I,H], down [E,H,I], "
        "correction_bias [E]. Scores sigmoid (V3) or softmax (V2) of x @ router^T in f32; with n_group > "
        "topk_group only each token's topk_group groups (ranked by top2_sum or max of scores + bias) compete; "
        "the top_k experts by scores + bias are weighed by their scores (norm_topk: over their sum + norm_eps) "
        "times routed_scale; out = sum of weight * down[e] @ (silu(gate) * up) over a token's k experts. "
        "FLOPs count the k selected experts only, bytes at most min(E, T*k) experts' weights")
def _fused_moe(ins: T, attrs: A) -> list[TensorType]:
    x, router, gate_up, down = ins[:4]
    if x.rank != 2 or router.rank != 2 or gate_up.rank != 3 or down.rank != 3:
        raise ShapeError("fused_moe takes x [T,H], router [E,H], gate_up [E,2I,H], down [E,H,I]")
    h, e, i = x.shape[1], router.shape[0], down.shape[2]
    if router.shape != (e, h) or gate_up.shape != (e, 2 * i, h) or down.shape != (e, h, i) \
            or (len(ins) > 4 and ins[4].shape != (e,)):
        raise ShapeError(f"fused_moe x {x}, router {router}, gate_up {gate_up}, down {down} do not fit")
    if not all(t.dtype.is_float for t in ins) or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ShapeError(f"fused_moe operands {[str(t) for t in ins]} are not floats of x's dtype")
    g, kg, k = attrs["n_group"], attrs["topk_group"], attrs["top_k"]
    if attrs["scoring"] not in MOE_MASK_FILL or attrs["group_score"] not in ("top2_sum", "max") \
            or attrs["activation"] != "silu":
        raise ShapeError(f"fused_moe scoring {attrs['scoring']!r}, group_score {attrs['group_score']!r} or "
                         f"activation {attrs['activation']!r} is not supported")
    # Static shapes: every token must have k experts to pick from its groups.
    if g < 1 or e % g or not 1 <= kg <= g or not 1 <= k <= kg * (e // g) \
            or (kg < g and attrs["group_score"] == "top2_sum" and e // g < 2):
        raise ShapeError(f"fused_moe top_k={k} of {e} experts in topk_group={kg} of n_group={g} does not fit")
    return [x]
