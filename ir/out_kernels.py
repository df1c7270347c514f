"""Out-kernels: the runtime's allocation-free form of an op's reference kernel.

An out-kernel writes its results into the planned output slots (`outs`) and keeps
its temporaries in a workspace (`ws`, bytes the memory planner reserved in the
arena for that one step), so a run allocates no tensor. It returns False to hand
an operand combination it does not cover back to the reference kernel, which
computes a result that the runtime then copies in. Each follows its reference
kernel's order of operations, so results agree to the last bit or two (tests
compare every registry case).

Attached to the registry here rather than in ops.py: the reference kernel stays the
definition of what an op computes; this is one way to run it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from npuc.ir.ops import _BINARY, _COMPARE, _FLOAT_UNARY, _NUMERIC_UNARY
from npuc.ir.quant import qmoe_dequantized  # registers qmoe, whose out-kernel is below
from npuc.ir.registry import REGISTRY, OutKernelFn, WorkspaceFn
from npuc.ir.types import DType, TensorType

T = Sequence[TensorType]
A = dict[str, Any]
Ts = list[torch.Tensor]
F32 = DType.f32.itemsize


def _attach(name: str, fn: OutKernelFn, workspace: WorkspaceFn | None = None) -> None:
    REGISTRY[name] = dataclasses.replace(REGISTRY[name], out_kernel=fn, workspace=workspace)


def out_kernel(*names: str, workspace: WorkspaceFn | None = None) -> Callable[[OutKernelFn], OutKernelFn]:
    def deco(fn: OutKernelFn) -> OutKernelFn:
        for n in names:
            _attach(n, fn, workspace)
        return fn

    return deco


def _scalar(ws: torch.Tensor | None, offset: int, value: float) -> torch.Tensor:
    """A 0-d f32 in the workspace holding `value`. A Python number as an operand
    (`t.add_(eps)`) makes ATen allocate a tensor for it on every call; this does not."""
    t = _f32(ws, offset, ())
    t.fill_(value)
    return t


def _f32(ws: torch.Tensor | None, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    assert ws is not None
    n = math.prod(shape)
    return ws[offset:offset + n * F32].view(torch.float32).view(shape)


# -- elementwise ---------------------------------------------------------------------------

def _unary(fn: Callable[..., torch.Tensor]) -> OutKernelFn:
    def run(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
        fn(xs[0], out=outs[0])
        return True

    return run


_OUT_UNARY = {**{k: v for k, v in _FLOAT_UNARY.items() if not getattr(v, "__module__", "").endswith("functional")},
              **_NUMERIC_UNARY, "silu": torch.ops.aten.silu.out,
              "relu": lambda x, out: torch.clamp_min(x, 0, out=out)}
for _name, _fn in _OUT_UNARY.items():
    _attach(_name, _unary(_fn))


def _binary(fn: Callable[..., torch.Tensor]) -> OutKernelFn:
    def run(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
        fn(xs[0], xs[1], out=outs[0])
        return True

    return run


for _name, _fn in {**_BINARY, **_COMPARE}.items():
    _attach(_name, _binary(_fn))


@out_kernel("where")
def _where(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    torch.where(xs[0], xs[1], xs[2], out=outs[0])
    return True


@out_kernel("gelu")
def _gelu(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    torch.ops.aten.gelu.out(xs[0], approximate=a["approximate"], out=outs[0])
    return True


@out_kernel("cast")
def _cast(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    outs[0].copy_(xs[0])
    return True


@out_kernel("swiglu")
def _swiglu(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    torch.ops.aten.silu.out(xs[0], out=outs[0])
    outs[0].mul_(xs[1])
    return True


# -- data movement -------------------------------------------------------------------------

@out_kernel("concat")
def _concat(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    torch.cat(xs, dim=a["axis"], out=outs[0])
    return True


@out_kernel("gather")
def _gather(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, idx, out = xs[0], xs[1], outs[0]
    ax = a["axis"] % x.dim()
    if idx.dtype != torch.int64 or ax != 0:
        return False
    try:  # a negative index (ONNX allows them) goes to the reference kernel
        torch.index_select(x, 0, idx.reshape(-1), out=out.view((-1,) + tuple(x.shape[1:])))
    except IndexError:
        return False
    return True


@out_kernel("index")
def _index(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    # Prefill's last-token row (passes/last_token_logits.py); aten's out form allocates nothing.
    if any(i.dtype != torch.int64 for i in xs[1:]):
        return False
    torch.ops.aten.index.Tensor_out(xs[0], list(xs[1:]), out=outs[0])
    return True


@out_kernel("pad")
def _pad(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, pads, out = xs[0], a["pads"], outs[0]
    r = x.dim()
    if a["mode"] != "constant" or any(p < 0 for p in pads):
        return False
    if len(xs) > 1:
        out.fill_(xs[1].reshape(()))
    else:
        out.zero_()
    out[tuple(slice(pads[ax], pads[ax] + x.shape[ax]) for ax in range(r))].copy_(x)
    return True


# -- linear algebra ------------------------------------------------------------------------

@out_kernel("linear")
def _linear(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, w, out = xs[0], xs[1], outs[0]
    if not x.is_contiguous():
        return False
    k, n = x.shape[-1], out.shape[-1]
    wt = w.t() if a["weight_layout"] == "nk" else w
    torch.mm(x.reshape(-1, k), wt, out=out.view(-1, n))
    if len(xs) > 2:
        out.add_(xs[2])  # after the product, as the reference adds its bias
    return True


@out_kernel("matmul")
def _matmul(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, y, out = xs[0], xs[1], outs[0]
    if x.dtype != y.dtype or out.dtype != x.dtype:
        return False
    if x.dim() == 2 and y.dim() == 3:  # one matrix against a batch (Mamba's dt projection): its products
        for i in range(y.shape[0]):
            torch.mm(x, y[i], out=out[i])
        return True
    if x.dim() < 2 or y.dim() < 2 or (y.dim() > 2 and x.shape[:-2] != y.shape[:-2]):
        return False  # a vector, or batch dims that broadcast: the reference kernel's
    torch.matmul(x, y, out=out)
    return True


# -- reductions and normalisations ---------------------------------------------------------

@out_kernel("softmax")
def _softmax(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    if xs[0].dtype != torch.float32:
        return False  # computed in f32 and rounded: the reference kernel's
    torch.softmax(xs[0], dim=a["axis"], out=outs[0])
    return True


@out_kernel("reduce_sum")
def _reduce_sum(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x = xs[0]
    torch.sum(x, dim=tuple(a["axes"]), keepdim=a["keepdim"], dtype=x.dtype, out=outs[0])
    return True


def _rows(shape: Sequence[int], axis: int) -> int:
    """Rows a norm over axis.. has: the product of the dims before it."""
    return math.prod(shape[:axis % len(shape)])


@out_kernel("rms_norm", workspace=lambda ins, outs, a: (_rows(ins[0].shape, a["axis"]) + 2) * F32)
def _rms_norm(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, scale, out = xs[0], xs[1], outs[0]
    if x.dtype != torch.float32:
        return False
    ax = a["axis"] % x.dim()
    axes = tuple(range(ax, x.dim()))
    rows = _rows(x.shape, ax)
    m = _f32(ws, 0, tuple(x.shape[:ax]) + (1,) * (x.dim() - ax))
    n = _scalar(ws, rows * F32, float(x.shape[ax:].numel()))
    eps = _scalar(ws, (rows + 1) * F32, a["eps"])
    torch.mul(x, x, out=out)
    torch.sum(out, dim=axes, keepdim=True, out=m)  # mean as torch computes it: the sum, then / n
    m.div_(n)
    m.add_(eps).rsqrt_()
    torch.mul(x, m, out=out)
    out.mul_(scale)
    return True


def _rope_ws(ins: T, outs: T, a: A) -> int:
    pos, table = ins[1], ins[2]
    return 2 * pos.numel * table.shape[1] * F32


@out_kernel("rope_lut", workspace=_rope_ws)
def _rope_lut(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, pos, cos_t, sin_t = xs
    out = outs[0]
    if x.dtype != torch.float32 or cos_t.dtype != torch.float32 or pos.dim() not in (1, 2) \
            or (pos.dim() == 2 and x.dim() != 4) or pos.dtype != torch.int64 or not pos.is_contiguous():
        return False
    n, half = pos.numel(), cos_t.shape[1]
    r = 2 * half
    c, sn = _f32(ws, 0, (n, half)), _f32(ws, n * half * F32, (n, half))
    torch.index_select(cos_t, 0, pos.view(n), out=c)
    torch.index_select(sin_t, 0, pos.view(n), out=sn)
    if pos.dim() == 2:  # each sequence's rows [b, s] broadcast over its heads: [b, 1, s, half]
        c, sn = c.view(pos.shape[0], 1, pos.shape[1], half), sn.view(pos.shape[0], 1, pos.shape[1], half)
    layout = a["layout"]
    if layout == "half":
        x1, x2 = x[..., :half], x[..., half:r]
    else:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    if layout == "interleaved":
        o1, o2 = out[..., 0:r:2], out[..., 1:r:2]
    else:
        o1, o2 = out[..., :half], out[..., half:r]
    # real = x1*c - x2*s, imag = x2*c + x1*s, as the reference computes them
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, sn, value=-1)
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, sn)
    if r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])
    return True


def _hide_later_rows(scores: torch.Tensor, pos: torch.Tensor, window: int = 0) -> None:
    """Scores [..., s, rows]: query i at position pos[i] sees cached rows 0..pos[i] only (the
    last `window` of them, with a sliding window). Positions [b, s] are each sequence's, and
    the scores' first axis is the sequence."""
    per_seq = pos.tolist() if pos.dim() == 2 else [pos.tolist()]
    for b, positions in enumerate(per_seq):
        rows = scores[b] if pos.dim() == 2 else scores
        for i, p in enumerate(positions):
            rows[..., i, p + 1:].fill_(float("-inf"))
            if window and p - window + 1 > 0:
                rows[..., i, :p - window + 1].fill_(float("-inf"))


