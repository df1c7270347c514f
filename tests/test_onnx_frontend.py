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
    out = npuc.load(npuc.compile(str(path), input_shape="a:2,3", output=str(tmp_path / "f"))).run(
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
    for item in ("ai.onnx::Hardmax (opset 18) x2", "ai.onnx::DepthToSpace (opset 18) x1",
                 "com.vendor::FancyOp (opset 18) x1"):
        assert item in first
    assert not (tmp_path / "x.om").exists()


@pytest.mark.parametrize("opset", [12, 24])
def test_opsets_outside_the_range_are_refused(tmp_path: Path, opset: int) -> None:
    path = _save(tmp_path, [helper.make_node("Neg", ["a"], ["b"])], [_vi("a", [2])], [_vi("b", None)], opset=opset)
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
    out = npuc.load(npuc.compile(str(path), input_shape="x:5,3,4", output=str(tmp_path / "s"))).run(
        {"x": np.ones((5, 3, 4), np.float32)})
    assert out["flat"].shape == (5, 12)
    assert out["r"].tolist() == [0, 1, 2, 3, 4]
