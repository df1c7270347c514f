"""Precision: run compute (and store weights) in the dtype `--precision_mode` asks for.

    must_keep_origin_dtype    nothing changes (the default: no silent accuracy loss)
    force_fp32                every float op computes in f32
    force_fp16                every float op computes in f16
    allow_fp32_to_fp16        matrix-unit ops (linear, matmul, fused_attention, mla_attention,
                              fused_moe's experts) in f16, the rest as they are
    allow_mix_precision_bf16  matrix-unit ops in bf16, the rest as they are
    allow_fp32_to_bf16        the same mode, by the name ATC's allow_fp32_to_fp16 suggests

Each converted op reads casts of its operands and its result is cast back, so
every value keeps its type for the ops around it:

    %y : f32[1,16,64] = linear(%x, @w)
  ->  (force_fp16)
    %y_h : f16[1,16,64] = linear(cast[dtype=f16](%x), cast[dtype=f16](@w))
    %y : f32[1,16,64] = cast[dtype=f32](%y_h)

then a widening cast followed by the narrowing one back (`cast[f16](cast[f32](%a : f16))`)
collapses to `%a` (also through reshapes and transposes, below), so runs of converted
ops pass f16 between them, and the casts of constant weights fold lazily: the weights
are stored in f16.

Quantized products (`qlinear`, from `--quant_type w8a16|w4a16` or an imported quantized
model) take 16-bit activations under the f16 modes (f16) and allow_mix_precision_bf16
(bf16); under must_keep_origin_dtype and the other modes but force_fp32 they take the
target's `matrix.quant_activations`: bf16 on the npu target (the a16 in the quant type's
name: its matrix unit multiplies 16-bit operands), the model's own dtype on the cpu
target, whose kernels read f32 activations as fast (the codes are the bytes that count)
and so need no casts around each product.

Ops named in `keep` (node names, `--keep_dtype`) keep their precision. Norms and
softmax accumulate in f32 inside their kernels whatever their storage dtype.

The KV cache takes the dtype its attention computes in. The KV-cache pass declares each
cache state in the model's dtype (f32); where this pass converts a layer's attention, it
converts the layer's cache with it: bf16 under allow_mix_precision_bf16, f16 under
allow_fp32_to_fp16 and force_fp16. kv_write then writes half rows and decode's attention
reads the half cache, so no step casts the cache, and a token's rows cost half the bytes:

    state %kv_cache.0.k : f32[1,2,64,16]
    %wk : f32[1,2,64,16] = kv_write(%kv_cache.0.k, %k, %position)       (likewise %wv)
    update %kv_cache.0.k = %wk
    %o : f32[1,4,1,16] = cached_attention(%q, %wk, %wv, %position)
  ->  (allow_mix_precision_bf16)
    state %kv_cache.0.k : bf16[1,2,64,16]
    %wk : bf16[1,2,64,16] = kv_write(%kv_cache.0.k, cast[dtype=bf16](%k), %position)
    update %kv_cache.0.k = %wk
    %o_bf16 : bf16[1,4,1,16] = cached_attention(cast[dtype=bf16](%q), %wk, %wv, %position)
    %o : f32[1,4,1,16] = cast[dtype=f32](%o_bf16)

The attention kernels compute scores and softmax in f32 from the half cache. Prefill's
attention (which reads %k, the rows kv_write writes) and decode's (which reads %wk)
decide alike, so both programs declare the shared state with one dtype. A cache stays f32
where its attention does: must_keep_origin_dtype, force_fp32, or an attention named in
`keep`; a kept name covers both programs' attention (prefill's `X`, decode's `X.cached`).
An op that reads a state of another dtype than it would compute in is left alone and
listed in the details under "reads_state" (converting it would cast the whole cache on
every step); the converted caches are listed under "caches" ("name dtype").

A widening cast and the narrowing one back collapse through the layout ops between them,
so a half producer feeds kv_write (and the next matrix op) without a round trip:

    %v : f32[1,2,16,16] = transpose[perm=[0,2,1,3]](reshape(cast[dtype=f32](%v_bf16)))
    %wv = kv_write(%kv_cache.0.v, cast[dtype=bf16](%v), %position)
  ->
    %wv = kv_write(%kv_cache.0.v, transpose[perm=[0,2,1,3]](reshape(%v_bf16)), %position)

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
from npuc.passes.kv_cache import CACHED
from npuc.passes.manager import Pass, PassResult

log = logging.getLogger("npuc")
MODES = ("must_keep_origin_dtype", "force_fp32", "force_fp16", "allow_fp32_to_fp16", "allow_mix_precision_bf16")
# Other names for a mode: ATC names its f16 mode allow_fp32_to_fp16, and users spell bf16 alike.
ALIASES = {"allow_fp32_to_bf16": "allow_mix_precision_bf16"}
# The matrix unit's ops. Those that read the KV cache convert with it (see above).
CUBE_OPS = frozenset({"linear", "qlinear", "matmul", "fused_attention", "cached_attention", "mla_attention",
                      "fused_moe", "qmoe"})
# The ops that read a layer's KV cache (prefill's reads the rows it writes, decode's the state).
ATTENTION = frozenset({"fused_attention", "cached_attention", "mla_attention"})
# Operands a converted op keeps as they are: fused_moe routes in f32 (its kernel reads the
# router in f32), since rounding the router's weights or bias can flip which experts a token gets.
# qlinear and qmoe: codes, scales, zeros (qmoe unpacks to x's dtype).
_KEEP_OPERANDS = {"fused_moe": frozenset({1, 4}), "qlinear": frozenset({1, 2, 3}), "qmoe": frozenset(range(1, 9))}
_NO_CONVERT = frozenset({"cast", "gather", "reshape", "transpose", "expand", "slice", "concat", "split", "kv_write",
                         "dequantize"})
# Ops that only move values: a cast commutes with them exactly.
_LAYOUT = frozenset({"reshape", "transpose"})


def check_mode(mode: str) -> str:
    """The mode's own name (an alias resolved), or a usage error."""
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise NpucError("NPUC-E0117", f"unknown --precision_mode {mode!r}",
                        "one of: " + ", ".join((*MODES, *ALIASES)), exit_code=EXIT_USAGE)
    return mode


