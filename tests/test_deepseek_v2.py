"""DeepSeek-V2 from a Hugging Face folder: its RoPE multiplies complex numbers
(`torch.polar`, `view_as_complex`, `view_as_real`), which the torch frontend carries
as real (re, im) pairs and rope-fusion turns into `rope_lut[layout="interleaved"]`;
its group-limited router takes each group's best score with `max(dim)`. Prefill
matches HF eager, and generation with a KV cache matches HF `generate` token for token."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import hf_greedy, prefill_vs_hf
from torch import nn

import npuc
from npuc.apps.generate import generate
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session


def v2_config(**overrides: Any) -> Any:
    import transformers as tf

    cfg: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, topk_method="group_limited_greedy", n_shared_experts=1, routed_scaling_factor=2.5,
        max_position_embeddings=64)
    cfg.update(overrides)
    return tf.DeepseekV2Config(**cfg)


def _save(path: Path, **overrides: Any) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(v2_config(**overrides)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def v2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("v2") / "deepseek_v2")


@pytest.fixture(scope="module")
def hf_v2(v2_ckpt: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(v2_ckpt)).eval()  # its default (looping) experts


def _prefill_error(ckpt: Path, hf: Any, out: Path) -> tuple[float, Counter[str]]:
    sess = Session.load(compile_model(str(ckpt), input_shape="input_ids:1,8", output=str(out)))
    ops = Counter(st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps)
    return prefill_vs_hf(sess, hf), ops


def test_prefill_matches_hf(v2_ckpt: Path, hf_v2: Any, tmp_path: Path) -> None:
    err, ops = _prefill_error(v2_ckpt, hf_v2, tmp_path / "m")
    assert err < 1e-4
    assert ops["rope_lut"] == 4  # q and k in each of the 2 layers: the complex RoPE fused


def test_generation_matches_hf(v2_ckpt: Path, hf_v2: Any, tmp_path: Path) -> None:
    # Needs rope_lut: the KV cache moves RoPE's positions with the decoded token.
    om = compile_model(str(v2_ckpt), input_shape="input_ids:1,8", output=str(tmp_path / "g"), max_seq_len=48)
    prompt = [5, 17, 3, 99, 42, 7]
    assert generate(Session.load(om), prompt, 32, ignore_eos=True) == hf_greedy(hf_v2, prompt, 32)


def test_q_without_lora_and_greedy_routing(tmp_path: Path) -> None:
    import transformers as tf

    ckpt = _save(tmp_path / "plain_q", q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    err, ops = _prefill_error(ckpt, hf, tmp_path / "p")
    assert err < 1e-4 and ops["rope_lut"] == 4


# -- the complex converters on their own ----------------------------------------------------------

class ComplexOps(nn.Module):
    """What complex code does with npuc's converters: polar, view_as_complex/real, complex and real
    products, sums, cat, slices, a complex buffer, abs, real/imag, complex()."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4, 4), torch.linspace(0, 3, 16).reshape(4, 4)))

    def forward(self, x: torch.Tensor, angle: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = torch.view_as_complex(x.reshape(2, 3, 4, 4, 2))
        f = torch.polar(angle.abs() + 0.5, angle) * 0.75
        y = (c * f.unsqueeze(0) - c + 1.5) * angle.cos()
        y = torch.cat([y, c], dim=-1)[..., 1:7]
        z = y[:, 1] * self.freqs_cis[:, :1].expand(4, 6)
        w = torch.complex(angle, angle * 2)
        return (torch.view_as_real(y).flatten(3), torch.view_as_real(z), y.abs(),
                torch.view_as_real(w * c).sum(-1), y.real + z.imag.sum())


def test_complex_converters_match_torch(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x, angle = torch.randn(2, 3, 4, 8, generator=g), torch.randn(3, 4, 4, generator=g)
    m = ComplexOps().eval()
    out = npuc.load(npuc.compile(m, input_shape="x:2,3,4,8;angle:3,4,4", output=str(tmp_path / "c")), executor="torch").run(
        {"x": x, "angle": angle})
    for got, want in zip(out.values(), m(x, angle), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class ComplexExp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.exp(torch.view_as_complex(x)))


class ComplexOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(x) * 2


def test_unsupported_complex_ops_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        npuc.compile(ComplexExp(), input_shape="x:3,2", output=str(tmp_path / "e"))
    assert info.value.code == "NPUC-E0301" and info.value.exit_code == 3
    assert "aten.exp.default on complex values (x1)" in info.value.message
    with pytest.raises(NpucError) as info:
        npuc.compile(ComplexOut(), input_shape="x:3,2", output=str(tmp_path / "o"))
    assert info.value.code == "NPUC-E0309" and "returns a complex tensor" in info.value.message
    assert not list(tmp_path.glob("*.om"))


def test_unsupported_complex_op_via_cli_has_no_traceback(tmp_path: Path) -> None:
    torch.export.save(torch.export.export(ComplexExp(), (torch.randn(3, 2),)), str(tmp_path / "e.pt2"))
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(tmp_path / "e.pt2"), "--input_shape", "x:3,2",
                        "--output", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert "NPUC-E0301" in r.stderr and "aten.exp.default on complex values (x1)" in r.stderr
