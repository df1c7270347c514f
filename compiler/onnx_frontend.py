"""ONNX frontend: an `.onnx` file (opsets 11-25; below 17 upgraded first, compiler/onnx_opsets.py)
to npuc IR.

- The file is read without its external data: initializers stored beside it stay
  there as `OnnxTensorSource`s and are read one at a time when the `.om` is
  written, so a model larger than memory compiles.
- Model-local functions are inlined; ONNX shape inference runs with the user's
  static shapes and cross-checks every type npuc infers.
- Shape arithmetic from dynamic exports (`Shape -> Gather -> Concat -> Reshape`,
  `Range`, `ConstantOfShape`) is evaluated while importing: once every input
  shape is fixed those values are constants, and the ops that need them
  (Reshape, Expand, Slice, ...) read them as data.
- Every unsupported op is reported at once, with its domain and opset. Ops of
  other domains than ai.onnx are keyed "domain::OpType" (`com.microsoft::MatMulNBits`).
- Quantized weights (DequantizeLinear, MatMulNBits, int4 initializers) are converted
  into npuc's quantized layout by compiler/onnx_quant.py.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npuc.compiler.onnx_checks import check_graph, check_model, converting, external_data
from npuc.compiler.onnx_opsets import MAX_OPSET as MAX_OPSET  # re-exported: `npuc ops`, onnx_backend
from npuc.compiler.onnx_opsets import OLDEST, ai_onnx_opset, check_opset, domain_opset, to_native
from npuc.compiler.shapes import DeclaredInput
from npuc.compiler.weights import file_range_chunks
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, InternalError, NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, Value, distinct_outputs, get_op
from npuc.ir.evaluate import fold_node, foldable
from npuc.ir.ops import ShapeError, broadcast

MIN_OPSET = OLDEST  # read from here; below MIN_NATIVE through ONNX's version converter (onnx_opsets.py)
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
        ext = external_data(tensor, base_dir) if tensor.data_location == 1 else None  # refuses escapes
        self.location = os.path.relpath(ext.path, base_dir) if ext else None
        self.offset: int = ext.offset if ext else 0
        self.length: int | None = ext.length if ext else None
        self.in_memory = self.location is None  # inline initializers are already in the loaded proto

    def files(self) -> list[str]:
        return [os.path.join(self.base_dir, self.location)] if self.location else []

    def _external(self) -> tuple[str, int]:
        path = os.path.join(self.base_dir, self.location or "")
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if self.length is not None and self.length < nbytes:
            raise NpucError("NPUC-E0404", f"external data of {self.tensor.name!r} declares {self.length} bytes, "
                            f"its shape needs {nbytes}", "the model file is inconsistent", exit_code=EXIT_IO)
        return path, nbytes

    def file_range(self, want: TensorType) -> tuple[str, int, int] | None:
        """External bytes are already little-endian and contiguous: (path, offset, length)."""
        if self.location is None or want.dtype != self.dtype or want.shape != self.shape:
            return None
        path, nbytes = self._external()
        return path, self.offset, nbytes

    def load(self) -> torch.Tensor:
        np_dtype = _NP[self.dtype]
        if self.location is not None:
            path, nbytes = self._external()
            raw = bytearray()
            for chunk in file_range_chunks(path, self.offset, nbytes, f"external data of {self.tensor.name!r}"):
                raw += chunk
            t = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            t = t.view(self.dtype.torch).reshape(self.shape)
            return t
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
    written: int = 0  # the ai.onnx opset the file was written at (below `opset`: upgraded)


def load_onnx(path: str) -> OnnxModel:
    import onnx
    import onnx.inliner

    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise NpucError("NPUC-E0407", f"cannot read {path!r} as an ONNX model: {str(e).splitlines()[0]}",
                        "export it with torch.onnx.export or onnx.save", exit_code=EXIT_IO) from None
    check_model(proto, path)  # structure, tensor sizes, external data: before anything else reads it
    check_opset(proto, path)  # one npuc reads, before inlining or conversion run
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
        check_graph(proto.graph, ai_onnx_opset(proto))  # function bodies are checked as inlined
    proto, written = to_native(proto, path)
    opset = ai_onnx_opset(proto)
    if written != opset:
        check_graph(proto.graph, opset)  # what the version converter wrote
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
    model = OnnxModel(proto, path, opset, inputs, [path], written)
    base = os.path.dirname(os.path.abspath(path))
    for ext in (external_data(t, base) for t in proto.graph.initializer if t.data_location == 1):
        if ext.path not in model.files:
            model.files.append(ext.path)
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
    """The ai.onnx operators npuc converts (other domains' are keyed "domain::OpType")."""
    return sorted(k for k in CONVERTERS if "::" not in k)


def supported_elem_types() -> list[int]:
    """The ONNX TensorProto element types npuc represents."""
    return sorted(_DTYPES)


class _Ctx:
    def __init__(self, g: Graph, opset: int, past_elsewhere: bool = False) -> None:
        self.g = g
        self.opset = opset
        self.node: Any = None
        # The tokens run after earlier ones whose keys npuc's KV cache holds, not the graph's
        # (empty) past inputs: the decode program's trace (compiler/onnx_decode.py).
        self.past_elsewhere = past_elsewhere

    @property
    def where(self) -> str:
        n = self.node
        return f"{n.op_type} node {n.name or n.output[0]!r}" if n is not None else "the graph"

    def unsupported(self, what: str) -> NpucError:
        return NpucError("NPUC-E0304", f"{self.where}: {what} is not supported", "`npuc ops` lists what is (docs/ops.md)",
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
            try:
                return fold_node(self.g, node)
            except (IndexError, RuntimeError) as e:  # e.g. an index out of range at these shapes
                raise NpucError("NPUC-E0311", f"{self.where}: evaluating it at these shapes fails ({e})",
                                "the model is inconsistent at the shapes given; check --input_shape (an export "
                                "traced at batch 1 may run at batch 1 only)", exit_code=EXIT_USAGE) from None
        return node.outputs

    def one(self, op: str, inputs: Sequence[Value], attrs: dict[str, Any] | None = None,
            name: str | None = None) -> Value:
        return self.emit(op, inputs, attrs, name)[0]

    def const(self, data: Any, dtype: DType, name: str = "const") -> Value:
        t = torch.as_tensor(np.asarray(data), dtype=dtype.torch)
        return self.g.add_constant(name, TensorType(tuple(t.shape), dtype), TensorSource(t, "onnx"))

    def data(self, v: Value | None, what: str) -> Any:
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


def op_key(node: Any) -> str:
    """A node's key in CONVERTERS: its op type in ai.onnx, else "domain::op type"."""
    domain = node.domain or "ai.onnx"
    return node.op_type if domain == "ai.onnx" else f"{domain}::{node.op_type}"


def check_supported(model: OnnxModel) -> None:
    """Every operator npuc cannot convert, in one error (needs no input shapes)."""
    bad: Counter[str] = Counter()
    for n in model.proto.graph.node:
        if op_key(n) not in CONVERTERS:
            version = model.written if n.domain in ("", "ai.onnx") and model.written else \
                domain_opset(model.proto, n.domain)
            bad[f"{n.domain or 'ai.onnx'}::{n.op_type}" + (f" ({n.domain or 'ai.onnx'} opset {version})"
                                                           if version is not None else "")] += 1
    if bad:
        listing = ", ".join(f"{k} x{v}" for k, v in sorted(bad.items()))
        raise NpucError("NPUC-E0301", f"the model uses {len(bad)} operator(s) npuc does not support: {listing}",
                        "`npuc ops` lists the supported operators (docs/ops.md)", exit_code=EXIT_UNSUPPORTED)


def import_onnx(model: OnnxModel, shapes: dict[str, tuple[int, ...]],
                fixed: Mapping[str, torch.Tensor] | None = None, *, past_elsewhere: bool = False) -> Graph:
    """The model as npuc's IR at the static `shapes`. Inputs in `fixed` are constants of those
    values. An input may have a 0 dim (a past KV cache of length 0, fed empty as onnxruntime
    takes it: Concat drops it). `past_elsewhere`: see _Ctx."""
    proto = model.proto
    check_supported(model)
    fixed = dict(fixed or {})
    shapes = {**shapes, **{k: tuple(v.shape) for k, v in fixed.items()}}
    expected = _inferred_types(proto, shapes)
    g = Graph(proto.graph.name or "main")
    ctx = _Ctx(g, model.opset, past_elsewhere)
    env: dict[str, Value] = {}
    base = os.path.dirname(os.path.abspath(model.path))
    for t in proto.graph.initializer:
        src = onnx_quant.int4_source(t, base) or OnnxTensorSource(t, base)  # int4: widened, one value a byte
        env[t.name] = g.add_constant(t.name, TensorType(src.shape, src.dtype), src)
    for vi in proto.graph.input:
        if vi.name in env:
            continue
        dtype = onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        if vi.name in fixed:
            env[vi.name] = ctx.const(fixed[vi.name].to(dtype.torch), dtype, vi.name)
            continue
        env[vi.name] = g.add_input(vi.name, TensorType(shapes[vi.name], dtype))
    for node in proto.graph.node:
        ctx.node = node
        ins = [env[i] if i else None for i in node.input]  # check_graph: each is defined before
        with converting(ctx.where):
            outs = CONVERTERS[op_key(node)](ctx, node, ins, {a.name: _attr(a) for a in node.attribute})
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
        if v.name != o.name:
            _free_name(g, o.name)
        if v.name != o.name and o.name not in g._names:
            g.rename(v, o.name)
    g.set_outputs(outs)
    return g


def _free_name(g: Graph, name: str) -> None:
    """Move an intermediate off `name`, which a graph output must carry: converters name
    their helper values after the ONNX node's first output, so one may hold it already."""
    for v in g.values():
        if v.name == name and not v.is_input:
            g.rename(v, g.fresh_name(name))
            return


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
    del p.graph.value_info[:]  # what the file declares is no inference: compare only what ONNX infers
    for vi in [*p.graph.output, *(vi for vi in p.graph.input if vi.name in shapes)]:
        vi.type.tensor_type.ClearField("shape")
    for vi in p.graph.input:
        for d in shapes.get(vi.name, ()):
            vi.type.tensor_type.shape.dim.add().dim_value = d
    try:
        p = onnx.shape_inference.infer_shapes(p, strict_mode=True, data_prop=True)
    except Exception:  # a cross-check, not a requirement; strict: none for a model ONNX finds inconsistent
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
          "IsNaN": "is_nan", "Tan": "tan", "Sinh": "sinh", "Cosh": "cosh", "Asin": "asin", "Acos": "acos",
          "Atan": "atan", "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Softplus": "softplus",
          "Softsign": "softsign", "Mish": "mish", "HardSwish": "hardswish", "BitwiseNot": "bitwise_not"}


def _unary(op: str) -> OnnxConverter:
    def conv(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
        assert ins[0] is not None
        return [ctx.one(op, [ins[0]])]

    return conv


for _k, _v in _UNARY.items():
    CONVERTERS[_k] = _unary(_v)


# ONNX activation -> (npuc op, its attributes with ONNX's defaults).
_ACTIVATIONS: dict[str, tuple[str, dict[str, float]]] = {
    "Elu": ("elu", {"alpha": 1.0}), "Celu": ("celu", {"alpha": 1.0}),
    "Selu": ("selu", {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875}),
    "LeakyRelu": ("leaky_relu", {"alpha": 0.01}), "HardSigmoid": ("hard_sigmoid", {"alpha": 0.2, "beta": 0.5}),
    "ThresholdedRelu": ("thresholded_relu", {"alpha": 1.0}),
}


@converts(*_ACTIVATIONS)
def _activation(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    op, defaults = _ACTIVATIONS[node.op_type]
    return [ctx.one(op, [ins[0]], {k: float(a.get(k, d)) for k, d in defaults.items()})]


@converts("PRelu")
def _prelu(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, slope = ins[0], ins[1]
    assert x is not None and slope is not None
    neg = ctx.one("lt", [x, ctx.const(0, x.type.dtype)])
    return [ctx.one("where", [neg, ctx.one("mul", [x, slope]), x])]


@converts("IsInf")
def _is_inf(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    return [ctx.one("is_inf", [ins[0]], {"detect_negative": bool(a.get("detect_negative", 1)),
                                         "detect_positive": bool(a.get("detect_positive", 1))})]


@converts("Swish")
def _swish(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]  # opset 24: x * sigmoid(alpha * x)
    assert x is not None
    alpha = float(a.get("alpha", 1.0))
    if alpha == 1.0:
        return [ctx.one("silu", [x])]
    return [ctx.one("mul", [x, ctx.one("sigmoid", [ctx.one("mul", [x, ctx.const(alpha, x.type.dtype)])])])]


@converts("Gelu")
def _gelu(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None
    return [ctx.one("gelu", [ins[0]], {"approximate": a.get("approximate", "none")})]


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Max": "maximum", "Min": "minimum", "And": "bitwise_and",
           "Or": "bitwise_or", "Xor": "bitwise_xor", "Equal": "eq", "Less": "lt", "LessOrEqual": "le",
           "Greater": "gt", "GreaterOrEqual": "ge", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or",
           "BitwiseXor": "bitwise_xor"}


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


@converts("Mod")
def _mod(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.one("mod", [ins[0], ins[1]], {"fmod": bool(a.get("fmod", 0))})]


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
    return [onnx_quant.product(ctx, ins[0], ins[1])]  # a linear over a DequantizeLinear weight, else matmul


@converts("Gemm")
def _gemm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, w = ins[0], ins[1]
    assert x is not None and w is not None
    if a.get("transA", 0):
        x = ctx.one("transpose", [x], {"perm": (1, 0)})
    if a.get("transB", 0):  # transposing a DequantizeLinear weight [K, N] gives back its dequantize
        w = onnx_quant.dequantized_nk(w) or ctx.one("transpose", [w], {"perm": (1, 0)})
    y = onnx_quant.product(ctx, x, w)
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
    ax = a.get("axis", 1)
    ax = ax + x.type.rank if ax < 0 else ax  # axis is in [-r, r]: -1 keeps all but the last axis in front
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
    data, idx = ins[0], ins[1]
    assert data is not None and idx is not None
    if a.get("batch_dims", 0) == 0 and idx.type.rank >= 1 and idx.type.shape[-1] == 1:
        # Indices that address the leading axis alone: data[i], the `index` the torch frontend
        # gives aten.index, so that passes see one form (the exporter writes x[ids] this way,
        # e.g. a MoE's per-slot expert weights, behind a reshape that adds the trailing 1).
        src = idx.producer.inputs[0] if idx.producer is not None and idx.producer.op == "reshape" else idx
        return [ctx.one("index", [data, ctx.reshape(src, idx.type.shape[:-1])])]
    return [ctx.one("gather_nd", [data, idx], {"batch_dims": a.get("batch_dims", 0)})]


@converts("ScatterND")
def _scatter_nd(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert all(v is not None for v in ins[:3])
    return [ctx.one("scatter_nd", [v for v in ins[:3] if v is not None], {"reduction": a.get("reduction", "none")})]


@converts("GatherElements")
def _gather_elements(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None
    return [ctx.one("gather_elements", [ins[0], ins[1]], {"axis": a.get("axis", 0) % ins[0].type.rank})]


@converts("ScatterElements")
def _scatter_elements(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    assert ins[0] is not None and ins[1] is not None and ins[2] is not None
    return [ctx.one("scatter_elements", [ins[0], ins[1], ins[2]],
                    {"axis": a.get("axis", 0) % ins[0].type.rank, "reduction": a.get("reduction", "none")})]


@converts("Tile")
def _tile(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """[d0, d1] tiled [r0, r1] = [1, d0, 1, d1] expanded to [r0, d0, r1, d1], reshaped to [r0*d0, r1*d1]."""
    x = ins[0]
    assert x is not None
    reps = [int(r) for r in ctx.data(ins[1], "repeats")]
    s = x.type.shape
    if len(reps) != len(s):
        raise NpucError("NPUC-E0311", f"{ctx.where}: {len(reps)} repeats for a rank-{len(s)} input",
                        "the model is inconsistent at the shapes given; check --input_shape", exit_code=EXIT_USAGE)
    if all(r == 1 for r in reps):
        return [x]
    spread = ctx.reshape(x, [d for dim in s for d in (1, dim)])
    y = ctx.one("expand", [spread], {"shape": tuple(d for r, dim in zip(reps, s, strict=True) for d in (r, dim))})
    return [ctx.reshape(y, [r * dim for r, dim in zip(reps, s, strict=True)])]


@converts("Pad")
def _pad(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    r = x.type.rank
    raw = list(a["pads"]) if "pads" in a else [int(p) for p in ctx.data(ins[1], "pads")]
    axes = [int(v) for v in ctx.data(ins[3], "axes")] if len(ins) > 3 and ins[3] is not None else list(range(r))
    pads = [0] * (2 * r)
    for i, ax in enumerate(axes):  # ONNX lists begins then ends, for the given axes only
        pads[ax % r], pads[ax % r + r] = int(raw[i]), int(raw[i + len(axes)])
    if not any(pads):
        return [x]
    mode = a.get("mode", "constant")
    value = ins[2] if mode == "constant" and len(ins) > 2 and ins[2] is not None else None
    return [ctx.one("pad", [x] if value is None else [x, value], {"pads": tuple(pads), "mode": mode})]


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


@converts("TopK")
def _topk(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    k = ctx.data(ins[1], "k")
    k = int(k[0] if isinstance(k, list) else k)
    # sorted=0 leaves the order to the backend: npuc always returns it sorted.
    return ctx.emit("topk", [x], {"k": k, "axis": a.get("axis", -1) % x.type.rank,
                                  "largest": bool(a.get("largest", 1))})


@converts("Dropout")
def _dropout(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """Inference: the identity, and an all-true mask. Training with a non-zero ratio is random."""
    x = ins[0]
    assert x is not None
    if len(ins) > 2 and ins[2] is not None and ctx.data(ins[2], "training_mode"):
        ratio = ctx.data(ins[1], "ratio") if len(ins) > 1 and ins[1] is not None else a.get("ratio", 0.5)
        if ratio:
            raise ctx.unsupported("Dropout in training mode")
    mask = None
    if len(node.output) > 1 and node.output[1]:
        mask = ctx.one("full", [], {"shape": x.type.shape, "value": 1.0, "dtype": DType.bool},
                       name=node.output[1])
    return [x, mask]


@converts("Einsum")
def _einsum(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    vals = [v for v in ins if v is not None]
    return [ctx.one("einsum", vals, {"equation": a["equation"].replace(" ", "")})]


@converts("Softmax", "LogSoftmax")
def _softmax(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    op = "log_softmax" if node.op_type == "LogSoftmax" else "softmax"
    return [ctx.one(op, [x], {"axis": a.get("axis", -1) % x.type.rank})]


_REDUCE = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max",
           "ReduceMin": "reduce_min", "ReduceProd": "reduce_prod"}


def _reduce_attrs(ctx: _Ctx, x: Value, ins: list[Value | None], a: dict[str, Any]) -> dict[str, Any] | None:
    """An ONNX Reduce* node's npuc attributes, or None when it reduces over no axis."""
    axes = _axes(ctx, ins, a, 1)
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(x.type.rank))
    if x.type.rank == 0:
        return None
    return {"axes": tuple(sorted({ax % x.type.rank for ax in axes})), "keepdim": bool(a.get("keepdims", 1))}


def _reduce(op: str) -> OnnxConverter:
    def conv(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
        x = ins[0]
        assert x is not None
        r = _reduce_attrs(ctx, x, ins, a)
        return [x if r is None else ctx.one(op, [x], r)]

    return conv


for _k, _v in _REDUCE.items():
    CONVERTERS[_k] = _reduce(_v)


@converts("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")
def _reduce_composite(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """A sum between elementwise steps; with no axis to reduce only the elementwise steps remain."""
    x = ins[0]
    assert x is not None
    r = _reduce_attrs(ctx, x, ins, a)

    def total(v: Value) -> Value:
        return v if r is None else ctx.one("reduce_sum", [v], r)

    t = node.op_type
    if t == "ReduceL1":
        return [total(ctx.one("abs", [x]))]
    if t == "ReduceSumSquare":
        return [total(ctx.one("mul", [x, x]))]
    if t == "ReduceL2":  # integers: the root in f64, truncated back
        xf = x if x.type.dtype.is_float else ctx.cast(x, DType.f64)
        return [ctx.cast(ctx.one("sqrt", [total(ctx.one("mul", [xf, xf]))]), x.type.dtype)]
    if t == "ReduceLogSum":
        return [ctx.one("log", [total(x)])]
    if r is None or any(x.type.shape[ax] == 0 for ax in r["axes"]):  # log(sum(exp(empty))) = -inf
        return [ctx.one("log", [total(ctx.one("exp", [x]))])]
    # log(sum(exp(x - m))) + m, m the finite max, so that exp does not overflow
    m = ctx.one("reduce_max", [x], {"axes": r["axes"], "keepdim": True})
    m = ctx.one("where", [ctx.one("is_inf", [m]), ctx.const(0.0, x.type.dtype), m])
    y = ctx.one("log", [ctx.one("reduce_sum", [ctx.one("exp", [ctx.one("sub", [x, m])])], r)])
    return [ctx.one("add", [y, m if r["keepdim"] else ctx.reshape(m, y.type.shape)])]


@converts("ArgMax", "ArgMin")
def _arg(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    return [ctx.one(node.op_type.lower(), [x], {"axis": a.get("axis", 0) % x.type.rank,
                                                 "keepdim": bool(a.get("keepdims", 1)),
                                                 "select_last": bool(a.get("select_last_index", 0))})]


# The transformer ops (norms, RoPE, Attention) and quantized weights (DequantizeLinear,
# com.microsoft::MatMulNBits) register their converters here.
from npuc.compiler import onnx_llm_ops, onnx_quant  # noqa: E402, F401  (registration)
