"""torch.export frontend: an `ExportedProgram` (functional ATen) to npuc IR.

Each supported ATen overload has a converter below that emits IR ops and checks
the inferred type against the exporter's own metadata, so a converter that
disagrees with torch is caught at import, not as a wrong number later.
`scaled_dot_product_attention` and `linear` arrive intact (we run no default
decompositions), which is what the fusion passes want to see.

Parameters and buffers become graph constants whose bytes stay in their source
(`WeightResolver`) until the backend writes them. A weight a checkpoint stores
quantized (a `QuantizedWeight`: GPTQ, AWQ) becomes `dequantize` over its codes.

npuc's IR has no complex dtype. A complex tensor [..] is carried as its real pairs,
a real [.., 2] tensor (re, im), the layout `torch.view_as_real` gives it, wrapped in
`Pairs` so that no real converter mistakes it for a real tensor. A node that reads or
makes a complex value is converted by `COMPLEX_CONVERTERS`; any other such node is
listed with the unsupported operators (NPUC-E0301). DeepSeek-V2's RoPE is the user:

    view_as_complex(x.view(.., d/2, 2)) * polar(1, freqs)    (re, im) = (ac - bd, ad + bc)
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from npuc.compiler.quant_import import Emitted, QuantizedWeight
from npuc.errors import EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import ConstSource, DType, Graph, TensorSource, TensorType, Value, distinct_outputs, get_op
from npuc.ir.ops import ShapeError

WeightResolver = Callable[[str, torch.Tensor | None], ConstSource]
Converter = Callable[["_Ctx", torch.fx.Node, dict[str, Any]], Any]
CONVERTERS: dict[str, Converter] = {}
COMPLEX_CONVERTERS: dict[str, Converter] = {}  # for nodes that read or make complex values
_IGNORED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
            "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"}


def converts(*targets: str, table: dict[str, Converter] = CONVERTERS) -> Callable[[Converter], Converter]:
    def deco(fn: Converter) -> Converter:
        for t in targets:
            table[t] = fn
        return fn

    return deco


@dataclass(frozen=True)
class Pairs:
    """A complex tensor [..] as a real [.., 2] value (re, im)."""

    v: Value


_COMPLEX_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _is_complex(val: Any) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_is_complex(v) for v in val)
    return isinstance(val, torch.Tensor) and val.is_complex()


def _touches_complex(node: torch.fx.Node) -> bool:
    return _is_complex(node.meta.get("val")) or any(_is_complex(a.meta.get("val")) for a in node.all_input_nodes)


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OperatorBase):
        return str(t)
    name = getattr(t, "__name__", None) or type(t).__name__
    if getattr(t, "__module__", None) in ("_operator", "operator", "builtins") or name.startswith("sym_"):
        # Python arithmetic on sizes: sizes the trace computed from the data (data-dependent)
        return f"size arithmetic from data ({name})"
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', name)}"  # never a repr with an address


def unsupported_ops(ep: torch.export.ExportedProgram) -> Counter[str]:
    ops: Counter[str] = Counter()
    for n in ep.graph.nodes:
        if n.op == "call_function":
            name = _target_name(n)
            if name in _IGNORED:
                continue
            if _touches_complex(n):
                if name not in COMPLEX_CONVERTERS:
                    ops[f"{name} on complex values"] += 1
            elif name not in CONVERTERS:
                ops[name] += 1
        elif n.op not in ("placeholder", "output", "get_attr"):
            ops[f"<{n.op}>"] += 1
    return ops


def _meta_type(node: torch.fx.Node) -> TensorType:
    """The node's type as torch recorded it; a complex tensor's is that of its real pairs."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise InternalError(f"node {node.name} has no tensor metadata")
    if val.is_complex():
        dims, dtype = tuple(val.shape) + (2,), DType.from_torch(_COMPLEX_PARTS[val.dtype])
    else:
        dims, dtype = tuple(val.shape), DType.from_torch(val.dtype)
    shape = []
    for d in dims:
        if not isinstance(d, int):
            raise NpucError("NPUC-E0302", f"dimension {d} of {node.name} is symbolic",
                            "npuc compiles static shapes only: export with concrete example inputs")
        shape.append(d)
    return TensorType(tuple(shape), dtype)


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
        self.act_order: dict[int, Emitted] = {}  # id of an act-order weight -> how it was emitted

    def value(self, arg: Any) -> Value:
        if isinstance(arg, torch.fx.Node):
            v = self.env[arg]
            if not isinstance(v, Value):
                raise InternalError(f"{arg.name} is not a real tensor")
            return v
        raise InternalError(f"expected a tensor operand, got {arg!r}")

    def pairs(self, arg: Any) -> Value:
        """A complex operand's real pairs [.., 2]."""
        v = self.env.get(arg) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(v, Pairs):
            raise InternalError(f"expected a complex tensor operand, got {arg!r}")
        return v.v

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
                        "`npuc ops` lists the supported operators (docs/ops.md)", exit_code=EXIT_UNSUPPORTED)
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
                if _is_complex(node.meta.get("val")):
                    raise _complex_refused(f"input {node.name!r} is complex",
                                           "pass its torch.view_as_real pairs and view_as_complex them inside")
                if isinstance(node.meta.get("val"), torch.Tensor):
                    ctx.env[node] = g.add_input(node.name, _meta_type(node))
                else:
                    ctx.env[node] = node.meta.get("val")
            else:
                target = spec.target  # type: ignore[union-attr]
                ctx.env[node] = _constant(ctx, node, target, tensors.get(target), resolve_weight)
        elif node.op == "call_function":
            tname = _target_name(node)
            if tname in _IGNORED:
                continue
            args = {"args": node.args} if tname == "getitem" else _bind(node)
            table = COMPLEX_CONVERTERS if _touches_complex(node) else CONVERTERS
            ctx.env[node] = table[tname](ctx, node, args)
        elif node.op == "output":
            if any(isinstance(ctx.env.get(a), Pairs) for a in node.args[0]):
                raise _complex_refused("the model returns a complex tensor", "return its torch.view_as_real pairs")
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


