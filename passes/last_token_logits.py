"""Last-token logits: a prefill program computes the logits of one row per sequence,
the one generation reads, not all S (TensorRT-LLM's default, gather_context_logits off).

Generation pads a short prompt on the right and reads only the logits of its last
position, so the LM head over the other S-1 rows is wasted: a quarter of prefill's
FLOPs on a 125M model, and a [b, S, vocab] output buffer (262 MB at S=2048, vocab
32000). The program gets an input `%last_token : i64[b]`, the row (0..S-1) of each
sequence, and the row is picked before the final norm (which is row-wise), so the norm,
the LM head and everything after them run on one row:

    graph prefill(%input_ids : i64[1,8]) {
      %h : f32[1,8,64] = add(%a, %b)
      %n : f32[1,8,64] = rms_norm[axis=2](%h, @model.norm.weight)
      %logits : f32[1,8,128] = linear(%n, @lm_head.weight)
      return %logits
    }
  ->
    graph prefill(%input_ids : i64[1,8], %last_token : i64[1]) {
      %h : f32[1,8,64] = add(%a, %b)
      %h_last : f32[1,64] = index(%h, @batch_rows, %last_token)     @batch_rows = 0..b-1
      %h_last_row : f32[1,1,64] = reshape[shape=[1,1,64]](%h_last)
      %n : f32[1,1,64] = rms_norm[axis=2](%h_last_row, @model.norm.weight)
      %logits : f32[1,1,128] = linear(%n, @lm_head.weight)
      return %logits
    }

The LM head is a `linear` (any layout, a bias allowed; a tied embedding is just its
weight) or a `matmul` by a constant 2-D weight, whose input is the [b, S, H] hidden
state. Between it and the output may lie row-wise ops only, each rebuilt on the row
with its type inferred again: casts and element-wise math, binary ops with a constant
that does not run along the sequence (a bias, a soft-cap's scale), softmax or
log-softmax over the last axis, and reshapes that keep [b, S] in front (their shape
attribute is rewritten). The runtime refuses a `last_token` outside 0..S-1
(NPUC-E0108); it is the `index` operand `Session.index_rows` reports.

Left alone (the output keeps its S rows): an output that is not such a chain from such
a head, e.g. a softmax over the sequence. Where no output is, the pass changes nothing
and says why in its details and a warning (`required=False`: the default under
--max_seq_len), or refuses with NPUC-E0129 (`required=True`: --prefill_logits last
was asked for). A hidden state whose norm has another reader is picked after the norm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import DType, Graph, Node, TensorSource, TensorType, Value, get_op
from npuc.ir.ops import norm_axis
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")

# The input's name: the runtime (generate, verify) looks it up by this name.
LAST_TOKEN = "last_token"

# Ops that compute each row from that row alone, whatever their operand shapes.
_UNARY = frozenset({"cast", "neg", "abs", "relu", "sigmoid", "tanh", "silu", "gelu", "exp", "log", "sqrt",
                    "rsqrt", "reciprocal", "softplus", "erf", "floor", "ceil", "round"})
_BINARY = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum"})
_LAST_AXIS = frozenset({"softmax", "log_softmax"})
_NORMS = frozenset({"rms_norm", "layer_norm"})


@dataclass(frozen=True)
class _Chain:
    """An output computed from the LM head's rows: what to rebuild on one row."""
    source: Value  # the [b, S, H] value whose row is picked
    nodes: list[tuple[Node, int]]  # (node, operand on the chain), in program order: [norm], head, row-wise ops


def _rows(v: Value, b: int, s: int) -> bool:
    return v.type.rank >= 2 and v.type.shape[:2] == (b, s)


def _row_wise(n: Node, operand: int, b: int, s: int) -> str | None:
    """Why `n` does not compute each row of its operand `operand` from that row alone (None: it does)."""
    out = n.outputs[0]
    if len(n.outputs) != 1 or not _rows(out, b, s):
        return f"{n.name}: {n.op} does not keep the [batch, seq] rows"
    if n.op in _UNARY:
        return None
    if n.op in _BINARY:
        other = n.inputs[1 - operand]
        lead = out.type.rank - other.type.rank  # dims the constant is broadcast over
        if not other.is_const or (other.type.rank > out.type.rank - 2 and other.type.shape[1 - lead] != 1):
            return f"{n.name}: {n.op} with {other.ref()}, which is not a constant free of the sequence axis"
        return None
    if n.op in _LAST_AXIS:
        return None if norm_axis(n.attrs["axis"], out.type.rank) == out.type.rank - 1 else \
            f"{n.name}: {n.op} runs along another axis than the last"
    if n.op == "reshape":
        return None if _rows(n.inputs[0], b, s) else f"{n.name}: reshape mixes the [batch, seq] rows"
    return f"{n.name}: {n.op} is neither an LM head (a product of the [{b},{s},H] hidden state by a constant " \
        "weight) nor known to be row-wise"


def _head(n: Node, b: int, s: int) -> bool:
    """An LM head: a product of the [b, S, H] hidden state by a constant 2-D weight."""
    if n.op == "linear":
        return _rows(n.inputs[0], b, s) and n.inputs[0].type.rank == 3 and n.inputs[1].is_const
    return n.op == "matmul" and _rows(n.inputs[0], b, s) and n.inputs[0].type.rank == 3 \
        and n.inputs[1].is_const and n.inputs[1].type.rank == 2


