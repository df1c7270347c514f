"""Load-time kernel choice: each step of a program becomes one call with its operands bound.

The session binds every tensor to its planned bytes once; this module then turns each
step into a zero-argument callable, so that a run is a flat loop of calls with nothing
left to decide. Per step, the first that applies:

    view    a reshape / transpose / slice whose output the planner placed on its operand's
            bytes (backend/lower.py is_view): nothing to run, the step is dropped
    native  linear with few rows, on the CPU: runtime/native's GEMV, which reads each
            weight once, as stored (layout nk or kn, f32 or bf16), and computes only the
            `valid_rows` of a tile-padded input; the other ops of a transformer block
            (rms_norm, rope_lut, kv_write, cached and fused attention, swiglu, add, f32/bf16
            cast, a transpose that moves bytes, tile padding: only the rows that a later
            step reads, tail_rows_read; a quantized embedding's rows) in one native call each, on the same pool
            at prefill sizes: torch's OpenMP threads, spinning after a kernel of theirs,
            would take the cores from the pool's GEMM (prefill 1.7x slower, measured)
            The recurrences of ir/recurrent_ops.py (selective_scan, gated_delta_rule,
            linear_attention, wkv, linear_recurrence; pure and stateful) and the depthwise
            conv1d over a recurrent layer's conv window likewise, with f32 operands
            (npucrt/src/ops_recurrent.c's flat entry points): a recurrent model's decode
            step allocates nothing
    scratch an op whose torch form needs temporaries the memory plan has no workspace for
            (layer_norm's statistics): the same torch ops, `out=` into scratch the session
            allocates once, at load
    native-gemm  linear with many rows (prefill): runtime/native's GEMM over a copy of the
            weight packed at load into 16-column panels; only the `valid_rows` computed
    prepacked  the same without the native library (no compiler, NPUC_NATIVE=0): oneDNN
            over weights packed at load
    out     the op's out-kernel (ir/out_kernels.py), falling back to the reference kernel
            for an operand combination it declines
    ref     the reference kernel, its result copied into the planned slot

Everything a native call needs (pointers, sizes, strides, thread count) is computed here,
once; the weights stay in the memory-mapped file, unpacked.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from npuc.errors import EXIT_USAGE, InternalError, NpucError
from npuc.ir import DType, OpDef, TensorType

Launcher = Callable[[], Any]

# At most this many rows (tokens) go to the GEMV kernel; more are a GEMM (packed at load, or torch's).
GEMV_MAX_ROWS = 8
_VIEW_OPS = frozenset({"reshape", "transpose", "slice"})


@dataclass(frozen=True)
class Bound:
    """One step with its operands bound to their planned views."""
    opdef: OpDef
    attrs: Mapping[str, Any]
    ins: list[torch.Tensor]
    outs: list[torch.Tensor]
    ws: torch.Tensor | None
    # Rows along the output's axis -2 that any later step reads (tail_rows_read); None: all.
    rows_read: int | None = None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


def is_noop_view(b: Bound) -> bool:
    """The output already is the operand's bytes: running the step would copy nothing."""
    if b.opdef.name not in _VIEW_OPS or len(b.ins) != 1 or len(b.outs) != 1:
        return False
    x, out = b.ins[0], b.outs[0]
    if not _same_bytes(x, out) or not x.is_contiguous():
        return False
    try:  # the view itself, no data read: what the step would return
        r = b.opdef.run([x], b.attrs)[0]
    except (RuntimeError, ValueError, IndexError, TypeError):
        return False  # attributes that do not fit (a damaged file): the step runs, and says so
    return _same_bytes(r, out) and tuple(r.shape) == tuple(out.shape) and r.is_contiguous()


def _declared_right(b: Bound) -> bool:
    """Whether the step's output slots are what the op's shape rule makes of its operands.
    A native kernel writes by pointer, trusting the sizes: a damaged or hostile .om that
    declares a slot too small must not turn into a write past it (torch's kernels, which
    check, run such a step and refuse it)."""
    try:
        ins = [TensorType(tuple(t.shape), DType.from_torch(t.dtype)) for t in b.ins]
        want = b.opdef.infer_types(ins, b.attrs)
    except Exception:  # noqa: BLE001 - a shape rule's refusal, or a dtype npuc does not know
        return False
    return [(t.shape, t.dtype) for t in want] == [(tuple(o.shape), DType.from_torch(o.dtype)) for o in b.outs]