_HALF = (torch.float16, torch.bfloat16)
# The KV cache layouts cached_attention reads beside a query of another dtype (ir/fused_ops.py).
_KV_CACHES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
_KV_SCALE = 4  # bytes of a packed int8 row's scale (fused_ops.KV_SCALE_BYTES)


def _cached_attention_f32s(b: int, hq: int, s: int, length: int, d: int, dv: int, half: bool) -> int:
    """The workspace's f32s before ALiBi's: the scores, the scale, and with half operands f32
    copies of the query, the result and one KV head's rows at a time."""
    return b * hq * s * length + 1 + (b * hq * s * (d + dv) + length * max(d, dv) if half else 0)


def _cached_attention_ws(ins: T, outs: T, a: A) -> int:
    q, kc = ins[:2]
    b, hq, s, d = q.shape
    length = kc.shape[2]
    n = _cached_attention_f32s(b, hq, s, length, d, outs[0].shape[3], q.dtype != DType.f32 or kc.dtype != q.dtype)
    if a.get("alibi"):  # ALiBi's key-minus-query distances [s, rows], the rows' indices, the positions
        n += s * length + length + s
    return n * F32


def _add_alibi(scores: torch.Tensor, slopes: tuple[float, ...], pos: torch.Tensor, ws: torch.Tensor | None,
               off: int) -> None:
    """scores [b, hq, s, n] += slope_h * (j - pos[i]), from the workspace at `off` on."""
    s, n = scores.shape[-2:]
    rel, j, p = _f32(ws, off, (s, n)), _f32(ws, off + s * n * F32, (n,)), _f32(ws, off + (s * n + n) * F32, (s,))
    torch.arange(n, out=j)
    p.copy_(pos)
    torch.sub(j.view(1, n), p.view(s, 1), out=rel)
    for h, slope in enumerate(slopes):
        scores[:, h].add_(rel, alpha=slope)


