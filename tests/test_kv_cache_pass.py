"""The KV-cache pass on hand-built two-layer graphs (RoPE by table, fused causal
attention, grouped-query heads): the prefill and decode programs it makes, in
FileCheck style, their numerics against plain causal attention over the whole
sequence, and the graphs it refuses.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ir_build import const, f32, node  # noqa: E402

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph, TensorType, get_op, parse_graph, verify
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.kv_cache import FROM_DATA, KVCache, RopeTables
from npuc.runtime.session import Session

B, HQ, HKV, D = 1, 4, 2, 8
CACHE = 16  # cache rows, and the tables' rows (max_seq_len)
SCALE = 1 / math.sqrt(D)
TRACE = 3  # the position the decode graphs are "traced" at
LAYERS = 2


def rope_tables(rows: int, theta: float = 10000.0) -> RopeTables:
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    f = torch.outer(torch.arange(rows, dtype=torch.float64), inv)
    return f.cos().float(), f.sin().float()


TABLES = rope_tables(CACHE)





def build(seq: int, start: int = 0, name: str = "main", causal: bool = True, rope: bool = True,
          positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> Graph:
    """What a trace of `seq` tokens at positions start.. looks like after fusion: each
    layer ropes its query (the previous layer's output) and its key input with the
    traced rows of the tables (indexed by 0..seq-1) and attends causally."""
    g = Graph(name)
    q = g.add_input("q0", f32(B, HQ, seq, D))
    pos = const(g, "pos", torch.arange(seq) if positions is None else positions)
    cos = const(g, "cos", TABLES[0][start:start + seq].clone())
    sin = const(g, "sin", TABLES[1][start:start + seq].clone())
    m = const(g, "mask", mask) if mask is not None else None
    for i in range(LAYERS):
        k = g.add_input(f"k{i}", f32(B, HKV, seq, D))
        v = g.add_input(f"v{i}", f32(B, HKV, seq, D))
        if rope:
            q = node(g, "rope_lut", [q, pos, cos, sin], name=f"qr{i}")
            k = node(g, "rope_lut", [k, pos, cos, sin], name=f"kr{i}")
        q = node(g, "fused_attention", [q, k, v] + ([m] if m is not None else []),
                 {"scale": SCALE, "causal": causal}, name=f"o{i}")
    g.set_outputs([q])
    verify(g)
    return g


def apply(role: str, g: Graph, tables: list[RopeTables] | None = None, trace_position: int = 0) -> Graph:
    res = KVCache(role, CACHE, [TABLES] if tables is None else tables, trace_position)(g)
    assert res.modified and res.details == {"caches": 2 * LAYERS, "rope_lut": 2 * LAYERS}
    DeadCodeElimination()(res.graph)
    verify(res.graph)
    return res.graph


def check_order(text: str, expected: list[str]) -> None:
    """FileCheck: each line of `expected` occurs in `text`, in this order."""
    at = 0
    for want in expected:
        found = text.find(want, at)
        assert found >= 0, f"{want!r} not found after offset {at} in:\n{text}"
        at = found + len(want)


def round_trips(g: Graph) -> None:
    text = str(g)
    assert str(parse_graph(text)) == text


# --- reference: plain causal attention over the whole sequence ------------------------


def rope_ref(x: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE at positions 0..s-1."""
    s, h = x.shape[-2], D // 2
    c, sn = TABLES[0][:s], TABLES[1][:s]
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * c - x2 * sn, x2 * c + x1 * sn), dim=-1)


