"""Lowering: views and in-place results share buffers, buffers live as long as any
value in them, several programs share weights and states, and the `.om` sections
split and join exactly. Every lowered model also runs: a wrong plan is a wrong
result, so the arena is filled with NaN before runs that must not read stale bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ir_build import const, f32, i64, node  # noqa: E402

from npuc.backend.lower import Lowered, buffer_roots, lifetimes, lower
from npuc.backend.om_schema import Plans, Tasks
from npuc.backend.om_sections import PLAN, TASKS, join_model, split_model
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import InternalError, NpucError
from npuc.ir import Graph, verify
from npuc.runtime.session import Session

CPU = get_target("cpu")






def tensor_index(model: Any, name: str, region: str | None = None) -> int:
    hits = [i for i, t in enumerate(model.tensors)
            if t.name == name and (region is None or t.region == region)]
    assert len(hits) == 1, (name, region, hits)
    return hits[0]


def plan_buffers(model: Any, program: int = 0) -> dict[int, tuple[int, int]]:
    """Tensor index -> (first step, last step) of each buffer in a program's plan."""
    return {b.tensor: (b.first_step, b.last_step) for b in model.programs[program].plan.buffers}


def load(low: Lowered, tmp_path: Path, name: str = "m") -> Session:
    path = str(tmp_path / f"{name}.om")
    write_om(low, path)
    return Session.load(path)


def run_nan(sess: Session, inputs: dict[str, Any], program: str | None = None) -> dict[str, torch.Tensor]:
    """Run with every arena byte 0xFF (NaN as f32): reading a byte nobody wrote shows."""
    sess.arena.fill_(0xFF)
    return sess.run(inputs, program)


# --- views -------------------------------------------------------------------------


def _view_chain() -> Graph:
    g = Graph("main")
    x = g.add_input("x", f32(2, 3, 4))
    e = node(g, "exp", [x], name="e")
    r1 = node(g, "reshape", [e], {"shape": (6, 4)}, name="r1")
    n = node(g, "neg", [r1], name="n")
    r2 = node(g, "reshape", [n], {"shape": (2, 12)}, name="r2")
    g.set_outputs([r2])
    verify(g)
    return g


def test_reshape_output_is_a_view_of_its_operand() -> None:
    g = _view_chain()
    roots = buffer_roots(g)
    by_name = {v.name: v for v in g.values()}
    assert roots[id(by_name["r1"])] is by_name["e"]
    assert roots[id(by_name["r2"])] is by_name["n"]
    assert {v.name for v, _, _ in lifetimes(g).values()} == {"x", "e", "n"}

    low = lower(g, CPU)
    m = low.model
    e, r1, n, r2 = (tensor_index(m, k) for k in ("e", "r1", "n", "r2"))
    for view, base in ((r1, e), (r2, n)):
        tv, tb = m.tensors[view], m.tensors[base]
        assert tv.HasField("base") and tv.base == base
        assert (tv.region, tv.offset, tv.nbytes) == (tb.region, tb.offset, tb.nbytes)
        assert tv.region == "arena" and tv.nbytes == 96
        assert not tb.HasField("base")
    assert list(m.tensors[r1].shape) == [6, 4] and list(m.tensors[r2].shape) == [2, 12]
    bufs = plan_buffers(m)
    assert r1 not in bufs and r2 not in bufs  # a view has no buffer of its own
    assert set(bufs) == {tensor_index(m, "x"), e, n}
    # The ops name the views themselves (their shapes), not the bases.
    prog = m.programs[0]
    assert [o.op for o in prog.ops] == ["exp", "reshape", "neg", "reshape"]
    assert list(prog.ops[1].inputs) == [e] and list(prog.ops[1].outputs) == [r1]
    assert list(prog.ops[2].inputs) == [r1] and list(prog.outputs) == [r2]
    # n is an output through its view: it lives to the end.
    assert bufs[n] == (3, len(g.nodes) + 1)


def test_view_chain_runs(tmp_path: Path) -> None:
    sess = load(lower(_view_chain(), CPU), tmp_path)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    want = torch.neg(torch.exp(x)).reshape(2, 12)
    out = sess.run({"x": x.numpy()})["r2"]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out = run_nan(sess, {"x": x.numpy()})["r2"]
    assert out.shape == (2, 12)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def _late_view() -> Graph:
    """`a`'s own last use is step 2, but its view `av` is read at step 6: without the
    extension, `b` or `c` could take `a`'s bytes at steps 3..5."""
    g = Graph("main")
    x = g.add_input("x", f32(4, 8))
    a = node(g, "exp", [x], name="a")  # step 1
    av = node(g, "reshape", [a], {"shape": (32,)}, name="av")  # step 2
    b = node(g, "neg", [x], name="b")  # step 3
    c = node(g, "tanh", [b], name="c")  # step 4
    cv = node(g, "reshape", [c], {"shape": (32,)}, name="cv")  # step 5
    d = node(g, "add", [av, cv], name="d")  # step 6
    g.set_outputs([d])
    verify(g)
    return g


