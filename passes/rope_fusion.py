"""RoPE -> RoPE-with-LUT: rotary position embedding as one table lookup op.

No frequency formula is pattern-matched. By the time this pass runs, constant
folding has evaluated the cos/sin subgraph (default, Llama-3, YaRN or attention-
scaled RoPE alike) into tables indexed by position; the pass recognises how the
tables are applied and hands them to `rope_lut` with the position ids.

    %c  = mul(%x, @cos)                                       half layout (rotate_half)
    %r  = concat[axis=-1](neg(slice(%x, d/2:d)), slice(%x, 0:d/2))
    %y  = add(%c, mul(%r, @sin))
  ->
    %y  = rope_lut[layout="half"](%x, @positions, @cos_table, @sin_table)

    %e = slice[step=2](%x, 0:), %o = slice[step=2](%x, 1:)    DeepSeek's interleaved pairs
    %y = concat[axis=-1](sub(mul(%e, @cos), mul(%o, @sin)), add(mul(%o, @cos), mul(%e, @sin)))
  ->
    %y = rope_lut[layout="deinterleave"](%x, @positions, @cos_table, @sin_table)

    %a, %b = split[axis=-1](%x)                               gpt-oss: halves, by a split
    %y = concat[axis=-1](sub(mul(%a, @cos), mul(%b, @sin)), add(mul(%b, @cos), mul(%a, @sin)))
  ->
    %y = rope_lut[layout="half"](%x, @positions, @cos_table, @sin_table)

    %e = slice[step=2](%x, 0:), %o = slice[step=2](%x, 1:)    GPT-J's rotate_every_two (Cohere,
    %r = reshape(concat[axis=-1](reshape(neg(%o)), reshape(%e)))   GLM): stack([-o, e], -1)
    %y = add(mul(%x, @cos), mul(%r, @sin))                     cos/sin columns in equal pairs
  ->
    %y = rope_lut[layout="interleaved"](%x, @positions, @cos_table, @sin_table)

    %p = reshape(%x) [b, h, s, d/2, 2]                      complex pairs (DeepSeek-V2's
    %a = slice(%p, 0:1), %b = slice(%p, 1:2)                 view_as_complex(x) * freqs_cis,
    %y = reshape(concat[axis=-1](                            as the torch frontend writes it)
           sub(mul(%a, @cos), mul(%b, @sin)), add(mul(%a, @sin), mul(%b, @cos)))) [b, h, s, d]
  ->
    %y = rope_lut[layout="interleaved"](reshape(%x) [b, h, s, d], @positions, @cos_table, @sin_table)
    (the reshape only where %x has another shape: a single-head k [b, s, d]; Llama 4 ropes
    [b, s, h, d] by tables [1, s, 1, d/2, 1], so its x is transposed to heads first and back)

    %c = cos(f(%position_ids)), %s = sin(f(%position_ids))   optimum / TorchScript exports:
    %y = add(mul(%x, %c), mul(rotate_half(%x), %s))          tables from the position ids input
  ->
    %y = rope_lut[layout="half"](%x, reshape(%position_ids), @cos_table, @sin_table)
    (the tables evaluated from f position by position, RUNTIME_TABLE_ROWS rows; refused
    where a row depends on other positions than its own, as a scaling by the largest does)

    %y = rotary_embedding(%x, @cos, @sin [, %position_ids])   ONNX opset 23
  ->
    %y = rope_lut[layout="half" | "interleaved"](...)
    (com.microsoft's [b, s, h*d] with num_heads: reshape and transpose to [b, h, s, d] around it)

Tables are [positions, rotary_dim/2]. The positions are those the folded tables
cover (0..seq-1 here); extending the tables to --max_seq_len for decoding belongs
with the KV cache. Left alone: tables that vary along batch or heads, cos halves
that differ (not a rotate_half RoPE), and partial rotary through slices of x.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from npuc.ir import Node, Value, get_op
from npuc.ir.evaluate import evaluate_value
from npuc.passes.rewrite import Builder, Match, Pat, RewritePass, Rule, is_const, last_axis, op, var


def _attrs(n: Node) -> dict[str, object]:
    return get_op(n.op).full_attrs(n.attrs)


def _rows(t: torch.Tensor, seq: int) -> torch.Tensor | None:
    """A broadcast table [1, .., 1, seq, w] as [seq, w]; None if it varies along other axes."""
    if t.dim() < 2 or t.shape[-2] != seq:
        return None
    flat = t.reshape(-1, seq, t.shape[-1])
    if not bool((flat == flat[:1]).all()):
        return None
    return flat[0]


# How the matched cos/sin columns hold the [positions, rotary_dim/2] table: as they are
# (half width), twice over in halves (rotate_half's), or each value twice (repeat_interleave's).
Fold = Literal["none", "halves", "pairs"]


def _table_data(m: Match, x: Value, fold: Fold) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The [positions, rotary_dim/2] tables behind the broadcast cos/sin constants, or why not."""
    seq = x.type.shape[-2]
    cos, sin = _rows(m.data("cos"), seq), _rows(m.data("sin"), seq)
    if cos is None or sin is None:
        return "the cos/sin tables vary along batch or heads"
    if fold == "halves":
        h = cos.shape[-1] // 2
        if cos.shape[-1] % 2 or not (torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])):
            return "the cos/sin halves differ: not a rotate_half RoPE"
        cos, sin = cos[:, :h], sin[:, :h]
    elif fold == "pairs":
        if not (torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2], sin[:, 1::2])):
            return "the cos/sin columns do not come in equal pairs: not an interleaved RoPE"
        cos, sin = cos[:, 0::2], sin[:, 0::2]
    return cos, sin


