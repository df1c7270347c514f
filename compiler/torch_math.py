"""torch.export frontend, continued: converters for math that has no IR op of its own and is
written out in IR ops (square, logsumexp, floor division, ...), and for a few more ATen
overloads. Registered into `torch_frontend.CONVERTERS` on import (torch_frontend imports
this module at its end).

    logsumexp(x, dims)       ->  add(log(reduce_sum(exp(sub(x, m)))), m), m = reduce_max(x, dims)
    floor_divide(a, b)       ->  floor_div(a, b)          (an IR op: integers stay exact)
    div(a, b, 'trunc')       ->  mul(floor_div(abs(a), abs(b)), mul(sign(a), sign(b)))
    unbind(x, dim)           ->  one slice + reshape per index
    select_scatter(x, s, d, i) -> slice_scatter(x, reshape(s), d, i:i+1)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from npuc.compiler.torch_frontend import _Ctx, _meta_type, _out_dtype, converts, reduce_axes
from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import Value


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
