"""`npuc export-onnx`: the optimised graph of a `.om` as an ONNX model, to look at in Netron.

    $ npuc export-onnx build/llama.om build/llama.onnx                   # the first program
    $ npuc export-onnx build/lm.om build/decode.onnx --program decode    # a KV-cache model's decode step

What the file holds, for one program of the `.om` (the first by default):

- One node per npuc op, in schedule order, named as the op is in `npuc dump`;
  every value is named as its `.om` tensor, and has a value_info with its dtype
  and static shape. Each node's doc_string gives the npuc op, its execution unit,
  FLOPs and bytes.
- An op that one standard ONNX op (opset 18) computes exactly becomes that op:
  `add` -> Add, `reshape` -> Reshape, `linear` on a 2-D input -> Gemm, ... The
  ONNX inputs npuc keeps as attributes (a Reshape's shape, a Slice's starts, a
  reduction's axes) are small int64 initializers named `<node>.<input>`. Every
  other op (the fused ones: `rms_norm`, `swiglu`, `rope_lut`, `fused_attention`,
  `cached_attention`, `kv_write`, a 3-D `linear` with its weight stored [out, in],
  ...) is a node of the custom domain `npuc` (version 1) with npuc's inputs in
  npuc's order and npuc's attributes, schema defaults filled in: int and bool
  (0/1) as INT, float as FLOAT (32-bit), str as STRING, dtype as STRING (`f32`,
  `bf16`, ...), ints and floats as INTS and FLOATS; an unset optional attribute
  (sdpa's scale) is left out. `MAPPING` lists what maps where; an op whose
  operand dtypes ONNX does not take there (bool Add, bf16 Sin) stays npuc.
- Weights are initializers holding the `.om`'s bytes unchanged (a `linear`
  weight stays in its stored layout). Above 1.5 GiB of weights (or with
  `weights="external"`) they go to `<out>.data` beside the model as ONNX
  external data, each tensor of 1 KiB or more at a 4 KiB-aligned offset.
- A KV-cache program is stateful in npuc (`kv_write` updates the cache in
  place); here it is a pure function: each state (`kv_cache.0.k`, ...) is a graph
  input after the program's own inputs, and its value after the program is a
  graph output `<state>.out` (an Identity of the last `kv_write` result, the
  only nodes that are not npuc ops). To step a decode loop, feed each
  `<state>.out` back as `<state>`; the caches start as zeros.
- The `.om`'s metadata (compiler, target, options, source hash) are the model's
  metadata_props, with `npuc.program` and `npuc.programs` added.

A graph with only standard nodes runs in onnxruntime and matches `npuc run`;
one with `npuc` nodes opens in Netron and passes `onnx.checker`, but runs only
where those ops are implemented. The same `.om` always gives the same bytes.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

import npuc
from npuc.errors import EXIT_IO, EXIT_USAGE, InternalError, NpucError
from npuc.ir import DType, get_op
from npuc.runtime.om_validate import attr_value, check_tensors
from npuc.tools.om_tools import _open

__all__ = ["DOMAIN", "MAPPING", "OPSET", "ExportSummary", "export_onnx", "onnx_model"]

OPSET = 18
IR_VERSION = 8  # the IR version of opset 18
DOMAIN = "npuc"
DOMAIN_VERSION = 1
AUTO_EXTERNAL_BYTES = 3 * 2**29  # 1.5 GiB: above this, weights="auto" writes external data
_PROTO_LIMIT = 2**31 - 2**24  # a protobuf message stops at 2 GiB; leave room for the graph
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay in the model file
EXTERNAL_ALIGN = 4096

E_PROGRAM = "NPUC-E0111"
E_WRITE = "NPUC-E0406"
E_BAD = "NPUC-E0405"

_ONNX_DTYPE = {
    DType.f64: TensorProto.DOUBLE, DType.f32: TensorProto.FLOAT, DType.f16: TensorProto.FLOAT16,
    DType.bf16: TensorProto.BFLOAT16, DType.i64: TensorProto.INT64, DType.i32: TensorProto.INT32,
    DType.i16: TensorProto.INT16, DType.i8: TensorProto.INT8, DType.u8: TensorProto.UINT8,
    DType.bool: TensorProto.BOOL,
}
_NP_DTYPE = {DType.f64: np.float64, DType.f32: np.float32, DType.f16: np.float16, DType.i64: np.int64,
             DType.i32: np.int32, DType.i16: np.int16, DType.i8: np.int8, DType.u8: np.uint8, DType.bool: np.bool_}


@dataclass(frozen=True)
class ExportSummary:
    """What `export_onnx` wrote."""

    path: str
    data_path: str | None  # the external data file, or None when the weights are in the model
    program: str
    programs: tuple[str, ...]  # every program of the .om
    nodes: int
    standard_nodes: int  # ONNX-domain nodes (state Identity nodes included)
    custom_nodes: int  # `npuc`-domain nodes
    custom_ops: tuple[str, ...]  # their op types, sorted
    initializers: int  # weights, plus the int64 operands of standard nodes
    weights: int  # initializers that are .om weights
    weights_bytes: int
    inputs: tuple[str, ...]  # the graph's: the program's inputs, then the states
    outputs: tuple[str, ...]  # the graph's: the program's outputs, then <state>.out for each state
    states: tuple[str, ...]

    def render(self) -> str:
        where = f" + {self.data_path}" if self.data_path else ""
        custom = f" ({', '.join(self.custom_ops)})" if self.custom_ops else ""
        others = [p for p in self.programs if p != self.program]
        more = f"; other programs: {', '.join(others)} (--program)" if others else ""
        return (f"wrote {self.path}{where}: program {self.program}, {self.nodes} nodes "
                f"({self.standard_nodes} ONNX opset {OPSET}, {self.custom_nodes} {DOMAIN}{custom}), "
                f"{self.weights} weights ({self.weights_bytes:,} B), "
                f"inputs {', '.join(self.inputs[:len(self.inputs) - len(self.states)])}, "
                f"outputs {', '.join(self.outputs[:len(self.outputs) - len(self.states)])}"
                + (f", {len(self.states)} states (<state> in, <state>.out out)" if self.states else "") + more)


# --- op mapping ----------------------------------------------------------------------

_FLOAT3 = frozenset({DType.f16, DType.f32, DType.f64})
_FLOAT = _FLOAT3 | {DType.bf16}
_SIGNED = frozenset({DType.i8, DType.i16, DType.i32, DType.i64})
_INT = _SIGNED | {DType.u8}
_NUM = _FLOAT | _INT
_ANY = frozenset(DType)
_MATH = _FLOAT | {DType.i32, DType.i64}  # MatMul, Gemm, ReduceSum, ReduceProd, CumSum, Pow


@dataclass
class _Op:
    """One npuc op on its way to an ONNX node."""

    name: str
    op: str
    inputs: list[str]  # ONNX value names
    in_types: list[tuple[DType, tuple[int, ...]]]
    attrs: dict[str, Any]  # with the schema's defaults
    consts: list[TensorProto] = field(default_factory=list)  # operands the standard form adds
    _new_name: Callable[[str], str] = lambda s: s

    def dtype(self, i: int = 0) -> DType:
        return self.in_types[i][0]

    def shape(self, i: int = 0) -> tuple[int, ...]:
        return self.in_types[i][1]

    def const(self, label: str, value: Any, dtype: Any = np.int64) -> str:
        """An initializer `<node>.<label>` holding `value`; returns its name."""
        name = self._new_name(f"{self.name}.{label}")
        self.consts.append(onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name


_Std = tuple[str, list[str], dict[str, Any]]  # ONNX op type, inputs, attributes
_Rule = Callable[[_Op], _Std | None]


def _plain(onnx_op: str, dtypes: frozenset[DType] = _ANY, attrs: Callable[[Mapping[str, Any]], dict[str, Any]]
           = lambda a: {}, operand: int = 0) -> _Rule:
    """The same inputs, attributes renamed; only when operand `operand` has a dtype ONNX takes."""
    def rule(o: _Op) -> _Std | None:
        return (onnx_op, o.inputs, attrs(o.attrs)) if o.dtype(operand) in dtypes else None
    return rule


def _by_dtype(rules: Mapping[frozenset[DType], _Rule]) -> _Rule:
    def rule(o: _Op) -> _Std | None:
        for dts, r in rules.items():
            if o.dtype() in dts:
                return r(o)
        return None
    return rule


def _reduce(onnx_op: str, dtypes: frozenset[DType]) -> _Rule:
    def rule(o: _Op) -> _Std | None:
        if o.dtype() not in dtypes:
            return None
        return onnx_op, [o.inputs[0], o.const("axes", list(o.attrs["axes"]))], {"keepdims": int(o.attrs["keepdim"])}
    return rule


def _reshape(o: _Op) -> _Std:
    shape = list(o.attrs["shape"])
    return "Reshape", [o.inputs[0], o.const("shape", shape)], {"allowzero": 1} if 0 in shape else {}


def _slice(o: _Op) -> _Std:
    a = o.attrs
    return "Slice", [o.inputs[0], o.const("starts", [a["start"]]), o.const("ends", [a["end"]]),
                     o.const("axes", [a["axis"]]), o.const("steps", [a["step"]])], {}


def _index(o: _Op) -> _Std | None:
    return ("Gather", o.inputs, {"axis": 0}) if len(o.inputs) == 2 else None  # x[i]: a Gather; x[i, j]: not one op


def _mod(o: _Op) -> _Std | None:
    # ONNX Mod with fmod=0 is integer-only; a float remainder with the divisor's sign is not one op.
    if o.dtype() not in _NUM or (o.dtype().is_float and not o.attrs["fmod"]):
        return None
    return "Mod", o.inputs, {"fmod": int(o.attrs["fmod"])}


def _pad(o: _Op) -> _Std | None:
    if o.attrs["mode"] not in ("constant", "reflect", "edge"):  # wrap is opset 19
        return None
    if len(o.inputs) > 1 and math.prod(o.shape(1)) != 1:
        return None
    return "Pad", [o.inputs[0], o.const("pads", list(o.attrs["pads"])), *o.inputs[1:]], {"mode": o.attrs["mode"]}


def _arange(o: _Op) -> _Std | None:
    a, dt = o.attrs, o.attrs["dtype"]
    if dt not in (DType.f32, DType.f64, DType.i16, DType.i32, DType.i64):
        return None
    vals = (a["start"], a["end"], a["step"])
    if not dt.is_float and any(float(v) != int(v) for v in vals):
        return None
    npt = _NP_DTYPE[dt]
    return "Range", [o.const("start", vals[0], npt), o.const("limit", vals[1], npt),
                     o.const("delta", vals[2], npt)], {}


def _full(o: _Op) -> _Std | None:
    dt = o.attrs["dtype"]
    if dt not in _NP_DTYPE:  # ConstantOfShape takes bf16 from opset 20
        return None
    value = onnx.numpy_helper.from_array(np.array([o.attrs["value"]]).astype(_NP_DTYPE[dt]), "value")
    return "ConstantOfShape", [o.const("shape", list(o.attrs["shape"]))], {"value": value}


def _linear(o: _Op) -> _Std | None:
    """x @ W (+ bias) with W as stored: Gemm for a 2-D x, MatMul for a bias-free [in, out] W;
    a 3-D x with an [out, in] W is no single ONNX op without transposing the weight."""
    if o.dtype() not in _MATH:
        return None
    nk = o.attrs["weight_layout"] == "nk"
    if len(o.shape()) == 2:
        return "Gemm", o.inputs, {"transB": 1} if nk else {}
    if not nk and len(o.inputs) == 2:
        return "MatMul", o.inputs, {}
    return None


def _layer_norm(o: _Op) -> _Std | None:
    x = o.shape()
    normalised = x[o.attrs["axis"] % max(len(x), 1):]
    if o.dtype() not in _FLOAT or any(s != normalised for _, s in o.in_types[1:]):
        return None
    return "LayerNormalization", o.inputs, {"axis": o.attrs["axis"], "epsilon": o.attrs["eps"]}


def _topk(o: _Op) -> _Std | None:
    if o.dtype() not in _NUM - {DType.bf16}:
        return None
    return "TopK", [o.inputs[0], o.const("k", [o.attrs["k"]])], \
        {"axis": o.attrs["axis"], "largest": int(o.attrs["largest"]), "sorted": 1}


def _attrs(**names: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """npuc attribute -> ONNX attribute, bools as ints."""
    return lambda a: {onnx_name: int(a[k]) if isinstance(a[k], bool) else a[k] for onnx_name, k in names.items()}


_UNARY: dict[str, tuple[str, frozenset[DType]]] = {
    "sqrt": ("Sqrt", _FLOAT), "exp": ("Exp", _FLOAT), "log": ("Log", _FLOAT), "tanh": ("Tanh", _FLOAT),
    "sigmoid": ("Sigmoid", _FLOAT), "reciprocal": ("Reciprocal", _FLOAT), "erf": ("Erf", _FLOAT),
    "floor": ("Floor", _FLOAT), "ceil": ("Ceil", _FLOAT), "round": ("Round", _FLOAT3),
    "cos": ("Cos", _FLOAT3), "sin": ("Sin", _FLOAT3), "tan": ("Tan", _FLOAT3), "asin": ("Asin", _FLOAT3),
    "acos": ("Acos", _FLOAT3), "atan": ("Atan", _FLOAT3), "sinh": ("Sinh", _FLOAT3), "cosh": ("Cosh", _FLOAT3),
    "asinh": ("Asinh", _FLOAT3), "acosh": ("Acosh", _FLOAT3), "atanh": ("Atanh", _FLOAT3),
    "softplus": ("Softplus", _FLOAT3), "softsign": ("Softsign", _FLOAT3), "mish": ("Mish", _FLOAT3),
    "hardswish": ("HardSwish", _FLOAT3), "neg": ("Neg", _FLOAT | _SIGNED), "relu": ("Relu", _FLOAT | _SIGNED),
    "abs": ("Abs", _NUM), "sign": ("Sign", _NUM), "is_nan": ("IsNaN", _FLOAT),
}
_BINARY: dict[str, tuple[str, frozenset[DType]]] = {
    "add": ("Add", _NUM), "sub": ("Sub", _NUM), "mul": ("Mul", _NUM), "div": ("Div", _NUM),
    "pow": ("Pow", _MATH), "maximum": ("Max", _NUM), "minimum": ("Min", _NUM), "matmul": ("MatMul", _MATH),
    "eq": ("Equal", _NUM | {DType.bool}), "lt": ("Less", _NUM), "le": ("LessOrEqual", _NUM),
    "gt": ("Greater", _NUM), "ge": ("GreaterOrEqual", _NUM),
}

_RULES: dict[str, _Rule] = {
    **{k: _plain(v, d) for k, (v, d) in _UNARY.items()},
    **{k: _plain(v, d) for k, (v, d) in _BINARY.items()},
    "elu": _plain("Elu", _FLOAT3, _attrs(alpha="alpha")),
    "celu": _plain("Celu", frozenset({DType.f32}), _attrs(alpha="alpha")),
    "selu": _plain("Selu", _FLOAT3, _attrs(alpha="alpha", gamma="gamma")),
    "leaky_relu": _plain("LeakyRelu", _FLOAT, _attrs(alpha="alpha")),
    "hard_sigmoid": _plain("HardSigmoid", _FLOAT3, _attrs(alpha="alpha", beta="beta")),
    "thresholded_relu": _plain("ThresholdedRelu", _FLOAT3, _attrs(alpha="alpha")),
    "is_inf": _plain("IsInf", frozenset({DType.f32, DType.f64}),
                     _attrs(detect_negative="detect_negative", detect_positive="detect_positive")),
    "logical_not": _plain("Not", frozenset({DType.bool})),
    "bitwise_not": _by_dtype({frozenset({DType.bool}): _plain("Not"), _INT: _plain("BitwiseNot")}),
    **{f"bitwise_{k}": _by_dtype({frozenset({DType.bool}): _plain(k.capitalize()),
                                  _INT: _plain(f"Bitwise{k.capitalize()}")}) for k in ("and", "or", "xor")},
    "cast": lambda o: ("Cast", o.inputs, {"to": _ONNX_DTYPE[o.attrs["dtype"]]}),
    "where": _plain("Where", operand=1),
    "mod": _mod,
    "reduce_mean": _reduce("ReduceMean", _FLOAT),
    "reduce_sum": _reduce("ReduceSum", _MATH),
    "reduce_max": _reduce("ReduceMax", _FLOAT | {DType.i8, DType.u8, DType.i32, DType.i64}),
    "reduce_min": _reduce("ReduceMin", _FLOAT | {DType.i8, DType.u8, DType.i32, DType.i64}),
    "reduce_prod": _reduce("ReduceProd", _MATH),
    "cumsum": lambda o: ("CumSum", [o.inputs[0], o.const("axis", o.attrs["axis"])],
                         {"exclusive": int(o.attrs["exclusive"]), "reverse": int(o.attrs["reverse"])})
    if o.dtype() in _MATH else None,
    "softmax": _plain("Softmax", _FLOAT, _attrs(axis="axis")),
    "log_softmax": _plain("LogSoftmax", _FLOAT, _attrs(axis="axis")),
    "reshape": _reshape,
    "transpose": lambda o: ("Transpose", o.inputs, {"perm": list(o.attrs["perm"])}),
    "expand": lambda o: ("Expand", [o.inputs[0], o.const("shape", list(o.attrs["shape"]))], {}),
    "slice": _slice,
    "concat": _plain("Concat", attrs=_attrs(axis="axis")),
    "split": lambda o: ("Split", [o.inputs[0], o.const("split", list(o.attrs["sizes"]))], {"axis": o.attrs["axis"]}),
    "gather": _plain("Gather", attrs=_attrs(axis="axis")),
    "index": _index,
    "gather_nd": _plain("GatherND", attrs=_attrs(batch_dims="batch_dims")),
    "gather_elements": _plain("GatherElements", attrs=_attrs(axis="axis")),
    "scatter_nd": _plain("ScatterND", attrs=_attrs(reduction="reduction")),
    "scatter_elements": _plain("ScatterElements", attrs=_attrs(axis="axis", reduction="reduction")),
    "pad": _pad,
    "trilu": lambda o: ("Trilu", [o.inputs[0], o.const("k", o.attrs["k"])], {"upper": int(o.attrs["upper"])}),
    "argmax": _plain("ArgMax", _NUM, _attrs(axis="axis", keepdims="keepdim", select_last_index="select_last")),
    "argmin": _plain("ArgMin", _NUM, _attrs(axis="axis", keepdims="keepdim", select_last_index="select_last")),
    "topk": _topk,
    "arange": _arange,
    "full": _full,
    "linear": _linear,
    "einsum": _plain("Einsum", _NUM - {DType.bf16}, _attrs(equation="equation")),
    "layer_norm": _layer_norm,
}

# npuc op -> the ONNX op it becomes when its rule takes the operands (else it is npuc.<op>).
MAPPING: dict[str, str] = {
    **{k: v for k, (v, _) in _UNARY.items()}, **{k: v for k, (v, _) in _BINARY.items()},
    "elu": "Elu", "celu": "Celu", "selu": "Selu", "leaky_relu": "LeakyRelu", "hard_sigmoid": "HardSigmoid",
    "thresholded_relu": "ThresholdedRelu", "is_inf": "IsInf", "logical_not": "Not", "bitwise_not": "Not|BitwiseNot",
    "bitwise_and": "And|BitwiseAnd", "bitwise_or": "Or|BitwiseOr", "bitwise_xor": "Xor|BitwiseXor", "cast": "Cast",
    "where": "Where", "mod": "Mod", "reduce_mean": "ReduceMean", "reduce_sum": "ReduceSum",
    "reduce_max": "ReduceMax", "reduce_min": "ReduceMin", "reduce_prod": "ReduceProd", "cumsum": "CumSum",
    "softmax": "Softmax", "log_softmax": "LogSoftmax", "reshape": "Reshape", "transpose": "Transpose",
    "expand": "Expand", "slice": "Slice", "concat": "Concat", "split": "Split", "gather": "Gather",
    "index": "Gather", "gather_nd": "GatherND", "gather_elements": "GatherElements", "scatter_nd": "ScatterND",
    "scatter_elements": "ScatterElements", "pad": "Pad", "trilu": "Trilu", "argmax": "ArgMax", "argmin": "ArgMin",
    "topk": "TopK", "arange": "Range", "full": "ConstantOfShape", "linear": "Gemm|MatMul", "einsum": "Einsum",
    "layer_norm": "LayerNormalization",
}


# --- attributes of npuc-domain nodes ---------------------------------------------------

def _custom_attr(name: str, kind: str | None, v: Any) -> AttributeProto | None:
    """An npuc attribute as an ONNX one; `kind` is the schema's (None: an op this npuc does not know)."""
    if v is None:
        return None
    if kind is None:
        kind = ("bool" if isinstance(v, bool) else "dtype" if isinstance(v, DType) else "int" if isinstance(v, int)
                else "float" if isinstance(v, float) else "str" if isinstance(v, str)
                else "floats" if any(isinstance(x, float) for x in v) else "ints")
    if kind in ("int", "bool"):
        return helper.make_attribute(name, int(v), attr_type=AttributeProto.INT)
    if kind == "float":
        return helper.make_attribute(name, float(v), attr_type=AttributeProto.FLOAT)
    if kind in ("str", "dtype"):
        return helper.make_attribute(name, str(v), attr_type=AttributeProto.STRING)
    if kind == "ints":
        return helper.make_attribute(name, [int(x) for x in v], attr_type=AttributeProto.INTS)
    if kind == "floats":
        return helper.make_attribute(name, [float(x) for x in v], attr_type=AttributeProto.FLOATS)
    raise InternalError(f"attribute {name} of kind {kind}")


