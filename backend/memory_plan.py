"""Static memory planning: place buffers with known lifetimes in one arena.

The model (as in ExecuTorch's memory planning) separates *lifetimes* from
*placement*. Some earlier pass turns the schedule into `Buffer`s: a byte size
and the inclusive range of schedule steps over which the buffer is live. This
module knows nothing about graphs or tensors; it only assigns every buffer an
aligned byte offset so that two buffers live at the same step never share a
byte, and tries to keep the arena small.

Placement is greedy-by-size best-fit (Pisarchyk & Lee, 2020): buffers are taken
largest first and each goes into the tightest gap left between the already
placed buffers whose lifetimes overlap its own, or above them all. If that does
not reach the lower bound (the peak of live bytes over all steps, which no
placement can beat) a few other deterministic orders are tried and the smallest
arena wins. Everything is deterministic: same buffers, same plan.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from npuc.errors import InternalError

__all__ = ["Buffer", "Plan", "align_up", "lower_bound", "plan_memory", "validate_plan"]


@dataclass(frozen=True)
class Buffer:
    """`size` bytes, live over schedule steps `start..end` inclusive."""

    id: int
    size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        # Buffers come from our own lowering passes, so a bad one is our bug.
        if self.size <= 0:
            raise InternalError(f"buffer {self.id}: size must be > 0, got {self.size}")
        if self.start > self.end:
            raise InternalError(f"buffer {self.id}: start {self.start} is after end {self.end}")


@dataclass(frozen=True)
class Plan:
    """Offsets (as `(id, offset)` pairs sorted by id, so the plan is hashable) and arena size."""

    offsets: tuple[tuple[int, int], ...]
    arena_bytes: int
    lower_bound: int
    alignment: int
    _index: Mapping[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", MappingProxyType(dict(self.offsets)))

    def offset(self, id: int) -> int:
        """Byte offset of buffer `id` within the arena."""
        try:
            return self._index[id]
        except KeyError:
            raise InternalError(f"memory plan has no offset for buffer {id}") from None

    def as_dict(self) -> Mapping[int, int]:
        """Read-only id -> offset mapping."""
        return self._index


def align_up(n: int, a: int) -> int:
    """Smallest multiple of `a` that is >= `n`."""
    if a <= 0:
        raise InternalError(f"alignment must be > 0, got {a}")
    return -(-n // a) * a


def _check_inputs(buffers: Sequence[Buffer], alignment: int) -> None:
    if alignment <= 0:
        raise InternalError(f"alignment must be > 0, got {alignment}")
    seen: set[int] = set()
    for b in buffers:
        if b.id in seen:
            raise InternalError(f"buffer id {b.id} appears more than once")
        seen.add(b.id)


def lower_bound(buffers: Sequence[Buffer], alignment: int) -> int:
    """Peak over steps of the aligned bytes live at that step: no plan can be smaller."""
    events: list[tuple[int, int]] = []
    for b in buffers:
        sz = align_up(b.size, alignment)
        events.append((b.start, sz))
        events.append((b.end + 1, -sz))
    # At equal times the negative (freeing) deltas sort first: a buffer ending at
    # step t-1 is not live at step t.
    events.sort()
    live = peak = 0
    for _, delta in events:
        live += delta
        if live > peak:
            peak = live
    return peak


class _IntervalTree:
    """Static centered interval tree over buffer indices: overlap queries in O(log n + k)."""

    __slots__ = ("_root",)

    def __init__(self, starts: Sequence[int], ends: Sequence[int]) -> None:
        self._root = self._build(list(range(len(starts))), starts, ends)

    @classmethod
    def _build(cls, items: list[int], starts: Sequence[int], ends: Sequence[int]) -> tuple | None:
        if not items:
            return None
        points = sorted([starts[i] for i in items] + [ends[i] for i in items])
        center = points[len(points) // 2]
        left: list[int] = []
        right: list[int] = []
        here: list[int] = []
        for i in items:
            if ends[i] < center:
                left.append(i)
            elif starts[i] > center:
                right.append(i)
            else:
                here.append(i)
        # `here` is never empty (the median endpoint belongs to some interval
        # containing it), so both halves shrink and the recursion terminates.
        by_start = sorted(here, key=lambda i: starts[i])
        by_end = sorted(here, key=lambda i: -ends[i])
        return (
            center,
            by_start,
            [starts[i] for i in by_start],
            by_end,
            [-ends[i] for i in by_end],
            cls._build(left, starts, ends),
            cls._build(right, starts, ends),
        )

    def overlapping(self, s: int, e: int) -> Iterator[int]:
        """Indices of intervals intersecting [s, e] (inclusive), each once."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            center, by_start, start_keys, by_end, neg_end_keys, left, right = node
            if e < center:
                # Node intervals all reach `center` > e; they overlap iff start <= e.
                yield from by_start[: bisect_right(start_keys, e)]
                stack.append(left)
            elif s > center:
                # Node intervals all start at or before `center` < s; overlap iff end >= s.
                yield from by_end[: bisect_right(neg_end_keys, -s)]
                stack.append(right)
            else:
                yield from by_start
                stack.append(left)
                stack.append(right)


