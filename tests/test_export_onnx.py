"""`export_onnx`: a `.om` program as an ONNX graph.

Every mapping to a standard ONNX op is checked by running the exported one-op graph
in onnxruntime against the npuc runtime. Graphs with npuc-domain nodes are run in
onnx's reference evaluator with each npuc node computed by npuc's own kernel from
the node's ONNX attributes: that checks the wiring (names, input order, initializers,
attributes, states) of the whole exported graph, not the kernels again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, all_ops, get_op
from npuc.runtime.session import Session
from npuc.tools import export_onnx as ex
from npuc.tools.export_onnx import DOMAIN, MAPPING, OPSET, export_onnx

ort = pytest.importorskip("onnxruntime")

R = np.random.default_rng(0)


def f32(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return R.uniform(lo, hi, shape).astype(np.float32)


def ints(*shape: int, lo: int = -5, hi: int = 6, dtype: Any = np.int64) -> np.ndarray:
    return R.integers(lo, hi, shape).astype(dtype)


def bools(*shape: int) -> np.ndarray:
    return R.integers(0, 2, shape).astype(np.bool_)


def one_op_om(tmp_path: Path, op: str, args: Sequence[np.ndarray], attrs: dict[str, Any] | None = None,
              consts: Sequence[int] = ()) -> str:
    """A .om of one `op` over inputs x0, x1, ... (those at `consts`: weights), its outputs the program's."""
    g = Graph("main")
    vals = []
    for i, a in enumerate(args):
        t = TensorType(a.shape, DType.from_torch(torch.from_numpy(a).dtype))
        vals.append(g.add_constant(f"w{i}", t, TensorSource(torch.from_numpy(a.copy()))) if i in consts
                    else g.add_input(f"x{i}", t))
    outs = get_op(op).infer_types([v.type for v in vals], attrs or {})
    g.set_outputs(g.add_node(op, vals, outs, attrs, names=op).outputs)
    path = str(tmp_path / f"{op}.om")
    write_om(lower(g, get_target("cpu")), path)
    return path


def feeds_of(args: Sequence[np.ndarray], consts: Sequence[int] = ()) -> dict[str, np.ndarray]:
    return {f"x{i}": a for i, a in enumerate(args) if i not in consts}


def npuc_attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """An npuc-domain node's attributes back in npuc's form (the inverse of the export's encoding)."""
    od = get_op(node.op_type)
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        kind = od.attrs[a.name].kind
        out[a.name] = {"bool": bool, "dtype": lambda s: DType(s.decode()), "str": lambda s: s.decode(),
                       "ints": tuple, "floats": tuple}.get(kind, lambda v: v)(v)
    return out


def _npuc_node_class(op: str) -> type[OpRun]:
    class NpucOp(OpRun):
        op_domain = DOMAIN

        def _run(self, *xs: Any, **_: Any) -> tuple[Any, ...]:
            outs = get_op(op).run([torch.from_numpy(np.array(x)) for x in xs], npuc_attrs(self.onnx_node))
            return tuple(o.numpy() for o in outs)

    NpucOp.__name__ = op
    return NpucOp


def reference_run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    m = onnx.load(model) if isinstance(model, str) else model
    custom = sorted({n.op_type for n in m.graph.node if n.domain == DOMAIN})
    ev = ReferenceEvaluator(m, new_ops=[_npuc_node_class(c) for c in custom])
    names = [o.name for o in m.graph.output]
    return dict(zip(names, ev.run(None, feeds), strict=True))


