"""Hostile `.onnx` files: each gets a one-line coded error and its exit code, no traceback,
no output file, and no byte of a file outside the model's folder (compiler/onnx_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

onnx = pytest.importorskip("onnx")
from onnx import ModelProto, TensorProto, helper, numpy_helper  # noqa: E402

from npuc.cli.main import main  # noqa: E402
from npuc.errors import NpucError  # noqa: E402

SECRET = b"NPUC-SECRET-0123456789abcdef" * 4  # 112 bytes: as many as w's 4x7 f32 need
W = np.arange(28, dtype=np.float32).reshape(4, 7)


def _model(nodes: list | None = None, inits: list | None = None, outputs: tuple[str, ...] = ("y",),
           opset: int = 18) -> ModelProto:
    """x[1,4] @ w[4,7] -> y, with `w` inline unless `inits` says otherwise."""
    nodes = nodes if nodes is not None else [helper.make_node("MatMul", ["x", "w"], ["y"])]
    inits = inits if inits is not None else [numpy_helper.from_array(W, "w")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    graph = helper.make_graph(nodes, "g", [x], outs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _external(location: str, offset: str = "0", length: str | None = None, name: str = "w") -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(W.shape))
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value=location)
    t.external_data.add(key="offset", value=offset)
    if length is not None:
        t.external_data.add(key="length", value=length)
    return t


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """tmp/model/ (the model's folder, with weights.bin) beside tmp/secret.bin (outside it)."""
    (tmp_path / "secret.bin").write_bytes(SECRET)
    d = tmp_path / "model"
    d.mkdir()
    (d / "weights.bin").write_bytes(W.tobytes())
    return d


def _save(folder: Path, m: ModelProto) -> Path:
    path = folder / "m.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def _outputs(folder: Path) -> list[Path]:
    out = folder / "out"
    return sorted(out.iterdir()) if out.exists() else []


def _cli(folder: Path, m: ModelProto) -> tuple[int, str]:
    """`npuc compile` in this process: (exit code, stderr)."""
    path = _save(folder, m)
    r = CliRunner().invoke(main, ["compile", str(path), "--input_shape", "x:1,4", "--output",
                                  str(folder / "out" / "m")])
    (folder / "out").mkdir(exist_ok=True)
    return r.exit_code, r.stderr


def _subprocess(folder: Path, m: ModelProto) -> tuple[int, str]:
    """`npuc compile` in a child with a timeout: for files that could make a read never end."""
    path = _save(folder, m)
    (folder / "out").mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(path), "--input_shape", "x:1,4",
                        "--output", str(folder / "out" / "m")], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def _refused(folder: Path, m: ModelProto, code: str, exit_code: int,
             run: Callable[[Path, ModelProto], tuple[int, str]] = _cli) -> str:
    rc, err = run(folder, m)
    assert rc == exit_code, err
    assert err.startswith(f"npuc: error {code}: ") and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if not line.startswith("  hint:")]) == 1, err
    assert _outputs(folder) == []
    return err


def _no_secret(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET[:16] not in p.read_bytes(), p


# -- graph structure ---------------------------------------------------------------------

def test_cycle(folder: Path) -> None:
    nodes = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Add", ["x", "a"], ["y"])]
    x_w = [numpy_helper.from_array(np.ones((1, 4), np.float32), "c")]
    assert "cycle" in _refused(folder, _model(nodes, x_w), "NPUC-E0315", 4)


def test_undefined_input(folder: Path) -> None:
    m = _model([helper.make_node("MatMul", ["x", "nowhere"], ["y"])])
    assert "'nowhere'" in _refused(folder, m, "NPUC-E0312", 2)


def test_output_never_produced(folder: Path) -> None:
    assert "'z'" in _refused(folder, _model(outputs=("y", "z")), "NPUC-E0315", 4)


def test_value_defined_twice(folder: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["w"]), helper.make_node("MatMul", ["x", "w"], ["y"])]
    assert "defined twice" in _refused(folder, _model(nodes), "NPUC-E0315", 4)


def test_wrong_arity(folder: Path) -> None:
    m = _model([helper.make_node("MatMul", ["x", "w", "x"], ["y"])])
    assert "3 inputs" in _refused(folder, m, "NPUC-E0315", 4)


