"""The fusions fire on every architecture and every export path: golden op counts of the
final program for torch.export and ONNX at opsets 18 and 23, and numerics after fusion."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ONNX_OPSETS
from hf_models import ARCHS

LAYERS = 2
# Per architecture: one fused attention per layer, RoPE on q and k, every norm one rms_norm
# (DeepSeek's MLA adds q_a and kv_a norms), one SwiGLU per MLP; the only adds left are the two
# residuals per layer (Qwen2's q/k/v biases are fused into their linears).
GOLDEN = {
    "llama": {"fused_attention": 2, "rope_lut": 4, "rms_norm": 5, "swiglu": 2, "linear": 15, "add": 4},
    "qwen2": {"fused_attention": 2, "rope_lut": 4, "rms_norm": 5, "swiglu": 2, "linear": 15, "add": 4},
    "mistral": {"fused_attention": 2, "rope_lut": 4, "rms_norm": 5, "swiglu": 2, "linear": 15, "add": 4},
    "phi3": {"fused_attention": 2, "rope_lut": 4, "rms_norm": 5, "swiglu": 2, "linear": 9, "add": 4},
    # MLA: the per-head key/value expansion (kv_b_proj) is absorbed into one mla_attention per layer
    "deepseek_v3": {"mla_attention": 2, "fused_attention": 0, "rope_lut": 4, "rms_norm": 9, "swiglu": 2,
                    "linear": 15, "add": 4},
}
# Nothing of the unfused forms may be left: no softmax, pow, mean, trigonometry, rotate-half
# negation, sigmoid gate, separate rsqrt, matmul with a weight, or bias add.
FORBIDDEN = {"softmax", "pow", "reduce_mean", "cos", "sin", "neg", "sigmoid", "silu", "rsqrt", "sdpa",
             "rotary_embedding", "is_nan", "where", "matmul", "div", "sqrt", "reciprocal"}
PATHS = ["torch"] + [f"onnx{o}" for o in ONNX_OPSETS]


def _source(arch: str, path: str, hf: dict[str, Path], onnx_exports: dict[tuple[str, int], Path]) -> str:
    return str(hf[arch]) if path == "torch" else str(onnx_exports[(arch, int(path[4:]))])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_golden_op_counts(arch: str, path: str, hf_checkpoints: dict[str, Path],
                          onnx_exports: dict[tuple[str, int], Path]) -> None:
    from npuc.compiler.driver import build_graph
    from npuc.passes.manager import PassManager
    from npuc.passes.pipeline import default_pipeline

    g, _ = build_graph(_source(arch, path, hf_checkpoints, onnx_exports), "input_ids:1,16")
    g = PassManager(default_pipeline(), verify_each=True).run(g)
    ops = Counter(n.op for n in g.nodes)
    got = {k: ops.get(k, 0) for k in GOLDEN[arch]}
    assert got == GOLDEN[arch], f"{arch}/{path}: {dict(ops)}"
    assert not FORBIDDEN & set(ops), f"{arch}/{path} keeps {sorted(FORBIDDEN & set(ops))}: {dict(ops)}"
    # Every attention is causal through the flag, not a mask operand.
    for n in g.nodes:
        if n.op in ("fused_attention", "mla_attention"):
            assert n.attrs["causal"] and len(n.inputs) == (3 if n.op == "fused_attention" else 5), n


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_program_matches_the_source(arch: str, path: str, hf_checkpoints: dict[str, Path],
                                          onnx_exports: dict[tuple[str, int], Path], tmp_path: Path) -> None:
    import npuc

    src = _source(arch, path, hf_checkpoints, onnx_exports)
    sess = npuc.load(npuc.compile(src, input_shape="input_ids:1,16", output=str(tmp_path / "m")), executor="torch")
    ids = np.random.default_rng(3).integers(0, 128, size=(1, 16), dtype=np.int64)
    got = next(iter(sess.run({"input_ids": ids}).values())).numpy()
    if path == "torch":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
        with torch.no_grad():
            ref = model(torch.from_numpy(ids)).logits.numpy()
    else:
        import onnxruntime as ort

        ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]
    assert float(np.abs(got - ref).max()) < 1e-4