# --- the exporter ----------------------------------------------------------------------------


def _value_info(name: str, dtype: DType, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ONNX_DTYPE[dtype], list(shape))


class _Graph:
    """Builds the ONNX graph of one program (weights not yet attached)."""

    def __init__(self, m: Any, prog: Any, om_path: str) -> None:
        self.m, self.prog, self.path = m, prog, om_path
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[TensorProto] = []
        self.weights: list[int] = []  # tensor ids of the weights used, in first-use order
        self.custom: set[str] = set()
        self.states: list[int] = []  # the state tensors, as graph inputs
        used = [*prog.inputs, *prog.outputs, *(i for o in prog.ops for i in [*o.inputs, *o.outputs])]
        counts: dict[str, int] = {}
        for tid in dict.fromkeys(used):
            counts[m.tensors[tid].name] = counts.get(m.tensors[tid].name, 0) + 1
        # Names are the .om's; only a name two tensors of this program share gets its index appended.
        self.names = {tid: m.tensors[tid].name + (f"#{tid}" if counts[m.tensors[tid].name] > 1 else "")
                      for tid in dict.fromkeys(used)}
        self.taken = set(self.names.values())

    def new_name(self, want: str) -> str:
        name, n = want, 0
        while name in self.taken:
            n += 1
            name = f"{want}_{n}"
        self.taken.add(name)
        return name

    def _bad(self, what: str) -> NpucError:
        return NpucError(E_BAD, f"{self.path}: program {self.prog.name!r}: {what}",
                         "the file is damaged or was written by another npuc; recompile the model", exit_code=EXIT_IO)

    def build(self) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
        m, prog = self.m, self.prog
        t = m.tensors
        defined: set[int] = set()
        inputs = []
        for tid in prog.inputs:
            if t[tid].region != "arena":
                raise self._bad(f"input {t[tid].name!r} is in the {t[tid].region} region")
            inputs.append(tid)
            defined.add(tid)
        states: list[int] = []  # state tensors (the buffers), in tensor order below
        last: dict[int, int] = {}  # state -> the value holding it now
        value_infos: list[int] = []
        for step, o in enumerate(prog.ops):
            for i in o.inputs:
                if i in defined:
                    continue
                if t[i].region == "weights":
                    defined.add(i)
                    self.weights.append(i)
                elif t[i].region == "state" and not t[i].HasField("base"):
                    defined.add(i)
                    states.append(i)
                    last.setdefault(i, i)
                else:
                    raise self._bad(f"op {o.name!r} reads {t[i].name!r} before anything writes it")
            for i in o.outputs:
                if i in defined or t[i].region == "weights":
                    raise self._bad(f"op {o.name!r} writes {t[i].name!r}, which already has a value")
                defined.add(i)
                value_infos.append(i)
                if t[i].region == "state":
                    root = t[i].base if t[i].HasField("base") else i
                    if root not in last:
                        states.append(root)
                    last[root] = i
            self.nodes.append(self._node(step, o))
        for tid in prog.outputs:
            if tid not in defined:
                if t[tid].region != "weights":
                    raise self._bad(f"output {t[tid].name!r} is never written")
                self.weights.append(tid)
                defined.add(tid)
        states = sorted(dict.fromkeys(states))
        self.states = states
        for s in states:  # a state some op writes before reading is still an input: the rows it keeps
            if s not in self.names:
                self.names[s] = self.new_name(t[s].name)
        outs = [self.names[i] for i in prog.outputs]
        state_outs = []
        for s in states:
            out = self.new_name(f"{t[s].name}.out")
            self.nodes.append(helper.make_node("Identity", [self.names[last[s]]], [out], name=out,
                                               doc_string=f"the state {t[s].name} after this program"))
            state_outs.append((out, s))
        g_in = [_value_info(self.names[i], DType(t[i].dtype), t[i].shape) for i in [*inputs, *states]]
        g_out = [_value_info(n, DType(t[i].dtype), t[i].shape) for n, i in zip(outs, prog.outputs, strict=True)]
        g_out += [_value_info(n, DType(t[s].dtype), t[s].shape) for n, s in state_outs]
        out_ids = set(prog.outputs)
        vis = [_value_info(self.names[i], DType(t[i].dtype), t[i].shape) for i in value_infos if i not in out_ids]
        return g_in, g_out, vis

    def _node(self, step: int, o: Any) -> onnx.NodeProto:
        t = self.m.tensors
        name = o.name or f"{o.op}_{step}"
        raw = {a.name: attr_value(a.value) for a in o.attrs}
        try:
            od = get_op(o.op)
        except InternalError:
            od = None  # an op this npuc does not know: exported as it stands
        attrs = od.full_attrs(raw) if od is not None else raw
        ins = [self.names[i] for i in o.inputs]
        outs = [self.names[i] for i in o.outputs]
        doc = f"npuc {o.op} on the {o.unit or 'unknown'} unit: {o.flops:,} FLOPs, {o.bytes:,} bytes"
        if o.HasField("workspace"):
            doc += f", {t[o.workspace].nbytes:,} bytes of workspace"
        rule = _RULES.get(o.op) if od is not None else None
        if rule is not None:
            op = _Op(name, o.op, ins, [(DType(t[i].dtype), tuple(t[i].shape)) for i in o.inputs], attrs,
                     _new_name=self.new_name)
            std = rule(op)
            if std is not None:
                op_type, std_ins, std_attrs = std
                self.consts += op.consts
                return helper.make_node(op_type, std_ins, outs, name=name, doc_string=doc,
                                        **{k: v for k, v in sorted(std_attrs.items())})
            for c in op.consts:  # a rule that declined gave its names back
                self.taken.discard(c.name)
        self.custom.add(o.op)
        node = helper.make_node(o.op, ins, outs, name=name, domain=DOMAIN, doc_string=doc)
        for k in sorted(attrs):
            a = _custom_attr(k, od.attrs[k].kind if od is not None and k in od.attrs else None, attrs[k])
            if a is not None:
                node.attribute.append(a)
        return node


