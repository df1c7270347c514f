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


def _conv1d_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = F.pad(xs[0], tuple(a["pads"])) if any(a["pads"]) else xs[0]
    return F.conv1d(x, xs[1], xs[2] if len(xs) > 2 else None, a["stride"], 0, a["dilation"], a["groups"])


def _conv1d_flops(ins: T, outs: T, attrs: A) -> int:
    return 2 * outs[0].numel * ins[1].shape[1] * ins[1].shape[2]


@op("conv1d", ("x", "w", "bias?"), {"pads": Attr("ints", (0, 0)), "stride": Attr("int", 1),
                                    "dilation": Attr("int", 1), "groups": Attr("int", 1)},
    kernel=_conv1d_kernel, flops=_conv1d_flops, unit="cube",
    doc="1-D convolution of x [N, C, L] by w [O, C/groups, K] (+ bias [O]); pads = [left, right] "
        "(the short causal convolutions of hybrid and state-space mixers)")
def _conv1d(ins: T, attrs: A) -> list[TensorType]:
    x, w = ins[0], ins[1]
    g, (left, right), s, d = attrs["groups"], attrs["pads"], attrs["stride"], attrs["dilation"]
    if x.rank != 3 or w.rank != 3 or g < 1 or s < 1 or d < 1 or left < 0 or right < 0:
        raise ShapeError(f"conv1d needs x [N, C, L], w [O, C/groups, K] and positive strides: {x}, {w}")
    if x.shape[1] != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"conv1d: {x} has {x.shape[1]} channels, w {w} with groups={g} wants {w.shape[1] * g}")
    if len(ins) > 2 and ins[2].shape != (w.shape[0],):
        raise ShapeError(f"conv1d bias {ins[2]} must be [{w.shape[0]}]")
    length = (x.shape[2] + left + right - d * (w.shape[2] - 1) - 1) // s + 1
    if length < 0:
        raise ShapeError(f"conv1d: kernel {w.shape[2]} (dilation {d}) is longer than the padded input {x}")
    return [TensorType((x.shape[0], w.shape[0], length), _same_dtype(ins))]


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
