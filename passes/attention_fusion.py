"""SDPA -> FusedAttention: every spelling of attention becomes one `fused_attention`.

Sources: `sdpa` (torch's `scaled_dot_product_attention`, ONNX `Attention`), and the
decomposed form exporters write at opset 18:

    %kt = transpose[perm=[0,1,3,2]](%k)        (or reshape -> transpose -> reshape)
    %s  = matmul(mul(%q, @c1), mul(%kt, @c2))   (scale on the scores, split as sqrt on q and k, or absent)
    %s  = mul(tanh(div(%s, @cap)), @cap)        (soft-capped scores, Gemma 2: optional)
    %sm = softmax[axis=-1](add(%s, @mask))      (additive mask, where(%mask, %s, -inf), or none)
    %p  = where(is_nan(%sm), @zero, %sm)        (the NaN guard, optional)
    %y  = matmul(%p, %v)
  ->
    %y  = fused_attention[scale=c1*c2, causal=..., softcap=cap](%q, %k, %v [, %mask])

GQA: keys and values repeated by `repeat_kv` (reshape -> expand -> reshape) are read
from before the repeat; the op broadcasts heads itself. A constant mask equal to the
causal mask becomes `causal=true` and disappears; one equal to a sliding window's causal
band (query i sees keys i-w+1..i) becomes `causal=true, window=w`. A mask that is ALiBi's
per-head bias on each key, slope_h * j, on such a mask (score-chain's add(@key_bias, @mask),
or their sum) becomes `alibi=[slope_h, ..]` on it. q/k and v head dims may differ (MLA).

With attention sinks (gpt-oss), a constant column of per-head logits joins the scores
before the softmax and its probability is dropped after:

    %c  = concat[axis=-1](add(%s, @mask), @sinks)     %p = slice(softmax(sub(%c, reduce_max(%c))), 0:L)
  ->
    %y  = fused_attention[causal=true, scale=..](%q, %k, %v, @no_mask, @sinks_heads)

Left alone: a softmax over other than the last axis, a mask whose shape does not
broadcast to [batch, heads, q, k] (it then stays an explicit operand only if it
does), scores scaled by a non-scalar, and operands that are not 4-D.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from npuc.ir import DType, Value, get_op
from npuc.ir.fused_ops import window_mask
from npuc.ir.ops import ShapeError, broadcast
from npuc.passes.mask_analysis import mask_window_of
from npuc.passes.rewrite import (
    Builder,
    Match,
    RewritePass,
    Rule,
    any_of,
    const,
    is_const,
    last_axis,
    op,
    opt,
    var,
)
from npuc.passes.score_chain import key_bias_split


def _scalar(v: Value) -> bool:
    return v.is_const and v.type.numel == 1


def repeat_source(v: Value) -> Value | None:
    """The [b, hkv, s, d] tensor that `repeat_kv` repeated into `v`, if it was.

    `v` is the repeat's final reshape [b, hkv*n, s, d], or its expand [b, hkv, n, s, d]
    when an exporter merged that reshape into the next one."""
    final = None
    if v.producer is not None and v.producer.op == "reshape" and v.type.rank == 4:
        final, v = v, v.producer.inputs[0]
    e = v.producer
    if e is None or e.op != "expand" or v.type.rank != 5:
        return None
    r1 = e.inputs[0].producer
    if r1 is None or r1.op != "reshape" or r1.inputs[0].type.rank != 4:
        return None
    base = r1.inputs[0]
    b, h, s, d = base.type.shape
    n = v.type.shape[2]
    if r1.outputs[0].type.shape != (b, h, 1, s, d) or v.type.shape != (b, h, n, s, d):
        return None
    if final is not None and final.type.shape != (b, h * n, s, d):
        return None  # the heads were regrouped some other way: not a repeat
    return base


def strip_repeat_kv(v: Value) -> Value:
    base = repeat_source(v)
    return base if base is not None and v.type.rank == 4 else v


def hides_nothing(mask: Value) -> bool:
    """Whether a constant mask (in memory: a weight is never read to match) masks no key:
    what a one-token trace folds its causal mask to."""
    if mask.const is None or not getattr(mask.const, "in_memory", False):
        return False
    t = mask.const.load()
    return bool(t.all()) if t.dtype == torch.bool else bool((t == 0).all())


def causal_window(mask: Value, q_len: int, k_len: int) -> int | None:
    """Whether a constant mask is exactly the (top-left aligned) causal mask: 0 if it is,
    the window w if it is the causal band of a sliding window (query i sees keys
    i-w+1..i, w < q_len), None otherwise. A mask computed from constants (too large to fold:
    a long prompt's) is read from how it is built, never evaluated (passes/mask_analysis.py)."""
    if mask.type.rank < 2 or mask.type.shape[-2:] != (q_len, k_len):
        return None
    if mask.const is None:
        window = mask_window_of(mask, q_len, k_len)
        return None if isinstance(window, str) else window  # UNKNOWN: left to the mask's own values
    if any(d != 1 for d in mask.type.shape[:-2]) and mask.type.numel > (1 << 22):
        return None
    return mask_window(mask.const.load(), q_len, k_len)


def mask_window(t: torch.Tensor, q_len: int, k_len: int) -> int | None:
    """causal_window of a mask's values."""
    if t.dim() < 2 or tuple(t.shape[-2:]) != (q_len, k_len):
        return None
    if t.dtype == torch.bool:
        seen = t
    else:
        t = t.double()
        if not ((t == 0) | (t <= -1e4)).all():
            return None  # a bias, not a mask
        seen = t == 0
    seen = seen.reshape(-1, q_len, k_len)
    if not bool((seen == seen[:1]).all()):
        return None  # differs along batch or heads
    seen = seen[0]
    w = int(seen[-1].sum())
    for window in (0, w) if w < q_len else (0,):
        if torch.equal(seen, window_mask(torch.arange(q_len), k_len, window)):
            return window
    return None


def alibi_mask(mask: Value, q_len: int, k_len: int) -> tuple[tuple[float, ...], int] | None:
    """(slopes, window) where a mask is ALiBi's per-head key bias, slope_h * j (+ a constant per
    head), on the causal mask or a sliding window's band: what score-chain writes as
    add(@key_bias [b, h, 1, k], @mask [1, 1, q, k]), or one constant it sums to. None otherwise."""
    parts: tuple[torch.Tensor, torch.Tensor] | None = None
    n = mask.producer
    if mask.const is not None and getattr(mask.const, "in_memory", False):
        parts = key_bias_split(mask.const.load())
    elif n is not None and n.op == "add" and all(v.const is not None and getattr(v.const, "in_memory", False)
                                                 for v in n.inputs):
        a, c = (v.const.load() for v in n.inputs if v.const is not None)
        parts = (a, c) if a.dim() == 4 and a.shape[-2] == 1 else (c, a)
    if parts is None:
        return None
    bias, qk = parts
    if bias.dim() != 4 or bias.shape[-2] != 1 or bias.shape[-1] != k_len or k_len < 2:
        return None
    window = mask_window(qk, q_len, k_len)
    if window is None:
        return None
    b = bias.double()[:, :, 0, :]  # [batch, heads, k]
    if not bool((b == b[:1]).all()):
        return None  # differs along the batch
    slopes = (b[0, :, -1] - b[0, :, 0]) / (k_len - 1)
    line = b[0, :, :1] + slopes[:, None] * torch.arange(k_len, dtype=torch.float64)
    if not bool(((b[0] - line).abs() <= 1e-4 * (line.abs() + 1)).all()):
        return None  # not linear in the key's position
    return tuple(float(x) for x in slopes), window


def _kv(q: Value, k: Value, v: Value) -> tuple[Value, Value] | str:
    """k and v as fused_attention takes them: repeat_kv undone on both where that leaves them
    the same heads (grouped-query attention), else as the product saw them (a model that
    builds v's heads some other way, DiffLlama's, keeps its repeated k); or why they do not fit."""
    ks, vs = strip_repeat_kv(k), strip_repeat_kv(v)
    if ks.type.rank == vs.type.rank == 4 and ks.type.shape[1] != vs.type.shape[1]:
        ks, vs = k, v
    try:
        get_op("fused_attention").infer_types([q.type, ks.type, vs.type], {"scale": 1.0})
    except ShapeError as e:
        return f"q, k and v do not fit one attention: {e}"
    return ks, vs


def _build(b: Builder, q: Value, k: Value, v: Value, mask: Value | None, scale: float,
           causal: bool = False, softcap: float = 0.0, sinks: Value | None = None) -> Value:
    kv = _kv(q, k, v)  # the checks refused what does not fit, so this is the fitting pair
    k, v = kv if not isinstance(kv, str) else (strip_repeat_kv(k), strip_repeat_kv(v))
    window = causal_window(mask, q.type.shape[2], k.type.shape[2]) if mask is not None else None
    alibi = alibi_mask(mask, q.type.shape[2], k.type.shape[2]) if mask is not None and window is None else None
    if alibi is not None and len(alibi[0]) == q.type.shape[1] and not causal:
        window = alibi[1]
    else:
        alibi = None
    ins = [q, k, v] + ([mask] if mask is not None and window is None else [])
    if sinks is not None:  # after the mask slot: a mask of zeros where there is none
        if len(ins) == 3:
            ins.append(b.const("no_mask", torch.zeros((), dtype=q.type.dtype.torch)))
        ins.append(sinks)
    attrs: dict[str, object] = {"scale": scale, "causal": causal or window is not None}
    if window:
        attrs["window"] = window
    if alibi is not None:
        attrs["alibi"] = alibi[0]
    if softcap:
        attrs["softcap"] = softcap
    return b.op("fused_attention", ins, attrs)


def _mask_ok(m: Match, q: Value, k: Value) -> str | None:
    mask = m.values.get("mask")
    if q.type.rank != 4 or k.type.rank != 4:
        return "attention operands are not 4-D [batch, heads, seq, dim]"
    if mask is not None:
        try:
            if broadcast(mask.type.shape, (q.type.shape[0], q.type.shape[1], q.type.shape[2], k.type.shape[2])) \
                    != (q.type.shape[0], q.type.shape[1], q.type.shape[2], k.type.shape[2]):
                return f"mask {mask.type} broadcasts the scores to another shape"
        except ShapeError:
            return f"mask {mask.type} does not broadcast to the scores"
    return None


# -- from sdpa ------------------------------------------------------------------------------

def _sdpa_check(m: Match) -> str | None:
    bad = _mask_ok(m, m["q"], m["k"])
    if bad is None and m["q"].type.rank == 4:
        kv = _kv(m["q"], m["k"], m["v"])
        bad = kv if isinstance(kv, str) else None
    return bad


def _sdpa_rewrite(b: Builder, m: Match) -> Value:
    q = m["q"]
    scale = m.node("att").attrs.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.type.shape[-1])
    return _build(b, q, m["k"], m["v"], m.values.get("mask"), float(scale), bool(m.node("att").attrs.get("causal")))


