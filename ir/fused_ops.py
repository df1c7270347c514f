"""Fused op declarations: the normalisations, position encodings, attention, KV cache,
MLA and MoE ops that the fusion passes produce, each with its shape rule, reference
kernel and cost. The primitive ops they fuse live in `npuc.ir.ops`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from npuc.ir.ops import (
    A,
    ShapeError,
    T,
    _float_unary_infer,
    _same_dtype,
    _sdpa_flops,
    _sdpa_kernel,
    _topk_kernel,
    broadcast,
    norm_axis,
)
from npuc.ir.registry import Attr, op
from npuc.ir.types import DType, TensorType

# -- normalisations and position encodings ----------------------------------------------

def _norm_axes(x: TensorType, axis: int) -> tuple[int, ...]:
    ax = norm_axis(axis, x.rank)
    return tuple(range(ax, x.rank))


def _rms_norm_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    axes = tuple(range(a["axis"] % x.dim(), x.dim()))
    xf = x.float()  # accumulate in fp32 whatever the storage dtype
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + a["eps"])
    return (y * xs[1].float()).to(x.dtype)


def _norm_infer(ins: T, attrs: A) -> list[TensorType]:
    x = ins[0]
    normalized = x.shape[norm_axis(attrs["axis"], x.rank):]
    for t in ins[1:]:
        if broadcast(t.shape, normalized) != normalized:
            raise ShapeError(f"norm parameter {t} does not broadcast to the normalised shape {list(normalized)}")
    if not x.dtype.is_float:
        raise ShapeError("norms need float operands")
    return [x]


@op("rms_norm", ("x", "scale"), {"axis": Attr("int", -1), "eps": Attr("float", 1e-5)}, kernel=_rms_norm_kernel,
    flops=lambda i, o, a: 4 * o[0].numel, doc="x / sqrt(mean(x^2 over axis..) + eps) * scale, in fp32")
def _rms_norm(ins: T, attrs: A) -> list[TensorType]:
    return _norm_infer(ins, attrs)


def _layer_norm_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    axes = tuple(range(a["axis"] % x.dim(), x.dim()))
    xf = x.float()
    mu = xf.mean(dim=axes, keepdim=True)
    var = (xf - mu).pow(2).mean(dim=axes, keepdim=True)
    y = (xf - mu) * torch.rsqrt(var + a["eps"]) * xs[1].float()
    if len(xs) > 2:
        y = y + xs[2].float()
    return y.to(x.dtype)


@op("layer_norm", ("x", "scale", "bias?"), {"axis": Attr("int", -1), "eps": Attr("float", 1e-5)},
    kernel=_layer_norm_kernel, flops=lambda i, o, a: 8 * o[0].numel)
def _layer_norm(ins: T, attrs: A) -> list[TensorType]:
    return _norm_infer(ins, attrs)


def _rope_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, cos, sin = xs[:3]
    pos = xs[3] if len(xs) > 3 else None
    shape = x.shape
    if x.dim() == 4:  # [b, heads, s, d] -> [b, s, heads, d]
        x = x.transpose(1, 2)
    else:
        x = x.reshape(shape[0], shape[1], a["num_heads"], -1)
    d = x.shape[-1]
    rd = a["rotary_dim"] or d
    xr, xp = x[..., :rd], x[..., rd:]
    if pos is not None:
        cos, sin = cos[pos.long()], sin[pos.long()]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if a["interleaved"]:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr.chunk(2, dim=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if a["interleaved"]:
        rot = torch.stack((real, imag), dim=-1).reshape(xr.shape)
    else:
        rot = torch.cat((real, imag), dim=-1)
    y = torch.cat((rot, xp), dim=-1).to(x.dtype)
    return y.transpose(1, 2) if len(shape) == 4 else y.reshape(shape)


@op("rotary_embedding", ("x", "cos", "sin", "position_ids?"),
    {"interleaved": Attr("bool", False), "num_heads": Attr("int", 0), "rotary_dim": Attr("int", 0)},
    kernel=_rope_kernel, flops=lambda i, o, a: 6 * o[0].numel,
    doc="ONNX RotaryEmbedding: x [b,h,s,d] or [b,s,h*d]; cos/sin [b,s,r/2], or [max_pos,r/2] with position_ids")
def _rope(ins: T, attrs: A) -> list[TensorType]:
    x, cos, sin = ins[:3]
    if x.rank == 4:
        b, _, s, d = x.shape
    elif x.rank == 3 and attrs["num_heads"] > 0 and x.shape[2] % attrs["num_heads"] == 0:
        b, s, d = x.shape[0], x.shape[1], x.shape[2] // attrs["num_heads"]
    else:
        raise ShapeError("rotary_embedding takes x as [b,h,s,d], or [b,s,h*d] with num_heads")
    rd = attrs["rotary_dim"] or d
    if rd % 2 or rd > d:
        raise ShapeError(f"rotary_dim {rd} must be even and at most the head size {d}")
    want = (b, s, rd // 2)
    if len(ins) == 4:
        pos = ins[3]
        if pos.shape != (b, s) or pos.dtype not in (DType.i64, DType.i32) or cos.rank != 2 or cos.shape[1] != rd // 2:
            raise ShapeError(f"rotary_embedding position_ids {pos} / cache {cos} do not fit x {x}")
    elif cos.shape != want:
        raise ShapeError(f"rotary_embedding cos cache {cos} should be {list(want)}")
    if cos.shape != sin.shape or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ShapeError("rotary_embedding cos and sin caches must match each other and x's dtype")
    return [x]


# -- fused ops (what the fusion passes produce) -------------------------------------------

@op("swiglu", ("gate", "up"), kernel=lambda xs, a: F.silu(xs[0]) * xs[1], flops=lambda i, o, a: 5 * o[0].numel,
    doc="silu(gate) * up")
def _swiglu(ins: T, attrs: A) -> list[TensorType]:
    if ins[0] != ins[1]:
        raise ShapeError(f"swiglu operands {ins[0]} and {ins[1]} differ")
    return _float_unary_infer(ins[:1], attrs)


def _query_positions(q_pos: torch.Tensor) -> torch.Tensor:
    """Positions [s] as [s, 1]; per-sequence positions [b, s] (one slot each) as [b, 1, s, 1]."""
    return q_pos.long()[:, None, :, None] if q_pos.dim() == 2 else q_pos.reshape(-1, 1).long()


def window_mask(q_pos: torch.Tensor, k_len: int, window: int) -> torch.Tensor:
    """[s, k_len] bool ([b, 1, s, k_len] for positions [b, s]): query i at q_pos[i] sees keys j
    with q_pos[i] - window < j <= q_pos[i] (causal; with a sliding window of `window` keys,
    itself included, unless window is 0)."""
    j = torch.arange(k_len, device=q_pos.device)
    p = _query_positions(q_pos)
    return (j <= p) & (j > p - window) if window else j <= p


def alibi_bias(slopes: tuple[float, ...] | list[float], q_pos: torch.Tensor, k_len: int) -> torch.Tensor:
    """ALiBi's bias [hq, s, k_len] ([b, hq, s, k_len] for positions [b, s]): slope_h * (j -
    q_pos[i]), key j's distance behind query i (a per-row constant away from Bloom's slope_h * j
    and MPT's, which softmax ignores)."""
    j = torch.arange(k_len, device=q_pos.device, dtype=torch.float32)
    rel = j - _query_positions(q_pos).float()  # [s, k] or [b, 1, s, k]
    return torch.tensor(slopes, dtype=torch.float32, device=q_pos.device).reshape(-1, 1, 1) * rel