def _select(m: Any, program: str | None) -> Any:
    names = [p.name for p in m.programs]
    if program is None:
        return m.programs[0]
    if program not in names:
        raise NpucError(E_PROGRAM, f"the model has no program {program!r}", "its programs are " + ", ".join(names),
                        exit_code=EXIT_USAGE)
    return m.programs[names.index(program)]


def _assemble(m: Any, g: _Graph, built: tuple[list[Any], list[Any], list[Any]], weights: memoryview,
              external: Mapping[int, tuple[int, int]], location: str) -> onnx.ModelProto:
    """The model: the graph `g` built, with each weight embedded, or in the data file
    `location` at `external[tensor id]` = (offset, length)."""
    g_in, g_out, vis = built
    inits = []
    for tid in g.weights:
        t = m.tensors[tid]
        tp = TensorProto(name=g.names[tid], data_type=_ONNX_DTYPE[DType(t.dtype)], dims=list(t.shape))
        if tid in external:
            offset, length = external[tid]
            tp.data_location = TensorProto.EXTERNAL  # as onnx.external_data_helper writes it, without the bytes
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                tp.external_data.add(key=k, value=v)
        else:
            tp.raw_data = bytes(weights[t.offset:t.offset + t.nbytes])
        inits.append(tp)
    prog = g.prog
    graph = helper.make_graph(g.nodes, prog.name, g_in, g_out, initializer=inits + g.consts, value_info=vis,
                              doc_string=f"program {prog.name} of an npuc .om (target {m.target}); each state is "
                                         "an input, and its value after the program the output <state>.out")
    opsets = [helper.make_opsetid("", OPSET)]
    if g.custom:
        opsets.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="npuc", producer_version=npuc.__version__,
                              doc_string="exported by npuc export-onnx: nodes of domain npuc are npuc ops "
                                         "(docs/ops.md) with npuc's inputs and attributes")
    model.ir_version = IR_VERSION
    meta = {e.key: e.value for e in m.metadata}
    meta.update({"npuc.program": prog.name, "npuc.programs": ",".join(p.name for p in m.programs)})
    helper.set_model_props(model, meta)
    return model


