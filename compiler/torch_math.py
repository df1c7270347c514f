"""torch.export frontend, continued: converters for math that has no IR op of its own and is
written out in IR ops (square, logsumexp, floor division, ...), and for a few more ATen
overloads. Registered into `torch_frontend.CONVERTERS` on import (torch_frontend imports
this module at its end).

    logsumexp(x, dims)       ->  add(log(reduce_sum(exp(sub(x, m)))), m), m = reduce_max(x, dims)
    floor_divide(a, b)       ->  floor_div(a, b)          (an IR op: integers stay exact)
    div(a, b, 'trunc')       ->  mul(floor_div(abs(a), abs(b)), mul(sign(a), sign(b)))
    unbind(x, dim)           ->  one slice + reshape per index
    select_scatter(x, s, d, i) -> slice_scatter(x, reshape(s), d, i:i+1)
    eye(n, m)                ->  eq(reshape(arange(n), [n, 1]), arange(m))   (folded to a constant)
    linalg_vector_norm(x, 2) ->  sqrt(reduce_sum(mul(x, x)))                  (1: abs, inf: max)
    log_sigmoid(x)           ->  neg(softplus(neg(x)))
    pad(x, p, mode)          ->  pad(x, pads)        (torch's last-axis-first pairs, ONNX's order)
    conv1d, einsum           ->  the IR ops of the same names
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from npuc.compiler.torch_frontend import _Ctx, _meta_type, _out_dtype, converts, reduce_axes
from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import DType, Value


@converts("aten.square.default")
def _square(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
    return ctx.emit("mul", [x, x], like=node)


@converts("aten.pow.Scalar")
def _pow_scalar_base(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    return ctx.emit("pow", [ctx.scalar(a["self"], dt), ctx.operand(a["exponent"], dt)], like=node)


@converts("aten.clamp.default", "aten.clamp.Tensor")
def _clamp(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # Bounds that are numbers or tensors (broadcast); torch applies min, then max.
    dt = _out_dtype(node)
    y = ctx.cast(ctx.value(a["self"]), dt)
    lo, hi = a.get("min"), a.get("max")
    if lo is not None:
        y = ctx.emit("maximum", [y, ctx.operand(lo, dt)], name=f"{node.name}_min",
                     like=None if hi is not None else node)
    if hi is not None:
        y = ctx.emit("minimum", [y, ctx.operand(hi, dt)], like=node)
    return y


@converts("aten.softplus.default")
def _softplus(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # softplus(beta x) / beta, linear above threshold / beta; the registry's softplus is torch's
    # default threshold (20), so the scaled form reuses it exactly.
    beta, threshold = a.get("beta", 1), a.get("threshold", 20)
    if threshold != 20:
        raise NpucError("NPUC-E0304", f"{node.name}: softplus with threshold {threshold}",
                        "only torch's default threshold (20) is supported", exit_code=EXIT_UNSUPPORTED)
    dt = _out_dtype(node)
    x = ctx.cast(ctx.value(a["self"]), dt)
    if beta == 1:
        return ctx.emit("softplus", [x], like=node)
    y = ctx.emit("softplus", [ctx.emit("mul", [x, ctx.scalar(beta, dt)], name=f"{node.name}_beta")],
                 name=f"{node.name}_sp")
    return ctx.emit("div", [y, ctx.scalar(beta, dt)], like=node)


@converts("aten.floor.default", "aten.ceil.default", "aten.round.default", "aten.trunc.default")
def _rounding(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    if not x.type.dtype.is_float:  # torch returns integers unchanged
        return x
    fn = str(node.target).split(".")[1]
    if fn == "trunc":  # toward zero: floor of |x|, with x's sign
        mag = ctx.emit("floor", [ctx.emit("abs", [x], name=f"{node.name}_abs")], name=f"{node.name}_floor")
        return ctx.emit("mul", [mag, ctx.emit("sign", [x], name=f"{node.name}_sign")], like=node)
    return ctx.emit(fn, [x], like=node)


@converts("aten.sign.default")
def _sign(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("sign", [ctx.cast(ctx.value(a["self"]), _out_dtype(node))], like=node)


def _rounded_div(ctx: _Ctx, node: torch.fx.Node, lhs: Any, rhs: Any, mode: str | None) -> Value:
    if mode not in (None, "floor", "trunc"):
        raise NpucError("NPUC-E0304", f"{node.name}: division with rounding_mode={mode!r}",
                        "rounding_mode is None, 'floor' or 'trunc'", exit_code=EXIT_UNSUPPORTED)
    dt = _out_dtype(node)
    a, b = ctx.operand(lhs, dt), ctx.operand(rhs, dt)
    if mode is None:
        return ctx.emit("div", [a, b], like=node)
    if mode == "floor":
        return ctx.emit("floor_div", [a, b], like=node)
    # toward zero: |a| // |b| with the quotient's sign (integers stay exact)
    mag = ctx.emit("floor_div", [ctx.emit("abs", [a], name=f"{node.name}_abs_a"),
                                 ctx.emit("abs", [b], name=f"{node.name}_abs_b")], name=f"{node.name}_mag")
    sign = ctx.emit("mul", [ctx.emit("sign", [a], name=f"{node.name}_sign_a"),
                            ctx.emit("sign", [b], name=f"{node.name}_sign_b")], name=f"{node.name}_sign")
    return ctx.emit("mul", [mag, sign], like=node)


@converts("aten.floor_divide.default", "aten.floor_divide.Scalar")
def _floor_divide(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return _rounded_div(ctx, node, a["self"], a["other"], "floor")


@converts("aten.div.Tensor_mode", "aten.div.Scalar_mode")
def _div_mode(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return _rounded_div(ctx, node, a["self"], a["other"], a.get("rounding_mode"))


@converts("aten.logsumexp.default")
def _logsumexp(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    x = ctx.cast(ctx.value(a["self"]), dt)
    axes = reduce_axes(a["dim"], x.type.rank)
    keep = bool(a.get("keepdim", False))
    # Shifted by the maximum, as torch does, so that large logits do not overflow exp.
    m = ctx.emit("reduce_max", [x], {"axes": axes, "keepdim": True}, name=f"{node.name}_max")
    e = ctx.emit("exp", [ctx.emit("sub", [x, m], name=f"{node.name}_shift")], name=f"{node.name}_exp")
    s = ctx.emit("log", [ctx.emit("reduce_sum", [e], {"axes": axes, "keepdim": True}, name=f"{node.name}_sum")],
                 name=f"{node.name}_log")
    y = ctx.emit("add", [s, m], name=f"{node.name}_lse" if not keep else None, like=node if keep else None)
    return y if keep else ctx.emit("reshape", [y], {"shape": _meta_type(node).shape}, like=node)


@converts("aten.unbind.int")
def _unbind(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> list[Value]:
    x = ctx.value(a["self"])
    axis = a.get("dim", 0) % x.type.rank
    shape = x.type.shape[:axis] + x.type.shape[axis + 1:]
    return [ctx.emit("reshape", [ctx.emit("slice", [x], {"axis": axis, "start": i, "end": i + 1, "step": 1},
                                          name=f"{node.name}_{i}_slice")], {"shape": shape}, name=f"{node.name}_{i}")
            for i in range(x.type.shape[axis])]


@converts("aten.scalar_tensor.default")
def _scalar_tensor(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    t = _meta_type(node)
    return ctx.emit("full", [], {"shape": t.shape, "value": float(a["s"]), "dtype": t.dtype}, like=node)


@converts("aten.select_scatter.default")
def _select_scatter(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # src into one index of dim: a slice_scatter of src with that axis put back
    x = ctx.value(a["self"])
    axis = a["dim"] % x.type.rank
    i = a["index"] % x.type.shape[axis]
    src = ctx.cast(ctx.value(a["src"]), x.type.dtype)
    src = ctx.emit("reshape", [src], {"shape": x.type.shape[:axis] + (1,) + x.type.shape[axis + 1:]},
                   name=f"{node.name}_src")
    return ctx.emit("slice_scatter", [x, src], {"axis": axis, "start": i, "end": i + 1, "step": 1}, like=node)


@converts("aten.triu.default", "aten.tril.default")
def _trilu(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    upper = str(node.target).startswith("aten.triu")
    return ctx.emit("trilu", [ctx.value(a["self"])], {"upper": upper, "k": int(a.get("diagonal", 0))}, like=node)


@converts("aten.clamp_min.default", "aten.clamp_max.default")
def _clamp__one_int(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    bound = "min" if str(node.target).startswith("aten.clamp_min") else "max"
    return _clamp(ctx, node, {"self": a["self"], bound: a[bound]})


@converts("aten.log_sigmoid.default")
def _log_sigmoid(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # log(sigmoid(x)) = -softplus(-x): exact where sigmoid underflows (x very negative)
    x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
    sp = ctx.emit("softplus", [ctx.emit("neg", [x], name=f"{node.name}_neg")], name=f"{node.name}_sp")
    return ctx.emit("neg", [sp], like=node)


@converts("aten.linalg_vector_norm.default")
def _vector_norm(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    x = ctx.cast(ctx.value(a["self"]), dt)
    ord_ = float(a.get("ord", 2))
    attrs = {"axes": reduce_axes(a.get("dim"), x.type.rank), "keepdim": bool(a.get("keepdim", False))}
    if ord_ in (math.inf, -math.inf, 1.0):
        ax = ctx.emit("abs", [x], name=f"{node.name}_abs")
        red = {math.inf: "reduce_max", -math.inf: "reduce_min", 1.0: "reduce_sum"}[ord_]
        return ctx.emit(red, [ax], attrs, like=node)
    if ord_ == 2.0:
        sq = ctx.emit("reduce_sum", [ctx.emit("mul", [x, x], name=f"{node.name}_sq")], attrs, name=f"{node.name}_sum")
        return ctx.emit("sqrt", [sq], like=node)
    if ord_ <= 0:
        raise NpucError("NPUC-E0304", f"{node.name}: vector norm of order {ord_:g}", "npuc computes orders > 0",
                        exit_code=EXIT_UNSUPPORTED)
    p = ctx.scalar(ord_, dt)
    powered = ctx.emit("pow", [ctx.emit("abs", [x], name=f"{node.name}_abs"), p], name=f"{node.name}_pow")
    s = ctx.emit("reduce_sum", [powered], attrs, name=f"{node.name}_sum")
    return ctx.emit("pow", [s, ctx.scalar(1.0 / ord_, dt)], like=node)


@converts("aten.eye.default", "aten.eye.m")
def _eye(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    t = _meta_type(node)
    n, m = t.shape
    rows = ctx.emit("reshape", [ctx.emit("arange", [], {"start": 0, "end": n, "step": 1, "dtype": DType.i64},
                                         name=f"{node.name}_rows")], {"shape": (n, 1)}, name=f"{node.name}_col")
    cols = ctx.emit("arange", [], {"start": 0, "end": m, "step": 1, "dtype": DType.i64}, name=f"{node.name}_cols")
    diag = ctx.emit("eq", [rows, cols], name=f"{node.name}_diag" if t.dtype != DType.bool else None,
                    like=node if t.dtype == DType.bool else None)
    return diag if t.dtype == DType.bool else ctx.emit("cast", [diag], {"dtype": t.dtype}, like=node)


_TORCH_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


@converts("aten.pad.default", "aten.constant_pad_nd.default")
def _pad(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"] if "self" in a else a["input"])
    r, pad = x.type.rank, list(a["pad"])
    mode = a.get("mode", "constant")
    if mode not in _TORCH_PAD_MODES or len(pad) % 2 or len(pad) > 2 * r:
        raise NpucError("NPUC-E0304", f"{node.name}: pad {pad} in mode {mode!r}",
                        f"npuc pads in modes {sorted(_TORCH_PAD_MODES)}", exit_code=EXIT_UNSUPPORTED)
    begin, end = [0] * r, [0] * r
    for i in range(len(pad) // 2):  # torch lists (begin, end) pairs from the last axis backwards
        begin[r - 1 - i], end[r - 1 - i] = pad[2 * i], pad[2 * i + 1]
    value = a.get("value")
    ins = [x] if not value or mode != "constant" else [x, ctx.scalar(value, x.type.dtype)]
    return ctx.emit("pad", ins, {"pads": tuple(begin + end), "mode": _TORCH_PAD_MODES[mode]}, like=node)


@converts("aten.einsum.default")
def _einsum(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    xs = [ctx.cast(ctx.value(t), dt) for t in a["tensors"]]
    return ctx.emit("einsum", xs, {"equation": a["equation"].replace(" ", "")}, like=node)


def _one_int(v: Any) -> int:
    """A 1-D convolution's stride, padding or dilation, given as an int or a 1-list."""
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


@converts("aten.conv1d.default", "aten.conv1d.padding")
def _conv1d(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    x, w = ctx.cast(ctx.value(a["input"]), dt), ctx.cast(ctx.value(a["weight"]), dt)
    stride, dilation = _one_int(a.get("stride", 1)), _one_int(a.get("dilation", 1))
    padding = a.get("padding", 0)
    if padding == "valid":
        pads = (0, 0)
    elif padding == "same":  # torch: the extra element of an odd total goes on the right
        total = dilation * (w.type.shape[2] - 1)
        pads = (total // 2, total - total // 2)
    else:
        pads = (_one_int(padding),) * 2
    ins = [x, w] + ([ctx.cast(ctx.value(a["bias"]), dt)] if a.get("bias") is not None else [])
    attrs = {"pads": pads, "stride": stride, "dilation": dilation, "groups": int(a.get("groups", 1))}
    return ctx.emit("conv1d", ins, attrs, like=node)
