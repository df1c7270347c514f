"""Dead code elimination: drop nodes none of whose outputs is used, and
constants nothing reads.

    %a : f32[4] = neg(%x)          # unused
    %b : f32[4] = exp(%x)
    return %b
  ->
    %b : f32[4] = exp(%x)
    return %b

Every op in the registry is pure, so an unused result is always safe to drop; a
state's new value (`update`) counts as used.
"""

from __future__ import annotations

from dataclasses import dataclass

from npuc.ir import Graph
from npuc.passes.manager import Pass, PassResult


@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    name = "dce"

    def call(self, g: Graph) -> PassResult:
        outputs = g.root_ids()
        modified = False
        for node in reversed(list(g.nodes)):
            if all(not o.uses and id(o) not in outputs for o in node.outputs):
                g.remove_node(node)
                modified = True
        for c in list(g.constants.values()):
            if not c.uses and id(c) not in outputs:
                g.remove_constant(c)
                modified = True
        return PassResult(g, modified)
