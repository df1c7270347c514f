"""torch.export frontend: an `ExportedProgram` (functional ATen) to npuc IR.

Each supported ATen overload has a converter below that emits IR ops and checks
the inferred type against the exporter's own metadata, so a converter that
disagrees with torch is caught at import, not as a wrong number later.
`scaled_dot_product_attention` and `linear` arrive intact (we run no default
decompositions), which is what the fusion passes want to see.

Parameters and buffers become graph constants whose bytes stay in their source
(`WeightResolver`) until the backend writes them.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from npuc.errors import EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import ConstSource, DType, Graph, TensorSource, TensorType, Value, distinct_outputs, get_op
from npuc.ir.ops import ShapeError

WeightResolver = Callable[[str, torch.Tensor | None], ConstSource]
Converter = Callable[["_Ctx", torch.fx.Node, dict[str, Any]], Any]
CONVERTERS: dict[str, Converter] = {}
_IGNORED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
            "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"}


def converts(*targets: str) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for t in targets:
            CONVERTERS[t] = fn
        return fn

    return deco


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    return str(t)


def unsupported_ops(ep: torch.export.ExportedProgram) -> Counter[str]:
    ops: Counter[str] = Counter()
    for n in ep.graph.nodes:
        if n.op == "call_function":
            name = _target_name(n)
            if name not in CONVERTERS and name not in _IGNORED:
                ops[name] += 1
        elif n.op not in ("placeholder", "output", "get_attr"):
            ops[f"<{n.op}>"] += 1
    return ops


def _meta_type(node: torch.fx.Node) -> TensorType:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise InternalError(f"node {node.name} has no tensor metadata")
    shape = []
    for d in val.shape:
        if not isinstance(d, int):
            raise NpucError("NPUC-E0302", f"dimension {d} of {node.name} is symbolic",
                            "npuc compiles static shapes only: export with concrete example inputs")
        shape.append(d)
    return TensorType(tuple(shape), DType.from_torch(val.dtype))


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


class _Ctx:
    def __init__(self, g: Graph) -> None:
        self.g = g
        self.env: dict[torch.fx.Node, Any] = {}
        self._scalars: dict[tuple[str, DType], Value] = {}

    def value(self, arg: Any) -> Value:
        if isinstance(arg, torch.fx.Node):
            v = self.env[arg]
            if not isinstance(v, Value):
                raise InternalError(f"{arg.name} is not a tensor")
            return v
        raise InternalError(f"expected a tensor operand, got {arg!r}")

    def scalar(self, x: float | int | bool, dtype: DType) -> Value:
        key = (repr(x), dtype)
        if key not in self._scalars:
            t = torch.tensor(x, dtype=dtype.torch)
            self._scalars[key] = self.g.add_constant(f"scalar_{dtype}", TensorType((), dtype),
                                                     TensorSource(t, "scalar"))
        return self._scalars[key]

    def operand(self, arg: Any, dtype: DType) -> Value:
        """A tensor or Python scalar operand, cast to `dtype`."""
        if isinstance(arg, torch.fx.Node):
            return self.cast(self.value(arg), dtype)
        return self.scalar(arg, dtype)

    def cast(self, v: Value, dtype: DType) -> Value:
        if v.type.dtype == dtype:
            return v
        return self.emit("cast", [v], {"dtype": dtype}, name=f"{v.name}_cast")

    def emit(self, op: str, inputs: list[Value], attrs: dict[str, Any] | None = None, *,
             name: str | None = None, like: torch.fx.Node | None = None) -> Any:
        attrs = attrs or {}
        od = get_op(op)
        try:
            types = od.infer_types([v.type for v in inputs], attrs)
        except ShapeError as e:
            where = like.name if like is not None else name
            raise InternalError(f"converting {where}: {op} refused its operands: {e}") from e
        node = self.g.add_node(op, inputs, types, attrs, names=name or (like.name if like else op))
        if like is not None and len(types) == 1:
            want = _meta_type(like)
            if types[0] != want:
                raise InternalError(f"converting {like.name} ({like.target}): npuc infers {types[0]}, "
                                    f"torch says {want}")
        return node.outputs if len(types) != 1 else node.outputs[0]


def import_exported_program(
    ep: torch.export.ExportedProgram,
    resolve_weight: WeightResolver,
    *,
    output_names: list[str] | None = None,
    name: str = "main",
) -> Graph:
    bad = unsupported_ops(ep)
    if bad:
        listing = ", ".join(f"{k} (x{v})" for k, v in sorted(bad.items()))
        raise NpucError("NPUC-E0301", f"the model uses {len(bad)} operator(s) npuc does not support: {listing}",
                        "see docs/ops.md for the supported operators", exit_code=EXIT_UNSUPPORTED)
    g = Graph(name)
    ctx = _Ctx(g)
    sig = ep.graph_signature
    specs = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
    tensors = dict(ep.state_dict)
    tensors.update(getattr(ep, "constants", {}) or {})
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = specs.get(node.name)
            kind = spec.kind.name if spec is not None else "USER_INPUT"
            if kind == "USER_INPUT":
                if isinstance(node.meta.get("val"), torch.Tensor):
                    ctx.env[node] = g.add_input(node.name, _meta_type(node))
                else:
                    ctx.env[node] = node.meta.get("val")
            else:
                target = spec.target  # type: ignore[union-attr]
                src = resolve_weight(target, tensors.get(target))
                ctx.env[node] = g.add_constant(target, _meta_type(node), src)
        elif node.op == "call_function":
            tname = _target_name(node)
            if tname in _IGNORED:
                continue
            args = {"args": node.args} if tname == "getitem" else _bind(node)
            ctx.env[node] = CONVERTERS[tname](ctx, node, args)
        elif node.op == "output":
            outs = [ctx.value(a) for a in node.args[0]]
            user = [s for s in ep.graph_signature.output_specs]
            if any(s.kind.name != "USER_OUTPUT" for s in user):
                raise NpucError("NPUC-E0303", "the exported program mutates its buffers or inputs",
                                "export the model in eval mode without in-place state updates",
                                exit_code=EXIT_UNSUPPORTED)
            outs = distinct_outputs(g, outs)
            for i, v in enumerate(outs):
                want = output_names[i] if output_names and i < len(output_names) else f"output_{i}"
                if want != v.name and want not in {x.name for x in g.values()}:
                    g.rename(v, want)
            g.set_outputs(outs)
    return g


# -- converters -------------------------------------------------------------------

def _out_dtype(node: torch.fx.Node) -> DType:
    return _meta_type(node).dtype


@converts("getitem")
def _getitem(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Any:
    src, idx = a["args"]
    return ctx.env[src][idx]


@converts("aten.clone.default", "aten.alias.default", "aten.contiguous.default", "aten.detach.default",
          "aten.lift_fresh_copy.default", "aten.dropout.default", "aten._to_copy.default", "aten.to.dtype",
          "aten.to.dtype_layout", "aten.to.device", "aten.type_as.default")
def _identity_or_cast(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"] if "self" in a else a["input"])
    want = _meta_type(node)
    if want.shape != x.type.shape:
        raise InternalError(f"{node.name}: copy-like op changed the shape")
    return ctx.cast(x, want.dtype)


def _to_meta_shape(op: str) -> Converter:
    """reshape/expand to the shape torch recorded; a no-op when it is already that."""

    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
        x = ctx.value(a["self"])
        shape = _meta_type(node).shape
        if shape == x.type.shape:
            return x
        return ctx.emit(op, [x], {"shape": shape}, like=node)

    return conv


for _t in ("view.default", "reshape.default", "_unsafe_view.default", "unsqueeze.default", "squeeze.dim",
           "squeeze.dims", "squeeze.default", "flatten.using_ints", "unflatten.int"):
    CONVERTERS[f"aten.{_t}"] = _to_meta_shape("reshape")
for _t in ("expand.default", "expand_as.default"):
    CONVERTERS[f"aten.{_t}"] = _to_meta_shape("expand")


@converts("aten.transpose.int", "aten.permute.default", "aten.t.default")
def _transpose(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    rank = x.type.rank
    if "dims" in a:
        perm = [d % rank for d in a["dims"]]
    else:
        d0, d1 = (a["dim0"], a["dim1"]) if "dim0" in a else (0, 1)
        perm = list(range(rank))
        if rank:
            d0, d1 = d0 % rank, d1 % rank
            perm[d0], perm[d1] = perm[d1], perm[d0]
    if perm == list(range(rank)):
        return x
    return ctx.emit("transpose", [x], {"perm": tuple(perm)}, like=node)


def _clamp_slice(dim: int, start: int | None, end: int | None, step: int) -> tuple[int, int, int]:
    s, e, st = slice(start, end, step).indices(dim)
    return s, max(e, s), st


@converts("aten.slice.Tensor")
def _slice(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    axis = a["dim"] % max(x.type.rank, 1)
    start, end, step = _clamp_slice(x.type.shape[axis], a["start"], a["end"], a["step"])
    if (start, end, step) == (0, x.type.shape[axis], 1):
        return x
    return ctx.emit("slice", [x], {"axis": axis, "start": start, "end": end, "step": step}, like=node)


@converts("aten.select.int")
def _select(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    axis = a["dim"] % x.type.rank
    i = a["index"] % x.type.shape[axis]
    s = ctx.emit("slice", [x], {"axis": axis, "start": i, "end": i + 1, "step": 1}, name=f"{node.name}_slice")
    return ctx.emit("reshape", [s], {"shape": _meta_type(node).shape}, like=node)


@converts("aten.slice_scatter.default")
def _slice_scatter(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    src = ctx.cast(ctx.value(a["src"]), x.type.dtype)
    axis = a["dim"] % x.type.rank
    start, end, step = _clamp_slice(x.type.shape[axis], a["start"], a["end"], a["step"])
    return ctx.emit("slice_scatter", [x, src], {"axis": axis, "start": start, "end": end, "step": step}, like=node)


@converts("aten.copy.default")
def _copy(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # Functional copy: the values of `src`, in the shape and dtype of `self`.
    want = _meta_type(node)
    src = ctx.cast(ctx.value(a["src"]), want.dtype)
    if src.type.shape != want.shape:
        src = ctx.emit("expand", [src], {"shape": want.shape}, like=node)
    return src


@converts("aten.cat.default")
def _cat(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    xs = [ctx.cast(ctx.value(t), dt) for t in a["tensors"]]
    xs = [x for x in xs if x.type.numel > 0] or xs[:1]  # empty operands (a zero-width pass-through) add nothing
    if len(xs) == 1:
        return xs[0]
    return ctx.emit("concat", xs, {"axis": a["dim"] % xs[0].type.rank}, like=node)


@converts("aten.split_with_sizes.default", "aten.split.Tensor")
def _split(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> list[Value]:
    x = ctx.value(a["self"])
    axis = a["dim"] % x.type.rank
    if "split_sizes" in a:
        sizes = tuple(a["split_sizes"])
    else:
        n, size = x.type.shape[axis], a["split_size"]
        sizes = tuple(min(size, n - i) for i in range(0, n, size))
    return ctx.emit("split", [x], {"axis": axis, "sizes": sizes}, name=node.name)


@converts("aten.embedding.default")
def _embedding(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("gather", [ctx.value(a["weight"]), ctx.value(a["indices"])], {"axis": 0}, like=node)


@converts("aten.index.Tensor")
def _index(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    idx = a["indices"]
    if any(i is None for i in idx):
        raise NpucError("NPUC-E0304", f"{node.name}: indexing with None (x[:, idx]) is not supported",
                        "index leading axes only", exit_code=EXIT_UNSUPPORTED)
    return ctx.emit("index", [ctx.value(a["self"])] + [ctx.value(i) for i in idx], like=node)


@converts("aten.topk.default")
def _topk(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> list[Value]:
    # Always sorted: torch's sorted=False leaves the order unspecified, so sorted is one valid answer.
    x = ctx.value(a["self"])
    attrs = {"k": a["k"], "axis": a.get("dim", -1) % x.type.rank, "largest": a.get("largest", True)}
    return ctx.emit("topk", [x], attrs, name=node.name)


@converts("aten.gather.default")
def _gather_elements(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    return ctx.emit("gather_elements", [x, ctx.value(a["index"])], {"axis": a["dim"] % x.type.rank}, like=node)


@converts("aten.scatter.value", "aten.scatter.src")
def _scatter(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x, idx = ctx.value(a["self"]), ctx.value(a["index"])
    if "src" in a:
        src = ctx.value(a["src"])
    else:  # a scalar scattered: broadcast to the index's shape
        src = ctx.emit("expand", [ctx.scalar(a["value"], x.type.dtype)], {"shape": idx.type.shape},
                       name=f"{node.name}_value")
    return ctx.emit("scatter_elements", [x, idx, src], {"axis": a["dim"] % x.type.rank}, like=node)


@converts("aten.repeat_interleave.self_int")
def _repeat_interleave(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    """x.repeat_interleave(r, dim): each slice along dim r times, as unsqueeze-expand-reshape."""
    x = ctx.value(a["self"])
    r, dim = a["repeats"], a.get("dim")
    if dim is None:
        raise NpucError("NPUC-E0304", f"{node.name}: repeat_interleave without dim is not supported",
                        "give dim", exit_code=EXIT_UNSUPPORTED)
    d = dim % x.type.rank
    shape = x.type.shape
    y = ctx.emit("reshape", [x], {"shape": shape[:d + 1] + (1,) + shape[d + 1:]}, name=f"{node.name}_unsq")
    y = ctx.emit("expand", [y], {"shape": shape[:d + 1] + (r,) + shape[d + 1:]}, name=f"{node.name}_rep")
    return ctx.emit("reshape", [y], {"shape": _meta_type(node).shape}, like=node)


@converts("aten.arange.default", "aten.arange.start", "aten.arange.start_step")
def _arange(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    attrs = {"start": a.get("start", 0), "end": a["end"], "step": a.get("step", 1), "dtype": _out_dtype(node)}
    return ctx.emit("arange", [], attrs, like=node)


_FILL = {"new_ones": 1, "ones": 1, "ones_like": 1, "new_zeros": 0, "zeros": 0, "zeros_like": 0,
         "new_empty": 0, "empty": 0, "empty_like": 0}


@converts("aten.new_ones.default", "aten.new_zeros.default", "aten.new_empty.default", "aten.ones.default",
          "aten.zeros.default", "aten.empty.memory_format", "aten.full.default", "aten.new_full.default",
          "aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default")
def _full(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    t = _meta_type(node)
    base = str(node.target).split(".")[1]
    # Uninitialised memory (`empty`) is given zeros so that programs are deterministic.
    value = a["fill_value"] if "fill_value" in a else _FILL[base]
    return ctx.emit("full", [], {"shape": t.shape, "value": float(value), "dtype": t.dtype}, like=node)


def _unary(op: str) -> Converter:
    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
        x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
        return ctx.emit(op, [x], like=node)

    return conv


for _op in ("neg", "rsqrt", "sqrt", "exp", "log", "cos", "sin", "tanh", "sigmoid", "silu", "relu",
            "reciprocal", "abs", "erf", "logical_not"):
    CONVERTERS[f"aten.{_op}.default"] = _unary(_op)
CONVERTERS["aten.bitwise_not.default"] = _unary("logical_not")


@converts("aten.gelu.default")
def _gelu(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("gelu", [ctx.value(a["self"])], {"approximate": a["approximate"]}, like=node)


def _binary(op: str, compare: bool = False) -> Converter:
    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
        lhs, rhs = a["self"], a["other"] if "other" in a else a["exponent"]
        if compare:
            metas = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in (lhs, rhs)]
            dt = DType.from_torch(torch.result_type(*metas))
        else:
            dt = _out_dtype(node)
        if a.get("alpha", 1) != 1:
            rhs_v = ctx.emit("mul", [ctx.operand(rhs, dt), ctx.scalar(a["alpha"], dt)], name=f"{node.name}_alpha")
        else:
            rhs_v = ctx.operand(rhs, dt)
        return ctx.emit(op, [ctx.operand(lhs, dt), rhs_v], like=node)

    return conv


for _op, _names in {
    "add": ("add.Tensor", "add.Scalar"), "sub": ("sub.Tensor", "sub.Scalar"), "mul": ("mul.Tensor", "mul.Scalar"),
    "div": ("div.Tensor", "div.Scalar"), "pow": ("pow.Tensor_Scalar", "pow.Tensor_Tensor"),
    "maximum": ("maximum.default",), "minimum": ("minimum.default",),
    "bitwise_and": ("__and__.Tensor", "bitwise_and.Tensor", "logical_and.default"),
    "bitwise_or": ("__or__.Tensor", "bitwise_or.Tensor", "logical_or.default"),
}.items():
    for _n in _names:
        CONVERTERS[f"aten.{_n}"] = _binary(_op)
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    CONVERTERS[f"aten.{_op}.Tensor"] = _binary(_op, compare=True)
    CONVERTERS[f"aten.{_op}.Scalar"] = _binary(_op, compare=True)


@converts("aten.rsub.Scalar")
def _rsub(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    return ctx.emit("sub", [ctx.operand(a["other"], dt), ctx.operand(a["self"], dt)], like=node)


@converts("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar")
def _where(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    return ctx.emit("where", [ctx.value(a["condition"]), ctx.operand(a["self"], dt), ctx.operand(a["other"], dt)],
                    like=node)


@converts("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def _masked_fill(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    return ctx.emit("where", [ctx.value(a["mask"]), ctx.operand(a["value"], dt), ctx.operand(a["self"], dt)],
                    like=node)


def _reduction(op: str) -> Converter:
    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
        x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
        dims = a.get("dim")
        if dims is None or dims == []:
            dims = list(range(x.type.rank))
        if isinstance(dims, int):
            dims = [dims]
        axes = tuple(sorted(d % x.type.rank for d in dims))
        return ctx.emit(op, [x], {"axes": axes, "keepdim": bool(a.get("keepdim", False))}, like=node)

    return conv


CONVERTERS["aten.mean.dim"] = _reduction("reduce_mean")
CONVERTERS["aten.mean.default"] = _reduction("reduce_mean")
CONVERTERS["aten.sum.dim_IntList"] = _reduction("reduce_sum")
CONVERTERS["aten.sum.default"] = _reduction("reduce_sum")
CONVERTERS["aten.amax.default"] = _reduction("reduce_max")


@converts("aten.cumsum.default")
def _cumsum(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
    return ctx.emit("cumsum", [x], {"axis": a["dim"] % max(x.type.rank, 1)}, like=node)


@converts("aten.diff.default")
def _diff(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    if a["n"] != 1:
        raise NpucError("NPUC-E0304", f"{node.name}: diff with n={a['n']} is not supported", "use n=1",
                        exit_code=EXIT_UNSUPPORTED)
    x = ctx.value(a["self"])
    axis = a["dim"] % x.type.rank
    parts = [ctx.value(p) if p is not a["self"] else x for p in (a["prepend"], a["self"], a["append"]) if p is not None]
    full = parts[0] if len(parts) == 1 else ctx.emit("concat", parts, {"axis": axis}, name=f"{node.name}_cat")
    n = full.type.shape[axis]
    hi = ctx.emit("slice", [full], {"axis": axis, "start": 1, "end": n, "step": 1}, name=f"{node.name}_hi")
    lo = ctx.emit("slice", [full], {"axis": axis, "start": 0, "end": n - 1, "step": 1}, name=f"{node.name}_lo")
    return ctx.emit("sub", [hi, lo], like=node)


@converts("aten._softmax.default", "aten.softmax.int")
def _softmax(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
    return ctx.emit("softmax", [x], {"axis": a["dim"] % x.type.rank}, like=node)


@converts("aten.linear.default")
def _linear(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    ins = [ctx.value(a["input"]), ctx.value(a["weight"])]
    if a.get("bias") is not None:
        ins.append(ctx.value(a["bias"]))
    return ctx.emit("linear", ins, like=node)


@converts("aten.matmul.default", "aten.mm.default", "aten.bmm.default")
def _matmul(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("matmul", [ctx.value(a["self"]), ctx.value(a["other"] if "other" in a else a["mat2"])],
                    like=node)


@converts("aten.addmm.default")
def _addmm(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    if a["beta"] != 1 or a["alpha"] != 1:
        raise NpucError("NPUC-E0304", f"{node.name}: addmm with alpha/beta != 1 is not supported", "",
                        exit_code=EXIT_UNSUPPORTED)
    mm = ctx.emit("matmul", [ctx.value(a["mat1"]), ctx.value(a["mat2"])], name=f"{node.name}_mm")
    return ctx.emit("add", [mm, ctx.value(a["self"])], like=node)


@converts("aten.scaled_dot_product_attention.default")
def _sdpa(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    if a["dropout_p"]:
        raise NpucError("NPUC-E0304", f"{node.name}: attention dropout is not supported in inference",
                        "put the model in eval mode (model.eval()) before export", exit_code=EXIT_UNSUPPORTED)
    ins = [ctx.value(a["query"]), ctx.value(a["key"]), ctx.value(a["value"])]
    if a["attn_mask"] is not None:
        ins.append(ctx.value(a["attn_mask"]))
    scale = a["scale"]
    attrs = {"scale": None if scale is None else float(scale), "causal": bool(a["is_causal"]),
             "gqa": bool(a["enable_gqa"])}
    return ctx.emit("sdpa", ins, attrs, like=node)
