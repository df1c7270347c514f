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
    return npuc.load(str(tmp / f"{name}.om"), executor="torch").run({"input_ids": ids})["logits"], low.weights_bytes


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
    sess = npuc.load(str(tmp_path / "h.om"), executor="torch")
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


DECODE = """graph decode(%x : f32[1,2,1,16], %k : f32[1,2,1,16], %pos : i64[1]) {
  const @w : f32[16,16]
  state %kv_cache.0.k : f32[1,2,32,16]
  %q : f32[1,2,1,16] = linear(%x, @w)
  %wk : f32[1,2,32,16] = kv_write(%kv_cache.0.k, %k, %pos)
  %o.cached : f32[1,2,1,16] = cached_attention[scale=0.25](%q, %wk, %wk, %pos)
  update %kv_cache.0.k = %wk
  return %o.cached
}
"""


def _decode(mode: str, keep: frozenset[str] = frozenset(), text: str = DECODE
            ) -> tuple[Graph, dict[str, list[str]]]:
    from npuc.ir import TensorSource, parse_graph, verify

    g = parse_graph(text)
    g.constants["w"].const = TensorSource(torch.randn(16, 16))
    res = Precision(mode, keep)(g)
    verify(g)
    return g, res.details


def test_filecheck_kv_cache_converts_with_its_attention() -> None:
    # the cache state takes the attention's dtype: kv_write writes bf16 rows, and the
    # attention reads the bf16 cache (a cast of the whole cache per step would be the alternative)
    g, details = _decode("allow_mix_precision_bf16")
    assert details["caches"] == ["kv_cache.0.k bf16"] and details["converted"] == ["q", "o.cached"]
    assert str(g) == """graph decode(%x : f32[1,2,1,16], %k : f32[1,2,1,16], %pos : i64[1]) {
  const @w : f32[16,16]
  state %kv_cache.0.k : bf16[1,2,32,16]
  %x_bf16 : bf16[1,2,1,16] = cast[dtype=bf16](%x)
  %w_bf16 : bf16[16,16] = cast[dtype=bf16](@w)
  %q_bf16 : bf16[1,2,1,16] = linear(%x_bf16, %w_bf16)
  %k_bf16 : bf16[1,2,1,16] = cast[dtype=bf16](%k)
  %wk : bf16[1,2,32,16] = kv_write(%kv_cache.0.k, %k_bf16, %pos)
  %o.cached_bf16 : bf16[1,2,1,16] = cached_attention[scale=0.25](%q_bf16, %wk, %wk, %pos)
  %o.cached : f32[1,2,1,16] = cast[dtype=f32](%o.cached_bf16)
  update %kv_cache.0.k = %wk
  return %o.cached
}
"""


@pytest.mark.parametrize("mode, cache", [
    ("must_keep_origin_dtype", DType.f32), ("force_fp32", DType.f32), ("force_fp16", DType.f16),
    ("allow_fp32_to_fp16", DType.f16), ("allow_mix_precision_bf16", DType.bf16),
    ("allow_fp32_to_bf16", DType.bf16)])
def test_cache_dtype_follows_the_mode(mode: str, cache: DType) -> None:
    g, _ = _decode(mode)
    assert g.states["kv_cache.0.k"].type.dtype == cache
    assert g.outputs[0].producer is not None and g.outputs[0].producer.inputs[0].type.dtype == cache


@pytest.mark.parametrize("keep", ["o", "o.cached"])
def test_a_kept_attention_keeps_its_cache(keep: str) -> None:
    # prefill's attention is `o`, decode's `o.cached`: either name keeps both, so the
    # programs agree on the state they share
    g, details = _decode("force_fp16", frozenset({keep}))
    assert g.states["kv_cache.0.k"].type.dtype == DType.f32
    assert details["kept"] == ["o.cached"] and details["converted"] == ["q"] and not details["caches"]


def test_a_reader_of_a_cache_kept_for_another_stays_in_its_dtype() -> None:
    # two readers that disagree (one kept): the cache stays f32 and the other reader with it
    two = DECODE.replace("  update", "  %p : f32[1,2,1,16] = cached_attention[scale=0.25](%q, %wk, %wk, %pos)\n"
                         "  update").replace("return %o.cached", "return %o.cached, %p")
    g, details = _decode("allow_fp32_to_fp16", frozenset({"o"}), two)
    assert g.states["kv_cache.0.k"].type.dtype == DType.f32
    assert details["kept"] == ["o.cached"] and details["reads_state"] == ["p"] and not details["caches"]


def test_round_trips_collapse_through_layout_ops() -> None:
    # cast[bf16](transpose(reshape(cast[f32](%a : bf16)))) -> transpose(reshape(%a)): exact moves
    from npuc.ir import TensorSource, parse_graph, verify

    g = parse_graph("""graph main(%x : f32[1,2,32]) {
  const @w : f32[32,32]
  %a : f32[1,2,32] = linear(%x, @w)
  %r : f32[1,2,2,16] = reshape[shape=[1,2,2,16]](%a)
  %t : f32[1,2,2,16] = transpose[perm=[0,2,1,3]](%r)
  %o : f32[1,2,2,16] = fused_attention[causal=true, scale=0.25](%t, %t, %t)
  return %o
}
""")
    g.constants["w"].const = TensorSource(torch.randn(32, 32))
    Precision("allow_mix_precision_bf16")(g)
    verify(g)
    assert str(g) == """graph main(%x : f32[1,2,32]) {
  const @w : f32[32,32]
  %x_bf16 : bf16[1,2,32] = cast[dtype=bf16](%x)
  %w_bf16 : bf16[32,32] = cast[dtype=bf16](@w)
  %a_bf16 : bf16[1,2,32] = linear(%x_bf16, %w_bf16)
  %r_bf16 : bf16[1,2,2,16] = reshape[shape=[1,2,2,16]](%a_bf16)
  %t_bf16 : bf16[1,2,2,16] = transpose[perm=[0,2,1,3]](%r_bf16)
  %o_bf16 : bf16[1,2,2,16] = fused_attention[causal=true, scale=0.25](%t_bf16, %t_bf16, %t_bf16)
  %o : f32[1,2,2,16] = cast[dtype=f32](%o_bf16)
  return %o
}
"""


def test_allow_fp32_to_bf16_is_the_bf16_mode() -> None:
    from npuc.passes.precision import check_mode

    assert check_mode("allow_fp32_to_bf16") == "allow_mix_precision_bf16"
    assert str(_decode("allow_fp32_to_bf16")[0]) == str(_decode("allow_mix_precision_bf16")[0])
    with pytest.raises(NpucError) as info:
        check_mode("allow_fp32_to_bf8")
    assert "allow_fp32_to_bf16" in str(info.value.hint)  # the hint lists it