def _kv_write_ws(ins: T, outs: T, a: A) -> int:
    """Packed int8 rows: an f32 copy of the new rows, their |x|, their scales, and the packed
    rows themselves. Other caches need none."""
    cache, new = ins[:2]
    if cache.dtype != DType.i8:
        return 0
    rows = new.numel // max(new.shape[-1], 1)
    return (2 * new.numel + rows + 1) * F32 + rows * (new.shape[-1] + _KV_SCALE)


@out_kernel("kv_write", workspace=_kv_write_ws)
def _kv_write(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    """kv_write into packed int8 rows without allocating: the reference's quantization
    (ir/fused_ops.quantize_kv_rows) step by step in the workspace, then the same copy."""
    cache, new, pos = xs[:3]
    if cache.dtype != torch.int8 or ws is None or new.dim() != 4 or not new.dtype.is_floating_point \
            or pos.dtype != torch.int64 or (len(xs) > 3 and (xs[3].dtype != torch.int64 or xs[3].numel() != 1)):
        return False  # a cache in new's dtype or a half one (the reference converts in place already), or each
        # row into its own slot (a mixed step: the reference's)
    b, h, s, d = new.shape
    x = _f32(ws, 0, (b, h, s, d)).copy_(new)
    off = x.numel() * F32
    mag = torch.abs(x, out=_f32(ws, off, (b, h, s, d)))
    off += mag.numel() * F32
    scale = torch.amax(mag, dim=-1, keepdim=True, out=_f32(ws, off, (b, h, s, 1)))
    off += scale.numel() * F32
    scale.div_(_scalar(ws, off, 127.0))
    off += F32
    # x / scale rounds half to even; a row of zeros (scale 0) gives 0 / 0 = nan -> code 0
    x.div_(scale).round_().nan_to_num_(0.0).clamp_(-127, 127)
    packed = ws[off:off + b * h * s * (d + _KV_SCALE)].view(torch.int8).view(b, h, s, d + _KV_SCALE)
    packed[..., :_KV_SCALE].copy_(scale.view(torch.int8))
    packed[..., _KV_SCALE:].copy_(x)
    if len(xs) > 3:  # one sequence into its slot
        cache[int(xs[3].reshape(-1)[0])].index_copy_(1, pos.reshape(-1), packed[0])
    elif pos.dim() == 2:  # each sequence at its own positions
        for j in range(cache.shape[0]):
            cache[j].index_copy_(1, pos[j], packed[j])
    else:
        cache.index_copy_(2, pos.reshape(-1), packed)
    return True


def _widen_rows(dst: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One head's cached rows [n, width] as f32 [n, d] in `dst`: copied, or (packed int8 rows,
    ir/fused_ops.py) their codes times their scales, as the reference dequantizes them."""
    if rows.dtype != torch.int8:
        return dst.copy_(rows)
    dst.copy_(rows[:, _KV_SCALE:])
    return dst.mul_(rows[:, :_KV_SCALE].view(torch.float32))  # [n, 1]: aligned (_packed_ok)


def _packed_ok(c: torch.Tensor) -> bool:
    """Whether a packed int8 cache's scales can be read in place as f32 (4-byte aligned rows)."""
    return c.dtype != torch.int8 or (c.is_contiguous() and c.shape[-1] % _KV_SCALE == 0
                                     and c.data_ptr() % _KV_SCALE == 0)


@out_kernel("cached_attention", workspace=_cached_attention_ws)
def _cached_attention(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    if len(xs) != 4 or (a["alibi"] and xs[3].dim() == 2):
        return False  # attention sinks, ALiBi from each sequence's position, rows of several slots: the reference's
    q, kc, vc, pos = xs
    out = outs[0]
    # half operands, or a cache of another layout than q (--kv_cache_dtype): scores and
    # softmax in f32 over one KV head's rows at a time, widened (dequantized) into scratch
    half = q.dtype in _HALF or kc.dtype != q.dtype
    if not (q.dtype in _HALF or q.dtype == torch.float32) or vc.dtype != kc.dtype \
            or (kc.dtype != q.dtype and kc.dtype not in _KV_CACHES) or not q.is_contiguous() \
            or not (_packed_ok(kc) and _packed_ok(vc)):
        return False
    b, hq, s, d = q.shape
    hkv, length, dv = kc.shape[1], kc.shape[2], out.shape[3]
    g = hq // hkv
    # No query sees a row past the last position: those rows are neither read nor scored.
    n = min(length, max(pos.reshape(-1).tolist()) + 1)
    # Grouped-query attention without repeating K/V: q's heads of one group stack as rows.
    qg, k, v, o = q.view(b, hkv, g * s, d), kc[:, :, :n], vc[:, :, :n], out.view(b, hkv, g * s, dv)
    scores = _f32(ws, 0, (b, hkv, g * s, n))
    off = b * hq * s * length * F32
    scale = _scalar(ws, off, a["scale"])
    if not half:
        torch.matmul(qg, k.transpose(-1, -2), out=scores)
    else:  # scores and softmax in f32, as the reference: widen the query, then one KV head's rows
        off += F32
        qg = _f32(ws, off, (b, hkv, g * s, d)).copy_(qg)
        off += qg.numel() * F32
        o = _f32(ws, off, (b, hkv, g * s, dv))
        off += o.numel() * F32
        for j in range(b):
            for h in range(hkv):  # the widened rows of one head at a time: scratch of one head, not the cache
                torch.mm(qg[j, h], _widen_rows(_f32(ws, off, (n, d)), k[j, h]).t(), out=scores[j, h])
    scores.mul_(scale)
    if a["softcap"]:  # in place: softcap * tanh(scores / softcap)
        scores.div_(a["softcap"]).tanh_().mul_(a["softcap"])
    if a["alibi"]:  # its scratch after everything above (_cached_attention_ws)
        at = _cached_attention_f32s(b, hq, s, length, d, dv, half)
        _add_alibi(scores.view(b, hq, s, n), a["alibi"], pos, ws, at * F32)
    _hide_later_rows(scores.view(b, hkv, g, s, n), pos, a["window"])
    torch.softmax(scores, dim=-1, out=scores)
    if not half:
        torch.matmul(scores, v, out=o)
    else:
        for j in range(b):
            for h in range(hkv):
                torch.mm(scores[j, h], _widen_rows(_f32(ws, off, (n, dv)), v[j, h]), out=o[j, h])
        out.view(b, hkv, g * s, dv).copy_(o)  # rounded once
    return True


def _mla_ws(ins: T, outs: T, a: A) -> int:
    from npuc.ir.fused_ops import mla_absorbed

    if not mla_absorbed(ins) or (len(ins) == 5 and a["causal"]):
        return 0  # the reference kernel's case (a prefill): no scratch to plan
    b, h, s, _ = ins[0].shape
    r, dr, n = ins[3].shape[2], ins[1].shape[3], ins[2].shape[2]
    f32 = b * h * s * ((r + dr) + n + r) + 1  # [q_lat | q_rot], the scores, o_lat, the scale
    if ins[0].dtype != DType.f32:
        f32 += b * n * (r + dr)  # the cache's rows, widened
    return f32 * F32 + b * h * s * r * ins[0].dtype.itemsize  # q_lat (later o_lat) in the operands' dtype


@out_kernel("mla_attention", workspace=_mla_ws)
def _mla_attention(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    q_nope, q_rot, kv, w_uk, w_uv = xs[:5]
    pos = xs[5] if len(xs) > 5 else None
    dt = q_nope.dtype
    if ws is None or not (dt in _HALF or dt == torch.float32) or any(x.dtype != dt for x in xs[:5]):
        return False  # no scratch planned (_mla_ws): the expanded or causal form, the reference kernel's
    b, h, s, _ = q_nope.shape
    r, dr, n = w_uk.shape[2], q_rot.shape[3], kv.shape[2]
    m = n if pos is None else min(n, max(pos.reshape(-1).tolist()) + 1)  # the rows any query sees
    q_cat = _f32(ws, 0, (b, h, s, r + dr))
    off = q_cat.numel() * F32
    scores = _f32(ws, off, (b, h, s, m))
    off += b * h * s * n * F32
    o_lat = _f32(ws, off, (b, h, s, r))
    off += o_lat.numel() * F32
    scale = _scalar(ws, off, a["scale"])
    off += F32
    rows = kv[:, 0, :m]  # [b, m, r + dr]
    if dt != torch.float32:  # the scores in f32, as the reference: widen the rows seen
        rows = _f32(ws, off, (b, m, r + dr)).copy_(rows)
        off += b * n * (r + dr) * F32
    # The products with W_UK and W_UV run in the operands' dtype, as the reference's do.
    q_lat = ws[off:off + b * h * s * r * q_nope.element_size()].view(dt).view(b, h, s, r)
    for j in range(b):  # batch by batch: every product is a plain mm/bmm, so nothing is copied
        torch.bmm(q_nope[j], w_uk, out=q_lat[j])  # the queries in latent space: q_nope_i @ W_UK_i
        q_cat[j, ..., :r].copy_(q_lat[j])
        q_cat[j, ..., r:].copy_(q_rot[j])
        # [q_lat | q_rot] . [c | k_rope] = the full per-head q.k, without expanding any key
        torch.mm(q_cat[j].view(h * s, r + dr), rows[j].t(), out=scores[j].view(h * s, m))
    scores.mul_(scale)
    if pos is not None:
        _hide_later_rows(scores, pos)
    torch.softmax(scores, dim=-1, out=scores)
    for j in range(b):
        torch.mm(scores[j].view(h * s, m), rows[j, :, :r], out=o_lat[j].view(h * s, r))
        lat = o_lat[j] if dt == torch.float32 else q_lat[j].copy_(o_lat[j])
        torch.bmm(lat, w_uv, out=outs[0][j])  # back out of the latent: o_lat_i @ W_UV_i
    return True


@out_kernel("slice_scatter")
def _slice_scatter(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    # torch.slice_scatter clones its operand's whole storage: for an arena view, the arena.
    x, src, out = xs[0], xs[1], outs[0]
    idx: list[slice] = [slice(None)] * x.dim()
    idx[a["axis"]] = slice(a["start"], a["end"], a["step"])
    out.copy_(x)
    out[tuple(idx)].copy_(src)
    return True


# -- mixture of experts ----------------------------------------------------------------------

def _moe_layout(ins: T, a: A) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """fused_moe's workspace, region by region (each 8-byte aligned)."""
    (t, h), e, i = ins[0].shape, ins[1].shape[0], ins[3].shape[2]
    g, k = a["n_group"], a["top_k"]
    s = t * k
    f, i64, b = torch.float32, torch.int64, torch.bool
    return [("scores", (t, e), f), ("choice", (t, e), f), ("sorted", (t, e), f), ("order", (t, e), i64),
            ("group_sorted", (t, e), f), ("group_order", (t, e), i64), ("group_scores", (t, g), f),
            ("best_sorted", (t, g), f), ("best_order", (t, g), i64), ("drop", (t, g), b), ("drop_e", (t, e), b),
            ("picked_drop", (t, k), b), ("weights", (t, k), f), ("total", (t, 1), f), ("ids", (s,), i64),
            ("ids_sorted", (s,), i64), ("slots", (s,), i64), ("tokens", (s,), i64), ("experts", (e + 1,), i64),
            ("starts", (e + 1,), i64), ("x", (s, h), f), ("gate_up", (s, 2 * i), f), ("act", (s, i), f),
            ("y", (s, h), f), ("rows", (s, h), f), ("k", (), i64), ("fill", (), f), ("eps", (), f), ("scale", (), f)]


def _moe_ws(ins: T, outs: T, a: A) -> int:
    return sum((math.prod(shape) * (8 if dt == torch.int64 else 1 if dt == torch.bool else F32) + 7) // 8 * 8
               for _, shape, dt in _moe_layout(ins, a))


@out_kernel("fused_moe", workspace=_moe_ws)
def _fused_moe(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    x, router, gate_up, down = xs[:4]
    if any(v.dtype != torch.float32 for v in xs) or not x.is_contiguous():
        return False
    assert ws is not None
    return _moe(x, router, xs[4] if len(xs) > 4 else None, [TensorType(tuple(v.shape), DType.f32) for v in xs],
                lambda e: (gate_up[e], down[e]), a, outs[0], ws)


def _qmoe_ws(ins: T, outs: T, a: A) -> int:
    moe = qmoe_dequantized(ins, a)
    gu, dn = moe[2].shape[1:], moe[3].shape[1:]
    return _moe_ws(moe, outs, a) + (math.prod(gu) + math.prod(dn)) * F32 + max(math.prod(gu), math.prod(dn)) + 16


@out_kernel("qmoe", workspace=_qmoe_ws)
def _qmoe(xs: Ts, a: A, outs: Ts, ws: torch.Tensor | None) -> bool:
    """fused_moe's steps, with each picked expert's weights unpacked into the workspace
    first, as dequantize_ref computes them: (code - zero) * scale in f32."""
    x, router = xs[0], xs[1]
    if x.dtype != torch.float32 or router.dtype != torch.float32 or not x.is_contiguous() \
            or not all(v.is_contiguous() for v in xs[2:8]) or any(v.dtype != torch.float32 for v in xs[8:]):
        return False
    assert ws is not None
    bits = a["bits"]
    moe = qmoe_dequantized([TensorType(tuple(v.shape), DType.from_torch(v.dtype)) for v in xs], a)
    gu_shape, dn_shape = moe[2].shape[1:], moe[3].shape[1:]
    off = _moe_ws(moe, [], a)
    gu = _f32(ws, off, gu_shape)
    off += math.prod(gu_shape) * F32
    dn = _f32(ws, off, dn_shape)
    off += math.prod(dn_shape) * F32
    codes = ws[off:off + max(math.prod(gu_shape), math.prod(dn_shape)) // 2]
    nibble = ws[off + max(math.prod(gu_shape), math.prod(dn_shape)):][:2]
    nibble[0], nibble[1] = 15, 4

    def unpack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor, g: int) -> torch.Tensor:
        n, kk = out.shape
        if bits == 8:
            out.copy_(q)
        else:
            c = codes[:q.numel()].view(q.shape)
            pairs = out.view(n, kk // 2, 2)
            torch.bitwise_and(q, nibble[0], out=c)
            pairs[..., 0].copy_(c)
            torch.bitwise_right_shift(q, nibble[1], out=c)
            pairs[..., 1].copy_(c)
        groups = out.view(n, kk // g, g)
        groups.sub_(zero.unsqueeze(-1))
        groups.mul_(scale.unsqueeze(-1))
        return out

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (unpack(xs[2][e], xs[3][e], xs[4][e], gu, a["group_size"]),
                unpack(xs[5][e], xs[6][e], xs[7][e], dn, a["down_group_size"]))

    return _moe(x, router, xs[8] if len(xs) > 8 else None, moe, expert, a, outs[0], ws)


def _moe(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, types: T,
         expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]], a: A, out: torch.Tensor, ws: torch.Tensor
         ) -> bool:
    """The reference kernel's steps, in its order, on workspace tensors (ir/fused_ops.py moe_route,
    moe_experts): every top-k a stable sort, the experts' GEMMs over each one's contiguous
    slots; `expert(e)` gives expert e's gate_up [2I, H] and down [H, I]."""
    from npuc.ir.fused_ops import MOE_MASK_FILL

    w: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape, dt in _moe_layout(types, a):
        n = math.prod(shape) * (8 if dt == torch.int64 else 1 if dt == torch.bool else F32)
        w[name] = ws[off:off + n].view(dt).view(shape)
        off += (n + 7) // 8 * 8
    (t, e), g, kg, k = w["scores"].shape, a["n_group"], a["topk_group"], a["top_k"]
    inter = types[3].shape[2]
    w["fill"].fill_(MOE_MASK_FILL[a["scoring"]])
    torch.mm(x, router.t(), out=w["choice"])  # the logits, for now
    if a["scoring"] == "sigmoid":
        torch.sigmoid(w["choice"], out=w["scores"])
    else:
        torch.softmax(w["choice"], dim=-1, out=w["scores"])
    choice = w["choice"]
    if bias is not None:
        torch.add(w["scores"], bias, out=choice)
    else:
        choice.copy_(w["scores"])
    if kg < g:
        grouped = choice.view(t, g, e // g)
        if a["group_score"] == "top2_sum":
            gs, go = w["group_sorted"].view(t, g, e // g), w["group_order"].view(t, g, e // g)
            torch.sort(grouped, dim=2, descending=True, stable=True, out=(gs, go))
            torch.sum(gs[..., :2], dim=2, out=w["group_scores"])
        else:
            torch.amax(grouped, dim=2, out=w["group_scores"])
        torch.sort(w["group_scores"], dim=1, descending=True, stable=True, out=(w["best_sorted"], w["best_order"]))
        w["drop"].fill_(True)
        w["drop"].scatter_(1, w["best_order"][:, :kg], False)
        w["drop_e"].view(t, g, e // g).copy_(w["drop"].unsqueeze(2).expand(t, g, e // g))
        choice.masked_fill_(w["drop_e"], w["fill"])
    torch.sort(choice, dim=1, descending=True, stable=True, out=(w["sorted"], w["order"]))
    idx = w["order"][:, :k]
    weights = w["weights"]
    torch.gather(w["scores"], 1, idx, out=weights)
    if kg < g:
        torch.gather(w["drop_e"], 1, idx, out=w["picked_drop"])
        weights.masked_fill_(w["picked_drop"], w["fill"])
    if a["norm_topk"]:
        torch.sum(weights, dim=-1, keepdim=True, out=w["total"])
        if a["norm_eps"]:
            w["total"].add_(w["eps"].fill_(a["norm_eps"]))
        weights.div_(w["total"])
    weights.mul_(w["scale"].fill_(a["routed_scale"]))
    # The experts: token-slots sorted by expert, one GEMM per expert over its run of slots.
    w["ids"].view(t, k).copy_(idx)
    torch.sort(w["ids"], stable=True, out=(w["ids_sorted"], w["slots"]))
    torch.floor_divide(w["slots"], w["k"].fill_(k), out=w["tokens"])
    torch.arange(e + 1, out=w["experts"])
    torch.searchsorted(w["ids_sorted"], w["experts"], out=w["starts"])
    bounds = w["starts"].tolist()
    first, here = a["expert_offset"], types[2].shape[0]
    if here < e:  # expert parallel: other ranks' experts leave their slots' rows zero
        w["rows"].zero_()
    for ex in range(first, first + here):
        lo, hi = bounds[ex], bounds[ex + 1]
        if lo == hi:
            continue
        xe, gu, act, y = w["x"][lo:hi], w["gate_up"][lo:hi], w["act"][lo:hi], w["y"][lo:hi]
        torch.index_select(x, 0, w["tokens"][lo:hi], out=xe)
        w_gu, w_dn = expert(ex - first)
        torch.mm(xe, w_gu.t(), out=gu)
        torch.ops.aten.silu.out(gu[:, :inter], out=act)
        act.mul_(gu[:, inter:])
        torch.mm(act, w_dn.t(), out=y)
        w["rows"].index_copy_(0, w["slots"][lo:hi], y)
    w["rows"].mul_(weights.view(-1, 1))
    torch.sum(w["rows"].view(t, k, -1), dim=1, out=out)
    return True
