"""`--input_shape` in ATC's syntax: every refusal, with its exact message and exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

INPUTS = "model inputs: input_ids: i64[batch,seq], attention_mask: i64[batch,seq], x:0: f32[2,3]"
HINT = ('hint: write --input_shape as "name:d0,d1;name2:d0,d1", e.g. "input_ids:1,16", or bind the inputs\' '
        'dim names, e.g. "batch_size:1;sequence_length:16"')


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three inputs: two with dynamic dims, one static and named like a TF tensor (`x:0`)."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    x = helper.make_tensor_value_info("x:0", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, None)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Add", ["input_ids", "attention_mask"], ["y"]),
             helper.make_node("Neg", ["x:0"], ["z"])]
    m = helper.make_model(helper.make_graph(nodes, "g", [ids, mask, x], [y, z]),
                          opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path_factory.mktemp("shapes") / "m.onnx"
    onnx.save(m, str(path))
    return path


def compile_(model: Path, shape: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", "compile", str(model), "--input_shape", shape,
                           "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)


def expect(r: subprocess.CompletedProcess[str], *lines: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == list(lines)


CASES = {
    "unknown name": (
        "input_ids:1,4;attention_mask:1,4;input_idz:1,4",
        "npuc: error NPUC-E0102: 'input_idz:1,4': the model has no input or dim named 'input_idz' (closest: "
        "'input_ids')"),
    "not an integer": (
        "input_ids:1,four;attention_mask:1,4",
        "npuc: error NPUC-E0101: 'input_ids:1,four': dim 1 ('four') is not an integer"),
    "negative": (
        "input_ids:1,-3;attention_mask:1,4",
        "npuc: error NPUC-E0101: 'input_ids:1,-3': dim 1 is -3; dims must be positive"),
    "minus one": (
        "input_ids:1,-1;attention_mask:1,4",
        "npuc: error NPUC-E0101: 'input_ids:1,-1': dim 1 is -1; npuc compiles static shapes only"),
    "rank": (
        "input_ids:1,4,2;attention_mask:1,4",
        "npuc: error NPUC-E0114: 'input_ids:1,4,2': rank 3, but input 'input_ids' is i64[batch,seq] (rank 2)"),
    "dynamic dims without a shape": (
        "input_ids:1,4",
        "npuc: error NPUC-E0113: input 'attention_mask' (i64[batch,seq]) has dynamic dims and --input_shape "
        "gives it no shape"),
    "twice": (
        "input_ids:1,4;attention_mask:1,4;input_ids:1,8",
        "npuc: error NPUC-E0116: input 'input_ids' is given twice ('input_ids:1,4' and 'input_ids:1,8')"),
    "fixed dim": (
        "input_ids:1,4;attention_mask:1,4;x:0:3,3",
        "npuc: error NPUC-E0115: 'x:0:3,3': dim 0 is 3, but the model fixes it to 2"),
    "a dim name against an input's own dims": (
        "batch:1;seq:4;input_ids:1,8",
        "npuc: error NPUC-E0132: 'input_ids:1,8' makes dim 'seq' 8, but 'seq:4' binds it to 4"),
    "one dim name, two sizes in the inputs": (
        "input_ids:1,4;attention_mask:1,5",
        "npuc: error NPUC-E0132: dim 'seq' is 4 in 'input_ids:1,4' and 5 in 'attention_mask:1,5'"),
    "a dim name with two dims": (
        "input_ids:1,4;attention_mask:1,4;batch:1,2",
        "npuc: error NPUC-E0132: 'batch:1,2': dim name 'batch' binds one size, not 2"),
    "a dim name misspelt": (
        "input_ids:1,4;attention_mask:1,4;sequ:4",
        "npuc: error NPUC-E0102: 'sequ:4': the model has no input or dim named 'sequ' (closest: 'seq')"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_refusal(case: str, model: Path, tmp_path: Path) -> None:
    shape, first = CASES[case]
    expect(compile_(model, shape, tmp_path), first, "  " + INPUTS, "  " + HINT)
    assert not (tmp_path / "out.om").exists()


def test_all_problems_reported_together(model: Path, tmp_path: Path) -> None:
    r = compile_(model, "input_id:1,x;attention_mask:1,-1,2;x:0:2,3;x:0:2,3", tmp_path)
    expect(r,
           "npuc: error NPUC-E0101: 5 problems with --input_shape 'input_id:1,x;attention_mask:1,-1,2;x:0:2,3;x:0:2,3'",
           "  - 'input_id:1,x': dim 1 ('x') is not an integer [NPUC-E0101]",
           "  - 'attention_mask:1,-1,2': dim 1 is -1; npuc compiles static shapes only [NPUC-E0101]",
           "  - input 'x:0' is given twice ('x:0:2,3' and 'x:0:2,3') [NPUC-E0116]",
           "  - 'input_id:1,x': the model has no input or dim named 'input_id' (closest: 'input_ids') [NPUC-E0102]",
           "  - input 'input_ids' (i64[batch,seq]) has dynamic dims and --input_shape gives it no shape [NPUC-E0113]",
           "  " + INPUTS, "  " + HINT)


def test_names_split_on_the_last_colon_and_static_inputs_need_no_shape(model: Path, tmp_path: Path) -> None:
    import npuc

    path = npuc.compile(str(model), input_shape=" input_ids:2,5 ; attention_mask:2,5 ", output=str(tmp_path / "ok"))
    a = np.arange(10, dtype=np.int64).reshape(2, 5)
    x = np.ones((2, 3), dtype=np.float32)
    out = npuc.load(path, executor="torch").run({"input_ids": a, "attention_mask": a, "x:0": x})
    np.testing.assert_array_equal(out["y"].numpy(), a + a)
    np.testing.assert_array_equal(out["z"].numpy(), -x)
    path = npuc.compile(str(model), input_shape="input_ids:1,3;attention_mask:1,3;x:0:2,3", output=str(tmp_path / "b"))
    assert npuc.load(path, executor="torch").inputs[2].shape == (2, 3)


def test_dim_names_bind_every_input_that_uses_them(model: Path, tmp_path: Path) -> None:
    """ONNX's symbolic dims named once ("batch:2;seq:5") size both inputs; an input's own item
    may sit beside them when it agrees."""
    import npuc

    for shape in ("batch:2;seq:5", " seq:5 ; batch:2 ", "batch:2;seq:5;input_ids:2,5"):
        path = npuc.compile(str(model), input_shape=shape, output=str(tmp_path / "n"))
        assert [t.shape for t in npuc.load(path, executor="torch").inputs] == [(2, 5), (2, 5), (2, 3)], shape


def test_a_dim_written_as_a_sum_is_computed_from_its_names() -> None:
    """optimum's attention mask is [batch_size, "past_sequence_length + sequence_length"]."""
    from npuc.compiler.shapes import DeclaredInput, resolve_input_shapes

    declared = {"ids": DeclaredInput("int64", ("batch_size", "sequence_length")),
                "mask": DeclaredInput("int64", ("batch_size", "past_sequence_length + sequence_length")),
                "past": DeclaredInput("float32", ("batch_size", 2, "past_sequence_length", 16))}
    assert resolve_input_shapes("batch_size:2;sequence_length:3;past_sequence_length:5", declared) == \
        {"ids": (2, 3), "mask": (2, 8), "past": (2, 2, 5, 16)}
    from npuc.errors import NpucError
    with pytest.raises(NpucError) as e:  # an explicit mask that disagrees with the sum
        resolve_input_shapes("batch_size:1;sequence_length:3;past_sequence_length:5;mask:1,4", declared)
    assert e.value.code == "NPUC-E0132" and e.value.message == \
        "'mask:1,4' makes dim 'past_sequence_length + sequence_length' 4, but the dim names bound make it 8"
    with pytest.raises(NpucError) as e:  # a zero past is taken only where the caller reads empty inputs (ONNX)
        resolve_input_shapes("batch_size:1;sequence_length:3;past_sequence_length:0", declared)
    assert e.value.code == "NPUC-E0101" and "is 0" in e.value.message
    assert resolve_input_shapes("batch_size:1;sequence_length:3;past_sequence_length:0", declared,
                                empty_ok=True)["past"] == (1, 2, 0, 16)
