"""ONNX frontend: an `.onnx` file (opsets 17-23) to npuc IR.

- The file is read without its external data: initializers stored beside it stay
  there as `OnnxTensorSource`s and are read one at a time when the `.om` is
  written, so a model larger than memory compiles.
- Model-local functions are inlined; ONNX shape inference runs with the user's
  static shapes and cross-checks every type npuc infers.
- Shape arithmetic from dynamic exports (`Shape -> Gather -> Concat -> Reshape`,
  `Range`, `ConstantOfShape`) is evaluated while importing: once every input
  shape is fixed those values are constants, and the ops that need them
  (Reshape, Expand, Slice, ...) read them as data.
- Every unsupported op is reported at once, with its domain and opset.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npuc.compiler.shapes import DeclaredInput
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, InternalError, NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, Value, get_op
from npuc.ir.evaluate import fold_node, foldable
from npuc.ir.ops import ShapeError, broadcast

MIN_OPSET, MAX_OPSET = 17, 23
# Values computed while importing (shape arithmetic, masks) up to this size become constants at once.
_EAGER_FOLD_BYTES = 1 << 20

_DTYPES = {1: DType.f32, 2: DType.u8, 3: DType.i8, 5: DType.i16, 6: DType.i32, 7: DType.i64, 9: DType.bool,
           10: DType.f16, 11: DType.f64, 16: DType.bf16}
_NP = {DType.f32: np.float32, DType.u8: np.uint8, DType.i8: np.int8, DType.i16: np.int16, DType.i32: np.int32,
       DType.i64: np.int64, DType.bool: np.bool_, DType.f16: np.float16, DType.f64: np.float64,
       DType.bf16: np.uint16}


def onnx_dtype(code: int, where: str) -> DType:
    if code not in _DTYPES:
        import onnx

        name = onnx.TensorProto.DataType.Name(code) if code in onnx.TensorProto.DataType.values() else str(code)
        raise NpucError("NPUC-E0309", f"{where} has element type {name}, which npuc does not support",
                        "supported: " + ", ".join(sorted(str(d) for d in _DTYPES.values())),
                        exit_code=EXIT_UNSUPPORTED)
    return _DTYPES[code]


class OnnxTensorSource:
    """An initializer: inline bytes, or a range of an external data file read on demand."""

    def __init__(self, tensor: Any, base_dir: str) -> None:
        self.tensor = tensor
        self.base_dir = base_dir
        self.dtype = onnx_dtype(tensor.data_type, f"initializer {tensor.name!r}")
        self.shape = tuple(int(d) for d in tensor.dims)
        ext = {e.key: e.value for e in tensor.external_data}
        self.location = ext.get("location") if tensor.data_location == 1 else None
        self.offset = int(ext.get("offset", 0))
        self.length = int(ext["length"]) if "length" in ext else None

    def files(self) -> list[str]:
        return [os.path.join(self.base_dir, self.location)] if self.location else []

    def load(self) -> torch.Tensor:
        np_dtype = _NP[self.dtype]
        count = int(np.prod(self.shape, dtype=np.int64))
        if self.location is not None:
            path = os.path.join(self.base_dir, self.location)
            nbytes = count * np.dtype(np_dtype).itemsize
            try:
                with open(path, "rb") as f:
                    f.seek(self.offset)
                    raw = f.read(nbytes)
            except OSError as e:
                raise NpucError("NPUC-E0401", f"cannot read external data {path!r} of {self.tensor.name!r}: "
                                f"{e.strerror}", "keep the data file beside the .onnx", exit_code=EXIT_IO) from None
            if len(raw) != nbytes:
                raise NpucError("NPUC-E0404", f"external data {path!r} is too short for {self.tensor.name!r}",
                                "the data file is truncated", exit_code=EXIT_IO)
            arr = np.frombuffer(raw, dtype=np_dtype).reshape(self.shape)
        else:
            from onnx import numpy_helper

            arr = numpy_helper.to_array(self.tensor)
            if self.dtype == DType.bf16:
                arr = np.asarray(arr).view(np.uint16) if arr.dtype.itemsize == 2 else \
                    torch.from_numpy(np.asarray(arr, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
            arr = np.asarray(arr).reshape(self.shape)
        t = torch.from_numpy(np.array(arr, dtype=np_dtype, copy=True))
        return t.view(torch.bfloat16) if self.dtype == DType.bf16 else t

    def describe(self) -> str:
        return f"{self.location}+{self.offset}" if self.location else "inline"


@dataclass
class OnnxModel:
    proto: Any
    path: str
    opset: int
    inputs: dict[str, DeclaredInput]
    files: list[str] = field(default_factory=list)


def load_onnx(path: str) -> OnnxModel:
    import onnx
    import onnx.inliner

    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise NpucError("NPUC-E0407", f"cannot read {path!r} as an ONNX model: {str(e).splitlines()[0]}",
                        "export it with torch.onnx.export or onnx.save", exit_code=EXIT_IO) from None
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise NpucError("NPUC-E0310", f"{path!r} uses ONNX opset {opset}; npuc reads opsets {MIN_OPSET} to {MAX_OPSET}",
                        "re-export at a supported opset, or convert it with onnx.version_converter",
                        exit_code=EXIT_UNSUPPORTED)
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    inits = {t.name for t in proto.graph.initializer}
    inputs = {}
    for vi in proto.graph.input:
        if vi.name in inits:
            continue  # IR < 4 lists initializers as inputs too
        tt = vi.type.tensor_type
        dtype = str(_DTYPES.get(tt.elem_type, f"type{tt.elem_type}"))
        dims: tuple[int | str | None, ...] | None = None
        if tt.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        inputs[vi.name] = DeclaredInput(dtype, dims)
    model = OnnxModel(proto, path, opset, inputs, [path])
    base = os.path.dirname(os.path.abspath(path))
    for t in proto.graph.initializer:
        if t.data_location == 1:
            loc = {e.key: e.value for e in t.external_data}.get("location")
            if loc and os.path.join(base, loc) not in model.files:
                model.files.append(os.path.join(base, loc))
    return model


# -- conversion ----------------------------------------------------------------------

OnnxConverter = Callable[["_Ctx", Any, list[Value | None], dict[str, Any]], Sequence[Value | None]]
CONVERTERS: dict[str, OnnxConverter] = {}


def converts(*op_types: str) -> Callable[[OnnxConverter], OnnxConverter]:
    def deco(fn: OnnxConverter) -> OnnxConverter:
        for t in op_types:
            CONVERTERS[t] = fn
        return fn

    return deco


def supported_op_types() -> list[str]:
    return sorted(CONVERTERS)


class _Ctx:
    def __init__(self, g: Graph, opset: int) -> None:
        self.g = g
        self.opset = opset
        self.node: Any = None

    @property
    def where(self) -> str:
        n = self.node
        return f"{n.op_type} node {n.name or n.output[0]!r}" if n is not None else "the graph"

    def unsupported(self, what: str) -> NpucError:
        return NpucError("NPUC-E0304", f"{self.where}: {what} is not supported", "see docs/ops.md",
                         exit_code=EXIT_UNSUPPORTED)

    def emit(self, op: str, inputs: Sequence[Value], attrs: dict[str, Any] | None = None,
             name: str | None = None) -> list[Value]:
        attrs = attrs or {}
        od = get_op(op)
        try:
            types = od.infer_types([v.type for v in inputs], attrs)
        except ShapeError as e:
            raise NpucError("NPUC-E0311", f"{self.where}: operands do not fit ({e})",
                            "the model is inconsistent at the shapes given; check --input_shape",
                            exit_code=EXIT_USAGE) from None
        base = name or (self.node.output[0] if self.node is not None and self.node.output else op)
        node = self.g.add_node(op, list(inputs), types, attrs, names=base)
        if foldable(node, _EAGER_FOLD_BYTES):
            return fold_node(self.g, node)
        return node.outputs

    def one(self, op: str, inputs: Sequence[Value], attrs: dict[str, Any] | None = None,
            name: str | None = None) -> Value:
        return self.emit(op, inputs, attrs, name)[0]

    def const(self, data: Any, dtype: DType, name: str = "const") -> Value:
        t = torch.as_tensor(np.asarray(data), dtype=dtype.torch)
        return self.g.add_constant(name, TensorType(tuple(t.shape), dtype), TensorSource(t, "onnx"))

    def data(self, v: Value | None, what: str) -> list[Any] | Any:
        """The value of `v`, which must be known at compile time once shapes are fixed."""
        if v is None:
            raise InternalError("data() of a missing input")
        if v.const is None:
            raise NpucError("NPUC-E0308", f"{self.where}: its {what} ({v.name!r}) depends on input data, "
                            "not only on shapes", "npuc compiles static graphs: this value must be computable "
                            "at compile time", exit_code=EXIT_UNSUPPORTED)
        return v.const.load().tolist()

    def cast(self, v: Value, dtype: DType) -> Value:
        return v if v.type.dtype == dtype else self.one("cast", [v], {"dtype": dtype}, name=f"{v.name}_cast")

    def reshape(self, v: Value, shape: Sequence[int]) -> Value:
        shape = tuple(int(d) for d in shape)
        return v if v.type.shape == shape else self.one("reshape", [v], {"shape": shape})


def import_onnx(model: OnnxModel, shapes: dict[str, tuple[int, ...]]) -> Graph:
    proto = model.proto
    bad: Counter[str] = Counter()
    for n in proto.graph.node:
        domain = n.domain or "ai.onnx"
        if domain not in ("ai.onnx",) or n.op_type not in CONVERTERS:
            bad[f"{domain}::{n.op_type} (opset {model.opset})"] += 1
    if bad:
        listing = ", ".join(f"{k} x{v}" for k, v in sorted(bad.items()))
        raise NpucError("NPUC-E0301", f"the model uses {len(bad)} operator(s) npuc does not support: {listing}",
                        "see docs/ops.md for the supported operators", exit_code=EXIT_UNSUPPORTED)
    expected = _inferred_types(proto, shapes)
    g = Graph(proto.graph.name or "main")
    ctx = _Ctx(g, model.opset)
    env: dict[str, Value] = {}
    base = os.path.dirname(os.path.abspath(model.path))
    for t in proto.graph.initializer:
        src = OnnxTensorSource(t, base)
        env[t.name] = g.add_constant(t.name, TensorType(src.shape, src.dtype), src)
    for vi in proto.graph.input:
        if vi.name in env:
            continue
        dtype = onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        env[vi.name] = g.add_input(vi.name, TensorType(shapes[vi.name], dtype))
    for node in proto.graph.node:
        ctx.node = node
        ins = [env[i] if i else None for i in node.input]
        for i in node.input:
            if i and i not in env:
                raise NpucError("NPUC-E0312", f"{ctx.where} reads {i!r}, which nothing defines",
                                "the ONNX graph is malformed (run onnx.checker)", exit_code=EXIT_USAGE)
        attrs = {a.name: _attr(a) for a in node.attribute}
        outs = CONVERTERS[node.op_type](ctx, node, ins, attrs)
        for name, v in zip(node.output, outs, strict=False):
            if not name:
                continue
            if v is None:
                raise ctx.unsupported(f"output {name!r}")
            _check_type(ctx, name, v, expected)
            if v.producer is not None and v.name != name and name not in g._names and not v.uses:
                g.rename(v, name)
            env[name] = v
        for name in node.output[len(outs):]:
            if name:
                raise ctx.unsupported(f"output {name!r}")
    ctx.node = None
    outs = [env[o.name] for o in proto.graph.output]
    outs = distinct_outputs(g, outs)
    for o, v in zip(proto.graph.output, outs, strict=True):
        if v.name != o.name and o.name not in g._names:
            g.rename(v, o.name)
    g.set_outputs(outs)
    return g


def distinct_outputs(g: Graph, outs: list[Value]) -> list[Value]:
    """Give every graph output its own producing node, so each can carry its own name."""
    seen: set[int] = set()
    res = []
    for v in outs:
        if id(v) in seen or v.producer is None:
            v = g.add_node("reshape", [v], [v.type], {"shape": v.type.shape}, names="output").outputs[0]
        seen.add(id(v))
        res.append(v)
    return res


def _attr(a: Any) -> Any:
    import onnx

    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    return v


def _inferred_types(proto: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], int]]:
    """ONNX's own shape inference at the static shapes: name -> (shape, elem type), fully known ones only."""
    import onnx

    p = onnx.ModelProto()
    p.CopyFrom(proto)
    for vi in p.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            for d in shapes[vi.name]:
                dims.add().dim_value = d
    try:
        p = onnx.shape_inference.infer_shapes(p, strict_mode=False, data_prop=True)
    except Exception:  # inference is a cross-check, not a requirement
        return {}
    out = {}
    for vi in list(p.graph.value_info) + list(p.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            out[vi.name] = (tuple(d.dim_value for d in tt.shape.dim), tt.elem_type)
    return out


def _check_type(ctx: _Ctx, name: str, v: Value, expected: dict[str, tuple[tuple[int, ...], int]]) -> None:
    if name not in expected:
        return
    shape, elem = expected[name]
    if shape != v.type.shape or _DTYPES.get(elem) != v.type.dtype:
        raise InternalError(f"{ctx.where}: npuc infers {name!r} as {v.type}, ONNX shape inference says "
                            f"{_DTYPES.get(elem)}{list(shape)}")


# -- converters ------------------------------------------------------------------------

def _axes(ctx: _Ctx, ins: list[Value | None], attrs: dict[str, Any], index: int) -> list[int] | None:
    """Axes from the attribute (older opsets) or from input `index` (newer ones)."""
    if "axes" in attrs:
        return list(attrs["axes"])
    if len(ins) > index and ins[index] is not None:
        return [int(a) for a in ctx.data(ins[index], "axes")]
    return None


@converts("Identity")
def _identity(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    return [ins[0]]


@converts("Constant")
def _constant(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    if "value" in a:
        src = OnnxTensorSource(a["value"], "")
        return [ctx.g.add_constant(node.output[0], TensorType(src.shape, src.dtype), src)]
    for key, dt in (("value_float", DType.f32), ("value_floats", DType.f32), ("value_int", DType.i64),
                    ("value_ints", DType.i64)):
        if key in a:
            return [ctx.const(a[key], dt, node.output[0])]
    raise ctx.unsupported(f"a Constant with {sorted(a)}")


@converts("Shape")
def _shape(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    dims = list(x.type.shape)
    start, end = a.get("start", 0), a.get("end", len(dims))
    return [ctx.const(dims[slice(start, end)], DType.i64, node.output[0])]


@converts("Size")
def _size(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    return [ctx.const(ins[0].type.numel, DType.i64, node.output[0])]


@converts("Cast")
def _cast(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    return [ctx.cast(ins[0], onnx_dtype(a["to"], ctx.where))]


@converts("CastLike")
def _cast_like(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.cast(ins[0], ins[1].type.dtype)]


_UNARY = {"Neg": "neg", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Exp": "exp", "Log": "log", "Cos": "cos",
          "Sin": "sin", "Tanh": "tanh", "Sigmoid": "sigmoid", "Relu": "relu", "Abs": "abs", "Erf": "erf",
          "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign", "Not": "logical_not",
          "IsNaN": "is_nan"}


def _unary(op: str) -> OnnxConverter:
    def conv(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
        assert ins[0] is not None
        return [ctx.one(op, [ins[0]])]

    return conv


for _k, _v in _UNARY.items():
    CONVERTERS[_k] = _unary(_v)


@converts("Gelu")
def _gelu(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    return [ctx.one("gelu", [ins[0]], {"approximate": a.get("approximate", "none")})]


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Max": "maximum", "Min": "minimum", "And": "bitwise_and",
           "Or": "bitwise_or", "Xor": "bitwise_xor", "Equal": "eq", "Less": "lt", "LessOrEqual": "le",
           "Greater": "gt", "GreaterOrEqual": "ge"}


def _binary(op: str) -> OnnxConverter:
    def conv(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
        vals = [v for v in ins if v is not None]
        out = vals[0]
        for v in vals[1:]:  # Max/Min are variadic
            out = ctx.one(op, [out, v])
        return [out]

    return conv


for _k, _v in _BINARY.items():
    CONVERTERS[_k] = _binary(_v)


@converts("Sum", "Mean")
def _sum(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    vals = [v for v in ins if v is not None]
    out = vals[0]
    for v in vals[1:]:
        out = ctx.one("add", [out, v])
    if node.op_type == "Mean":
        out = ctx.one("div", [out, ctx.const(len(vals), out.type.dtype)])
    return [out]


@converts("Div")
def _div(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, y = ins[0], ins[1]
    assert x is not None and y is not None
    if x.type.dtype.is_float:
        return [ctx.one("div", [x, y])]
    # Integer division truncates toward zero, which a float division then a cast does.
    q = ctx.one("div", [ctx.cast(x, DType.f64), ctx.cast(y, DType.f64)], name=f"{node.output[0]}_f")
    return [ctx.cast(q, x.type.dtype)]


@converts("Pow")
def _pow(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, y = ins[0], ins[1]
    assert x is not None and y is not None
    return [ctx.one("pow", [x, ctx.cast(y, x.type.dtype)])]


@converts("Where")
def _where(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert all(v is not None for v in ins)
    return [ctx.one("where", [v for v in ins if v is not None])]


@converts("Clip")
def _clip(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    if len(ins) > 1 and ins[1] is not None:
        x = ctx.one("maximum", [x, ins[1]])
    if len(ins) > 2 and ins[2] is not None:
        x = ctx.one("minimum", [x, ins[2]])
    return [x]


@converts("MatMul")
def _matmul(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.one("matmul", [ins[0], ins[1]])]


@converts("Gemm")
def _gemm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, w = ins[0], ins[1]
    assert x is not None and w is not None
    if a.get("transA", 0):
        x = ctx.one("transpose", [x], {"perm": (1, 0)})
    if a.get("transB", 0):
        w = ctx.one("transpose", [w], {"perm": (1, 0)})
    y = ctx.one("matmul", [x, w])
    if a.get("alpha", 1.0) != 1.0:
        y = ctx.one("mul", [y, ctx.const(a["alpha"], y.type.dtype)])
    if len(ins) > 2 and ins[2] is not None:
        c = ins[2]
        if a.get("beta", 1.0) != 1.0:
            c = ctx.one("mul", [c, ctx.const(a["beta"], c.type.dtype)])
        y = ctx.one("add", [y, c])
    return [y]


def _resolve_reshape(shape: list[int], src: tuple[int, ...], allowzero: bool) -> tuple[int, ...]:
    out = [src[i] if d == 0 and not allowzero else d for i, d in enumerate(shape)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        out[out.index(-1)] = int(np.prod(src, dtype=np.int64)) // max(known, 1)
    return tuple(out)


@converts("Reshape")
def _reshape(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    shape = _resolve_reshape([int(d) for d in ctx.data(ins[1], "shape")], x.type.shape, bool(a.get("allowzero", 0)))
    return [ctx.reshape(x, shape)]


@converts("Flatten")
def _flatten(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    ax = a.get("axis", 1) % (x.type.rank + 1) if x.type.rank else 0
    s = x.type.shape
    return [ctx.reshape(x, (int(np.prod(s[:ax], dtype=np.int64)), int(np.prod(s[ax:], dtype=np.int64))))]


@converts("Squeeze", "Unsqueeze")
def _squeeze(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    axes = _axes(ctx, ins, a, 1)
    shape = list(x.type.shape)
    if node.op_type == "Squeeze":
        rank = len(shape)
        drop = {ax % rank for ax in axes} if axes is not None else {i for i, d in enumerate(shape) if d == 1}
        shape = [d for i, d in enumerate(shape) if i not in drop]
    else:
        assert axes is not None
        rank = len(shape) + len(axes)
        for ax in sorted(ax % rank for ax in axes):
            shape.insert(ax, 1)
    return [ctx.reshape(x, shape)]


@converts("Transpose")
def _transpose(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    perm = tuple(a.get("perm", range(x.type.rank - 1, -1, -1)))
    if perm == tuple(range(x.type.rank)):
        return [x]
    return [ctx.one("transpose", [x], {"perm": perm})]


@converts("Concat")
def _concat(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    vals = [v for v in ins if v is not None]
    rank = vals[0].type.rank
    ax = a["axis"] % rank
    kept = [v for v in vals if v.type.shape[ax] > 0] or vals[:1]
    return [kept[0] if len(kept) == 1 else ctx.one("concat", kept, {"axis": ax})]


@converts("Split")
def _split(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    ax = a.get("axis", 0) % x.type.rank
    n = x.type.shape[ax]
    if "split" in a:
        sizes = list(a["split"])
    elif len(ins) > 1 and ins[1] is not None:
        sizes = [int(s) for s in ctx.data(ins[1], "split")]
    else:
        parts = a.get("num_outputs", len(node.output))
        step = -(-n // parts)
        sizes = [min(step, n - i) for i in range(0, n, step)]
    return ctx.emit("split", [x], {"axis": ax, "sizes": tuple(sizes)})


@converts("Slice")
def _slice(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    starts = [int(v) for v in ctx.data(ins[1], "starts")]
    ends = [int(v) for v in ctx.data(ins[2], "ends")]
    axes = [int(v) for v in ctx.data(ins[3], "axes")] if len(ins) > 3 and ins[3] is not None \
        else list(range(len(starts)))
    steps = [int(v) for v in ctx.data(ins[4], "steps")] if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        ax %= x.type.rank
        dim = x.type.shape[ax]
        idx = range(dim)[slice(s, e, st)]
        if st > 0:
            if (idx.start, idx.stop, st) == (0, dim, 1):
                continue
            x = ctx.one("slice", [x], {"axis": ax, "start": idx.start, "end": max(idx.stop, idx.start),
                                       "step": st})
        else:
            x = ctx.one("gather", [x, ctx.const(list(idx), DType.i64)], {"axis": ax})
    return [x]


@converts("Gather")
def _gather(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.one("gather", [ins[0], ins[1]], {"axis": a.get("axis", 0) % max(ins[0].type.rank, 1)})]


@converts("GatherND")
def _gather_nd(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.one("gather_nd", [ins[0], ins[1]], {"batch_dims": a.get("batch_dims", 0)})]


@converts("ScatterND")
def _scatter_nd(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert all(v is not None for v in ins[:3])
    return [ctx.one("scatter_nd", [v for v in ins[:3] if v is not None], {"reduction": a.get("reduction", "none")})]


@converts("Expand")
def _expand(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    shape = broadcast(x.type.shape, tuple(int(d) for d in ctx.data(ins[1], "shape")))  # ONNX broadcasts both ways
    return [x if shape == x.type.shape else ctx.one("expand", [x], {"shape": shape})]


@converts("Range")
def _range(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    start, limit, delta = (ctx.data(v, w) for v, w in zip(ins, ("start", "limit", "delta"), strict=True))
    assert ins[0] is not None
    return [ctx.one("arange", [], {"start": start, "end": limit, "step": delta, "dtype": ins[0].type.dtype})]


@converts("ConstantOfShape")
def _constant_of_shape(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    from onnx import numpy_helper

    shape = tuple(int(d) for d in ctx.data(ins[0], "shape"))
    value, dtype = 0.0, DType.f32
    if "value" in a:
        arr = numpy_helper.to_array(a["value"]).reshape(-1)
        value, dtype = arr[0].item(), onnx_dtype(a["value"].data_type, ctx.where)
    return [ctx.one("full", [], {"shape": shape, "value": float(value), "dtype": dtype})]


@converts("CumSum")
def _cumsum(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    ax = int(ctx.data(ins[1], "axis")) % x.type.rank
    return [ctx.one("cumsum", [x], {"axis": ax, "exclusive": bool(a.get("exclusive", 0)),
                                   "reverse": bool(a.get("reverse", 0))})]


@converts("Trilu")
def _trilu(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    k = int(ctx.data(ins[1], "k")) if len(ins) > 1 and ins[1] is not None else 0
    return [ctx.one("trilu", [ins[0]], {"upper": bool(a.get("upper", 1)), "k": k})]


@converts("Softmax", "LogSoftmax")
def _softmax(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    y = ctx.one("softmax", [x], {"axis": a.get("axis", -1) % x.type.rank})
    return [ctx.one("log", [y]) if node.op_type == "LogSoftmax" else y]


_REDUCE = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max",
           "ReduceMin": "reduce_min", "ReduceProd": "reduce_prod"}


def _reduce(op: str) -> OnnxConverter:
    def conv(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
        x = ins[0]
        assert x is not None
        axes = _axes(ctx, ins, a, 1)
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.type.rank))
        if x.type.rank == 0:
            return [x]
        norm = tuple(sorted({ax % x.type.rank for ax in axes}))
        return [ctx.one(op, [x], {"axes": norm, "keepdim": bool(a.get("keepdims", 1))})]

    return conv


for _k, _v in _REDUCE.items():
    CONVERTERS[_k] = _reduce(_v)


@converts("ArgMax", "ArgMin")
def _arg(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    return [ctx.one(node.op_type.lower(), [x], {"axis": a.get("axis", 0) % x.type.rank,
                                                 "keepdim": bool(a.get("keepdims", 1)),
                                                 "select_last": bool(a.get("select_last_index", 0))})]


@converts("RMSNormalization", "LayerNormalization")
def _norm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    if any(node.output[1:]):
        raise ctx.unsupported("the mean / inverse-std-dev outputs")
    op = "rms_norm" if node.op_type == "RMSNormalization" else "layer_norm"
    params = [v for v in ins[1:] if v is not None]
    return [ctx.one(op, [x, *params], {"axis": a.get("axis", -1) % x.type.rank, "eps": a.get("epsilon", 1e-5)})]


@converts("RotaryEmbedding")
def _rotary(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    vals = [v for v in ins if v is not None]
    return [ctx.one("rotary_embedding", vals, {"interleaved": bool(a.get("interleaved", 0)),
                                               "num_heads": a.get("num_heads", 0),
                                               "rotary_dim": a.get("rotary_embedding_dim", 0)})]


@converts("Attention")
def _attention(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    q, k, v = ins[0], ins[1], ins[2]
    assert q is not None and k is not None and v is not None
    mask = ins[3] if len(ins) > 3 else None
    if any(i is not None for i in ins[4:]) or any(node.output[1:]):
        raise ctx.unsupported("Attention with a KV cache (past/present) or qk_matmul_output")
    if a.get("softcap", 0.0):
        raise ctx.unsupported("Attention softcap")
    three_d = q.type.rank == 3
    if three_d:  # [b, s, heads*d] -> [b, heads, s, d]
        qh, kvh = a.get("q_num_heads", 0), a.get("kv_num_heads", 0)
        if not qh or not kvh:
            raise ctx.unsupported("3-D Attention without q_num_heads/kv_num_heads")

        def heads(x: Value, n: int) -> Value:
            b, s, hd = x.type.shape
            return ctx.one("transpose", [ctx.reshape(x, (b, s, n, hd // n))], {"perm": (0, 2, 1, 3)})

        q, k, v = heads(q, qh), heads(k, kvh), heads(v, kvh)
    gqa = q.type.shape[-3] != k.type.shape[-3]
    ops = [q, k, v] + ([mask] if mask is not None else [])
    y = ctx.one("sdpa", ops, {"scale": a.get("scale"), "causal": bool(a.get("is_causal", 0)), "gqa": gqa})
    if three_d:
        b, h, s, d = y.type.shape
        y = ctx.reshape(ctx.one("transpose", [y], {"perm": (0, 2, 1, 3)}), (b, s, h * d))
    return [y]
