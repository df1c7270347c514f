"""Tensor parallel: one rank's part of a fused model, Megatron-style (--tp N [--ep N]).

Runs once per rank on a copy of the optimised graph, after fusion and before
quantization, precision and alignment (which then see the rank's shapes). Rank r of N:

    %q = linear(%x, @wq : f32[H*D, K])            column parallel: rows of rank r's heads
    %k = linear(%x, @wk : f32[Hkv*D, K])          (Hkv < N: the one kv head r's queries read)
    ... reshape/transpose/rope_lut/kv_write over heads ...
    %a = fused_attention(%q', %k', %v')           H/N heads; the KV cache holds this rank's heads
    %o = linear(%a', @wo : f32[K, H*D])           row parallel: wo[:, rank r's columns]
  ->
    %o = linear(%a', @wo.tp1 : f32[K, H*D/N])     a partial sum
    %o.sum = all_reduce(%o) [world=N]

    swiglu(linear(@gate), linear(@up))            gate/up rows r, down's columns r, all_reduce
    mla_attention(q heads r, latent whole, @w_uk[r heads], @w_uv[r heads])    the latent replicated
    fused_moe(x, @router, @gate_up, @down)        --ep N: experts r*E/N.. (expert_offset), routing whole;
                                                  else each expert's FFN split like swiglu; all_reduce
    lm head                                       vocab parallel (rows r of the vocabulary) + all_gather
    embedding                                     replicated (a gather reads S rows: no bandwidth to save)

Seeds are found from the fused ops backwards: each attention operand and each SwiGLU
input is followed back through view ops (transpose, reshape, split, rope_lut, kv_write's
new rows) to the linear that makes it, which becomes column parallel over those heads.
Then every node is retyped in order: a value split over heads carries (axis) forward
through views and elementwise ops, a linear contracting a split axis is row parallel
and followed by an all_reduce, and a split value that reaches a graph output (the vocab-
parallel logits) is all-gathered. Anything else a split value reaches is refused: the
model is then not one this pass knows how to shard (NPUC-E0151), never sharded wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import Graph, Node, TensorType, Value, get_op
from npuc.ir.ops import _ACTIVATIONS, _BINARY, _FLOAT_UNARY, _NUMERIC_UNARY
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.manager import Pass, PassResult

E_SHARD = "NPUC-E0151"
SHARD_TAG = "rank's rows of"  # in a split weight's description, whatever wraps it (a cast, a quantization)
REPLICA_TAG = "replicated rows of"  # rows more than one rank holds: counted as replicated
_HINT = "use a --tp that divides the model's heads, KV heads, FFN width and experts, or compile without --tp"

_VIEWS = {"reshape", "transpose", "split", "rope_lut", "slice", "cast"}
_ELEMENTWISE = {*_BINARY, *_FLOAT_UNARY, *_NUMERIC_UNARY, *_ACTIVATIONS, "gelu", "cast", "swiglu"}


def refuse(message: str, hint: str = _HINT) -> NpucError:
    return NpucError(E_SHARD, message, hint, exit_code=EXIT_UNSUPPORTED)


class ShardSource:
    """Rows `ranges` (start, length) of `axis` of a weight, concatenated: read from the full
    weight's source only when written, and as a byte range of its file where the rows are a
    leading-axis run of a weight stored as it is (so a column-parallel shard streams)."""

    def __init__(self, src: Any, full: TensorType, axis: int, ranges: Sequence[tuple[int, int]],
                 replica: bool = False) -> None:
        self.src, self.full, self.axis, self.ranges = src, full, axis, tuple(ranges)
        self.replica = replica  # rows several ranks hold (a KV head shared by N / Hkv ranks)
        self.in_memory = getattr(src, "in_memory", False)

    def load(self) -> torch.Tensor:
        t = self.src.load()
        parts = [t.narrow(self.axis, s, n) for s, n in self.ranges]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.axis)).contiguous()

    def file_range(self, type: TensorType) -> tuple[str, int, int] | None:
        where = getattr(self.src, "file_range", None)
        whole = where(self.full) if where is not None else None
        if whole is None or len(self.ranges) != 1 or any(d != 1 for d in self.full.shape[:self.axis]):
            return None
        path, offset, _ = whole
        row = self.full.nbytes // self.full.shape[self.axis]
        start, n = self.ranges[0]
        return path, offset + start * row, n * row

    def describe(self) -> str:
        return f"{self.src.describe()} [{REPLICA_TAG if self.replica else SHARD_TAG} axis {self.axis}: " \
               f"{list(self.ranges)}]"


def _chunk(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise refuse(f"--tp {world} does not divide {what} ({n})")
    return rank * n // world, n // world


@dataclass
class _Plan:
    """Column-parallel rows of one linear: segment offset -> (segment size, row ranges kept)."""
    segments: dict[int, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)


@dataclass
class _Run:
    """What one run of the pass knows: the plans, each split value's axis, and whether a
    split value holds chunk r of that axis (the heads of a replicated KV head do not)."""
    plans: dict[int, tuple[Node, _Plan]] = field(default_factory=dict)
    splits: dict[int, list[tuple[int, bool]]] = field(default_factory=dict)  # split node -> (rows, chunk) each
    slices: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # slice node -> (start, rows, chunk)
    axis: dict[int, int] = field(default_factory=dict)
    chunk: dict[int, bool] = field(default_factory=dict)
    before: dict[int, TensorType] = field(default_factory=dict)  # every value's type before the pass
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("column", "row", "experts", "attention", "all_reduce", "all_gather"), 0))

    def mark(self, v: Value, axis: int, chunk: bool) -> None:
        self.axis[id(v)] = axis
        self.chunk[id(v)] = chunk


@dataclass(frozen=True)
class TensorParallel(Pass):
    """Rank `rank` of `world`; `expert_parallel` splits MoE experts across the ranks
    (else each expert's FFN is split like a dense one)."""
    rank: int
    world: int
    expert_parallel: bool = False
    name = "tensor-parallel"

    def call(self, g: Graph) -> PassResult:
        if self.world == 1:
            return PassResult(g, False)
        g = DeadCodeElimination()(g).graph  # what fusion left unread is not split (nor refused)
        run = _Run(before={id(v): v.type for v in g.values()})
        self._seed(g, run)
        for node in list(g.nodes):
            if g.has_node(node):
                self._retype(g, node, run)
        for i, out in enumerate(list(g.outputs)):
            if id(out) in run.axis:
                g.outputs[i] = self._gather(g, out, run, None)
        return PassResult(g, True, {"sharded": run.counts})

    # -- seeds ---------------------------------------------------------------------------
    def _heads(self, h: int, q_heads: int | None, what: str) -> list[tuple[int, int]]:
        """Head ranges rank r keeps of `h` heads: its chunk, or for KV heads fewer than the
        ranks the one head its query heads read (replicated over N / h ranks)."""
        n, r = self.world, self.rank
        if h % n == 0:
            return [(r * h // n, h // n)]
        if q_heads is not None and n % h == 0 and q_heads % n == 0:
            return [(r * h // n, 1)]
        raise refuse(f"--tp {n} does not divide the {h} {what}")

    def _seed(self, g: Graph, run: _Run) -> None:
        for node in g.nodes:
            if node.op in ("fused_attention", "cached_attention"):
                hq, hkv = node.inputs[0].type.shape[1], node.inputs[1].type.shape[1]
                self._trace(node.inputs[0], self._heads(hq, None, "query heads"), hq, run)
                for v in node.inputs[1:3]:
                    self._trace(v, self._heads(hkv, hq, "key/value heads"), hkv, run)
            elif node.op == "mla_attention":
                h = node.inputs[0].type.shape[1]
                for v in node.inputs[:2]:
                    self._trace(v, self._heads(h, None, "attention heads"), h, run)
            elif node.op == "swiglu":
                for v in node.inputs:
                    self._trace(v, [(self.rank, 1)], self.world, run)
            elif node.op == "linear" and node.inputs[1].is_const and node.inputs[1].type.rank == 2:
                for lin in _ffn_inputs(node):  # GELU, GeGLU: products joined by elementwise ops only
                    self._plan_rows(lin, 0, lin.outputs[0].type.shape[-1], [(self.rank, 1)], self.world, run)
        # The LM head: a linear whose result reaches an output through views only.
        for out in g.outputs:
            lin = _back_to_linear(out, frozenset({"reshape", "slice", "index", "cast", "pad"}))
            if lin is not None and id(lin) not in run.plans and lin.inputs[1].is_const \
                    and lin.inputs[1].type.rank == 2 and lin.outputs[0].type.shape[-1] % self.world == 0:
                self._plan_rows(lin, 0, lin.outputs[0].type.shape[-1], [(self.rank, 1)], self.world, run)

    def _trace(self, v: Value, heads: list[tuple[int, int]], h: int, run: _Run) -> None:
        """Follow `v` back to the linear making it; keep `heads` of its `h` head groups."""
        segment: tuple[int, int] | None = None
        while True:
            n = v.producer
            if n is None:
                if v.state:  # a cache: its rows come from a kv_write's new rows
                    writes = [u for u, i in v.uses if u.op == "kv_write" and i == 0]
                    if len(writes) == 1:
                        v = writes[0].inputs[1]
                        continue
                raise refuse(f"{v.ref()} feeds attention but is not made by a linear this pass can split")
            if n.op == "linear":
                if not n.inputs[1].is_const or n.inputs[1].type.rank != 2:
                    raise refuse(f"{n.name}: the weight of a linear feeding attention or an FFN is not a plain "
                                 "matrix (imported quantized weights cannot be split yet)",
                                 "compile without --tp, or from unquantized weights")
                off, size = segment if segment is not None else (0, n.outputs[0].type.shape[-1])
                self._plan_rows(n, off, size, heads, h, run)
                return
            if n.op == "kv_write":
                v = n.inputs[1]
            elif n.op in ("split", "slice") and _cuts_features(n):
                if n.op == "split":
                    sizes = list(n.attrs["sizes"])
                    idx = n.outputs.index(v)
                    segment = (sum(sizes[:idx]), sizes[idx])
                else:
                    segment = (n.attrs["start"], n.outputs[0].type.shape[-1])
                v = n.inputs[0]
            elif n.op in _VIEWS or (n.op in ("rms_norm", "layer_norm") and _per_head(n)):
                v = n.inputs[0]  # a per-head norm (Qwen3's q_norm, k_norm) keeps the heads apart
            else:
                raise refuse(f"{n.name} ({n.op}) lies between a linear and the attention or FFN it feeds")

    def _plan_rows(self, lin: Node, off: int, size: int, heads: list[tuple[int, int]], h: int, run: _Run) -> None:
        if size % h:
            raise refuse(f"{lin.name}: {size} features are not {h} equal heads")
        d = size // h
        rows = [(off + s * d, n * d) for s, n in heads]
        plan = run.plans.setdefault(id(lin), (lin, _Plan()))[1]
        old = plan.segments.get(off)
        if old is not None and old != (size, rows):
            raise refuse(f"{lin.name}: its rows are read as heads in two different ways")
        plan.segments[off] = (size, rows)

    # -- retyping ------------------------------------------------------------------------
    def _retype(self, g: Graph, node: Node, run: _Run) -> None:
        ins = [run.axis.get(id(v)) for v in node.inputs]
        if node.op == "linear" and id(node) in run.plans:
            if ins[0] is not None:
                raise refuse(f"{node.name}: a column-parallel linear over a split input")
            self._column(g, node, run.plans[id(node)][1], run)
            return
        if node.op in ("fused_moe", "qmoe"):
            if any(s is not None for s in ins):
                raise refuse(f"{node.name}: the experts' input is split")
            self._moe(g, node)
            run.counts["experts"] += 1
            self._reduce(g, node.outputs[0], run)
            return
        if all(s is None for s in ins):
            return
        if node.op == "linear":
            self._row(g, node, ins, run)
            return
        axis = next(s for s in ins if s is not None)
        chunk = all(run.chunk[id(v)] for v, s in zip(node.inputs, ins, strict=True) if s is not None)
        op = node.op
        if op == "transpose":
            self._infer(node)
            run.mark(node.outputs[0], node.attrs["perm"].index(axis), chunk)
        elif op == "reshape":
            self._reshape(node, axis, chunk, run)
        elif op == "split" and node.attrs["axis"] % node.inputs[0].type.rank == axis:
            planned = run.splits.get(id(node))
            if planned is None:
                raise refuse(f"{node.name}: splits a split axis this pass did not plan")
            node.set_attrs(sizes=tuple(n for n, _ in planned))
            self._infer(node)
            for o, (_, c) in zip(node.outputs, planned, strict=True):
                run.mark(o, axis, c)
        elif op == "slice" and node.attrs["axis"] % node.inputs[0].type.rank == axis:
            planned_slice = run.slices.get(id(node))
            if planned_slice is None:
                raise refuse(f"{node.name}: slices a split axis this pass did not plan")
            start, n, c = planned_slice
            node.set_attrs(start=start, end=start + n)
            self._infer(node)
            run.mark(node.outputs[0], axis, c)
        elif op in ("slice", "pad", "split", "concat", "rope_lut", "rms_norm", "layer_norm") or op in _ELEMENTWISE:
            self._elementwise(g, node, axis, chunk, ins, run)
        elif op == "kv_write":
            if ins[1] != 1 or ins[0] is not None:
                raise refuse(f"{node.name}: writes a cache over a split that is not its heads")
            cache = node.inputs[0]
            if cache.state:
                cache.type = _with_dim(cache.type, 1, node.inputs[1].type.shape[1])
                run.mark(cache, 1, chunk)
            self._infer(node)
            run.mark(node.outputs[0], 1, chunk)
        elif op in ("fused_attention", "cached_attention"):
            self._attention(g, node, ins, run)
        elif op == "mla_attention":
            self._mla(g, node, ins, run)
        else:
            for i, s in enumerate(ins):
                if s is not None:
                    node.set_input(i, self._gather(g, node.inputs[i], run, node))

    def _column(self, g: Graph, node: Node, plan: _Plan, run: _Run) -> None:
        feats = node.outputs[0].type.shape[-1]
        segs = sorted(plan.segments.items())
        covered = sum(size for _, (size, _) in segs)
        if covered != feats:
            raise refuse(f"{node.name}: only {covered} of its {feats} outputs are heads this pass can split")
        rows = [r for _, (_, rs) in segs for r in rs]
        users = _feature_users(node.outputs[0])  # before retyping: the reshapes still keep the features

        def is_chunk(off: int, size: int, rs: list[tuple[int, int]]) -> bool:
            return size % self.world == 0 and rs == [(off + self.rank * size // self.world, size // self.world)]

        replica = not any(is_chunk(o, size, rs) for o, (size, rs) in segs)
        self._slice_const(g, node, 1, _out_axis(node), rows, replica)
        if len(node.inputs) > 2:
            self._slice_const(g, node, 2, 0, rows, replica)
        self._infer(node)
        out = node.outputs[0]

        run.mark(out, out.type.rank - 1, len(segs) == 1 and is_chunk(0, feats, rows))
        if len(segs) > 1:  # a fused q/k/v or gate/up product: its split or slices take each segment's rows
            kept = [(o, size, sum(n for _, n in rs), is_chunk(o, size, rs)) for o, (size, rs) in segs]
            local = dict(zip((o for o, *_ in kept), _offsets([k for _, _, k, _ in kept]), strict=True))
            for u in users:
                if u.op == "split" and [o for o, *_ in kept] == _offsets(u.attrs["sizes"]):
                    run.splits[id(u)] = [(k, c) for _, _, k, c in kept]
                elif u.op == "slice" and _cuts_features(u):
                    seg = next(((o, k, c) for o, size, k, c in kept
                                if o == u.attrs["start"] and size == u.outputs[0].type.shape[-1]), None)
                    if seg is not None:
                        run.slices[id(u)] = (local[seg[0]], seg[1], seg[2])
        run.counts["column"] += 1

    def _row(self, g: Graph, node: Node, ins: list[int | None], run: _Run) -> None:
        x, w = node.inputs[0], node.inputs[1]
        if ins[0] != x.type.rank - 1 or not run.chunk[id(x)] or any(s is not None for s in ins[1:]):
            raise refuse(f"{node.name}: a linear over a split that is not its contracted axis")
        if not w.is_const or w.type.rank != 2:
            raise refuse(f"{node.name}: a row-parallel linear needs a plain weight matrix")
        k = 1 - _out_axis(node)  # the contracted axis of the weight as stored
        self._slice_const(g, node, 1, k, [_chunk(w.type.shape[k], self.world, self.rank, f"{node.name}'s inputs")])
        if len(node.inputs) > 2 and self.rank:  # the bias once, on rank 0, before the sum
            node = self._without_bias(g, node)
        self._infer(node)
        run.counts["row"] += 1
        self._reduce(g, node.outputs[0], run)

    def _moe(self, g: Graph, node: Node) -> None:
        gate_up, down = (2, 3) if node.op == "fused_moe" else (2, 5)
        e = node.inputs[gate_up].type.shape[0]
        if self.expert_parallel:
            first, n = _chunk(e, self.world, self.rank, "routed experts")
            for i in (range(2, 4) if node.op == "fused_moe" else range(2, 8)):
                self._slice_const(g, node, i, 0, [(first, n)])
            node.set_attrs(expert_offset=first)
        else:
            if node.op != "fused_moe":
                raise refuse(f"{node.name}: quantized experts are split by expert only", f"add --ep {self.world}")
            inter = node.inputs[down].type.shape[2]
            s, n = _chunk(inter, self.world, self.rank, "the experts' FFN width")
            self._slice_const(g, node, gate_up, 1, [(s, n), (inter + s, n)])
            self._slice_const(g, node, down, 2, [(s, n)])
        self._infer(node)

    def _attention(self, g: Graph, node: Node, ins: list[int | None], run: _Run) -> None:
        if ins[0] != 1 or ins[1] != 1 or ins[2] != 1:
            raise refuse(f"{node.name}: attention whose query, key and value are not all split by heads")
        h = node.inputs[0].type.shape[1]
        s = self.rank * h  # the first local query head, as a global index
        if node.attrs.get("alibi"):
            node.set_attrs(alibi=tuple(node.attrs["alibi"][s:s + h]))
        first_extra = 3 if node.op == "fused_attention" else 4  # after q, k, v (and cached positions)
        for i in range(first_extra, len(node.inputs)):
            v = node.inputs[i]
            if ins[i] is not None:
                raise refuse(f"{node.name}: its operand {v.ref()} is split")
            axis = v.type.rank - 3 if node.op == "fused_attention" and i == 3 else 0  # mask [.., H, S, N]; sinks [H]
            if axis >= 0 and v.type.shape[axis] == h * self.world and h * self.world > 1:
                if not v.is_const:
                    raise refuse(f"{node.name}: a per-head mask or sink that is not a constant")
                self._slice_const(g, node, i, axis, [(s, h)])
        self._infer(node)
        run.mark(node.outputs[0], 1, True)
        run.counts["attention"] += 1

    def _mla(self, g: Graph, node: Node, ins: list[int | None], run: _Run) -> None:
        if ins[0] != 1 or ins[1] != 1 or any(s is not None for s in ins[2:]):
            raise refuse(f"{node.name}: latent attention over a split that is not its query heads")
        full = node.inputs[0].type.shape[1] * self.world
        for i in (3, 4):
            w = node.inputs[i]
            if not w.is_const or w.type.shape[0] != full:
                raise refuse(f"{node.name}: its W_UK/W_UV are not per-head constants")
            self._slice_const(g, node, i, 0, [_chunk(full, self.world, self.rank, "attention heads")])
        self._infer(node)
        run.mark(node.outputs[0], 1, True)
        run.counts["attention"] += 1

    def _elementwise(self, g: Graph, node: Node, axis: int, chunk: bool, ins: list[int | None], run: _Run) -> None:
        out_rank = node.outputs[0].type.rank
        op, r = node.op, node.inputs[0].type.rank
        if op == "pad" and (node.attrs["pads"][axis] or node.attrs["pads"][axis + r]):
            raise refuse(f"{node.name}: pads a split axis")
        if op in ("slice", "split", "concat") and node.attrs["axis"] % out_rank == axis:
            raise refuse(f"{node.name}: cuts or joins along a split axis")
        if op in ("rms_norm", "layer_norm") and node.attrs.get("axis", -1) % out_rank <= axis:
            raise refuse(f"{node.name}: normalises over a split axis")
        if op == "rope_lut" and axis == r - 1:
            raise refuse(f"{node.name}: rotates a split head dimension")
        lead = out_rank - axis  # the split axis counted from the end, as broadcasting aligns it
        for i, v in enumerate(node.inputs):
            if ins[i] is not None:
                if v.type.rank - ins[i] != lead:
                    raise refuse(f"{node.name}: its operands are split along different axes")
                continue
            if op == "rope_lut" or (op in ("rms_norm", "layer_norm") and i > 0):
                continue  # tables indexed by position; scales along the normalised axis
            if v.type.rank >= lead and v.type.shape[v.type.rank - lead] != 1:
                if not (v.is_const and chunk):
                    raise refuse(f"{node.name}: combines a split value with a whole one ({v.ref()})")
                full = v.type.shape[v.type.rank - lead]
                self._slice_const(g, node, i, v.type.rank - lead,
                                  [_chunk(full, self.world, self.rank, f"{v.ref()}'s features")])
        self._infer(node)
        for o in node.outputs:
            run.mark(o, axis, chunk)

    def _reshape(self, node: Node, axis: int, chunk: bool, run: _Run) -> None:
        """Carry the split through a reshape that merges or splits it with inner axes only
        (heads x head_dim <-> features): the output's outermost axis of that group shrinks."""
        old_in = run.before[id(node.inputs[0])].shape
        factor = old_in[axis] // node.inputs[0].type.shape[axis]
        shape = list(node.attrs["shape"])
        lead, acc = math.prod(old_in[:axis]), 1
        out_axis = None
        for j, d in enumerate(shape):
            if acc == lead and d != 1:
                out_axis = j
                break
            acc *= d
        if out_axis is None or shape[out_axis] % factor or math.prod(shape[:out_axis]) != lead:
            raise refuse(f"{node.name}: reshapes a split axis across outer axes")
        shape[out_axis] //= factor
        node.set_attrs(shape=tuple(shape))
        self._infer(node)
        run.mark(node.outputs[0], out_axis, chunk)

    # -- helpers -------------------------------------------------------------------------
    def _infer(self, node: Node) -> None:
        types = get_op(node.op).infer_types([v.type for v in node.inputs], node.attrs)
        for o, t in zip(node.outputs, types, strict=True):
            o.type = t

    def _slice_const(self, g: Graph, node: Node, i: int, axis: int, ranges: Sequence[tuple[int, int]],
                     replica: bool = False) -> None:
        v = node.inputs[i]
        if v.const is None:
            raise refuse(f"{node.name}: operand {v.ref()} must be a weight to be split")
        t = _with_dim(v.type, axis, sum(n for _, n in ranges))
        src = ShardSource(v.const, v.type, axis, ranges, replica)
        if len(v.uses) == 1 and not any(o is v for o in g.outputs):
            v.const, v.type = src, t  # the weight keeps its name: dumps read as the model's
            return
        # Read whole elsewhere too (a tied embedding and LM head): this part is a second copy of
        # rows every rank holds, so it counts as replicated.
        src.replica = True
        node.set_input(i, g.add_constant(f"{v.name}.tp{self.rank}", t, src))

    def _without_bias(self, g: Graph, node: Node) -> Node:
        out = node.outputs[0]
        new = g.add_node("linear", node.inputs[:2], [out.type], node.attrs, names=out.name + ".nobias", before=node)
        g.replace_all_uses_with(out, new.outputs[0])
        g.remove_node(node)
        g.rename(new.outputs[0], out.name)
        return new

    def _reduce(self, g: Graph, v: Value, run: _Run) -> None:
        """Every reader of the partial sum `v` reads its all_reduce instead."""
        uses = list(v.uses)
        at = g.nodes.index(v.producer) + 1 if v.producer is not None else 0
        red = g.add_node("all_reduce", [v], [v.type], {"world": self.world}, names=f"{v.name}.sum",
                         before=g.nodes[at] if at < len(g.nodes) else None)
        for u, i in uses:
            u.set_input(i, red.outputs[0])
        g.outputs = [red.outputs[0] if o is v else o for o in g.outputs]
        run.counts["all_reduce"] += 1

    def _gather(self, g: Graph, v: Value, run: _Run, before: Node | None) -> Value:
        """`v` whole on every rank (each rank's chunk, concatenated in rank order)."""
        if not run.chunk.get(id(v), False):
            raise refuse(f"{v.ref()} holds the heads of a KV head shared by several ranks and reaches an op that "
                         "needs them all")
        attrs = {"axis": run.axis[id(v)], "world": self.world}
        out_t = get_op("all_gather").infer_types([v.type], attrs)
        is_output = any(o is v for o in g.outputs)
        name = v.name
        if is_output:  # the graph output keeps its name: the part is renamed
            g.rename(v, g.fresh_name(name + ".part"))
        node = g.add_node("all_gather", [v], out_t, attrs, names=name if is_output else f"{name}.gathered",
                          before=before)
        run.counts["all_gather"] += 1
        return node.outputs[0]


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _with_dim(t: TensorType, axis: int, n: int) -> TensorType:
    shape = list(t.shape)
    shape[axis] = n
    return TensorType(tuple(shape), t.dtype, t.format) if hasattr(t, "format") else TensorType(tuple(shape), t.dtype)


def _ffn_inputs(down: Node) -> list[Node]:
    """The linears an FFN's down projection reads through elementwise ops alone (GPT-2's
    GELU, Gemma's GeGLU): up = linear(x), down(act(up)) or down(act(gate) * up). Each
    value on the way must be read only inside it, and every other operand must broadcast
    along the features (a scalar); else [] (the FFN stays whole)."""
    x = down.inputs[0]
    feats = x.type.shape[-1]
    found: list[Node] = []
    inside: set[int] = set()
    stack = [x]
    while stack:
        v = stack.pop()
        n = v.producer
        if n is None or len(n.outputs) != 1:
            return []
        if id(n) in inside:  # reached again (GELU reads its input three times)
            continue
        inside.add(id(n))
        if n.op == "linear":
            if not n.inputs[1].is_const or n.inputs[1].type.rank != 2 or n.outputs[0].type.shape[-1] != feats:
                return []
            found.append(n)
            continue
        if n.op not in _ELEMENTWISE and not _keeps_features(n):
            return []
        for u in n.inputs:
            if u.is_const and (u.type.rank == 0 or u.type.shape[-1] == 1):
                continue  # a scalar (GELU's constants)
            if u.type.shape[-1] != feats:
                return []
            stack.append(u)
    if not found or len(found) > 2 or len(inside) > 24:
        return []
    nodes = [n for n in down.graph.nodes if id(n) in inside]
    roots = {id(o) for o in down.graph.outputs}
    for n in nodes:  # nothing on the way is read from outside it, nor is an output
        for o in n.outputs:
            if id(o) in roots or any(id(u) not in inside and u is not down for u, _ in o.uses):
                return []
    return found


def _per_head(norm: Node) -> bool:
    """A norm over the last axis of a value with heads before it ([.., H, D] or [.., H, S, D])."""
    x = norm.inputs[0]
    return x.type.rank >= 4 and norm.attrs.get("axis", -1) % x.type.rank == x.type.rank - 1


def _out_axis(linear: Node) -> int:
    """The weight axis of a linear's outputs: 0 as torch stores it ([N, K]), 1 as ONNX's
    MatMul does (weight_layout="kn", [K, N])."""
    return 1 if linear.attrs.get("weight_layout", "nk") == "kn" else 0


def _cuts_features(n: Node) -> bool:
    """Whether split or slice `n` cuts a linear's output features (a fused q/k/v or
    gate/up product) into its parts."""
    x = n.inputs[0]
    if n.attrs["axis"] % x.type.rank != x.type.rank - 1 or (n.op == "slice" and n.attrs.get("step", 1) != 1):
        return False
    p = x.producer
    while p is not None and _keeps_features(p):  # GPT-2's Conv1D: linear [B*S, 3H] -> reshape [B, S, 3H]
        p = p.inputs[0].producer
    return p is not None and p.op == "linear"


def _keeps_features(n: Node) -> bool:
    """A reshape or cast that leaves the last axis (a product's features) as it is."""
    return n.op == "cast" or (n.op == "reshape" and n.outputs[0].type.shape[-1:] == n.inputs[0].type.shape[-1:])


def _feature_users(v: Value) -> list[Node]:
    """The readers of a product's features, through reshapes and casts that keep them."""
    out = []
    for u, _ in v.uses:
        out.extend(_feature_users(u.outputs[0]) if _keeps_features(u) else [u])
    return out


def _back_to_linear(v: Value, through: frozenset[str]) -> Node | None:
    n = v.producer
    while n is not None and n.op in through:
        n = n.inputs[0].producer
    return n if n is not None and n.op == "linear" else None
