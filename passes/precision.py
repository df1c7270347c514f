"""Precision: run compute (and store weights) in the dtype `--precision_mode` asks for.

    must_keep_origin_dtype    nothing changes (the default: no silent accuracy loss)
    force_fp32                every float op computes in f32
    force_fp16                every float op computes in f16
    allow_fp32_to_fp16        matrix-unit ops (linear, matmul, fused_attention) in f16, the rest as they are
    allow_mix_precision_bf16  matrix-unit ops in bf16, the rest as they are

Each converted op reads casts of its operands and its result is cast back, so
every value keeps its type for the ops around it:

    %y : f32[1,16,64] = linear(%x, @w)
  ->  (force_fp16)
    %y_h : f16[1,16,64] = linear(cast[dtype=f16](%x), cast[dtype=f16](@w))
    %y : f32[1,16,64] = cast[dtype=f32](%y_h)

then a widening cast followed by the narrowing one back (`cast[f16](cast[f32](%a : f16))`)
collapses to `%a`, so runs of converted ops pass f16 between them, and the casts of
constant weights fold lazily: the weights are stored in f16.

Ops named in `keep` (node names, `--keep_dtype`) keep their precision. Norms and
softmax accumulate in f32 inside their kernels whatever their storage dtype. RoPE
tables are stored in the compute dtype unless that changes them by more than
`rope_table_tol`; then they stay f32 and the pass says so in its details.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir import DType, Graph, Node, Value
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")
MODES = ("must_keep_origin_dtype", "force_fp32", "force_fp16", "allow_fp32_to_fp16", "allow_mix_precision_bf16")
CUBE_OPS = frozenset({"linear", "matmul", "fused_attention"})
_NO_CONVERT = frozenset({"cast", "gather", "reshape", "transpose", "expand", "slice", "concat", "split"})


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise NpucError("NPUC-E0117", f"unknown --precision_mode {mode!r}", "one of: " + ", ".join(MODES),
                        exit_code=EXIT_USAGE)
    return mode


def _target(mode: str, node: Node) -> DType | None:
    if mode == "force_fp32":
        return DType.f32
    if mode == "force_fp16":
        return DType.f16
    if mode == "allow_fp32_to_fp16" and node.op in CUBE_OPS:
        return DType.f16
    if mode == "allow_mix_precision_bf16" and node.op in CUBE_OPS:
        return DType.bf16
    return None


def _cast(g: Graph, v: Value, dtype: DType, before: Node) -> Value:
    if v.type.dtype == dtype:
        return v
    n = g.add_node("cast", [v], [v.type.with_dtype(dtype)], {"dtype": dtype}, names=f"{v.name}_{dtype}",
                   before=before)
    return n.outputs[0]


def _widening(a: DType, b: DType) -> bool:
    """Whether casting a -> b is exact (so b -> a gives the original back)."""
    order = {DType.f16: 1, DType.bf16: 1, DType.f32: 2, DType.f64: 3}
    return a in order and b in order and order[b] > order[a] and not {a, b} == {DType.f16, DType.bf16}


@dataclass(frozen=True)
class Precision(Pass):
    name = "precision"
    mode: str = "must_keep_origin_dtype"
    keep: frozenset[str] = field(default_factory=frozenset)
    rope_table_tol: float = 1e-3

    def call(self, g: Graph) -> PassResult:
        check_mode(self.mode)
        details: dict[str, list[str]] = {"converted": [], "kept": [], "rope_tables_f32": []}
        if self.mode == "must_keep_origin_dtype":
            return PassResult(g, False)
        for node in list(g.nodes):
            want = _target(self.mode, node)
            if want is None or node.op in _NO_CONVERT or len(node.outputs) != 1:
                continue
            if not node.outputs[0].type.dtype.is_float or node.outputs[0].type.dtype == want:
                continue
            if node.name in self.keep:
                details["kept"].append(node.name)
                continue
            self._convert(g, node, want, details)
        self._collapse_round_trips(g)
        return PassResult(g, bool(details["converted"]), details)

    def _convert(self, g: Graph, node: Node, want: DType, details: dict[str, list[str]]) -> None:
        from npuc.ir import get_op

        ins = []
        for i, v in enumerate(node.inputs):
            if not v.type.dtype.is_float:
                ins.append(v)
            elif node.op == "rope_lut" and i >= 2 and not self._rope_table_ok(v, want):
                ins.append(v)  # the kernel reads tables of any float dtype in f32
                details["rope_tables_f32"].append(v.name)
                log.warning("RoPE table %s kept in f32: %s would change it by more than %g", v.name, want,
                            self.rope_table_tol)
            else:
                ins.append(_cast(g, v, want, node))
        out = node.outputs[0]
        types = get_op(node.op).infer_types([v.type for v in ins], node.attrs)
        new = g.add_node(node.op, ins, types, dict(node.attrs), names=f"{out.name}_{want}", before=node)
        back = _cast(g, new.outputs[0], out.type.dtype, node)
        g.replace_all_uses_with(out, back)
        g.remove_node(node)
        g.rename(back, out.name)
        details["converted"].append(out.name)

    def _rope_table_ok(self, v: Value, want: DType) -> bool:
        if v.const is None:
            return True
        t = v.const.load().float()
        return float((t - t.to(want.torch).float()).abs().max()) <= self.rope_table_tol

    @staticmethod
    def _collapse_round_trips(g: Graph) -> None:
        """cast[narrow](cast[wide](%a : narrow)) -> %a: the widening cast was exact."""
        for node in list(g.nodes):
            if node.op != "cast" or node not in g.nodes:
                continue
            inner = node.inputs[0].producer
            if inner is None or inner.op != "cast":
                continue
            a = inner.inputs[0]
            if a.type.dtype == node.outputs[0].type.dtype and _widening(a.type.dtype, inner.outputs[0].type.dtype):
                if any(o is node.outputs[0] for o in g.outputs):
                    continue
                g.replace_all_uses_with(node.outputs[0], a)
                g.remove_node(node)
                if not inner.outputs[0].uses and not any(o is inner.outputs[0] for o in g.outputs):
                    g.remove_node(inner)
