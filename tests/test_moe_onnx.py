"""DeepSeek-V3 and V2 with routed mixture-of-experts layers, from ONNX files that
torch.onnx.export(dynamo=True) writes at opsets 18 and 23 (transformers' `batched_mm`
experts, a dynamic batch and sequence), compiled at a static shape: logits match HF eager
(its default looping experts) and onnxruntime on the same file, and the fusions fire.

The router exports to TopK, GatherElements, ScatterElements, Where, ReduceMax / ReduceSum;
each token-slot's expert weights to GatherND, which the frontend imports as `index`, the form
the torch frontend gives, so moe-fusion sees one form. V2's complex RoPE needs a complex
`aten::unsqueeze` the exporter lacks (`onnx_build.register_complex_unsqueeze`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import moe_config
from onnx_build import export_causal_lm, register_complex_unsqueeze
from test_deepseek_v2 import v2_config

from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session

ort = pytest.importorskip("onnxruntime")

ARCHS = {"deepseek_v3": moe_config, "deepseek_v2": v2_config}
OPSETS = [18, 23]


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    """Per architecture: HF eager with its default experts, and the same weights with `batched_mm`
    experts for the export (the default loops over the experts hit: a data-dependent shape)."""
    import transformers as tf

    out = {}
    for arch, config in ARCHS.items():
        torch.manual_seed(0)
        eager = tf.AutoModelForCausalLM.from_config(config()).eval()
        batched = tf.AutoModelForCausalLM.from_config(config(), experts_implementation="batched_mm").eval()
        batched.load_state_dict(eager.state_dict())
        out[arch] = (eager, batched)
    return out


@pytest.fixture(scope="module")
def onnx_file(hf_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str, int], Path]:
    """Each model exported once per opset, when a test first asks for it."""
    root = tmp_path_factory.mktemp("moe_onnx")
    cache: dict[tuple[str, int], Path] = {}

    def get(arch: str, opset: int) -> Path:
        if (arch, opset) not in cache:
            if arch == "deepseek_v2":
                register_complex_unsqueeze()
            cache[arch, opset] = Path(export_causal_lm(hf_models[arch][1], str(root / f"{arch}_{opset}.onnx"), opset))
        return cache[arch, opset]

    return get


def _compare(model: Path, eager: Any, out: Path, batch: int, seq: int) -> tuple[float, float, dict[str, Any]]:
    """Max abs error of npuc's logits vs HF eager and vs onnxruntime, and the fusion report."""
    report = out.parent / f"{out.name}_fusions.json"
    om = compile_model(str(model), input_shape=f"input_ids:{batch},{seq}", output=str(out), fusion_report=str(report))
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = eager(ids, use_cache=False).logits
    sess = Session.load(om)
    sess.arena.fill_(0xFF)  # nothing may read a slot before it is written
    got = sess.run({"input_ids": ids})["logits"]
    (rt,) = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["logits"],
                                                                                     {"input_ids": ids.numpy()})
    assert got.shape == ref.shape == rt.shape == (batch, seq, 128)
    return float((got - ref).abs().max()), float(np.abs(got.numpy() - rt).max()), json.loads(report.read_text())


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_moe_onnx_matches_hf_and_onnxruntime(arch: str, opset: int, hf_models: dict[str, Any],
                                             onnx_file: Callable[[str, int], Path], tmp_path: Path) -> None:
    err_hf, err_ort, rep = _compare(onnx_file(arch, opset), hf_models[arch][0], tmp_path / "m", 1, 8)
    ops = rep["op_counts"]
    print(f"\n{arch} opset {opset}: max abs error vs HF {err_hf:.2e}, vs onnxruntime {err_ort:.2e}; "
          f"ops {json.dumps(ops, sort_keys=True)}")
    assert err_hf < 1e-4 and err_ort < 1e-4, (err_hf, err_ort)
    # Two layers (the first dense, the second MoE with a shared expert), MLA attention, 9 RMSNorms
    # (2 per layer, q_a and kv_a per attention, the final one).
    assert ops["rms_norm"] == 9 and ops["rope_lut"] == 4
    assert ops.get("mla_attention") == 2 and "fused_attention" not in ops, ops  # one latent attention per layer
    assert "gather_nd" not in ops  # the experts' GatherND imported as `index`
    # The router and routed experts in one op; SwiGLU in the dense MLP and the shared expert.
    assert ops.get("fused_moe") == 1 and ops["swiglu"] == 2, ops
    assert not {"topk", "index", "scatter_elements", "scatter_nd"} & set(ops)


def test_dynamic_export_compiles_at_another_length(hf_models: dict[str, Any],
                                                   onnx_file: Callable[[str, int], Path], tmp_path: Path) -> None:
    """Five tokens from the file exported at [1, 8]."""
    err_hf, err_ort, _ = _compare(onnx_file("deepseek_v2", 23), hf_models["deepseek_v2"][0], tmp_path / "b", 1, 5)
    assert err_hf < 1e-4 and err_ort < 1e-4, (err_hf, err_ort)


def test_batch_the_export_did_not_trace_is_a_user_error(onnx_file: Callable[[str, int], Path], tmp_path: Path) -> None:
    """Traced at batch 1, the export's shape arithmetic fixes the batch (onnxruntime fails at
    batch 2 too); npuc says where, as a user error, while importing."""
    with pytest.raises(NpucError) as e:
        compile_model(str(onnx_file("deepseek_v3", 18)), input_shape="input_ids:2,5", output=str(tmp_path / "b"))
    assert e.value.code == "NPUC-E0311" and "at these shapes" in str(e.value)


@pytest.mark.parametrize(("data_shape", "idx"), [((5, 3, 2), [[[1], [-1]], [[4], [0]]]), ((4, 3), [2]),
                                                 ((6,), [[3], [-2], [0]])])
def test_gather_nd_of_the_leading_axis_is_index(data_shape: tuple[int, ...], idx: list[Any]) -> None:
    """GatherND whose indices address axis 0 alone (trailing dim 1, batch_dims 0), from input
    data and behind a Reshape as the exporter writes it, negative indices included."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    from npuc.onnx_backend import NpucBackend

    ix = np.array(idx, dtype=np.int64)
    nodes = [helper.make_node("Constant", [], ["shape"], value_ints=list(ix.shape)),
             helper.make_node("Reshape", ["i", "shape"], ["ix"]), helper.make_node("GatherND", ["x", "ix"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, data_shape),
                                       helper.make_tensor_value_info("i", TensorProto.INT64, [ix.size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ix.shape[:-1] + data_shape[1:])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(m)
    x = np.random.default_rng(0).standard_normal(data_shape).astype(np.float32)
    (want,) = ReferenceEvaluator(m).run(None, {"x": x, "i": ix.reshape(-1)})
    (got,) = NpucBackend.run_model(m, [x, ix.reshape(-1)])
    np.testing.assert_array_equal(got, want)