def test_view_extends_its_base_lifetime(tmp_path: Path) -> None:
    g = _late_view()
    live = {v.name: (s, e) for v, s, e in lifetimes(g).values()}
    assert live == {"x": (0, 3), "a": (1, 6), "c": (4, 6), "b": (3, 4), "d": (6, 7)}

    low = lower(g, CPU)
    m = low.model
    bufs = plan_buffers(m)
    assert bufs[tensor_index(m, "a")] == (1, 6)
    assert bufs[tensor_index(m, "c")] == (4, 6)
    assert tensor_index(m, "av") not in bufs and tensor_index(m, "cv") not in bufs
    # a's bytes are not reused while its view is live.
    a, b, c = (m.tensors[tensor_index(m, k)] for k in ("a", "b", "c"))
    for other in (b, c):
        assert a.offset + a.nbytes <= other.offset or other.offset + other.nbytes <= a.offset

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want = torch.exp(x).reshape(32) + torch.tanh(-x).reshape(32)
    out = run_nan(load(low, tmp_path), {"x": x.numpy()})["d"]
    torch.testing.assert_close(out, want)


def test_reshape_of_a_constant_is_not_aliased(tmp_path: Path) -> None:
    g = Graph("main")
    x = g.add_input("x", f32(6))
    wdata = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    w = const(g, "w", wdata)
    wr = node(g, "reshape", [w], {"shape": (6,)}, name="wr")
    y = node(g, "add", [x, wr], name="y")
    g.set_outputs([y])
    verify(g)
    assert buffer_roots(g)[id(wr)] is wr
    assert id(wr) in lifetimes(g)

    m = lower(g, CPU).model
    wi, wri = tensor_index(m, "w"), tensor_index(m, "wr")
    assert m.tensors[wi].region == "weights"
    t = m.tensors[wri]
    assert t.region == "arena" and not t.HasField("base")  # its own copy, in the arena
    assert wri in plan_buffers(m)

    sess = load(lower(g, CPU), tmp_path)
    xs = torch.ones(6)
    torch.testing.assert_close(run_nan(sess, {"x": xs.numpy()})["y"], xs + wdata.reshape(6))


# --- in place: states ----------------------------------------------------------------


def _cache_graph() -> Graph:
    g = Graph("main")
    new = g.add_input("new", f32(1, 2, 1, 4))
    pos = g.add_input("pos", i64(1))
    cache = g.add_state("cache", f32(1, 2, 8, 4))
    w = node(g, "kv_write", [cache, new, pos], name="w")
    g.set_state_update(cache, w)
    total = node(g, "reduce_sum", [w], {"axes": (2,)}, name="total")
    g.set_outputs([total])
    verify(g)
    return g


def test_inplace_result_shares_the_state_buffer() -> None:
    g = _cache_graph()
    cache = g.states["cache"]
    w = g.state_updates["cache"]
    assert buffer_roots(g)[id(w)] is cache
    assert id(cache) not in lifetimes(g)  # states are not in the arena

    low = lower(g, CPU)
    m = low.model
    ci, wi = tensor_index(m, "cache"), tensor_index(m, "w")
    tc, tw = m.tensors[ci], m.tensors[wi]
    assert tc.region == tw.region == "state"
    assert not tc.HasField("base") and tw.HasField("base") and tw.base == ci
    assert tw.offset == tc.offset and tw.nbytes == tc.nbytes == 1 * 2 * 8 * 4 * 4
    assert m.state_bytes == low.state_bytes == tc.nbytes
    bufs = plan_buffers(m)
    assert ci not in bufs and wi not in bufs
    assert list(m.programs[0].ops[0].inputs)[0] == ci and list(m.programs[0].ops[0].outputs) == [wi]


def test_state_persists_across_runs_and_resets(tmp_path: Path) -> None:
    sess = load(lower(_cache_graph(), CPU), tmp_path)
    cache = sess.views[tensor_index(sess.model, "cache")]
    assert not sess.state.any()
    one = torch.full((1, 2, 1, 4), 1.0)
    out1 = run_nan(sess, {"new": one.numpy(), "pos": np.array([0])})["total"]
    torch.testing.assert_close(out1, torch.full((1, 2, 4), 1.0))
    out2 = run_nan(sess, {"new": (2 * one).numpy(), "pos": np.array([3])})["total"]
    torch.testing.assert_close(out2, torch.full((1, 2, 4), 3.0))  # row 0 from the first run is still there
    want = torch.zeros(1, 2, 8, 4)
    want[:, :, 0] = 1.0
    want[:, :, 3] = 2.0
    torch.testing.assert_close(cache, want)
    sess.reset_state()
    assert not sess.state.any()
    out3 = run_nan(sess, {"new": one.numpy(), "pos": np.array([5])})["total"]
    torch.testing.assert_close(out3, torch.full((1, 2, 4), 1.0))


