"""ONNX's transformer operators: RMSNormalization and LayerNormalization, RotaryEmbedding
and Attention (with opset 25's sliding window), converted onto npuc's fused ops where one
covers the node, and onto the spec's formula in primitive ops otherwise. Registered into
the ONNX frontend's CONVERTERS when it is imported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from npuc.compiler.onnx_frontend import _Ctx, converts, onnx_dtype
from npuc.ir import DType, Value


@converts("RMSNormalization", "LayerNormalization")
def _norm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x = ins[0]
    assert x is not None
    op = "rms_norm" if node.op_type == "RMSNormalization" else "layer_norm"
    params = [v for v in ins[1:] if v is not None]
    axis, eps = a.get("axis", -1) % x.type.rank, a.get("epsilon", 1e-5)
    y = ctx.one(op, [x, *params], {"axis": axis, "eps": eps})
    if not any(node.output[1:]):
        return [y]
    # LayerNormalization's Mean and InvStdDev (training outputs), in the stash type: the
    # fused op does not expose them, so they are recomputed from the same formula.
    stash = onnx_dtype(a.get("stash_type", 1), ctx.where)
    xs = ctx.cast(x, stash)
    red = {"axes": tuple(range(axis, x.type.rank)), "keepdim": True}
    mean = ctx.one("reduce_mean", [xs], red, name=f"{node.output[0]}_mean")
    dev = ctx.one("sub", [xs, mean])
    var = ctx.one("reduce_mean", [ctx.one("mul", [dev, dev])], red)
    inv = ctx.one("reciprocal", [ctx.one("sqrt", [ctx.one("add", [var, ctx.const(eps, stash)])])])
    return [y, mean, inv]


@converts("RotaryEmbedding")
def _rotary(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    vals = [v for v in ins if v is not None]
    return [ctx.one("rotary_embedding", vals, {"interleaved": bool(a.get("interleaved", 0)),
                                               "num_heads": a.get("num_heads", 0),
                                               "rotary_dim": a.get("rotary_embedding_dim", 0)})]


def _split_heads(ctx: _Ctx, x: Value, n: int) -> Value:
    """[b, s, n*d] -> [b, n, s, d]."""
    b, s, width = x.type.shape
    return ctx.one("transpose", [ctx.reshape(x, (b, s, n, width // n))], {"perm": (0, 2, 1, 3)})


def _merge_heads(ctx: _Ctx, y: Value) -> Value:
    """[b, n, s, d] -> [b, s, n*d]."""
    b, h, s, d = y.type.shape
    return ctx.reshape(ctx.one("transpose", [y], {"perm": (0, 2, 1, 3)}), (b, s, h * d))


@converts("Attention")
def _attention(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """`sdpa` when the fused op covers the node; else the spec's formula in primitive ops
    (softcap, a qk_matmul_output, a softmax_precision other than the inputs')."""
    q, k, v = ins[0], ins[1], ins[2]
    assert q is not None and k is not None and v is not None
    mask, past_k, past_v = (ins[i] if len(ins) > i else None for i in (3, 4, 5))
    nonpad = ins[6] if len(ins) > 6 else None
    if nonpad is not None and past_k is not None:
        raise ctx.unsupported("Attention with nonpad_kv_seqlen and past_key")  # the spec forbids it too
    if (past_k is None) != (past_v is None):
        raise ctx.unsupported("Attention with only one of past_key and past_value")
    three_d = q.type.rank == 3
    if three_d:  # [b, s, heads*d] -> [b, heads, s, d]
        qh, kvh = a.get("q_num_heads", 0), a.get("kv_num_heads", 0)
        if not qh or not kvh:
            raise ctx.unsupported("3-D Attention without q_num_heads/kv_num_heads")

        q, k, v = _split_heads(ctx, q, qh), _split_heads(ctx, k, kvh), _split_heads(ctx, v, kvh)
    past = 0
    if past_k is not None and past_v is not None and not (_empty(past_k) and _empty(past_v)):
        # the KV cache grows along the sequence axis (a past of length 0, the first step, is none)
        past = past_k.type.shape[2]
        k = ctx.one("concat", [past_k, k], {"axis": 2}, name=f"{node.output[0]}_present_key")
        v = ctx.one("concat", [past_v, v], {"axis": 2}, name=f"{node.output[0]}_present_value")
    dt = q.type.dtype
    lq, lk = q.type.shape[-2], k.type.shape[-2]
    if mask is not None and mask.type.shape[-1] < lk:  # a short mask covers the first keys only
        fill = ctx.one("full", [], {"shape": mask.type.shape[:-1] + (lk - mask.type.shape[-1],),
                                    "value": 0.0 if mask.type.dtype == DType.bool else -math.inf,
                                    "dtype": mask.type.dtype})
        mask = ctx.one("concat", [mask, fill], {"axis": mask.type.rank - 1})
    causal = bool(a.get("is_causal", 0))
    softcap = float(a.get("softcap", 0.0))
    mode = int(a.get("qk_matmul_output_mode", 0))
    want_qk = len(node.output) > 3 and bool(node.output[3])
    precision = onnx_dtype(a["softmax_precision"], ctx.where) if "softmax_precision" in a else dt
    fused = not softcap and not want_qk and precision == dt
    # Opset 25's sliding window: query i (at position past + i) sees keys j with
    # past + i - left <= j <= past + i + right, each bound where it is >= 0; applied on its own,
    # beside the causal frontier and the mask.
    left, right = int(a.get("left_window_size", -1)), int(a.get("right_window_size", -1))
    if left < -1 or right < -1:
        raise ctx.unsupported(f"Attention window sizes {left}, {right} (each -1 or >= 0)")
    band = None
    if nonpad is not None:  # opset 24's external cache: each sequence's keys end at nonpad_kv_seqlen[b]
        mask = _compose(ctx, mask, _nonpad_allowed(ctx, node, nonpad, q.type.shape[0], lq, lk, causal, left, right))
        causal, left, right, fused = False, -1, -1, False  # its rows may be empty: the formula zeroes them
    if left >= 0 or right >= 0:
        diff = (np.arange(lq)[:, None] + past) - np.arange(lk)[None, :]
        ok = np.ones((lq, lk), dtype=bool)
        if left >= 0:
            ok &= diff <= left
        if right >= 0:
            ok &= -diff <= right
        band = ok
    if band is not None and not causal:
        mask = _compose(ctx, mask, ctx.const(band, DType.bool, f"{node.output[0]}_window"))
    if causal and (past or mask is not None or not fused or band is not None):
        # Bottom-right causal frontier (query i sees key j <= i + past), composed with the mask
        # as the spec says: a bool mask intersects it, a float mask gets -inf outside it.
        frontier = np.tril(np.ones((lq, lk), dtype=bool), past)
        allowed = ctx.const(frontier & band if band is not None else frontier, DType.bool, f"{node.output[0]}_causal")
        mask = _compose(ctx, mask, allowed)
        causal = False
    gqa = q.type.shape[-3] != k.type.shape[-3]
    qk: Value | None = None
    if fused:
        ops = [q, k, v] + ([mask] if mask is not None else [])
        y = ctx.one("sdpa", ops, {"scale": a.get("scale"), "causal": causal, "gqa": gqa})
    else:
        y, qk = _attention_math(ctx, q, k, v, mask, a.get("scale"), softcap, mode, precision)
    if three_d:
        y = _merge_heads(ctx, y)
    return [y, k, v, qk]  # present_key/value are the (grown) K and V


def _compose(ctx: _Ctx, mask: Value | None, allowed: Value) -> Value:
    """The spec's composition of a mask with a bool `allowed`: a bool mask intersects it, a
    float mask gets -inf outside it."""
    if mask is None:
        return allowed
    if mask.type.dtype == DType.bool:
        return ctx.one("bitwise_and", [mask, allowed])
    return ctx.one("where", [allowed, mask, ctx.const(-math.inf, mask.type.dtype)])


def _nonpad_allowed(ctx: _Ctx, node: Any, nonpad: Value, b: int, lq: int, lk: int, causal: bool, left: int,
                    right: int) -> Value:
    """[b, 1, lq, lk]: key j is a real key (j < n[b]), and, where asked, within the causal
    frontier and window of query i at position n[b] - lq + i (run-time data: built in the graph)."""
    keys = ctx.const(np.arange(lk, dtype=np.int64).reshape(1, 1, 1, lk), DType.i64, f"{node.output[0]}_keys")
    n = ctx.reshape(ctx.cast(nonpad, DType.i64), (b, 1, 1, 1))
    ok = ctx.one("lt", [keys, n])
    at = ctx.one("add", [ctx.const(np.arange(lq, dtype=np.int64).reshape(1, 1, lq, 1) - lq, DType.i64,
                                   f"{node.output[0]}_rows"), n])  # each query's position
    diff = ctx.one("sub", [at, keys])  # position - j
    for op, bound, wanted in (("ge", 0, causal), ("le", left, left >= 0), ("ge", -right, right >= 0)):
        if wanted:
            ok = ctx.one("bitwise_and", [ok, ctx.one(op, [diff, ctx.const(bound, DType.i64)])])
    return ok


def _attention_math(ctx: _Ctx, q: Value, k: Value, v: Value, mask: Value | None, scale: float | None,
                    softcap: float, mode: int, precision: DType) -> tuple[Value, Value]:
    """Attention as the spec writes it, over [b, heads, s, d]; returns (Y, qk_matmul_output).

        qk = (q*sqrt(scale)) @ (k*sqrt(scale))^T   -> mode 0
        qk = softcap * tanh(qk / softcap)           -> mode 1
        qk = qk + bias(mask)                        -> mode 2
        p  = softmax(qk), 0 on fully masked rows    -> mode 3
        Y  = p @ v
    """
    dt = q.type.dtype
    hq, hk = q.type.shape[-3], k.type.shape[-3]
    if hq != hk:  # GQA: each KV head serves hq/hk consecutive query heads
        def repeat(x: Value) -> Value:
            b, h, s, d = x.type.shape
            x = ctx.one("expand", [ctx.reshape(x, (b, h, 1, s, d))], {"shape": (b, h, hq // h, s, d)})
            return ctx.reshape(x, (b, hq, s, d))

        k, v = repeat(k), repeat(v)
    root = ctx.const(math.sqrt(scale if scale is not None else 1 / math.sqrt(q.type.shape[-1])), dt)
    kt = ctx.one("transpose", [ctx.one("mul", [k, root])], {"perm": (0, 1, 3, 2)})
    qk = ctx.one("matmul", [ctx.one("mul", [q, root]), kt])
    outs = {0: qk}
    if softcap > 0:
        cap = ctx.const(softcap, dt)
        qk = ctx.one("mul", [ctx.one("tanh", [ctx.one("div", [qk, cap])]), cap])
    outs[1] = qk
    bias = None
    if mask is not None:
        bias = mask if mask.type.dtype != DType.bool else \
            ctx.one("where", [mask, ctx.const(0.0, dt), ctx.const(-math.inf, dt)])
        qk = ctx.one("add", [qk, bias])
    outs[2] = qk
    p = ctx.cast(ctx.one("softmax", [ctx.cast(qk, precision)], {"axis": 3}), dt)
    if bias is not None:  # a row whose every key is masked attends to nothing: zeros, not NaN
        top = ctx.one("reduce_max", [bias], {"axes": (bias.type.rank - 1,), "keepdim": True})
        dead = ctx.one("eq", [top, ctx.const(-math.inf, dt)])
        p = ctx.one("where", [dead, ctx.const(0.0, dt), p])
    outs[3] = p
    if mode not in outs:
        raise ctx.unsupported(f"qk_matmul_output_mode {mode}")
    return ctx.one("matmul", [p, v]), outs[mode]


# -- onnxruntime's contrib ops (its transformer optimizer's and GenAI model builder's) ---------
# Keyed "com.microsoft::Op"; SimplifiedLayerNormalization is registered in the default domain
# by onnxruntime, and written there.

@converts("SimplifiedLayerNormalization")
def _simplified_norm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    x, scale = ins[0], ins[1]
    assert x is not None and scale is not None
    if any(node.output[1:]):
        raise ctx.unsupported("SimplifiedLayerNormalization's inv_std_var output")
    return [ctx.one("rms_norm", [x, scale], {"axis": a.get("axis", -1) % x.type.rank,
                                             "eps": float(a.get("epsilon", 1e-5))})]


@converts("com.microsoft::SkipSimplifiedLayerNormalization", "com.microsoft::SkipLayerNormalization")
def _skip_norm(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """norm(input + skip (+ bias)) * gamma (+ beta), and the sum (output 3) for the next layer's
    residual: the fused-residual form of the Llama and BERT layers."""
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    x, skip, gamma = ins[0], ins[1], ins[2]
    assert x is not None and skip is not None and gamma is not None
    beta = None if simplified else (ins[3] if len(ins) > 3 else None)
    bias = ins[3 if simplified else 4] if len(ins) > (3 if simplified else 4) else None
    if any(node.output[1:3]):
        raise ctx.unsupported(f"{node.op_type}'s mean and inv_std_var outputs")
    total = ctx.one("add", [x, skip])
    if bias is not None:
        total = ctx.one("add", [total, bias])
    eps = {"axis": x.type.rank - 1, "eps": float(a.get("epsilon", 1e-12 if not simplified else 1e-5))}
    y = ctx.one("rms_norm" if simplified else "layer_norm", [total, gamma, *([beta] if beta is not None else [])], eps)
    return [y, None, None, total]


@converts("com.microsoft::FastGelu", "com.microsoft::BiasGelu")
def _bias_gelu(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """gelu(x + bias): FastGelu is the tanh form (its bias optional), BiasGelu the erf form."""
    x = ins[0]
    assert x is not None
    if len(ins) > 1 and ins[1] is not None:
        x = ctx.one("add", [x, ins[1]])
    return [ctx.one("gelu", [x], {"approximate": "tanh" if node.op_type == "FastGelu" else "none"})]


@converts("com.microsoft::RotaryEmbedding")
def _ms_rotary(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """onnxruntime's RotaryEmbedding (input, position_ids, cos_cache, sin_cache): ONNX's
    opset-23 op, with its operands in another order and an optional scale."""
    x, pos, cos, sin = ins[0], ins[1], ins[2], ins[3]
    assert x is not None and pos is not None and cos is not None and sin is not None
    if a.get("is_packed_batching", 0):
        raise ctx.unsupported("RotaryEmbedding with is_packed_batching")
    if float(a.get("scale", 1.0)) != 1.0:
        raise ctx.unsupported(f"RotaryEmbedding with scale {a.get('scale')}")
    if pos.type.rank == 1 and pos.type.shape == (1,):  # one offset for every position: offset + 0..s-1
        seq = x.type.shape[1] if x.type.rank == 3 else x.type.shape[2]  # [b, s, hidden] or [b, heads, s, d]
        steps = ctx.const(np.arange(seq, dtype=np.int64).reshape(1, seq), DType.i64, f"{node.output[0]}_steps")
        pos = ctx.one("add", [ctx.one("reshape", [pos], {"shape": (1, 1)}), steps])
    return [ctx.one("rotary_embedding", [x, cos, sin, pos], {"interleaved": bool(a.get("interleaved", 0)),
                                                              "num_heads": a.get("num_heads", 0),
                                                              "rotary_dim": a.get("rotary_embedding_dim", 0)})]


def _empty(v: Value) -> bool:
    """A past KV cache of length 0 (the first step): the same as none."""
    return v.type.numel == 0


@converts("com.microsoft::GroupQueryAttention")
def _group_query_attention(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """onnxruntime's GroupQueryAttention over a prompt (no past): q [b, s, hq*d], k and v
    [b, s, hkv*d], RoPE inside when `do_rotary` (positions 0..s-1 from the caches), causal
    attention whose keys stop at each sequence's `seqlens_k` (its length - 1: a right-padded
    batch). Outputs y [b, s, hq*d] and the present key/value [b, hkv, s, d]. A past KV cache
    of length 0 is no past; a longer one, packed QKV, and the optional inputs after sin_cache
    are refused. A total_sequence_length past s (tokens after earlier ones) is taken only
    where npuc's cache holds the earlier keys (ctx.past_elsewhere): the new tokens attend
    each other causally, at positions seqlens_k - (s-1) + i as onnxruntime counts them, and
    the kv-cache pass gives them the cached keys."""
    q, k, v = ins[0], ins[1] if len(ins) > 1 else None, ins[2] if len(ins) > 2 else None
    assert q is not None
    if k is None or v is None:
        raise ctx.unsupported("GroupQueryAttention with packed QKV")
    if any(x is not None and not _empty(x) for x in ins[3:5]):
        raise ctx.unsupported("GroupQueryAttention with a past KV cache")
    if any(x is not None for x in ins[9:]):
        raise ctx.unsupported("GroupQueryAttention's position_ids, attention_bias or head_sink inputs")
    for attr, default in (("smooth_softmax", 0), ("local_window_size", -1)):
        if int(a.get(attr, default)) != default:
            raise ctx.unsupported(f"GroupQueryAttention with {attr}={a[attr]}")
    hq, hkv = int(a.get("num_heads", 0)), int(a.get("kv_num_heads", 0))
    b, s, width = q.type.shape if q.type.rank == 3 else (0, 0, 0)
    if not hq or not hkv or not width or width % hq or k.type.rank != 3 or k.type.shape[2] != hkv * (width // hq):
        raise ctx.unsupported(f"GroupQueryAttention of q {q.type} with num_heads {hq}, kv_num_heads {hkv}")
    seqlens = ins[5] if len(ins) > 5 else None
    total = ins[6] if len(ins) > 6 else None
    total_len = int(np.asarray(ctx.data(total, "total_sequence_length")).reshape(-1)[0]) if total is not None else s
    later = total_len != s  # not the first prompt: the tokens follow total_len - s earlier ones
    if later and not (ctx.past_elsewhere and seqlens is not None):
        raise ctx.unsupported(f"GroupQueryAttention whose total_sequence_length {total_len} is not its "
                              f"sequence length {s} with no past")
    if a.get("do_rotary", 0):
        cos, sin = (ins[i] if len(ins) > i else None for i in (7, 8))
        if cos is None or sin is None:
            raise ctx.unsupported("GroupQueryAttention with do_rotary and no cos/sin caches")
        pos = ctx.const(np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy(), DType.i64, f"{node.output[0]}_pos")
        if later and seqlens is not None:  # onnxruntime's positions after the first prompt: seqlens_k - (s-1) + i
            first = ctx.one("sub", [ctx.reshape(ctx.cast(seqlens, DType.i64), (b, 1)),
                                    ctx.const(np.int64(s - 1), DType.i64, f"{node.output[0]}_s1")])
            pos = ctx.one("add", [first, pos])
        rot = {"interleaved": bool(a.get("rotary_interleaved", 0)), "rotary_dim": 0}
        q = ctx.one("rotary_embedding", [q, cos, sin, pos], {**rot, "num_heads": hq})
        k = ctx.one("rotary_embedding", [k, cos, sin, pos], {**rot, "num_heads": hkv})

    qh, kh, vh = _split_heads(ctx, q, hq), _split_heads(ctx, k, hkv), _split_heads(ctx, v, hkv)
    causal = np.tril(np.ones((s, s), dtype=bool))
    lens = seqlens.const.load() if seqlens is not None and seqlens.is_const and seqlens.const is not None else None
    mask: Value | None = None
    if seqlens is not None and not later and not (lens is not None and bool((lens.reshape(-1) == s - 1).all())):
        # keys past each sequence's seqlens_k are padding: (j <= i) & (j <= seqlens_k[b]), [b, 1, s, s]
        keys = ctx.const(np.arange(s, dtype=np.int64).reshape(1, 1, 1, s), DType.i64, f"{node.output[0]}_keys")
        last = ctx.reshape(ctx.cast(seqlens, DType.i64), (b, 1, 1, 1))
        mask = ctx.one("bitwise_and", [ctx.const(causal.reshape(1, 1, s, s), DType.bool, f"{node.output[0]}_causal"),
                                       ctx.one("le", [keys, last])])
    scale = float(a.get("scale", 0.0)) or None
    softcap = float(a.get("softcap", 0.0))
    if softcap:
        allowed = mask if mask is not None else ctx.const(causal, DType.bool, f"{node.output[0]}_causal")
        y, _ = _attention_math(ctx, qh, kh, vh, allowed, scale, softcap, 0, qh.type.dtype)
    else:
        ops = [qh, kh, vh] + ([mask] if mask is not None else [])
        y = ctx.one("sdpa", ops, {"scale": scale, "causal": mask is None, "gqa": hq != hkv})
    return [_merge_heads(ctx, y), kh, vh]


@converts("com.microsoft::MultiHeadAttention")
def _multi_head_attention(ctx: _Ctx, node: Any, ins: list[Value | None], a: dict[str, Any]) -> list[Value | None]:
    """onnxruntime's MultiHeadAttention without a past: q [b, s, h*d]; k and v [b, kv, h*d], or
    [b, h, kv, d] as they are; an optional packed bias [3*h*d] on q, k and v, an additive
    attention_bias, and `unidirectional` for the causal mask. Outputs y [b, s, h*d] and the
    present key/value [b, h, kv, d]. Packed QKV, key_padding_mask and a past longer than 0
    are refused."""
    def at(i: int) -> Value | None:
        return ins[i] if len(ins) > i else None

    q, k, v, bias, padding, attn_bias = (at(i) for i in range(6))
    assert q is not None
    if k is None or v is None or q.type.rank != 3:
        raise ctx.unsupported("MultiHeadAttention with packed QKV")
    if padding is not None:
        raise ctx.unsupported("MultiHeadAttention's key_padding_mask")
    if any(x is not None and not _empty(x) for x in ins[6:]):
        raise ctx.unsupported("MultiHeadAttention with a past KV cache")
    h = int(a.get("num_heads", 0))
    b, s, width = q.type.shape
    if not h or width % h:
        raise ctx.unsupported(f"MultiHeadAttention of q {q.type} with num_heads {h}")
    if bias is not None:
        q, k, v = (ctx.one("add", [x, ctx.one("slice", [bias], {"axis": 0, "start": i * width, "end": (i + 1) * width,
                                                                  "step": 1})]) if x.type.rank == 3 else x
                     for i, x in enumerate((q, k, v)))

    qh, kh, vh = (x if x.type.rank == 4 else _split_heads(ctx, x, h) for x in (q, k, v))
    mask = attn_bias
    if a.get("unidirectional", 0):
        lk = kh.type.shape[2]
        allowed = ctx.const(np.tril(np.ones((s, lk), dtype=bool), lk - s), DType.bool, f"{node.output[0]}_causal")
        mask = _compose(ctx, mask, allowed)
    ops = [qh, kh, vh] + ([mask] if mask is not None else [])
    y = ctx.one("sdpa", ops, {"scale": float(a.get("scale", 0.0)) or None, "causal": False, "gqa": False})
    return [_merge_heads(ctx, y), kh, vh]