def _complex_refused(what: str, hint: str) -> NpucError:
    return NpucError("NPUC-E0309", f"{what}: npuc has no complex element type", hint, exit_code=EXIT_UNSUPPORTED)


def _constant(ctx: _Ctx, node: torch.fx.Node, target: str, tensor: torch.Tensor | None,
              resolve_weight: WeightResolver) -> Value | Pairs:
    g = ctx.g
    if not _is_complex(node.meta.get("val")):
        src = resolve_weight(target, tensor)
        if isinstance(src, QuantizedWeight):  # stored quantized (GPTQ, AWQ): dequantize over its codes
            want = _meta_type(node)
            if (src.n, src.k) != want.shape or src.dtype != want.dtype:
                raise InternalError(f"quantized weight {target} is {src.dtype}[{src.n},{src.k}], torch says {want}")
            emitted = src.emit(g, target)
            if emitted.order is not None:
                ctx.act_order[id(emitted.weight)] = emitted
            return emitted.weight
        return g.add_constant(target, _meta_type(node), src)
    if tensor is None:  # a complex weight still on disk: no lazy reader splits it into pairs
        raise _complex_refused(f"weight {target!r} is complex", "store it as torch.view_as_real pairs")
    # A complex buffer (a precomputed freqs_cis) in memory: its pairs are a constant npuc computed.
    return Pairs(g.add_constant(target, _meta_type(node),
                                TensorSource(torch.view_as_real(tensor.detach()).contiguous(), "complex buffer")))


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


# Ops whose result is a view of their operand with the shape torch recorded.
_RESHAPES = ("view.default", "reshape.default", "_unsafe_view.default", "unsqueeze.default", "squeeze.dim",
             "squeeze.dims", "squeeze.default", "flatten.using_ints", "unflatten.int")
_EXPANDS = ("expand.default", "expand_as.default")
for _t in _RESHAPES:
    CONVERTERS[f"aten.{_t}"] = _to_meta_shape("reshape")
for _t in _EXPANDS:
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


