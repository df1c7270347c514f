"""Quantization at compile time (`--quant_type w8a16|w4a16|w8a8|w4a8`): round to
nearest, one weight at a time, when the .om is written (weights in a file are never
read while the graph is optimised).

    %y : f32[1,16,768] = linear(%x, @w : f32[2048,768])
  ->                                                            (w4a16, groups of 128)
    %w_dq : f32[2048,768] = dequantize[bits=4, group_size=128](@w.q : u8[2048,384],
                                                               @w.scale : f32[2048,6], @w.zero : u8[2048,6])
    %y : f32[1,16,768] = linear(%x, %w_dq)                      (quant-fusion then makes it a qlinear)

What is quantized, and how:
- every `linear` over a constant weight (layout nk or kn; kn is stored transposed, so
  groups always run along K): w8a16 symmetric int8 per output channel (or per group
  with `group_size`); w4a16 asymmetric int4 per group (default 128);
- the LM head (a linear whose result reaches a graph output through no other matrix
  product) keeps 8 bits under w4a16: logits are where 4-bit error shows most, and
  NNCF and llama.cpp keep the output layer at higher precision too;
- embedding tables (`gather` along axis 0 of a constant [vocab, hidden] table) take the
  layers' format: a step reads one row, and llama.cpp's Q4_0 does the same;
- DeepSeek's routed experts (`fused_moe`'s gate_up and down) take the layers' format.

w8a8 and w4a8 quantize the activations too: each such linear becomes a `qlinear` with
act_bits 8 here (int8 activations per row and block of 32, integer products; ir/quant.py),
its weight in groups of 32 by default with f16 scales, the codes rounded against the
f16 scale. The LM head takes 8 bits and int8 activations; embedding rows and experts are
only dequantized (no activations to quantize). A product whose K or group is no multiple
of 32 keeps float activations, listed in the details ("float activations").

    %y = linear(%x, @w)  ->  %y = qlinear[bits=4, group_size=32, act_bits=8](%x, @w.q, @w.scale, @w.zero)

A weight whose K the group does not divide falls back to int8 per channel, listed in
the details ("fallback") and logged, unless `strict`, which refuses it (NPUC-E0131).
Weights named in `exclude` (the node or the weight's name, as `npuc dump` prints them)
are left as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir import DType, Graph, Node, TensorType, Value, get_op
from npuc.ir.quant import ACT_BLOCK, code_dtype, dequantize_attrs, packed_k, quantize_rtn
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")

QUANT_TYPES = {"w8a16": 8, "w4a16": 4, "w8a8": 8, "w4a8": 4}
ACT8 = frozenset({"w8a8", "w4a8"})  # int8 activations (ir/quant.py, act_bits 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = {8: None, 4: 128}  # None: one group per output channel
DEFAULT_GROUP_ACT8 = 32
CUBE = frozenset({"linear", "matmul", "qlinear", "fused_attention", "cached_attention", "mla_attention",
                  "fused_moe", "qmoe"})


def check_quant(quant_type: str | None, group_size: int | None) -> tuple[int, int | None, int | None] | None:
    """(bits, group size or None for per channel, activation bits or None for float), or
    None without quantization; a usage error for a type or group size npuc does not offer."""
    if quant_type is None:
        if group_size is not None:
            raise NpucError("NPUC-E0131", f"--group_size {group_size} without --quant_type",
                            "add --quant_type w4a16 (or w8a16)", exit_code=EXIT_USAGE)
        return None
    if quant_type not in QUANT_TYPES:
        raise NpucError("NPUC-E0131", f"unknown --quant_type {quant_type!r}",
                        "one of: " + ", ".join(QUANT_TYPES), exit_code=EXIT_USAGE)
    if group_size is not None and group_size not in GROUP_SIZES:
        raise NpucError("NPUC-E0131", f"--group_size {group_size} is not offered",
                        "one of: " + ", ".join(map(str, GROUP_SIZES)), exit_code=EXIT_USAGE)
    bits = QUANT_TYPES[quant_type]
    if quant_type in ACT8:
        return bits, group_size if group_size is not None else DEFAULT_GROUP_ACT8, 8
    return bits, group_size if group_size is not None else DEFAULT_GROUP[bits], None


class _Quantized:
    """One weight's (q, scale, zero), computed once for its three constants."""

    def __init__(self, source: Any, transpose: bool, bits: int, group: int, symmetric: bool,
                 f16_scale: bool = False) -> None:
        self.source, self.transpose, self.bits, self.group, self.symmetric = source, transpose, bits, group, symmetric
        self.f16_scale = f16_scale
        self._parts: tuple[torch.Tensor, ...] | None = None
        self._taken = 0

    def part(self, i: int) -> torch.Tensor:
        if self._parts is None:
            w = self.source.load()
            w = w.t() if self.transpose else w
            self._parts = quantize_rtn(w.contiguous(), self.bits, self.group, self.symmetric, self.f16_scale)
        t = self._parts[i]
        self._taken += 1
        if self._taken % 3 == 0:  # all three written: let the memory go
            self._parts = None
        return t


