"""The precision pass: modes, keep-lists, f32 accumulation, RoPE tables."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import npuc
from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph
from npuc.passes.manager import PassManager
from npuc.passes.pipeline import default_pipeline
from npuc.passes.precision import Precision


def _fused(hf: dict[str, Path]) -> Graph:
    from npuc.compiler.driver import build_graph

    g, _ = build_graph(str(hf["llama"]), "input_ids:1,16")
    return PassManager(default_pipeline(), verify_each=True).run(g)


def _run(g: Graph, tmp: Path, name: str) -> tuple[torch.Tensor, int]:
    low = lower(g, get_target("cpu"))
    write_om(low, str(tmp / f"{name}.om"))
    ids = np.random.default_rng(0).integers(0, 128, size=(1, 16))
    return npuc.load(str(tmp / f"{name}.om")).run({"input_ids": ids})["logits"], low.weights_bytes


@pytest.fixture(scope="module")
def reference(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, int]:
    return _run(_fused(hf_checkpoints), tmp_path_factory.mktemp("ref"), "ref")


@pytest.mark.parametrize("mode, dtype, tol", [
    ("force_fp16", DType.f16, 5e-3), ("allow_fp32_to_fp16", DType.f16, 5e-3),
    ("allow_mix_precision_bf16", DType.bf16, 5e-2)])
def test_modes_cast_weights_and_compute(mode: str, dtype: DType, tol: float, hf_checkpoints: dict[str, Path],
                                        reference: tuple[torch.Tensor, int], tmp_path: Path) -> None:
    g = _fused(hf_checkpoints)
    res = Precision(mode)(g)
    PassManager(default_pipeline()[-3:], verify_each=True).run(g)
    linears = [n for n in g.nodes if n.op == "linear"]
    assert linears and all(n.outputs[0].type.dtype == dtype for n in linears)
    assert all(n.inputs[1].type.dtype == dtype and n.inputs[1].is_const for n in linears)  # weights stored converted
    if mode == "force_fp16":
        assert all(n.outputs[0].type.dtype == DType.f16 for n in g.nodes if n.op in ("rms_norm", "swiglu"))
    else:  # only the matrix unit converts
        assert all(n.outputs[0].type.dtype == DType.f32 for n in g.nodes if n.op == "rms_norm")
    assert g.outputs[0].type.dtype == DType.f32  # the user sees the model's own output dtype
    out, wbytes = _run(g, tmp_path, mode)
    ref, ref_bytes = reference
    assert wbytes < 0.6 * ref_bytes
    err = float((out - ref).abs().max())
    assert 0 < err < tol, err
    assert res.details["converted"]


def test_keep_dtype_and_origin_mode(hf_checkpoints: dict[str, Path]) -> None:
    g = _fused(hf_checkpoints)
    first = next(n for n in g.nodes if n.op == "linear")
    Precision("force_fp16", keep=frozenset({first.name}))(g)
    kept = next(n for n in g.nodes if n.outputs[0].name == first.outputs[0].name)
    assert kept.op == "linear" and kept.outputs[0].type.dtype == DType.f32
    assert Counter(n.outputs[0].type.dtype for n in g.nodes if n.op == "linear")[DType.f16] == 14
    g2 = _fused(hf_checkpoints)
    before = str(g2)
    assert not Precision("must_keep_origin_dtype")(g2).modified and str(g2) == before


def test_rope_tables_stay_f32_when_f16_would_change_them(hf_checkpoints: dict[str, Path]) -> None:
    g = _fused(hf_checkpoints)
    res = Precision("force_fp16", rope_table_tol=1e-6)(g)
    ropes = [n for n in g.nodes if n.op == "rope_lut"]
    assert ropes and all(n.inputs[2].type.dtype == DType.f32 and n.inputs[0].type.dtype == DType.f16 for n in ropes)
    assert res.details["rope_tables_f32"]
    assert all(d.split()[1] == "f32" for d in res.details["rope_tables"])  # "name kept-dtype change"
    g = _fused(hf_checkpoints)
    res = Precision("force_fp16")(g)  # within the default 1e-3, the tables go f16
    assert all(n.inputs[2].type.dtype == DType.f16 for n in g.nodes if n.op == "rope_lut")
    assert not res.details["rope_tables_f32"]
    name, dtype, change = res.details["rope_tables"][0].split()
    assert dtype == "f16" and 0 < float(change) <= 2 ** -12
    for mode in ("allow_fp32_to_fp16", "allow_mix_precision_bf16"):  # rope_lut is not a matrix-unit op
        g = _fused(hf_checkpoints)
        res = Precision(mode)(g)
        assert all(n.inputs[2].type.dtype == DType.f32 for n in g.nodes if n.op == "rope_lut")
        assert not res.details["rope_tables"]


def test_half_precision_reductions_accumulate_in_f32() -> None:
    from npuc.ir import get_op

    x = torch.full((1, 4096), 0.1, dtype=torch.float16)
    mean = get_op("reduce_mean").run([x], {"axes": (1,), "keepdim": False})[0]
    assert abs(float(mean) - 0.1) < 1e-3
    sm = get_op("softmax").run([torch.zeros(1, 4096, dtype=torch.float16)], {"axis": 1})[0]
    assert abs(float(sm.float().sum()) - 1.0) < 1e-2


def test_unknown_mode_is_a_usage_error() -> None:
    with pytest.raises(NpucError) as info:
        Precision("fp8_please")(Graph())
    assert info.value.code == "NPUC-E0117" and info.value.exit_code == 2


def test_cli_precision_flags(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import subprocess
    import sys

    keep = tmp_path / "keep.txt"
    keep.write_text("# stays f32\nlinear\n")
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(hf_checkpoints["llama"]), "--input_shape",
                        "input_ids:1,16", "--output", str(tmp_path / "h"), "--precision_mode=force_fp16",
                        "--keep_dtype", str(keep)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    sess = npuc.load(str(tmp_path / "h.om"))
    lin = [o for o in sess.program.ops if o.op == "linear"]
    dtypes = Counter(sess.tensors[o.outputs[0]].dtype for o in lin)
    assert dtypes == {DType.f32: 1, DType.f16: 14}
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(hf_checkpoints["llama"]), "--input_shape",
                        "input_ids:1,16", "--output", str(tmp_path / "x"), "--precision_mode", "fp3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "NPUC-E0117" in r.stderr and "Traceback" not in r.stderr


def test_filecheck_force_fp16() -> None:
    # each converted op reads casts and is cast back; the f16 round trip between ops collapses
    from npuc.ir import TensorSource, parse_graph

    g = parse_graph("""graph main(%x : f32[2,8]) {
  const @w : f32[8,8]
  %a : f32[2,8] = linear(%x, @w)
  %b : f32[2,8] = silu(%a)
  return %b
}
""")
    g.constants["w"].const = TensorSource(torch.randn(8, 8))
    Precision("force_fp16")(g)
    assert str(g) == """graph main(%x : f32[2,8]) {
  const @w : f32[8,8]
  %x_f16 : f16[2,8] = cast[dtype=f16](%x)
  %w_f16 : f16[8,8] = cast[dtype=f16](@w)
  %a_f16 : f16[2,8] = linear(%x_f16, %w_f16)
  %b_f16 : f16[2,8] = silu(%a_f16)
  %b : f32[2,8] = cast[dtype=f32](%b_f16)
  return %b
}
"""


def test_filecheck_kv_cache_readers_keep_the_cache_dtype() -> None:
    # kv_write writes the f32 state in place and cached_attention reads it: both stay f32
    # (converting the reader would cast the whole cache every step); the query's producer converts
    from npuc.ir import TensorSource, parse_graph

    g = parse_graph("""graph decode(%x : f32[1,2,1,16], %k : f32[1,2,1,16], %pos : i64[1]) {
  const @w : f32[16,16]
  state %kv_cache.0.k : f32[1,2,32,16]
  %q : f32[1,2,1,16] = linear(%x, @w)
  %wk : f32[1,2,32,16] = kv_write(%kv_cache.0.k, %k, %pos)
  %o : f32[1,2,1,16] = cached_attention[scale=0.25](%q, %wk, %wk, %pos)
  update %kv_cache.0.k = %wk
  return %o
}
""")
    g.constants["w"].const = TensorSource(torch.randn(16, 16))
    res = Precision("force_fp16")(g)
    assert res.details["reads_state"] == ["o"] and res.details["converted"] == ["q"]
    assert str(g) == """graph decode(%x : f32[1,2,1,16], %k : f32[1,2,1,16], %pos : i64[1]) {
  const @w : f32[16,16]
  state %kv_cache.0.k : f32[1,2,32,16]
  %x_f16 : f16[1,2,1,16] = cast[dtype=f16](%x)
  %w_f16 : f16[16,16] = cast[dtype=f16](@w)
  %q_f16 : f16[1,2,1,16] = linear(%x_f16, %w_f16)
  %q : f32[1,2,1,16] = cast[dtype=f32](%q_f16)
  %wk : f32[1,2,32,16] = kv_write(%kv_cache.0.k, %k, %pos)
  %o : f32[1,2,1,16] = cached_attention[scale=0.25](%q, %wk, %wk, %pos)
  update %kv_cache.0.k = %wk
  return %o
}
"""