def _target(mode: str, node: Node, quant_activations: DType | None = DType.bf16) -> DType | None:
    if node.op == "qlinear" and mode != "force_fp32":
        # w8a16 / w4a16: a quantized product takes the 16-bit activations of the f16 and bf16
        # modes, and otherwise the target's (its matrix unit's input, bf16 on the npu; the
        # cpu's kernels read f32 as fast, so none there and no casts around the product)
        if mode in ("force_fp16", "allow_fp32_to_fp16"):
            return DType.f16
        return DType.bf16 if mode == "allow_mix_precision_bf16" else quant_activations
    if mode == "force_fp32":
        return DType.f32
    if mode == "force_fp16":
        return DType.f16
    if mode == "allow_fp32_to_fp16" and node.op in CUBE_OPS:
        return DType.f16
    if mode == "allow_mix_precision_bf16" and node.op in CUBE_OPS:
        return DType.bf16
    return None


def _want(mode: str, node: Node, quant_activations: DType | None = DType.bf16) -> DType | None:
    """The dtype the mode converts `node` to, or None where it computes as it is."""
    want = _target(mode, node, quant_activations)
    if want is None or node.op in _NO_CONVERT or len(node.outputs) != 1:
        return None
    dt = node.outputs[0].type.dtype
    return want if dt.is_float and dt != want else None


# The casts the pass made, by (value, dtype): keyed by the Value itself, which keeps it
# alive, so no id of a removed value is reused for another.
Casts = dict[tuple[Value, DType], Value]


def _cast(g: Graph, v: Value, dtype: DType, before: Node, made: Casts) -> Value:
    """v in `dtype`: v itself, the cast this pass already made (it precedes `before`, since
    the pass edits in program order), or a new one."""
    if v.type.dtype == dtype:
        return v
    key = (v, dtype)
    if key not in made:
        made[key] = g.add_node("cast", [v], [v.type.with_dtype(dtype)], {"dtype": dtype},
                               names=f"{v.name}_{dtype}", before=before).outputs[0]
    return made[key]


def table_error(t: torch.Tensor, dtype: DType) -> float:
    """How much storing `t` in `dtype` changes it (max abs)."""
    t = t.float()
    return float((t - t.to(dtype.torch).float()).abs().max()) if t.numel() else 0.0


