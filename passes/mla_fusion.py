"""MLA fusion: DeepSeek's multi-head latent attention as one op over the latent.

DeepSeek-V2/V3 project each token to a latent `c` (rank r) plus one rope key shared
by all heads, and expand per-head keys and values from `c` with `kv_b_proj`. After
attention fusion that reads:

    %kvb = linear(%c : [b,1,s,r], @kv_b_proj.weight : [h*(dn+dv), r])
    %kv4 = transpose[perm=[0,2,1,3]](reshape[shape=[b,s,h,dn+dv]](%kvb))
    %k_nope, %v = split[axis=3, sizes=[dn,dv]](%kv4)
    %k = slice_scatter[3, dn:dn+dr](slice_scatter[3, 0:dn](@empty, %k_nope), expand(%k_rot : [b,1,s,dr]))
                                                            (or concat[axis=3](%k_nope, expand(%k_rot)))
    %o = fused_attention[scale](concat[axis=3](%q_nope, %q_rot), %k, %v)
  ->
    %kv = concat[axis=3](%c, %k_rot)                          [b,1,s,r+dr]: what a token caches
    %o  = mla_attention[scale, causal](%q_nope, %q_rot, %kv, @kv_b_proj.weight.uk, @kv_b_proj.weight.uv)

`kv_b_proj`'s rows split per head into W_UK [h, dn, r] and W_UV (stored [h, r, dv]).
The op computes over the latent when that is cheaper, which decode always is:
q_nope @ W_UK moves the queries into latent space, scores are [q_lat | q_rot] . kv,
and the attended latent goes back out through W_UV, so no per-head key or value is
ever formed; the KV-cache pass then caches `%kv` alone.

W_UK and W_UV are applied per head next to the attention rather than folded into the
q_b_proj and o_proj weights: folded, DeepSeek-V3's query and output projections
would grow from 1536x(128*192) and (128*128)x7168 to 1536x(128*576) and
(128*512)x7168 values, 2.5x and 4x the bytes streamed per decoded token.

Left alone: a mask other than the causal one, a `kv_b_proj` with a bias, operands
not laid out as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from npuc.ir import Value, get_op
from npuc.ir.evaluate import fold_node
from npuc.ir.ops import linear_nk
from npuc.passes.attention_fusion import hides_nothing
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, any_of, op, var


def _expanded_key() -> object:
    rot = op("expand", var("k_rot"))
    by_copies = op("slice_scatter", op("slice_scatter", var("k_base"), var("k_nope"), axis=3, start=0, step=1),
                   rot, axis=3, step=1, bind="k_scatter")
    return any_of(by_copies, op("concat", var("k_nope"), rot, axis=lambda a: a in (3, -1)))


def _latent(m: Match) -> tuple[Value, Value, str] | str:
    """The latent `c`, the kv_b_proj weight and its layout behind k_nope and v, or why not."""
    k_nope, v = m["k_nope"], m["v"]
    split = k_nope.producer
    if split is None or split.op != "split" or k_nope.index != 0 or v.producer is not split or v.index != 1 \
            or split.attrs["axis"] != 3:
        return "k_nope and v are not the two halves of one split"
    tr = split.inputs[0].producer
    if tr is None or tr.op != "transpose" or tuple(tr.attrs["perm"]) != (0, 2, 1, 3):
        return "the expanded keys are not transposed [b,s,h,d] -> [b,h,s,d]"
    rs = tr.inputs[0].producer
    lin = rs.inputs[0].producer if rs is not None and rs.op == "reshape" else None
    if lin is None or lin.op != "linear" or len(lin.inputs) != 2 or not lin.inputs[1].is_const:
        return "the expanded keys do not come from a constant projection without bias"
    c, w = lin.inputs
    layout = str(lin.attrs.get("weight_layout", "nk"))
    b, h, s, dn = k_nope.type.shape
    dv = v.type.shape[3]
    if c.type.rank != 4 or c.type.shape[:3] != (b, 1, s):
        return f"the latent {c.type} is not [b, 1, s, r]"
    if linear_nk(w.type, layout) != (h * (dn + dv), c.type.shape[3]):
        return f"kv_b_proj {w.type} does not expand {h} heads of {dn}+{dv}"
    return c, w, layout


def _check(m: Match) -> str | None:
    found = _latent(m)
    if isinstance(found, str):
        return found
    c = found[0]
    k_nope, k_rot, q_nope, q_rot = m["k_nope"], m["k_rot"], m["q_nope"], m["q_rot"]
    b, h, s, dn = k_nope.type.shape
    dr = k_rot.type.shape[-1]
    if k_rot.type.shape != (b, 1, s, dr) or q_rot.type.shape[-1] != dr or q_nope.type.shape[-1] != dn \
            or q_nope.type.shape[:2] != (b, h):
        return f"rope key {k_rot.type} and queries {q_nope.type}/{q_rot.type} do not fit {h} heads"
    if "k_scatter" in m.values and (m.node("k_scatter").attrs["start"] != dn
                                    or m["k_base"].type.shape[-1] != dn + dr):
        return "the key is not [nope key | rope key]"  # the copies cover the whole (empty) base
    if len({c.type.dtype, k_rot.type.dtype, q_nope.type.dtype}) != 1:
        return "the latent, rope key and queries have different dtypes"
    mask = m.values.get("mask")
    if mask is not None and not hides_nothing(mask):
        return "the attention has a mask that is not the causal one"
    return None


def _fold(b: Builder, name: str, op_name: str, x: Value, attrs: dict[str, object]) -> Value:
    n = b.g.add_node(op_name, [x], get_op(op_name).infer_types([x.type], attrs), attrs, names=name, before=b.before)
    (c,) = fold_node(b.g, n)
    return c


def _rewrite(b: Builder, m: Match) -> Value:
    found = _latent(m)
    assert not isinstance(found, str), found
    c, w, layout = found
    att = m.node("att")
    h, dn = m["k_nope"].type.shape[1], m["k_nope"].type.shape[3]
    dv, r = m["v"].type.shape[3], c.type.shape[3]
    # Derived from the weight by folded views, so the weight is read only when the .om is written.
    per_head = _fold(b, f"{w.name}.heads", "transpose", w, {"perm": (1, 0)}) if layout == "kn" else w
    per_head = _fold(b, f"{w.name}.heads", "reshape", per_head, {"shape": (h, dn + dv, r)})
    w_uk = _fold(b, f"{w.name}.uk", "slice", per_head, {"axis": 1, "start": 0, "end": dn, "step": 1})
    w_uv = _fold(b, f"{w.name}.uv", "slice", per_head, {"axis": 1, "start": dn, "end": dn + dv, "step": 1})
    w_uv = _fold(b, f"{w.name}.uv", "transpose", w_uv, {"perm": (0, 2, 1)})
    kv = b.op("concat", [c, m["k_rot"]], {"axis": 3}, name=f"{att.name}.kv")
    causal = bool(att.attrs["causal"]) and m["q_nope"].type.shape[2] > 1
    return b.op("mla_attention", [m["q_nope"], m["q_rot"], kv, w_uk, w_uv],
                {"scale": float(att.attrs["scale"]), "causal": causal})


@dataclass(frozen=True)
class MLAFusion(RewritePass):
    name = "mla-fusion"

    def rules(self) -> Sequence[Rule]:
        q = op("concat", var("q_nope"), var("q_rot"), axis=lambda a: a in (3, -1), bind="q")
        att = any_of(op("fused_attention", q, _expanded_key(), var("v"), bind="att"),
                     op("fused_attention", q, _expanded_key(), var("v"), var("mask"), bind="att"))
        return [Rule("mla-attention", att, _rewrite, _check)]