def _generic(b: Bound) -> Launcher:
    od, attrs, ins, outs, ws = b.opdef, b.attrs, b.ins, b.outs, b.ws
    ok = od.out_kernel

    def reference() -> None:
        for dst, r in zip(outs, od.run(ins, attrs), strict=True):
            if r.data_ptr() != dst.data_ptr():  # a view or an in-place write is there already
                dst.copy_(r)

    if ok is None:
        return reference

    def out_kernel() -> None:
        if not ok(ins, attrs, outs, ws):
            reference()

    return out_kernel


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _row_calls(x: torch.Tensor, attrs: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """(first row, rows, row stride in rows) of each kernel call for a product over x: its
    leading dims flattened; or, where a tile-padded axis -2 holds `valid_rows` of each
    leading index, one strided call for one valid row each (decode over several sequences:
    the weights are read once for all), else a call per leading index."""
    s = x.shape[-2] if x.dim() >= 2 else 1
    lead = math.prod(x.shape[:-2]) if x.dim() >= 2 else 1
    valid = attrs.get("valid_rows")
    valid = s if valid is None or not 1 <= valid <= s else valid
    if valid == s:
        return [(0, lead * s, 1)]
    return [(0, lead, s)] if valid == 1 else [(i * s, valid, 1) for i in range(lead)]


def _sequence(fs: Sequence[Launcher]) -> Launcher:
    """One launcher for a step that makes several calls."""
    if len(fs) == 1:
        return fs[0]

    def run_all() -> None:
        for f in fs:
            f()

    return run_all


def _native_linear(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    x, w = b.ins[0], b.ins[1]
    bias = b.ins[2] if len(b.ins) > 2 else None
    y = b.outs[0]
    layout = b.attrs["weight_layout"]
    if x.dim() < 1 or w.dim() != 2 or not _contiguous(x, w, y, bias):
        return None
    n, k = (w.shape[0], w.shape[1]) if layout == "nk" else (w.shape[1], w.shape[0])
    if x.shape[-1] != k or y.shape[-1] != n or (bias is not None and tuple(bias.shape) != (n,)):
        return None
    calls = _row_calls(x, b.attrs)
    if sum(r for _, r, _ in calls) > GEMV_MAX_ROWS:
        return None
    fs = []
    if x.dtype == w.dtype == y.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32):
        for row, rows, st in calls:
            fs.append(functools.partial(lib.npuc_linear_f32, x.data_ptr() + row * k * 4, rows, st * k, w.data_ptr(),
                                        int(layout == "kn"), n, k, _ptr(bias), y.data_ptr() + row * n * 4, st * n,
                                        ls.threads))
    elif w.dtype == torch.bfloat16 and layout == "nk" and {x.dtype, y.dtype} <= {torch.float32, torch.bfloat16} \
            and (bias is None or bias.dtype in (torch.float32, torch.bfloat16)):
        xb, yb = int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16)
        ws = ls.scratch(2 * max(r for _, r, _ in calls) * k)
        for row, rows, st in calls:
            fs.append(functools.partial(lib.npuc_linear_bf16, x.data_ptr() + row * k * x.element_size(), xb, rows,
                                        st * k, w.data_ptr(), n, k, _ptr(bias),
                                        int(bias is not None and bias.dtype == torch.bfloat16),
                                        y.data_ptr() + row * n * y.element_size(), yb, st * n, ws.data_ptr(),
                                        ls.threads))
    else:
        return None
    return _sequence(fs)


F32, BF16 = torch.float32, torch.bfloat16
# The KV cache layouts of libnpucrt's kv_write and cached_attention (kernels.h NPUC_KV_*; the
# old bf flag for f32 and bf16). f16 and packed int8 rows (d + 4 bytes: an f32 scale, then d
# codes; ir/fused_ops.py) only where the library has the kernels for them (_kv_layouts).
_KV_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


def _kv_layouts(lib: ctypes.CDLL) -> frozenset[torch.dtype]:
    """The cache dtypes the library's KV kernels take: every layout where it sizes its
    attention's scratch itself (the same change brought them), else f32 and bf16."""
    if hasattr(lib, "npuc_cached_attention_scratch_floats"):
        return frozenset(_KV_KIND)
    return frozenset({F32, BF16})


def _kv_width(cache: torch.Tensor, d: int) -> int:
    """A cache's last dim for rows of d values (packed int8: d + 4 bytes)."""
    return d + 4 if cache.dtype == torch.int8 else d


def _contiguous(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.is_contiguous() and t.device.type == "cpu") for t in ts)


def _checked(f: Callable[[], int], b: Bound) -> Launcher:
    """A native call that refuses a position outside its table or cache (returns non-zero):
    the same refusal as the reference kernel's, never a read outside the bytes."""
    def run() -> None:
        if f():
            raise NpucError("NPUC-E0108", f"{b.opdef.name}: a position lies outside the table or cache it "
                            "indexes", "positions run from 0 to --max_seq_len - 1", exit_code=EXIT_USAGE)

    return run


def _rows(x: torch.Tensor, axis: int) -> tuple[int, int]:
    ax = axis % x.dim()
    return math.prod(x.shape[:ax]), math.prod(x.shape[ax:])


