"""Constant folding: a node whose operands are all constants (or that has none,
like `arange`) is evaluated at compile time with its reference kernel, and its
results become graph constants.

    const @inv_freq : f32[4]
    %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
    %p2 : f32[16,1] = reshape[shape=[16,1]](%pos)
    %f : f32[16,4] = mul(%p2, @inv_freq)
  ->
    const @f_folded : f32[16,4]        # (@pos_folded, @p2_folded are left for DCE)

Past `max_bytes`, a dtype or layout change of one weight (cast, tile pad, reshape,
transpose, slice) is folded where its result takes the place of the weight, so the
.om holds one form of it (computed when the .om is written, one weight at a time,
for weights in a file):

    %w_bf16 : bf16[32000,768] = cast[dtype=bf16](@lm_head.weight : f32[32000,768])
  ->                                                   (@lm_head.weight read by nothing else)
    const @w_bf16_folded : bf16[32000,768]

and a narrowing cast is folded always: left in the graph, it would convert the
weight on every run. Left alone: other results larger than `max_bytes` (folding
would add a second big copy, e.g. a transpose of an embedding table the gather still
reads), anything else past `max_bytes` (a sum over a big weight, an expand), and
graph outputs (they keep a producing node, so the runtime writes them), and
`dequantize` of a quantized weight (folding it would store the weight unpacked).
"""

from __future__ import annotations

from dataclasses import dataclass

from npuc.ir import Graph, Node
from npuc.ir.evaluate import fold_node, foldable
from npuc.passes.manager import Pass, PassResult


@dataclass(frozen=True)
class ConstantFolding(Pass):
    name = "constant-folding"
    max_bytes: int = 16 << 20

    def call(self, g: Graph) -> PassResult:
        outputs = g.root_ids()
        modified = False
        for node in list(g.nodes):
            if any(id(o) in outputs for o in node.outputs) or not _fold(node, self.max_bytes):
                continue
            fold_node(g, node)
            modified = True
        return PassResult(g, modified)


def _fold(node: Node, max_bytes: int) -> bool:
    if node.op == "dequantize" or not all(v.is_const for v in node.inputs):
        return False  # a quantized weight stays packed in the .om: that is its point
    if foldable(node, max_bytes):
        return True
    if node.op not in _RETYPES or not node.inputs:
        return False
    w, out = node.inputs[0], sum(o.type.nbytes for o in node.outputs)
    if node.op == "cast" and out <= w.type.nbytes:
        return True
    return len(w.uses) == 1 and all(v.type.nbytes <= max_bytes for v in node.inputs[1:]) \
        and out <= w.type.nbytes + max_bytes


# Ops that give one weight another dtype or layout: folded past max_bytes (see above).
_RETYPES = frozenset({"cast", "pad", "reshape", "transpose", "slice"})
