"""passes/score_chain.py in FileCheck style: hand-written attention's score chains become one
scale and one additive mask (then attention fusion fires), and chains that are not that are
left alone with a reason."""

from __future__ import annotations

import pytest
import torch
from test_fusion_passes import check, interpret, load, random_feeds, refuses

from npuc.ir import print_graph, verify
from npuc.passes import score_chain
from npuc.passes.attention_fusion import AttentionFusion
from npuc.passes.canonicalize import Canonicalize
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.score_chain import ScoreChain

TRIL = torch.ones(4, 4).tril()[None, None]

GPT = """
    graph main(%q : f32[1,2,4,8], %kx : f32[1,4,2,8], %v : f32[1,2,4,8]) {
      const @inv : f32[]
      const @keep : f32[1,1,4,4]
      const @fill : f32[1,1,4,4]
      %kt : f32[1,2,8,4] = transpose[perm=[0,2,3,1]](%kx)
      %s : f32[1,2,4,4] = matmul(%q, %kt)
      %a : f32[1,2,4,4] = mul(%s, @inv)
      %b : f32[1,2,4,4] = mul(%a, @keep)
      %c : f32[1,2,4,4] = add(%b, @fill)
      %p : f32[1,2,4,4] = softmax[axis=3](%c)
      %y : f32[1,2,4,8] = matmul(%p, %v)
      return %y
    }
    """


def gpt_data(keep: torch.Tensor = TRIL) -> dict[str, torch.Tensor]:
    return {"inv": torch.tensor(0.125), "keep": keep, "fill": -1e4 * (1 - keep)}


def test_gpt_mask_by_product_and_fill_and_key_from_bshd() -> None:
    # -- score-chain: s * scale * keep + -1e4 * (1 - keep), k^T straight from [b, s, h, d]:
    #    one scale, one mask with -inf where keep is 0, and k^T rebuilt as fusion reads it --
    check(ScoreChain(), GPT, """
        graph main(%q : f32[1,2,4,8], %kx : f32[1,4,2,8], %v : f32[1,2,4,8]) {
          const @s_1_scale : f32[]
          const @p_mul_mask : f32[1,1,4,4]
          %kt_k : f32[1,2,4,8] = transpose[perm=[0,2,1,3]](%kx)
          %kt_kt : f32[1,2,8,4] = transpose[perm=[0,1,3,2]](%kt_k)
          %s_1 : f32[1,2,4,4] = matmul(%q, %kt_kt)
          %p_mul : f32[1,2,4,4] = mul(%s_1, @s_1_scale)
          %p_add : f32[1,2,4,4] = add(%p_mul, @p_mul_mask)
          %p : f32[1,2,4,4] = softmax[axis=3](%p_add)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, gpt_data(), numerics=True)


def test_gpt_chain_then_fuses_causal() -> None:
    g = load(GPT, gpt_data())
    ScoreChain()(g)
    AttentionFusion()(g)
    text = print_graph(g)
    assert "fused_attention[causal=true, scale=0.125](%q, %kt_k, %v)" in text, text
    assert "softmax" not in text


def test_runtime_mask_is_added_after_the_constant_part() -> None:
    # -- score-chain: where(tril, s, finfo.min) + %m (a mask the program computes, as decode's
    #    from its position ids): the constant part becomes a -inf mask, %m is added to it --
    check(ScoreChain(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8], %m : f32[1,1,4,4]) {
          const @tril : bool[1,1,4,4]
          const @low : f32[]
          %s : f32[1,2,4,4] = matmul(%q, %k)
          %w : f32[1,2,4,4] = where(@tril, %s, @low)
          %c : f32[1,2,4,4] = add(%w, %m)
          %p : f32[1,2,4,4] = softmax[axis=3](%c)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8], %m : f32[1,1,4,4]) {
          const @s_mask : f32[1,1,4,4]
          %s : f32[1,2,4,4] = matmul(%q, %k)
          %s_masks : f32[1,1,4,4] = add(@s_mask, %m)
          %p_add : f32[1,2,4,4] = add(%s, %s_masks)
          %p : f32[1,2,4,4] = softmax[axis=3](%p_add)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, {"tril": TRIL.bool(), "low": torch.tensor(torch.finfo(torch.float32).min)}, numerics=True)


CLAMPED = """
    graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8]) {
      const @mask : f32[1,1,4,4]
      const @low : f32[]
      %s : f32[1,2,4,4] = matmul(%q, %k)
      %a : f32[1,2,4,4] = add(%s, @mask)
      %c : f32[1,2,4,4] = maximum(%a, @low)
      %p : f32[1,2,4,4] = softmax[axis=3](%c)
      %y : f32[1,2,4,8] = matmul(%p, %v)
      return %y
    }
    """


def test_clamped_mask() -> None:
    # -- score-chain: maximum(s + mask, finfo.min) (XGLM, OPT): the clamp changes nothing shown --
    low = torch.finfo(torch.float32).min
    check(ScoreChain(), CLAMPED, """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8]) {
          const @s_mask : f32[1,1,4,4]
          %s : f32[1,2,4,4] = matmul(%q, %k)
          %p_add : f32[1,2,4,4] = add(%s, @s_mask)
          %p : f32[1,2,4,4] = softmax[axis=3](%p_add)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, {"mask": torch.full((4, 4), low).triu(1)[None, None], "low": torch.tensor(low)}, numerics=True)