def positions_fit(pos: TensorType, b: int, s: int) -> bool:
    """A position operand of a cached op: [s] (every sequence at the same positions) or [b, s]
    (each of the b sequences, a slot of the cache, at its own)."""
    return pos.shape in ((s,), (b, s)) and pos.dtype in (DType.i64, DType.i32)


def _attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(softcap * tanh(q @ k^T * scale / softcap) + bias + mask) @ v, in f32 for half
    operands; k/v heads broadcast over groups of q heads. With `sinks` [hq], each head's softmax
    also counts a sink logit that takes no value (gpt-oss's attention sinks); `bias` [hq, s, k]
    is ALiBi's."""
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    g = q.shape[-3] // k.shape[-3]
    k, v = (t.to(wide).repeat_interleave(g, dim=-3) for t in (k, v))
    s = q.to(wide) @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias.to(wide)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(wide)
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:
        col = sinks.to(wide).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return (p @ v).to(q.dtype)


def _fused_attention_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, k = xs[0], xs[1]
    gqa = q.shape[-3] != k.shape[-3]
    mask = xs[3] if len(xs) > 3 else None
    sinks = xs[4] if len(xs) > 4 else None
    if not a["window"] and not a["softcap"] and sinks is None and not a["alibi"]:
        return _sdpa_kernel(xs, {"scale": a["scale"], "causal": a["causal"], "gqa": gqa})
    # A sliding window or soft-capped scores: the causal band (top-left aligned, as causal is;
    # all of it without a window), and any mask given.
    if a["causal"]:
        band = window_mask(torch.arange(q.shape[-2], device=q.device), k.shape[-2], a["window"])
        if mask is None:
            mask = band
        else:
            mask = band & mask if mask.dtype == torch.bool else \
                torch.where(band, mask.float(), torch.tensor(float("-inf"), device=band.device))
    if a["softcap"] or sinks is not None or a["alibi"]:
        bias = alibi_bias(a["alibi"], torch.arange(q.shape[-2], device=q.device), k.shape[-2]) if a["alibi"] else None
        return _attention_math(q, k, xs[2], mask, a["scale"], a["softcap"], sinks, bias)
    return _sdpa_kernel([*xs[:3], *([] if mask is None else [mask])], {"scale": a["scale"], "causal": False, "gqa": gqa})


@op("fused_attention", ("q", "k", "v", "mask?", "sinks?"),
    {"scale": Attr("float"), "causal": Attr("bool", False), "window": Attr("int", 0),
     "softcap": Attr("float", 0.0), "alibi": Attr("floats", ())},
    kernel=_fused_attention_kernel, flops=_sdpa_flops, unit="cube",
    doc="softmax(q @ k^T * scale + mask [+ causal]) @ v; q [b,hq,s,d], k [b,hkv,l,d], v [b,hkv,l,dv], "
        "hq a multiple of hkv (grouped-query attention absorbed); window > 0 (with causal): query i sees "
        "keys i-window+1..i; softcap > 0: scores softcap * tanh(scores / softcap) before the mask; sinks [hq]: "
        "a logit per head that the softmax counts and that takes no value; alibi [hq slopes]: scores of query i "
        "at key j move by slope_h * (j - i) (ALiBi)")
def _fused_attention(ins: T, attrs: A) -> list[TensorType]:
    q, k, v = ins[:3]
    if attrs["window"] < 0 or (attrs["window"] and not attrs["causal"]) or attrs["softcap"] < 0:
        raise ShapeError("fused_attention's window is a number of keys (>= 0), on a causal attention; "
                         "its softcap >= 0")
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError("fused_attention takes [batch, heads, seq, dim] operands")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"fused_attention q {q}, k {k}, v {v} do not fit")
    if q.shape[1] % k.shape[1]:
        raise ShapeError("fused_attention query heads are not a multiple of key heads")
    if len(ins) >= 4:
        broadcast(ins[3].shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    if len(ins) == 5 and (ins[4].shape != (q.shape[1],) or not ins[4].dtype.is_float):
        raise ShapeError(f"fused_attention sinks {ins[4]} should be a float [{q.shape[1]}]")
    _check_alibi("fused_attention", attrs, q.shape[1])
    _same_dtype(ins[:3])
    return [TensorType(q.shape[:3] + (v.shape[-1],), q.dtype)]


def _check_alibi(name: str, attrs: A, heads: int) -> None:
    if attrs["alibi"] and len(attrs["alibi"]) != heads:
        raise ShapeError(f"{name} has {len(attrs['alibi'])} ALiBi slopes for {heads} query heads")


# -- the KV cache's layouts (docs/precision.md, --kv_cache_dtype) --------------------------
#
# A cache is f32, bf16 or f16 rows of D values, or packed int8 rows of D + 4 bytes: each
# row (one slot, head and position) starts with its f32 scale (little-endian, 4-byte aligned
# where D % 4 == 0) and then holds its D codes. The row x quantizes per head and per token:
# scale = max|x| / 127 (0 for a row of zeros), code = clamp(round_half_even(x / scale),
# -127, 127), and reads back as code * scale. libnpucrt's kernels match these.

KV_SCALE_BYTES = 4
# The caches a cached op reads or writes besides one of its own operands' dtype, and the
# operand dtypes it converts them from or to.
KV_CACHE_DTYPES = frozenset({DType.f32, DType.bf16, DType.f16, DType.i8})
_KV_ROW_DTYPES = frozenset({DType.f32, DType.bf16})


def kv_row_bytes(dtype: DType, d: int) -> int:
    """Bytes of one cached row of d values in a cache of `dtype` (i8: packed, with its scale)."""
    return d + KV_SCALE_BYTES if dtype == DType.i8 else d * dtype.itemsize


def kv_cache_width(dtype: DType, d: int) -> int:
    """The cache's last dim for rows of d values: D + 4 bytes for packed int8, else D."""
    return d + KV_SCALE_BYTES if dtype == DType.i8 else d


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """Float rows [..., D] as packed int8 rows [..., D + 4]: each row's f32 scale, then its codes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    nonzero = scale > 0
    codes = torch.where(nonzero, torch.round(xf / torch.where(nonzero, scale, 1.0)), 0.0).clamp_(-127, 127)
    # the scale's 4 bytes in the host's order: libnpucrt targets little-endian hosts only
    return torch.cat([scale.contiguous().view(torch.int8), codes.to(torch.int8)], dim=-1)


def dequantize_kv_rows(c: torch.Tensor) -> torch.Tensor:
    """Packed int8 rows [..., D + 4] as f32 rows [..., D]: code * scale."""
    scale = c[..., :KV_SCALE_BYTES].contiguous().view(torch.float32)  # [..., 1]
    return c[..., KV_SCALE_BYTES:].float() * scale


def kv_rows_f32(cache: torch.Tensor) -> torch.Tensor:
    """A cache in any layout as f32 rows [..., D] (the reference's widening)."""
    return dequantize_kv_rows(cache) if cache.dtype == torch.int8 else cache.float()


def _kv_write_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    cache, new, pos = xs[:3]
    if cache.dtype == torch.int8:  # packed rows: quantized per head and per token
        new = quantize_kv_rows(new)
    else:  # round to nearest even into a half cache
        new = new.to(cache.dtype)
    if new.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
        new = new.clone()  # rows of the cache itself, viewed (a conv window moving on: recurrent_state.py)
    if len(xs) > 3 and xs[3].numel() > 1:  # row i into slot[i] at position[i] (a mixed step)
        cache[xs[3].long(), :, pos.reshape(-1).long()] = new[0].transpose(0, 1)
    elif len(xs) > 3:  # one sequence into its slot
        cache[int(xs[3].reshape(-1)[0])].index_copy_(1, pos.reshape(-1).long(), new[0])
    elif pos.dim() == 2:  # each sequence at its own positions
        for b in range(cache.shape[0]):
            cache[b].index_copy_(1, pos[b].long(), new[b])
    else:
        cache.index_copy_(2, pos.reshape(-1).long(), new)
    return cache


def _converts_rows(cache: DType, rows: DType) -> bool:
    """Whether a cached op may read or write a cache of `cache` beside operands of `rows`
    (same dtype: any cache, as always; otherwise a KV cache layout beside f32/bf16 rows)."""
    return (cache == rows and cache != DType.i8) or (cache in KV_CACHE_DTYPES and rows in _KV_ROW_DTYPES)


@op("kv_write", ("cache", "new", "position", "slot?"), kernel=_kv_write_kernel, unit="dma", inplace=0,
    flops=lambda i, o, a: 0,
    doc="the KV cache with new's rows written at the given positions (in place): cache [b,h,max_len,d], "
        "new [b,h,s,d], position i64 [s] or [b,s] (each sequence at its own); with slot i64 [1], new is "
        "one sequence [1,h,s,d] written into cache[slot]; with slot i64 [s], row i of new [1,h,s,d] goes to "
        "cache[slot[i]] at position[i] (rows of several sequences: a mixed step). A cache of another dtype than new's (new f32 or bf16): "
        "f32, bf16 or f16 rows (rounded to nearest even), or i8 rows of d + 4 bytes, each an f32 scale "
        "(max|row| / 127) then d codes round(x / scale) in -127..127")
def _kv_write(ins: T, attrs: A) -> list[TensorType]:
    cache, new, pos = ins[:3]
    slot = ins[3] if len(ins) > 3 else None
    if cache.rank != 4 or new.rank != 4 or cache.shape[1] != new.shape[1] \
            or cache.shape[3] != kv_cache_width(cache.dtype, new.shape[3]) \
            or new.shape[2] > cache.shape[2] or not _converts_rows(cache.dtype, new.dtype) \
            or new.shape[0] != (1 if slot is not None else cache.shape[0]):
        raise ShapeError(f"kv_write rows {new} do not fit cache {cache}" + (" (one sequence, into a slot)" if slot
                                                                           is not None else ""))
    if not positions_fit(pos, new.shape[0], new.shape[2]):
        raise ShapeError(f"kv_write position {pos} should be i64[{new.shape[2]}] or [{new.shape[0]},{new.shape[2]}]")
    if slot is not None and (slot.shape not in ((1,), (new.shape[2],)) or slot.dtype not in (DType.i64, DType.i32)):
        raise ShapeError(f"kv_write slot {slot} should be i64[1] or [{new.shape[2]}] (each row's)")
    return [cache]


def _cached_attention_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, kc, vc, pos = xs[:4]
    if a["slotted"]:  # query row i over cache[slot[i]]: the rows as sequences of one token each
        slot, s = xs[-1].long(), q.shape[2]
        rows = q.transpose(0, 2)  # [s, hq, 1, d]
        out = _cached_attention_kernel([rows, kc[slot], vc[slot], pos.reshape(s, 1), *xs[4:-1]],
                                       {**a, "slotted": 0})
        return out.transpose(0, 2).contiguous()
    if kc.dtype != q.dtype or kc.dtype == torch.int8:
        # a cache of another layout than q's dtype: its rows read as f32 (int8: code * scale),
        # the scores and softmax in f32, the result rounded once to q's dtype
        out = _cached_attention_kernel([q.float(), kv_rows_f32(kc), kv_rows_f32(vc), *xs[3:]], a)
        return out.to(q.dtype)
    # Query i sees cached keys 0..position[i] (the last `window` of them with a window): the
    # causal mask, offset by where the chunk starts. A half cache is computed in f32 and
    # rounded once (_sdpa_kernel).
    mask = window_mask(pos, kc.shape[-2], a["window"])
    if a["softcap"] or len(xs) > 4 or a["alibi"]:
        bias = alibi_bias(a["alibi"], pos, kc.shape[-2]) if a["alibi"] else None
        return _attention_math(q, kc, vc, mask, a["scale"], a["softcap"], xs[4] if len(xs) > 4 else None, bias)
    return _sdpa_kernel([q, kc, vc, mask], {"scale": a["scale"], "causal": False, "gqa": q.shape[-3] != kc.shape[-3]})


def _cached_attention_flops(ins: T, outs: T, attrs: A) -> int:
    return _sdpa_flops(ins, outs, attrs)


@op("cached_attention", ("q", "k_cache", "v_cache", "position", "sinks?", "slot?"),
    {"scale": Attr("float"), "window": Attr("int", 0), "softcap": Attr("float", 0.0), "alibi": Attr("floats", ()),
     "slotted": Attr("int", 0)},
    kernel=_cached_attention_kernel, flops=_cached_attention_flops, unit="cube",
    doc="causal attention of q over a KV cache: query i at position[i] attends cached keys 0..position[i] "
        "(position[i]-window+1.. with a sliding window; scores soft-capped, sinks and ALiBi as fused_attention's, from position[i]); "
        "q [b,hq,s,d], caches [b,hkv,max_len,d] / [..,dv], position i64 [s] or [b,s] (each sequence at its own). "
        "Caches of another dtype than q's (q f32 or bf16; k and v alike): f32, bf16, f16, or i8 rows of d + 4 "
        "bytes (kv_write's), read as code * scale; scores and softmax in f32, the result in q's dtype. "
        "slotted=1: the last operand is slot i64 [s], and query row i of q [1,hq,s,d] attends cache[slot[i]] "
        "(rows of several sequences: a mixed step)")
def _cached_attention(ins: T, attrs: A) -> list[TensorType]:
    q, kc, vc, pos = ins[:4]
    slotted = attrs["slotted"]
    if slotted not in (0, 1) or (slotted and len(ins) < 5):
        raise ShapeError("cached_attention's slotted is 0, or 1 with a last operand slot")
    sinks = ins[4] if len(ins) == 5 + slotted else None
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.dtype.is_float):
        raise ShapeError(f"cached_attention sinks {sinks} should be a float [{q.shape[1]}]")
    if attrs["window"] < 0 or attrs["softcap"] < 0:
        raise ShapeError("cached_attention's window is a number of keys (>= 0), its softcap >= 0")
    if q.rank != 4 or kc.rank != 4 or vc.rank != 4 or kc.shape[:3] != vc.shape[:3] \
            or q.shape[0] != (1 if slotted else kc.shape[0]) \
            or kc.shape[-1] != kv_cache_width(kc.dtype, q.shape[-1]) or q.shape[1] % kc.shape[1] \
            or vc.shape[-1] < kv_cache_width(vc.dtype, 1):
        raise ShapeError(f"cached_attention q {q}, caches {kc} / {vc} do not fit")
    if slotted and (ins[-1].shape != (q.shape[2],) or ins[-1].dtype not in (DType.i64, DType.i32)):
        raise ShapeError(f"cached_attention slot {ins[-1]} should be i64[{q.shape[2]}], one per row of q {q}")
    if not positions_fit(pos, q.shape[0], q.shape[2]):
        raise ShapeError(f"cached_attention position {pos} should be i64[{q.shape[2]}] or [{q.shape[0]},{q.shape[2]}]")
    _check_alibi("cached_attention", attrs, q.shape[1])
    if kc.dtype != vc.dtype or not _converts_rows(kc.dtype, q.dtype):
        raise ShapeError(f"cached_attention q {q} cannot read caches {kc} / {vc} (a cache of q's dtype, or one "
                         "of f32, bf16, f16, i8 beside an f32 or bf16 q; k and v alike)")
    dv = vc.shape[-1] - (KV_SCALE_BYTES if vc.dtype == DType.i8 else 0)
    return [TensorType(q.shape[:3] + (dv,), q.dtype)]


def _conv_window(cache: torch.Tensor, pos: torch.Tensor, k: int, dilation: int) -> torch.Tensor:
    """The rows a causal conv reads for the token at `pos` ([1], or [b, 1]: each sequence's),
    oldest first, as [b, c, k]; rows before position 0 are zeros (the conv's left padding)."""
    steps = dilation * torch.arange(k - 1, -1, -1, device=cache.device)
    rows = pos.reshape(-1, 1).long() - steps  # [1 or b, k]
    window = torch.stack([cache[b, 0].index_select(0, rows[b % rows.shape[0]].clamp(min=0))
                          for b in range(cache.shape[0])])  # [b, k, c]
    return torch.where((rows >= 0)[:, :, None], window, torch.zeros((), dtype=cache.dtype)).transpose(1, 2)


def _cached_conv1d_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    cache, w, pos = xs[:3]
    window = _conv_window(cache, pos, w.shape[2], a["dilation"]).to(w.dtype)
    return F.conv1d(window, w, xs[3] if len(xs) > 3 else None, 1, 0, 1, a["groups"])  # the window is dilated


@op("cached_conv1d", ("cache", "w", "position", "bias?"), {"dilation": Attr("int", 1), "groups": Attr("int", 1)},
    kernel=_cached_conv1d_kernel, unit="vector",
    flops=lambda i, o, a: 2 * o[0].numel * i[1].shape[1] * i[1].shape[2],
    traffic=lambda i, o, a: (i[0].shape[0] * i[1].shape[2] * i[0].shape[3] * i[0].dtype.itemsize
                             + sum(t.nbytes for t in i[1:]) + o[0].nbytes),
    doc="a causal 1-D convolution's output for the one token at `position`, from the conv inputs cached "
        "by position: cache [b,1,max_len,c] (kv_write's rows), w [o, c/groups, k] (+ bias [o]); it reads "
        "rows position-dilation*(k-1)..position, those before 0 as zeros. Out [b, o, 1]")
def _cached_conv1d(ins: T, attrs: A) -> list[TensorType]:
    cache, w, pos = ins[:3]
    g, d = attrs["groups"], attrs["dilation"]
    if cache.rank != 4 or cache.shape[1] != 1 or w.rank != 3 or g < 1 or d < 1 or cache.shape[3] != w.shape[1] * g \
            or w.shape[0] % g or not cache.dtype.is_float:
        raise ShapeError(f"cached_conv1d cache {cache} (channels last) does not fit w {w} with groups={g}")
    if len(ins) > 3 and ins[3].shape != (w.shape[0],):
        raise ShapeError(f"cached_conv1d bias {ins[3]} must be [{w.shape[0]}]")
    if not positions_fit(pos, cache.shape[0], 1):
        raise ShapeError(f"cached_conv1d position {pos} should be i64[1] or [{cache.shape[0]},1]")
    return [TensorType((cache.shape[0], w.shape[0], 1), _same_dtype(ins[1:2] + ins[3:]))]


def _mla_dims(ins: T) -> tuple[int, int, int, int, int, int, int, int]:
    """b, h, s, keys, nope, rope, latent rank, v dim of an mla_attention."""
    q_nope, q_rot, kv, w_uk, w_uv = ins[:5]
    b, h, s, dn = q_nope.shape
    r = w_uk.shape[2]
    return b, h, s, kv.shape[2], dn, q_rot.shape[3], r, w_uv.shape[2]


def mla_absorbed(ins: T) -> bool:
    """Whether mla_attention computes over the latent (W_UK on the queries, W_UV on the
    result) rather than expanding per-head keys and values: whichever needs fewer FLOPs.
    Decode (one query over many cached keys) is always absorbed; a long prefill is not."""
    b, h, s, n, dn, dr, r, dv = _mla_dims(ins)
    absorbed = h * s * (dn * r + n * (2 * r + dr) + r * dv)
    expanded = h * n * r * (dn + dv) + h * s * n * (dn + dr + dv)
    return absorbed <= expanded


def _mla_mask(s: int, n: int, pos: torch.Tensor | None, causal: bool, device: torch.device) -> torch.Tensor | None:
    if pos is not None:  # query i at position[i] sees cached rows 0..position[i]
        return window_mask(pos, n, 0)
    return torch.ones(s, n, dtype=torch.bool, device=device).tril() if causal else None


def _mla_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    # Products with the per-head weights run in the operands' dtype, as a linear does; the
    # scores, softmax and the sum over rows in f32 (a half cache is read widened).
    q_nope, q_rot, kv, w_uk, w_uv = xs[:5]
    pos = xs[5] if len(xs) > 5 else None
    r = w_uk.shape[2]
    lat, k_rot = kv[..., :r].float(), kv[..., r:].float()  # [b, 1, n, r], [b, 1, n, dr]
    mask = _mla_mask(q_nope.shape[2], kv.shape[2], pos, a["causal"], q_nope.device)
    if mla_absorbed([TensorType(tuple(x.shape), DType.f32) for x in xs[:5]]):
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk).float()
        scores = (q_lat @ lat.transpose(-1, -2) + q_rot.float() @ k_rot.transpose(-1, -2)) * a["scale"]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o_lat = torch.softmax(scores, dim=-1) @ lat
        out = torch.einsum("bhsr,hrv->bhsv", o_lat.to(w_uv.dtype), w_uv)
    else:
        c = kv[..., :r]
        k_nope = torch.einsum("bxnr,hdr->bhnd", c, w_uk).float()
        v = torch.einsum("bxnr,hrv->bhnv", c, w_uv).float()
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope.float(), q_rot.float()), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a["scale"])
    return out.to(q_nope.dtype)