def onnx_model(m: Any, weights: memoryview, program: str | None = None, om_path: str = "<model>"
               ) -> onnx.ModelProto:
    """The ONNX model of one program (the first by default) of a merged ModelDef (`Session.model`),
    every weight embedded from `weights` (the .om's weights section), in memory."""
    g = _Graph(m, _select(m, program), om_path)
    return _assemble(m, g, g.build(), weights, {}, "")


def _write(path: str, chunks: Iterator[bytes | memoryview]) -> None:
    """Write `path` atomically (a temporary file, then a rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise NpucError(E_WRITE, f"cannot write {path}: {e.strerror or e}", "check the path and the free space",
                        exit_code=EXIT_IO) from None


def _external_layout(m: Any, used: Sequence[int]) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int, int]]]:
    """Where each weight of 1 KiB or more goes in the data file: (tensor id -> (offset, length)),
    and the copies to make, (file offset, .om weights offset, length), each range once."""
    layout: dict[int, tuple[int, int]] = {}
    copies: list[tuple[int, int, int]] = []
    placed: dict[tuple[int, int], int] = {}
    cursor = 0
    for tid in used:
        t = m.tensors[tid]
        if t.nbytes < EXTERNAL_MIN_BYTES:
            continue
        key = (t.offset, t.nbytes)
        if key not in placed:  # two names for the same bytes (an aliased weight) share them
            cursor = -(-cursor // EXTERNAL_ALIGN) * EXTERNAL_ALIGN
            placed[key] = cursor
            copies.append((cursor, t.offset, t.nbytes))
            cursor += t.nbytes
        layout[tid] = (placed[key], t.nbytes)
    return layout, copies


def export_onnx(om_path: str, out_path: str, program: str | None = None, weights: str = "auto") -> ExportSummary:
    """Write program `program` (the first by default) of the `.om` at `om_path` as ONNX to `out_path`.

    `weights`: "embed" keeps the weights in the model file (below 2 GiB), "external"
    writes them to `<out_path>.data` (ONNX external data, beside the model), "auto"
    embeds up to 1.5 GiB of weights. See the module docstring for what the graph holds."""
    if weights not in ("auto", "embed", "external"):
        raise ValueError(f"weights must be 'auto', 'embed' or 'external', not {weights!r}")
    om_path, out_path = os.fspath(om_path), os.fspath(out_path)
    with _open(om_path, verify_weights=False) as (om, m), om.section("weights") as wv:
        check_tensors(om_path, m, len(wv), max(p.plan.arena_bytes for p in m.programs))
        g = _Graph(m, _select(m, program), om_path)
        built = g.build()
        total = sum(m.tensors[i].nbytes for i in g.weights)
        external = weights == "external" or (weights == "auto" and total > AUTO_EXTERNAL_BYTES)
        if not external and total > _PROTO_LIMIT:
            raise NpucError(E_WRITE, f"program {g.prog.name!r} has {total:,} bytes of weights, more than one ONNX "
                                     "file holds (protobuf stops at 2 GiB)",
                            "export with --weights external (or auto) to write them to a file beside it",
                            exit_code=EXIT_IO)
        data_path = f"{out_path}.data" if external else None
        layout, copies = _external_layout(m, g.weights) if external else ({}, [])
        model = _assemble(m, g, built, wv, layout, os.path.basename(data_path or ""))

        def data() -> Iterator[bytes | memoryview]:
            end = 0
            for at, src, n in copies:
                if at > end:
                    yield bytes(at - end)
                yield wv[src:src + n]
                end = at + n

        if data_path is not None:
            _write(data_path, data())
        _write(out_path, iter([model.SerializeToString(deterministic=True)]))
    nodes = model.graph.node
    custom = [n for n in nodes if n.domain == DOMAIN]
    return ExportSummary(
        path=out_path, data_path=data_path, program=g.prog.name, programs=tuple(p.name for p in m.programs),
        nodes=len(nodes), standard_nodes=len(nodes) - len(custom), custom_nodes=len(custom),
        custom_ops=tuple(sorted({n.op_type for n in custom})), initializers=len(g.weights) + len(g.consts),
        weights=len(g.weights), weights_bytes=total,
        inputs=tuple(v.name for v in model.graph.input), outputs=tuple(v.name for v in model.graph.output),
        states=tuple(g.names[i] for i in g.states))