def _native_rms_norm(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    x, scale, out = b.ins[0], b.ins[1], b.outs[0]
    if x.dim() == 0 or not _contiguous(x, scale, out) or {x.dtype, scale.dtype, out.dtype} != {F32}:
        return None
    rows, d = _rows(x, b.attrs["axis"])
    if scale.numel() != d or tuple(scale.shape) != tuple(x.shape[x.dim() - scale.dim():]):
        return None  # a scale that broadcasts: the out-kernel's case
    return functools.partial(lib.npuc_rms_norm_f32, x.data_ptr(), scale.data_ptr(), b.attrs["eps"], out.data_ptr(),
                             rows, d, ls.threads)


_ROPE_LAYOUTS = {"half": 0, "interleaved": 1, "deinterleave": 2}


def _native_rope(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    x, pos, cos_t, sin_t = b.ins
    out = b.outs[0]
    layout = _ROPE_LAYOUTS.get(b.attrs["layout"])
    if layout is None or x.dim() < 2 or not _contiguous(x, pos, cos_t, sin_t, out) \
            or {x.dtype, cos_t.dtype, sin_t.dtype, out.dtype} != {F32} or pos.dtype != torch.int64:
        return None
    s, d = x.shape[-2], x.shape[-1]
    per_seq = pos.dim() == 2 and x.dim() >= 3 and tuple(pos.shape) == (x.shape[0], s)  # [b, s]: each sequence's
    if (pos.dim() != 1 or pos.shape[0] != s) and not per_seq or cos_t.dim() != 2 or cos_t.shape != sin_t.shape \
            or 2 * cos_t.shape[1] > d:
        return None
    return _checked(functools.partial(lib.npuc_rope_f32, x.data_ptr(), pos.data_ptr(), cos_t.data_ptr(),
                                      sin_t.data_ptr(), out.data_ptr(), x.numel() // max(s * d, 1), s, d,
                                      cos_t.shape[1], cos_t.shape[0], layout, x.shape[0] if per_seq else 0,
                                      ls.threads), b)


def _native_kv_write(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    cache, new, pos = b.ins[:3]
    slot = b.ins[3] if len(b.ins) > 3 else None
    s = new.shape[2] if new.dim() == 4 else 0
    if cache.dim() != 4 or new.dim() != 4 or not _contiguous(cache, new, pos) or pos.dtype != torch.int64 \
            or new.dtype not in (F32, BF16) or cache.dtype not in _kv_layouts(lib) \
            or b.outs[0].data_ptr() != cache.data_ptr() \
            or new.shape[0] != (1 if slot is not None else cache.shape[0]) or cache.shape[1] != new.shape[1] \
            or cache.shape[3] != _kv_width(cache, new.shape[3]) or tuple(pos.shape) not in ((s,), (new.shape[0], s)) \
            or (slot is not None and (slot.dtype != torch.int64 or slot.numel() != 1)):
        return None
    nb, h, _, d = new.shape
    length = cache.shape[2]
    call = functools.partial(lib.npuc_kv_write, cache.data_ptr(), _KV_KIND[cache.dtype], new.data_ptr(),
                             int(new.dtype == BF16), pos.data_ptr(), s if pos.dim() == 2 else 0)
    if slot is None:
        return _checked(functools.partial(call, -1, nb, h, length, s, d), b)
    slots, at = cache.shape[0], ctypes.c_int64.from_address(slot.data_ptr())

    def into_slot() -> int:  # the slot is run-time data: checked against the cache's slots
        return -1 if not 0 <= at.value < slots else call(at.value, nb, h, length, s, d)
    return _checked(into_slot, b)


def _native_cached_attention(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    if b.attrs.get("window") or b.attrs.get("softcap") or b.attrs.get("alibi") or len(b.ins) != 4:
        return None  # a sliding window, soft-capped scores, ALiBi or sinks: torch's
    q, kc, vc, pos = b.ins
    out = b.outs[0]
    if not _contiguous(q, kc, vc, pos, out) or pos.dtype != torch.int64 or kc.dtype != vc.dtype \
            or {q.dtype, out.dtype} - {F32, BF16} or kc.dtype not in _kv_layouts(lib) \
            or q.dim() != 4 or kc.dim() != 4 or vc.dim() != 4:
        return None
    bb, hq, s, d = q.shape
    hkv, length, dv = kc.shape[1], kc.shape[2], out.shape[3] if out.dim() == 4 else 0
    if kc.shape[0] != bb or vc.shape[:3] != kc.shape[:3] or kc.shape[3] != _kv_width(kc, d) or hq % hkv \
            or vc.shape[3] != _kv_width(vc, dv) or tuple(out.shape) != (bb, hq, s, dv) \
            or tuple(pos.shape) not in ((s,), (bb, s)):
        return None
    if hasattr(lib, "npuc_cached_attention_scratch_floats"):
        ws = ls.scratch(lib.npuc_cached_attention_scratch_floats(bb, hq, s, d, hkv, length, dv, ls.threads))
    else:
        ws = ls.scratch(ls.threads * (length + d + dv))
    return _checked(functools.partial(lib.npuc_cached_attention, q.data_ptr(), int(q.dtype == BF16), kc.data_ptr(),
                                      vc.data_ptr(), _KV_KIND[kc.dtype], pos.data_ptr(),
                                      s if pos.dim() == 2 else 0, out.data_ptr(),
                                      int(out.dtype == BF16), bb, hq, s, d, hkv, length, dv, b.attrs["scale"],
                                      ws.data_ptr(), ls.threads), b)


def _native_elementwise(fn: str) -> Callable[[Bound, ctypes.CDLL, Launchers], Launcher | None]:
    def build(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
        x, y, out = b.ins[0], b.ins[1], b.outs[0]
        if not _contiguous(x, y, out) or {x.dtype, y.dtype, out.dtype} != {F32} \
                or not x.shape == y.shape == out.shape:
            return None  # broadcasting: the out-kernel's case
        return functools.partial(getattr(lib, fn), x.data_ptr(), y.data_ptr(), out.data_ptr(), out.numel(),
                                 ls.threads)

    return build


def _native_transpose(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """A transpose that moves bytes (prefill's [b, s, h, d] <-> [b, h, s, d]): one strided
    copy on the pool. A rank above 4 is torch's."""
    x, out = b.ins[0], b.outs[0]
    if x.dim() > 4 or x.device.type != "cpu" or not out.is_contiguous() or x.dtype != out.dtype:
        return None
    perm = list(b.attrs["perm"])
    pad = 4 - x.dim()
    shape = [1] * pad + [x.shape[p] for p in perm]
    strides = [0] * pad + [x.stride(p) for p in perm]
    if tuple(shape[pad:]) != tuple(out.shape):
        return None
    dims = ls.keep(torch.tensor(shape + strides, dtype=torch.int64))
    return functools.partial(lib.npuc_permute, x.data_ptr(), out.data_ptr(), x.element_size(), dims.data_ptr(),
                             dims.data_ptr() + 32, ls.threads)


def _native_gather(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """Rows of a table along axis 0 by i64 indices (the embedding lookup): a memcpy per row,
    with no torch kernel (whose OpenMP workers would then spin against npuc's pool). An
    index outside the table falls to the reference kernel, which refuses it."""
    x, idx, out = b.ins[0], b.ins[1], b.outs[0]
    if x.dim() < 1 or b.attrs["axis"] % x.dim() != 0 or idx.dtype != torch.int64 or x.dtype != out.dtype \
            or not _contiguous(x, idx, out):
        return None
    row = x.element_size() * math.prod(x.shape[1:])
    call = functools.partial(lib.npuc_gather_rows, x.data_ptr(), x.shape[0], row, idx.data_ptr(), idx.numel(),
                             out.data_ptr())
    fallback = _generic(b)

    def run() -> None:
        if call():
            fallback()

    return run


def tail_rows_read(steps: Sequence[Any], kept: set[int]) -> dict[int, int]:
    """Steps (by index) whose output's tile-padded rows no later step reads: a `pad` read
    only as the input of products with `valid_rows` (passes/align.py), which compute and
    read those rows only. Such a pad need write only the rows read. `steps` have `opdef`,
    `inputs`, `outputs` and `attrs`; `kept` are the tensors that outlive the run (program
    outputs, state), whose every byte counts."""
    readers: dict[int, list[Any]] = {}
    for st in steps:
        for t in set(st.inputs):
            readers.setdefault(t, []).append(st)
    found = {}
    for i, st in enumerate(steps):
        if st.opdef.name != "pad" or len(st.outputs) != 1 or st.outputs[0] in kept:
            continue
        o, rows = st.outputs[0], []
        for r in readers.get(o, []):
            if r.opdef.name not in ("linear", "qlinear") or r.inputs[0] != o or o in r.inputs[1:] \
                    or not isinstance(r.attrs.get("valid_rows"), int):
                break
            rows.append(r.attrs["valid_rows"])
        else:
            if rows:
                found[i] = max(rows)
    return found


def _native_pad(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """Tile padding with zeros at the end of the last two axes (passes/align.py's): a memcpy
    and a memset per row, and only the rows a later step reads (Bound.rows_read)."""
    x, out = b.ins[0], b.outs[0]
    pads, r = list(b.attrs["pads"]), x.dim()
    if len(b.ins) != 1 or b.attrs["mode"] != "constant" or r < 2 or any(pads[:r]) or any(pads[r:2 * r - 2]) \
            or min(pads) < 0 or x.dtype != out.dtype or not _contiguous(x, out):
        return None
    m, k, m2, k2 = x.shape[-2], x.shape[-1], out.shape[-2], out.shape[-1]
    fill = m2 if b.rows_read is None else max(0, min(b.rows_read, m2))
    return _checked_call(functools.partial(lib.npuc_pad_rows, x.data_ptr(), out.data_ptr(), x.element_size(),
                                           math.prod(x.shape[:-2]), m, k, m2, k2, fill), b)


def _native_fused_attention(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """Prefill's attention without a mask, query i attending keys 0..min(i, L - 1) (causal,
    torch's top-left alignment) or all L keys: f32 with many queries, as small GEMMs
    (npuc_attention_gemm); otherwise decode's cached-attention kernel."""
    if len(b.ins) != 3 or b.attrs.get("window") or b.attrs.get("softcap") or b.attrs.get("alibi"):
        return None  # a mask, a sliding window or soft-capped scores: torch's
    q, k, v = b.ins
    s, length = q.shape[2] if q.dim() == 4 else 0, k.shape[2] if k.dim() == 4 else 0
    if not s or not length:
        return None
    pos = [min(i, length - 1) for i in range(s)] if b.attrs["causal"] else [length - 1] * s
    p = ls.keep(torch.tensor(pos, dtype=torch.int64))
    out = b.outs[0]
    if s > GEMV_MAX_ROWS and {q.dtype, k.dtype, v.dtype, out.dtype} == {F32} and _contiguous(q, k, v, out) \
            and q.dim() == k.dim() == v.dim() == 4 and q.shape[3] % 16 == 0 and v.shape[3] % 16 == 0 \
            and k.shape[0] == v.shape[0] == q.shape[0] and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0 \
            and k.shape[3] == q.shape[3] and v.shape[2] == length \
            and tuple(out.shape) == (q.shape[0], q.shape[1], s, v.shape[3]):
        # Prefill: the scores and the output as small GEMMs on the GEMM's register tile.
        bb, hq, _, d = q.shape
        hkv, dv = k.shape[1], v.shape[3]
        ws = ls.scratch(lib.npuc_attention_gemm_scratch_floats(bb, hkv, d, length, dv, ls.threads))
        return _checked_call(functools.partial(lib.npuc_attention_gemm, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                               p.data_ptr(), out.data_ptr(), bb, hq, s, d, hkv, length, dv,
                                               b.attrs["scale"], ws.data_ptr(), ls.threads), b)
    return _native_cached_attention(Bound(b.opdef, b.attrs, [q, k, v, p], b.outs, b.ws), lib, ls)


def _prepacked_linear(b: Bound, ls: Launchers) -> Launcher | None:
    """A product with many rows (prefill): oneDNN's GEMM over a copy of the weight packed
    at load into its blocked layout for this host (the packed bytes are this process's,
    never the .om's). The result is copied into the planned slot. bf16 weights are packed
    as bf16 where the CPU computes in bf16 (oneDNN says so), else widened to f32 once, at
    load: an f32 GEMM beats any emulated bf16 one, and rounds the result once, as a bf16
    kernel that accumulates in f32 does."""
    x, w, y = b.ins[0], b.ins[1], b.outs[0]
    bias = b.ins[2] if len(b.ins) > 2 else None
    if not _contiguous(x, w, y, bias) or x.dim() < 2 or w.dim() != 2 \
            or not ({x.dtype, w.dtype, y.dtype} == {F32} or (w.dtype == BF16 and {x.dtype, y.dtype} <= {F32, BF16})) \
            or (bias is not None and bias.dtype not in (F32, BF16)):
        return None
    wt = w if b.attrs["weight_layout"] == "nk" else w.t().contiguous()
    n, k = wt.shape
    rows = x.numel() // max(k, 1)
    if x.shape[-1] != k or y.shape[-1] != n or rows <= GEMV_MAX_ROWS:
        return None
    compute = BF16 if w.dtype == BF16 and torch.ops.mkldnn._is_mkldnn_bf16_supported() else F32
    packed = torch.ops.mkldnn._reorder_linear_weight(wt.to(compute), rows)
    ls.packed_bytes += wt.numel() * compute.itemsize
    bias_c = bias.to(compute) if bias is not None else None
    x2, y2 = x.view(rows, k), y.view(rows, n)
    linear = torch.ops.mkldnn._linear_pointwise

    def run() -> None:
        y2.copy_(linear(x2.to(compute), packed, bias_c, "none", [], ""))

    return run


def _native_gemm(b: Bound, ls: Launchers) -> Launcher | None:
    """A product with many rows (prefill) on the CPU: runtime/native's GEMM over a copy of
    the weight packed at load into 16-column panels (f32; a bf16 weight is widened once).
    Only the `valid_rows` of a tile-padded input are computed, and the result is written in
    place: no allocation per call."""
    lib = ls.lib
    assert lib is not None
    x, w, y = b.ins[0], b.ins[1], b.outs[0]
    bias = b.ins[2] if len(b.ins) > 2 else None
    if not _contiguous(x, w, y, bias) or x.dim() < 2 or w.dim() != 2 or {x.dtype, y.dtype} - {F32, BF16} \
            or w.dtype not in (F32, BF16) or (bias is not None and bias.dtype not in (F32, BF16)):
        return None
    kn = b.attrs["weight_layout"] == "kn"
    n, k = (w.shape[1], w.shape[0]) if kn else (w.shape[0], w.shape[1])
    if x.shape[-1] != k or y.shape[-1] != n or (bias is not None and tuple(bias.shape) != (n,)):
        return None
    calls = _row_calls(x, b.attrs)
    if sum(r for _, r, _ in calls) <= GEMV_MAX_ROWS:
        return None
    packed = torch.empty(lib.npuc_gemm_packed_floats(n, k), dtype=F32)
    lib.npuc_gemm_pack_b(w.data_ptr(), int(w.dtype == BF16), int(kn), n, k, packed.data_ptr(), ls.threads)
    ls.keep(packed)
    ls.packed_bytes += packed.numel() * 4
    bias_f = ls.keep(bias.float().contiguous()) if bias is not None else None
    xb, yb = int(x.dtype == BF16), int(y.dtype == BF16)
    ws = ls.scratch(max(lib.npuc_gemm_scratch_floats(r, n, k, yb) for _, r, _ in calls))
    fs = [functools.partial(lib.npuc_gemm_f32, x.data_ptr() + row * k * x.element_size(), xb, rows, st * k,
                            packed.data_ptr(), n, k, _ptr(bias_f), y.data_ptr() + row * n * y.element_size(), yb,
                            st * n, ws.data_ptr(), ls.threads) for row, rows, st in calls]
    return _sequence(fs)


def _native_qlinear(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """A product over a quantized weight (ir/quant.py's layout): the codes are read as
    stored, every call; the scales and zero points (small) are widened to f32 once, here.
    Few rows: a GEMV over the codes; more: the GEMM, dequantizing 16-column panels as it
    goes (nothing packed at load, so a quantized model stays small in memory too)."""
    x, q, scale, zero = b.ins[:4]
    bias = b.ins[4] if len(b.ins) > 4 else None
    y = b.outs[0]
    bits, g = b.attrs["bits"], b.attrs["group_size"]
    if not _contiguous(x, q, scale, zero, y, bias) or x.dim() < 1 or {x.dtype, y.dtype} - {F32, BF16}:
        return None
    n, k = q.shape[0], x.shape[-1]
    calls = _row_calls(x, b.attrs)
    if b.attrs.get("act_bits"):
        return _native_i8linear(b, lib, ls, calls)
    gemv = sum(r for _, r, _ in calls) <= GEMV_MAX_ROWS
    if gemv and bits == 4 and g % 16:
        return None  # the 4-bit GEMV reads whole blocks of 16: the reference kernel's case
    scale_f = ls.keep(scale.float().contiguous())
    zero_f = ls.keep(zero.float().contiguous())
    bias_f = ls.keep(bias.float().contiguous()) if bias is not None else None
    xb, yb = int(x.dtype == BF16), int(y.dtype == BF16)
    if gemv:
        fn = lib.npuc_qlinear
        ws = ls.scratch(max(lib.npuc_qlinear_scratch_floats(r, k, g) for _, r, _ in calls))
    else:
        fn = lib.npuc_qgemm
        ws = ls.scratch(max(lib.npuc_qgemm_scratch_floats(r, n, k, yb, ls.threads) for _, r, _ in calls))
    fs = [_checked_call(functools.partial(fn, x.data_ptr() + row * k * x.element_size(), xb, rows, st * k,
                                          q.data_ptr(), bits, scale_f.data_ptr(), zero_f.data_ptr(), n, k, g,
                                          _ptr(bias_f), y.data_ptr() + row * n * y.element_size(), yb, st * n,
                                          ws.data_ptr(), ls.threads), b) for row, rows, st in calls]
    return _sequence(fs)


def _native_i8linear(b: Bound, lib: ctypes.CDLL, ls: Launchers, calls: list) -> Launcher | None:
    """`qlinear[act_bits=8]`: int8 activations times int8 (or 4-bit) codes (kernels_i8.c).
    The weight is packed once, here, into the kernel's 8-row panels; each call quantizes
    the activations per block of 32 and accumulates in int32, as ir/quant.py's reference."""
    x, q, scale, zero = b.ins[:4]
    bias = b.ins[4] if len(b.ins) > 4 else None
    y = b.outs[0]
    bits, g = b.attrs["bits"], b.attrs["group_size"]
    n, k = q.shape[0], x.shape[-1]
    if scale.dtype != torch.float16 or k % 32 or g % 32:
        return None
    packed = ls.keep(torch.empty(lib.npuc_i8_packed_bytes(bits, n, k), dtype=torch.uint8))
    if lib.npuc_i8_pack(q.data_ptr(), bits, scale.data_ptr(), zero.data_ptr(), n, k, g, packed.data_ptr()):
        return None
    bias_f = ls.keep(bias.float().contiguous()) if bias is not None else None
    ws = ls.scratch(max(lib.npuc_i8linear_scratch_bytes(r, k) for _, r, _ in calls) // 4 + 1)
    xb, yb = int(x.dtype == BF16), int(y.dtype == BF16)
    fs = [_checked_call(functools.partial(lib.npuc_i8linear, x.data_ptr() + row * k * x.element_size(), xb, rows,
                                          st * k, packed.data_ptr(), bits, n, k, _ptr(bias_f),
                                          y.data_ptr() + row * n * y.element_size(), yb, st * n, ws.data_ptr(),
                                          ls.threads), b) for row, rows, st in calls]
    return _sequence(fs)


def _native_dequantize(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """A quantized table's looked-up rows (passes/quant_fusion.py's gathered embedding),
    as ir/quant.py's reference computes them, in one call."""
    q, scale, zero = b.ins
    out = b.outs[0]
    bits, g = b.attrs["bits"], b.attrs["group_size"]
    if not _contiguous(q, scale, zero, out) or q.dim() < 1 or scale.dtype not in (F32, BF16, torch.float16) \
            or out.dtype not in (F32, BF16):
        return None
    k = out.shape[-1]
    sdt = {F32: 0, BF16: 1, torch.float16: 2}[scale.dtype]
    return _checked_call(functools.partial(lib.npuc_dequantize, q.data_ptr(), bits, scale.data_ptr(),
                                           sdt, zero.data_ptr(), out.numel() // max(k, 1), k, g,
                                           out.data_ptr(), int(out.dtype == BF16)), b)


# -- the recurrences (npucrt/src/ops_recurrent.c's flat entry points) ------------------------------

I64, INT, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_RECURRENT_API = {
    # name: (argtypes, restype)
    "npuc_selective_scan_scratch_floats": ([I64, I64, I64, I64, INT, INT, INT], I64),
    "npuc_selective_scan_f32": ([PTR, PTR, PTR, INT, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, I64, I64,
                                 I64, PTR, I64, INT], INT),
    "npuc_gated_delta_rule_scratch_floats": ([I64, I64, I64, I64, INT, INT], I64),
    "npuc_gated_delta_rule_f32": ([PTR, PTR, PTR, PTR, INT, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, I64, I64, PTR,
                                   I64, INT], INT),
    "npuc_wkv_scratch_floats": ([I64, I64, INT, INT], I64),
    "npuc_wkv_f32": ([PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, PTR, I64, INT], INT),
    "npuc_linear_recurrence_scratch_floats": ([I64, I64, INT, INT], I64),
    "npuc_linear_recurrence_f32": ([PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, PTR, I64, INT], INT),
    "npuc_conv1d_depthwise_f32": ([PTR, PTR, PTR, PTR, I64, I64, I64, I64, INT], INT),
}


def _recurrent_api(lib: ctypes.CDLL) -> bool:
    """Declare the recurrences' entry points on `lib` (idempotent); False where the library
    predates them (a cached build of older sources)."""
    for name, (args, res) in _RECURRENT_API.items():
        f = getattr(lib, name, None)
        if f is None:
            return False
        if f.argtypes is None:
            f.argtypes, f.restype = args, res
    return True


def _index_checked(f: Callable[[], int], b: Bound) -> Launcher:
    """A recurrence's native call: 1 is a `last` or `slot` out of range (the C executor's
    NPUC_E_INPUT; nothing was written), anything else non-zero a launcher's bug."""
    def run() -> None:
        rc = f()
        if rc == 1:
            raise NpucError("NPUC-E0108", f"{b.opdef.name}: its last or slot lies outside the prompt's rows or the "
                            "state's slots", "last runs over the prompt's rows, slot over 0..slots - 1",
                            exit_code=EXIT_USAGE)
        if rc:
            raise InternalError(f"{b.opdef.name}: the native kernel refused its operands")

    return run


def _recurrent_operands(b: Bound, n: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None,
                                                    list[torch.Tensor]] | None:
    """(the recurrence's n operands, its output, the state or None, last and slot) where every
    tensor is a contiguous f32 on the CPU, the indices i64 and the state updated in place."""
    stateful = b.opdef.inplace is not None
    at = int(stateful)
    ops, tail, y = b.ins[at:at + n], b.ins[at + n:], b.outs[at]
    state = b.ins[0] if stateful else None
    if any(t.dtype != F32 for t in [*ops, y, *([state] if state is not None else [])]) \
            or not _contiguous(*ops, y, state, *tail) or any(t.dtype != torch.int64 or t.numel() != 1 for t in tail) \
            or (state is not None and b.outs[0].data_ptr() != state.data_ptr()):
        return None
    return ops, y, state, tail


def _state_args(state: torch.Tensor | None, tail: list[torch.Tensor]) -> tuple[int | None, int, int | None, int | None]:
    """state, slots, last and slot as the entry points take them (None: a NULL pointer)."""
    return (_ptr(state), state.shape[0] if state is not None else 0, _ptr(tail[0]) if tail else None,
            _ptr(tail[1]) if len(tail) > 1 else None)


def _native_selective_scan(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    got = _recurrent_operands(b, 6) if _recurrent_api(lib) else None
    if got is None:
        return None
    (x, dt, a, bm, cm, d), y, state, tail = got
    bt, s, dc = x.shape
    h, (g, n), a_full = dt.shape[2], bm.shape[2:], int(a.dim() == 2)
    floats = lib.npuc_selective_scan_scratch_floats(bt, dc, n, g, a_full, int(state is None or bool(tail)), ls.threads)
    if floats < 0:
        return None
    ws = ls.scratch(floats)
    return _index_checked(functools.partial(
        lib.npuc_selective_scan_f32, x.data_ptr(), dt.data_ptr(), a.data_ptr(), a_full, bm.data_ptr(), cm.data_ptr(),
        d.data_ptr(), y.data_ptr(), *_state_args(state, tail), bt, s, dc, n, h, g, ws.data_ptr(), ws.numel(),
        ls.threads), b)


def _native_gated_delta_rule(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """gated_delta_rule, and linear_attention: the rule without beta."""
    plain = b.opdef.name.startswith("linear_attention")
    got = _recurrent_operands(b, 4 if plain else 5) if _recurrent_api(lib) else None
    if got is None:
        return None
    (q, k, v, g, *rest), o, state, tail = got
    beta = rest[0] if rest else None
    bt, s, h, kd = q.shape
    vd = v.shape[3]
    floats = lib.npuc_gated_delta_rule_scratch_floats(bt, h, kd, vd, int(state is None or bool(tail)), ls.threads)
    if floats < 0:
        return None
    ws = ls.scratch(floats)
    return _index_checked(functools.partial(
        lib.npuc_gated_delta_rule_f32, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), int(g.dim() == 4),
        _ptr(beta), o.data_ptr(), *_state_args(state, tail), bt, s, h, kd, vd, ws.data_ptr(), ws.numel(),
        ls.threads), b)


def _native_wkv(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    got = _recurrent_operands(b, 4) if _recurrent_api(lib) else None
    if got is None:
        return None
    (k, v, w, u), y, state, tail = got
    bt, s, c = k.shape
    floats = lib.npuc_wkv_scratch_floats(bt, c, int(state is None or bool(tail)), ls.threads)
    if floats < 0:
        return None
    ws = ls.scratch(floats)
    return _index_checked(functools.partial(
        lib.npuc_wkv_f32, k.data_ptr(), v.data_ptr(), w.data_ptr(), u.data_ptr(), y.data_ptr(),
        *_state_args(state, tail), bt, s, c, ws.data_ptr(), ws.numel(), ls.threads), b)


def _native_linear_recurrence(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    got = _recurrent_operands(b, 2) if _recurrent_api(lib) else None
    if got is None:
        return None
    (x, a), y, state, tail = got
    bt, s, c = x.shape
    floats = lib.npuc_linear_recurrence_scratch_floats(bt, c, int(state is None or bool(tail)), ls.threads)
    if floats < 0:
        return None
    ws = ls.scratch(floats)
    return _index_checked(functools.partial(
        lib.npuc_linear_recurrence_f32, x.data_ptr(), a.data_ptr(), y.data_ptr(), *_state_args(state, tail), bt, s,
        c, ws.data_ptr(), ws.numel(), ls.threads), b)


def _native_conv1d(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    """A depthwise conv1d without padding (a recurrent layer's short convolution over its conv
    window, [slots, C, W]): one native call. Any other convolution is torch's."""
    x, w, out = b.ins[0], b.ins[1], b.outs[0]
    bias = b.ins[2] if len(b.ins) > 2 else None
    a = b.attrs
    if not _recurrent_api(lib) or tuple(a["pads"]) != (0, 0) or a["stride"] != 1 or a["dilation"] != 1 \
            or x.dim() != 3 or w.dim() != 3 or a["groups"] != x.shape[1] or w.shape[:2] != (x.shape[1], 1) \
            or {x.dtype, w.dtype, out.dtype} != {F32} or (bias is not None and bias.dtype != F32) \
            or not _contiguous(x, w, bias, out):
        return None
    bt, c, length = x.shape
    return _checked_call(functools.partial(lib.npuc_conv1d_depthwise_f32, x.data_ptr(), w.data_ptr(), _ptr(bias),
                                           out.data_ptr(), bt, c, length, w.shape[2], ls.threads), b)


# -- torch kernels on load-time scratch -------------------------------------------------------------

def _scratch_layer_norm(b: Bound, ls: Launchers) -> Launcher | None:
    """layer_norm in f32 as its reference kernel computes it (ir/fused_ops.py), op for op, with
    the statistics and the squared deviations in the session's scratch."""
    x, scale, out = b.ins[0], b.ins[1], b.outs[0]
    bias = b.ins[2] if len(b.ins) > 2 else None
    if x.dim() == 0 or {x.dtype, scale.dtype, out.dtype} != {F32} or (bias is not None and bias.dtype != F32) \
            or not _contiguous(x, scale, bias, out):
        return None
    ax = b.attrs["axis"] % x.dim()
    axes = tuple(range(ax, x.dim()))
    stat = tuple(x.shape[:ax]) + (1,) * (x.dim() - ax)
    rows = math.prod(stat)
    ws = ls.scratch(x.numel() + 2 * rows)
    sq = ws[:x.numel()].view(x.shape)
    mu, var = ws[x.numel():x.numel() + rows].view(stat), ws[x.numel() + rows:x.numel() + 2 * rows].view(stat)
    eps = ls.keep(torch.tensor(b.attrs["eps"], dtype=F32))
    n = ls.keep(torch.tensor(float(x.numel() // rows), dtype=F32))

    def run() -> None:  # each mean as torch.mean computes it, the sum then / n (its out= form allocates)
        torch.sum(x, dim=axes, keepdim=True, out=mu)
        mu.div_(n)
        torch.sub(x, mu, out=out)  # x - mu
        torch.mul(out, out, out=sq)  # (x - mu).pow(2): torch's pow by 2 is this product
        torch.sum(sq, dim=axes, keepdim=True, out=var)
        var.div_(n).add_(eps).rsqrt_()
        out.mul_(var).mul_(scale)
        if bias is not None:
            out.add_(bias)

    return run


def _checked_call(f: Callable[[], int], b: Bound) -> Launcher:
    """A native call that returns non-zero for arguments it does not take (the launcher
    checked them: this is a bug, said as one)."""
    def run() -> None:
        if f():
            raise InternalError(f"{b.opdef.name}: the native kernel refused its operands")

    return run


def _native_cast(b: Bound, lib: ctypes.CDLL, ls: Launchers) -> Launcher | None:
    x, out = b.ins[0], b.outs[0]
    if not _contiguous(x, out) or {x.dtype, out.dtype} - {F32, BF16} or x.shape != out.shape:
        return None
    return functools.partial(lib.npuc_cast, x.data_ptr(), int(x.dtype == BF16), out.data_ptr(),
                             int(out.dtype == BF16), out.numel(), ls.threads)


class Launchers:
    """Per-session: picks each step's kernel; owns the native kernels' shared scratch and
    the prepacked weights."""

    def __init__(self, lib: ctypes.CDLL | None, threads: int | None = None, prepack: bool = False) -> None:
        self.lib = lib
        self.threads = threads or torch.get_num_threads()
        self.prepack = prepack
        self.packed_bytes = 0
        self._scratch: list[torch.Tensor] = []  # kept alive: native calls hold their pointers
        self._kept: list[torch.Tensor] = []
        self.kinds: dict[str, int] = {}

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """Keep `t` alive as long as the session: native calls hold its pointer."""
        self._kept.append(t)
        return t

    def scratch(self, floats: int) -> torch.Tensor:
        """Scratch of at least `floats` f32, shared by every step: steps run one at a time."""
        if not self._scratch or self._scratch[-1].numel() < floats:
            self._scratch.append(torch.empty(max(floats, 1), dtype=torch.float32))
        return self._scratch[-1]

    def choose(self, b: Bound) -> Launcher | None:
        """The step's launcher, or None where it has nothing to do."""
        kind, f = self._choose(b)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return f

    def _choose(self, b: Bound) -> tuple[str, Launcher | None]:
        if is_noop_view(b):
            return "view", None
        build = _NATIVE.get(b.opdef.name)
        if build is not None and self.lib is not None and _declared_right(b):
            f = build(b, self.lib, self)
            if f is not None:
                return "native", f
        build_ws = _SCRATCH.get(b.opdef.name)
        if build_ws is not None and _declared_right(b):
            f = build_ws(b, self)
            if f is not None:
                return "scratch", f
        if b.opdef.name == "linear" and self.prepack:
            f = _native_gemm(b, self) if self.lib is not None and _declared_right(b) else None
            if f is not None:
                return "native-gemm", f
            f = _prepacked_linear(b, self) if torch.backends.mkldnn.is_available() else None
            if f is not None:
                return "prepacked", f
        return ("out" if b.opdef.out_kernel is not None else "ref"), _generic(b)


_NATIVE: dict[str, Callable[[Bound, ctypes.CDLL, Launchers], Launcher | None]] = {
    "linear": _native_linear, "rms_norm": _native_rms_norm, "rope_lut": _native_rope, "kv_write": _native_kv_write,
    "cached_attention": _native_cached_attention, "swiglu": _native_elementwise("npuc_swiglu_f32"),
    "add": _native_elementwise("npuc_add_f32"), "cast": _native_cast, "qlinear": _native_qlinear,
    "transpose": _native_transpose, "fused_attention": _native_fused_attention, "gather": _native_gather,
    "pad": _native_pad, "dequantize": _native_dequantize,
    "selective_scan": _native_selective_scan, "selective_scan_state": _native_selective_scan,
    "gated_delta_rule": _native_gated_delta_rule, "gated_delta_rule_state": _native_gated_delta_rule,
    "wkv": _native_wkv, "wkv_state": _native_wkv,
    "linear_recurrence": _native_linear_recurrence, "linear_recurrence_state": _native_linear_recurrence,
    "linear_attention": _native_gated_delta_rule, "linear_attention_state": _native_gated_delta_rule,
    "conv1d": _native_conv1d,
}
_SCRATCH: dict[str, Callable[[Bound, Launchers], Launcher | None]] = {"layer_norm": _scratch_layer_norm}