def _mla_flops(ins: T, outs: T, attrs: A) -> int:
    b, h, s, n, dn, dr, r, dv = _mla_dims(ins)
    if mla_absorbed(ins):
        return 2 * b * h * s * (dn * r + n * (2 * r + dr) + r * dv)
    return 2 * b * (h * n * r * (dn + dv) + h * s * n * (dn + dr + dv))


@op("mla_attention", ("q_nope", "q_rot", "kv", "w_uk", "w_uv", "position?"),
    {"scale": Attr("float"), "causal": Attr("bool", False)},
    kernel=_mla_kernel, flops=_mla_flops, unit="cube",
    doc="multi-head latent attention (DeepSeek MLA): keys and values are the per-token latent "
        "kv = [c (rank r) | shared rope key (dr)], [b,1,n,r+dr]; head i's key is [c @ W_UK_i^T | rope key], "
        "its value c @ W_UV_i; q_nope [b,h,s,dn], q_rot [b,h,s,dr], w_uk [h,dn,r], w_uv [h,r,dv]. "
        "Without position: causal (query i sees rows 0..i) or not; with position i64 [s] or [b,s]: kv is a cache, "
        "query i sees rows 0..position[i]. Computed over the latent when that is cheaper (decode)")
def _mla_attention(ins: T, attrs: A) -> list[TensorType]:
    q_nope, q_rot, kv, w_uk, w_uv = ins[:5]
    if any(t.rank != 4 for t in (q_nope, q_rot, kv)) or w_uk.rank != 3 or w_uv.rank != 3:
        raise ShapeError("mla_attention takes 4-D queries and latent, 3-D per-head weights")
    b, h, s, n, dn, dr, r, _ = _mla_dims(ins)
    if q_rot.shape[:3] != (b, h, s) or kv.shape[0] != b or kv.shape[1] != 1 or kv.shape[3] != r + dr \
            or w_uk.shape[:2] != (h, dn) or w_uv.shape[:2] != (h, r):
        raise ShapeError(f"mla_attention q {q_nope}/{q_rot}, kv {kv}, w_uk {w_uk}, w_uv {w_uv} do not fit")
    if len(ins) > 5 and not positions_fit(ins[5], b, s):
        raise ShapeError(f"mla_attention position {ins[5]} should be i64[{s}] or [{b},{s}]")
    if len(ins) == 5 and s != n and attrs.get("causal"):
        raise ShapeError(f"causal mla_attention over its own {n} rows has {s} queries")
    _same_dtype(ins[:5])
    return [TensorType((b, h, s, w_uv.shape[2]), q_nope.dtype)]