def _place(
    order: Sequence[int], sizes: Sequence[int], tree: _IntervalTree, starts: Sequence[int], ends: Sequence[int]
) -> tuple[list[int], int]:
    """Best-fit placement of buffers in `order`; returns (offset per index, arena bytes)."""
    offsets = [-1] * len(sizes)
    arena = 0
    for i in order:
        need = sizes[i]
        occupied = sorted(
            (offsets[j], offsets[j] + sizes[j]) for j in tree.overlapping(starts[i], ends[i]) if offsets[j] >= 0
        )
        cursor = 0
        best = -1
        best_gap = 0
        for lo, hi in occupied:
            gap = lo - cursor
            if gap >= need and (best < 0 or gap < best_gap):
                best, best_gap = cursor, gap
                if gap == need:
                    break  # a perfect fit cannot be beaten, and this is the lowest one
            if hi > cursor:
                cursor = hi
        # No gap fits: go above every overlapping buffer (not above the whole
        # arena; non-overlapping buffers up there are no obstacle).
        at = best if best >= 0 else cursor
        offsets[i] = at
        if at + need > arena:
            arena = at + need
    return offsets, arena


def _local_search(order: list[int], offsets: list[int], arena: int, bound: int, sizes: Sequence[int],
                  tree: _IntervalTree, starts: Sequence[int], ends: Sequence[int]) -> tuple[list[int], int]:
    """Iterated greedy over placement orders: move a buffer that touches the top of the
    arena earlier in the order, re-place, keep the result when it is no worse. Bounded
    in evaluations (fewer for bigger graphs) and seeded, so plans stay deterministic."""
    rng = random.Random(0x6E707563)
    n = len(order)
    for _ in range(max(8, min(2000, 100_000 // max(n, 1)))):
        if arena <= bound:
            break
        tops = [i for i in range(n) if offsets[i] + sizes[i] == arena]
        cand = list(order)
        if rng.random() < 0.7:
            i = rng.choice(tops)
            cand.remove(i)
            cand.insert(rng.randrange(0, order.index(i) + 1), i)
        else:
            a, b = rng.randrange(n), rng.randrange(n)
            cand[a], cand[b] = cand[b], cand[a]
        new_offsets, new_arena = _place(cand, sizes, tree, starts, ends)
        if new_arena <= arena:
            order, offsets, arena = cand, new_offsets, new_arena
    return offsets, arena


def plan_memory(buffers: Sequence[Buffer], alignment: int) -> Plan:
    """Assign every buffer an aligned offset; smallest arena over a few greedy orders."""
    _check_inputs(buffers, alignment)
    bound = lower_bound(buffers, alignment)
    if not buffers:
        return Plan(offsets=(), arena_bytes=0, lower_bound=0, alignment=alignment)

    # All sizes are rounded up to the alignment, and every placement is at a sum
    # of such sizes, so every offset is aligned without further rounding.
    sizes = [align_up(b.size, alignment) for b in buffers]
    starts = [b.start for b in buffers]
    ends = [b.end for b in buffers]
    ids = [b.id for b in buffers]
    tree = _IntervalTree(starts, ends)

    def duration(i: int) -> int:
        return ends[i] - starts[i] + 1

    # Orders tried in turn; ties always end on the id so the result does not
    # depend on the order the caller listed the buffers in.
    # The busiest step: buffers live there are stacked first, so that step meets the bound.
    events = sorted([(starts[i], sizes[i]) for i in range(len(buffers))] +
                    [(ends[i] + 1, -sizes[i]) for i in range(len(buffers))])
    live, peak, peak_t = 0, -1, 0
    for t, delta in events:
        live += delta
        if live > peak:
            peak, peak_t = live, t
    at_peak = [starts[i] <= peak_t <= ends[i] for i in range(len(buffers))]
    keys: list[Callable[[int], tuple[int, ...]]] = [
        lambda i: (-sizes[i], -duration(i), ids[i]),  # greedy by size
        lambda i: (not at_peak[i], -duration(i), -sizes[i], ids[i]),  # the peak step first
        lambda i: (starts[i], -sizes[i], -duration(i), ids[i]),  # by start time
        lambda i: (-sizes[i] * duration(i), -sizes[i], ids[i]),  # by area (bytes x steps)
    ]
    best_offsets: list[int] = []
    best_order: list[int] = []
    best_arena = -1
    for key in keys:
        order = sorted(range(len(buffers)), key=key)
        offsets, arena = _place(order, sizes, tree, starts, ends)
        if best_arena < 0 or arena < best_arena:
            best_offsets, best_arena, best_order = offsets, arena, order
        if best_arena <= bound:
            break
    if best_arena > bound:
        best_offsets, best_arena = _local_search(best_order, best_offsets, best_arena, bound, sizes, tree, starts,
                                                 ends)
    return Plan(
        offsets=tuple(sorted(zip(ids, best_offsets, strict=True))),
        arena_bytes=best_arena,
        lower_bound=bound,
        alignment=alignment,
    )


def validate_plan(buffers: Sequence[Buffer], plan: Plan) -> None:
    """Raise InternalError unless `plan` is a correct placement of `buffers`."""
    a = plan.alignment
    _check_inputs(buffers, a)
    placed = plan.as_dict()
    if len(placed) != len(plan.offsets):
        raise InternalError("memory plan lists some buffer id more than once")
    known = {b.id for b in buffers}
    extra = sorted(set(placed) - known)
    if extra:
        raise InternalError(f"memory plan has offsets for unknown buffers {extra[:5]}")

    top = 0
    for b in buffers:
        if b.id not in placed:
            raise InternalError(f"memory plan has no offset for buffer {b.id}")
        off = placed[b.id]
        if off < 0 or off % a:
            raise InternalError(f"buffer {b.id}: offset {off} is not a non-negative multiple of alignment {a}")
        top = max(top, off + align_up(b.size, a))

    # Sweep in start order; every buffer still active when another starts
    # overlaps it in time, so only those pairs need a space check.
    active: list[tuple[int, int, Buffer]] = []  # (end, id, buffer) heap
    for b in sorted(buffers, key=lambda b: (b.start, b.id)):
        while active and active[0][0] < b.start:
            heapq.heappop(active)
        lo = placed[b.id]
        hi = lo + align_up(b.size, a)
        for _, _, o in active:
            olo = placed[o.id]
            ohi = olo + align_up(o.size, a)
            if lo < ohi and olo < hi:
                raise InternalError(
                    f"buffers {o.id} (steps {o.start}..{o.end}, bytes {olo}..{ohi}) and "
                    f"{b.id} (steps {b.start}..{b.end}, bytes {lo}..{hi}) overlap in time and space"
                )
        heapq.heappush(active, (b.end, b.id, b))

    if plan.arena_bytes != top:
        raise InternalError(f"memory plan arena_bytes is {plan.arena_bytes} but its buffers end at {top}")
    bound = lower_bound(buffers, a)
    if plan.lower_bound != bound:
        raise InternalError(f"memory plan records lower bound {plan.lower_bound}, actual is {bound}")
    if plan.arena_bytes < bound:
        raise InternalError(f"memory plan arena {plan.arena_bytes} is below the lower bound {bound}")
