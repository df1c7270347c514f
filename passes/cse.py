"""Common subexpression elimination: two nodes with the same op, attributes and
operands compute the same value (every op is pure), so the later one goes.
Small constants with equal bytes merge too (exporters often repeat a scalar).

    %a = exp(%x)
    %b = exp(%x)          ->   %a = exp(%x)
    %c = add(%a, %b)           %c = add(%a, %a)

Left alone: constants over `max_const_bytes`, so that weights are never read to
compare them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from npuc.ir import Graph, TensorSource
from npuc.ir.graph import byte_view
from npuc.ir.printer import format_attr
from npuc.passes.manager import Pass, PassResult


@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    name = "cse"
    max_const_bytes: int = 1 << 16

    def call(self, g: Graph) -> PassResult:
        modified = False
        seen_const: dict[tuple[Any, ...], Any] = {}
        for c in list(g.constants.values()):
            if not isinstance(c.const, TensorSource) or c.type.nbytes > self.max_const_bytes:
                continue
            raw = byte_view(c.const.load()).numpy().tobytes()
            key = (str(c.type), hashlib.sha256(raw).hexdigest())
            if key in seen_const:
                g.replace_all_uses_with(c, seen_const[key])
                modified = True
            else:
                seen_const[key] = c
        seen: dict[tuple[Any, ...], Any] = {}
        outputs = g.root_ids()
        for node in list(g.nodes):
            if any(id(o) in outputs for o in node.outputs):
                continue  # a graph output keeps its own node and name
            nkey = (node.op, tuple(id(v) for v in node.inputs),
                    tuple((k, format_attr(node.attrs[k])) for k in sorted(node.attrs)))
            if nkey in seen:
                for old, new in zip(node.outputs, seen[nkey].outputs, strict=True):
                    g.replace_all_uses_with(old, new)
                modified = True
            else:
                seen[nkey] = node
        return PassResult(g, modified)
