"""ONNX frontend details: local functions, the unsupported-op report, opset range,
shape arithmetic folded at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

import npuc  # noqa: E402
from npuc.errors import NpucError  # noqa: E402


def _save(tmp_path: Path, nodes: list, inputs: list, outputs: list, opset: int = 18, functions: list | None = None,
          inits: list | None = None, extra_opsets: list | None = None) -> Path:
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)] + (extra_opsets or []),
                          functions=functions or [])
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    return path


def _vi(name: str, dims: list | None, t: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, t, dims)


def test_local_functions_are_inlined(tmp_path: Path) -> None:
    # swish(x) = x * sigmoid(x), as a model-local function in a custom domain.
    fn = helper.make_function("custom", "Swish", ["x"], ["y"],
                              [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])],
                              [helper.make_opsetid("", 18)])
    path = _save(tmp_path, [helper.make_node("Swish", ["a"], ["b"], domain="custom")], [_vi("a", [2, 3])],
                 [_vi("b", None)], functions=[fn], extra_opsets=[helper.make_opsetid("custom", 1)])
    out = npuc.load(npuc.compile(str(path), input_shape="a:2,3", output=str(tmp_path / "f")), executor="torch").run(
        {"a": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)})["b"].numpy()
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(out, x / (1 + np.exp(-x)), rtol=1e-6)


def test_every_unsupported_op_reported_with_domain_and_opset(tmp_path: Path) -> None:
    nodes = [helper.make_node("Hardmax", ["a"], ["b"]), helper.make_node("Hardmax", ["b"], ["c"]),
             helper.make_node("DepthToSpace", ["c"], ["d"], blocksize=1),
             helper.make_node("FancyOp", ["d"], ["e"], domain="com.vendor")]
    path = _save(tmp_path, nodes, [_vi("a", [1, 1, 2, 2])], [_vi("e", None)],
                 extra_opsets=[helper.make_opsetid("com.vendor", 1)])
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(path), "--input_shape", "a:1,1,2,2",
                        "--output", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("npuc: error NPUC-E0301: the model uses 3 operator(s) npuc does not support:")
    # each op with the version its own domain is imported at (not ai.onnx's, for a vendor's op)
    for item in ("ai.onnx::Hardmax (ai.onnx opset 18) x2", "ai.onnx::DepthToSpace (ai.onnx opset 18) x1",
                 "com.vendor::FancyOp (com.vendor opset 1) x1"):
        assert item in first
    assert not (tmp_path / "x.om").exists()


@pytest.mark.parametrize("opset,node", [
    (10, helper.make_node("Clip", ["a"], ["b"], min=0.0, max=1.0)),  # Clip-6's attributes became inputs at 11
    (26, helper.make_node("Neg", ["a"], ["b"])),
])
def test_opsets_outside_the_range_are_refused(tmp_path: Path, opset: int, node: onnx.NodeProto) -> None:
    path = _save(tmp_path, [node], [_vi("a", [2])], [_vi("b", None)], opset=opset)
    with pytest.raises(NpucError) as info:
        npuc.compile(str(path), input_shape="a:2", output=str(tmp_path / "x"))
    assert info.value.code == "NPUC-E0310" and f"opset {opset}" in info.value.message


def test_shape_arithmetic_folds_once_shapes_are_fixed(tmp_path: Path) -> None:
    """A dynamic export's Reshape(x, Concat(Shape(x)[0], -1)) becomes one static reshape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero_s"], ["b"], axis=0),
        helper.make_node("Unsqueeze", ["b", "zero"], ["b1"]),
        helper.make_node("Concat", ["b1", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["flat"]),
        helper.make_node("Range", ["zero_s", "b", "one_s"], ["r"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("zero_s", TensorProto.INT64, [], [0]),
             helper.make_tensor("one_s", TensorProto.INT64, [], [1])]
    path = _save(tmp_path, nodes, [_vi("x", ["batch", 3, 4])], [_vi("flat", None), _vi("r", None, TensorProto.INT64)],
                 inits=inits)
    from npuc.compiler.driver import build_graph

    g, _ = build_graph(str(path), "x:5,3,4")
    assert [n.op for n in g.nodes] == ["reshape", "reshape"]  # the flatten, and `r` given its own node
    out = npuc.load(npuc.compile(str(path), input_shape="x:5,3,4", output=str(tmp_path / "s")), executor="torch").run(
        {"x": np.ones((5, 3, 4), np.float32)})
    assert out["flat"].shape == (5, 12)
    assert out["r"].tolist() == [0, 1, 2, 3, 4]


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("opset", [11, 12, 13, 14, 16])
def test_older_opsets_keep_their_meaning(tmp_path: Path, opset: int) -> None:
    """Below 17 a model is upgraded by ONNX's version converter: Softmax before 13 flattens
    its input at `axis` (default 1) and normalises over all the trailing dims, Split's sizes,
    Squeeze's and ReduceSum's axes are attributes. The result matches onnxruntime at the
    model's own opset."""
    old = opset < 13
    nodes = [helper.make_node("Softmax", ["a"], ["s"], **({} if old else {"axis": 1})),
             helper.make_node("Split", ["s"] + ([] if old else ["sizes"]), ["p", "q"], axis=2,
                              **({"split": [1, 3]} if old else {})),
             helper.make_node("ReduceSum", ["q"] + ([] if old else ["rax"]), ["r"], keepdims=1,
                              **({"axes": [2]} if old else {})),
             helper.make_node("Squeeze", ["r"] + ([] if old else ["sax"]), ["t"], **({"axes": [2]} if old else {})),
             helper.make_node("Add", ["t", "t"], ["y"])]
    inits = [] if old else [helper.make_tensor("sizes", TensorProto.INT64, [2], [1, 3]),
                            helper.make_tensor("rax", TensorProto.INT64, [1], [2]),
                            helper.make_tensor("sax", TensorProto.INT64, [1], [2])]
    path = _save(tmp_path, nodes, [_vi("a", [2, 3, 4])], [_vi("y", None)], opset=opset, inits=inits)
    a = np.random.default_rng(opset).standard_normal((2, 3, 4)).astype(np.float32)
    got = npuc.load(npuc.compile(str(path), input_shape="a:2,3,4", output=str(tmp_path / "m")), executor="torch").run({"a": a})["y"]
    (want,) = _ort(path, {"a": a})
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    if old:  # the flattening softmax: [2, 12] normalised, not each row of 4
        e = np.exp(a.reshape(2, 12) - a.reshape(2, 12).max(1, keepdims=True))
        s = (e / e.sum(1, keepdims=True)).reshape(2, 3, 4)
        np.testing.assert_allclose(want, 2 * s[:, :, 1:].sum(2), rtol=1e-5)


def test_opset_25_attention_window_matches_the_reference(tmp_path: Path) -> None:
    """Opset 25's left/right_window_size band, beside is_causal, as ONNX's reference computes it."""
    from onnx.reference import ReferenceEvaluator

    q = [_vi(n, [1, 2, 6, 4]) for n in ("q", "k", "v")]
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1, left_window_size=2)
    path = _save(tmp_path, [node], q, [_vi("y", None)], opset=25)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for n in ("q", "k", "v")}
    got = npuc.load(npuc.compile(str(path), input_shape="q:1,2,6,4;k:1,2,6,4;v:1,2,6,4",
                                 output=str(tmp_path / "m")), executor="torch").run(feeds)["y"]
    (want,) = ReferenceEvaluator(str(path)).run(None, feeds)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_an_unsupported_op_in_an_upgraded_model_names_the_opset_it_was_written_at(tmp_path: Path) -> None:
    path = _save(tmp_path, [helper.make_node("Hardmax", ["a"], ["b"], axis=-1)], [_vi("a", [2, 3])],
                 [_vi("b", None)], opset=13)
    with pytest.raises(NpucError) as info:
        npuc.compile(str(path), input_shape="a:2,3", output=str(tmp_path / "x"))
    assert info.value.code == "NPUC-E0301" and "ai.onnx::Hardmax (ai.onnx opset 13) x1" in info.value.message
