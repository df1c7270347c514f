"""ONNX files as optimum (tests/data/optimum) and the TorchScript exporter
(tests/data/torchscript: torch.onnx.export with dynamo=False) write them: compiled with
the dims bound by name, matching onnxruntime, and fused as npuc's own exports are
(attention, RoPE as a LUT although its cos/sin are computed from the position_ids input,
RMSNorm, SwiGLU per layer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import npuc
from npuc.compiler.driver import compile_model

ort = pytest.importorskip("onnxruntime")
DATA = Path(__file__).parent / "data"
LAYERS = 2
FILES = ["optimum/llama_opset18", "optimum/llama_opset14", "optimum/qwen2_opset18", "torchscript/llama_opset14",
         "torchscript/llama_opset17", "torchscript/qwen2_opset14", "torchscript/qwen2_opset17"]


@pytest.mark.parametrize("name", FILES)
def test_exporter_output_compiles_fused_and_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    path = DATA / f"{name}.onnx"
    sess = npuc.load(npuc.compile(str(path), input_shape="batch_size:1;sequence_length:8", output=str(tmp_path / "m")), executor="torch")
    ops = [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    assert {op: ops.count(op) for op in ("fused_attention", "rope_lut", "rms_norm", "swiglu")} == \
        {"fused_attention": LAYERS, "rope_lut": 2 * LAYERS, "rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert not {"cos", "sin", "neg", "softmax", "matmul"} & set(ops)
    rng = np.random.default_rng(0)
    for start in (0, 100):  # positions as a chunked prefill would give them
        feeds = {"input_ids": rng.integers(0, 128, (1, 8)).astype(np.int64),
                 "attention_mask": np.ones((1, 8), np.int64),
                 "position_ids": np.arange(start, start + 8, dtype=np.int64)[None]}
        got = sess.run(feeds)["logits"].numpy()
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class _Rope(torch.nn.Module):
    """q rotated by tables computed from the position_ids input (HF's rotary embedding); with
    `by_max`, each angle divided by the largest position (a scaling no per-position table holds)."""

    def __init__(self, by_max: bool) -> None:
        super().__init__()
        self.inv = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
        self.by_max = by_max

    def forward(self, q: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        p = position_ids.float()
        if self.by_max:
            p = p / (position_ids.amax(-1, keepdim=True).float() + 1)
        f = (self.inv[None, :, None] @ p[:, None, :]).transpose(1, 2)
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        rot = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
        return q * cos + rot * sin


@pytest.mark.parametrize("by_max", [False, True])
def test_rope_tables_from_position_ids(by_max: bool, tmp_path: Path) -> None:
    """Per-position tables become a rope_lut over the position_ids input; tables whose rows
    depend on other positions (a scaling by the largest) stay as they are, and still compute."""
    m = _Rope(by_max).eval()
    om = compile_model(m, input_shape="q:1,2,8,16;position_ids:1,8", input_dtypes={"position_ids": "int64"},
                       output=str(tmp_path / "r"))
    sess = npuc.load(om, executor="torch")
    ops = [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    assert ("rope_lut" in ops) is not by_max
    q = torch.randn(1, 2, 8, 16)
    for pos in (torch.arange(8)[None], torch.arange(300, 308)[None]):
        got = sess.run({"q": q.numpy(), "position_ids": pos.numpy()})[next(iter(sess.outputs)).name]
        with torch.no_grad():
            np.testing.assert_allclose(got.numpy(), m(q, pos).numpy(), rtol=1e-4, atol=1e-5)


class _TokenPositions(_Rope):
    """Positions counted from the tokens (a cumsum of the non-padding ids, as some models make
    them): the only integer input is the token ids, and a row depends on every earlier token."""

    def forward(self, q: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(q, (position_ids != 0).long().cumsum(-1) - 1)


def test_positions_from_the_tokens_are_not_rope_positions(tmp_path: Path) -> None:
    m = _TokenPositions(False).eval()
    om = compile_model(m, input_shape="q:1,2,8,16;position_ids:1,8", input_dtypes={"position_ids": "int64"},
                       output=str(tmp_path / "t"))
    sess = npuc.load(om, executor="torch")
    assert "rope_lut" not in [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    q, ids = torch.randn(1, 2, 8, 16), torch.tensor([[5, 0, 7, 7, 0, 3, 9, 1]])
    got = sess.run({"q": q.numpy(), "position_ids": ids.numpy()})[next(iter(sess.outputs)).name]
    with torch.no_grad():
        np.testing.assert_allclose(got.numpy(), m(q, ids).numpy(), rtol=1e-4, atol=1e-5)


def _ort_optimized(src: Path, out: Path) -> Path:
    """onnxruntime's transformer optimizer on `src`, as users run it before deploying:
    SimplifiedLayerNormalization, com.microsoft SkipSimplifiedLayerNormalization and
    RotaryEmbedding replace the exporter's ops."""
    from onnxruntime.transformers import optimizer

    m = optimizer.optimize_model(str(src), model_type="gpt2", num_heads=4, hidden_size=64, opt_level=0)
    m.save_model_to_file(str(out))
    return out


@pytest.mark.parametrize("name", ["torchscript/llama_opset17", "optimum/qwen2_opset18", "optimum/llama_with_past_opset18"])
def test_onnxruntime_optimizer_output_compiles_fused_and_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    import onnx

    path = _ort_optimized(DATA / f"{name}.onnx", tmp_path / "opt.onnx")
    kinds = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding"} <= kinds
    past = "with_past" in name
    shape = "batch_size:1;sequence_length:8" + (";past_sequence_length:0" if past else "")
    sess = npuc.load(npuc.compile(str(path), input_shape=shape, output=str(tmp_path / "m")), executor="torch")
    ops = [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    assert {op: ops.count(op) for op in ("fused_attention", "rope_lut", "rms_norm", "swiglu")} == \
        {"fused_attention": LAYERS, "rope_lut": 2 * LAYERS, "rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    rng = np.random.default_rng(2)
    feeds = {"input_ids": rng.integers(0, 128, (1, 8)).astype(np.int64), "attention_mask": np.ones((1, 8), np.int64),
             "position_ids": np.arange(8, dtype=np.int64)[None]}
    pasts = {f"past_key_values.{i}.{kv}": np.zeros((1, 2, 0, 16), np.float32)
             for i in range(LAYERS) for kv in ("key", "value")} if past else {}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], {**feeds, **pasts})[0]
    np.testing.assert_allclose(sess.run({**feeds, **pasts})["logits"].numpy(), want, rtol=1e-4, atol=1e-4)
