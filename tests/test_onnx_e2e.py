"""ONNX files from torch.onnx.export(dynamo=True) at opsets 18 and 23: `npuc compile`
then `npuc run`, against onnxruntime on the same file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ONNX_OPSETS
from hf_models import ARCHS

ort = pytest.importorskip("onnxruntime")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("opset", ONNX_OPSETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_onnx_export_matches_onnxruntime(arch: str, opset: int, onnx_exports: dict[tuple[str, int], Path],
                                         tmp_path: Path) -> None:
    model = onnx_exports[(arch, opset)]
    r = cli("compile", str(model), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "build/m"))
    assert r.returncode == 0, r.stderr
    ids = np.random.default_rng(7).integers(0, 128, size=(1, 16), dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    r = cli("run", str(tmp_path / "build/m.om"), "--input", f"input_ids={tmp_path / 'ids.npy'}",
            "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = sess.get_outputs()[0].name
    (ref,) = sess.run([name], {"input_ids": ids})
    got = np.load(tmp_path / "out" / f"{name}.npy")
    assert got.shape == ref.shape == (1, 16, 128)
    err = float(np.abs(got - ref).max())
    assert err < 1e-4, f"{arch} opset {opset}: max abs error {err}"
    assert float(np.abs(ref).max()) > 1e-3


def test_opset23_keeps_its_fused_ops(onnx_exports: dict[tuple[str, int], Path]) -> None:
    """At opset 23 the exporter emits Attention, RotaryEmbedding and RMSNormalization; they map to
    npuc ops one to one instead of being expanded."""
    from collections import Counter

    from npuc.compiler.driver import build_graph

    g, _ = build_graph(str(onnx_exports[("llama", 23)]), "input_ids:1,16")
    ops = Counter(n.op for n in g.nodes)
    assert ops["sdpa"] == 2 and ops["rotary_embedding"] == 4 and ops["rms_norm"] == 5
    # The mask and RoPE-table arithmetic of the dynamic export folded away at import.
    assert not {"cumsum", "gather_nd", "arange", "full"} & set(ops)
