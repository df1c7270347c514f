"""Constant folding: a node whose operands are all constants (or that has none,
like `arange`) is evaluated at compile time with its reference kernel, and its
results become graph constants.

    const @inv_freq : f32[4]
    %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
    %p2 : f32[16,1] = reshape[shape=[16,1]](%pos)
    %f : f32[16,4] = mul(%p2, @inv_freq)
  ->
    const @f_folded : f32[16,4]        # (@pos_folded, @p2_folded are left for DCE)

Left alone: results larger than `max_bytes` (folding would copy big weights into
memory, e.g. a transpose of an embedding table), and graph outputs (they keep a
producing node, so the runtime writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from npuc.ir import Graph
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
            if any(id(o) in outputs for o in node.outputs) or not foldable(node, self.max_bytes):
                continue
            fold_node(g, node)
            modified = True
        return PassResult(g, modified)