def _tables(b: Builder, m: Match, x: Value, fold: Fold) -> tuple[Value, Value]:
    data = _table_data(m, x, fold)
    assert not isinstance(data, str), data  # the rule's check refused this already
    dt = x.type.dtype.torch
    return (b.const(f"{m['cos'].name}_lut", data[0].to(dt).contiguous()),
            b.const(f"{m['sin'].name}_lut", data[1].to(dt).contiguous()))


def _positions(b: Builder, seq: int) -> Value:
    return b.const(f"positions_{seq}", torch.arange(seq, dtype=torch.int64))


def _x(m: Match) -> Value:
    return m["x"]


def _check_tables(m: Match, fold: Fold, x: Value | None = None) -> str | None:
    """x (the matched `x` unless given) and the tables a RoPE of it reads, or why they do not fit."""
    x = _x(m) if x is None else x
    if x.type.rank != 4:
        return "x is not [batch, heads, seq, dim]"
    if m.matched[0].outputs[0].type != x.type:
        return "the tables broadcast x to another shape"
    seq, d = x.type.shape[-2:]
    for name in ("cos", "sin"):
        t = m[name].type
        want = d // 2 if fold == "none" else d
        if t.rank < 2 or t.shape[-2:] != (seq, want):
            return f"{name} table {t} is not [.., {seq}, {want}]"
    data = _table_data(m, x, fold)
    return data if isinstance(data, str) else None


# -- half (rotate_half) --------------------------------------------------------------------

