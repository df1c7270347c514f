"""Textual IR, one line per node, in the torch.fx/MLIR spirit:

    graph main(%input_ids : i64[1,16]) {
      const @model.norm.weight : f32[64]
      %x : f32[1,16,64] = embedding(@model.embed_tokens.weight, %input_ids)
      %q : f32[1,16,32], %k : f32[1,16,32] = split[axis=-1, sizes=[32,32]](%x)
      return %logits

A program with a KV cache declares its persistent tensors and their new values:

      state %kv_cache.0.k : f32[1,2,64,16]
      %w : f32[1,2,64,16] = kv_write(%kv_cache.0.k, %k, %position)
      update %kv_cache.0.k = %w
    }

Attributes print sorted by name; floats use `repr`, so `parse(print(g)) == g`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from npuc.ir.graph import Graph, Node, format_name
from npuc.ir.types import DType


def format_attr(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, DType):
        return v.value
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        r = repr(v)
        return r
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ",".join(format_attr(x) for x in v) + "]"
    raise TypeError(f"unprintable attribute {v!r}")


def format_node(node: Node) -> str:
    outs = ", ".join(f"%{format_name(o.name)} : {o.type}" for o in node.outputs)
    attrs = ""
    if node.attrs:
        attrs = "[" + ", ".join(f"{k}={format_attr(node.attrs[k])}" for k in sorted(node.attrs)) + "]"
    args = ", ".join(v.ref() for v in node.inputs)
    lhs = f"{outs} = " if outs else ""
    return f"{lhs}{node.op}{attrs}({args})"


def print_graph(g: Graph) -> str:
    ins = ", ".join(f"%{format_name(v.name)} : {v.type}" for v in g.inputs)
    lines = [f"graph {format_name(g.name, sigil=False)}({ins}) {{"]
    for c in g.constants.values():
        lines.append(f"  const @{format_name(c.name)} : {c.type}")
    for st in g.states.values():
        lines.append(f"  state %{format_name(st.name)} : {st.type}")
    for n in g.nodes:
        lines.append("  " + format_node(n))
    for name, u in g.state_updates.items():
        lines.append(f"  update %{format_name(name)} = {u.ref()}")
    lines.append("  return " + ", ".join(v.ref() for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_to_json(g: Graph) -> dict[str, Any]:
    """The graph as plain JSON data (`npuc compile --mode=1 --model ...`): what the text
    form says, keyed for tools. Attribute values are their text form."""

    def ty(v: Any) -> dict[str, Any]:
        return {"name": v.name, "dtype": v.type.dtype.value, "shape": list(v.type.shape)}

    return {
        "name": g.name,
        "inputs": [ty(v) for v in g.inputs],
        "states": [ty(v) for v in g.states.values()],
        "constants": [ty(v) for v in g.constants.values()],
        "nodes": [{"op": n.op, "name": n.name, "inputs": [v.name for v in n.inputs],
                   "outputs": [ty(v) for v in n.outputs],
                   "attrs": {k: format_attr(n.attrs[k]) for k in sorted(n.attrs)}} for n in g.nodes],
        "outputs": [v.name for v in g.outputs],
        "state_updates": {k: v.name for k, v in g.state_updates.items()},
    }