def _rope_lut_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, pos, cos_t, sin_t = xs
    half = cos_t.shape[-1]
    r = 2 * half
    c = cos_t[pos.long()].unsqueeze(-3).to(torch.float32)  # [..., 1, s, half] broadcasts over heads
    s = sin_t[pos.long()].unsqueeze(-3).to(torch.float32)
    xr = x[..., :r].float()
    layout = a["layout"]
    if layout == "half":
        x1, x2 = xr[..., :half], xr[..., half:]
    else:  # "interleaved" and "deinterleave" read pairs (x0, x1), (x2, x3), ...
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    real, imag = x1 * c - x2 * s, x2 * c + x1 * s
    if layout == "interleaved":
        rot = torch.stack((real, imag), dim=-1).reshape(xr.shape)
    else:  # "half" and "deinterleave" write halves
        rot = torch.cat((real, imag), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


@op("rope_lut", ("x", "position_ids", "cos_table", "sin_table"), {"layout": Attr("str", "half")},
    kernel=_rope_lut_kernel, flops=lambda i, o, a: 6 * o[0].numel,
    doc="rotary embedding from tables: x [..., heads, s, d], position_ids [s] or [b, s], tables [positions, r/2]; "
        "layout half (rotate_half), interleaved (pairs in and out), deinterleave (pairs in, halves out)")
def _rope_lut(ins: T, attrs: A) -> list[TensorType]:
    x, pos, cos_t, sin_t = ins
    if attrs["layout"] not in ("half", "interleaved", "deinterleave"):
        raise ShapeError(f"unknown rope layout {attrs['layout']!r}")
    if x.rank < 3 or pos.dtype not in (DType.i64, DType.i32) or pos.shape[-1] != x.shape[-2] or pos.rank > 2:
        raise ShapeError(f"rope_lut position_ids {pos} do not fit x {x}")
    if cos_t != sin_t or cos_t.rank != 2 or 2 * cos_t.shape[1] > x.shape[-1] or not x.dtype.is_float:
        raise ShapeError(f"rope_lut tables {cos_t}/{sin_t} do not fit x {x}")
    return [x]


# -- mixture of experts ---------------------------------------------------------------------

# Scoring -> the value a group-masked expert gets before the final top-k: DeepSeek-V3 masks its
# sigmoid scores with -inf, DeepSeek-V2 its softmax probabilities with 0.
MOE_MASK_FILL = {"sigmoid": -math.inf, "softmax": 0.0}
MOE_NORM_EPS = 1e-20  # transformers' DeepSeek-V3 normalises the routed weights by their sum + 1e-20


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, a: A) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router on f32 logits [T, E]: the k experts of each token (i64 [T, k]) and
    their weights (f32 [T, k]). Every top-k is the registry's (a stable sort: of equal
    scores the lower expert wins), so it selects what the traced router selects."""
    scores = torch.sigmoid(logits) if a["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    t, e = choice.shape
    g, kg = a["n_group"], a["topk_group"]
    keep, fill = None, MOE_MASK_FILL[a["scoring"]]
    if kg < g:  # group-limited: only the experts of each token's topk_group best groups compete
        grouped = choice.view(t, g, e // g)
        if a["group_score"] == "top2_sum":
            group_scores = _topk_kernel([grouped], {"axis": 2, "k": 2, "largest": True})[0].sum(dim=2)
        else:
            group_scores = grouped.amax(dim=2)
        best = _topk_kernel([group_scores], {"axis": 1, "k": kg, "largest": True})[1]
        keep = torch.zeros(t, g, dtype=torch.bool, device=choice.device).scatter_(1, best, True).repeat_interleave(e // g, dim=1)
        choice = choice.masked_fill(~keep, fill)
    idx = _topk_kernel([choice], {"axis": 1, "k": a["top_k"], "largest": True})[1]
    weights = scores.gather(1, idx)  # the scores without the correction bias
    if keep is not None:  # a masked expert is picked only when fewer than k others beat the fill
        weights = weights.masked_fill(~keep.gather(1, idx), fill)
    if a["norm_topk"]:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + a["norm_eps"] if a["norm_eps"] else total)
    return idx, weights * a["routed_scale"]


def moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor | Callable[[int], torch.Tensor],
                down: torch.Tensor | Callable[[int], torch.Tensor], experts: int, inter: int, first: int = 0
                ) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ swiglu(gate_up[e] @ x[t]) with e = idx[t, j], grouped by
    expert: the token-slots are sorted by expert id and each expert runs one GEMM over its
    contiguous rows (a loop over the experts hit, never over tokens). gate_up and down are
    stacked [E, ...] weights, or a function of the expert id (a quantized expert, unpacked
    only when a token picks it)."""
    t, k = idx.shape
    flat = idx.reshape(-1) - first
    # Expert parallel: experts first..first+experts-1 live here; a slot picking another rank's
    # expert sorts last (id `experts`) and keeps a zero row, added in by the all_reduce.
    flat = torch.where((flat >= 0) & (flat < experts), flat, experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts + 1).tolist()[:experts]
    rows = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        gu = gate_up(e) if callable(gate_up) else gate_up[e]
        dn = down(e) if callable(down) else down[e]
        gate, up = F.linear(x[slots // k], gu).split(inter, dim=1)
        rows[slots] = F.linear(F.silu(gate) * up, dn)
    if x.dtype == torch.float32:
        rows *= weights.reshape(-1, 1)
        return rows.view(t, k, -1).sum(dim=1)  # each token's k slots, in top-k order
    # A half-precision model weighs and sums its slots in f32 and rounds the sum once.
    wide = rows.float() * weights.reshape(-1, 1).float()
    return wide.view(t, k, -1).sum(dim=1).to(x.dtype)


def _fused_moe_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x, router, gate_up, down = xs[:4]
    bias = xs[4] if len(xs) > 4 else None
    idx, weights = moe_route(F.linear(x.float(), router.float()), bias, a)
    return moe_experts(x, idx, weights, gate_up, down, gate_up.shape[0], down.shape[2], a["expert_offset"])


def _fused_moe_flops(ins: T, outs: T, attrs: A) -> int:
    # Only the k selected experts of each token: a dense count over all E would overstate it E/k-fold.
    (t, h), e, i, k = ins[0].shape, ins[1].shape[0], ins[3].shape[2], attrs["top_k"]
    router = 2 * t * e * h
    experts = t * k * (2 * h * 2 * i + 2 * i * h) * ins[2].shape[0] // e  # a rank's share of the picks
    return router + experts + t * k * 5 * i + 2 * t * k * h  # + SwiGLU, + weighted combine


def _fused_moe_traffic(ins: T, outs: T, attrs: A) -> int:
    """Activations, router and bias, and the weights of the experts a run can select:
    at most min(E, T*k) of them (all E only once the tokens' picks could cover them)."""
    x, router, gate_up, down = ins[:4]
    t, here = x.shape[0], gate_up.shape[0]
    experts = min(here, t * attrs["top_k"])
    return sum(v.nbytes for v in (x, router, *ins[4:], *outs)) + (gate_up.nbytes + down.nbytes) * experts // here


@op("fused_moe", ("x", "router_weight", "gate_up", "down", "correction_bias?"),
    {"top_k": Attr("int"), "n_group": Attr("int", 1), "topk_group": Attr("int", 1),
     "scoring": Attr("str", "sigmoid"), "group_score": Attr("str", "top2_sum"), "norm_topk": Attr("bool", False),
     "norm_eps": Attr("float", MOE_NORM_EPS), "routed_scale": Attr("float", 1.0), "activation": Attr("str", "silu"),
     "expert_offset": Attr("int", 0)},
    kernel=_fused_moe_kernel, flops=_fused_moe_flops, unit="cube", traffic=_fused_moe_traffic,
    doc="DeepSeek's routed experts: x [T,H], router_weight [E,H], gate_up [E,2I,H], down [E,H,I], "
        "correction_bias [E]. Scores sigmoid (V3) or softmax (V2) of x @ router^T in f32; with n_group > "
        "topk_group only each token's topk_group groups (ranked by top2_sum or max of scores + bias) compete; "
        "the top_k experts by scores + bias are weighed by their scores (norm_topk: over their sum + norm_eps) "
        "times routed_scale; out = sum of weight * down[e] @ (silu(gate) * up) over a token's k experts. "
        "FLOPs count the k selected experts only, bytes at most min(E, T*k) experts' weights. Expert parallel: "
        "gate_up and down hold experts expert_offset.. only (the router all E); the others' slots add zero")
def _fused_moe(ins: T, attrs: A) -> list[TensorType]:
    x, router, gate_up, down = ins[:4]
    if x.rank != 2 or router.rank != 2 or gate_up.rank != 3 or down.rank != 3:
        raise ShapeError("fused_moe takes x [T,H], router [E,H], gate_up [E,2I,H], down [E,H,I]")
    h, e, i, here = x.shape[1], router.shape[0], down.shape[2], gate_up.shape[0]
    if router.shape != (e, h) or gate_up.shape != (here, 2 * i, h) or down.shape != (here, h, i) \
            or (len(ins) > 4 and ins[4].shape != (e,)) or not 0 <= attrs["expert_offset"] <= e - here:
        raise ShapeError(f"fused_moe x {x}, router {router}, gate_up {gate_up}, down {down} do not fit")
    if not all(t.dtype.is_float for t in ins) or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ShapeError(f"fused_moe operands {[str(t) for t in ins]} are not floats of x's dtype")
    g, kg, k = attrs["n_group"], attrs["topk_group"], attrs["top_k"]
    if attrs["scoring"] not in MOE_MASK_FILL or attrs["group_score"] not in ("top2_sum", "max") \
            or attrs["activation"] != "silu":
        raise ShapeError(f"fused_moe scoring {attrs['scoring']!r}, group_score {attrs['group_score']!r} or "
                         f"activation {attrs['activation']!r} is not supported")
    # Static shapes: every token must have k experts to pick from its groups.
    if g < 1 or e % g or not 1 <= kg <= g or not 1 <= k <= kg * (e // g) \
            or (kg < g and attrs["group_score"] == "top2_sum" and e // g < 2):
        raise ShapeError(f"fused_moe top_k={k} of {e} experts in topk_group={kg} of n_group={g} does not fit")
    return [x]