def ort_run(path: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def assert_same(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> None:
    assert set(want) <= set(got), (sorted(got), sorted(want))
    for k, t in want.items():
        w = t.numpy()
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, (k, got[k].dtype, got[k].shape, w.dtype, w.shape)
        if w.dtype.kind == "f":
            np.testing.assert_allclose(got[k].astype(np.float64), w.astype(np.float64), rtol=2e-5, atol=2e-6,
                                       err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], w, err_msg=k)


# --- one op: standard mappings run in onnxruntime ----------------------------------------------

_W2 = f32(5, 4)
STANDARD: list[tuple[str, str, list[np.ndarray], dict[str, Any], tuple[int, ...]]] = [
    *[(op, onnx_op, [f32(2, 3)], {}, ()) for op, onnx_op in [
        ("exp", "Exp"), ("tanh", "Tanh"), ("sigmoid", "Sigmoid"), ("erf", "Erf"), ("floor", "Floor"),
        ("ceil", "Ceil"), ("cos", "Cos"), ("sin", "Sin"), ("atan", "Atan"), ("sinh", "Sinh"), ("cosh", "Cosh"),
        ("asinh", "Asinh"), ("softplus", "Softplus"), ("softsign", "Softsign"), ("mish", "Mish"),
        ("hardswish", "HardSwish"), ("neg", "Neg"), ("relu", "Relu"), ("abs", "Abs"), ("sign", "Sign")]],
    *[(op, onnx_op, [f32(2, 3, lo=0.1, hi=2.0)], {}, ()) for op, onnx_op in [
        ("sqrt", "Sqrt"), ("log", "Log"), ("reciprocal", "Reciprocal")]],
    *[(op, onnx_op, [f32(2, 3, lo=-0.9, hi=0.9)], {}, ()) for op, onnx_op in [
        ("asin", "Asin"), ("acos", "Acos"), ("atanh", "Atanh"), ("tan", "Tan")]],
    ("acosh", "Acosh", [f32(2, 3, lo=1.1, hi=3.0)], {}, ()),
    ("round", "Round", [np.array([[0.5, 1.5, 2.5], [-0.5, -1.4, 3.7]], np.float32)], {}, ()),
    ("neg", "Neg", [ints(2, 3, dtype=np.int32)], {}, ()),
    ("abs", "Abs", [ints(2, 3)], {}, ()),
    ("elu", "Elu", [f32(2, 3)], {"alpha": 0.5}, ()),
    ("celu", "Celu", [f32(2, 3)], {"alpha": 0.7}, ()),
    ("selu", "Selu", [f32(2, 3)], {"alpha": 1.6, "gamma": 1.1}, ()),
    ("leaky_relu", "LeakyRelu", [f32(2, 3)], {"alpha": 0.2}, ()),
    ("hard_sigmoid", "HardSigmoid", [f32(2, 3)], {"alpha": 0.3, "beta": 0.4}, ()),
    ("thresholded_relu", "ThresholdedRelu", [f32(2, 3)], {"alpha": 0.5}, ()),
    ("is_inf", "IsInf", [np.array([1.0, np.inf, -np.inf, np.nan], np.float32)], {"detect_negative": False}, ()),
    ("is_nan", "IsNaN", [np.array([1.0, np.inf, np.nan], np.float32)], {}, ()),
    ("logical_not", "Not", [bools(2, 3)], {}, ()),
    ("bitwise_not", "Not", [bools(2, 3)], {}, ()),
    ("bitwise_not", "BitwiseNot", [ints(2, 3, dtype=np.int32)], {}, ()),
    ("bitwise_and", "And", [bools(2, 3), bools(2, 3)], {}, ()),
    ("bitwise_or", "BitwiseOr", [ints(2, 3, dtype=np.int32), ints(3, dtype=np.int32)], {}, ()),
    ("bitwise_xor", "BitwiseXor", [ints(2, 3), ints(2, 3)], {}, ()),
    ("cast", "Cast", [f32(2, 3, lo=-9, hi=9)], {"dtype": DType.i32}, ()),
    ("cast", "Cast", [ints(2, 3)], {"dtype": DType.f16}, ()),
    ("add", "Add", [f32(2, 3), f32(3)], {}, ()),
    ("add", "Add", [ints(2, 3), ints(2, 1)], {}, ()),
    ("sub", "Sub", [f32(2, 3), f32(2, 3)], {}, (1,)),
    ("mul", "Mul", [ints(2, 3, dtype=np.int32), ints(1, dtype=np.int32)], {}, ()),
    ("div", "Div", [f32(2, 3), f32(2, 3, lo=0.5)], {}, ()),
    ("pow", "Pow", [f32(2, 3, lo=0.1), f32(2, 3)], {}, ()),
    ("maximum", "Max", [f32(2, 3), f32(3)], {}, ()),
    ("minimum", "Min", [ints(2, 3), ints(2, 3)], {}, ()),
    ("matmul", "MatMul", [f32(2, 3, 4), f32(4, 5)], {}, (1,)),
    ("eq", "Equal", [ints(2, 3, lo=0, hi=2), ints(2, 3, lo=0, hi=2)], {}, ()),
    *[(op, onnx_op, [ints(3, 4, lo=0, hi=3).astype(np.float32), ints(4, lo=0, hi=3).astype(np.float32)], {}, ())
      for op, onnx_op in [("lt", "Less"), ("le", "LessOrEqual"), ("gt", "Greater"), ("ge", "GreaterOrEqual")]],
    ("where", "Where", [bools(2, 3), f32(2, 3), f32(3)], {}, ()),
    ("mod", "Mod", [ints(2, 4, lo=-9, hi=9, dtype=np.int32), np.array([3, -3, 4, -2], np.int32)], {}, ()),
    ("mod", "Mod", [f32(2, 4, lo=-9, hi=9), np.array([3, -3, 4, -2], np.float32)], {"fmod": True}, ()),
    ("reduce_mean", "ReduceMean", [f32(2, 3, 4)], {"axes": (0, 2), "keepdim": True}, ()),
    ("reduce_sum", "ReduceSum", [f32(2, 3, 4)], {"axes": (1,)}, ()),
    ("reduce_max", "ReduceMax", [ints(2, 3, 4)], {"axes": (2,)}, ()),
    ("reduce_min", "ReduceMin", [f32(2, 3, 4)], {"axes": (0,), "keepdim": True}, ()),
    ("reduce_prod", "ReduceProd", [f32(2, 3, 4, lo=0.5, hi=1.5)], {"axes": (1, 2)}, ()),
    ("cumsum", "CumSum", [f32(2, 5)], {"axis": 1}, ()),
    ("cumsum", "CumSum", [ints(2, 5)], {"axis": 1, "exclusive": True, "reverse": True}, ()),
    ("softmax", "Softmax", [f32(2, 3, 4)], {"axis": 1}, ()),
    ("log_softmax", "LogSoftmax", [f32(2, 3, 4)], {"axis": 2}, ()),
    ("reshape", "Reshape", [f32(2, 3, 4)], {"shape": (6, 4)}, ()),
    ("transpose", "Transpose", [f32(2, 3, 4)], {"perm": (2, 0, 1)}, ()),
    ("expand", "Expand", [f32(3, 1)], {"shape": (2, 3, 4)}, ()),
    ("slice", "Slice", [f32(2, 7, 3)], {"axis": 1, "start": 1, "end": 6, "step": 2}, ()),
    ("slice", "Slice", [f32(2, 7, 3)], {"axis": 1, "start": -3, "end": 100}, ()),
    ("concat", "Concat", [f32(2, 3), f32(2, 2), f32(2, 1)], {"axis": 1}, (1,)),
    ("split", "Split", [f32(2, 6)], {"axis": 1, "sizes": (2, 4)}, ()),
    ("gather", "Gather", [_W2, np.array([[0, -1], [2, 4]], np.int64)], {}, (0,)),
    ("gather", "Gather", [f32(3, 5), np.array([4, 0, 1], np.int32)], {"axis": 1}, ()),
    ("index", "Gather", [f32(5, 3), np.array([4, -2, 0, 1], np.int64)], {}, ()),
    ("gather_nd", "GatherND", [f32(2, 3, 4), np.array([[0, 1], [1, 2]], np.int64)], {}, ()),
    ("gather_elements", "GatherElements", [f32(3, 4), np.array([[0, 3], [1, 1], [2, 0]], np.int64)], {"axis": 1},
     ()),
    ("scatter_nd", "ScatterND", [f32(4, 3), np.array([[1], [3]], np.int64), f32(2, 3)], {}, ()),
    ("scatter_nd", "ScatterND", [f32(4, 3), np.array([[1], [1]], np.int64), f32(2, 3)], {"reduction": "add"}, ()),
    ("scatter_elements", "ScatterElements", [f32(3, 4), np.array([[0, 3], [1, 2], [2, 0]], np.int64), f32(3, 2)],
     {"axis": 1, "reduction": "add"}, ()),
    ("pad", "Pad", [f32(2, 3), np.array(2.5, np.float32)], {"pads": (0, 1, 1, 0)}, ()),
    ("pad", "Pad", [f32(3, 4)], {"pads": (1, 0, 2, 1), "mode": "reflect"}, ()),
    ("pad", "Pad", [f32(3, 4)], {"pads": (1, 2, 0, 1), "mode": "edge"}, ()),
    ("pad", "Pad", [f32(3, 4)], {"pads": (-1, 0, 0, 2)}, ()),
    ("trilu", "Trilu", [f32(3, 4)], {"upper": False, "k": 1}, ()),
    ("argmax", "ArgMax", [ints(3, 4, lo=0, hi=2).astype(np.float32)], {"axis": 1, "keepdim": False,
                                                                        "select_last": True}, ()),
    ("argmin", "ArgMin", [f32(3, 4)], {"axis": 0}, ()),
    ("topk", "TopK", [f32(3, 5)], {"k": 2, "axis": 1}, ()),
    ("topk", "TopK", [ints(3, 5)], {"k": 3, "axis": 0, "largest": False}, ()),
    ("arange", "Range", [], {"start": 1, "end": 10, "step": 3, "dtype": DType.i64}, ()),
    ("arange", "Range", [], {"start": 0.5, "end": 2, "step": 0.25, "dtype": DType.f32}, ()),
    ("full", "ConstantOfShape", [], {"shape": (2, 3), "value": 1.5, "dtype": DType.f32}, ()),
    ("full", "ConstantOfShape", [], {"shape": (2,), "value": 7, "dtype": DType.i32}, ()),
    ("linear", "Gemm", [f32(3, 4), f32(5, 4), f32(5)], {}, (1, 2)),
    ("linear", "Gemm", [f32(3, 4), f32(4, 5)], {"weight_layout": "kn"}, (1,)),
    ("linear", "MatMul", [f32(2, 3, 4), f32(4, 5)], {"weight_layout": "kn"}, (1,)),
    ("einsum", "Einsum", [f32(2, 3, 4), f32(2, 4, 5)], {"equation": "bij,bjk->bik"}, ()),
    ("layer_norm", "LayerNormalization", [f32(2, 3, 4), f32(4), f32(4)], {"axis": -1, "eps": 1e-5}, (1, 2)),
]


def exported_one_op(tmp_path: Path, op: str, args: list[np.ndarray], attrs: dict[str, Any], consts: tuple[int, ...]
                    ) -> tuple[str, str, Any, onnx.ModelProto, onnx.NodeProto]:
    """A one-op .om, its ONNX export (checked in full), the export's stats, model and only node."""
    om = one_op_om(tmp_path, op, args, attrs, consts)
    out = str(tmp_path / "m.onnx")
    stats = export_onnx(om, out)
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    (n,) = model.graph.node
    return om, out, stats, model, n


@pytest.mark.parametrize("op,onnx_op,args,attrs,consts", STANDARD,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(STANDARD)])
def test_standard_op_runs_in_onnxruntime_like_npuc(tmp_path: Path, op: str, onnx_op: str, args: list[np.ndarray],
                                                   attrs: dict[str, Any], consts: tuple[int, ...]) -> None:
    om, out, s, model, n = exported_one_op(tmp_path, op, args, attrs, consts)
    sess = Session.load(om)
    (o,) = sess.model.programs[0].ops
    assert (n.domain, n.op_type, n.name) == ("", onnx_op, o.name)
    assert MAPPING[op].split("|").count(onnx_op) == 1
    assert s.custom_nodes == 0 and s.standard_nodes == 1
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    feeds = feeds_of(args, consts)
    assert_same(ort_run(out, feeds), sess.run(feeds))