def reference(feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's output over the whole sequence, and what its caches hold."""
    q = feeds["q0"]
    caches = {}
    for i in range(LAYERS):
        k, v = rope_ref(feeds[f"k{i}"]), feeds[f"v{i}"]
        caches[f"kv_cache.{i}.k"], caches[f"kv_cache.{i}.v"] = k, v
        rep = HQ // HKV
        q = F.scaled_dot_product_attention(rope_ref(q), k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True, scale=SCALE)
    return q, caches


def full_feeds(seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    feeds = {"q0": torch.randn(B, HQ, seq, D, generator=gen)}
    for i in range(LAYERS):
        feeds[f"k{i}"] = torch.randn(B, HKV, seq, D, generator=gen)
        feeds[f"v{i}"] = torch.randn(B, HKV, seq, D, generator=gen)
    return feeds


def rows(feeds: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {k: v[:, :, lo:hi].contiguous() for k, v in feeds.items()}


def interpret(g: Graph, feeds: dict[str, torch.Tensor],
              states: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Run `g` op by op with the registry's kernels; states are updated in place."""
    env: dict[int, torch.Tensor] = {id(v): feeds[v.name] for v in g.inputs}
    env.update({id(c): c.const.load() for c in g.constants.values() if c.const is not None})
    env.update({id(st): states[n] for n, st in g.states.items()})
    for n in g.nodes:
        outs = get_op(n.op).run([env[id(v)] for v in n.inputs], n.attrs)
        env.update({id(o): r for o, r in zip(n.outputs, outs, strict=True)})
    for name, u in g.state_updates.items():
        assert env[id(u)].data_ptr() == states[name].data_ptr()  # written in place
    return [env[id(v)] for v in g.outputs]


# --- prefill ----------------------------------------------------------------------------


def test_prefill_writes_the_caches() -> None:
    g = apply("prefill", build(4, name="prefill"))
    cache_t = f32(B, HKV, CACHE, D)
    assert list(g.states) == [f"kv_cache.{i}.{kv}" for i in range(LAYERS) for kv in "kv"]
    assert all(st.type == cache_t for st in g.states.values())
    for name, st in g.states.items():
        u = g.state_updates[name]
        assert u.producer is not None and u.producer.op == "kv_write" and u.producer.inputs[0] is st
    assert [n.op for n in g.nodes].count("fused_attention") == LAYERS
    assert all(n.attrs["causal"] for n in g.nodes if n.op == "fused_attention")
    text = str(g)
    check_order(text, [
        "graph prefill(%q0 : f32[1,4,4,8], %k0 : f32[1,2,4,8], %v0 : f32[1,2,4,8], %k1 : f32[1,2,4,8], "
        "%v1 : f32[1,2,4,8]) {",
        "const @pos : i64[4]",
        "const @positions_4 : i64[4]",
        "const @rope_cos_table : f32[16,4]",
        "const @rope_sin_table : f32[16,4]",
        "state %kv_cache.0.k : f32[1,2,16,8]",
        "state %kv_cache.0.v : f32[1,2,16,8]",
        "state %kv_cache.1.k : f32[1,2,16,8]",
        "state %kv_cache.1.v : f32[1,2,16,8]",
        "%qr0 : f32[1,4,4,8] = rope_lut(%q0, @pos, @rope_cos_table, @rope_sin_table)",
        "%kr0 : f32[1,2,4,8] = rope_lut(%k0, @pos, @rope_cos_table, @rope_sin_table)",
        "%kv_cache.0.k.write : f32[1,2,16,8] = kv_write(%kv_cache.0.k, %kr0, @positions_4)",
        "%kv_cache.0.v.write : f32[1,2,16,8] = kv_write(%kv_cache.0.v, %v0, @positions_4)",
        f"%o0 : f32[1,4,4,8] = fused_attention[causal=true, scale={SCALE!r}](%qr0, %kr0, %v0)",
        "%qr1 : f32[1,4,4,8] = rope_lut(%o0, @pos, @rope_cos_table, @rope_sin_table)",
        "%kv_cache.1.k.write : f32[1,2,16,8] = kv_write(%kv_cache.1.k, %kr1, @positions_4)",
        f"%o1 : f32[1,4,4,8] = fused_attention[causal=true, scale={SCALE!r}](%qr1, %kr1, %v1)",
        "update %kv_cache.0.k = %kv_cache.0.k.write",
        "update %kv_cache.0.v = %kv_cache.0.v.write",
        "update %kv_cache.1.k = %kv_cache.1.k.write",
        "update %kv_cache.1.v = %kv_cache.1.v.write",
        "return %o1",
        "}",
    ])
    # The traced [4, d/2] rows gave way to the max-length tables; nothing is cached attention.
    assert "@cos" not in text and "@sin" not in text and "cached_attention" not in text
    round_trips(g)


def test_prefill_numerics_and_caches() -> None:
    seq = 5
    g = apply("prefill", build(seq))
    feeds = full_feeds(seq)
    states = {n: torch.zeros(st.type.shape) for n, st in g.states.items()}
    (out,) = interpret(g, feeds, states)
    want, caches = reference(feeds)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for name, c in caches.items():
        torch.testing.assert_close(states[name][:, :, :seq], c, rtol=1e-6, atol=1e-6)
        assert not states[name][:, :, seq:].any()


def test_one_token_prefill_need_not_be_causal() -> None:
    g = apply("prefill", build(1, causal=False))
    assert [n.op for n in g.nodes].count("kv_write") == 2 * LAYERS


# --- decode -----------------------------------------------------------------------------


def test_decode_reads_the_caches() -> None:
    g = apply("decode", build(1, TRACE, name="decode"), trace_position=TRACE)
    assert g.inputs[-1].name == "position" and g.inputs[-1].type == TensorType((1,), DType.i64)
    ops = [n.op for n in g.nodes]
    assert "fused_attention" not in ops and ops.count("cached_attention") == LAYERS
    for n in g.nodes:
        if n.op == "cached_attention":
            writes = [v.producer.op for v in n.inputs[1:3] if v.producer is not None]
            assert writes == ["kv_write", "kv_write"]
            assert n.inputs[1] is g.state_updates[n.inputs[1].name.removesuffix(".write")]
        if n.op == "rope_lut":
            assert n.inputs[1] is g.inputs[-1]
    text = str(g)
    check_order(text, [
        "graph decode(%q0 : f32[1,4,1,8], %k0 : f32[1,2,1,8], %v0 : f32[1,2,1,8], %k1 : f32[1,2,1,8], "
        "%v1 : f32[1,2,1,8], %position : i64[1]) {",
        "const @rope_cos_table : f32[16,4]",
        "const @rope_sin_table : f32[16,4]",
        "state %kv_cache.0.k : f32[1,2,16,8]",
        "state %kv_cache.1.v : f32[1,2,16,8]",
        "%qr0 : f32[1,4,1,8] = rope_lut(%q0, %position, @rope_cos_table, @rope_sin_table)",
        "%kr0 : f32[1,2,1,8] = rope_lut(%k0, %position, @rope_cos_table, @rope_sin_table)",
        "%kv_cache.0.k.write : f32[1,2,16,8] = kv_write(%kv_cache.0.k, %kr0, %position)",
        "%kv_cache.0.v.write : f32[1,2,16,8] = kv_write(%kv_cache.0.v, %v0, %position)",
        f"%o0.cached : f32[1,4,1,8] = cached_attention[scale={SCALE!r}](%qr0, %kv_cache.0.k.write, "
        "%kv_cache.0.v.write, %position)",
        "%qr1 : f32[1,4,1,8] = rope_lut(%o0.cached, %position, @rope_cos_table, @rope_sin_table)",
        f"%o1.cached : f32[1,4,1,8] = cached_attention[scale={SCALE!r}](%qr1, %kv_cache.1.k.write, "
        "%kv_cache.1.v.write, %position)",
        "update %kv_cache.0.k = %kv_cache.0.k.write",
        "update %kv_cache.1.v = %kv_cache.1.v.write",
        "return %o1.cached",
    ])
    # The traced position (a constant 0 into the traced rows) and those rows are gone.
    assert "@pos" not in text and "@cos" not in text and "@sin" not in text
    round_trips(g)


@pytest.mark.parametrize("p", [1, 6, CACHE - 1])
def test_decode_step_is_a_row_of_full_causal_attention(p: int) -> None:
    g = apply("decode", build(1, TRACE), trace_position=TRACE)
    feeds = full_feeds(p + 1, seed=p)
    want, caches = reference(feeds)
    states = {}
    for name, c in caches.items():  # positions 0..p-1 cached; the rest is garbage decode must not read
        states[name] = torch.full((B, HKV, CACHE, D), 1e4)
        states[name][:, :, :p] = c[:, :, :p]
    step = {**rows(feeds, p, p + 1), "position": torch.tensor([p])}
    (out,) = interpret(g, step, states)
    torch.testing.assert_close(out, want[:, :, p:p + 1], rtol=1e-5, atol=1e-5)
    for name, c in caches.items():  # the step wrote its own row
        torch.testing.assert_close(states[name][:, :, p], c[:, :, p], rtol=1e-6, atol=1e-6)


def test_decode_drops_a_mask_that_hides_nothing() -> None:
    g = apply("decode", build(1, TRACE, mask=torch.zeros(1, 1, 1, 1)), trace_position=TRACE)
    assert "@mask" not in str(g)
    assert all(len(n.inputs) == 4 for n in g.nodes if n.op == "cached_attention")


def test_prefill_then_decode_through_the_runtime(tmp_path: Path) -> None:
    """Both programs in one .om over one cache: prefill 5 tokens, then decode the rest;
    every output is the full causal computation's row, with a NaN-filled arena."""
    pre, total = 5, 9
    prefill = apply("prefill", build(pre, name="prefill"))
    decode = apply("decode", build(1, TRACE, name="decode"), trace_position=TRACE)
    low = lower([prefill, decode], get_target("cpu"))
    m = low.model
    weights = [t.name for t in m.tensors if t.region == "weights"]
    assert weights.count("rope_cos_table") == 1 and weights.count("rope_sin_table") == 1  # shared
    states = [t.name for t in m.tensors if t.region == "state" and not t.HasField("base")]
    assert states == list(prefill.states)
    assert m.state_bytes == 2 * LAYERS * B * HKV * CACHE * D * 4
    path = str(tmp_path / "kv.om")
    write_om(low, path)
    sess = Session.load(path)
    feeds = full_feeds(total, seed=7)
    want, _ = reference(feeds)

    def run(inputs: dict[str, Any], program: str) -> torch.Tensor:
        sess.arena.fill_(0xFF)
        (out,) = sess.run({k: np.asarray(v) for k, v in inputs.items()}, program).values()
        return out

    torch.testing.assert_close(run(rows(feeds, 0, pre), "prefill"), want[:, :, :pre], rtol=1e-5, atol=1e-5)
    for p in range(pre, total):
        out = run({**rows(feeds, p, p + 1), "position": np.array([p])}, "decode")
        torch.testing.assert_close(out, want[:, :, p:p + 1], rtol=1e-5, atol=1e-5)
    # A new sequence: after a reset the same decode step no longer sees the prompt.
    sess.reset_state()
    out = run({**rows(feeds, total - 1, total), "position": np.array([total - 1])}, "decode")
    assert not torch.allclose(out, want[:, :, total - 1:total], atol=1e-3)


@pytest.mark.parametrize("mode, dtype", [("allow_mix_precision_bf16", DType.bf16),
                                         ("allow_fp32_to_fp16", DType.f16)])
def test_half_caches_through_the_runtime(mode: str, dtype: DType, tmp_path: Path) -> None:
    """The precision pass after this one gives both programs' caches the mode's half dtype
    (half the state bytes); prefill then decode still compute the full causal rows, to
    the half dtype's rounding of q, k and v (scores in f32)."""
    from npuc.passes.precision import Precision

    pre, total = 5, 9
    graphs = [apply("prefill", build(pre, name="prefill")),
              apply("decode", build(1, TRACE, name="decode"), trace_position=TRACE)]
    for g in graphs:
        res = Precision(mode)(g)
        verify(g)
        assert res.details["caches"] == [f"kv_cache.{i}.{kv} {dtype}" for i in range(LAYERS) for kv in "kv"]
        assert all(st.type == TensorType((B, HKV, CACHE, D), dtype) for st in g.states.values())
        assert not res.details["reads_state"]
    check_order(str(graphs[1]), [
        f"state %kv_cache.0.k : {dtype}[1,2,16,8]",
        f"%kr0_{dtype} : {dtype}[1,2,1,8] = cast[dtype={dtype}](%kr0)",
        f"%kv_cache.0.k.write : {dtype}[1,2,16,8] = kv_write(%kv_cache.0.k, %kr0_{dtype}, %position)",
        f"%o0.cached_{dtype} : {dtype}[1,4,1,8] = cached_attention[scale={SCALE!r}](%qr0_{dtype}, "
        "%kv_cache.0.k.write, %kv_cache.0.v.write, %position)",
        f"%o0.cached : f32[1,4,1,8] = cast[dtype=f32](%o0.cached_{dtype})",
    ])
    low = lower(graphs, get_target("cpu"))
    assert low.model.state_bytes == 2 * LAYERS * B * HKV * CACHE * D * dtype.itemsize
    write_om(low, str(tmp_path / "kv.om"))
    sess = Session.load(str(tmp_path / "kv.om"))
    feeds = full_feeds(total, seed=7)
    want, _ = reference(feeds)
    tol = 2 * torch.finfo(dtype.torch).eps * float(want.abs().max())  # measured: at most 0.2 of this
    (out,) = sess.run({k: np.asarray(v) for k, v in rows(feeds, 0, pre).items()}, "prefill").values()
    assert float((out - want[:, :, :pre]).abs().max()) < tol
    for p in range(pre, total):
        (out,) = sess.run({**{k: np.asarray(v) for k, v in rows(feeds, p, p + 1).items()},
                           "position": np.array([p])}, "decode").values()
        assert float((out - want[:, :, p:p + 1]).abs().max()) < tol, p


# --- refusals ---------------------------------------------------------------------------


def refused(g: Graph, role: str = "prefill", tables: list[RopeTables] | None = None, trace_position: int = 0,
            match: str = "") -> None:
    with pytest.raises(NpucError, match=match) as e:
        KVCache(role, CACHE, [TABLES] if tables is None else tables, trace_position)(g)
    assert e.value.code == "NPUC-E0123"


def test_refuses_a_graph_without_fused_attention() -> None:
    g = Graph("main")
    x = g.add_input("x", f32(B, HQ, 4, D))
    y = node(g, "rope_lut", [x, const(g, "pos", torch.arange(4)), const(g, "cos", TABLES[0][:4].clone()),
                             const(g, "sin", TABLES[1][:4].clone())], name="y")
    g.set_outputs([y])
    refused(g, match="no fused attention")


def test_refuses_non_causal_prefill() -> None:
    refused(build(4, causal=False), match="not causal")


def test_refuses_a_mask_in_prefill() -> None:
    # (one of zeros hides nothing: it stands where a mask slot must be filled, before sinks)
    refused(build(4, mask=torch.zeros(1, 1, 4, 4).index_fill(3, torch.tensor([0]), float("-inf"))), match="mask")


def test_refuses_fewer_attentions_than_layers() -> None:
    # A layer that mixes tokens some other way (linear attention) would decode without its past.
    with pytest.raises(NpucError, match=f"{LAYERS} fused attention\\(s\\) for {LAYERS + 1} layers"):
        KVCache("prefill", CACHE, [TABLES], 0, layers=LAYERS + 1)(build(4))


@pytest.mark.parametrize(("pads", "why"), [((1, 1), "mixer_conv convolves over the sequence, but not causally"),
                                           ((2, 0), "mixer_conv convolves 8 positions, the program runs 4")])
def test_refuses_a_convolution_it_cannot_cache(pads: tuple[int, int], why: str) -> None:
    # A conv's inputs are cached by position when it is causal over the program's tokens
    # (tests/test_conv_cache.py); one that sees later tokens, or runs along another axis, is named.
    g = build(4)
    x = g.outputs[0]
    seq = node(g, "reshape", [x], {"shape": (B, HQ * 4, D)}, name="seq")
    y = node(g, "conv1d", [seq, const(g, "w", torch.randn(HQ * 4, 1, 3))], {"pads": pads, "groups": HQ * 4},
             name="mixer_conv")
    g.set_outputs([y])
    refused(g, match=why)


def test_refuses_a_mask_at_the_cache_length_computed_from_the_tokens() -> None:
    # sparse attention past its top-k (DeepSeek-V3.2 at a cache longer than index_topk)
    with pytest.raises(NpucError, match="computed from the tokens"):
        KVCache("decode", CACHE, [TABLES], TRACE, windows=[FROM_DATA] * LAYERS)(build(1, TRACE))


def test_refuses_a_mask_at_the_cache_length_that_is_no_window() -> None:
    with pytest.raises(NpucError, match="neither causal nor a sliding window"):
        KVCache("decode", CACHE, [TABLES], TRACE, windows=[None] * LAYERS)(build(1, TRACE))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_window_wider_than_the_trace_comes_from_the_cache_length(role: str) -> None:
    # prefill of 4 under a window of 6: causal here, a band at the cache length
    g = build(4) if role == "prefill" else build(1, TRACE)
    res = KVCache(role, CACHE, [TABLES], 0 if role == "prefill" else TRACE, windows=[6] * LAYERS)(g)
    ops = [n for n in res.graph.nodes if n.op in ("fused_attention", "cached_attention")]
    assert len(ops) == LAYERS and all(n.attrs["window"] == 6 for n in ops)
    # a window at the cache length that the prefill's own mask contradicts
    with pytest.raises(NpucError, match="window 0 here and 2"):
        KVCache("prefill", CACHE, [TABLES], 0, windows=[2] * LAYERS)(build(4))


def test_refuses_a_multi_token_decode() -> None:
    refused(build(4), role="decode", match="4 query positions")


def test_caches_an_attention_without_positions() -> None:
    """NoPE (Jamba's, Nemotron-H's attention): an ordinary cached attention; whether positions
    were baked in instead is decode-check's to find (tests/test_recurrent.py)."""
    for role, seq in (("prefill", 4), ("decode", 1)):
        out = KVCache(role, CACHE)(build(seq, rope=False)).graph
        assert {n for n in out.states} >= {"kv_cache.0.k", "kv_cache.0.v"}
        assert any(n.op == ("cached_attention" if role == "decode" else "fused_attention") for n in out.nodes)


def test_rope_indexing_the_whole_table_by_its_position_ids() -> None:
    """ONNX's RotaryEmbedding reads its cache at the model's position ids: the rows it reads at
    the traced positions are what is compared, prefill's and decode's."""
    for role, seq, start in (("prefill", 4, 0), ("decode", 1, TRACE)):
        g = build(seq, start, positions=torch.arange(start, start + seq))
        for n in g.nodes:
            if n.op == "rope_lut":
                for i, t in ((2, TABLES[0]), (3, TABLES[1])):
                    n.set_input(i, const(g, f"{n.name}_{i}", t.clone()))
        out = KVCache(role, CACHE, [TABLES], start)(g).graph
        ropes = [n for n in out.nodes if n.op == "rope_lut"]
        assert ropes and all(r.inputs[2].name == "rope_cos_table" for r in ropes)
        assert all((r.inputs[1].name == "position") == (role == "decode") for r in ropes)


def test_refuses_rope_at_other_positions() -> None:
    refused(build(4, positions=torch.arange(1, 5)), match="reads other positions")


@pytest.mark.parametrize("tables", [
    [rope_tables(CACHE, theta=500.0)],  # another base frequency
    [rope_tables(3)],  # fewer rows than the graph's
], ids=["other-theta", "too-short"])
def test_refuses_tables_that_do_not_match(tables: list[RopeTables]) -> None:
    refused(build(4), tables=tables, match="no table")


def test_refuses_decode_traced_elsewhere() -> None:
    # The graph's rows are position 3's, the pass is told position 2.
    refused(build(1, TRACE), role="decode", trace_position=TRACE - 1, match="no table")


def test_refuses_ambiguous_tables() -> None:
    other = (TABLES[0].clone(), TABLES[1].clone())
    other[0][8:] = 0.0  # agrees with the graph's rows 0..3, differs beyond
    refused(build(4), tables=[TABLES, other], match="several")
    # The same table given twice is not ambiguous.
    apply("prefill", build(4), tables=[TABLES, (TABLES[0].clone(), TABLES[1].clone())])


# --- ALiBi ------------------------------------------------------------------------------

SLOPES = (0.5, 0.25, 0.125, 0.0625)


def test_alibi_decode_rows_are_the_prefill_rows_and_hf_form() -> None:
    # cached_attention at position p is row p of the causal prefill; and slope * (j - i) is
    # softmax-equal to Bloom's slope * j added as a mask
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(B, HQ, 6, D, generator=gen), torch.randn(B, HKV, 6, D, generator=gen), \
        torch.randn(B, HKV, 6, D, generator=gen)
    full = get_op("fused_attention").run([q, k, v], {"scale": SCALE, "causal": True, "alibi": SLOPES})[0]
    kc, vc = torch.zeros(B, HKV, CACHE, D), torch.zeros(B, HKV, CACHE, D)
    kc[:, :, :6], vc[:, :, :6] = k, v
    for p in range(6):
        row = get_op("cached_attention").run([q[:, :, p:p + 1], kc, vc, torch.tensor([p])],
                                             {"scale": SCALE, "alibi": SLOPES})[0]
        torch.testing.assert_close(row, full[:, :, p:p + 1])
    bloom = torch.tensor(SLOPES).view(1, HQ, 1, 1) * torch.arange(6.0).view(1, 1, 1, 6)
    mask = bloom + torch.full((6, 6), float("-inf")).triu(1)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1),
                                          attn_mask=mask, scale=SCALE)
    torch.testing.assert_close(full, want)


def test_alibi_slopes_come_from_the_cache_length_trace() -> None:
    # A one-token decode trace has no ALiBi to see (its key is at distance 0): the slopes the
    # model showed at max_seq_len go on each cached attention, and stand in for RoPE.
    res = KVCache("decode", CACHE, [], TRACE, windows=[0] * LAYERS, alibi=[SLOPES] * LAYERS)(build(1, TRACE, rope=False))
    cached = [n for n in res.graph.nodes if n.op == "cached_attention"]
    assert len(cached) == LAYERS and all(tuple(n.attrs["alibi"]) == SLOPES for n in cached)


def test_refuses_prefill_alibi_that_differs_from_the_cache_length() -> None:
    g = build(4, rope=False)
    for n in g.nodes:
        if n.op == "fused_attention":
            n.set_attrs(alibi=SLOPES[::-1])
    with pytest.raises(NpucError, match="ALiBi slopes"):
        KVCache("prefill", CACHE, [], 0, windows=[0] * LAYERS, alibi=[SLOPES] * LAYERS)(g)