def test_refuses_a_scale_that_varies() -> None:
    # -- a per-key multiplier is not one scale: left alone --
    keep = TRIL * torch.tensor([1.0, 2.0, 1.0, 1.0])
    refuses(ScoreChain(), GPT, "score-scale-and-mask", "the chain is not a scale and an additive mask",
            gpt_data(keep))


def test_refuses_a_row_that_hides_every_key() -> None:
    keep = TRIL.clone()
    keep[..., 2, :] = 0
    refuses(ScoreChain(), GPT, "score-scale-and-mask", "a row hides every key", gpt_data(keep))


def test_leaves_the_canonical_form_alone() -> None:
    refuses(ScoreChain(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8]) {
          const @c : f32[]
          const @mask : f32[1,1,4,4]
          %s : f32[1,2,4,4] = matmul(%q, %k)
          %a : f32[1,2,4,4] = mul(%s, @c)
          %b : f32[1,2,4,4] = add(%a, @mask)
          %p : f32[1,2,4,4] = softmax[axis=3](%b)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, "score-scale-and-mask", "already one scale and one mask",
            {"c": torch.tensor(0.5), "mask": torch.zeros(1, 1, 4, 4)})


def test_refuses_scores_through_other_ops() -> None:
    refuses(ScoreChain(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,4], %v : f32[1,2,4,8]) {
          const @mask : f32[1,1,4,4]
          %s : f32[1,2,4,4] = matmul(%q, %k)
          %t : f32[1,2,4,4] = tanh(%s)
          %b : f32[1,2,4,4] = add(%t, @mask)
          %c : f32[1,2,4,4] = add(%b, @mask)
          %p : f32[1,2,4,4] = softmax[axis=3](%c)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, "score-scale-and-mask", "the scores pass through tanh", {"mask": torch.zeros(1, 1, 4, 4)})


XGLM_3D = """
    graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
      const @alpha : f32[]
      const @mask : f32[1,1,4,4]
      const @low : f32[]
      %q3 : f32[2,4,8] = reshape[shape=[2,4,8]](%q)
      %k3 : f32[2,4,8] = reshape[shape=[2,4,8]](%k)
      %kt3 : f32[2,8,4] = transpose[perm=[0,2,1]](%k3)
      %s3 : f32[2,4,4] = matmul(%q3, %kt3)
      %a : f32[2,4,4] = mul(%s3, @alpha)
      %s4 : f32[1,2,4,4] = reshape[shape=[1,2,4,4]](%a)
      %m : f32[1,2,4,4] = add(%s4, @mask)
      %c : f32[1,2,4,4] = maximum(%m, @low)
      %c3 : f32[2,4,4] = reshape[shape=[2,4,4]](%c)
      %p3 : f32[2,4,4] = softmax[axis=2](%c3)
      %v3 : f32[2,4,8] = reshape[shape=[2,4,8]](%v)
      %y3 : f32[2,4,8] = matmul(%p3, %v3)
      %y : f32[1,2,4,8] = reshape[shape=[1,2,4,8]](%y3)
      return %y
    }
    """