def test_every_mapped_op_is_tested_and_exists() -> None:
    assert {c[0] for c in STANDARD} == set(MAPPING) == set(ex._RULES)
    assert set(MAPPING) <= set(all_ops())


# --- one op: npuc-domain nodes --------------------------------------------------------------

CUSTOM: list[tuple[str, list[np.ndarray], dict[str, Any], tuple[int, ...]]] = [
    ("rms_norm", [f32(2, 3, 8), f32(8)], {"eps": 1e-6}, (1,)),
    ("swiglu", [f32(2, 5), f32(2, 5)], {}, ()),
    ("silu", [f32(2, 5)], {}, ()),
    ("rsqrt", [f32(2, 5, lo=0.1)], {}, ()),
    ("gelu", [f32(2, 5)], {"approximate": "tanh"}, ()),
    ("ne", [ints(2, 3, lo=0, hi=2), ints(2, 3, lo=0, hi=2)], {}, ()),
    ("mod", [f32(2, 4, lo=-9, hi=9), np.array([3, -3, 4, -2], np.float32)], {}, ()),  # remainder: not ONNX Mod
    ("pad", [f32(3, 4)], {"pads": (1, 0, 2, 1), "mode": "wrap"}, ()),  # opset 19
    ("linear", [f32(2, 3, 4), f32(5, 4), f32(5)], {}, (1, 2)),  # [out, in] weight, 3-D x
    ("slice_scatter", [f32(4, 6), f32(4, 2)], {"axis": 1, "start": 1, "end": 5, "step": 2}, ()),
    ("index", [f32(4, 5, 2), np.array([0, 3], np.int64), np.array([1, 4], np.int64)], {}, ()),
    ("sdpa", [f32(1, 2, 3, 4), f32(1, 2, 5, 4), f32(1, 2, 5, 4)], {"causal": True}, ()),
    ("rope_lut", [f32(1, 2, 3, 8), np.array([0, 2, 5], np.int64), f32(6, 4), f32(6, 4)], {"layout": "interleaved"},
     (2, 3)),
    ("fused_attention", [f32(1, 4, 3, 8), f32(1, 2, 3, 8), f32(1, 2, 3, 8)], {"scale": 0.3, "causal": True}, ()),
    ("celu", [f32(2, 3).astype(np.float64)], {"alpha": 0.5}, ()),  # ONNX Celu is f32-only
]