@pytest.mark.parametrize("read_after", [False, True], ids=["read-before-write", "read-after-write"])
def test_state_read_twice_is_refused(read_after: bool) -> None:
    g = Graph("main")
    new = g.add_input("new", f32(1, 2, 1, 4))
    pos = g.add_input("pos", i64(1))
    cache = g.add_state("cache", f32(1, 2, 8, 4))
    old = None if read_after else node(g, "neg", [cache], name="old")
    w = node(g, "kv_write", [cache, new, pos], name="w")
    if old is None:  # would read the bytes the in-place write has just overwritten
        old = node(g, "neg", [cache], name="old")
    g.set_state_update(cache, w)
    g.set_outputs([old])
    with pytest.raises(InternalError, match="in place"):
        verify(g)  # the verifier refuses it, and lower would too
    with pytest.raises(InternalError, match="in place"):
        lower(g, CPU)


def test_state_updated_out_of_place_is_refused() -> None:
    g = Graph("main")
    cache = g.add_state("cache", f32(1, 2, 8, 4))
    n = node(g, "neg", [cache], name="n")
    g.set_state_update(cache, n)
    g.set_outputs([n])
    verify(g)
    with pytest.raises(InternalError, match="in place"):
        lower(g, CPU)


# --- two programs -------------------------------------------------------------------

W = torch.tensor([1.0, -2.0, 0.5, 3.0])
B_PREFILL = torch.tensor([0.25, 0.5, 0.75, 1.0])
B_DECODE = torch.tensor([-1.0, -2.0, -3.0, -4.0])


def _program(name: str, rows: int, bias: torch.Tensor) -> Graph:
    """y = x * w + b; x's rows also go into the shared cache `s` (prefill at 0..rows-1,
    decode at its `position` input); `total` sums the whole cache."""
    g = Graph(name)
    x = g.add_input("x", f32(rows, 4))
    if name == "prefill":
        pos = const(g, "positions", torch.arange(rows))
    else:
        pos = g.add_input("position", i64(rows))
    w = const(g, "w", W.clone())
    b = const(g, "b", bias.clone())
    y = node(g, "add", [node(g, "mul", [x, w], name="xw"), b], name="y")
    s = g.add_state("s", f32(1, 1, 8, 4))
    xr = node(g, "reshape", [x], {"shape": (1, 1, rows, 4)}, name="xr")
    ws = node(g, "kv_write", [s, xr, pos], name="ws")
    g.set_state_update(s, ws)
    total = node(g, "reduce_sum", [ws], {"axes": (0, 1, 2)}, name="total")
    g.set_outputs([y, total])
    verify(g)
    return g


def _two_programs() -> Lowered:
    return lower([_program("prefill", 3, B_PREFILL), _program("decode", 1, B_DECODE)], CPU, {"k": "v"})


def test_programs_share_weights_and_states() -> None:
    low = _two_programs()
    m = low.model
    assert [p.name for p in m.programs] == ["prefill", "decode"]
    weights = {t.name: i for i, t in enumerate(m.tensors) if t.region == "weights"}
    assert set(weights) == {"positions", "w", "b", "decode.b"}
    assert len(low.weights) == 4
    # The same weight (name and bytes) is one tensor, read by both programs' mul.
    muls = [next(o for o in p.ops if o.op == "mul") for p in m.programs]
    assert [o.inputs[1] for o in muls] == [weights["w"], weights["w"]]
    # Same name, other bytes: each program reads its own.
    adds = [next(o for o in p.ops if o.op == "add") for p in m.programs]
    assert [o.inputs[1] for o in adds] == [weights["b"], weights["decode.b"]]
    offs = sorted(m.tensors[i].offset for i in weights.values())
    assert all(o % CPU.weight_alignment == 0 for o in offs) and len(set(offs)) == 4
    assert m.weights_bytes == low.weights_bytes
    # One state, written in place by both programs.
    states = [i for i, t in enumerate(m.tensors) if t.region == "state" and not t.HasField("base")]
    assert [m.tensors[i].name for i in states] == ["s"]
    (si,) = states
    for p in m.programs:
        kw = next(o for o in p.ops if o.op == "kv_write")
        assert kw.inputs[0] == si and m.tensors[kw.outputs[0]].base == si
    assert m.state_bytes == low.state_bytes == 8 * 4 * 4
    # Each program has its own plan; the runtime allocates the largest.
    assert low.arena_bytes == max(p.plan.arena_bytes for p in m.programs)
    assert low.arena_bytes == max(p.arena_bytes for p in low.plans)
    assert len(low.plans) == 2


