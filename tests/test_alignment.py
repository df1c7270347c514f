"""Target alignment: matrix products and attention padded to the 16-tile, numerics unchanged."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import npuc
from npuc.ir import Graph, TensorSource, parse_graph, verify
from npuc.passes.align import TargetAlignment
from npuc.passes.manager import PassManager
from npuc.passes.pipeline import default_pipeline


def _run(g: Graph, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    from ir_build import run_graph

    return run_graph(g, feeds)


def _with_data(text: str, **data: torch.Tensor) -> Graph:
    g = parse_graph(text)
    for name, t in data.items():
        g.constants[name].const = TensorSource(t)
    return g


def test_linear_padded_on_m_n_and_k() -> None:
    g = _with_data("""graph main(%x : f32[1,7,40]) {
  const @w : f32[24,40]
  const @b : f32[24]
  %y : f32[1,7,24] = linear(%x, @w, @b)
  return %y
}
""", w=torch.randn(24, 40), b=torch.randn(24))
    x = torch.randn(1, 7, 40)
    before = _run(g, {"x": x})[0]
    res = TargetAlignment(16)(g)
    verify(g)
    assert res.details["padded"] == ["y"]
    lin = next(n for n in g.nodes if n.op == "linear")
    assert lin.inputs[0].type.shape == (1, 16, 48) and lin.outputs[0].type.shape == (1, 16, 32)
    assert Counter(n.op for n in g.nodes) == {"pad": 3, "linear": 1, "slice": 2}
    assert g.outputs[0].name == "y" and g.outputs[0].type.shape == (1, 7, 24)
    torch.testing.assert_close(_run(g, {"x": x})[0], before)


def test_rows_of_several_sequences_padded_together() -> None:
    """Decode over four sequences: [4, 1, k] is padded as one [1, 16, k] block (one product,
    which reads the weight once and whose four valid rows are a contiguous prefix), not as
    four [16, k] blocks."""
    from npuc.ir import print_graph

    g = _with_data("""graph main(%x : f32[4,1,40]) {
  const @w : f32[32,40]
  %y : f32[4,1,32] = linear(%x, @w)
  return %y
}
""", w=torch.randn(32, 40))
    x = torch.randn(4, 1, 40)
    before = _run(g, {"x": x})[0]
    TargetAlignment(16)(g)
    verify(g)
    text = print_graph(g)
    for line in ["%y_rows : f32[1,4,40] = reshape[shape=[1,4,40]](%x)",
                 "%y_pad : f32[1,16,48] = pad[pads=[0,0,0,0,12,8]](%y_rows)",
                 "%y_aligned : f32[1,16,32] = linear[valid_rows=4](%y_pad, %y_pad_1)",
                 "%y_unpad : f32[1,4,32] = slice[axis=1, end=4, start=0, step=1](%y_aligned)",
                 "%y : f32[4,1,32] = reshape[shape=[4,1,32]](%y_unpad)"]:
        assert line in text, text
    torch.testing.assert_close(_run(g, {"x": x})[0], before)


@pytest.mark.parametrize("causal, mask", [(True, None), (False, None), (False, "bool"), (False, "float")])
def test_attention_padded_and_padding_masked(causal: bool, mask: str | None) -> None:
    mask_arg = ", @m" if mask else ""
    mask_decl = {"bool": "  const @m : bool[1,1,7,7]\n", "float": "  const @m : f32[7]\n"}.get(mask or "", "")
    g = parse_graph(f"""graph main(%q : f32[1,4,7,24], %k : f32[1,2,7,24], %v : f32[1,2,7,8]) {{
{mask_decl}  %y : f32[1,4,7,8] = fused_attention[causal={'true' if causal else 'false'}, scale=0.2](%q, %k, %v{mask_arg})
  return %y
}}
""")
    if mask == "bool":
        g.constants["m"].const = TensorSource(torch.rand(1, 1, 7, 7) > 0.3)
        g.constants["m"].const.load()[..., 0] = True  # every row attends something
    elif mask == "float":
        g.constants["m"].const = TensorSource(torch.randn(7))
    feeds = {"q": torch.randn(1, 4, 7, 24), "k": torch.randn(1, 2, 7, 24), "v": torch.randn(1, 2, 7, 8)}
    before = _run(g, feeds)[0]
    TargetAlignment(16)(g)
    verify(g)
    att = next(n for n in g.nodes if n.op == "fused_attention")
    assert att.inputs[0].type.shape == (1, 4, 16, 32) and att.inputs[2].type.shape == (1, 2, 16, 16)
    assert len(att.inputs) == (3 if causal else 4)  # causal already hides padded keys from real queries
    after = _run(g, feeds)[0]
    assert not torch.isnan(after).any()
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alibi", ["", "alibi=[0.5,0.25], "])
def test_head_dim_over_the_target_limit_falls_back_unfused(alibi: str) -> None:
    g = parse_graph(f"""graph main(%q : f32[1,2,16,32], %k : f32[1,1,16,32], %v : f32[1,1,16,32]) {{
  %y : f32[1,2,16,32] = fused_attention[{alibi}causal=true, scale=0.2](%q, %k, %v)
  return %y
}}
""")
    feeds = {"q": torch.randn(1, 2, 16, 32), "k": torch.randn(1, 1, 16, 32), "v": torch.randn(1, 1, 16, 32)}
    before = _run(g, feeds)[0]
    res = TargetAlignment(16, max_head_dim=16)(g)
    verify(g)
    assert "fused_attention" not in {n.op for n in g.nodes} and "softmax" in {n.op for n in g.nodes}
    assert "exceeds the target's maximum 16" in res.details["fallback"][0]
    torch.testing.assert_close(_run(g, feeds)[0], before, atol=1e-5, rtol=1e-5)


def test_cpu_target_leaves_the_graph_alone() -> None:
    g = parse_graph("""graph main(%x : f32[1,7,40], %w : f32[24,40]) {
  %y : f32[1,7,24] = linear(%x, %w)
  return %y
}
""")
    text = str(g)
    assert not TargetAlignment(1)(g).modified and str(g) == text


def test_compiled_model_at_an_odd_length_is_aligned_and_exact(hf_checkpoints: dict[str, Path], tmp_path: Path
                                                              ) -> None:
    import transformers

    from npuc.compiler.driver import build_graph

    g, _ = build_graph(str(hf_checkpoints["deepseek_v3"]), "input_ids:1,7")
    g = PassManager(default_pipeline(), verify_each=True).run(g)
    for n in g.nodes:
        if n.op in ("linear", "matmul"):
            m, k = n.inputs[0].type.shape[-2:]
            assert m % 16 == 0 and k % 16 == 0 and n.outputs[0].type.shape[-1] % 16 == 0, n
        if n.op == "fused_attention":
            assert all(d % 16 == 0 for d in n.inputs[0].type.shape[2:] + n.inputs[1].type.shape[2:])
    path = npuc.compile(str(hf_checkpoints["deepseek_v3"]), input_shape="input_ids:1,7", output=str(tmp_path / "ds"))
    ids = np.arange(7, dtype=np.int64).reshape(1, 7)
    got = npuc.load(path, executor="torch").run({"input_ids": ids})["logits"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["deepseek_v3"]),
                                                              attn_implementation="eager").eval()
    torch.testing.assert_close(got, model(torch.from_numpy(ids)).logits, atol=1e-4, rtol=0)
    import subprocess
    import sys

    from npuc.cli.main import main  # noqa: F401  (dump must list the pads)

    r = subprocess.run([sys.executable, "-m", "npuc", "dump", path], capture_output=True, text=True)
    assert r.returncode == 0 and " pad " in r.stdout


def test_filecheck_linear_alignment() -> None:
    # a 7x40 @ 40x24 product becomes 16x48 @ 48x32, sliced back; rows 7..15 are marked padding
    g = _with_data("""graph main(%x : f32[1,7,40]) {
  const @w : f32[24,40]
  %y : f32[1,7,24] = linear(%x, @w)
  return %y
}
""", w=torch.randn(24, 40))
    TargetAlignment(16)(g)
    assert str(g) == """graph main(%x : f32[1,7,40]) {
  const @w : f32[24,40]
  %y_pad : f32[1,16,48] = pad[pads=[0,0,0,0,9,8]](%x)
  %y_pad_1 : f32[32,48] = pad[pads=[0,0,8,8]](@w)
  %y_aligned : f32[1,16,32] = linear[valid_rows=7](%y_pad, %y_pad_1)
  %y_unpad : f32[1,7,32] = slice[axis=1, end=7, start=0, step=1](%y_aligned)
  %y : f32[1,7,24] = slice[axis=2, end=24, start=0, step=1](%y_unpad)
  return %y
}
"""