def _halves(m: Match) -> str | None:
    """Why rotate_half's slices and concat (bound lo, hi, cat) are not x's two halves, or None."""
    x, lo, hi = m["x"], m.node("lo"), m.node("hi")
    d = x.type.shape[-1]
    if not (last_axis(lo) and last_axis(hi) and last_axis(m.node("cat"))):
        return "the halves are not taken along the last axis"
    la, ha = _attrs(lo), _attrs(hi)
    if (la["start"], la["end"], la["step"]) != (0, d // 2, 1) or (ha["start"], ha["end"], ha["step"]) != (d // 2, d, 1):
        return "the slices are not the two halves of the head dim"
    return None


def _half_check(m: Match) -> str | None:
    return _halves(m) or _check_tables(m, "halves")


def _lut(layout: str, fold: Fold, source: Callable[[Match], Value] = _x) -> Callable[[Builder, Match], Value]:
    """The rewrite of a matched RoPE: rope_lut over the tables, at positions 0..seq-1, of the
    x that `source` finds."""

    def rewrite(b: Builder, m: Match) -> Value:
        x = source(m)
        tables = _tables(b, m, x, fold)
        return b.op("rope_lut", [x, _positions(b, x.type.shape[-2]), *tables], {"layout": layout})

    return rewrite


def _half_pattern(cos: Pat | None = None, sin: Pat | None = None) -> object:
    """x * cos + rotate_half(x) * sin; cos and sin constants unless other patterns are given."""
    rot = op("concat", op("neg", op("slice", var("x"), bind="hi")), op("slice", var("x"), bind="lo"), bind="cat")
    return op("add", op("mul", var("x"), cos or var("cos", is_const)), op("mul", rot, sin or var("sin", is_const)))


# -- tables computed from a position ids input (optimum's and the TorchScript exporter's) ------

# Rows of the tables made from such a model: positions it may be run at (a position past them
# is refused by the runtime as an index outside its table).
RUNTIME_TABLE_ROWS = 2048


def _position_input(v: Value) -> list[Value]:
    """The graph inputs (and states) `v` is computed from."""
    seen, todo, found = set(), [v], []
    while todo:
        u = todo.pop()
        if id(u) in seen or u.is_const:
            continue
        seen.add(id(u))
        if u.producer is None:
            found.append(u)
        else:
            todo.extend(u.producer.inputs)
    return found


def _evaluated_rows(m: Match, name: str, pos: Value, ids: torch.Tensor, seq: int) -> torch.Tensor | None:
    """`name`'s [seq, d] rows with `pos` fed `ids` (laid out as its shape), or None."""
    value = m[name]
    feed = ids.to(pos.type.dtype.torch).reshape((1,) * (pos.type.rank - 1) + (seq,)).expand(pos.type.shape)
    t = evaluate_value(value.graph, value, {pos.name: feed.contiguous()}, max_bytes=1 << 24)
    return None if t is None else _rows(t, seq)


Tables = tuple[Value, torch.Tensor, torch.Tensor]
TableCache = dict[tuple[int, int], tuple[Value, Value, "Tables | str"]]


def _runtime_tables(m: Match, cache: TableCache) -> Tables | str:
    """(the position ids input, the cos and sin [rows, d/2] tables) of a rotate_half RoPE whose
    cos/sin the graph computes from that input, position by position; or why not. Every layer's
    q and k share the cos/sin values: evaluated once (`cache`, one pass run's)."""
    key = (id(m["cos"]), id(m["sin"]))
    if key not in cache:  # the entry holds the two values: their ids stay theirs for the run
        cache[key] = (m["cos"], m["sin"], _evaluate_tables(m))
    return cache[key][2]


def _evaluate_tables(m: Match) -> Tables | str:
    x = m["x"]
    if x.type.rank != 4 or m.matched[0].outputs[0].type != x.type:
        return "x is not [batch, heads, seq, dim] or the tables broadcast it"
    seq, d = x.type.shape[-2:]
    reads = {id(v): v for name in ("cos", "sin") for v in _position_input(m[name])}
    if len(reads) != 1:
        return f"the cos/sin tables read {len(reads)} graph inputs, not one of position ids"
    pos = next(iter(reads.values()))
    if pos.type.dtype.is_float or pos.type.rank not in (1, 2) or pos.type.numel != seq:
        return f"{pos.ref()} is not the position ids of one sequence, [1, {seq}]"
    rows = max(RUNTIME_TABLE_ROWS, seq)
    tables = []
    for name in ("cos", "sin"):
        first = _evaluated_rows(m, name, pos, torch.arange(seq), seq)
        moved = torch.arange(seq)
        moved[-1] = rows - 1
        other = _evaluated_rows(m, name, pos, moved, seq)
        if first is None or other is None or first.shape[-1] != d:
            return f"the {name} table is not [{seq}, {d}] rows of the positions"
        if not torch.equal(first[:-1], other[:-1]):  # e.g. a scaling by the largest position
            return f"the {name} table's rows depend on other positions than their own"
        chunks = [first] + [_evaluated_rows(m, name, pos, torch.arange(k, k + seq), seq)
                            for k in range(seq, rows, seq)]
        if any(c is None for c in chunks):
            return f"the {name} table could not be evaluated"
        full = torch.cat([c for c in chunks if c is not None])[:rows]
        # Row i must be the table's row p[i] for any ids, not only runs of them: positions
        # computed from the tokens (a cumsum of a padding mask) fail here.
        ids = torch.randint(0, rows, (seq,), generator=torch.Generator().manual_seed(0))
        picked = _evaluated_rows(m, name, pos, ids, seq)
        if picked is None or not torch.allclose(picked, full[ids], rtol=0, atol=1e-6):
            return f"the {name} table's row i is not a function of position i alone"
        h = d // 2
        if not torch.equal(full[:, :h], full[:, h:]):
            return "the cos/sin halves differ: not a rotate_half RoPE"
        tables.append(full[:, :h])
    return pos, tables[0], tables[1]


def _runtime_check(m: Match, cache: TableCache) -> str | None:
    if m["cos"].is_const or m["sin"].is_const:
        return "constant tables: rope-half's"
    bad = _halves(m)
    if bad is not None:
        return bad
    got = _runtime_tables(m, cache)
    return got if isinstance(got, str) else None


def _runtime_rewrite(b: Builder, m: Match, cache: TableCache) -> Value:
    got = _runtime_tables(m, cache)
    assert not isinstance(got, str), got
    pos, cos, sin = got
    x, dt = m["x"], m["x"].type.dtype.torch
    ids = b.op("reshape", [pos], {"shape": (x.type.shape[-2],)}) if pos.type.rank != 1 else pos
    tables = [b.const(f"{pos.name}_rope_{k}_table", t.to(dt).contiguous()) for k, t in (("cos", cos), ("sin", sin))]
    return b.op("rope_lut", [x, ids, *tables], {"layout": "half"})


def _runtime_pattern() -> object:
    return _half_pattern(var("cos"), var("sin"))


# -- DeepSeek: interleaved pairs in, halves out ------------------------------------------------

def _pairs_check(m: Match) -> str | None:
    e, o = m.node("xe"), m.node("xo")
    if not (last_axis(e) and last_axis(o) and last_axis(m.node("cat"))):
        return "the pairs are not taken along the last axis"
    ea, oa = _attrs(e), _attrs(o)
    if (ea["start"], ea["step"], oa["start"], oa["step"]) != (0, 2, 1, 2):
        return "the slices are not the even/odd elements"
    return _check_tables(m, "none")


def _pairs_pattern() -> object:
    xe, xo = op("slice", var("x"), bind="xe"), op("slice", var("x"), bind="xo")
    cos, sin = var("cos", is_const), var("sin", is_const)
    real = op("sub", op("mul", xe, cos), op("mul", xo, sin))
    imag = op("add", op("mul", xo, cos), op("mul", xe, sin))
    return op("concat", real, imag, bind="cat")


# -- halves by split (gpt-oss): half in, half out ------------------------------------------------

def _split_source(m: Match) -> Value | str:
    """x, whose two halves (one split) the matched rotation reads; or why not."""
    a, b = m["a"], m["b"]
    sp = a.producer
    if sp is None or sp.op != "split" or b.producer is not sp or (a.index, b.index) != (0, 1) \
            or len(sp.outputs) != 2:
        return "the halves are not the two outputs of one split"
    x = sp.inputs[0]
    d = x.type.shape[-1] if x.type.rank else 0
    sizes = _attrs(sp)["sizes"]
    if x.type.rank != 4 or not (last_axis(sp) and last_axis(m.node("cat"))) or list(sizes) != [d // 2, d // 2]:  # type: ignore[call-overload]
        return "the split is not the two halves of the last axis of [batch, heads, seq, dim]"
    bad = _check_tables(m, "none", x)
    return bad if bad is not None else x


def _split_check(m: Match) -> str | None:
    x = _split_source(m)
    return x if isinstance(x, str) else None


def _split_x(m: Match) -> Value:
    x = _split_source(m)
    assert not isinstance(x, str), x  # the check refused this already
    return x


def _split_pattern() -> object:
    a, b = var("a"), var("b")  # the two outputs of one split (a node the pattern cannot match twice)
    cos, sin = var("cos", is_const), var("sin", is_const)
    first = op("sub", op("mul", a, cos), op("mul", b, sin))
    second = op("add", op("mul", b, cos), op("mul", a, sin))
    return op("concat", first, second, bind="cat")


# -- every two (GPT-J, Cohere, GLM): interleaved in, interleaved out ---------------------------

def _every_two_check(m: Match) -> str | None:
    x, e, o, cat = m["x"], m.node("xe"), m.node("xo"), m.node("cat")
    if x.type.rank != 4 or m.matched[0].outputs[0].type != x.type or m.node("flat").outputs[0].type != x.type:
        return "x is not [batch, heads, seq, dim], or the rotation has another shape"
    if not (last_axis(e) and last_axis(o)):
        return "the pairs are not taken along the last axis"
    ea, oa = _attrs(e), _attrs(o)
    if (ea["start"], ea["step"], oa["start"], oa["step"]) != (0, 2, 1, 2):
        return "the slices are not the even/odd elements"
    # stack([-odd, even], dim=-1): pair i of the result is (-x[2i+1], x[2i])
    half = e.outputs[0].type.shape
    if any(v.type.shape != half + (1,) for v in cat.inputs) or not last_axis(cat):
        return "the pairs are not stacked along a new last axis"
    return _check_tables(m, "pairs")


def _every_two_pattern() -> object:
    xe, xo = op("slice", var("x"), bind="xe"), op("slice", var("x"), bind="xo")
    pairs = op("concat", op("reshape", op("neg", xo)), op("reshape", xe), bind="cat")
    rot = op("reshape", pairs, bind="flat")
    return op("add", op("mul", var("x"), var("cos", is_const)), op("mul", rot, var("sin", is_const)))


# -- complex pairs: interleaved in, interleaved out --------------------------------------------

def _complex_check(m: Match) -> str | None:
    # The rotation is typed by its result y [batch, heads, seq, d]: x may be the same data in
    # another shape (k's single head: [batch, seq, d] viewed straight as pairs).
    y = m.matched[0].outputs[0].type
    if y.rank != 4:
        return "the result is not [batch, heads, seq, dim]"
    seq, d = y.shape[-2:]
    if d % 2 or m.node("p").outputs[0].type.shape != y.shape[:-1] + (d // 2, 2):
        return "x is not viewed as [.., d/2, 2] pairs"
    if not (last_axis(m.node("re")) and last_axis(m.node("im")) and last_axis(m.node("cat"))):
        return "the parts are not taken along the pairs' axis"
    ra, ia = _attrs(m.node("re")), _attrs(m.node("im"))
    if (ra["start"], ra["end"], ra["step"], ia["start"], ia["end"], ia["step"]) != (0, 1, 1, 1, 2, 1):
        return "the slices are not the real and imaginary parts"
    for name in ("cos", "sin"):
        rows = _complex_rows(m, name)
        if isinstance(rows, str):
            return rows
    return None


def _seq_first(m: Match) -> bool:
    """Whether the rotation runs on [batch, seq, heads, d] (Llama 4 ropes before moving the
    heads forward): its tables are [.., seq, 1, d/2, 1], broadcast over the heads."""
    y, t = m.matched[0].outputs[0].type, m["cos"].type
    return t.rank >= 4 and t.shape[-4:] == (y.shape[1], 1, y.shape[3] // 2, 1) and y.shape[2] != 1


def _complex_rows(m: Match, name: str) -> torch.Tensor | str:
    """The [positions, d/2] table behind the broadcast `name` column, or why not."""
    y, t = m.matched[0].outputs[0].type, m[name].type
    seq, d = (y.shape[1] if _seq_first(m) else y.shape[2]), y.shape[3]
    data = m.data(name).squeeze(-1)
    if _seq_first(m):
        if t.shape[-4:] != (seq, 1, d // 2, 1):
            return f"{name} table {t} is not [.., {seq}, 1, {d // 2}, 1]"
        data = data.squeeze(-2)
    elif t.rank < 3 or t.shape[-3:] != (seq, d // 2, 1):
        return f"{name} table {t} is not [.., {seq}, {d // 2}, 1]"
    rows = _rows(data, seq)
    return "the cos/sin tables vary along batch or heads" if rows is None else rows


def _complex_rewrite(b: Builder, m: Match) -> Value:
    x, y = m["x"], m.matched[0].outputs[0].type
    if x.type.shape != y.shape:
        x = b.op("reshape", [x], {"shape": y.shape})
    first = _seq_first(m)
    if first:  # rope_lut rotates [batch, heads, seq, d]
        x = b.op("transpose", [x], {"perm": (0, 2, 1, 3)})
    seq, dt = x.type.shape[2], y.dtype.torch
    tables = []
    for name in ("cos", "sin"):
        rows = _complex_rows(m, name)
        assert not isinstance(rows, str), rows  # the check refused this already
        tables.append(b.const(f"{m[name].name}_lut", rows.to(dt).contiguous()))
    out = b.op("rope_lut", [x, _positions(b, seq), *tables], {"layout": "interleaved"})
    return b.op("transpose", [out], {"perm": (0, 2, 1, 3)}) if first else out


def _complex_pattern() -> object:
    pairs = op("reshape", var("x"), bind="p")
    re, im = op("slice", pairs, bind="re"), op("slice", pairs, bind="im")
    cos, sin = var("cos", is_const), var("sin", is_const)
    real = op("sub", op("mul", re, cos), op("mul", im, sin))
    imag = op("add", op("mul", re, sin), op("mul", im, cos))
    return op("reshape", op("concat", real, imag, bind="cat"))


# -- ONNX RotaryEmbedding ------------------------------------------------------------------------

def _onnx_check(m: Match) -> str | None:
    x, n = m["x"], m.node("rot")
    if len(n.inputs) == 4:
        return None
    seq = x.type.shape[-2] if x.type.rank == 4 else x.type.shape[1]
    if _rows(m.data("cos"), seq) is None or _rows(m.data("sin"), seq) is None:
        return "the cos/sin caches vary along batch"
    return None


def _onnx_rewrite(b: Builder, m: Match) -> Value:
    """rope_lut over [b, h, s, d]; com.microsoft's 3-D [b, s, h*d] is split into heads around
    it (the attention that reads it splits them again, and the transposes cancel)."""
    x, n = m["x"], m.node("rot")
    if x.type.rank == 3:
        batch, seq, hidden = x.type.shape
        h = int(n.attrs["num_heads"])
        x = b.op("transpose", [b.op("reshape", [x], {"shape": (batch, seq, h, hidden // h)})], {"perm": (0, 2, 1, 3)})
    layout = "interleaved" if n.attrs.get("interleaved") else "half"
    if len(n.inputs) == 4:  # caches indexed by position ids already: they are the tables
        y = b.op("rope_lut", [x, n.inputs[3], m["cos"], m["sin"]], {"layout": layout})
    else:
        seq = x.type.shape[-2]
        cos, sin = _rows(m.data("cos"), seq), _rows(m.data("sin"), seq)
        assert cos is not None and sin is not None
        tables = [b.const(f"{m[k].name}_lut", t.contiguous()) for k, t in (("cos", cos), ("sin", sin))]
        y = b.op("rope_lut", [x, _positions(b, seq), *tables], {"layout": layout})
    if m["x"].type.rank == 3:
        y = b.op("reshape", [b.op("transpose", [y], {"perm": (0, 2, 1, 3)})], {"shape": m["x"].type.shape})
    return y


@dataclass(frozen=True)
class RoPEFusion(RewritePass):
    name = "rope-fusion"

    def rules(self) -> Sequence[Rule]:
        tables: TableCache = {}  # rope-half-positions' evaluations, this run's
        onnx3 = op("rotary_embedding", var("x"), var("cos", is_const), var("sin", is_const), bind="rot")
        onnx4 = op("rotary_embedding", var("x"), var("cos", is_const), var("sin", is_const), var("pos"), bind="rot")
        return [
            Rule("rope-half", _half_pattern(), _lut("half", "halves"), _half_check),
            Rule("rope-half-positions", _runtime_pattern(), lambda b, m: _runtime_rewrite(b, m, tables),
                 lambda m: _runtime_check(m, tables)),
            Rule("rope-deinterleave", _pairs_pattern(), _lut("deinterleave", "none"), _pairs_check),
            Rule("rope-complex", _complex_pattern(), _complex_rewrite, _complex_check),
            Rule("rope-every-two", _every_two_pattern(), _lut("interleaved", "pairs"), _every_two_check),
            Rule("rope-split-halves", _split_pattern(), _lut("half", "none", _split_x), _split_check),
            Rule("rope-onnx", onnx3, _onnx_rewrite, _onnx_check),
            Rule("rope-onnx-positions", onnx4, _onnx_rewrite, _onnx_check),
        ]