@pytest.mark.parametrize("op,args,attrs,consts", CUSTOM, ids=[f"{c[0]}-{i}" for i, c in enumerate(CUSTOM)])
def test_other_ops_are_npuc_domain_nodes_with_npuc_attributes(tmp_path: Path, op: str, args: list[np.ndarray],
                                                              attrs: dict[str, Any], consts: tuple[int, ...]) -> None:
    om, out, s, model, n = exported_one_op(tmp_path, op, args, attrs, consts)
    assert (n.domain, n.op_type, n.name) == (DOMAIN, op, op)
    assert s.custom_ops == (op,) and s.standard_nodes == 0
    assert {(o.domain, o.version) for o in model.opset_import} == {("", OPSET), (DOMAIN, 1)}
    # Every attribute, defaults included (None ones left out), decodes back to what the .om says.
    want = get_op(op).full_attrs(attrs)
    f32_attrs = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in want.items()}  # ONNX FLOAT
    assert npuc_attrs(n) == {k: v for k, v in f32_attrs.items() if v is not None}
    assert list(n.input) == [f"w{i}" if i in consts else f"x{i}" for i in range(len(args))]
    feeds = feeds_of(args, consts)
    assert_same(reference_run(model, feeds), Session.load(om).run(feeds))


def test_attribute_encoding() -> None:
    om_attr = ex._custom_attr
    assert om_attr("eps", "float", 1e-6).type == onnx.AttributeProto.FLOAT
    assert om_attr("causal", "bool", True).i == 1
    assert om_attr("dtype", "dtype", DType.bf16).s == b"bf16"
    assert list(om_attr("axes", "ints", ()).ints) == [] and om_attr("axes", "ints", ()).type == onnx.AttributeProto.INTS
    assert om_attr("scale", "float", None) is None
    assert om_attr("x", None, (1.0, 2)).type == onnx.AttributeProto.FLOATS  # an op npuc does not know


