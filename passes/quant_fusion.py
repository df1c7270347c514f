"""Quant fusion: a product or a row lookup over a dequantized weight reads the packed
codes itself, so no dequantized copy of a weight is ever made at run time.

    %w : f32[n,k] = dequantize[bits, group_size](@q, @scale, @zero)
    %y = linear(%x, %w, @b?)                                  (weight layout nk)
  ->
    %y = qlinear[bits, group_size](%x, @q, @scale, @zero, @b?)

    %t : f32[v,h] = dequantize[bits, group_size](@q, @scale, @zero)
    %e = gather[axis=0](%t, %ids)
  ->
    %e = dequantize[bits, group_size](gather(@q, %ids), gather(@scale, %ids), gather(@zero, %ids))

    %gu : f32[E,2I,H] = dequantize[bits, group_size](@gu.q, @gu.scale, @gu.zero)
    %dn : f32[E,H,I]  = dequantize[bits, group_size](@dn.q, @dn.scale, @dn.zero)
    %y = fused_moe[...](%x, @router, %gu, %dn, @bias?)
  ->
    %y = qmoe[..., bits, group_size, down_group_size](%x, @router, @gu.q, @gu.scale, @gu.zero, @dn.q, @dn.scale,
                                                      @dn.zero, @bias?)

(qmoe unpacks only the experts the tokens pick, when they pick them.)

The dequantize nodes come from `--quant_type` (passes/quantize.py) or from an imported
quantized model (GPTQ, AWQ, MatMulNBits, ONNX DequantizeLinear). Left alone: a
dequantized weight in layout kn (its groups would run along N), and other readers of a
dequantized weight: they dequantize on every run, which is correct and slow
(docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from npuc.ir import Graph, Node, Value, get_op
from npuc.passes.manager import Pass, PassResult


def _dequantized(node: Node, index: int, rank: int = 2) -> Node | None:
    p = node.inputs[index].producer
    return p if p is not None and p.op == "dequantize" and p.outputs[0].type.rank == rank else None


@dataclass(frozen=True)
class QuantFusion(Pass):
    name = "quant-fusion"

    def call(self, g: Graph) -> PassResult:
        details: dict[str, list[str]] = {"qlinear": [], "qgather": [], "qmoe": []}
        for node in list(g.nodes):
            if node.op == "linear" and get_op("linear").full_attrs(node.attrs)["weight_layout"] == "nk":
                dq = _dequantized(node, 1)
                if dq is None or dq.outputs[0].type.dtype != node.inputs[0].type.dtype:
                    continue
                attrs = {"bits": dq.attrs["bits"], "group_size": dq.attrs["group_size"]}
                if node.attrs.get("valid_rows") is not None:
                    attrs["valid_rows"] = node.attrs["valid_rows"]
                ins = [node.inputs[0], *dq.inputs, *node.inputs[2:]]
                self._replace(g, node, "qlinear", ins, attrs)
                details["qlinear"].append(node.name)
            elif node.op == "gather" and node.attrs.get("axis", 0) == 0:
                dq = _dequantized(node, 0)
                if dq is None:
                    continue
                ids = node.inputs[1]
                rows = [g.add_node("gather", [v, ids], get_op("gather").infer_types([v.type, ids.type], {"axis": 0}),
                                   {"axis": 0}, names=f"{node.name}_{part}", before=node).outputs[0]
                        for v, part in zip(dq.inputs, ("q", "scale", "zero"), strict=True)]
                self._replace(g, node, "dequantize", rows, dict(dq.attrs))
                details["qgather"].append(node.name)
            elif node.op == "fused_moe":
                gu, dn = _dequantized(node, 2, 3), _dequantized(node, 3, 3)
                if gu is None or dn is None or dn.attrs["bits"] != gu.attrs["bits"] \
                        or any(d.outputs[0].type.dtype != node.inputs[0].type.dtype for d in (gu, dn)):
                    continue
                attrs = {**node.attrs, "bits": gu.attrs["bits"], "group_size": gu.attrs["group_size"],
                         "down_group_size": dn.attrs["group_size"]}
                self._replace(g, node, "qmoe", [*node.inputs[:2], *gu.inputs, *dn.inputs, *node.inputs[4:]], attrs)
                details["qmoe"].append(node.name)
        for node in list(g.nodes):  # dequantize nodes nothing reads any more
            if node.op == "dequantize" and not node.outputs[0].uses and not g.is_root(node.outputs[0]):
                g.remove_node(node)
        return PassResult(g, any(details.values()), details)

    @staticmethod
    def _replace(g: Graph, node: Node, op: str, ins: list[Value], attrs: dict[str, Any]) -> None:
        out = node.outputs[0]
        types = get_op(op).infer_types([v.type for v in ins], attrs)
        new = g.add_node(op, ins, types, attrs, names=out.name + "_q", before=node).outputs[0]
        g.replace_all_uses_with(out, new)
        g.remove_node(node)
        g.rename(new, out.name)
