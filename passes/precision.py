"""Precision: run compute (and store weights) in the dtype `--precision_mode` asks for.

    must_keep_origin_dtype    nothing changes (the default: no silent accuracy loss)
    force_fp32                every float op computes in f32
    force_fp16                every float op computes in f16
    allow_fp32_to_fp16        matrix-unit ops (linear, matmul, fused_attention, mla_attention,
                              fused_moe's experts) in f16, the rest as they are
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
softmax accumulate in f32 inside their kernels whatever their storage dtype.

Left alone in every mode (and listed in the details under "reads_state"): ops that
write a state (`kv_write`) and ops that read one, such as decode's attention over the
KV cache. Converting a cache reader would cast the whole cache on every step; the
cache's dtype is the KV-cache pass's choice, and its readers compute in it:

    %o = cached_attention(%q, %wk, %wv, %position)      %wk = kv_write(%kv_cache.0.k, ..)
  ->  (allow_fp32_to_fp16)
    unchanged: f32, like the cache

RoPE tables (`rope_lut`'s cos/sin operands, converted only where rope_lut is, i.e.
force_fp16) are stored in the compute dtype unless that changes them by more than
`rope_table_tol`; then they stay f32 (the kernel reads tables of any float dtype in
f32). Each decision is logged, at info with the measured change, at warning when a
table stays f32, and recorded in the details ("rope_tables": "name dtype change").
Rounding values in [-1, 1] changes them by at most half an ulp at 0.5..1: 2^-12
(2.4e-4) in f16, under the default 1e-3 at any length, and 2^-9 (2.0e-3) in bf16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir import DType, Graph, Node, Value, get_op
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")
MODES = ("must_keep_origin_dtype", "force_fp32", "force_fp16", "allow_fp32_to_fp16", "allow_mix_precision_bf16")
# The matrix unit's ops. Those among them that read the KV cache stay in its dtype (see above).
CUBE_OPS = frozenset({"linear", "matmul", "fused_attention", "cached_attention", "mla_attention", "fused_moe"})
# Operands a converted op keeps as they are: fused_moe routes in f32 (its kernel reads the
# router in f32), since rounding the router's weights or bias can flip which experts a token gets.
_KEEP_OPERANDS = {"fused_moe": frozenset({1, 4})}
_NO_CONVERT = frozenset({"cast", "gather", "reshape", "transpose", "expand", "slice", "concat", "split", "kv_write"})


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


def table_error(t: torch.Tensor, dtype: DType) -> float:
    """How much storing `t` in `dtype` changes it (max abs)."""
    t = t.float()
    return float((t - t.to(dtype.torch).float()).abs().max()) if t.numel() else 0.0


def _reads_state(v: Value) -> bool:
    """Whether `v` is a state (the KV cache) or a state written in place (kv_write's result)."""
    while not v.state:
        p = v.producer
        if p is None or get_op(p.op).inplace is None:
            return False
        v = p.inputs[get_op(p.op).inplace]
    return True


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
        details: dict[str, list[str]] = {"converted": [], "kept": [], "reads_state": [], "rope_tables": [],
                                         "rope_tables_f32": []}
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
            if any(_reads_state(v) for v in node.inputs):
                details["reads_state"].append(node.name)
                continue
            self._convert(g, node, want, details)
        self._collapse_round_trips(g)
        return PassResult(g, bool(details["converted"]), details)

    def _convert(self, g: Graph, node: Node, want: DType, details: dict[str, list[str]]) -> None:
        ins = []
        for i, v in enumerate(node.inputs):
            if not v.type.dtype.is_float or i in _KEEP_OPERANDS.get(node.op, ()):
                ins.append(v)
            elif node.op == "rope_lut" and i >= 2 and not self._rope_table_ok(v, want, details):
                ins.append(v)  # the kernel reads tables of any float dtype in f32
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

    def _rope_table_ok(self, v: Value, want: DType, details: dict[str, list[str]]) -> bool:
        """Whether storing table `v` in `want` keeps it within rope_table_tol; logged and
        recorded once per table (several rope_lut nodes share one)."""
        if v.const is None:
            return True
        kept = v.name in details["rope_tables_f32"]
        if any(d.split()[0] == v.name for d in details["rope_tables"]):
            return not kept
        err = table_error(v.const.load(), want)
        rows = v.type.shape[0] if v.type.rank else 1
        ok = err <= self.rope_table_tol
        details["rope_tables"].append(f"{v.name} {want if ok else v.type.dtype} {err:.3g}")
        if ok:
            log.info("RoPE table %s (%d rows) stored in %s: it changes by at most %.3g (<= %g)", v.name, rows, want,
                     err, self.rope_table_tol)
        else:
            details["rope_tables_f32"].append(v.name)
            log.warning("RoPE table %s (%d rows) kept in %s: %s would change it by %.3g (> %g)", v.name, rows,
                        v.type.dtype, want, err, self.rope_table_tol)
        return ok

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
                if g.is_root(node.outputs[0]):
                    continue
                g.replace_all_uses_with(node.outputs[0], a)
                g.remove_node(node)
                if not inner.outputs[0].uses and not g.is_root(inner.outputs[0]):
                    g.remove_node(inner)
