"""Recurrent token mixers: the selective scan of state-space layers (Mamba, Mamba2 and the
hybrids built on them) and the gated delta rule of linear-attention layers (Gated
DeltaNet: Qwen3.5, Qwen3-Next; Kimi's per-channel gate), each with its shape rule and
reference kernel.

Each recurrence comes as two ops. The frontend emits the pure one (the layer over a
prompt from a zero state, what a program without --max_seq_len runs); passes/kv_cache.py
turns it into the stateful one, whose state is a `.om` state of one row per slot:

    selective_scan(x, dt, A, B, C, D) -> y
    selective_scan_state(state, x, dt, A, B, C, D, last?, slot?) -> state (in place), y

      x [b,S,Dc]; dt [b,S,H] (already biased, softplus'd and clamped; channel d reads
      dt[.., d // (Dc/H)]); A [H] (one decay rate per dt head: Mamba2) or [Dc,N] (per
      channel and state: Mamba); B, C [b,S,G,N] (channel d reads group d // (Dc/G));
      D [Dc]; state [slots,Dc,N]:
          h[d,n] = exp(dt[d] A[d(,n)]) h[d,n] + dt[d] B[g,n] x[d]
          y[d]   = sum_n C[g,n] h[d,n] + D[d] x[d]

    gated_delta_rule(q, k, v, g, beta) -> o
    gated_delta_rule_state(state, q, k, v, g, beta, last?, slot?) -> state (in place), o

      q, k [b,S,H,K] (normalised and scaled by the caller); v [b,S,H,V]; g [b,S,H] (the
      log of a head's decay) or [b,S,H,K] (one per key channel: Kimi's delta attention);
      beta [b,S,H]; state [slots,H,K,V]:
          h  = exp(g) h                       (g [H]: every row; g [H,K]: row k by exp(g[k]))
          h += k (beta (v - k^T h))^T
          o  = q^T h

With `last` (prefill: i64[1], the prompt's last row; later rows are the right padding of
a shorter prompt) the scan starts from zeros and the state keeps h after row `last`, in
state[slot] with `slot` (one sequence into the slot it fills). Without it (decode) every
sequence b starts from state[b] and the state advances over all S rows. A slot refilled
by a prefill therefore never sees the state of its last request.

The reference kernels step token by token in float32 (what the C kernels do); the
chunked forms transformers writes for prefill compute the same sums in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from npuc.ir.ops import A, ShapeError, T
from npuc.ir.registry import op
from npuc.ir.types import DType, TensorType

_RECURRENT_DOC = " (ir/recurrent_ops.py)"


def _per_channel(t: torch.Tensor, channels: int) -> torch.Tensor:
    """[.., H] -> [.., channels]: channel d reads t[.., d // (channels / H)]."""
    return t.repeat_interleave(channels // t.shape[-1], dim=-1) if t.shape[-1] != channels else t


def _scan(h: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
          d: torch.Tensor, last: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan of x [b,S,Dc] from h [b,Dc,N]; returns (y, the state after `last` or the end)."""
    dc = x.shape[-1]
    x, dt, b, c, d = x.float(), _per_channel(dt.float(), dc), b.float(), c.float(), d.float()
    b = b.repeat_interleave(dc // b.shape[2], dim=2)  # [b,S,Dc,N]
    c = c.repeat_interleave(dc // c.shape[2], dim=2)
    a = _per_channel(a.float(), dc)[:, None] if a.dim() == 1 else a.float()  # [Dc,1] or [Dc,N]
    h = h.float().clone()
    ys, kept = [], h
    for s in range(x.shape[1]):
        h = torch.exp(dt[:, s, :, None] * a) * h + (dt[:, s] * x[:, s])[:, :, None] * b[:, s]
        ys.append((h * c[:, s]).sum(-1) + d * x[:, s])
        if s == last:
            kept = h
    return torch.stack(ys, 1), (h if last is None else kept)


def _delta(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
           last: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over S tokens from h [b,H,K,V]; returns (o [b,S,H,V], the kept state).
    Without beta, the plain decayed linear attention: h = exp(g) h + k v^T."""
    q, k, v, g = (t.float() for t in (q, k, v, g))
    h = h.float().clone()
    outs, kept = [], h
    for s in range(q.shape[1]):
        decay = torch.exp(g[:, s])
        h = h * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        if beta is None:
            delta = v[:, s]
        else:
            kv = torch.einsum("bhkv,bhk->bhv", h, k[:, s])
            delta = (v[:, s] - kv) * beta[:, s, :, None].float()
        h = h + k[:, s, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", h, q[:, s]))
        if s == last:
            kept = h
    return torch.stack(outs, 1), (h if last is None else kept)


def _stateful(xs: list[torch.Tensor], n: int, step: object, out: int = 0,
              empty: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Run `step` for a stateful op: state, its n operands, then last? and slot?; the result
    takes operand `out`'s dtype (the shape rule's). Prefill starts from `empty(shape)`
    (zeros unless given)."""
    state, ops, rest = xs[0], xs[1:1 + n], xs[1 + n:]
    if rest:  # prefill: from an empty state, keep the state after `last`, into `slot`
        last = int(rest[0].reshape(-1)[0])
        slot = int(rest[1].reshape(-1)[0]) if len(rest) > 1 else 0
        shape = (ops[0].shape[0], *state.shape[1:])
        start = empty(shape) if empty is not None else torch.zeros(shape, dtype=torch.float32)
        y, h = step(start, *ops, last)  # type: ignore[operator]
        state[slot:slot + ops[0].shape[0]] = h.to(state.dtype)
    else:
        y, h = step(state, *ops, None)  # type: ignore[operator]
        state.copy_(h.to(state.dtype))
    return [state, y.to(ops[out].dtype)]


def _scan_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    h = torch.zeros((x.shape[0], x.shape[2], xs[3].shape[-1]), dtype=torch.float32)
    return _scan(h, xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], None)[0].to(x.dtype)


def _delta_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, v = xs[0], xs[2]
    h = torch.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)
    return _delta(h, xs[0], xs[1], xs[2], xs[3], xs[4], None)[0].to(v.dtype)


def _check_scan(x: TensorType, dt: TensorType, a: TensorType, b: TensorType, c: TensorType, d: TensorType) -> int:
    """The state size N, or ShapeError."""
    bat, s, dc = x.shape if x.rank == 3 else (0, 0, 0)
    n = b.shape[3] if b.rank == 4 else 0
    ok = (x.rank == 3 and dt.rank == 3 and dt.shape[:2] == (bat, s) and dt.shape[2] > 0 and dc % dt.shape[2] == 0
          and b.rank == 4 and b.shape[:2] == (bat, s) and b.shape[2] > 0 and dc % b.shape[2] == 0 and c.shape == b.shape
          and (a.shape == (dt.shape[2],) or a.shape == (dc, n)) and d.shape == (dc,)
          and all(t.dtype.is_float for t in (x, dt, a, b, c, d)))
    if not ok:
        raise ShapeError(f"selective_scan x {x}, dt {dt}, A {a}, B {b}, C {c}, D {d} do not fit: x [b,S,Dc], dt [b,S,H], "
                         "A [H] or [Dc,N], B and C [b,S,G,N], D [Dc], with H and G dividing Dc")
    return n


def _check_delta(q: TensorType, k: TensorType, v: TensorType, g: TensorType, beta: TensorType) -> None:
    ok = (q.rank == 4 and k.shape == q.shape and v.rank == 4 and v.shape[:3] == q.shape[:3]
          and (g.shape == q.shape[:3] or g.shape == q.shape) and beta.shape == q.shape[:3]
          and all(t.dtype.is_float for t in (q, k, v, g, beta)))
    if not ok:
        raise ShapeError(f"gated_delta_rule q {q}, k {k}, v {v}, g {g}, beta {beta} do not fit: q and k [b,S,H,K], "
                         "v [b,S,H,V], g [b,S,H] or [b,S,H,K], beta [b,S,H]")


def _check_tail(name: str, ins: T, n: int, rows: int, state: TensorType, want: tuple[int, ...]) -> None:
    rest = ins[1 + n:]
    for t in rest:
        if t.shape != (1,) or t.dtype not in (DType.i64, DType.i32):
            raise ShapeError(f"{name}'s last and slot {t} should be i64[1]")
    if state.shape[1:] != want or state.dtype != DType.f32:
        raise ShapeError(f"{name} state {state} should be f32[slots, {', '.join(map(str, want))}]")
    if len(rest) == 2 and rows != 1:
        raise ShapeError(f"{name} fills one slot from one sequence, not {rows}")
    if len(rest) < 2 and rows != state.shape[0]:
        raise ShapeError(f"{name} runs {rows} sequences over a state of {state.shape[0]}")


def _scan_flops(ins: T, outs: T, attrs: A) -> int:
    at = 1 if len(ins) > 6 else 0  # the stateful op's operands follow its state
    return 6 * ins[at].numel * ins[at + 3].shape[3]


def _delta_flops(ins: T, outs: T, attrs: A) -> int:
    at = 1 if len(ins) > 5 else 0
    return 8 * ins[at].numel * ins[at + 2].shape[3]


@op("selective_scan", ("x", "dt", "A", "B", "C", "D"), kernel=_scan_kernel, flops=_scan_flops,
    doc="a state-space layer's selective scan over the sequence from a zero state: x [b,S,Dc], dt [b,S,H], "
        "A [H] or [Dc,N], B and C [b,S,G,N], D [Dc]; y [b,S,Dc]" + _RECURRENT_DOC)
def _selective_scan(ins: T, attrs: A) -> list[TensorType]:
    _check_scan(*ins)
    return [ins[0]]


def _scan_state_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    return _stateful(xs, 6, _scan)


@op("selective_scan_state", ("state", "x", "dt", "A", "B", "C", "D", "last?", "slot?"), kernel=_scan_state_kernel,
    flops=_scan_flops, inplace=0,
    doc="selective_scan over a state [slots,Dc,N] (updated in place; output 0): with last i64[1] (prefill) from "
        "zeros, keeping the state after row last (in state[slot] with slot); without, from and into the state of "
        "each sequence; y [b,S,Dc] is output 1" + _RECURRENT_DOC)
def _selective_scan_state(ins: T, attrs: A) -> list[TensorType]:
    n = _check_scan(*ins[1:7])
    x = ins[1]
    _check_tail("selective_scan_state", ins, 6, x.shape[0], ins[0], (x.shape[2], n))
    return [ins[0], x]


@op("gated_delta_rule", ("q", "k", "v", "g", "beta"), kernel=_delta_kernel, flops=_delta_flops,
    doc="a linear-attention layer's gated delta rule over the sequence from a zero state: q, k [b,S,H,K], "
        "v [b,S,H,V], g [b,S,H] or [b,S,H,K] (log decay), beta [b,S,H]; o [b,S,H,V]" + _RECURRENT_DOC)
def _gated_delta_rule(ins: T, attrs: A) -> list[TensorType]:
    _check_delta(*ins)
    q, v = ins[0], ins[2]
    return [TensorType(q.shape[:3] + (v.shape[3],), v.dtype)]


def _delta_state_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    return _stateful(xs, 5, _delta, out=2)


@op("gated_delta_rule_state", ("state", "q", "k", "v", "g", "beta", "last?", "slot?"), kernel=_delta_state_kernel,
    flops=_delta_flops, inplace=0,
    doc="gated_delta_rule over a state [slots,H,K,V] (updated in place; output 0), from zeros with last (prefill) "
        "or from each sequence's state (decode), as selective_scan_state; o [b,S,H,V] is output 1" + _RECURRENT_DOC)
def _gated_delta_rule_state(ins: T, attrs: A) -> list[TensorType]:
    q, v = ins[1], ins[3]
    _check_delta(*ins[1:6])
    _check_tail("gated_delta_rule_state", ins, 5, q.shape[0], ins[0], (q.shape[2], q.shape[3], v.shape[3]))
    return [ins[0], TensorType(q.shape[:3] + (v.shape[3],), v.dtype)]


# -- RWKV's WKV: a decayed, normalised sum over the past, with a bonus for the current token ------

def _wkv(h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
         last: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV over S tokens from h [b,3,C] (numerator, denominator, the running max of their
    exponents); returns (y [b,S,C], the kept state)."""
    k, v, w, u = k.float(), v.float(), w.float(), u.float()
    num, den, mx = (t.clone() for t in h.float().unbind(1))
    ys, kept = [], h.float()
    for s in range(k.shape[1]):
        kt, vt = k[:, s], v[:, s]
        m = torch.maximum(mx, kt + u)
        e1, e2 = torch.exp(mx - m), torch.exp(kt + u - m)
        ys.append((e1 * num + e2 * vt) / (e1 * den + e2))
        m = torch.maximum(mx + w, kt)
        e1, e2 = torch.exp(mx + w - m), torch.exp(kt - m)
        num, den, mx = e1 * num + e2 * vt, e1 * den + e2, m
        if s == last:
            kept = torch.stack([num, den, mx], 1)
    return torch.stack(ys, 1), (torch.stack([num, den, mx], 1) if last is None else kept)


# The state before any token: no numerator or denominator, an exponent far below any key's
WKV_EMPTY_MAX = -1e38


def _wkv_empty(b: int, c: int) -> torch.Tensor:
    h = torch.zeros((b, 3, c), dtype=torch.float32)
    h[:, 2] = WKV_EMPTY_MAX
    return h


def _wkv_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    k = xs[0]
    return _wkv(_wkv_empty(k.shape[0], k.shape[2]), xs[0], xs[1], xs[2], xs[3], None)[0].to(xs[1].dtype)


def _wkv_state_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    return _stateful(xs, 4, _wkv, out=1, empty=lambda shape: _wkv_empty(shape[0], shape[2]))


def _check_wkv(k: TensorType, v: TensorType, w: TensorType, u: TensorType) -> None:
    if k.rank != 3 or v.shape != k.shape or w.shape != (k.shape[2],) or u.shape != w.shape \
            or not all(t.dtype.is_float for t in (k, v, w, u)):
        raise ShapeError(f"wkv k {k}, v {v}, w {w}, u {u} do not fit: k and v [b,S,C], w and u [C]")


@op("wkv", ("k", "v", "w", "u"), kernel=_wkv_kernel, flops=lambda i, o, a: 20 * i[0].numel,
    doc="RWKV's WKV over the sequence from an empty state: k, v [b,S,C], w [C] (the decay, -exp(time_decay)), "
        "u [C] (the current token's bonus, time_first); y [b,S,C]" + _RECURRENT_DOC)
def _wkv_infer(ins: T, attrs: A) -> list[TensorType]:
    _check_wkv(*ins)
    return [ins[1]]


@op("wkv_state", ("state", "k", "v", "w", "u", "last?", "slot?"), kernel=_wkv_state_kernel,
    flops=lambda i, o, a: 20 * i[1].numel, inplace=0,
    doc="wkv over a state [slots,3,C] (numerator, denominator, max exponent; updated in place, output 0), from "
        "an empty state with last (prefill) or from each sequence's (decode), as selective_scan_state; y is "
        "output 1" + _RECURRENT_DOC)
def _wkv_state_infer(ins: T, attrs: A) -> list[TensorType]:
    k = ins[1]
    _check_wkv(*ins[1:5])
    _check_tail("wkv_state", ins, 4, k.shape[0], ins[0], (3, k.shape[2]))
    return [ins[0], ins[2]]


# -- a diagonal linear recurrence: RG-LRU's (RecurrentGemma, Griffin) ----------------------------

def _linear(h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, last: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = a h + x over S tokens from h [b,C]; y is every h; returns (y, the kept state)."""
    x, a = x.float(), a.float()
    h = h.float().clone()
    ys, kept = [], h
    for s in range(x.shape[1]):
        h = a[:, s] * h + x[:, s]
        ys.append(h)
        if s == last:
            kept = h
    return torch.stack(ys, 1), (h if last is None else kept)


def _linear_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    x = xs[0]
    return _linear(torch.zeros((x.shape[0], x.shape[2]), dtype=torch.float32), xs[0], xs[1], None)[0].to(x.dtype)


def _linear_state_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    return _stateful(xs, 2, _linear)


def _check_linear(x: TensorType, a: TensorType) -> None:
    if x.rank != 3 or a.shape != x.shape or not x.dtype.is_float or not a.dtype.is_float:
        raise ShapeError(f"linear_recurrence x {x}, a {a} do not fit: both [b,S,C]")


@op("linear_recurrence", ("x", "a"), kernel=_linear_kernel, flops=lambda i, o, a: 2 * i[0].numel,
    doc="a diagonal linear recurrence over the sequence from zeros (RG-LRU's): h = a h + x, y = h; x, a [b,S,C]"
        + _RECURRENT_DOC)
def _linear_infer(ins: T, attrs: A) -> list[TensorType]:
    _check_linear(*ins)
    return [ins[0]]


@op("linear_recurrence_state", ("state", "x", "a", "last?", "slot?"), kernel=_linear_state_kernel,
    flops=lambda i, o, a: 2 * i[1].numel, inplace=0,
    doc="linear_recurrence over a state [slots,C] (updated in place, output 0), from zeros with last (prefill) or "
        "from each sequence's (decode), as selective_scan_state; y is output 1" + _RECURRENT_DOC)
def _linear_state_infer(ins: T, attrs: A) -> list[TensorType]:
    x = ins[1]
    _check_linear(*ins[1:3])
    _check_tail("linear_recurrence_state", ins, 2, x.shape[0], ins[0], (x.shape[2],))
    return [ins[0], x]


# -- decayed linear attention: MiniMax's lightning attention ----------------------------------------

def _lin_attn(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              last: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _delta(h, q, k, v, g, None, last)


def _lin_attn_kernel(xs: list[torch.Tensor], a: A) -> torch.Tensor:
    q, v = xs[0], xs[2]
    h = torch.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)
    return _lin_attn(h, xs[0], xs[1], xs[2], xs[3], None)[0].to(v.dtype)


def _lin_attn_state_kernel(xs: list[torch.Tensor], a: A) -> list[torch.Tensor]:
    return _stateful(xs, 4, _lin_attn, out=2)


def _check_lin_attn(q: TensorType, k: TensorType, v: TensorType, g: TensorType) -> None:
    if not (q.rank == 4 and k.shape == q.shape and v.rank == 4 and v.shape[:3] == q.shape[:3]
            and g.shape == q.shape[:3] and all(t.dtype.is_float for t in (q, k, v, g))):
        raise ShapeError(f"linear_attention q {q}, k {k}, v {v}, g {g} do not fit: q and k [b,S,H,K], v [b,S,H,V], "
                         "g [b,S,H]")


def _lin_attn_flops(ins: T, outs: T, attrs: A) -> int:
    at = 1 if len(ins) > 4 else 0
    return 4 * ins[at].numel * ins[at + 2].shape[3]


@op("linear_attention", ("q", "k", "v", "g"), kernel=_lin_attn_kernel, flops=_lin_attn_flops,
    doc="decayed linear attention over the sequence from a zero state (MiniMax's lightning attention): "
        "h = exp(g) h + k v^T, o = q^T h; q, k [b,S,H,K], v [b,S,H,V], g [b,S,H]" + _RECURRENT_DOC)
def _lin_attn_infer(ins: T, attrs: A) -> list[TensorType]:
    _check_lin_attn(*ins)
    q, v = ins[0], ins[2]
    return [TensorType(q.shape[:3] + (v.shape[3],), v.dtype)]


@op("linear_attention_state", ("state", "q", "k", "v", "g", "last?", "slot?"), kernel=_lin_attn_state_kernel,
    flops=_lin_attn_flops, inplace=0,
    doc="linear_attention over a state [slots,H,K,V] (updated in place, output 0), from zeros with last (prefill) "
        "or from each sequence's (decode), as selective_scan_state; o is output 1" + _RECURRENT_DOC)
def _lin_attn_state_infer(ins: T, attrs: A) -> list[TensorType]:
    q, v = ins[1], ins[3]
    _check_lin_attn(*ins[1:5])
    _check_tail("linear_attention_state", ins, 4, q.shape[0], ins[0], (q.shape[2], q.shape[3], v.shape[3]))
    return [ins[0], TensorType(q.shape[:3] + (v.shape[3],), v.dtype)]