class QuantizedSource:
    """One of a quantized weight's three constants (0 codes, 1 scale, 2 zero points)."""

    in_memory = False  # computed when the .om is written

    def __init__(self, q: _Quantized, index: int) -> None:
        self.q, self.index = q, index

    def load(self) -> torch.Tensor:
        return self.q.part(self.index)

    def describe(self) -> str:
        # What the backend shares between programs by (see backend/lower.py): all that decides the bytes.
        q = self.q
        what = ("codes", "scales", "zero points")[self.index]
        form = f"{q.bits}-bit {'symmetric' if q.symmetric else 'asymmetric'}, groups of {q.group}" \
            + (", f16 scales" if q.f16_scale else "")
        return f"{what} ({form}) of {'transposed ' if q.transpose else ''}{q.source.describe()}"


def _lm_heads(g: Graph) -> set[Node]:
    """Linears whose result reaches a graph output through no other matrix product."""
    heads: set[Node] = set()
    seen: set[int] = set()
    todo = [v for v in g.outputs]
    while todo:
        v = todo.pop()
        if id(v) in seen or v.producer is None:
            continue
        seen.add(id(v))
        p = v.producer
        if p.op == "linear":
            heads.add(p)
        elif p.op not in CUBE:
            todo.extend(p.inputs)
    return heads