def _state_of(v: Value) -> Value | None:
    """The state `v` is (the KV cache), or writes in place (kv_write's result); else None."""
    while not v.state:
        p = v.producer
        if p is None or get_op(p.op).inplace is None:
            return None
        v = p.inputs[get_op(p.op).inplace]
    return v


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
    # A quantized product's activations where the mode keeps the model's dtype (the target's
    # matrix.quant_activations); None: the model's own.
    quant_activations: DType | None = DType.bf16
    # --kv_cache_dtype other than auto: the key and value caches (kv_cache.<i>.k / .v) keep the
    # dtype the KV-cache pass gave them; decode's attention then reads them as they are.
    kv_cache_fixed: bool = False

    def call(self, g: Graph) -> PassResult:
        mode = check_mode(self.mode)
        details: dict[str, list[str]] = {"converted": [], "kept": [], "reads_state": [], "caches": [],
                                         "rope_tables": [], "rope_tables_f32": []}
        if mode == "must_keep_origin_dtype" and (self.quant_activations is None
                                                 or not any(n.op == "qlinear" for n in g.nodes)):
            return PassResult(g, False)
        made: Casts = {}
        for st in list(g.states.values()):
            self._cache(g, mode, st, details, made)
        for node in list(g.nodes):
            want = _want(mode, node, self.quant_activations)
            if want is None:
                continue
            if self._kept(node):
                details["kept"].append(node.name)
                continue
            if any((st := _state_of(v)) is not None and st.type.dtype != want for v in node.inputs):
                details["reads_state"].append(node.name)
                continue
            self._convert(g, node, want, details, made)
        self._collapse_round_trips(g)
        return PassResult(g, bool(details["converted"] or details["caches"]), details)

    def _kept(self, node: Node) -> bool:
        # Decode's attention is prefill's renamed (kv_cache.CACHED); the programs share its
        # cache, so a name keeps both or neither.
        return bool({node.name, node.name.removesuffix(CACHED), node.name + CACHED} & self.keep)

    def _cache(self, g: Graph, mode: str, st: Value, details: dict[str, list[str]], made: Casts) -> None:
        """Give cache state `st` the dtype its attention converts to (see above)."""
        if self.kv_cache_fixed and st.name.startswith("kv_cache.") and st.name.endswith((".k", ".v")):
            return
        upd = g.state_updates.get(st.name)
        w = upd.producer if upd is not None else None
        if w is None or w.op != "kv_write" or w.inputs[0] is not st:
            return
        readers = [n for v in (w.inputs[1], w.outputs[0]) for n in v.users() if n.op in ATTENTION]
        wants = {None if self._kept(n) else _want(mode, n, self.quant_activations) for n in readers}
        want = wants.pop() if len(wants) == 1 else None
        if want is None or want == st.type.dtype:
            return
        # Retyped in place: the state's name is how the programs share it, and kv_write (rebuilt
        # below) is its only reader.
        st.type = st.type.with_dtype(want)
        rows = _cast(g, w.inputs[1], want, w, made)
        new = g.add_node("kv_write", [st, rows, *w.inputs[2:]], [st.type], dict(w.attrs),  # positions (, slot)
                         names=f"{w.outputs[0].name}_{want}", before=w)
        name = w.outputs[0].name
        g.replace_all_uses_with(w.outputs[0], new.outputs[0])  # its readers convert below
        g.remove_node(w)
        g.rename(new.outputs[0], name)
        details["caches"].append(f"{st.name} {want}")

    def _convert(self, g: Graph, node: Node, want: DType, details: dict[str, list[str]], made: Casts) -> None:
        ins = []
        for i, v in enumerate(node.inputs):
            if not v.type.dtype.is_float or i in _KEEP_OPERANDS.get(node.op, ()):
                ins.append(v)
            elif node.op == "rope_lut" and i >= 2 and not self._rope_table_ok(v, want, details):
                ins.append(v)  # the kernel reads tables of any float dtype in f32
            else:
                ins.append(_cast(g, v, want, node, made))
        out = node.outputs[0]
        types = get_op(node.op).infer_types([v.type for v in ins], node.attrs)
        new = g.add_node(node.op, ins, types, dict(node.attrs), names=f"{out.name}_{want}", before=node)
        back = _cast(g, new.outputs[0], out.type.dtype, node, made)
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
        """cast[narrow](L(cast[wide](%a : narrow))) -> L(%a), L any run of reshapes and
        transposes (or none): the widening cast was exact, and layout ops only move values."""
        for node in list(g.nodes):
            if node.op != "cast" or not g.has_node(node) or g.is_root(node.outputs[0]):
                continue
            narrow = node.outputs[0].type.dtype
            chain: list[Node] = []  # nearest first
            inner = node.inputs[0].producer
            while inner is not None and inner.op in _LAYOUT:
                chain.append(inner)
                inner = inner.inputs[0].producer
            if inner is None or inner.op != "cast" or inner.inputs[0].type.dtype != narrow \
                    or not _widening(narrow, inner.outputs[0].type.dtype):
                continue
            a = inner.inputs[0]
            for lay in reversed(chain):  # the same moves on the narrow values
                out = lay.outputs[0]
                a = g.add_node(lay.op, [a, *lay.inputs[1:]], [out.type.with_dtype(narrow)], dict(lay.attrs),
                               names=f"{out.name}_{narrow}", before=node).outputs[0]
            name = node.outputs[0].name
            g.replace_all_uses_with(node.outputs[0], a)
            g.remove_node(node)
            if chain:
                g.rename(a, name)
            for dead in (*chain, inner):  # the wide run, as far as nothing else reads it
                if dead.outputs[0].uses or g.is_root(dead.outputs[0]):
                    break
                g.remove_node(dead)