def test_two_programs_run_from_one_session(tmp_path: Path) -> None:
    sess = load(_two_programs(), tmp_path)
    assert set(sess.programs) == {"prefill", "decode"}
    gen = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(3, 4, generator=gen), torch.randn(1, 4, generator=gen)
    out = run_nan(sess, {"x": x1.numpy()}, program="prefill")
    torch.testing.assert_close(out["y"], x1 * W + B_PREFILL)
    torch.testing.assert_close(out["total"], x1.sum(0))
    out = run_nan(sess, {"x": x2.numpy(), "position": np.array([3])}, program="decode")
    torch.testing.assert_close(out["y"], x2 * W + B_DECODE)
    torch.testing.assert_close(out["total"], x1.sum(0) + x2[0])  # decode sees what prefill wrote
    assert sess.run({"x": x1.numpy()})["y"].shape == (3, 4)  # the first program by default
    with pytest.raises(NpucError) as e:
        sess.run({"x": x2.numpy()}, program="nope")
    assert e.value.code == "NPUC-E0111"


def test_same_state_name_with_other_types_is_refused() -> None:
    a, b = Graph("prefill"), Graph("decode")
    for g, rows in ((a, 8), (b, 4)):
        s = g.add_state("s", f32(1, 1, rows, 4))
        n = g.add_input("n", f32(1, 1, 1, 4))
        p = g.add_input("p", i64(1))
        w = node(g, "kv_write", [s, n, p], name="w")
        g.set_state_update(s, w)
        g.set_outputs([node(g, "neg", [w], name="o")])
    with pytest.raises(InternalError, match="state s"):
        lower([a, b], CPU)


# --- sections -------------------------------------------------------------------------


def test_split_join_round_trips() -> None:
    for low in (_two_programs(), lower(_view_chain(), CPU, {"a": "1"}), lower(_cache_graph(), CPU)):
        m = low.model
        sections = split_model(m)
        back = join_model("m.om", sections)
        assert back.SerializeToString(deterministic=True) == m.SerializeToString(deterministic=True)
        assert split_model(back) == sections


def _join_error(sections: dict[str, bytes]) -> NpucError:
    with pytest.raises(NpucError) as e:
        join_model("m.om", sections)
    assert e.value.code == "NPUC-E0405" and "m.om" in e.value.message
    return e.value


def test_join_refuses_sections_that_disagree() -> None:
    sections = split_model(_two_programs().model)

    tasks = Tasks()
    tasks.ParseFromString(sections[TASKS])
    del tasks.programs[1].tasks[-1]  # one task fewer than decode has ops
    err = _join_error({**sections, TASKS: tasks.SerializeToString(deterministic=True)})
    assert "decode" in err.message

    plans = Plans()
    plans.ParseFromString(sections[PLAN])
    plans.plans[0].program = "other"
    _join_error({**sections, PLAN: plans.SerializeToString(deterministic=True)})

    plans = Plans()
    plans.ParseFromString(sections[PLAN])
    del plans.plans[1]  # a program without a plan
    _join_error({**sections, PLAN: plans.SerializeToString(deterministic=True)})

    _join_error({**sections, TASKS: b"\xff\xff\xff"})  # does not parse


def test_renamed_weights_never_clash_and_equal_copies_are_shared() -> None:
    """Three programs: `w` differs in b, equals b's in c; b also has a constant named `b.w`."""
    def prog(name: str, w: torch.Tensor, extra: bool = False) -> Graph:
        g = Graph(name)
        x = g.add_input("x", f32(4))
        y = node(g, "add", [x, const(g, "w", w)], name="y")
        if extra:
            y = node(g, "add", [y, const(g, "b.w", torch.full((4,), 7.0))], name="z")
        g.set_outputs([y])
        return g

    low = lower([prog("a", torch.zeros(4)), prog("b", torch.ones(4), extra=True), prog("c", torch.ones(4))], CPU)
    names = [t.name for t in low.model.tensors if t.region == "weights"]
    assert len(names) == len(set(names)) == 3, names
    read = [[low.model.tensors[i].name for op in p.ops for i in op.inputs
             if low.model.tensors[i].region == "weights"] for p in low.model.programs]
    assert read[1][0] == read[2][0] != read[0][0]  # c shares b's copy of w


def test_kv_write_into_a_constant_is_refused_by_the_verifier() -> None:
    g = Graph("main")
    c = const(g, "c", torch.zeros(1, 1, 4, 2))
    w = node(g, "kv_write", [c, g.add_input("n", f32(1, 1, 1, 2)), g.add_input("p", i64(1))], name="w")
    g.set_outputs([w])
    with pytest.raises(InternalError, match="must be a state"):
        verify(g)