def test_wrong_attribute_type(folder: Path) -> None:
    node = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    node.attribute[0].type = onnx.AttributeProto.FLOAT
    assert "'axis'" in _refused(folder, _model([node], []), "NPUC-E0315", 4)


def test_out_of_order_nodes_are_sorted(folder: Path) -> None:
    nodes = [helper.make_node("Relu", ["h"], ["y"]), helper.make_node("MatMul", ["x", "w"], ["h"])]
    rc, err = _cli(folder, _model(nodes))
    assert rc == 0, err


def test_converter_failure_is_coded(folder: Path) -> None:
    """A `repeats` of rank 2 passes the schema check; the converter's TypeError becomes E0311."""
    reps = numpy_helper.from_array(np.array([[1, 2]], np.int64), "reps")
    m = _model([helper.make_node("Tile", ["x", "reps"], ["y"])], [reps])
    _refused(folder, m, "NPUC-E0311", 2)


# -- initializer data --------------------------------------------------------------------

@pytest.mark.parametrize("raw", [W.tobytes()[:-4], W.tobytes() + b"\0" * 4, b""], ids=["short", "long", "empty"])
def test_raw_data_size(folder: Path, raw: bytes) -> None:
    t = numpy_helper.from_array(W, "w")
    t.raw_data = raw
    assert "'w'" in _refused(folder, _model(inits=[t]), "NPUC-E0316", 4)


def test_typed_data_count(folder: Path) -> None:
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 7], float_data=[1.0] * 27)
    _refused(folder, _model(inits=[t]), "NPUC-E0316", 4)


def test_negative_dim(folder: Path) -> None:
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[-4, -7], raw_data=W.tobytes())
    assert "negative" in _refused(folder, _model(inits=[t]), "NPUC-E0316", 4)


def test_external_length_shorter_than_dims(folder: Path) -> None:
    _refused(folder, _model(inits=[_external("weights.bin", "0", "100")]), "NPUC-E0316", 4)


# -- external data -----------------------------------------------------------------------

@pytest.mark.parametrize("location", ["../secret.bin", "sub/../../secret.bin", "ABS", "/etc/passwd"])
def test_location_outside_folder(folder: Path, location: str) -> None:
    location = str(folder.parent / "secret.bin") if location == "ABS" else location
    _refused(folder, _model(inits=[_external(location)]), "NPUC-E0317", 4)
    _no_secret(folder)


def test_symlink_out_of_folder(folder: Path) -> None:
    (folder / "link.bin").symlink_to(folder.parent / "secret.bin")
    assert "out of the model's folder" in _refused(folder, _model(inits=[_external("link.bin")]), "NPUC-E0317", 4)
    _no_secret(folder)


def test_symlink_inside_folder_is_followed(folder: Path) -> None:
    (folder / "sub").mkdir()
    (folder / "sub" / "w.bin").write_bytes(W.tobytes())
    (folder / "link.bin").symlink_to(folder / "sub" / "w.bin")
    rc, err = _cli(folder, _model(inits=[_external("link.bin")]))
    assert rc == 0, err


@pytest.mark.parametrize("how", ["symlink", "absolute"])
def test_dev_zero(folder: Path, how: str) -> None:
    if how == "symlink":
        (folder / "zero.bin").symlink_to("/dev/zero")
    _refused(folder, _model(inits=[_external("zero.bin" if how == "symlink" else "/dev/zero")]), "NPUC-E0317", 4,
             _subprocess)


def test_fifo(folder: Path) -> None:
    os.mkfifo(folder / "pipe.bin")
    err = _refused(folder, _model(inits=[_external("pipe.bin")]), "NPUC-E0317", 4, _subprocess)
    assert "not a regular file" in err


def test_fifo_inside_a_folder_link(folder: Path) -> None:
    os.mkfifo(folder.parent / "pipe")
    (folder / "p.bin").symlink_to(folder.parent / "pipe")
    _refused(folder, _model(inits=[_external("p.bin")]), "NPUC-E0317", 4, _subprocess)


