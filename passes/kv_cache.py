"""Causal-LM programs over a persistent KV cache: prefill writes it, decode reads it.

Runs on a graph whose attention is fused and whose RoPE is a table lookup. For the
i-th attention (schedule order, so prefill and decode agree) the pass declares two
states, `kv_cache.<i>.k` and `kv_cache.<i>.v`, of [batch, kv_heads, cache_len, dim],
shared by every program of the model, and writes the new keys and values into them:

    prefill (positions 0..s-1 are constants):
      %o = fused_attention[causal=true](%q, %k, %v)
    ->
      state %kv_cache.0.k : f32[1,2,64,16]
      %wk = kv_write(%kv_cache.0.k, %k, @positions)            (likewise %wv)
      update %kv_cache.0.k = %wk
      %o = fused_attention[causal=true](%q, %k, %v)            attends its own keys

    decode (one token at the runtime input %position):
      %o = fused_attention(%q, %k, %v)
    ->
      %wk = kv_write(%kv_cache.0.k, %k, %position)
      %o = cached_attention(%q, %wk, %wv, %position)           keys 0..position

DeepSeek's latent attention (`mla_attention`, see mla_fusion.py) caches what its
tokens project to, not per-head keys and values: one state `kv_cache.<i>.latent` of
[batch, 1, cache_len, r + dr] holds each token's latent and shared rope key, so a
token costs (r + dr) values per layer instead of 2 x heads x head_dim:

    %kv = concat[axis=3](%c, %k_rot)
    %wkv = kv_write(%kv_cache.0.latent, %kv, %position)
    %o = mla_attention(%q_nope, %q_rot, %wkv, @w_uk, @w_uv, %position)    decode: over the cache

The states take the dtype of what they cache, here the model's (f32). The precision pass,
which runs after this one, converts a layer's cache with its attention (latent caches
too): under allow_mix_precision_bf16 a token's rows are written and read in bf16 (f16
under the f16 modes), and `npuc info`'s KV bytes per token halve:

    state %kv_cache.0.k : bf16[1,2,64,16]
    %wk = kv_write(%kv_cache.0.k, cast[dtype=bf16](%k), %position)
    %o_bf16 = cached_attention(cast[dtype=bf16](%q), %wk, %wv, %position)    scores in f32

RoPE moves with the token: every `rope_lut` reads its rows at the program's positions
from tables that cover 0..max_seq_len-1 (`tables`, taken from the same model traced at
that length; each program's own rows must agree with them, which also picks the table
when a model has several). Prefill and decode then share one table constant. The
decode program is traced at position `trace_position` (> 0: at position 0 the rotation
is the identity and folding would remove it), so its rows are compared there.

Refused with NPUC-E0123: no fused attention, a non-causal prefill, an attention mask
that is not the plain causal one, or positions that are not all RoPE (the decode
program would bake position 0 in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import DType, Graph, Node, TensorType, Value
from npuc.ir.graph import TensorSource
from npuc.passes.attention_fusion import hides_nothing
from npuc.passes.manager import Pass, PassResult

RopeTables = tuple[torch.Tensor, torch.Tensor]
# Decode's attention over the cache is named after the attention it replaces, plus this:
# `--keep_dtype X` keeps both programs' attention (and so their shared cache) as it is.
CACHED = ".cached"


def _refuse(msg: str) -> NpucError:
    return NpucError("NPUC-E0123", f"cannot compile a decode program: {msg}",
                     "--max_seq_len needs a causal LM whose attention and RoPE npuc fuses "
                     "(see --fusion-report); compile without --max_seq_len for a single program",
                     exit_code=EXIT_UNSUPPORTED)


@dataclass(frozen=True)
class KVCache(Pass):
    name = "kv-cache"
    role: str = "prefill"  # "prefill" | "decode"
    cache_len: int = 0  # rows per cache (max_seq_len rounded up to the matrix tile)
    tables: Sequence[RopeTables] = field(default=(), compare=False)
    # The position the graph was traced at: a one-token trace at position 0 would have
    # RoPE's identity rotation folded away, so decode programs are traced further on.
    trace_position: int = 0

    def call(self, g: Graph) -> PassResult:
        attn = [n for n in g.nodes if n.op in ("fused_attention", "mla_attention")]
        if not attn:
            raise _refuse("the graph has no fused attention to cache")
        seq = attn[0].inputs[0].type.shape[2]
        if self.cache_len < seq:
            raise _refuse(f"a cache of {self.cache_len} rows cannot hold the {seq} positions of one run")
        if self.role == "decode":
            if any(v.name == "position" for v in g.inputs):
                raise _refuse("the model already has an input named 'position'")
            if seq != 1:
                raise _refuse(f"the decode trace has {seq} query positions, not 1")
            pos = g.add_input("position", TensorType((1,), DType.i64))
        else:
            pos = g.add_constant(f"positions_{seq}", TensorType((seq,), DType.i64),
                                 TensorSource(torch.arange(seq, dtype=torch.int64)))
        for i, n in enumerate(attn):
            self._attention(g, n, i, pos, seq)
        ropes = [n for n in g.nodes if n.op == "rope_lut"]
        if not ropes:
            raise _refuse("no rotary position embedding was fused (positions that are not RoPE "
                          "cannot move with the decoded token)")
        shared: dict[int, tuple[Value, Value]] = {}
        for r in ropes:
            self._rope(g, r, pos, seq, shared)
        return PassResult(g, True, {"caches": sum(2 if n.op == "fused_attention" else 1 for n in attn), "rope_lut": len(ropes)})

    def _attention(self, g: Graph, n: Node, i: int, pos: Value, seq: int) -> None:
        latent = n.op == "mla_attention"
        q = n.inputs[0]
        # What a token caches: its latent and rope key (MLA), or its key and value.
        rows = [("latent", n.inputs[2])] if latent else [("k", n.inputs[1]), ("v", n.inputs[2])]
        if q.type.shape[2] != seq or (latent and rows[0][1].type.shape[2] != seq):
            raise _refuse(f"attention {n.name} has {q.type.shape[2]} queries, another has {seq}")
        mask = None if latent else (n.inputs[3] if len(n.inputs) > 3 else None)
        if mask is not None and not (self.role == "decode" and hides_nothing(mask)):
            raise _refuse(f"attention {n.name} has a mask that is not the plain causal one")
        if self.role == "prefill" and seq > 1 and not n.attrs.get("causal", False):
            raise _refuse(f"attention {n.name} is not causal")
        written = [self._write(g, f"kv_cache.{i}.{kind}", x, pos, n) for kind, x in rows]
        if self.role == "decode":  # attend over the cache, query i at position[i]
            if latent:
                op, ins = "mla_attention", [*n.inputs[:2], *written, *n.inputs[3:5], pos]
                attrs = {"scale": n.attrs["scale"], "causal": False}
            else:
                op, ins, attrs = "cached_attention", [q, *written, pos], {"scale": n.attrs["scale"]}
            new = g.add_node(op, ins, [n.outputs[0].type], attrs, names=n.name + CACHED, before=n)
            g.replace_all_uses_with(n.outputs[0], new.outputs[0])
            g.remove_node(n)

    def _write(self, g: Graph, name: str, x: Value, pos: Value, before: Node) -> Value:
        """A state of `cache_len` rows for x's [b, heads, s, d], with x written at `pos`."""
        b, h, _, d = x.type.shape
        st = g.add_state(name, TensorType((b, h, self.cache_len, d), x.type.dtype))
        w = g.add_node("kv_write", [st, x, pos], [st.type], names=f"{name}.write", before=before)
        g.set_state_update(st, w.outputs[0])
        return w.outputs[0]

    def _rope(self, g: Graph, r: Node, pos: Value, seq: int, shared: dict[int, tuple[Value, Value]]) -> None:
        x, p, cos, sin = r.inputs
        if not (p.is_const and cos.is_const and sin.is_const) or p.const is None or cos.const is None \
                or sin.const is None:
            raise _refuse(f"RoPE {r.name} takes its positions or tables at run time")
        if not torch.equal(p.const.load().reshape(-1).long(), torch.arange(seq)):
            raise _refuse(f"RoPE {r.name} is not at positions 0..{seq - 1}")
        c, s = cos.const.load(), sin.const.load()
        lo, hi = self.trace_position, self.trace_position + c.shape[0]
        hits = [j for j, (tc, ts) in enumerate(self.tables)
                if tc.shape[1] == c.shape[1] and tc.shape[0] >= hi
                and torch.allclose(tc[lo:hi].to(c.dtype), c, rtol=0, atol=1e-6)
                and torch.allclose(ts[lo:hi].to(s.dtype), s, rtol=0, atol=1e-6)]
        distinct = {j for j in hits if not any(torch.equal(self.tables[j][0], self.tables[h][0]) for h in hits if h < j)}
        if len(distinct) != 1:
            raise _refuse(f"RoPE {r.name}: {'no' if not distinct else 'several'} table(s) at max_seq_len "
                          "agree with its rows")
        j = min(distinct)
        if j not in shared:
            tc, ts = self.tables[j]
            shared[j] = tuple(g.add_constant(f"rope_{kind}_table", TensorType(tuple(t.shape), cos.type.dtype),
                                             TensorSource(t.to(cos.type.dtype.torch).contiguous()))
                              for kind, t in (("cos", tc), ("sin", ts)))
        tcv, tsv = shared[j]
        if self.role == "decode":
            r.set_input(1, pos)
        r.set_input(2, tcv)
        r.set_input(3, tsv)