# -- from the decomposed form ---------------------------------------------------------------

def _swap_last(perm: tuple[int, ...]) -> bool:
    return len(perm) == 4 and tuple(perm) == (0, 1, 3, 2)


def _kt(k: str) -> object:
    """k transposed over its last two axes: directly, or folded through a 3-D view."""
    direct = op("transpose", var(k), perm=_swap_last)
    via_3d = op("reshape", op("transpose", op("reshape", var(k)), perm=(0, 2, 1)), bind="kt3")
    return any_of(direct, via_3d)


def _scaled(inner: object, name: str) -> object:
    return any_of(op("mul", inner, var(name, _scalar)), op("div", inner, var(name + "_div", _scalar)), inner)


def _decomposed_pattern() -> object:
    scores = op("matmul", _scaled(var("q"), "cq"), _scaled(_kt("k"), "ck"), bind="qk")
    scaled = _scaled(scores, "cs")
    # Soft-capped scores (Gemma 2): cap * tanh(scores / cap), the division as one or a product
    inner = any_of(op("div", scaled, var("cap_div", _scalar)), op("mul", scaled, var("cap_inv", _scalar)))
    capped = any_of(op("mul", op("tanh", inner), var("cap", _scalar)), scaled)
    ninf = const(value=float("-inf"))
    masked = any_of(op("add", capped, var("mask")),
                    op("where", var("mask", lambda v: v.type.dtype == DType.bool), capped, ninf), capped)
    sm = op("softmax", masked, bind="sm", axis=lambda a: a in (3, -1))
    guarded = any_of(op("where", op("is_nan", sm), const(value=0.0), sm), sm)
    return op("matmul", opt("cast", guarded), var("v"))


