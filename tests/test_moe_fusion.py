"""FusedMoE: the op's reference kernel against a per-token reference (both DeepSeek routings,
ties included), its FLOPs (the selected experts only), the moe-fusion pass in FileCheck style
(fires, and refuses with a reason), and on real models: one fused_moe per MoE layer in the
prefill and decode programs and in the fusion report, with logits and generation still
matching Hugging Face."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import ONNX_OPSETS
from hf_models import hf_greedy, prefill_vs_hf
from test_fusion_passes import check, refuses

from npuc.apps.generate import generate
from npuc.compiler.driver import compile_model
from npuc.ir import DType, TensorType, get_op
from npuc.ir.fused_ops import moe_route
from npuc.passes.moe_fusion import MoEFusion
from npuc.runtime import Session

V3 = dict(top_k=2, n_group=4, topk_group=2, scoring="sigmoid", group_score="top2_sum", norm_topk=True,
          routed_scale=2.5)
V2_GROUPED = dict(top_k=3, n_group=4, topk_group=2, scoring="softmax", group_score="max", routed_scale=1.5)
V2_GREEDY = dict(top_k=2, scoring="softmax", routed_scale=0.5)


# =========================================================================================
# the kernel
# =========================================================================================

def _ranked(values: list[float], n: int) -> list[int]:
    """The n largest, best first; of equal values the lower index (Python's sort is stable)."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:n]


def naive_route(logits: torch.Tensor, bias: torch.Tensor | None, a: dict[str, Any]) -> tuple[list[int], list[float]]:
    """One token's experts and weights, as transformers' DeepseekV2/V3 routers define them."""
    scores = torch.sigmoid(logits) if a["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias if bias is not None else scores
    e, g, kg = len(scores), a.get("n_group", 1), a.get("topk_group", 1)
    fill = -math.inf if a["scoring"] == "sigmoid" else 0.0
    masked = [float(c) for c in choice]
    if kg < g:
        size = e // g
        groups = [choice[i * size:(i + 1) * size] for i in range(g)]
        group_scores = [float(grp.max()) if a["group_score"] == "max"
                        else float(grp[_ranked(grp.tolist(), 2)].sum()) for grp in groups]
        kept = set(_ranked(group_scores, kg))
        masked = [v if i // size in kept else fill for i, v in enumerate(masked)]
    picks = _ranked(masked, a["top_k"])
    weights = torch.tensor([float(scores[i]) if masked[i] != fill else fill for i in picks])
    if a.get("norm_topk"):
        weights = weights / (weights.sum() + 1e-20)
    return picks, (weights * a["routed_scale"]).tolist()


def naive_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              bias: torch.Tensor | None, a: dict[str, Any]) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for t in range(x.shape[0]):  # the test may loop over tokens; the kernel never does
        picks, weights = naive_route(router @ x[t], bias, a)
        for e, w in zip(picks, weights, strict=True):
            h = gate_up[e] @ x[t]
            out[t] += w * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _operands(t: int, e: int, h: int, i: int, seed: int, ties: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # small integers: many tokens score several experts (and groups) exactly alike
        x = torch.randint(-1, 2, (t, h), generator=gen).float()
        router = torch.randint(-1, 2, (e, h), generator=gen).float()
    else:
        x, router = torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    down = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return [x, router, gate_up, down]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("form", ["v3", "v2-grouped", "v2-greedy"])
def test_kernel_matches_a_per_token_reference(form: str, ties: bool) -> None:
    a = {"v3": V3, "v2-grouped": V2_GROUPED, "v2-greedy": V2_GREEDY}[form]
    x, router, gate_up, down = _operands(t=24, e=8, h=8, i=4, seed=1, ties=ties)
    bias = torch.randint(-2, 3, (8,), generator=torch.Generator().manual_seed(2)).float() / 8 if form == "v3" else None
    ins = [x, router, gate_up, down, *([bias] if bias is not None else [])]
    od = get_op("fused_moe")
    (got,) = od.run(ins, a)
    torch.testing.assert_close(got, naive_moe(x, router, gate_up, down, bias, od.full_attrs(a)), atol=1e-5, rtol=1e-5)
    idx, weights = moe_route(x @ router.T, bias, od.full_attrs(a))
    for t in range(x.shape[0]):
        picks, want = naive_route(router @ x[t], bias, od.full_attrs(a))
        assert idx[t].tolist() == picks  # the same experts, in the same order, ties included
        torch.testing.assert_close(weights[t], torch.tensor(want), atol=1e-6, rtol=1e-6)
    if ties:
        routing = (x @ router.T).tolist()
        assert any(len(set(row)) < len(row) for row in routing), "the tie case has no ties"


def test_flops_count_the_selected_experts_only() -> None:
    od = get_op("fused_moe")
    t, e, h, i, k = 8, 64, 256, 128, 2
    ins = [TensorType(s, DType.f32) for s in ((t, h), (e, h), (e, 2 * i, h), (e, h, i), (e,))]
    outs = od.infer_types(ins, V3)
    flops = od.flops(ins, outs, od.full_attrs(V3))
    router, experts, act, combine = 2 * t * h * e, t * k * (2 * h * 2 * i + 2 * i * h), t * k * 5 * i, 2 * t * k * h
    assert flops == router + experts + act + combine
    assert flops < t * e * (2 * h * 2 * i + 2 * i * h) / 10  # far below every expert on every token
    # Bytes: the 16 experts 8 tokens x 2 can select, not all 64 (a decode step: 2 of 64).
    expert = (2 * i * h + h * i) * 4
    small = t * h * 4 + e * h * 4 + e * 4 + t * h * 4
    assert od.bytes(ins, outs, V3) == small + 16 * expert
    one = [TensorType((1, h), DType.f32)] + ins[1:]
    assert od.bytes(one, od.infer_types(one, V3), V3) == small - 14 * h * 4 + 2 * expert


# =========================================================================================
# the pass, in FileCheck style
# =========================================================================================

# DeepSeek-V3's router and batched_mm experts as torch.export traces them (T=2 tokens, E=4
# experts in 2 groups, one group kept, k=2, hidden 4, expert width 2).
MOE_V3 = """
    graph main(%x : f32[2,4]) {
      const @gate_up : f32[4,4,4]
      const @down : f32[4,4,2]
      const @router : f32[4,4]
      const @bias : f32[4]
      const @fill : f32[]
      const @eps : f32[]
      const @scale : f32[]
      const @zeros : f32[2,2]
      const @ones : f32[2,1]
      %logits : f32[2,4] = linear(%x, @router)
      %scores : f32[2,4] = sigmoid(%logits)
      %choice : f32[2,4] = add(%scores, @bias)
      %grouped : f32[2,2,2] = reshape[shape=[2,2,2]](%choice)
      %top2_0 : f32[2,2,2], %top2_1 : i64[2,2,2] = topk[axis=2, k=2, largest=true](%grouped)
      %group_scores : f32[2,2] = reduce_sum[axes=[2], keepdim=false](%top2_0)
      %best_0 : f32[2,1], %best_1 : i64[2,1] = topk[axis=1, k=1, largest=true](%group_scores)
      %scatter : f32[2,2] = scatter_elements[axis=1](@zeros, %best_1, @ones)
      %mask_groups : f32[2,2,1] = reshape[shape=[2,2,1]](%scatter)
      %mask_experts : f32[2,2,2] = expand[shape=[2,2,2]](%mask_groups)
      %mask : f32[2,4] = reshape[shape=[2,4]](%mask_experts)
      %mask_bool : bool[2,4] = cast[dtype=bool](%mask)
      %masked_out : bool[2,4] = logical_not(%mask_bool)
      %masked : f32[2,4] = where(%masked_out, @fill, %choice)
      %sel_0 : f32[2,2], %sel_1 : i64[2,2] = topk[axis=1, k=2, largest=true](%masked)
      %picked : f32[2,2] = gather_elements[axis=1](%scores, %sel_1)
      %total : f32[2,1] = reduce_sum[axes=[1], keepdim=true](%picked)
      %denom : f32[2,1] = add(%total, @eps)
      %normed : f32[2,2] = div(%picked, %denom)
      %weights : f32[2,2] = mul(%normed, @scale)
      %tokens : f32[2,1,4] = reshape[shape=[2,1,4]](%x)
      %repeated : f32[2,2,4] = expand[shape=[2,2,4]](%tokens)
      %ids : i64[4] = reshape[shape=[4]](%sel_1)
      %w_gate_up : f32[4,4,4] = index(@gate_up, %ids)
      %slot_x : f32[4,4,1] = reshape[shape=[4,4,1]](%repeated)
      %gu3 : f32[4,4,1] = matmul(%w_gate_up, %slot_x)
      %gu : f32[4,4] = reshape[shape=[4,4]](%gu3)
      %gate : f32[4,2], %up : f32[4,2] = split[axis=1, sizes=[2,2]](%gu)
      %act : f32[4,2] = swiglu(%gate, %up)
      %w_down : f32[4,4,2] = index(@down, %ids)
      %act3 : f32[4,2,1] = reshape[shape=[4,2,1]](%act)
      %y3 : f32[4,4,1] = matmul(%w_down, %act3)
      %y : f32[4,4] = reshape[shape=[4,4]](%y3)
      %w_slots : f32[4,1] = reshape[shape=[4,1]](%weights)
      %weighted : f32[4,4] = mul(%y, %w_slots)
      %slots : f32[2,2,4] = reshape[shape=[2,2,4]](%weighted)
      %out : f32[2,4] = reduce_sum[axes=[1], keepdim=false](%slots)
      return %out
    }
    """
_CONSTS = ("  const @gate_up : f32[4,4,4]\n  const @down : f32[4,4,2]\n  const @router : f32[4,4]\n"
           "  const @bias : f32[4]\n  const @fill : f32[]\n  const @eps : f32[]\n  const @scale : f32[]\n"
           "  const @zeros : f32[2,2]\n  const @ones : f32[2,1]\n")


def moe_data(fill: float = -math.inf) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"gate_up": torch.randn(4, 4, 4, generator=gen), "down": torch.randn(4, 4, 2, generator=gen),
            "router": torch.randn(4, 4, generator=gen), "bias": torch.randn(4, generator=gen) / 4,
            "fill": torch.tensor(fill), "eps": torch.tensor(1e-20), "scale": torch.tensor(2.5),
            "zeros": torch.zeros(2, 2), "ones": torch.ones(2, 1)}


def test_moe_fusion_v3() -> None:
    # -- moe-fusion: the whole router and both expert matmuls become one op; the shared
    #    constants of the router stay for DCE --
    res = check(MoEFusion(), MOE_V3, "graph main(%x : f32[2,4]) {\n" + _CONSTS + """\
  %out : f32[2,4] = fused_moe[group_score="top2_sum", n_group=2, norm_eps=9.999999682655225e-21, norm_topk=true, \
routed_scale=2.5, scoring="sigmoid", top_k=2, topk_group=1](%x, @router, @gate_up, @down, @bias)
  return %out
}
""", moe_data(), numerics=True)
    assert res.details["rules"]["moe"] == {"matched": 1, "applied": 1, "refused": {}}
    (fusion,) = res.details["fusions"]
    assert fusion["created"] == ["out"] and len(fusion["replaced"]) == 37


def test_moe_fusion_v2_greedy() -> None:
    # -- moe-fusion: DeepSeek-V2's greedy router: softmax, top-k, the top-k values scaled --
    check(MoEFusion(), """
        graph main(%x : f32[2,4]) {
          const @gate_up : f32[4,4,4]
          const @down : f32[4,4,2]
          const @router : f32[4,4]
          const @scale : f32[]
          %logits : f32[2,4] = linear(%x, @router)
          %scores : f32[2,4] = softmax[axis=1](%logits)
          %sel_0 : f32[2,2], %sel_1 : i64[2,2] = topk[axis=1, k=2, largest=true](%scores)
          %weights : f32[2,2] = mul(%sel_0, @scale)
          %tokens : f32[2,1,4] = reshape[shape=[2,1,4]](%x)
          %repeated : f32[2,2,4] = expand[shape=[2,2,4]](%tokens)
          %ids : i64[4] = reshape[shape=[4]](%sel_1)
          %w_gate_up : f32[4,4,4] = index(@gate_up, %ids)
          %slot_x : f32[4,4,1] = reshape[shape=[4,4,1]](%repeated)
          %gu3 : f32[4,4,1] = matmul(%w_gate_up, %slot_x)
          %gu : f32[4,4] = reshape[shape=[4,4]](%gu3)
          %gate : f32[4,2], %up : f32[4,2] = split[axis=1, sizes=[2,2]](%gu)
          %act : f32[4,2] = swiglu(%gate, %up)
          %w_down : f32[4,4,2] = index(@down, %ids)
          %act3 : f32[4,2,1] = reshape[shape=[4,2,1]](%act)
          %y3 : f32[4,4,1] = matmul(%w_down, %act3)
          %y : f32[4,4] = reshape[shape=[4,4]](%y3)
          %w_slots : f32[4,1] = reshape[shape=[4,1]](%weights)
          %weighted : f32[4,4] = mul(%y, %w_slots)
          %slots : f32[2,2,4] = reshape[shape=[2,2,4]](%weighted)
          %out : f32[2,4] = reduce_sum[axes=[1], keepdim=false](%slots)
          return %out
        }
        """, """
        graph main(%x : f32[2,4]) {
          const @gate_up : f32[4,4,4]
          const @down : f32[4,4,2]
          const @router : f32[4,4]
          const @scale : f32[]
          %out : f32[2,4] = fused_moe[routed_scale=0.5, scoring="softmax", top_k=2](%x, @router, @gate_up, @down)
          return %out
        }
        """, {k: v for k, v in moe_data().items() if k in ("gate_up", "down", "router")} | {"scale": torch.tensor(0.5)},
        numerics=True)


def test_moe_fusion_refuses_a_fill_that_is_not_deepseeks() -> None:
    # -- moe-fusion: masked groups scored 0 under sigmoid scores could still be picked: not V3 --
    refuses(MoEFusion(), MOE_V3, "moe", "masked experts get 0.0, not the -inf DeepSeek gives sigmoid scores",
            moe_data(fill=0.0))


def test_moe_fusion_refuses_a_router_value_read_elsewhere() -> None:
    # -- moe-fusion: the scores are also a graph output: fusing would compute them twice --
    src = MOE_V3.replace("return %out", "return %out, %scores")
    refuses(MoEFusion(), src, "moe", "%scores is used outside the match", moe_data())


def test_moe_fusion_refuses_halves_of_different_splits() -> None:
    # -- moe-fusion: gate and up from two splits: not one expert's gate_up projection --
    src = MOE_V3.replace("%act : f32[4,2] = swiglu(%gate, %up)",
                         "%gate2 : f32[4,2], %up2 : f32[4,2] = split[axis=1, sizes=[2,2]](%gu)\n"
                         "      %act : f32[4,2] = swiglu(%gate, %up2)")
    refuses(MoEFusion(), src, "moe", "the SwiGLU halves are not the two halves of one split", moe_data())


def test_moe_fusion_leaves_a_dense_graph_alone() -> None:
    res = check(MoEFusion(), """
        graph main(%x : f32[2,3,4]) {
          %y : f32[2,4] = reduce_sum[axes=[1], keepdim=false](%x)
          return %y
        }
        """, """
        graph main(%x : f32[2,3,4]) {
          %y : f32[2,4] = reduce_sum[axes=[1], keepdim=false](%x)
          return %y
        }
        """, modified=False)
    assert res.details["explain"]["moe"] == "moe: no routed-experts combine in the graph"


# =========================================================================================
# real models
# =========================================================================================

def v3_config() -> Any:
    from hf_models import moe_config

    return moe_config(num_hidden_layers=3)  # two MoE layers


def v2_config(topk_method: str) -> Any:
    import transformers as tf

    return tf.DeepseekV2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, topk_method=topk_method,
        max_position_embeddings=64)


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two MoE layers (after one dense), compiled for generation with a fusion report."""
    import transformers as tf

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("moe_fusion")
    tf.AutoModelForCausalLM.from_config(v3_config()).save_pretrained(str(root / "v3"))
    om = compile_model(str(root / "v3"), input_shape="input_ids:1,8", output=str(root / "v3m"), max_seq_len=48,
                       fusion_report=str(root / "fusion.json"))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(root / "v3")).eval()
    return {"sess": Session.load(om), "hf": hf, "report": json.loads((root / "fusion.json").read_text())}


def test_one_fused_moe_per_moe_layer_in_both_programs(v3: dict[str, Any]) -> None:
    tensors = v3["sess"].tensors
    for name, prog in v3["sess"].programs.items():
        # Prefill's pick of the last_token row (passes/last_token_logits.py) is no routing leftover.
        ops = [st.opdef.name for st in prog.steps
               if not (st.opdef.name == "index" and any(tensors[i].name == "last_token" for i in st.inputs))]
        assert ops.count("fused_moe") == 2, name
        assert not {"topk", "index", "gather_elements", "scatter_elements", "matmul"} & set(ops), name


def test_fusion_report_shows_each_fused_moe(v3: dict[str, Any]) -> None:
    report = v3["report"]
    (moe_pass,) = [p for p in report["passes"] if p["pass"] == "moe-fusion"]
    assert moe_pass["rules"]["moe"]["applied"] == 2 and moe_pass["rules"]["moe"]["refused"] == {}
    fused = [f for f in report["fused_ops"].values() if f["op"] == "fused_moe"]
    assert len(fused) == 2 and all("moe" in f["rules"] and len(f["replaced"]) > 30 for f in fused)
    assert report["op_counts"]["fused_moe"] == 2


def test_v3_prefill_and_generation_match_hf(v3: dict[str, Any]) -> None:
    assert prefill_vs_hf(v3["sess"], v3["hf"], "prefill") < 1e-4
    prompt = [5, 17, 3, 99, 42, 7]
    assert generate(v3["sess"], prompt, 12, ignore_eos=True) == hf_greedy(v3["hf"], prompt, 12)


@pytest.mark.parametrize("tokens", [8, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_moe_layer_fuses_and_matches(topk_method: str, tokens: int, tmp_path: Path) -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    config = v2_config(topk_method)
    config._experts_implementation = "batched_mm"  # as compiler/loaders.py builds HF models
    torch.manual_seed(0)
    layer = DeepseekV2Moe(config).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    om = compile_model(layer, input_shape=f"hidden_states:1,{tokens},64", output=str(tmp_path / "v2"))
    sess = Session.load(om)
    (fused,) = [st for st in next(iter(sess.programs.values())).steps if st.opdef.name == "fused_moe"]
    grouped = topk_method == "group_limited_greedy"
    assert dict(fused.attrs) == get_op("fused_moe").full_attrs({
        "top_k": 3, "scoring": "softmax", "routed_scale": 2.5,
        **({"n_group": 4, "topk_group": 2, "group_score": "max"} if grouped else {})})
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = layer(x)
    (out,) = sess.run({"hidden_states": x}).values()
    assert float((out - ref).abs().max()) < 1e-5


def test_v2_model_fuses_and_matches_hf(tmp_path: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(v2_config("group_limited_greedy")).save_pretrained(str(tmp_path / "v2"))
    om = compile_model(str(tmp_path / "v2"), input_shape="input_ids:1,8", output=str(tmp_path / "m"))
    sess = Session.load(om)
    assert [st.opdef.name for st in sess.programs["main"].steps].count("fused_moe") == 1
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "v2")).eval()(ids, use_cache=False).logits
    assert float((sess.run({"input_ids": ids})["logits"] - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("opset", ONNX_OPSETS)
def test_v3_moe_layer_from_onnx_fuses_and_matches(opset: int, tmp_path: Path) -> None:
    """torch.onnx's spellings: the router as a [hidden, experts] linear, experts' weights by
    GatherND, and no `+ 1e-20` in the normaliser."""
    import numpy as np
    import onnxruntime as ort
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = v3_config()
    config._experts_implementation = "batched_mm"
    torch.manual_seed(0)
    layer = DeepseekV3MoE(config).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    path = str(tmp_path / "moe.onnx")
    torch.onnx.export(layer, (torch.zeros(1, 8, 64),), path, dynamo=True, opset_version=opset,
                      input_names=["hidden_states"], verbose=False)
    sess = Session.load(compile_model(path, input_shape="hidden_states:1,8,64", output=str(tmp_path / "m")))
    steps = next(iter(sess.programs.values())).steps
    (fused,) = [st for st in steps if st.opdef.name == "fused_moe"]
    assert fused.attrs["norm_eps"] == 0.0 and not {"topk", "gather_nd", "transpose"} & {st.opdef.name for st in steps}
    x = np.random.default_rng(0).standard_normal((1, 8, 64)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"hidden_states": x})[0]
    got = next(iter(sess.run({"hidden_states": x}).values())).numpy()
    assert float(np.abs(got - ref).max()) < 1e-4


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
