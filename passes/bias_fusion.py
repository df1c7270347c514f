"""Bias fusion: a matrix product plus a bias vector is one linear-with-bias.

    %y = linear(%x, @w)                       (one use)
    %z = add(%y, @b : f32[n])                 (either order)
  ->
    %z = linear(%x, @w, @b)

Qwen2's q/k/v projections through ONNX are the real case. Left alone: a bias
that would broadcast the result to a bigger shape, a bias that is not constant,
and a product that has another user (the add is then not the only reader).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from npuc.ir import Value
from npuc.passes.rewrite import Builder, Match, RewritePass, Rule, op, var


def _check(m: Match) -> str | None:
    y, bias = m["y"], m["b"]
    n = y.type.shape[-1]
    if bias.type.numel != n or (bias.type.rank and bias.type.shape[-1] != n):
        return f"bias {bias.type} does not run along the output features ({n})"
    if m.matched[0].outputs[0].type != y.type:
        return "the bias broadcasts the result to another shape"
    if bias.type.dtype != y.type.dtype:
        return "bias dtype differs"
    return None


def _rewrite(b: Builder, m: Match) -> Value:
    bias = m["b"]
    if bias.type.shape != (bias.type.numel,):
        bias = b.op("reshape", [bias], {"shape": (bias.type.numel,)}, name=f"{bias.name}_flat")
    return b.op("linear", [m["x"], m["w"], bias], dict(m.node("y").attrs))


@dataclass(frozen=True)
class BiasFusion(RewritePass):
    name = "bias-fusion"

    def rules(self) -> Sequence[Rule]:
        return [Rule("linear-bias", op("add", op("linear", var("x"), var("w"), bind="y"),
                                       var("b", lambda v: v.is_const)), _rewrite, _check)]
