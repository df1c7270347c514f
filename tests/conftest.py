from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", category=FutureWarning)

from hf_models import ARCHS, GEN_ARCHS, GEN_MAX_SEQ, GEN_PREFILL, moe_config, save_checkpoint  # noqa: E402


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
    from npuc.compiler.driver import compile_model

    root = tmp_path_factory.mktemp("gen")
    return {arch: Path(compile_model(str(hf_checkpoints[arch]), input_shape=f"input_ids:1,{GEN_PREFILL}",
                                     output=str(root / arch), max_seq_len=GEN_MAX_SEQ)) for arch in GEN_ARCHS}


ONNX_OPSETS = [18, 23]


@pytest.fixture(scope="session")
def onnx_exports(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[tuple[str, int], Path]:
    """Each tiny HF model exported with torch.onnx.export(dynamo=True) at opsets 18 and 23, once per session.

    Exported with a dynamic batch and sequence, as deployment exports usually are."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for arch, ckpt in hf_checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
        ids = torch.zeros(1, 16, dtype=torch.long)
        for opset in ONNX_OPSETS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prog = torch.onnx.export(model, (), kwargs={"input_ids": ids, "use_cache": False}, dynamo=True,
                                         opset_version=opset, verbose=False,
                                         dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "use_cache": None})
            path = root / f"{arch}_opset{opset}.onnx"
            prog.save(str(path))
            out[(arch, opset)] = path
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