@converts("aten.cat.default", "aten.concat.default", "aten.concatenate.default")
def _cat(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    dt = _out_dtype(node)
    xs = [ctx.cast(ctx.value(t), dt) for t in a["tensors"]]
    xs = [x for x in xs if x.type.numel > 0] or xs[:1]  # empty operands (a zero-width pass-through) add nothing
    if len(xs) == 1:
        return xs[0]
    return ctx.emit("concat", xs, {"axis": a["dim"] % xs[0].type.rank}, like=node)


@converts("aten.stack.default")
def _stack(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # A new axis of size 1 on each operand, then one concat (interleaved RoPE builds its pairs so).
    dt = _out_dtype(node)
    xs = [ctx.cast(ctx.value(t), dt) for t in a["tensors"]]
    axis = a.get("dim", 0) % (xs[0].type.rank + 1)
    parts = [ctx.emit("reshape", [x], {"shape": x.type.shape[:axis] + (1,) + x.type.shape[axis:]},
                      name=f"{node.name}_{i}") for i, x in enumerate(xs)]
    if len(parts) == 1:
        return parts[0]
    return ctx.emit("concat", parts, {"axis": axis}, like=node)


@converts("aten.layer_norm.default")
def _layer_norm(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # Normalised over the trailing len(normalized_shape) axes; no weight: a scale of one.
    x = ctx.value(a["input"])
    dt = x.type.dtype
    w, b = a.get("weight"), a.get("bias")
    ins = [x, ctx.cast(ctx.value(w), dt) if w is not None else ctx.scalar(1.0, dt)]
    if b is not None:
        ins.append(ctx.cast(ctx.value(b), dt))
    attrs = {"axis": x.type.rank - len(a["normalized_shape"]), "eps": float(a.get("eps", 1e-5))}
    return ctx.emit("layer_norm", ins, attrs, like=node)


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
    x, idx = ctx.value(a["self"]), list(a["indices"])
    at = [i for i, t in enumerate(idx) if t is not None]
    if at == list(range(len(at))):  # leading axes
        return ctx.emit("index", [x] + [ctx.value(t) for t in idx], like=node)
    if len(at) == 1:  # x[:, idx]: a gather along that axis
        return ctx.emit("gather", [x, ctx.value(idx[at[0]])], {"axis": at[0]}, like=node)
    # Several index tensors after a slice: index the axes moved to the front; torch keeps the
    # broadcast index dims where the first indexed axis was when the indexed axes are adjacent.
    rest = [i for i in range(x.type.rank) if i not in at]
    moved = ctx.emit("transpose", [x], {"perm": tuple(at + rest)}, name=f"{node.name}_front")
    y = ctx.emit("index", [moved] + [ctx.value(idx[i]) for i in at], name=f"{node.name}_index")
    nb = y.type.rank - len(rest)
    if at != list(range(at[0], at[0] + len(at))):
        return ctx.emit("reshape", [y], {"shape": y.type.shape}, like=node)
    perm = list(range(nb, nb + at[0])) + list(range(nb)) + list(range(nb + at[0], y.type.rank))
    return ctx.emit("transpose", [y], {"perm": tuple(perm)}, like=node)


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
            "reciprocal", "abs", "erf", "logical_not", "expm1", "log1p"):
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
    "add": ("add.Tensor", "add.Scalar"), "sub": ("sub.Tensor", "sub.Scalar"),
    "mul": ("mul.Tensor", "mul.Scalar", "multiply.Tensor"),
    "div": ("div.Tensor", "div.Scalar"), "pow": ("pow.Tensor_Scalar", "pow.Tensor_Tensor"),
    "maximum": ("maximum.default", "max.other"), "minimum": ("minimum.default", "min.other"),
    "bitwise_and": ("__and__.Tensor", "bitwise_and.Tensor", "logical_and.default"),
    "bitwise_or": ("__or__.Tensor", "bitwise_or.Tensor", "logical_or.default"),
}.items():
    for _n in _names:
        CONVERTERS[f"aten.{_n}"] = _binary(_op)
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    CONVERTERS[f"aten.{_op}.Tensor"] = _binary(_op, compare=True)
    CONVERTERS[f"aten.{_op}.Scalar"] = _binary(_op, compare=True)


@converts("aten.rms_norm.default")
def _rms_norm_aten(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["input"])
    dt = x.type.dtype
    w = a.get("weight")
    eps = a.get("eps")
    eps = float(torch.finfo(dt.torch).eps) if eps is None else float(eps)  # torch's default
    scale = ctx.cast(ctx.value(w), dt) if w is not None else ctx.scalar(1.0, dt)
    return ctx.emit("rms_norm", [x, scale], {"axis": x.type.rank - len(a["normalized_shape"]), "eps": eps},
                    like=node)


@converts("aten.repeat.default")
def _repeat(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # x.repeat(r): each axis d becomes [r, d] (an expand of a new axis), then merged.
    x = ctx.value(a["self"])
    reps = list(a["repeats"])
    shape = (1,) * (len(reps) - x.type.rank) + x.type.shape
    inter = tuple(v for d in shape for v in (1, d))
    big = tuple(v for r, d in zip(reps, shape, strict=True) for v in (r, d))
    y = ctx.emit("reshape", [x], {"shape": inter}, name=f"{node.name}_axes")
    y = ctx.emit("expand", [y], {"shape": big}, name=f"{node.name}_expand")
    return ctx.emit("reshape", [y], {"shape": tuple(r * d for r, d in zip(reps, shape, strict=True))}, like=node)


@converts("aten.index_select.default")
def _index_select(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    x = ctx.value(a["self"])
    return ctx.emit("gather", [x, ctx.value(a["index"])], {"axis": a["dim"] % x.type.rank}, like=node)


@converts("aten.baddbmm.default")
def _baddbmm(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    # beta * self + alpha * (batch1 @ batch2)
    dt = _out_dtype(node)
    y = ctx.emit("matmul", [ctx.cast(ctx.value(a["batch1"]), dt), ctx.cast(ctx.value(a["batch2"]), dt)],
                 name=f"{node.name}_mm")
    if a.get("alpha", 1) != 1:
        y = ctx.emit("mul", [y, ctx.scalar(a["alpha"], dt)], name=f"{node.name}_alpha")
    beta = a.get("beta", 1)
    if beta == 0:  # torch ignores self then (even its NaNs)
        return ctx.emit("reshape", [y], {"shape": y.type.shape}, like=node)
    s = ctx.cast(ctx.value(a["self"]), dt)
    if beta != 1:
        s = ctx.emit("mul", [s, ctx.scalar(beta, dt)], name=f"{node.name}_beta")
    return ctx.emit("add", [s, y], like=node)


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


def reduce_axes(dims: Any, rank: int) -> tuple[int, ...]:
    """A reduction's `dim` argument (one, several, or none: every axis) as sorted axes."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):  # torch: none given, all reduced
        dims = list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(d % rank for d in dims))


def _reduction(op: str) -> Converter:
    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
        x = ctx.cast(ctx.value(a["self"]), _out_dtype(node))
        axes = reduce_axes(a.get("dim"), x.type.rank)
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
    act_order = ctx.act_order.get(id(ins[1]))
    if act_order is not None and act_order.order is not None:
        # x @ W^T = x[..., order] @ W_stored^T: the input is gathered into the stored order of K.
        x = ins[0]
        ins = [ctx.emit("gather", [x, act_order.order], {"axis": x.type.rank - 1}, name=f"{node.name}_input"),
               act_order.dequantized]
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


@converts("aten.max.dim", "aten.min.dim")
def _extreme_dim(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> list[Value]:
    """x.max(dim) / x.min(dim): (values, indices) as reduce_max and argmax (first index of a tie, as torch)."""
    x = ctx.value(a["self"])
    kind = "max" if str(node.target).startswith("aten.max") else "min"
    axis, keep = a["dim"] % max(x.type.rank, 1), bool(a["keepdim"])
    vals = ctx.emit(f"reduce_{kind}", [x], {"axes": (axis,), "keepdim": keep}, name=f"{node.name}_values")
    idx = ctx.emit(f"arg{kind}", [x], {"axis": axis, "keepdim": keep}, name=f"{node.name}_indices")
    want = [TensorType(tuple(t.shape), DType.from_torch(t.dtype)) for t in node.meta["val"]]
    if [vals.type, idx.type] != want:
        raise InternalError(f"converting {node.name}: npuc infers {vals.type}, {idx.type}, torch says {want}")
    return [vals, idx]


# -- complex values, as real pairs [.., 2] (see the module docstring) ----------------------------

def _part_dtype(node: torch.fx.Node) -> DType:
    """The element type of the node's result, or of its real and imaginary parts."""
    return _meta_type(node).dtype


def _complex_rank(p: Value) -> int:
    return p.type.rank - 1


def _parts(ctx: _Ctx, p: Value, name: str) -> tuple[Value, Value]:
    """(re, im) of pairs [.., 2], each [.., 1]: they broadcast against other pairs' parts."""
    last = p.type.rank - 1
    re = ctx.emit("slice", [p], {"axis": last, "start": 0, "end": 1, "step": 1}, name=f"{name}_re")
    im = ctx.emit("slice", [p], {"axis": last, "start": 1, "end": 2, "step": 1}, name=f"{name}_im")
    return re, im


def _as_part(ctx: _Ctx, v: Value, name: str) -> Value:
    """A real tensor [..] as [.., 1], to broadcast against pairs [.., 2] or parts [.., 1]."""
    return ctx.emit("reshape", [v], {"shape": v.type.shape + (1,)}, name=name)


def _join(ctx: _Ctx, re: Value, im: Value, node: torch.fx.Node) -> Pairs:
    return Pairs(ctx.emit("concat", [re, im], {"axis": re.type.rank - 1}, like=node))


def _complex_operand(ctx: _Ctx, arg: Any, dtype: DType, name: str) -> tuple[Value, bool]:
    """An operand of complex arithmetic as (value, is_pairs): pairs [.., 2], or a real tensor as
    [.., 1] (or a real Python number as a scalar), either way broadcasting against pairs."""
    if isinstance(arg, torch.fx.Node):
        v = ctx.env[arg]
        if isinstance(v, Pairs):
            return ctx.cast(v.v, dtype), True
        return _as_part(ctx, ctx.cast(ctx.value(arg), dtype), f"{name}_part"), False
    if isinstance(arg, complex):
        t = torch.tensor([arg.real, arg.imag], dtype=dtype.torch)
        return ctx.g.add_constant(f"{name}_complex", TensorType((2,), dtype), TensorSource(t, "scalar")), True
    return ctx.scalar(arg, dtype), False


@converts("aten.view_as_complex.default", table=COMPLEX_CONVERTERS)
def _view_as_complex(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    x = ctx.value(a["self"])
    if x.type != _meta_type(node):
        raise InternalError(f"{node.name}: view_as_complex of {x.type}")
    return Pairs(x)


@converts("aten.view_as_real.default", table=COMPLEX_CONVERTERS)
def _view_as_real(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.pairs(a["self"])


@converts("aten.real.default", "aten.imag.default", table=COMPLEX_CONVERTERS)
def _real_imag(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    re, im = _parts(ctx, ctx.pairs(a["self"]), node.name)
    part = re if str(node.target).startswith("aten.real") else im
    return ctx.emit("reshape", [part], {"shape": _meta_type(node).shape}, like=node)


@converts("aten.polar.default", "aten.complex.default", table=COMPLEX_CONVERTERS)
def _polar(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    """polar(abs, angle) = abs * (cos angle, sin angle); complex(real, imag) = (real, imag)."""
    dt, shape = _part_dtype(node), _meta_type(node).shape[:-1]
    if "abs" in a:
        r, t = ctx.value(a["abs"]), ctx.value(a["angle"])
        re = ctx.emit("mul", [r, ctx.emit("cos", [t], name=f"{node.name}_cos")], name=f"{node.name}_re")
        im = ctx.emit("mul", [r, ctx.emit("sin", [t], name=f"{node.name}_sin")], name=f"{node.name}_im")
    else:
        re, im = ctx.value(a["real"]), ctx.value(a["imag"])
    parts = []
    for v, k in ((re, "re"), (im, "im")):
        v = ctx.cast(v, dt)
        if v.type.shape != shape:
            v = ctx.emit("expand", [v], {"shape": shape}, name=f"{node.name}_{k}_expand")
        parts.append(_as_part(ctx, v, f"{node.name}_{k}_part"))
    return _join(ctx, parts[0], parts[1], node)


@converts("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", table=COMPLEX_CONVERTERS)
def _complex_mul(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    """(a + bi)(c + di) = (ac - bd) + (ad + bc)i; by a real r, both parts times r."""
    dt, div = _part_dtype(node), str(node.target).startswith("aten.div")
    if a.get("rounding_mode") is not None:
        raise NpucError("NPUC-E0304", f"{node.name}: rounded division of complex values is not supported", "",
                        exit_code=EXIT_UNSUPPORTED)
    (x, x_pairs), (y, y_pairs) = (_complex_operand(ctx, a[k], dt, f"{node.name}_{k}") for k in ("self", "other"))
    if x_pairs and y_pairs:
        if div:
            raise NpucError("NPUC-E0304", f"{node.name}: division by a complex tensor is not supported",
                            "multiply by the conjugate and divide by the squared magnitude instead",
                            exit_code=EXIT_UNSUPPORTED)
        (xr, xi), (yr, yi) = _parts(ctx, x, f"{node.name}_x"), _parts(ctx, y, f"{node.name}_y")
        re = ctx.emit("sub", [ctx.emit("mul", [xr, yr], name=f"{node.name}_rr"),
                              ctx.emit("mul", [xi, yi], name=f"{node.name}_ii")], name=f"{node.name}_re")
        im = ctx.emit("add", [ctx.emit("mul", [xr, yi], name=f"{node.name}_ri"),
                              ctx.emit("mul", [xi, yr], name=f"{node.name}_ir")], name=f"{node.name}_im")
        return _join(ctx, re, im, node)
    if div and not x_pairs:
        raise NpucError("NPUC-E0304", f"{node.name}: division by a complex tensor is not supported", "",
                        exit_code=EXIT_UNSUPPORTED)
    return Pairs(ctx.emit("div" if div else "mul", [x, y], like=node))


@converts("aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", table=COMPLEX_CONVERTERS)
def _complex_add(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    """Pairs add part by part; a real operand adds to the real part only."""
    dt, op = _part_dtype(node), "add" if str(node.target).startswith("aten.add") else "sub"
    (x, x_pairs), (y, y_pairs) = (_complex_operand(ctx, a[k], dt, f"{node.name}_{k}") for k in ("self", "other"))
    if a.get("alpha", 1) != 1:
        if isinstance(a["alpha"], complex):
            raise NpucError("NPUC-E0304", f"{node.name}: a complex alpha is not supported", "",
                            exit_code=EXIT_UNSUPPORTED)
        y = ctx.emit("mul", [y, ctx.scalar(a["alpha"], dt)], name=f"{node.name}_alpha")
    if x_pairs and y_pairs:
        return Pairs(ctx.emit(op, [x, y], like=node))
    p, r = (x, y) if x_pairs else (y, x)
    re, im = _parts(ctx, p, node.name)
    re = ctx.emit(op, [re, r] if x_pairs else [r, re], name=f"{node.name}_re")
    if not x_pairs and op == "sub":  # real - complex: the imaginary part changes sign
        im = ctx.emit("neg", [im], name=f"{node.name}_im")
    shape = _meta_type(node).shape[:-1] + (1,)
    re, im = (v if v.type.shape == shape else ctx.emit("expand", [v], {"shape": shape}, name=f"{v.name}_expand")
              for v in (re, im))
    return _join(ctx, re, im, node)


@converts("aten.neg.default", table=COMPLEX_CONVERTERS)
def _complex_neg(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    return Pairs(ctx.emit("neg", [ctx.pairs(a["self"])], like=node))


@converts("aten.abs.default", table=COMPLEX_CONVERTERS)
def _complex_abs(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    p = ctx.pairs(a["self"])
    sq = ctx.emit("reduce_sum", [ctx.emit("mul", [p, p], name=f"{node.name}_sq")],
                  {"axes": (p.type.rank - 1,), "keepdim": False}, name=f"{node.name}_sum")
    return ctx.emit("sqrt", [sq], like=node)


@converts("aten.clone.default", "aten.alias.default", "aten.contiguous.default", "aten.detach.default",
          "aten.lift_fresh_copy.default", "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout",
          "aten.to.device", "aten.type_as.default", table=COMPLEX_CONVERTERS)
def _complex_copy(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value | Pairs:
    """Copies and casts: complex to complex casts the pairs, real to complex adds a zero
    imaginary part, complex to real keeps the real part (as torch does, with a warning)."""
    src = a["self"] if "self" in a else a["input"]
    x, want = ctx.env[src], _meta_type(node)
    if isinstance(x, Pairs) and _is_complex(node.meta.get("val")):
        return Pairs(ctx.cast(x.v, want.dtype))
    if isinstance(x, Pairs):
        re, _ = _parts(ctx, x.v, node.name)
        return ctx.emit("reshape", [ctx.cast(re, want.dtype)], {"shape": want.shape}, like=node)
    re = _as_part(ctx, ctx.cast(ctx.value(src), want.dtype), f"{node.name}_re")
    zero = ctx.emit("expand", [ctx.scalar(0.0, want.dtype)], {"shape": re.type.shape}, name=f"{node.name}_im")
    return _join(ctx, re, zero, node)


def _complex_to_meta_shape(op: str) -> Converter:
    """A complex reshape/expand: the pairs', to the recorded shape with the trailing 2."""

    def conv(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
        p, shape = ctx.pairs(a["self"]), _meta_type(node).shape
        return Pairs(p if p.type.shape == shape else ctx.emit(op, [p], {"shape": shape}, like=node))

    return conv


for _t in _RESHAPES:
    COMPLEX_CONVERTERS[f"aten.{_t}"] = _complex_to_meta_shape("reshape")
for _t in _EXPANDS:
    COMPLEX_CONVERTERS[f"aten.{_t}"] = _complex_to_meta_shape("expand")


@converts("aten.transpose.int", "aten.permute.default", "aten.t.default", table=COMPLEX_CONVERTERS)
def _complex_transpose(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    p = ctx.pairs(a["self"])
    rank = _complex_rank(p)
    if "dims" in a:
        perm = [d % rank for d in a["dims"]]
    else:
        d0, d1 = (a["dim0"] % rank, a["dim1"] % rank) if "dim0" in a else (0, 1)
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    if perm == list(range(rank)):
        return Pairs(p)
    return Pairs(ctx.emit("transpose", [p], {"perm": tuple(perm) + (rank,)}, like=node))


@converts("aten.slice.Tensor", "aten.select.int", table=COMPLEX_CONVERTERS)
def _complex_slice(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    p = ctx.pairs(a["self"])
    axis = a["dim"] % _complex_rank(p)
    if "index" in a:  # select: a slice of one, then the axis dropped
        i = a["index"] % p.type.shape[axis]
        s = ctx.emit("slice", [p], {"axis": axis, "start": i, "end": i + 1, "step": 1}, name=f"{node.name}_slice")
        return Pairs(ctx.emit("reshape", [s], {"shape": _meta_type(node).shape}, like=node))
    start, end, step = _clamp_slice(p.type.shape[axis], a["start"], a["end"], a["step"])
    if (start, end, step) == (0, p.type.shape[axis], 1):
        return Pairs(p)
    return Pairs(ctx.emit("slice", [p], {"axis": axis, "start": start, "end": end, "step": step}, like=node))


@converts("aten.cat.default", table=COMPLEX_CONVERTERS)
def _complex_cat(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Pairs:
    dt = _part_dtype(node)
    xs = []
    for i, t in enumerate(a["tensors"]):
        v, is_pairs = _complex_operand(ctx, t, dt, f"{node.name}_{i}")
        if not is_pairs:  # a real operand: a zero imaginary part
            v = ctx.emit("concat", [v, ctx.emit("expand", [ctx.scalar(0.0, dt)], {"shape": v.type.shape},
                                                name=f"{node.name}_{i}_im")],
                         {"axis": v.type.rank - 1}, name=f"{node.name}_{i}_pairs")
        xs.append(v)
    xs = [x for x in xs if x.type.numel > 0] or xs[:1]
    if len(xs) == 1:
        return Pairs(xs[0])
    return Pairs(ctx.emit("concat", xs, {"axis": a["dim"] % _complex_rank(xs[0])}, like=node))


@converts("aten.split_with_sizes.default", "aten.split.Tensor", table=COMPLEX_CONVERTERS)
def _complex_split(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> list[Pairs]:
    p = ctx.pairs(a["self"])
    axis = a["dim"] % _complex_rank(p)
    if "split_sizes" in a:
        sizes = tuple(a["split_sizes"])
    else:
        n, size = p.type.shape[axis], a["split_size"]
        sizes = tuple(min(size, n - i) for i in range(0, n, size))
    outs = ctx.emit("split", [p], {"axis": axis, "sizes": sizes}, name=node.name)
    return [Pairs(v) for v in ([outs] if isinstance(outs, Value) else outs)]


COMPLEX_CONVERTERS["getitem"] = _getitem


# More converters live beside this module; importing it registers them.
from npuc.compiler import torch_math  # noqa: E402, F401