@dataclass(frozen=True)
class Quantize(Pass):
    name = "quantize"
    bits: int = 8
    group_size: int | None = None  # None: per output channel
    exclude: frozenset[str] = field(default_factory=frozenset)
    strict: bool = False
    act_bits: int | None = None  # 8: int8 activations (w8a8, w4a8)

    def call(self, g: Graph) -> PassResult:
        details: dict[str, list[str]] = {"quantized": [], "fallback": [], "excluded": [], "float activations": []}
        done: dict[tuple[int, bool, int, int], tuple[Value, Value, Value]] = {}
        heads = _lm_heads(g)
        for node in list(g.nodes):
            for index, bits, group, transpose in self._weights(g, node, heads):
                w = node.inputs[index]
                if self.exclude & {node.name, w.name}:
                    details["excluded"].append(f"{node.name}: {w.name}")
                    continue
                k = w.type.shape[-2] if transpose else w.type.shape[-1]
                if group is not None and k % group:
                    if self.strict:
                        raise NpucError("NPUC-E0131", f"{node.name}: weight {w.name} {w.type} has K={k}, which "
                                        f"groups of {group} do not divide",
                                        "choose a --group_size that divides it, or leave out --quant_strict "
                                        "(the weight then falls back to int8 per channel)", exit_code=EXIT_USAGE)
                    msg = f"{node.name}: K={k} is no multiple of {group}; {w.name} stored as int8 per channel"
                    log.warning(msg)
                    details["fallback"].append(msg)
                    bits, group = 8, None
                group_ = group or k
                key = (id(w), transpose, bits, group_)
                if key not in done:
                    done[key] = self._constants(g, w, transpose, bits, group_)
                q, s, z = done[key]
                act8 = self._act8(node, k, group_)
                details["quantized"].append(f"{node.name}: {w.name} int{bits}"
                                            + (f" g{group_}" if group_ != k else " per channel")
                                            + (", int8 activations" if act8 else ""))
                if act8:
                    self._int8_product(g, node, q, s, z, bits, group_, transpose)
                    continue
                if self.act_bits and node.op == "linear":
                    details["float activations"].append(f"{node.name}: K={k}, group {group_}")
                dq = g.add_node("dequantize", [q, s, z],
                                [TensorType(s.type.shape[:-1] + (k,), w.type.dtype)],
                                dequantize_attrs(bits, group_, w.type.dtype), names=f"{w.name}_dq",
                                before=node).outputs[0]
                node.set_input(index, dq)
                if transpose:  # a kn weight is stored as nk: groups always run along K
                    node.attrs = MappingProxyType({**node.attrs, "weight_layout": "nk"})
        return PassResult(g, bool(details["quantized"]), details)

    def _act8(self, node: Node, k: int, group: int) -> bool:
        return self.act_bits == 8 and node.op == "linear" and k % ACT_BLOCK == 0 and group % ACT_BLOCK == 0

    @staticmethod
    def _int8_product(g: Graph, node: Node, q: Value, s: Value, z: Value, bits: int, group: int,
                      transpose: bool) -> None:
        """`node` (a linear over the weight (q, s, z)) as a qlinear with int8 activations."""
        attrs: dict[str, Any] = {"bits": bits, "group_size": group, "act_bits": 8}
        if node.attrs.get("valid_rows") is not None:
            attrs["valid_rows"] = node.attrs["valid_rows"]
        ins = [node.inputs[0], q, s, z, *node.inputs[2:]]
        out = node.outputs[0]
        new = g.add_node("qlinear", ins, get_op("qlinear").infer_types([v.type for v in ins], attrs), attrs,
                         names=out.name + "_q", before=node).outputs[0]
        g.replace_all_uses_with(out, new)
        g.remove_node(node)
        g.rename(new, out.name)

    def _weights(self, g: Graph, node: Node, heads: set[Node]) -> list[tuple[int, int, int | None, bool]]:
        """(operand, bits, group, stored transposed) for each weight of `node` to quantize."""
        layer = (self.bits, self.group_size)
        if node.op == "linear" and node.inputs[1].is_const and node.inputs[1].type.rank == 2 \
                and node.inputs[1].type.dtype.is_float:
            bits, group = (8, None) if node in heads else layer
            if node in heads and (self.bits == 8 or self.act_bits):
                bits, group = 8, self.group_size
            return [(1, bits, group, node.attrs.get("weight_layout", "nk") == "kn")]
        if node.op == "gather" and node.attrs.get("axis", 0) == 0 and node.inputs[0].is_const \
                and node.inputs[0].type.rank == 2 and node.inputs[0].type.dtype.is_float:
            return [(0, *layer, False)]
        if node.op == "fused_moe":
            return [(i, *layer, False) for i in (2, 3) if node.inputs[i].is_const]
        return []

    def _constants(self, g: Graph, w: Value, transpose: bool, bits: int, group: int) -> tuple[Value, Value, Value]:
        shape = w.type.shape[:-2] + (w.type.shape[-1], w.type.shape[-2]) if transpose else w.type.shape
        k = shape[-1]
        lead = shape[:-1]
        q = _Quantized(w.const, transpose, bits, group, symmetric=bits == 8, f16_scale=bool(self.act_bits))
        types = [TensorType(lead + (packed_k(k, bits),), code_dtype(bits)),
                 TensorType(lead + (k // group,), DType.f16 if self.act_bits else DType.f32),
                 TensorType(lead + (k // group,), code_dtype(bits))]
        qv, sv, zv = (g.add_constant(f"{w.name}.{part}", t, QuantizedSource(q, i))
                      for i, (part, t) in enumerate(zip(("q", "scale", "zero"), types, strict=True)))
        return qv, sv, zv
