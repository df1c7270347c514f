"""ONNX's own node test cases through npuc's ONNX backend (`npuc.onnx_backend`).

A case is in scope iff the declared support (`SUPPORTED_OPS`, `SUPPORTED_OPSETS`,
`SUPPORTED_ELEM_TYPES`, `COMPILE_TIME_OPERANDS`) covers its model; each one is compiled
to a `.om`, run, and compared with ONNX's runner's tolerances. docs/onnx-conformance.md
describes the run and is generated from it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from compile_pool import CompilePool
from onnx import TensorProto, helper

from npuc.errors import NpucError
from npuc.onnx_backend import (
    CaseResult,
    NpucBackend,
    case_dirs,
    failures,
    out_of_scope,
    report,
    run_cases,
    summary,
)

ROOT = Path(__file__).resolve().parent.parent
MIN_PASS_RATE = 0.98
MIN_EXTENDED_PASS_RATE = 0.95


@pytest.fixture(scope="module")
def results() -> list[CaseResult]:
    """Every case, in two worker processes (each compiles and runs half the cases)."""
    dirs = case_dirs()
    with CompilePool() as pool:
        halves = [pool.run(run_cases, dirs[i::2]) for i in range(2)]
        return [r for half in halves for r in half.result()]


def _listing(fails: list[CaseResult]) -> str:
    return "\n".join(f"  {r.name}{f' ({r.variant})' if r.variant else ''}: {r.reason}" for r in fails)


def test_in_scope_node_cases_pass(results: list[CaseResult]) -> None:
    n, passed, rate = summary(results)
    fails = failures(results)
    print(f"\nONNX node tests in scope: {n}, passed {passed} ({rate:.1%}); failures:\n{_listing(fails)}")
    assert n >= 700, f"only {n} cases in scope: did the declared support shrink?"
    assert rate >= MIN_PASS_RATE, f"{len(fails)} of {n} in-scope cases fail:\n{_listing(fails)}"


def test_extended_check_passes(results: list[CaseResult]) -> None:
    """Out-of-scope cases adapted without changing their meaning (re-declared opset, bound operands)."""
    n, passed, rate = summary(results, extended=True)
    fails = failures(results, extended=True)
    print(f"\nextended check: {n} adapted cases, passed {passed} ({rate:.1%}); failures:\n{_listing(fails)}")
    assert n >= 200  # fewer than in scope since opsets 11-16 and 24-25 are read as they are
    assert rate >= MIN_EXTENDED_PASS_RATE, _listing(fails)


def test_conformance_doc_is_current(results: list[CaseResult]) -> None:
    """The doc's figures and per-op table of in-scope cases follow the declared support."""
    doc = (ROOT / "docs/onnx-conformance.md").read_text()
    want = report(results)
    if f"onnx {onnx.__version__}:" not in doc:
        pytest.skip(f"docs/onnx-conformance.md was generated with another onnx than {onnx.__version__}")

    def scope_rows(text: str) -> list[str]:  # op and in-scope count: independent of numerics
        return re.findall(r"^\| `(\w+)` \| (\d+) \|", text, re.M)

    assert scope_rows(doc) == scope_rows(want), "regenerate: python -m npuc.onnx_backend --report > " \
                                                "docs/onnx-conformance.md"


# -- the backend itself ------------------------------------------------------------------

def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           opset: int = 23) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_outputs_come_back_in_the_models_order() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    m = _model([helper.make_node("Neg", ["x"], ["b"]), helper.make_node("Abs", ["x"], ["a"])],
               [x], [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("b", "a")])
    data = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    b, a = NpucBackend.run_model(m, [data])
    np.testing.assert_array_equal(b, -data)
    np.testing.assert_array_equal(a, np.abs(data))


def test_dynamic_dims_compile_per_input_shape() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    m = _model([helper.make_node("Softmax", ["x"], ["y"])], [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                                ["n", 4])])
    rep = NpucBackend.prepare(m)
    for n in (1, 3):
        data = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        (y,) = rep.run([data])
        e = np.exp(data - data.max(-1, keepdims=True))
        np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5)
    rep.close()


