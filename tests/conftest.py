from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=FutureWarning)

from hf_models import ARCHS, GEN_ARCHS, GEN_MAX_SEQ, GEN_PREFILL, export_onnx, moe_config, save_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random-init checkpoint per architecture, saved once per session."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        save_checkpoint(arch, str(root / arch))
        out[arch] = root / arch
    return out


@pytest.fixture(scope="session")
def gen_models(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each GEN_ARCHS checkpoint compiled with --max_seq_len (one slot), once per session."""
    from compile_pool import CompilePool

    root = tmp_path_factory.mktemp("gen")
    with CompilePool() as pool:
        oms = {arch: pool.compile(str(hf_checkpoints[arch]), input_shape=f"input_ids:1,{GEN_PREFILL}",
                                  output=str(root / arch), max_seq_len=GEN_MAX_SEQ) for arch in GEN_ARCHS}
        return {arch: Path(om.result()) for arch, om in oms.items()}


ONNX_OPSETS = [18, 23]


@pytest.fixture(scope="session")
def onnx_exports(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[tuple[str, int], Path]:
    """Each tiny HF model exported with torch.onnx.export(dynamo=True) at opsets 18 and 23, once per session.

    Exported with a dynamic batch and sequence, as deployment exports usually are (in worker
    processes, an architecture each)."""
    from compile_pool import CompilePool

    root = tmp_path_factory.mktemp("onnx")
    out = {(arch, opset): root / f"{arch}_opset{opset}.onnx" for arch in hf_checkpoints for opset in ONNX_OPSETS}
    with CompilePool() as pool:
        done = [pool.run(export_onnx, str(ckpt), {opset: str(out[(arch, opset)]) for opset in ONNX_OPSETS})
                for arch, ckpt in hf_checkpoints.items()]
        for d in done:
            d.result()
    return out


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 with routed experts (hf_models.moe_config), saved once per session."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe") / "deepseek_v3_moe"
    tf.AutoModelForCausalLM.from_config(moe_config()).save_pretrained(str(path))
    return path