# --- whole models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    from npuc.compiler.driver import compile_model

    return compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16",
                         output=str(tmp_path_factory.mktemp("llama") / "m"))


@pytest.fixture(scope="module")
def llama_kv_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    from npuc.compiler.driver import compile_model

    return compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=32,
                         output=str(tmp_path_factory.mktemp("llama_kv") / "m"))


def _weights_used(m: Any, prog: Any) -> set[str]:
    return {m.tensors[i].name for o in prog.ops for i in o.inputs if m.tensors[i].region == "weights"}


def test_llama_graph(llama_om: str, tmp_path: Path) -> None:
    out = str(tmp_path / "llama.onnx")
    s = export_onnx(llama_om, out)
    assert s.data_path is None and not (tmp_path / "llama.onnx.data").exists()
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    sess = Session.load(llama_om)
    m, prog = sess.model, sess.model.programs[0]
    nodes = model.graph.node
    # One node per op, in order, named as the op; the fused ops in the npuc domain.
    assert [n.name for n in nodes] == [o.name for o in prog.ops]
    assert len(nodes) == len(prog.ops) == s.nodes
    assert {"rms_norm", "fused_attention", "swiglu", "rope_lut"} <= set(s.custom_ops)
    for n, o in zip(nodes, prog.ops, strict=True):
        assert (n.domain == DOMAIN) == (n.op_type == o.op), (n.op_type, o.op)
        assert f"npuc {o.op} on the {o.unit} unit" in n.doc_string
        assert not (n.domain == DOMAIN and n.op_type in {"reshape", "transpose", "add", "gather"})
    # Values are the .om's tensors; the extra initializers are standard ops' operands, named <node>.<input>.
    names = {t.name for t in m.tensors}
    weights = _weights_used(m, prog)
    inits = {i.name for i in model.graph.initializer}
    assert weights <= inits and s.weights == len(weights)
    extra = inits - weights
    node_names = {n.name for n in nodes}
    assert all(e.rsplit(".", 1)[0] in node_names for e in extra), extra
    for n in nodes:
        assert set(n.output) <= names
        assert set(n.input) <= names | extra
    # Each initializer holds the .om's bytes, and every value has its dtype and shape.
    by_name = {t.name: t for t in m.tensors}
    for init in model.graph.initializer:
        if init.name in weights:
            t = by_name[init.name]
            assert list(init.dims) == list(t.shape)
            assert init.raw_data == bytes(sess._weights[t.offset:t.offset + t.nbytes].numpy())
    infos = {v.name: v for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    for n in nodes:
        for v in n.output:
            shape = [d.dim_value for d in infos[v].type.tensor_type.shape.dim]
            assert shape == list(by_name[v].shape)
    assert [i.name for i in model.graph.input] == ["input_ids"] and [o.name for o in model.graph.output] == ["logits"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["target"] == m.target and meta["source_xxh3"] and meta["compiler"].startswith("npuc")
    assert meta["npuc.program"] == "main"
    # The graph computes what npuc does.
    ids = np.arange(16, dtype=np.int64).reshape(1, 16) % 128
    assert_same(reference_run(out, {"input_ids": ids}), sess.run({"input_ids": ids}))


def test_tiny_module_runs_in_onnxruntime(tmp_path: Path) -> None:
    """A torch module compiled by the full pipeline (padding for the cube unit, folded
    weights): every op maps to a standard one and onnxruntime agrees with npuc."""
    from npuc.compiler.driver import compile_model

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(8, 12, generator=g))
            self.b = torch.nn.Parameter(torch.randn(12, generator=g))
            self.lin = torch.nn.Linear(12, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.lin(torch.tanh(x @ self.w + self.b)).transpose(0, 1).reshape(3, 4)
            return torch.softmax(z, dim=-1) * 2 - z.exp().sum(dim=0, keepdim=True)

    torch.manual_seed(0)
    om = compile_model(M().eval(), input_shape="x:2,8", output=str(tmp_path / "tiny"))
    out = str(tmp_path / "tiny.onnx")
    s = export_onnx(om, out)
    assert s.custom_nodes == 0 and {"Gemm", "Tanh", "Softmax", "Transpose", "Reshape"} <= \
        {n.op_type for n in onnx.load(out).graph.node}
    x = R.standard_normal((2, 8)).astype(np.float32)
    assert_same(ort_run(out, {"x": x}), Session.load(om).run({"x": x}))
    # External weights: the bytes beside the model, aligned; onnxruntime reads them the same.
    out2 = str(tmp_path / "ext" / "tiny.onnx")
    Path(out2).parent.mkdir()
    s2 = export_onnx(om, out2, weights="external")
    assert s2.data_path == out2 + ".data" and Path(s2.data_path).stat().st_size > 0
    model = onnx.load(out2, load_external_data=False)
    ext = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    m = Session.load(om).model
    sizes = {t.name: t.nbytes for t in m.tensors if t.region == "weights"}
    for i in model.graph.initializer:  # the small ones (and the int64 operands) stay in the model
        external = i.data_location == onnx.TensorProto.EXTERNAL
        assert external == (sizes.get(i.name, 0) >= ex.EXTERNAL_MIN_BYTES), i.name
    assert ext and len(ext) < len(model.graph.initializer)
    for i in ext:
        info = {e.key: e.value for e in i.external_data}
        assert info["location"] == "tiny.onnx.data" and int(info.get("offset", 0)) % ex.EXTERNAL_ALIGN == 0
    onnx.checker.check_model(out2)
    assert_same(ort_run(out2, {"x": x}), Session.load(om).run({"x": x}))


def test_kv_cache_programs_are_pure_functions_of_their_states(llama_kv_om: str, tmp_path: Path) -> None:
    sess = Session.load(llama_kv_om)
    m = sess.model
    states = [t.name for t in m.tensors if t.region == "state" and not t.HasField("base")]
    assert len(states) == 4
    paths = {}
    for prog in ("prefill", "decode"):
        paths[prog] = str(tmp_path / f"{prog}.onnx")
        s = export_onnx(llama_kv_om, paths[prog], program=prog)
        model = onnx.load(paths[prog])
        onnx.checker.check_model(model, full_check=True)
        own = ["input_ids", "position"] if prog == "decode" else ["input_ids", "last_token"]
        assert [i.name for i in model.graph.input] == own + states
        assert [o.name for o in model.graph.output] == ["logits"] + [f"{st}.out" for st in states]
        assert s.program == prog and s.programs == ("prefill", "decode") and s.states == tuple(states)
        assert "4 states" in s.render() and "outputs logits, 4 states" in s.render()
        p = next(p for p in m.programs if p.name == prog)
        ops = [n for n in model.graph.node if n.op_type != "Identity"]
        assert [n.name for n in ops] == [o.name for o in p.ops]
        ids = [n for n in model.graph.node if n.op_type == "Identity"]
        assert [n.output[0] for n in ids] == [f"{st}.out" for st in states]
        writes = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "kv_write"}
        assert {writes[n.input[0]] for n in ids} == set(states)  # each .out is a kv_write of that state
        assert {"kv_write", "rms_norm", "rope_lut", "swiglu"} <= set(s.custom_ops)
        assert ("cached_attention" in s.custom_ops) == (prog == "decode")
        assert {p.key: p.value for p in model.metadata_props}["npuc.program"] == prog
    # prefill, then two decode steps, carrying the caches: the same logits as the stateful runtime.
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 128, (1, 8)).astype(np.int64)
    cache = {st: np.zeros(tuple(t.shape), np.float32) for st in states
             for t in m.tensors if t.name == st}
    row = np.array([5], np.int64)  # prefill computes the logits of this row (--prefill_logits last)
    got = reference_run(paths["prefill"], {"input_ids": prompt, "last_token": row, **cache})
    want = sess.run({"input_ids": prompt, "last_token": row}, "prefill")
    assert want["logits"].shape == (1, 1, 128)
    assert_same({"logits": got["logits"]}, {"logits": want["logits"]})
    for step, tok in enumerate([5, 77]):
        cache = {st: got[f"{st}.out"] for st in states}
        feeds = {"input_ids": np.array([[tok]], np.int64), "position": np.array([8 + step], np.int64)}
        got = reference_run(paths["decode"], {**feeds, **cache})
        want = sess.run(feeds, "decode")
        assert_same({"logits": got["logits"]}, {"logits": want["logits"]})