def test_unsupported_models_are_out_of_scope_and_refused() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    # Clip took min/max as attributes before opset 11: an opset-10 model that uses it means something
    # else read at 11 (one whose operators are unchanged up to 11 is read: test_onnx_frontend)
    old = _model([helper.make_node("Clip", ["x"], ["y"], min=0.0, max=1.0)], [x], [y], opset=10)
    unknown = _model([helper.make_node("Hardmax", ["x"], ["y"])], [x], [y])
    assert out_of_scope(old) == "opset 10" and out_of_scope(unknown) == "op Hardmax"
    assert not NpucBackend.is_compatible(old) and NpucBackend.supports_device("CPU")
    assert not NpucBackend.supports_device("CUDA")
    for m, code in ((old, "NPUC-E0310"), (unknown, "NPUC-E0301")):
        with pytest.raises(NpucError) as e:
            NpucBackend.prepare(m)
        assert e.value.code == code


def test_shape_operands_from_input_data_are_out_of_scope() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])
    from_data = _model([helper.make_node("Reshape", ["x", "s"], ["y"])], [x, s], [y])
    assert out_of_scope(from_data) == "operand Reshape input 1 from input data"
    shape_of = helper.make_node("Shape", ["x"], ["sh"])  # shapes are known at compile time, data is not
    rev = helper.make_node("Slice", ["sh", "b", "e", "ax", "st"], ["s2"])
    consts = [helper.make_node("Constant", [], [n], value_ints=[v]) for n, v in
              (("b", -1), ("e", -(2 ** 62)), ("ax", 0), ("st", -1))]
    from_shape = _model([shape_of, *consts, rev, helper.make_node("Reshape", ["x", "s2"], ["y"])], [x], [y])
    assert out_of_scope(from_shape) is None
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(NpucBackend.run_model(from_shape, [data])[0], data.reshape(3, 2))


def test_backend_never_evaluates_the_model_itself(tmp_path: Path) -> None:
    """prepare + run load neither onnxruntime nor onnx's reference evaluator."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from onnx import TensorProto, helper
        from npuc.onnx_backend import NpucBackend
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
        g = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
        a = np.eye(2, dtype=np.float32) * 3
        assert (NpucBackend.run_model(m, [a])[0] == a @ a).all()
        bad = sorted(k for k in sys.modules if k.startswith(("onnxruntime", "onnx.reference")))
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# -- operators older than opset 11 that kept their meaning (issue 35) ----------------------------

BOOLEAN_CASES = ["test_and2d", "test_and3d", "test_and4d", "test_and_bcast3v1d", "test_and_bcast3v2d",
                 "test_and_bcast4v2d", "test_and_bcast4v3d", "test_and_bcast4v4d", "test_not_2d", "test_not_3d",
                 "test_not_4d"]


@pytest.mark.parametrize("case", BOOLEAN_CASES)
def test_and_not_cases_at_their_own_opset_pass_in_scope(case: str) -> None:
    """ONNX writes these at opset 7 (And) and 1 (Not), the operators' latest versions: they were
    refused as opsets below 11 (NPUC-E0310), and so failed ONNX's own runner."""
    from npuc.onnx_backend import node_test_dir, run_case

    r = run_case(node_test_dir() / case, extended=False)
    assert r.scope is None and not r.variant, r.scope  # in scope as written, not adapted
    assert r.ok, r.reason


def test_an_old_opset_whose_operator_changed_is_still_refused(tmp_path: Path) -> None:
    """Softmax changed its meaning at opset 11 (and 13): a model at opset 7 is not read as at 11."""
    from npuc.compiler.driver import compile_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    for op, refused in (("Softmax", True), ("Not", False)):
        xt = helper.make_tensor_value_info("x", TensorProto.BOOL, [2, 3]) if op == "Not" else x
        yt = helper.make_tensor_value_info("y", TensorProto.BOOL, [2, 3]) if op == "Not" else y
        g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", [xt], [yt])
        path = tmp_path / f"{op}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 7)]), str(path))
        if refused:
            with pytest.raises(NpucError) as e:
                compile_model(str(path), output=str(tmp_path / op))
            assert e.value.code == "NPUC-E0310"
        else:
            compile_model(str(path), output=str(tmp_path / op))
