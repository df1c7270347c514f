"""Static memory planning: place buffers with known lifetimes in one arena.

The model (as in ExecuTorch's memory planning) separates *lifetimes* from
*placement*. Some earlier pass turns the schedule into `Buffer`s: a byte size
and the inclusive range of schedule steps over which the buffer is live. This
module knows nothing about graphs or tensors; it only assigns every buffer an
aligned byte offset so that two buffers live at the same step never share a
byte, and tries to keep the arena small.

No arena can be smaller than the lower bound LB: the peak over steps of the
aligned bytes live at once. Placement runs in up to three stages, each only
when the ones before it missed LB:

1. Greedy best-fit (Pisarchyk & Lee, 2020) over a few orders (largest first,
   the peak step first, by start, by area): each buffer goes into the tightest
   gap between the placed buffers whose lifetimes overlap its own, or above
   them all. Cheap, and enough for most schedules.
2. Exact branch and bound after MiniMalloc (Moffitt, 2023), see `_Search`:
   buffers are placed in nondecreasing offset order, each at the lowest offset
   its placed neighbours leave; pruned by per-step capacity, a dominance rule,
   and splitting the schedule wherever no unplaced buffer spans a step
   boundary (transformer layers then come apart). It first asks for LB, which
   real schedules usually reach; if it proves LB impossible it tightens the
   best plan so far one step at a time, so a search that finishes is optimal.
3. If the search ran out of work: iterated greedy over placement orders.

Searches are bounded by counted work, never by the clock, and ties are broken
by buffer id: the same buffers (in any order) always give the same plan.
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import gcd
from types import MappingProxyType
from typing import TypeAlias

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


def _local_search(order: list[int], offsets: list[int], arena: int, bound: int, iterations: int,
                  sizes: Sequence[int], tree: _IntervalTree, starts: Sequence[int],
                  ends: Sequence[int]) -> tuple[list[int], int]:
    """Iterated greedy over placement orders: move a buffer that touches the top of the
    arena earlier in the order, re-place, keep the result when it is no worse. Bounded
    in evaluations and seeded, so plans stay deterministic."""
    rng = random.Random(0x6E707563)
    n = len(order)
    for _ in range(iterations):
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


# --- exact search ---------------------------------------------------------------

_FOUND, _INFEASIBLE, _ABORTED = 0, 1, 2

# A search step is a generator that yields the sub-searches it needs and gets
# their status back; `_drive` runs them on an explicit stack, so the search
# depth (one level per placed buffer) is not bounded by Python's recursion limit.
_Task: TypeAlias = Generator["_Task", int, int]


def _drive(task: _Task) -> int:
    """Run `task` and the sub-tasks it yields to completion; return its status."""
    stack = [task]
    result = 0
    sent = False
    while stack:
        try:
            sub = stack[-1].send(result) if sent else next(stack[-1])
        except StopIteration as stop:
            stack.pop()
            result, sent = stop.value, True
            continue
        stack.append(sub)
        sent = False
    return result


class _Sections:
    """The instance cut into sections (as in MiniMalloc, Moffitt 2023): the maximal sets of
    buffers live at one step. Two buffers overlap in time iff they share a section, and
    the lower bound is the largest section total, so steps inside a section add nothing."""

    def __init__(self, sizes: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                 tree: _IntervalTree) -> None:
        n = len(sizes)
        points = sorted(set(starts))
        ends_sorted = sorted(ends)
        # A start step is a section unless everything live there is still live at the
        # next start step (no end falls in between), which makes it a subset of that one.
        keep = [p for k, p in enumerate(points)
                if k + 1 == len(points) or bisect_left(ends_sorted, p) < bisect_left(ends_sorted, points[k + 1])]
        self.sizes = sizes
        self.lo = [bisect_left(keep, s) for s in starts]  # sections of i: lo[i] <= s < hi[i]
        self.hi = [bisect_right(keep, e) for e in ends]
        self.count = len(keep)
        self.members: list[list[int]] = [[] for _ in keep]
        for i in range(n):
            for s in range(self.lo[i], self.hi[i]):
                self.members[s].append(i)
        self.overlaps = [[j for j in tree.overlapping(starts[i], ends[i]) if j != i] for i in range(n)]
        self.totals = [sum(sizes[i] for i in m) for m in self.members]
        # cuts[s]: buffers spanning sections s and s + 1 (a difference array summed up).
        self.cuts = [0] * self.count
        for i in range(n):
            self.cuts[self.lo[i]] += 1
            self.cuts[self.hi[i] - 1] -= 1
        for s in range(1, self.count):
            self.cuts[s] += self.cuts[s - 1]

    def ranks(self, keys: str) -> list[int]:
        """Static preorder position of every buffer; `keys` letters, each descending:
        A area (bytes x sections), W width (sections), T largest section total."""
        lo, hi, sizes, totals = self.lo, self.hi, self.sizes, self.totals
        n = len(sizes)
        value = {
            "A": [sizes[i] * (hi[i] - lo[i]) for i in range(n)],
            "W": [hi[i] - lo[i] for i in range(n)],
            "T": [max(totals[lo[i]:hi[i]]) for i in range(n)],
        }
        order = sorted(range(n), key=lambda i: (*(-value[k][i] for k in keys), i))
        rank = [0] * n
        for r, i in enumerate(order):
            rank[i] = r
        return rank


class _Search:
    """Depth-first search for a placement with every buffer below `cap` (after MiniMalloc).

    Canonical solutions only: buffers are placed in nondecreasing (offset, rank) order,
    each at the lowest offset clear of the buffers placed before it. If any placement
    fits under `cap`, the one with the smallest offset sum has this form (every buffer
    rests on the floor or on a lower buffer, which comes before it) and survives every
    prune below, so a search that finishes is exact. The prunes:
    - a section cannot fit if its floor (the highest placed top there, or the lowest
      offset any unplaced member can still take) plus its unplaced bytes exceed `cap`;
      nor if the current offset plus those bytes do (later offsets are not lower);
    - a buffer is not placed at or above the top some unplaced buffer would have at its
      own lowest offset: that one could drop below it, lowering the offset sum;
    - once no unplaced buffer spans a boundary between two sections, the two sides are
      solved on their own (and a failure on one side does not retry the other).
    Work is counted in list items touched; `budget` bounds it, so results never depend on
    the clock."""

    def __init__(self, sec: _Sections, cap: int, rank: list[int], budget: int) -> None:
        n = len(sec.sizes)
        self.sec, self.cap, self.rank, self.budget = sec, cap, rank, budget
        self.offsets = [-1] * n  # current partial placement
        self.solution = [-1] * n  # last offset given to each buffer on the way to a leaf
        self.min_offset = [0] * n
        self.floor = [0] * sec.count
        self.total = list(sec.totals)
        self.cuts = list(sec.cuts)  # counting unplaced buffers only

    def run(self) -> int:
        n = len(self.sec.sizes)
        cuts = [s + 1 for s in range(self.sec.count - 1) if self.cuts[s] == 0]
        return _drive(self._split(sorted(range(n), key=self.rank.__getitem__), 0, self.sec.count, cuts))

    def _split(self, part: list[int], slo: int, shi: int, cuts: list[int]) -> _Task:
        """Solve the unplaced buffers of `part` (in rank order) as independent pieces
        between the section boundaries `cuts` (sorted, inside slo..shi)."""
        bounds = [slo, *cuts, shi]
        groups: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
        lo = self.sec.lo
        for i in part:
            if self.offsets[i] < 0:
                groups[bisect_right(bounds, lo[i]) - 1].append(i)
        for k, group in enumerate(groups):
            if group:
                status = yield self._place(group, bounds[k], bounds[k + 1], -1, -1)
                if status != _FOUND:
                    return status
        return _FOUND

    def _place(self, part: list[int], slo: int, shi: int, last_offset: int, last_rank: int) -> _Task:
        """Place the unplaced buffers of `part` (within sections slo..shi) canonically
        after one at `last_offset` with rank `last_rank`."""
        offsets, min_offset, rank = self.offsets, self.min_offset, self.rank
        order = [i for i in part if offsets[i] < 0]
        self.budget -= len(order) + shi - slo
        if self.budget < 0:
            return _ABORTED
        if not order:
            return _FOUND
        sec, cap, floor, total, cuts = self.sec, self.cap, self.floor, self.total, self.cuts
        sizes, lo, hi, members = sec.sizes, sec.lo, sec.hi, sec.members
        order.sort(key=min_offset.__getitem__)  # stable: rank breaks ties
        min_top = min(min_offset[i] + sizes[i] for i in order)
        for i in order:
            at = min_offset[i]
            if at >= min_top:
                break  # dominated, and so is every later one (offsets only grow)
            if at < last_offset or (at == last_offset and rank[i] < last_rank):
                continue  # not canonical
            top = at + sizes[i]
            if top > cap:
                continue
            offsets[i] = self.solution[i] = at
            # Undo logs: (index, old value).
            offset_log: list[tuple[int, int]] = []
            floor_log: list[tuple[int, int]] = []
            touched: set[int] = set()
            for j in sec.overlaps[i]:
                if offsets[j] < 0 and min_offset[j] < top:
                    offset_log.append((j, min_offset[j]))
                    min_offset[j] = top
                    touched.update(range(lo[j], hi[j]))
            for s in range(lo[i], hi[i]):
                floor_log.append((s, floor[s]))
                floor[s] = max(floor[s], top)
                total[s] -= sizes[i]
            work = len(sec.overlaps[i]) + len(touched)
            for s in touched:
                if total[s]:
                    work += len(members[s])
                    lowest = min(min_offset[j] for j in members[s] if offsets[j] < 0)
                    if floor[s] < lowest:
                        floor_log.append((s, floor[s]))
                        floor[s] = lowest
            self.budget -= work
            status = _INFEASIBLE
            if at + max(total[slo:shi]) <= cap and all(floor[s] + total[s] <= cap for s, _ in floor_log):
                new_cuts = []
                for s in range(lo[i], hi[i] - 1):
                    cuts[s] -= 1
                    if cuts[s] == 0 and slo <= s < shi - 1:
                        new_cuts.append(s + 1)
                if new_cuts:
                    status = yield self._split(part, slo, shi, new_cuts)
                else:
                    status = yield self._place(part, slo, shi, at, rank[i])
                for s in range(lo[i], hi[i] - 1):
                    cuts[s] += 1
            for s, old in reversed(floor_log):
                floor[s] = old
            for s in range(lo[i], hi[i]):
                total[s] += sizes[i]
            for j, old in reversed(offset_log):
                min_offset[j] = old
            offsets[i] = -1
            if status != _INFEASIBLE:
                return status
        return _INFEASIBLE


# Static preorders tried in turn (MiniMalloc's round robin); area first did best on
# our transformer schedules, the others rescue the odd instance it gets stuck on.
_PREORDERS = ("AWT", "WAT", "TAW")


def _exact(sec: _Sections, cap: int, budget: int) -> tuple[int, list[int], int]:
    """(status, offsets if found, work spent) for arena <= cap. Preorders take turns
    with a doubling work limit, so an easy instance is not stuck behind a bad order."""
    ranks = [sec.ranks(keys) for keys in _PREORDERS]
    limit = len(sec.sizes) + sec.count
    spent = 0
    while True:
        limit *= 2
        for rank in ranks:
            chunk = min(limit, budget - spent)
            search = _Search(sec, cap, rank, chunk)
            status = search.run()
            spent += chunk - max(search.budget, 0)
            if status != _ABORTED:
                return status, search.solution, spent
            if spent >= budget:
                return _ABORTED, [], spent


# Work (list items touched, see `_Search`) allowed to the exact search per plan, plus
# some per buffer: a search that succeeds on a transformer needs about 100 work per
# buffer for one preorder, and the round robin can spend about four times that. A
# million is roughly 0.2 s of CPU.
_EXACT_WORK = 1_000_000
_EXACT_WORK_PER_BUFFER = 500
# Overlapping pairs visited by the iterated greedy (about a quarter of a second).
_LOCAL_WORK = 1_000_000


def _improve(sec: _Sections, bound: int, offsets: list[int], arena: int) -> tuple[list[int], int, int]:
    """Exact search from a greedy plan: (offsets, arena, proven lower bound on the optimum).

    First asks for the lower bound itself, which real schedules usually reach; if that
    is proven impossible, asks for one step below the incumbent until a search fails
    (the incumbent is then optimal) or the work budget runs out."""
    sizes = sec.sizes
    step = 0
    for s in sizes:
        step = gcd(step, s)  # every offset and arena is a sum of sizes, so a multiple of this
    proven = bound
    budget = _EXACT_WORK + _EXACT_WORK_PER_BUFFER * len(sizes)
    spent = 0
    cap = bound
    while cap >= proven and spent < budget:
        status, found, used = _exact(sec, cap, budget - spent)
        spent += used
        if status == _ABORTED:
            break
        if status == _FOUND:
            offsets = found
            arena = max(o + s for o, s in zip(found, sizes, strict=True))
        else:
            proven = cap + step
        cap = arena - step
    return offsets, arena, proven


def plan_memory(buffers: Sequence[Buffer], alignment: int) -> Plan:
    """Assign every buffer an aligned offset (see the module docstring for how)."""
    _check_inputs(buffers, alignment)
    bound = lower_bound(buffers, alignment)
    if not buffers:
        return Plan(offsets=(), arena_bytes=0, lower_bound=0, alignment=alignment)

    # Index buffers by id, so every tie below (and the seeded search) is broken the
    # same way whatever order the caller listed them in.
    buffers = sorted(buffers, key=lambda b: b.id)
    # All sizes are rounded up to the alignment, and every placement is at a sum
    # of such sizes, so every offset is aligned without further rounding.
    sizes = [align_up(b.size, alignment) for b in buffers]
    starts = [b.start for b in buffers]
    ends = [b.end for b in buffers]
    ids = [b.id for b in buffers]
    n = len(buffers)
    tree = _IntervalTree(starts, ends)

    def duration(i: int) -> int:
        return ends[i] - starts[i] + 1

    # The busiest step: buffers live there are stacked first, so that step meets the bound.
    events = sorted([(starts[i], sizes[i]) for i in range(n)] + [(ends[i] + 1, -sizes[i]) for i in range(n)])
    live, peak, peak_t = 0, -1, 0
    for t, delta in events:
        live += delta
        if live > peak:
            peak, peak_t = live, t
    at_peak = [starts[i] <= peak_t <= ends[i] for i in range(n)]
    keys: list[Callable[[int], tuple[int, ...]]] = [
        lambda i: (-sizes[i], -duration(i), i),  # greedy by size
        lambda i: (not at_peak[i], -duration(i), -sizes[i], i),  # the peak step first
        lambda i: (starts[i], -sizes[i], -duration(i), i),  # by start time
        lambda i: (-sizes[i] * duration(i), -sizes[i], i),  # by area (bytes x steps)
    ]
    best_offsets: list[int] = []
    best_order: list[int] = []
    best_arena = -1
    for key in keys:
        order = sorted(range(n), key=key)
        offsets, arena = _place(order, sizes, tree, starts, ends)
        if best_arena < 0 or arena < best_arena:
            best_offsets, best_arena, best_order = offsets, arena, order
        if best_arena <= bound:
            break
    proven = bound
    if best_arena > bound:
        # The greedy orders are cheap but miss on some schedules; search exactly.
        sec = _Sections(sizes, starts, ends, tree)
        exact_offsets, exact_arena, proven = _improve(sec, bound, best_offsets, best_arena)
        if exact_arena < best_arena:
            best_offsets, best_arena = exact_offsets, exact_arena
            best_order = sorted(range(n), key=lambda i: (best_offsets[i], i))
    if best_arena > proven:
        # Not known optimal (the exact search ran out of work): iterated greedy may still
        # help. One greedy pass costs about one step per overlapping pair; bound the total.
        by_start, by_end = sorted(starts), sorted(ends)
        pairs = sum(bisect_right(by_start, ends[i]) - bisect_left(by_end, starts[i]) for i in range(n))
        best_offsets, best_arena = _local_search(best_order, best_offsets, best_arena, proven,
                                                 min(2000, _LOCAL_WORK // pairs), sizes, tree, starts, ends)
    return Plan(
        offsets=tuple(zip(ids, best_offsets, strict=True)),
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