def test_batched_3d_attention_is_lifted_and_fuses() -> None:
    # -- score-chain: bmm scores viewed 4-D for the mask, the softmax and the product with v
    #    back in 3-D (XGLM): lifted to [b, h, ..] products, then one causal fused_attention --
    low = torch.finfo(torch.float32).min
    data = {"alpha": torch.tensor(0.25), "mask": torch.full((4, 4), low).triu(1)[None, None],
            "low": torch.tensor(low)}
    g = load(XGLM_3D, data)
    res = ScoreChain()(g)
    assert res.details["rules"]["batched-probabilities-4d"]["applied"] == 1
    Canonicalize()(g)
    AttentionFusion()(g)
    DeadCodeElimination()(g)
    verify(g)
    text = print_graph(g)
    assert text.count("fused_attention[causal=true, scale=0.25]") == 1 and "softmax" not in text, text
    for seed in range(3):
        feeds = random_feeds(g, seed)
        torch.testing.assert_close(interpret(g, feeds)[0], interpret(load(XGLM_3D, data), feeds)[0],
                                   atol=1e-5, rtol=1e-5)


def test_refuses_a_3d_chain_whose_views_regroup_heads() -> None:
    # a [b*h, q, k] view that is not the merge of the 4-D one's leading axes: not attention heads
    refuses(ScoreChain(), """
        graph main(%q : f32[4,4,8], %k : f32[4,8,4], %v : f32[4,4,8]) {
          const @mask : f32[1,1,4,4]
          %s3 : f32[4,4,4] = matmul(%q, %k)
          %s4 : f32[2,2,4,4] = reshape[shape=[2,2,4,4]](%s3)
          %m : f32[2,2,4,4] = add(%s4, @mask)
          %c3 : f32[4,2,8] = reshape[shape=[4,2,8]](%m)
          %p3 : f32[4,2,8] = softmax[axis=2](%c3)
          return %p3
        }
        """, "score-scale-and-mask", "the scores are not [b, h, q, k] (or its [b*h, q, k] merge) throughout",
            {"mask": torch.zeros(1, 1, 4, 4)})


ALIBI = """
    graph main(%q : f32[1,4,4,8], %k : f32[1,4,4,8], %v : f32[1,4,4,8]) {
      const @alpha : f32[]
      const @alibi : f32[1,4,1,4]
      const @mask : f32[1,1,4,4]
      %kt : f32[1,4,8,4] = transpose[perm=[0,1,3,2]](%k)
      %s : f32[1,4,4,4] = matmul(%q, %kt)
      %a : f32[1,4,4,4] = mul(%s, @alpha)
      %b : f32[1,4,4,4] = add(%a, @alibi)
      %c : f32[1,4,4,4] = add(%b, @mask)
      %p : f32[1,4,4,4] = softmax[axis=3](%c)
      %y : f32[1,4,4,8] = matmul(%p, %v)
      return %y
    }
    """
SLOPES = (0.5, 0.25, 0.125, 0.0625)


def alibi_data() -> dict[str, torch.Tensor]:
    # Bloom's bias: slope_h * j for key j, whatever the query
    return {"alpha": torch.tensor(0.25), "alibi": torch.tensor(SLOPES).view(1, 4, 1, 1) * torch.arange(4.0),
            "mask": torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)[None, None]}


@pytest.mark.parametrize("limit", [1 << 24, 16], ids=["whole", "by-head"])
def test_alibi_becomes_slopes_on_causal_attention(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # -- score-chain: a per-head bias on each key and a causal mask stay two constants (never
    #    their [b, h, q, k] sum; a probe too large whole goes head by head); attention fusion
    #    reads them as ALiBi slopes on a causal attention --
    monkeypatch.setattr(score_chain, "_PROBE_LIMIT", limit)
    g = load(ALIBI, alibi_data())
    ScoreChain()(g)
    text = print_graph(g)
    assert "f32[1,4,1,4]" in text and "f32[1,4,4,4] = add(%" in text and "softmax" in text
    AttentionFusion()(g)
    DeadCodeElimination()(g)
    verify(g)
    text = print_graph(g)
    assert "fused_attention[alibi=[0.5,0.25,0.125,0.0625], causal=true, scale=0.25](%q, %k, %v)" in text, text
    for seed in range(3):
        feeds = random_feeds(g, seed)
        torch.testing.assert_close(interpret(g, feeds)[0], interpret(load(ALIBI, alibi_data()), feeds)[0],
                                   atol=1e-5, rtol=1e-5)


def test_a_per_head_bias_that_is_not_linear_stays_a_mask() -> None:
    data = alibi_data()
    data["alibi"] = data["alibi"] ** 2  # a bias per head and key, but not slope * j: no ALiBi
    g = load(ALIBI, data)
    ScoreChain()(g)
    AttentionFusion()(g)
    text = print_graph(g)
    assert "fused_attention[causal=false, scale=0.25]" in text and "alibi=" not in text, text
