"""`--quant_type` end to end: every test architecture (DeepSeek's routed experts included)
compiles from its Hugging Face folder and from ONNX, and the .om computes what HF computes
over the same weights rounded as npuc documents (docs/quantization.md): every product's
weight and the embedding in the layers' format, the LM head in int8 under w4a16, a K the
group does not divide in int8 per channel, the router and MLA's absorbed kv_b_proj left as
they are."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import ARCHS, prefill_vs_hf

from npuc.compiler.driver import compile_model
from npuc.ir.quant import dequantize_ref, quantize_rtn
from npuc.runtime import Session

GROUP = 32  # the tiny models' K are 16..128
QUANTS = [("w8a16", 8), ("w4a16", 4)]


def fake_quantized(model: Any, bits: int) -> Any:
    """A copy of `model` whose weights are what the quantized .om reads, dequantized."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            # norms and biases; the MoE router; MLA's kv_b_proj (folded into mla_attention's operands)
            if p.dim() not in (2, 3) or name.endswith(("mlp.gate.weight", "kv_b_proj.weight")):
                continue
            b, g = (bits, GROUP if bits == 4 else p.shape[-1])
            if name == "lm_head.weight" or p.shape[-1] % g:
                b, g = 8, p.shape[-1]  # the LM head, and a K the group does not divide: int8 per channel
            q, s, z = quantize_rtn(p.data, b, g, symmetric=b == 8)
            p.copy_(dequantize_ref(q, s, z, b, g))
    return m


@pytest.fixture(scope="module")
def hf_models(hf_checkpoints: dict[str, Path], moe_checkpoint: Path) -> dict[str, Any]:
    import transformers as tf

    paths = {**hf_checkpoints, "deepseek_v3_moe": moe_checkpoint}
    return {arch: tf.AutoModelForCausalLM.from_pretrained(str(p)).eval() for arch, p in paths.items()}


@pytest.mark.parametrize("quant, bits", QUANTS)
@pytest.mark.parametrize("arch", [*ARCHS, "deepseek_v3_moe"])
def test_quantized_hf_folder_matches_hf_over_rounded_weights(arch: str, quant: str, bits: int,
                                                             hf_checkpoints: dict[str, Path], moe_checkpoint: Path,
                                                             hf_models: dict[str, Any], tmp_path: Path) -> None:
    src = moe_checkpoint if arch == "deepseek_v3_moe" else hf_checkpoints[arch]
    # force_fp32: the products in f32, so the comparison is exact up to summation order
    om = compile_model(str(src), input_shape="input_ids:1,8", output=str(tmp_path / "q"), quant_type=quant,
                       group_size=GROUP if bits == 4 else None, precision_mode="force_fp32")
    sess = Session.load(om)
    steps = sess.programs[next(iter(sess.programs))].steps
    ops = [st.opdef.name for st in steps]
    assert "qlinear" in ops and "linear" not in ops, ops
    # the only dequantize left is the embedding's rows, [1, 8, hidden]: no weight is unpacked whole
    assert all(len(sess.tensors[st.outputs[0]].shape) == 3 and sess.tensors[st.outputs[0]].shape[:2] == (1, 8)
               for st in steps if st.opdef.name == "dequantize"), ops
    if arch == "deepseek_v3_moe":
        assert "qmoe" in ops and "fused_moe" not in ops, ops
    assert prefill_vs_hf(sess, fake_quantized(hf_models[arch], bits)) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_onnx_matches_hf_over_rounded_weights(arch: str, onnx_exports: dict[tuple[str, int], Path],
                                                        hf_models: dict[str, Any], tmp_path: Path) -> None:
    om = compile_model(str(onnx_exports[(arch, 18)]), input_shape="input_ids:1,8", output=str(tmp_path / "q"),
                       quant_type="w4a16", group_size=GROUP, precision_mode="force_fp32")
    sess = Session.load(om)
    assert "qlinear" in {st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps}
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    (got,) = sess.run({sess.inputs[0].name: ids}).values()
    with torch.no_grad():
        want = fake_quantized(hf_models[arch], 4)(ids, use_cache=False).logits
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("soc, act", [("cpu", torch.float32), ("npu", torch.bfloat16)])
def test_quantized_activations_follow_the_target(soc: str, act: torch.dtype, hf_checkpoints: dict[str, Path],
                                                  hf_models: dict[str, Any], tmp_path: Path) -> None:
    """The default precision mode: the npu target's quantized products read bf16 (its matrix
    unit's operands, with a cast either side), the cpu target's the model's f32, with no
    casts, and so match the rounded model as closely as force_fp32 does."""
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / soc),
                       quant_type="w4a16", group_size=GROUP, soc_version=soc)
    sess = Session.load(om)
    steps = sess.programs[next(iter(sess.programs))].steps
    qx = {sess.tensors[st.inputs[0]].dtype.torch for st in steps if st.opdef.name == "qlinear"}
    assert qx == {act}
    assert ("cast" in {st.opdef.name for st in steps}) == (soc == "npu")
    err = prefill_vs_hf(sess, fake_quantized(hf_models["llama"], 4))
    assert err < 1e-4 if soc == "cpu" else 1e-4 < err < 0.05


def test_quantized_moe_generates_in_the_default_mode(moe_checkpoint: Path, hf_models: dict[str, Any],
                                                     tmp_path: Path) -> None:
    """The default mode gives the quantized products bf16 activations: close to the rounded
    model, and a KV-cache program pair generates from it."""
    from npuc.apps.generate import generate

    om = compile_model(str(moe_checkpoint), input_shape="input_ids:1,8", output=str(tmp_path / "g"),
                       quant_type="w4a16", group_size=GROUP, max_seq_len=32)
    sess = Session.load(om)
    assert "qmoe" in {st.opdef.name for st in sess.programs["decode"].steps}
    assert prefill_vs_hf(sess, fake_quantized(hf_models["deepseek_v3_moe"], 4), "prefill") < 0.05
    assert len(generate(sess, [5, 17, 3, 99], 8, ignore_eos=True)) == 8
