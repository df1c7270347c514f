"""SwiGLU fusion: the gated MLP activation as one op.

    %s = silu(%gate)
    %y = mul(%s, %up)              (either order)
  ->
    %y = swiglu(%gate, %up)

`mul(%g, sigmoid(%g))` reaches this form through canonicalisation. Left alone:
operands of different shapes (a broadcast is not a gated MLP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from npuc.passes.rewrite import RewritePass, Rule, op, var


@dataclass(frozen=True)
class SwiGLUFusion(RewritePass):
    name = "swiglu-fusion"

    def rules(self) -> Sequence[Rule]:
        return [Rule("swiglu", op("mul", op("silu", var("gate")), var("up")),
                     lambda b, m: b.op("swiglu", [m["gate"], m["up"]]),
                     check=lambda m: None if m["gate"].type == m["up"].type
                     else f"gate {m['gate'].type} and up {m['up'].type} differ (a broadcast)")]