def test_same_om_same_bytes(llama_kv_om: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    for d in (a, b):
        export_onnx(llama_kv_om, str(d / "m.onnx"), program="decode")
        export_onnx(llama_kv_om, str(d / "x.onnx"), program="decode", weights="external")
    assert (a / "m.onnx").read_bytes() == (b / "m.onnx").read_bytes()
    assert (a / "x.onnx").read_bytes() == (b / "x.onnx").read_bytes()
    assert (a / "x.onnx.data").read_bytes() == (b / "x.onnx.data").read_bytes()
    assert len((a / "x.onnx").read_bytes()) < len((a / "m.onnx").read_bytes())


def test_weights_choice(llama_om: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ex, "AUTO_EXTERNAL_BYTES", 1000)
    s = export_onnx(llama_om, str(tmp_path / "auto.onnx"))
    assert s.data_path == str(tmp_path / "auto.onnx.data")
    model = onnx.load(str(tmp_path / "auto.onnx"))  # loads the external data
    onnx.checker.check_model(str(tmp_path / "auto.onnx"), full_check=True)
    sess = Session.load(llama_om)
    ids = np.zeros((1, 16), np.int64)
    assert_same(reference_run(model, {"input_ids": ids}), sess.run({"input_ids": ids}))
    monkeypatch.setattr(ex, "_PROTO_LIMIT", 1000)
    with pytest.raises(NpucError) as e:
        export_onnx(llama_om, str(tmp_path / "big.onnx"), weights="embed")
    assert e.value.code == "NPUC-E0406" and "--weights external" in e.value.hint
    assert not (tmp_path / "big.onnx").exists()


def test_errors(llama_om: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        export_onnx(llama_om, str(tmp_path / "m.onnx"), program="decode")
    assert e.value.code == "NPUC-E0111" and "main" in e.value.hint
    with pytest.raises(NpucError) as e:
        export_onnx(llama_om, str(tmp_path / "no" / "such" / "dir" / "m.onnx"))
    assert e.value.code == "NPUC-E0406"
    with pytest.raises(NpucError) as e:
        export_onnx(str(tmp_path / "missing.om"), str(tmp_path / "m.onnx"))
    assert e.value.code == "NPUC-E0401"
    with pytest.raises(ValueError):
        export_onnx(llama_om, str(tmp_path / "m.onnx"), weights="inline")
    assert not list(tmp_path.iterdir())


def test_summary_render(llama_om: str, tmp_path: Path) -> None:
    s = export_onnx(llama_om, str(tmp_path / "m.onnx"))
    text = s.render()
    assert text.startswith(f"wrote {tmp_path / 'm.onnx'}: program main, {s.nodes} nodes")
    assert "npuc (" in text and "rms_norm" in text and f"{s.weights} weights" in text