def _key(b: Builder | None, m: Match) -> Value | str:
    """k as [b, h, s, d] (or from before its repeat_kv), however the exporter viewed it for the transpose."""
    k = m["k"]
    if "kt3" not in m.values:
        return k
    bb, h, d, s = m["kt3"].type.shape if m["kt3"].type.rank == 4 else (0, 0, 0, 0)
    transpose = m["kt3"].producer.inputs[0].producer if m["kt3"].producer else None
    if transpose is None:
        return "no key transpose"
    inner = transpose.inputs[0]
    if m["kt3"].type.rank != 4 or inner.type.shape != (bb * h, s, d):
        return "the 3-D key transpose does not swap the last two axes"
    if k.type.numel != bb * h * s * d:
        return "the key view does not hold [batch, heads, seq, dim]"
    base = repeat_source(k)
    if base is not None and base.type.shape[0] == bb and base.type.shape[2:] == (s, d) and \
            base.type.shape[1] * (k.type.shape[2] if k.type.rank == 5 else h // base.type.shape[1]) == h:
        return base
    if b is None:
        return k
    return k if k.type.shape == (bb, h, s, d) else b.op("reshape", [k], {"shape": (bb, h, s, d)}, name=f"{k.name}_4d")


def _softcap(m: Match) -> float | str:
    """The soft-cap of the scores (0: none), or why the two constants are not one cap."""
    if "cap" not in m.values:
        return 0.0
    cap = float(m.data("cap").reshape(-1)[0])
    div = float(m.data("cap_div").reshape(-1)[0]) if "cap_div" in m.values else \
        1.0 / float(m.data("cap_inv").reshape(-1)[0])
    if not cap > 0 or not math.isclose(cap, div, rel_tol=1e-6):
        return f"tanh(scores / {div:g}) * {cap:g} is not a soft-cap"
    return cap


def _decomposed_check(m: Match) -> str | None:
    q = m["q"]
    cap = _softcap(m)
    if isinstance(cap, str):
        return cap
    k = _key(None, m)
    if isinstance(k, str):
        return k
    mask = m.values.get("mask")
    if q.type.rank != 4:
        return "attention operands are not 4-D [batch, heads, seq, dim]"
    kv = _kv(q, k, m["v"]) if k.type.rank == 4 else None  # a 3-D key is viewed 4-D only when built
    if isinstance(kv, str):
        return kv
    scores = m["qk"].type.shape
    if mask is not None:
        try:
            if broadcast(mask.type.shape, scores) != scores:
                return f"mask {mask.type} broadcasts the scores to another shape"
        except ShapeError:
            return f"mask {mask.type} does not broadcast to the scores"
    return None


def _scores_scale(m: Match) -> float:
    """The scale of the scores: the product of the scalars on q, on k^T and on their product."""
    scale = 1.0
    for name in ("cq", "ck", "cs"):
        if name in m.values:
            scale *= float(m.data(name).reshape(-1)[0])
        if name + "_div" in m.values:
            scale /= float(m.data(name + "_div").reshape(-1)[0])
    return scale


def _decomposed_rewrite(b: Builder, m: Match, sinks: Value | None = None) -> Value:
    k = _key(b, m)
    assert not isinstance(k, str), k
    cap = _softcap(m) if sinks is None else 0.0
    assert not isinstance(cap, str), cap
    y = _build(b, m["q"], k, m["v"], m.values.get("mask"), _scores_scale(m), softcap=cap, sinks=sinks)
    root = m.matched[0].outputs[0]
    return y if y.type.dtype == root.type.dtype else b.op("cast", [y], {"dtype": root.type.dtype})


# -- with attention sinks (gpt-oss) -----------------------------------------------------------

def _sinks_pattern() -> object:
    scores = op("matmul", _scaled(var("q"), "cq"), _scaled(_kt("k"), "ck"), bind="qk")
    scaled = _scaled(scores, "cs")
    masked = any_of(op("add", scaled, var("mask")), scaled)
    cat = op("concat", masked, var("sinks", is_const), bind="cat")
    shifted = any_of(op("sub", cat, op("reduce_max", cat, bind="max")), cat)
    probs = op("slice", op("softmax", shifted, bind="sm", axis=lambda a: a in (3, -1)), bind="drop")
    return op("matmul", opt("cast", probs), var("v"))


def _sink_logits(m: Match) -> torch.Tensor | str:
    """The per-head sink logits [heads] behind the constant [.., heads, q, 1] column, or why not."""
    q, s = m["q"], m["sinks"]
    b, h, n = q.type.shape[0], q.type.shape[1], q.type.shape[2]
    if s.type.rank != 4 or s.type.shape[1:] != (h, n, 1) or s.type.shape[0] not in (1, b):
        return f"sinks {s.type} are not a column [batch, {h}, {n}, 1]"
    t = m.data("sinks")[..., 0]
    if not bool((t == t[:1, :, :1]).all()):
        return "the sink logits vary along batch or queries"
    return t[0, :, 0]


def _sinks_check(m: Match) -> str | None:
    bad = _decomposed_check(m)
    if bad is not None:
        return bad
    cat, drop = m.node("cat"), m.node("drop")
    length = m["qk"].type.shape[-1]
    if not last_axis(cat) or cat.outputs[0].type.shape[-1] != length + 1:
        return "the sinks are not one more column of the scores"
    d = get_op("slice").full_attrs(drop.attrs)
    if not last_axis(drop) or (d["start"], d["end"], d["step"]) != (0, length, 1):
        return "the probabilities kept are not the scores' columns"
    if "max" in m.nodes:
        a = get_op("reduce_max").full_attrs(m.node("max").attrs)
        if tuple(x % 4 for x in a["axes"]) != (3,) or not a["keepdim"]:
            return "the shift is not the maximum over the keys"
    sinks = _sink_logits(m)
    return sinks if isinstance(sinks, str) else None


def _sinks_rewrite(b: Builder, m: Match) -> Value:
    logits = _sink_logits(m)
    assert not isinstance(logits, str), logits
    return _decomposed_rewrite(b, m, sinks=b.const(f"{m['sinks'].name}_heads", logits.contiguous()))


@dataclass(frozen=True)
class AttentionFusion(RewritePass):
    name = "attention-fusion"

    def rules(self) -> Sequence[Rule]:
        sdpa = any_of(op("sdpa", var("q"), var("k"), var("v"), var("mask"), bind="att"),
                      op("sdpa", var("q"), var("k"), var("v"), bind="att"))
        return [
            Rule("sdpa-to-fused-attention", sdpa, _sdpa_rewrite, _sdpa_check),
            Rule("decomposed-attention", _decomposed_pattern(), _decomposed_rewrite, _decomposed_check),
            Rule("attention-with-sinks", _sinks_pattern(), _sinks_rewrite, _sinks_check),
        ]