def _trace(out: Value, b: int, s: int) -> _Chain | str:
    """The chain from an LM head to `out`, or why `out` is not one."""
    if not _rows(out, b, s):
        return f"{out.ref()} {out.type} has no [{b},{s}] rows"
    after: list[tuple[Node, int]] = []
    v = out
    while True:
        n = v.producer
        if n is None:
            return f"{out.ref()} is not computed by an LM head (a product of the [{b},{s},H] hidden state)"
        if _head(n, b, s):
            break
        on = [i for i, x in enumerate(n.inputs) if not x.is_const]
        if len(on) != 1:
            return f"{n.name}: {n.op} reads {len(on)} computed values, not the rows of one"
        why = _row_wise(n, on[0], b, s)
        if why is not None:
            return why
        after.append((n, on[0]))
        v = n.inputs[on[0]]
    chain = [(n, 0)]
    x = n.inputs[0]
    norm = x.producer
    # A norm over the hidden axis alone is row-wise: picking its input saves it S-1 rows too.
    if norm is not None and norm.op in _NORMS and len(x.uses) == 1 and not x.graph.is_root(x) \
            and norm_axis(get_op(norm.op).full_attrs(norm.attrs)["axis"], x.type.rank) == x.type.rank - 1:
        chain.insert(0, (norm, 0))
        x = norm.inputs[0]
    return _Chain(x, chain + after[::-1])


def lm_head_input(out: Value, b: int, s: int) -> Value | str:
    """The [b, s, H] value read by the LM head that computes `out` (after the final norm), or
    why no LM head does (passes/expose_hidden.py)."""
    chain = _trace(out, b, s)
    if isinstance(chain, str):
        return chain
    return next(n for n, _ in chain.nodes if _head(n, b, s)).inputs[0]


def _refuse(msg: str) -> NpucError:
    return NpucError("NPUC-E0129", f"--prefill_logits last: {msg}",
                     "compile with --prefill_logits all (every row's logits, as the model computes them)",
                     exit_code=EXIT_UNSUPPORTED)


@dataclass(frozen=True)
class LastTokenLogits(Pass):
    name = "last-token-logits"
    # Asked for explicitly: a model the pass cannot rewrite is an error, not a warning.
    required: bool = False

    def call(self, g: Graph) -> PassResult:
        ids = [v for v in g.inputs if not v.type.dtype.is_float and v.type.rank == 2]
        if len(ids) != 1:
            return self._leave(g, "the program has no single [batch, seq] token-ids input")
        b, s = ids[0].type.shape
        # A recurrent model's prefill has the input already (passes/recurrent_state.py): the
        # row whose state it keeps is the row whose logits it computes.
        given = next((v for v in g.inputs if v.name == LAST_TOKEN and v.type == TensorType((b,), DType.i64)), None)
        if given is None and any(v.name == LAST_TOKEN for v in g.values()):
            return self._leave(g, f"the model already has a value named {LAST_TOKEN!r}")
        found = [(o, _trace(o, b, s)) for o in g.outputs]
        chains = [(o, c) for o, c in found if isinstance(c, _Chain)]
        if not chains:
            return self._leave(g, "; ".join(str(c) for _, c in found))
        last = given or g.add_input(LAST_TOKEN, TensorType((b,), DType.i64))
        batch = g.add_constant("batch_rows", TensorType((b,), DType.i64), TensorSource(torch.arange(b)))
        built = [pair for out, chain in chains for pair in self._rewrite(g, out, chain, last, batch)]
        # The old rows, as far as nothing else reads them, consumers first; their names go to
        # the rebuilt values (an output's to the output, where two chains rebuilt one node).
        order = {id(n): i for i, n in enumerate(g.nodes)}
        for n, new in sorted(built, key=lambda p: (-order[id(p[0])], not g.is_root(p[1]))):
            old = n.outputs[0]
            if g.has_node(n) and not old.uses and not g.is_root(old):
                name = old.name
                g.remove_node(n)
                g.rename(new, name)
        return PassResult(g, True, {"last_row": [o.name for o, _ in chains],
                                    "all_rows": [f"{o.name}: {c}" for o, c in found if isinstance(c, str)]})

    def _leave(self, g: Graph, why: str) -> PassResult:
        if self.required:
            raise _refuse(why)
        log.warning("prefill computes the logits of every row (--prefill_logits all): %s", why)
        return PassResult(g, False, {"fallback": why})

    @staticmethod
    def _rewrite(g: Graph, out: Value, chain: _Chain, last: Value, batch: Value) -> list[tuple[Node, Value]]:
        """Rebuild the chain on row last_token of chain.source and make it the output; returns
        each old node with its rebuilt value."""
        src, first = chain.source, chain.nodes[0][0]
        b, _, *rest = src.type.shape
        picked = g.add_node("index", [src, batch, last], [TensorType((b, *rest), src.type.dtype)],
                            names=f"{src.name}_last", before=first).outputs[0]
        v = g.add_node("reshape", [picked], [src.type.with_shape((b, 1, *rest))], {"shape": (b, 1, *rest)},
                       names=f"{src.name}_last_row", before=first).outputs[0]
        built: list[tuple[Node, Value]] = []
        for n, i in chain.nodes:
            ins = [v if j == i else x for j, x in enumerate(n.inputs)]
            attrs = dict(n.attrs)
            if n.op == "reshape":
                attrs["shape"] = (b, 1, *n.attrs["shape"][2:])
            types = get_op(n.op).infer_types([x.type for x in ins], attrs)
            v = g.add_node(n.op, ins, types, attrs, names=f"{n.outputs[0].name}_last", before=n).outputs[0]
            built.append((n, v))
        # Only the output changes: any other reader of the old values still gets every row.
        g.set_outputs([v if o is out else o for o in g.outputs])
        return built
