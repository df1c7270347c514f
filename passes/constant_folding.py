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

import torch
from npuc.errors import InternalError
from npuc.ir import Graph, TensorSource, get_op
from npuc.passes.manager import Pass, PassResult


@dataclass(frozen=True)
class ConstantFolding(Pass):
    name = "constant-folding"
    max_bytes: int = 16 << 20

    def call(self, g: Graph) -> PassResult:
        outputs = {id(v) for v in g.outputs}
        modified = False
        for node in list(g.nodes):
            if not all(v.is_const for v in node.inputs):
                continue
            if any(id(o) in outputs for o in node.outputs):
                continue
            if sum(o.type.nbytes for o in node.outputs) > self.max_bytes:
                continue
            if any(v.type.nbytes > self.max_bytes for v in node.inputs):
                continue
            with torch.no_grad():
                results = get_op(node.op).run([v.const.load() for v in node.inputs], node.attrs)
            for out, t in zip(node.outputs, results, strict=True):
                if tuple(t.shape) != out.type.shape or t.dtype != out.type.dtype.torch:
                    raise InternalError(f"folding {node.name}: kernel returned {t.dtype}{list(t.shape)}, "
                                        f"expected {out.type}")
                c = g.add_constant(out.name + "_folded", out.type, TensorSource(t.contiguous().clone(), "folded"))
                g.replace_all_uses_with(out, c)
            g.remove_node(node)
            modified = True
        return PassResult(g, modified)
