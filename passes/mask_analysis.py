"""An attention mask's window, read without materialising it: what lets a prompt of any
length (131,072 positions and more) compile with its causal mask recognised.

A model traced at S query and L key positions builds its mask [.., S, L] from small
constants: an arange of query positions [.., S, 1], one of key positions [.., 1, L], a
scalar window, and broadcasting compares, ands, wheres between them. Evaluated, that is S x L
values (16 GiB of bools at 131,072); folded, a constant of that size. Reasoned about, it is
a function of one number:

    %q : i64[1,1,S,1] = 0, 1, .. S-1          i            (affine in the query index)
    %k : i64[1,1,1,L] = 0, 1, .. L-1          j            (affine in the key index)
    %c = le(%k, %q)                           j - i <= 0   (a function of d = j - i)
    %w = gt(%k, sub(%q, 4096))                j - i > -4096
    %m = bitwise_and(%c, %w)                  the band -4096 < d <= 0

Each value of the mask's cone is tracked as an affine form a*i + b*j + c (exact integers:
the leaves are checked to be aranges, in O(S + L)) or, once forms of i and j meet, as a
tensor over the S + L - 1 diagonals d = j - i. That is exact when every form that meets
another depends on d alone (b = -a): the mask is then constant along each diagonal (a
Toeplitz matrix), and its S + L - 1 values decide causal or window as the full matrix
would (`attention_fusion.mask_window`). A compare of forms that is not of d is decided where
its sign is the same over the whole S x L box (a linear form's extremes are at the box's
corners): `new_ones`-style padding masks and packed-sequence ids that are all equal.

Anything else (an input-dependent mask, a form of i alone that does not fold away, an op not
listed here) is not decided: `mask_window_of` says UNKNOWN and the caller evaluates the mask
where it is small enough, else refuses or warns as before."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from npuc.ir import DType, Value
from npuc.ir.evaluate import reads_inputs
from npuc.ir.registry import get_op

UNKNOWN = "unknown"  # mask_window_of could not decide (not a verdict on the mask)

# Ops evaluated over the diagonals with their reference kernels: elementwise, broadcasting.
_ELEMENTWISE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or", "bitwise_xor",
                          "bitwise_not", "logical_not", "where", "add", "sub", "mul", "neg", "maximum",
                          "minimum", "cast", "abs", "is_inf", "is_nan"})
_COMPARES = {"eq", "ne", "lt", "le", "gt", "ge"}
# Ops that only view a value (its elements keep their (i, j)).
_VIEWS = frozenset({"reshape", "expand"})
# The most bytes computed to read one leaf (an arange of 131,072 positions is 1 MiB).
_LEAF_BYTES = 1 << 28
# Integers a float dtype holds exactly (past them the graph's own arithmetic rounds, which
# the exact forms here would not).
_FLOAT_EXACT = {DType.f64: 1 << 53, DType.f32: 1 << 24, DType.f16: 1 << 11, DType.bf16: 1 << 8}
# Exact integers in float64 (and in the int64 the leaves usually are).
_EXACT = 1 << 52


@dataclass(frozen=True)
class _Affine:
    """a*i + b*j + c at query i, key j (exact; c may be +-inf for a float mask's -inf)."""
    a: Fraction
    b: Fraction
    c: float | Fraction
    dtype: DType

    def along_d(self) -> bool:
        return self.a == -self.b

    def corners(self, q_len: int, k_len: int) -> list[float | Fraction]:
        return [self.a * i + self.b * j + self.c for i in (0, q_len - 1) for j in (0, k_len - 1)]


@dataclass(frozen=True)
class _Diagonal:
    """A value that depends on d = j - i alone: t[d + q_len - 1] for d in -(q_len-1) .. k_len-1."""
    t: torch.Tensor


class _Undecided(Exception):
    pass


def mask_window_of(mask: Value, q_len: int, k_len: int) -> int | None | str:
    """A mask's window as `attention_fusion.mask_window` reads it from the values (0 causal,
    w the causal band of a sliding window of w < q_len keys, None another mask), decided from
    how the graph builds it in O(S + L) time and memory; UNKNOWN where that cannot be told."""
    if mask.type.rank < 2 or mask.type.shape[-2:] != (q_len, k_len) or reads_inputs(mask):
        return UNKNOWN
    try:
        v = _Reader(q_len, k_len).read(mask)
    except _Undecided:
        return UNKNOWN
    t = _diagonals(v, q_len, k_len, mask.type.dtype)
    if t.dtype == torch.bool:
        seen = t
    else:
        t = t.double()
        if not bool(((t == 0) | (t <= -1e4)).all()):
            return None  # a bias, not a mask
        seen = t == 0
    d = torch.arange(-(q_len - 1), k_len)
    if bool(seen[d > 0].any()):
        return None  # a query sees a later key
    past = seen[d <= 0]  # d = -(q_len-1) .. 0: the last row's keys, oldest first
    w = int(past.sum())
    if w == 0 or not bool(past[past.numel() - w:].all()):
        return None  # a query misses itself, or its band has holes
    return 0 if w >= q_len else w


def _diagonals(v: _Affine | _Diagonal, q_len: int, k_len: int, dtype: DType) -> torch.Tensor:
    if isinstance(v, _Diagonal):
        return v.t
    if not v.along_d():
        raise _Undecided  # unreachable for a mask's root: read() keeps only forms of d
    d = torch.arange(-(q_len - 1), k_len, dtype=torch.float64)
    return (d * float(v.b) + float(v.c)).to(dtype.torch)


class _Reader:
    def __init__(self, q_len: int, k_len: int) -> None:
        self.q_len, self.k_len = q_len, k_len
        self.memo: dict[int, _Affine | _Diagonal] = {}
        self.leaf_numel = 4 * (q_len + k_len) + 64  # what a leaf of one axis may hold

    def read(self, v: Value) -> _Affine | _Diagonal:
        if id(v) not in self.memo:
            self.memo[id(v)] = self._read(v)
        return self.memo[id(v)]

    def _read(self, v: Value) -> _Affine | _Diagonal:
        n = v.producer
        if v.const is not None or (n is not None and v.type.numel <= self.leaf_numel):
            return self._leaf(v)
        if n is None:
            raise _Undecided
        if n.op in _VIEWS:
            return self._view(v, self.read(n.inputs[0]), n.inputs[0])
        if n.op not in _ELEMENTWISE or len(n.outputs) != 1:
            raise _Undecided
        ins = [self.read(x) for x in n.inputs]
        if all(isinstance(x, _Affine) for x in ins):
            lin = self._affine(n.op, ins, v.type.dtype)  # type: ignore[arg-type]
            if isinstance(lin, _Affine):
                self._exact(lin)
            if lin is not None:
                return lin
        # Anything else is computed per diagonal: every operand must be a function of d.
        if any(isinstance(x, _Affine) and not x.along_d() for x in ins):
            raise _Undecided  # a form of i or j alone meets another value: not a function of d
        ts = [_diagonals(x, self.q_len, self.k_len, y.type.dtype) for x, y in zip(ins, n.inputs, strict=True)]
        with torch.no_grad():
            out = get_op(n.op).run(ts, n.attrs)[0]
        if out.dim() != 1 or out.numel() != self.q_len + self.k_len - 1:
            raise _Undecided
        return _Diagonal(out.to(v.type.dtype.torch))

    def _leaf(self, v: Value) -> _Affine:
        """A small constant (or a small value computed from constants): a scalar, or an
        arange along the query axis (-2) or the key axis (-1), constant along every other."""
        if v.type.numel > self.leaf_numel:
            raise _Undecided
        from npuc.ir.evaluate import evaluate_value

        t = evaluate_value(v.graph, v, max_bytes=min(64 * self.leaf_numel, _LEAF_BYTES)) if v.const is None \
            else v.const.load()
        if t is None or t.dtype.is_complex:
            raise _Undecided
        shape = tuple(t.shape)
        flat = t.reshape(-1)
        if flat.numel() == 0:
            raise _Undecided
        first = flat[0].item()
        if bool((flat == flat[0]).all()):
            return self._form(0, 0, first, v.type.dtype)
        axis = self._axis(t)
        if axis is None:
            raise _Undecided
        x = t.movedim(axis, -1).reshape(-1, shape[axis])[0].double() if t.dtype != torch.bool else None
        if x is None or not bool(torch.isfinite(x).all()) or bool((x != x.round()).any()) \
                or float(x.abs().max()) >= _EXACT:
            raise _Undecided  # not exact integers
        slope = x[1] - x[0]
        if not bool((x == x[0] + slope * torch.arange(x.numel(), dtype=torch.float64)).all()):
            raise _Undecided  # not an arange
        s = int(slope)
        form = self._form(s if axis == -2 else 0, s if axis == -1 else 0, int(x[0]), v.type.dtype)
        self._exact(form)
        return form

    def _axis(self, t: torch.Tensor) -> int | None:
        """-2 (the mask's query axis) or -1 (its key axis): the one axis `t` varies along, where
        it is as long as that axis of the mask."""
        for axis, n in ((-2, self.q_len), (-1, self.k_len)):
            if t.dim() >= -axis and t.shape[axis] == n > 1:
                line = t
                for other in range(t.dim()):
                    if other - t.dim() != axis:
                        line = line.narrow(other, 0, 1)
                if bool((t == line).all()):
                    return axis
        return None

    def _exact(self, x: _Affine) -> None:
        """A float form whose values (at the box's corners: its extremes) the dtype does not hold
        exactly is undecided: the graph would round where the form does not."""
        limit = _FLOAT_EXACT.get(x.dtype)
        if limit is not None and (x.a or x.b) and isinstance(x.c, Fraction) \
                and max(abs(float(c)) for c in x.corners(self.q_len, self.k_len)) > limit:
            raise _Undecided

    @staticmethod
    def _form(a: int, b: int, c: float | int | bool, dtype: DType) -> _Affine:
        c0: float | Fraction = Fraction(int(c)) if isinstance(c, bool) or float(c).is_integer() else float(c)
        return _Affine(Fraction(a), Fraction(b), c0, dtype)

    def _view(self, out: Value, x: _Affine | _Diagonal, src: Value) -> _Affine | _Diagonal:
        """reshape or expand of a value larger than a leaf: the same elements, so the same
        value, where the query axis (-2) and the key axis (-1) stay where they were."""
        o, s = out.type.shape, src.type.shape
        if isinstance(x, _Affine) and x.a == 0 and x.b == 0:
            return x
        if len(o) < 2 or len(s) < 2 or o[-2:] != (self.q_len, self.k_len):
            raise _Undecided
        for axis, slope in ((-2, x.a), (-1, x.b)) if isinstance(x, _Affine) else ((-2, 1), (-1, 1)):
            if slope != 0 and s[axis] != o[axis]:
                raise _Undecided  # an index moved to another axis
        return x

    def _affine(self, op: str, ins: list[_Affine], dtype: DType) -> _Affine | _Diagonal | None:
        """An op on affine operands: affine where it stays so, a compare of a form of d per
        diagonal; None: the op is computed per diagonal from its operands'."""
        if op in ("add", "sub") and dtype != DType.bool:
            x, y = ins
            sign = 1 if op == "add" else -1
            return _Affine(x.a + sign * y.a, x.b + sign * y.b, _add(x.c, y.c, sign), dtype)
        if op == "neg":
            (x,) = ins
            return _Affine(-x.a, -x.b, _add(0, x.c, -1), dtype)
        if op == "mul" and dtype != DType.bool:
            x, y = ins
            if x.a == x.b == 0 and isinstance(x.c, Fraction):
                x, y = y, x
            if y.a == y.b == 0 and isinstance(y.c, Fraction) and isinstance(x.c, Fraction):
                return _Affine(x.a * y.c, x.b * y.c, x.c * y.c, dtype)
            return None
        if op == "cast" and dtype != DType.bool and (dtype.is_float or all(isinstance(x.c, Fraction) for x in ins)):
            (x,) = ins
            return _Affine(x.a, x.b, x.c, dtype)
        if op in _COMPARES:
            x, y = ins
            if x.dtype == DType.bool or not (isinstance(x.c, Fraction) and isinstance(y.c, Fraction)):
                return None
            diff = _Affine(x.a - y.a, x.b - y.b, x.c - y.c, x.dtype)
            if diff.along_d() and diff.a != 0:  # x - y = b*d + c: compared per diagonal (exact integers)
                d = torch.arange(-(self.q_len - 1), self.k_len, dtype=torch.float64)
                t = d * float(diff.b) + float(diff.c)
                return _Diagonal(get_op(op).run([t, torch.zeros((), dtype=torch.float64)], {})[0])
            if x.a == y.a == x.b == y.b == 0:
                return None  # constants: per diagonal, with the kernel
            signs = {_compare(op, c) for c in diff.corners(self.q_len, self.k_len)}
            if op in ("eq", "ne") and (diff.a != 0 or diff.b != 0):
                values = diff.corners(self.q_len, self.k_len)
                if min(values) > 0 or max(values) < 0:  # never zero in the box
                    return self._form(0, 0, op == "ne", DType.bool)
                raise _Undecided
            if len(signs) == 1:  # the same at every corner, so in the whole box (linear)
                return self._form(0, 0, signs.pop(), DType.bool)
            raise _Undecided
        return None


def _add(x: float | Fraction, y: float | Fraction, sign: int) -> float | Fraction:
    if isinstance(x, Fraction) and isinstance(y, Fraction):
        return x + sign * y
    return float(x) + sign * float(y)


def _compare(op: str, diff: float | Fraction) -> bool:
    return {"eq": diff == 0, "ne": diff != 0, "lt": diff < 0, "le": diff <= 0, "gt": diff > 0,
            "ge": diff >= 0}[op]
