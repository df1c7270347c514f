"""DeepSeek's multi-head latent attention: the mla_attention kernel against per-head
expanded attention (both of its forms), the mla-fusion pass (FileCheck style, with the
exporters' spellings of the key concatenation), the latent KV cache it leads to, and
`npuc info`'s bytes per token equal to (kv_lora_rank + qk_rope_head_dim) x layers x 4."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fusion_passes import assert_same_numerics, interpret, random_feeds
from test_kv_cache_pass import check_order, round_trips

from npuc.compiler.driver import compile_model
from npuc.ir import DType, Graph, TensorSource, TensorType, Value, get_op, verify
from npuc.ir.fused_ops import mla_absorbed
from npuc.passes.canonicalize import Canonicalize
from npuc.passes.mla_fusion import MLAFusion
from npuc.runtime import Session
from npuc.tools.om_tools import model_info

B, H, DN, DR, R, DV = 1, 4, 16, 8, 16, 16


def expanded_attention(q_nope: torch.Tensor, q_rot: torch.Tensor, kv: torch.Tensor, w_kvb: torch.Tensor,
                       scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """What HF's DeepseekV3Attention computes: per-head keys and values expanded from the latent."""
    b, _, n, _ = kv.shape
    h, r = q_nope.shape[1], w_kvb.shape[1]
    c, k_rot = kv[..., :r], kv[..., r:]
    kvb = (c @ w_kvb.t()).view(b, n, h, -1).transpose(1, 2)
    k_nope, v = kvb.split([q_nope.shape[-1], kvb.shape[-1] - q_nope.shape[-1]], dim=-1)
    k = torch.cat((k_nope, k_rot.expand(-1, h, -1, -1)), dim=-1)
    q = torch.cat((q_nope, q_rot), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def split_weight(w_kvb: torch.Tensor, h: int, dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_head = w_kvb.view(h, -1, w_kvb.shape[1])
    return per_head[:, :dn].contiguous(), per_head[:, dn:].transpose(1, 2).contiguous()


@pytest.mark.parametrize("s, n, r, position", [(1, 20, 16, [13]), (3, 20, 16, [4, 9, 19]), (6, 6, 16, None),
                                               (32, 32, 64, None)],
                         ids=["decode", "chunk", "prefill-absorbed", "prefill-expanded"])
def test_kernel_equals_expanded_attention(s: int, n: int, r: int, position: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(s)
    q_nope, q_rot = torch.randn(B, H, s, DN, generator=gen), torch.randn(B, H, s, DR, generator=gen)
    kv = torch.randn(B, 1, n, r + DR, generator=gen)
    w_kvb = torch.randn(H * (DN + DV), r, generator=gen) / math.sqrt(r)
    w_uk, w_uv = split_weight(w_kvb, H, DN)
    od = get_op("mla_attention")
    scale = 0.17
    args = [q_nope, q_rot, kv, w_uk, w_uv]
    if position is not None:
        pos = torch.tensor(position)
        args.append(pos)
        mask = torch.arange(n)[None, :] <= pos[:, None]
    else:
        mask = torch.ones(s, n, dtype=torch.bool).tril()
    types = [TensorType(tuple(a.shape), DType.from_torch(a.dtype)) for a in args]
    # decode and short prefills attend over the latent; a long prefill expands the heads
    assert mla_absorbed(types[:5]) == (s < 32)
    got = od.run(args, {"scale": scale, "causal": position is None})[0]
    torch.testing.assert_close(got, expanded_attention(q_nope, q_rot, kv, w_kvb, scale, mask), atol=2e-5, rtol=1e-5)
    if position is not None:  # the runtime's allocation-free form agrees with the reference kernel
        out = torch.empty_like(got)
        ws = torch.empty(od.workspace_bytes(types, [TensorType(tuple(got.shape), DType.f32)], od.full_attrs(
            {"scale": scale})), dtype=torch.uint8)
        assert od.out_kernel is not None and od.out_kernel(args, od.full_attrs({"scale": scale}), [out], ws)
        torch.testing.assert_close(out, got, atol=1e-6, rtol=1e-6)


def test_flops_follow_the_form() -> None:
    od = get_op("mla_attention")

    def flops(s: int, n: int) -> int:
        ins = [TensorType(sh, DType.f32) for sh in ((1, H, s, DN), (1, H, s, DR), (1, 1, n, R + DR),
                                                    (H, DN, R), (H, R, DV))]
        return od.flops(ins, od.infer_types(ins, {"scale": 1.0, "causal": s == n}), {"scale": 1.0})

    # one decoded token over 4096 cached rows: latent scores and values, no per-head expansion
    assert flops(1, 4096) == 2 * H * (DN * R + 4096 * (2 * R + DR) + R * DV)


# --- the pass ----------------------------------------------------------------------------

def _node(g: Graph, op: str, ins: list[Value], attrs: dict[str, Any] | None = None, name: str = "") -> Value:
    types = get_op(op).infer_types([v.type for v in ins], attrs or {})
    return g.add_node(op, ins, types, attrs or {}, names=name or op).outputs


def mla_graph(s: int, key_form: str = "slice_scatter", mask: torch.Tensor | None = None) -> Graph:
    """One MLA layer as HF's DeepseekV3Attention traces (after attention fusion), with the
    key assembled by slice_scatter copies (torch.export), ONNX's transposed scatter_nd, or concat."""
    g = Graph("mla")
    f32 = DType.f32
    q = g.add_input("q", TensorType((B, H, s, DN + DR), f32))
    c = g.add_input("c", TensorType((B, 1, s, R), f32))
    k_rot = g.add_input("k_rot", TensorType((B, 1, s, DR), f32))
    w = g.add_constant("kv_b_proj.weight", TensorType((H * (DN + DV), R), f32),
                       TensorSource(torch.randn(H * (DN + DV), R, generator=torch.Generator().manual_seed(1)) / 4))
    q_nope, q_rot = _node(g, "split", [q], {"axis": 3, "sizes": (DN, DR)})
    kvb = _node(g, "linear", [c, w])[0]
    kv4 = _node(g, "reshape", [kvb], {"shape": (B, s, H, DN + DV)})[0]
    kv4 = _node(g, "transpose", [kv4], {"perm": (0, 2, 1, 3)})[0]
    k_nope, v = _node(g, "split", [kv4], {"axis": 3, "sizes": (DN, DV)})
    rot = _node(g, "expand", [k_rot], {"shape": (B, H, s, DR)})[0]
    if key_form == "concat":
        k = _node(g, "concat", [k_nope, rot], {"axis": 3})[0]
    else:
        empty = g.add_constant("empty", TensorType((B, H, s, DN + DR), f32), TensorSource(torch.zeros(B, H, s, DN + DR)))
        if key_form == "slice_scatter":
            k = _node(g, "slice_scatter", [empty, k_nope], {"axis": 3, "start": 0, "end": DN, "step": 1})[0]
            k = _node(g, "slice_scatter", [k, rot], {"axis": 3, "start": DN, "end": DN + DR, "step": 1})[0]
        else:  # ONNX: x[..., a:b] = src as transpose -> ScatterND over rows -> transpose
            perm = {"perm": (3, 1, 2, 0)}
            k = empty
            for i, (src, lo, hi) in enumerate(((k_nope, 0, DN), (rot, DN, DN + DR))):
                rows = g.add_constant(f"rows{i}", TensorType((hi - lo, 1), DType.i64),
                                      TensorSource(torch.arange(lo, hi).view(-1, 1)))
                kt = _node(g, "transpose", [k], perm)[0]
                st = _node(g, "transpose", [src], perm)[0]
                k = _node(g, "transpose", [_node(g, "scatter_nd", [kt, rows, st])[0]], perm)[0]
    qc = _node(g, "concat", [q_nope, q_rot], {"axis": 3})[0]
    ins = [qc, k, v]
    if mask is not None:
        ins.append(g.add_constant("mask", TensorType(tuple(mask.shape), f32), TensorSource(mask)))
    o = _node(g, "fused_attention", ins, {"scale": 0.2, "causal": mask is None and s > 1}, name="attn")[0]
    g.set_outputs([o])
    verify(g)
    return g


@pytest.mark.parametrize("key_form", ["slice_scatter", "concat", "onnx_scatter_nd"])
def test_mla_fusion_rewrites_one_layer(key_form: str) -> None:
    before = mla_graph(5, key_form)
    g = mla_graph(5, key_form)
    if key_form == "onnx_scatter_nd":
        res = Canonicalize()(g)
        assert res.details["rules"]["scatter-nd-to-slice-scatter"]["applied"] == 2
        assert "scatter_nd" not in {n.op for n in g.nodes}
    res = MLAFusion()(g)
    assert res.details["rules"]["mla-attention"]["applied"] == 1
    verify(g)
    text = str(g)
    att = next(n for n in g.nodes if n.op == "mla_attention")
    assert att.attrs == {"scale": 0.2, "causal": True}
    assert [v.name for v in att.inputs[:2]] == ["split_0", "split_1"]
    assert att.inputs[2].producer is not None and att.inputs[2].producer.op == "concat"
    assert [v.name for v in att.inputs[2].producer.inputs] == ["c", "k_rot"]
    assert att.inputs[3].type.shape == (H, DN, R) and att.inputs[4].type.shape == (H, R, DV)
    assert att.inputs[3].is_const and att.inputs[4].is_const
    check_order(text, ["concat[axis=3](%c, %k_rot)", "mla_attention[causal=true, scale=0.2]"])
    round_trips(g)
    assert_same_numerics(before, g, atol=2e-5)


def test_mla_fusion_never_reads_the_weight() -> None:
    """The per-head weights are folds of kv_b_proj: computed when the .om is written."""
    g = mla_graph(4)

    real = g.constants["kv_b_proj.weight"].const
    assert real is not None

    class Guarded:
        in_memory = False
        armed = True

        def load(self) -> torch.Tensor:
            assert not self.armed, "kv_b_proj was read during optimisation"
            return real.load()

        def describe(self) -> str:
            return "a file"

    guard = Guarded()
    g.constants["kv_b_proj.weight"].const = guard
    MLAFusion()(g)
    assert any(n.op == "mla_attention" for n in g.nodes)
    guard.armed = False  # what the writer does later
    feeds = random_feeds(g, 0)
    assert interpret(g, feeds)[0].shape == (B, H, 4, DV)


def test_mla_fusion_refuses_a_real_mask() -> None:
    mask = torch.zeros(5, 5)
    mask[0, 3] = float("-inf")
    g = mla_graph(5, mask=mask)
    res = MLAFusion()(g)
    assert res.details["rules"]["mla-attention"]["applied"] == 0
    assert "the attention has a mask that is not the causal one" in res.details["rules"]["mla-attention"]["refused"]


# --- compiled DeepSeek-V3: the latent cache --------------------------------------------

@pytest.fixture(scope="module")
def v3_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("mla")
    om = compile_model(str(hf_checkpoints["deepseek_v3"]), input_shape="input_ids:1,8", output=str(out / "v3"),
                       max_seq_len=48, fusion_report=str(out / "fusion.json"))
    return Path(om), out / "fusion.json"


def test_kv_bytes_per_token_is_the_mla_formula(v3_om: tuple[Path, Path]) -> None:
    from hf_models import make_config

    cfg = make_config("deepseek_v3")
    info = model_info(str(v3_om[0]))
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4
    assert info["kv_cache_bytes_per_token"] == latent == 192
    # what caching per-head keys and values would take: 2 layers x 4 heads x (24 + 16) x 4 B
    full = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                              + cfg.v_head_dim) * 4
    assert full == 1280 and info["kv_cache_bytes_per_token"] * 6 < full


def test_one_latent_attention_per_layer_and_a_latent_cache(v3_om: tuple[Path, Path]) -> None:
    report = json.loads(v3_om[1].read_text())
    mla = next(p for p in report["passes"] if p["pass"] == "mla-fusion")
    assert mla["rules"]["mla-attention"]["applied"] == 2  # one per layer
    sess = Session.load(str(v3_om[0]))
    for name, prog in sess.programs.items():
        steps = [st for st in prog.steps if st.opdef.name == "mla_attention"]
        assert len(steps) == 2, name
        assert not [st for st in prog.steps if st.opdef.name in ("fused_attention", "cached_attention")], name
    decode = sess.programs["decode"]
    assert all(len(st.inputs) == 6 for st in decode.steps if st.opdef.name == "mla_attention")  # + position
    states = sorted(t.name for t in sess.model.tensors if t.region == "state" and not t.HasField("base"))
    assert states == ["kv_cache.0.latent", "kv_cache.1.latent"]


@pytest.mark.parametrize("name, layers, heads, dtype_bytes", [
    ("DeepSeek-V3 (671B)", 61, 128, 2), ("DeepSeek-V2 (236B)", 60, 128, 2), ("DeepSeek-V2-Lite", 27, 16, 2)])
def test_docs_table_is_the_formula(name: str, layers: int, heads: int, dtype_bytes: int) -> None:
    """docs/deepseek.md's figures for the published configs (r 512, dr 64, dn 128, dv 128)."""
    doc = (Path(__file__).parents[1] / "docs" / "deepseek.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith(f"| {name} |"))
    mla = (512 + 64) * layers * dtype_bytes
    full = layers * heads * (128 + 64 + 128) * dtype_bytes
    assert f"| {mla:,} B | {full:,} B | {full / mla:.1f}x |" in row
