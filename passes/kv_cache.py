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

`--kv_cache_dtype` (`cache_dtype`) declares the key and value states in a dtype of their
own instead, which the precision pass keeps: f32, bf16, f16, or packed int8 rows of d + 4
bytes (an f32 scale per head and token, then d codes; ir/fused_ops.py). kv_write quantizes
the f32 rows it writes, and decode's attention reads them as they are:

    state %kv_cache.0.k : i8[1,2,64,20]                                     head dim 16
    %wk = kv_write(%kv_cache.0.k, %k : f32[1,2,1,16], %position)
    %o = cached_attention(%q, %wk, %wv, %position)                          f32 result

RoPE moves with the token: every `rope_lut` reads its rows at the program's positions
from tables that cover 0..max_seq_len-1 (`tables`, taken from the same model traced at
that length; each program's own rows must agree with them, which also picks the table
when a model has several). Prefill and decode then share one table constant. The
decode program is traced at position `trace_position` (> 0: at position 0 the rotation
is the identity and folding would remove it), so its rows are compared there.

A model without RoPE whose positions are embeddings of its position ids (GPT-2's learned
table, OPT's, sinusoids) decodes with those ids an input (`decode_positions`), fed from
the position:

    %row = reshape[shape=[1,1]](%position)        replaces the position_ids input [1, 1]
    %pe = gather[axis=0](@wpe, %row)              the row of the position being decoded

A sliding window (`window=w`: a query sees the last w keys, itself included) goes to the
cached attention too. Its width comes from the model traced at the cache length
(`windows`), where a window wider than the prefill shows as a band:

      %o = fused_attention[causal=true](%q, %k, %v)                 prefill of 8, window 16
    ->
      %o = fused_attention[causal=true, window=16](%q, %k, %v)
      %o = cached_attention[window=16](%q, %wk, %wv, %position)     decode

Slots (`slots` B > 1, an --input_shape batch of B): the states hold B sequences, [B, ...];
prefill is traced for one and writes the slot its `slot` input names, decode runs one token
of every slot, each at its own position:

    prefill:  %wk = kv_write(%kv_cache.0.k, %k, @positions, %slot)            k [1, h, s, d]
    decode:   %p = reshape[shape=[4,1]](%position : i64[4])
              %wk = kv_write(%kv_cache.0.k, %k, %p)                           k [4, h, 1, d]
              %o = cached_attention(%q, %wk, %wv, %p)         slot b: keys 0..position[b]

With `decode_tokens` C > 1 the decode trace has C tokens of each slot, and `position` is
[slots, C], each token's own (no reshape): the ops take [b, s] positions as they are.

A causal convolution over the sequence (the short conv of LFM2-style mixers) caches its
inputs by position, one state `conv_cache.<i>` of [batch, 1, cache_len, channels] each,
and decode convolves its token's window of them (`_conv`). The same conv opens state-space
and linear-attention mixers, whose recurrence after it has no state here: the decode-check
pass, right after this one, refuses a decode program that disagrees with prefill.

A recurrence (a state-space scan, a delta rule: compiler/recurrent.py) keeps a state of
one row per slot instead of rows per position (passes/recurrent_state.py).

An attention without positions (no RoPE, ALiBi or position ids: NoPE) is cached as any
other. Whether the model had positions a one-token trace would bake in (a learned table
read at the trace's position) the graph cannot say; the decode-check pass runs such
programs and refuses a decode that disagrees with prefill.

Refused with NPUC-E0123: no fused attention, causal conv or recurrence, a conv over the
sequence that is not causal, a non-causal prefill, an attention mask that is not the plain
causal one (here or at the cache length), a decode step of several tokens beside a conv or
a recurrence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import DType, Graph, Node, TensorType, Value
from npuc.ir.evaluate import evaluate_value
from npuc.ir.fused_ops import kv_cache_width
from npuc.ir.graph import TensorSource
from npuc.passes.attention_fusion import hides_nothing
from npuc.passes.manager import Pass, PassResult
from npuc.passes.recurrent_state import cache_recurrences, conv_window, recurrences

RopeTables = tuple[torch.Tensor, torch.Tensor]
UNCHECKED = -1  # a window that was not checked (LongTrace.windows): the program's own stands
FROM_DATA = -2  # a mask computed from the tokens (LongTrace.windows): sparse or dynamic attention


@dataclass(frozen=True)
class LongTrace:
    """What the model traced at max_seq_len says about the positions to cache: its distinct
    RoPE tables, and each attention's mask there (schedule order): 0 causal, w > 0 the
    causal band of a sliding window of w keys, None another mask, FROM_DATA one computed from
    the tokens, UNCHECKED one too large to evaluate. A window wider than the prefill is
    invisible in the prefill's own trace; this is where it shows."""

    tables: Sequence[RopeTables] = ()
    windows: Sequence[int | None] = ()
    # The decode program's input of position ids [batch, 1], for a model without RoPE whose
    # positions are embeddings of them (learned, sinusoidal); "" where RoPE carries them.
    decode_positions: str = ""
    # The model's layers, where its source says (a Hugging Face config): each must have an
    # attention npuc caches, else a layer that mixes tokens otherwise (linear attention, an
    # attention left unfused) would decode without its past. 0: not known.
    layers: int = 0
    # Each attention's ALiBi slopes there (empty: none): a one-token decode trace cannot show
    # them (its only key is at distance 0).
    alibi: Sequence[tuple[float, ...]] = ()
    # Sequences the cache holds (KVCache.slots): the --input_shape batch.
    slots: int = 0
    # Tokens of each slot a decode step runs (KVCache.decode_tokens): --decode_tokens.
    decode_tokens: int = 1
    # The mixed program (KVCache.mixed): the decode trace at batch 1 whose rows each name
    # their slot of the `slots` the cache holds.
    mixed: bool = False
    # The verify program (KVCache.by_row): a decode of C tokens of each slot that keeps each
    # recurrent state after each row, for the scheduler's rollback (passes/recurrent_state.py).
    by_row: bool = False
    # The prefill program at a few tokens (the same trace), where the prefill is longer: what
    # the decode-check pass runs with the reference kernels instead of the whole prompt.
    probe: Any = field(default=None, compare=False)


# The prefill input naming the slot it fills, where the cache holds several sequences.
SLOT = "slot"
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
    # Each attention's window at max_seq_len (LongTrace.windows); empty: the graph's own.
    windows: Sequence[int | None] = field(default=(), compare=False)
    # LongTrace.decode_positions: the decode input that position becomes (no RoPE needed).
    decode_positions: str = ""
    # LongTrace.layers: at least this many attentions to cache.
    layers: int = 0
    # LongTrace.alibi: each attention's ALiBi slopes at max_seq_len.
    alibi: Sequence[tuple[float, ...]] = field(default=(), compare=False)
    # Sequences the cache holds at once (0 or 1: one). With slots > 1 decode runs every slot,
    # each at its own position (`position` [slots]), and prefill (of one sequence) writes the
    # slot its `slot` input names.
    slots: int = 0
    # Tokens of each slot a decode step runs: 1, or C > 1 with `position` [slots, C], each
    # token's own (a prompt fed C tokens a step beside the slots decoding one).
    decode_tokens: int = 1
    # --kv_cache_dtype: the dtype of the key and value caches (f32, bf16, f16, or i8: packed
    # int8 rows of d + 4 bytes, ir/fused_ops.py), which the precision pass then leaves as they
    # are; None (auto): the model's dtype, which the precision pass converts with the attention.
    # Latent (MLA) and conv caches keep the auto rule.
    cache_dtype: DType | None = None
    # The mixed step (role decode; --mixed_tokens): a decode trace at batch 1 of
    # `decode_tokens` rows, each of its own slot of the `slots` the cache holds (a `slot`
    # input [rows]) at its own position (`position` [1, rows]): the decoding slots' tokens
    # and an admitted prompt's chunk in one step (apps/scheduler.py).
    mixed: bool = False
    # What the state names begin with: "" for the model's own caches, "mtp." for the layer a
    # multi-token-prediction program caches beside them in the same state region
    # (compiler/mtp.py), whose attention is also numbered from 0.
    prefix: str = ""
    # The verify program (role decode, C > 1 tokens of each slot): each recurrent state also
    # kept after each row, `<state>.by_row`, so that a rejected draft is undone by copying one
    # row back (passes/recurrent_state.py); without it such a decode beside a recurrence is refused.
    by_row: bool = False

    def call(self, g: Graph) -> PassResult:
        convs = [n for n in g.nodes if n.op == "conv1d" and n.inputs[1].type.shape[2] > 1]
        for n in convs:
            if self._causal_conv(n) is None:
                raise _refuse(f"{n.name} convolves over the sequence, but not causally (left padding of its "
                              "dilated kernel, stride 1, its first outputs read): decode cannot cache its inputs")
        attn = [n for n in g.nodes if n.op in ("fused_attention", "mla_attention")]
        scans = recurrences(g)
        if not attn and not convs and not scans:
            raise _refuse("the graph has no fused attention to cache")
        # with convs or recurrences, the decode-check pass stands for this
        if len(attn) < self.layers and not convs and not scans:
            raise _refuse(f"{len(attn)} fused attention(s) for {self.layers} layers: a layer whose token mixing is "
                          "not an attention npuc fuses (linear attention, a state-space mixer) would decode "
                          "without its past")
        seq = attn[0].inputs[0].type.shape[2] if attn else convs[0].inputs[0].type.shape[2] if convs \
            else scans[0].inputs[0].type.shape[1]
        if self.cache_len < seq:
            raise _refuse(f"a cache of {self.cache_len} rows cannot hold the {seq} positions of one run")
        slot: Value | None = None
        if self.role == "decode":
            if any(v.name == "position" for v in g.inputs):
                raise _refuse("the model already has an input named 'position'")
            if seq != self.decode_tokens:
                raise _refuse(f"the decode trace has {seq} query positions, not {self.decode_tokens}")
            if seq > 1 and scans and not self.by_row:
                raise _refuse("a decode step of several tokens beside a recurrent layer (a slot short of C tokens "
                              "would advance its state over the tokens that pad it; only the verify program of "
                              "--speculative_tokens keeps the states by row to undo that)")
            if seq > 1 and convs and not scans:
                raise _refuse("a decode step of several tokens beside a cached convolution (cached_conv1d "
                              "computes one token's window)")
            batch = self._batch(g, attn, convs, scans)
            if self.mixed and (batch != 1 or convs or scans or any(n.op == "mla_attention" for n in attn)):
                raise _refuse("a mixed step runs one sequence of rows, over key/value caches only (not latent "
                              "attention, a cached convolution or a recurrence)")
            if self.slots > 1 and batch != self.slots and not self.mixed:
                raise _refuse(f"the decode trace runs {batch} sequences, the cache holds {self.slots}")
            slots = 1 if self.mixed else max(self.slots, 1)
            if seq > 1:  # each token's own position, [slots, C]: what the ops take
                pos = g.add_input("position", TensorType((slots, seq), DType.i64))
            else:
                pos = g.add_input("position", TensorType((slots,), DType.i64))
            if self.mixed:  # each row's slot
                if any(v.name == SLOT for v in g.inputs):
                    raise _refuse(f"the model already has an input named {SLOT!r}")
                slot = g.add_input(SLOT, TensorType((seq,), DType.i64))
            if self.slots > 1 and seq == 1 and not self.mixed:  # each slot's own position: [slots, 1] for the ops
                pos = g.add_node("reshape", [pos], [TensorType((self.slots, 1), DType.i64)],
                                 {"shape": (self.slots, 1)}, names="position_per_slot", before=g.nodes[0]).outputs[0]
            if self.decode_positions:
                self._position_ids(g, pos)
        else:
            if self.slots > 1:
                if any(v.name == SLOT for v in g.inputs):
                    raise _refuse(f"the model already has an input named {SLOT!r}")
                if self._batch(g, attn, convs, scans) != 1:
                    raise _refuse("a prefill into one slot runs one sequence")
                slot = g.add_input(SLOT, TensorType((1,), DType.i64))
            pos = g.add_constant(f"positions_{seq}", TensorType((seq,), DType.i64),
                                 TensorSource(torch.arange(seq, dtype=torch.int64)))
        recurrent = cache_recurrences(g, self.role, self.slots, slot, self.by_row)
        if self.windows and len(self.windows) != len(attn):
            raise _refuse(f"the model traced at the cache length has {len(self.windows)} attentions, "
                          f"this program {len(attn)}")
        for i, n in enumerate(attn):
            self._attention(g, n, i, pos, seq)
        for i, n in enumerate(convs):
            if recurrent:  # beside recurrent states, a window of the conv's last inputs (fixed size)
                reads = self._causal_conv(n)
                assert reads is not None  # checked above
                conv_window(g, n, i, self.role, self.slots, slot, reads, self.by_row)
            else:
                self._conv(g, n, i, pos, seq)
        ropes = [n for n in g.nodes if n.op == "rope_lut"]
        # An attention with no RoPE, ALiBi or position ids (NoPE: Jamba's, Nemotron-H's) is an
        # ordinary cached attention, if the model has no positions that a one-token trace bakes
        # in (a learned table read at the trace's position): the decode-check pass runs both
        # programs on such a graph and refuses a decode that disagrees with prefill.
        shared: dict[int, tuple[Value, Value]] = {}
        for r in ropes:
            self._rope(g, r, pos, seq, shared)
        details = {"caches": sum(2 if n.op == "fused_attention" else 1 for n in attn), "rope_lut": len(ropes)}
        return PassResult(g, True, {**details, **({"conv_caches": len(convs)} if convs else {}),
                                    **({"recurrent_states": recurrent} if recurrent else {})})

    @staticmethod
    def _batch(g: Graph, attn: Sequence[Node], convs: Sequence[Node], scans: Sequence[Node] = ()) -> int:
        return (attn[0] if attn else convs[0] if convs else scans[0]).inputs[0].type.shape[0]

    @staticmethod
    def _causal_conv(n: Node) -> list[Value] | None:
        """What reads a causal conv's outputs 0..s-1 (s = its input's length): the conv itself,
        or the slices that drop what its right padding adds. None if it is not causal so."""
        x, w = n.inputs[0], n.inputs[1]
        d, (left, right) = n.attrs.get("dilation", 1), n.attrs.get("pads", (0, 0))
        seq = x.type.shape[2]
        if n.attrs.get("stride", 1) != 1 or left != d * (w.type.shape[2] - 1):
            return None
        out = n.outputs[0]
        if right == 0:
            return [out]
        slices = out.users()
        if not slices or not all(u.op == "slice" and u.attrs["axis"] % 3 == 2 and u.attrs.get("start", 0) == 0
                                 and u.attrs.get("step", 1) == 1 and min(u.attrs["end"], out.type.shape[2]) == seq
                                 and u.inputs[0] is out for u in slices):
            return None
        return [u.outputs[0] for u in slices]

    def _conv(self, g: Graph, n: Node, i: int, pos: Value, seq: int) -> None:
        """A causal conv over the sequence caches its inputs by position, [b, 1, cache_len, c]:
        prefill writes them and convolves as before; decode writes its token's and convolves
        the last k of them:

            %y = slice[axis=2, end=1](conv1d[pads=[2,2], groups=64](%x, @w))      decode, k = 3
        ->
            %r = reshape[shape=[1,1,1,64]](%x)
            %wx = kv_write(%conv_cache.0, %r, %position)
            %y = cached_conv1d[groups=64](%wx, @w, %position)
        """
        x, w = n.inputs[0], n.inputs[1]
        b, c, s = x.type.shape
        if s != seq:
            raise _refuse(f"{n.name} convolves {s} positions, the program runs {seq}")
        rows = x
        if s > 1:
            rows = g.add_node("transpose", [rows], [TensorType((b, s, c), x.type.dtype)], {"perm": (0, 2, 1)},
                              names=f"{n.name}.rows_t", before=n).outputs[0]
        rows = g.add_node("reshape", [rows], [TensorType((b, 1, s, c), x.type.dtype)], {"shape": (b, 1, s, c)},
                          names=f"{n.name}.rows", before=n).outputs[0]
        written = self._write(g, f"conv_cache.{i}", rows, pos, n)
        if self.role != "decode":
            return
        reads = self._causal_conv(n)
        assert reads is not None  # checked in call
        ins = [written, w, pos, *n.inputs[2:3]]
        new = g.add_node("cached_conv1d", ins, [TensorType((b, w.type.shape[0], 1), n.outputs[0].type.dtype)],
                         {"dilation": n.attrs.get("dilation", 1), "groups": n.attrs.get("groups", 1)},
                         names=n.name + CACHED,
                         before=n)
        for v in reads:
            g.replace_all_uses_with(v, new.outputs[0])
            if v.producer is not n:
                g.remove_node(v.producer)
        g.remove_node(n)

    def _attention(self, g: Graph, n: Node, i: int, pos: Value, seq: int) -> None:
        latent = n.op == "mla_attention"
        q = n.inputs[0]
        # What a token caches: its latent and rope key (MLA), or its key and value.
        rows = [("latent", n.inputs[2])] if latent else [("k", n.inputs[1]), ("v", n.inputs[2])]
        if q.type.shape[2] != seq or (latent and rows[0][1].type.shape[2] != seq):
            raise _refuse(f"attention {n.name} has {q.type.shape[2]} queries, another has {seq}")
        mask = None if latent else (n.inputs[3] if len(n.inputs) > 3 else None)
        sinks = n.inputs[4:5] if not latent else []
        # A prefill mask must be none (or one that hides nothing: the slot before sinks); decode's
        # one-token trace masks its own key only, which the cache's positions replace.
        # (a decode of C tokens of each slot whose mask the model computes from its position ids:
        # causal among them, as the cache's positions make it)
        causal_rows = self.role == "decode" and seq > 1 and mask is not None and not n.attrs.get("causal") \
            and self._hides_nothing(g, mask, causal_rows=True)
        if mask is not None and not causal_rows and not (
                (self.role == "decode" or n.attrs.get("causal")) and self._hides_nothing(g, mask)):
            raise _refuse(f"attention {n.name} has a mask that is not the plain causal one")
        if seq > 1 and not n.attrs.get("causal", False) and not causal_rows:
            raise _refuse(f"attention {n.name} is not causal")
        window = int(n.attrs.get("window", 0))
        if self.windows and self.windows[i] != UNCHECKED:
            long = self.windows[i]
            if long == FROM_DATA:
                raise _refuse(f"attention {n.name}: at the cache length its mask is computed from the tokens "
                              "(sparse or dynamic attention, such as an indexer's top-k of fewer keys than the "
                              "cache holds)")
            if long is None:
                raise _refuse(f"attention {n.name}: at the cache length its mask is neither causal nor a "
                              "sliding window")
            if long != window and not (window == 0 and seq <= long):  # a band wider than this trace is causal here
                raise _refuse(f"attention {n.name} has window {window} here and {long} at the cache length")
            window = long
        if window and latent:
            raise _refuse(f"attention {n.name}: a sliding window over latent attention")
        alibi = tuple(n.attrs.get("alibi", ()))
        if self.alibi and not latent:
            long_alibi = tuple(self.alibi[i])
            same = len(alibi) == len(long_alibi) and all(abs(a - b) <= 1e-6 * max(1.0, abs(b))
                                                         for a, b in zip(alibi, long_alibi, strict=True))
            if not same and (alibi or (self.role == "prefill" and seq > 1)):
                raise _refuse(f"attention {n.name} has ALiBi slopes {list(alibi)[:4]}.. here and "
                              f"{list(long_alibi)[:4]}.. at the cache length")
            alibi = long_alibi
        if alibi and self.role == "prefill" and not n.attrs.get("alibi"):
            n.set_attrs(alibi=alibi)
        if window and self.role == "prefill":
            n.set_attrs(window=window)
        written = [self._write(g, f"{self.prefix}kv_cache.{i}.{kind}", x, pos, n, None if latent else self.cache_dtype)
                   for kind, x in rows]
        if self.role == "decode":  # attend over the cache, query i at position[i]
            if latent:
                op, ins = "mla_attention", [*n.inputs[:2], *written, *n.inputs[3:5], pos]
                attrs = {"scale": n.attrs["scale"], "causal": False}
            else:
                op, ins, attrs = "cached_attention", [q, *written, pos, *sinks], {"scale": n.attrs["scale"]}
                if self.mixed:  # row i over its slot's cache
                    ins.append(next(v for v in g.inputs if v.name == SLOT))
                    attrs["slotted"] = 1
                if window:
                    attrs["window"] = window
                if n.attrs.get("softcap"):
                    attrs["softcap"] = n.attrs["softcap"]
                if alibi:
                    attrs["alibi"] = alibi
            new = g.add_node(op, ins, [n.outputs[0].type], attrs, names=n.name + CACHED, before=n)
            g.replace_all_uses_with(n.outputs[0], new.outputs[0])
            g.remove_node(n)

    def _hides_nothing(self, g: Graph, mask: Value, causal_rows: bool = False) -> bool:
        """Whether the one-token trace's mask over its own key hides nothing: folded, or (a mask
        the position ids input computes) evaluated at the position traced. `causal_rows`: whether
        a trace of C > 1 tokens of each slot (the model's positions computing its mask) hides
        exactly the later of them."""
        if hides_nothing(mask) and not causal_rows:
            return True
        if not self.decode_positions:
            return False
        slots = 1 if self.mixed else max(self.slots, 1)
        at = torch.full((slots,), self.trace_position)
        if self.decode_tokens > 1:
            at = self.trace_position + torch.arange(self.decode_tokens).repeat(slots, 1)
        t = evaluate_value(g, mask, {"position": at}, max_bytes=1 << 20)
        if t is None:
            return False
        kept = t if t.dtype == torch.bool else t == 0
        if causal_rows:  # C tokens of each slot a step: causal among them, what their positions give
            c = self.decode_tokens
            return t.dim() >= 2 and t.shape[-2:] == (c, c) and \
                bool((kept == torch.ones((c, c), dtype=torch.bool).tril()).all())
        return bool(kept.all())

    def _position_ids(self, g: Graph, pos: Value) -> None:
        """The model's own position ids input [batch, C] becomes the decode position (each
        slot's, [slots, C], with slots; C the tokens of each slot a step)."""
        ids = next((v for v in g.inputs if v.name == self.decode_positions), None)
        c = self.decode_tokens
        if ids is None or ids.type.rank != 2 or ids.type.shape[1] != c or ids.type.dtype.is_float:
            raise _refuse(f"the decode program has no position ids input {self.decode_positions!r} [batch, {c}]")
        first = next(n for n in g.nodes if n is not pos.producer) if pos.producer is not None else g.nodes[0]
        v = pos
        if pos.type.rank == 1:
            v = g.add_node("reshape", [pos], [TensorType((1, 1), DType.i64)], {"shape": (1, 1)},
                           names="position_ids_row", before=first).outputs[0]
        if ids.type.shape[0] != v.type.shape[0]:
            v = g.add_node("expand", [v], [TensorType(ids.type.shape, DType.i64)], {"shape": ids.type.shape},
                           names="position_ids_rows", before=first).outputs[0]
        if ids.type.dtype != DType.i64:
            v = g.add_node("cast", [v], [ids.type], {"dtype": ids.type.dtype}, names="position_ids_cast",
                           before=first).outputs[0]
        g.replace_all_uses_with(ids, v)
        g.inputs.remove(ids)

    def _write(self, g: Graph, name: str, x: Value, pos: Value, before: Node, dtype: DType | None = None) -> Value:
        """A state of `cache_len` rows for x's [b, heads, s, d] (b slots, or `slots`), with x
        written at `pos` (into the `slot` input's slot, a prefill with slots). `dtype`: the
        cache's own (--kv_cache_dtype; i8 rows are d + 4 bytes wide), else x's."""
        b, h, _, d = x.type.shape
        dt = dtype or x.type.dtype
        if dt != x.type.dtype and x.type.dtype not in (DType.f32, DType.bf16):
            raise NpucError("NPUC-E0123", f"cannot compile a decode program: {name} caches {x.type.dtype} rows, "
                            f"which a {dt} cache cannot take (kv_write converts f32 and bf16 rows)",
                            "leave --kv_cache_dtype at auto for this model", exit_code=EXIT_UNSUPPORTED)
        st = g.add_state(name, TensorType((max(self.slots, b), h, self.cache_len, kv_cache_width(dt, d)), dt))
        slot = [v for v in g.inputs if v.name == SLOT] if self.slots > 1 and (self.role != "decode" or self.mixed) \
            else []
        w = g.add_node("kv_write", [st, x, pos, *slot], [st.type], names=f"{name}.write", before=before)
        g.set_state_update(st, w.outputs[0])
        return w.outputs[0]

    def _rope(self, g: Graph, r: Node, pos: Value, seq: int, shared: dict[int, tuple[Value, Value]]) -> None:
        x, p, cos, sin = r.inputs
        if not (p.is_const and cos.is_const and sin.is_const) or p.const is None or cos.const is None \
                or sin.const is None:
            raise _refuse(f"RoPE {r.name} takes its positions or tables at run time")
        # The rows it reads: its folded rows at 0..seq-1, or (tables indexed by the model's own
        # position ids, ONNX's RotaryEmbedding) the cache's rows at the traced positions.
        ids = p.const.load().long().reshape(-1, seq)
        c, s = cos.const.load(), sin.const.load()
        if not bool((ids == ids[:1]).all()) or int(ids.min()) < 0 or int(ids.max()) >= c.shape[0]:
            raise _refuse(f"RoPE {r.name} reads other positions than the program's")
        c, s = c[ids[0]], s[ids[0]]
        lo, hi = self.trace_position, self.trace_position + seq
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