@pytest.mark.parametrize("location", ["adir", "missing.bin", ""])
def test_not_a_file(folder: Path, location: str) -> None:
    (folder / "adir").mkdir()
    _refused(folder, _model(inits=[_external(location)]), "NPUC-E0317", 4)


@pytest.mark.parametrize("offset", ["abc", "-4", "1_0", " 4", "+4", "\u0661\u0662", "4.0"])
def test_bad_offset(folder: Path, offset: str) -> None:
    assert "offset" in _refused(folder, _model(inits=[_external("weights.bin", offset)]), "NPUC-E0317", 4)


def test_bad_length(folder: Path) -> None:
    assert "length" in _refused(folder, _model(inits=[_external("weights.bin", "0", "x")]), "NPUC-E0317", 4)


@pytest.mark.parametrize("offset", ["4", "112", "99999999999999"])
def test_offset_past_end(folder: Path, offset: str) -> None:
    assert "past the end" in _refused(folder, _model(inits=[_external("weights.bin", offset)]), "NPUC-E0317", 4)


def test_constant_attribute_external(folder: Path) -> None:
    """A Constant's tensor has no folder to be relative to: its external data is refused."""
    t = _external(str(folder.parent / "secret.bin"), name="c")
    nodes = [helper.make_node("Constant", [], ["c"], value=t), helper.make_node("MatMul", ["x", "c"], ["y"])]
    _refused(folder, _model(nodes, []), "NPUC-E0317", 4)
    _no_secret(folder)


def test_external_data_compiles(folder: Path) -> None:
    rc, err = _cli(folder, _model(inits=[_external("weights.bin", "0", str(W.nbytes))]))
    assert rc == 0, err
    assert [p.name for p in _outputs(folder)] == ["m.om"]


def test_int4_source_checks_its_path(folder: Path) -> None:
    """onnx_quant's INT4 initializers go through the same path check."""
    from npuc.compiler.onnx_quant import int4_source

    t = _external("../secret.bin")
    t.data_type = TensorProto.INT4
    with pytest.raises(NpucError) as e:
        int4_source(t, str(folder))
    assert e.value.code == "NPUC-E0317"


def test_weights_reader_refuses_non_regular_files(folder: Path) -> None:
    from npuc.compiler.weights import file_range_chunks

    os.mkfifo(folder / "pipe")
    for path in (str(folder / "pipe"), "/dev/zero"):
        with pytest.raises(NpucError) as e:
            next(file_range_chunks(path, 0, 16, "w"))
        assert e.value.code == "NPUC-E0401"


# -- input dims (issue 35) ---------------------------------------------------------------

def test_negative_input_dim(folder: Path) -> None:
    """Was an internal ShapeError ("pad [0, 0, 5, 0] (constant) does not fit f32[-5,16]")."""
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [])
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = -5
    assert "dim 0 as -5" in _refused(folder, m, "NPUC-E0315", 4)


def _positions_model() -> ModelProto:
    """y = x + range(n) over a dynamic n: constants sized by the input's dim."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "sequence_length"])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT), helper.make_node("Add", ["x", "rf"], ["y"])]
    inits = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in (("zero", 0), ("one", 1))]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("shape", ["sequence_length:99999999999", "x:1,99999999999", "x:1,-5"])
def test_absurd_or_negative_input_shape(folder: Path, shape: str) -> None:
    """Was an out-of-memory internal error while the constants were built (a -5: refused as before)."""
    path = _save(folder, _positions_model())
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(path), "--input_shape", shape, "--output",
                        str(folder / "out" / "m")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("npuc: error NPUC-E0101: ") and "Traceback" not in r.stderr, r.stderr
    assert "99,999,999,999 elements" in r.stderr or "-5" in r.stderr
    assert _outputs(folder) == []


def test_a_model_declaring_an_absurd_static_shape_is_refused() -> None:
    from npuc.compiler.shapes import DeclaredInput, resolve_input_shapes

    with pytest.raises(NpucError) as e:
        resolve_input_shapes(None, {"x": DeclaredInput("f32", (1, 2**31))})
    assert e.value.code == "NPUC-E0101" and "declares 2,147,483,648 elements" in e.value.message
