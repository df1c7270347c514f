"""DeepSeek-V3 with routed mixture-of-experts layers, from a Hugging Face folder:
per-expert checkpoint tensors stacked into transformers' fused expert weights, the
router (sigmoid scores, bias correction, group-limited top-k, normalised and scaled
weights) and the batched experts traced with static shapes and fused into one
`fused_moe` (passes/moe_fusion.py), matching HF eager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import hf_greedy, prefill_vs_hf

from npuc.apps.generate import generate
from npuc.compiler.driver import compile_model
from npuc.compiler.loaders import ConvertedSource, StackedExpertsSource, load_source
from npuc.runtime import Session


@pytest.fixture(scope="module")
def hf_moe(moe_checkpoint: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(moe_checkpoint)).eval()  # its default (looping) experts


def test_expert_weights_come_from_per_expert_tensors(moe_checkpoint: Path) -> None:
    loaded = load_source(str(moe_checkpoint))
    stacked = {k: v for k, v in loaded.sources.items() if isinstance(v, ConvertedSource | StackedExpertsSource)}
    assert sorted(stacked) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    # each names its parameter: the writer shares weights between programs by that description
    assert all(k in v.describe() for k, v in stacked.items() if isinstance(v, ConvertedSource))
    gate_up = stacked["model.layers.1.mlp.experts.gate_up_proj"].load()
    assert tuple(gate_up.shape) == (8, 64, 64)  # [experts, 2 x moe_intermediate, hidden]


def test_moe_prefill_matches_hf(moe_checkpoint: Path, hf_moe: Any, tmp_path: Path) -> None:
    om = compile_model(str(moe_checkpoint), input_shape="input_ids:1,8", output=str(tmp_path / "m"))
    sess = Session.load(om)
    assert prefill_vs_hf(sess, hf_moe) < 1e-4
    ops = {st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps}
    assert "fused_moe" in ops and not {"topk", "gather_elements", "scatter_elements", "index"} & ops  # fused


def test_moe_generation_matches_hf(moe_checkpoint: Path, hf_moe: Any, tmp_path: Path) -> None:
    om = compile_model(str(moe_checkpoint), input_shape="input_ids:1,8", output=str(tmp_path / "g"), max_seq_len=48)
    prompt = [5, 17, 3, 99, 42, 7]
    assert generate(Session.load(om), prompt, 32, ignore_eos=True) == hf_greedy(hf_moe, prompt, 32)


class _Routing(torch.nn.Module):
    """The ops a router uses, on their own: topk, gather, scatter of a value, repeat_interleave."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vals, idx = torch.topk(x, k=3, dim=-1)
        picked = torch.gather(x, 1, idx)
        mask = torch.zeros_like(x).scatter(1, idx, 1.0)
        return (vals + picked).repeat_interleave(2, dim=0).sum(-1) + mask.sum(-1).repeat_interleave(2, dim=0)


def test_router_ops_convert(tmp_path: Path) -> None:
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    om = compile_model(_Routing(), input_shape="x:4,9", output=str(tmp_path / "r"))
    out = Session.load(om).run({"x": x})
    (got,) = out.values()
    assert torch.allclose(got, _Routing()(x), atol=1e-6)
