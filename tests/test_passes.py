"""Pass tests in FileCheck style: input IR -> pass -> expected IR, each case headed
by a comment. The verifier runs before and after every pass, and every text
round-trips. Graphs whose folding needs constant data are built through the API
with `TensorSource` constants (parsed constants carry no data).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest
import torch

from npuc.errors import InternalError
from npuc.ir import DType, Graph, TensorSource, TensorType, get_op, parse_graph, print_graph, verify
from npuc.passes.constant_folding import ConstantFolding
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.manager import Pass, PassManager, PassResult
from npuc.passes.pipeline import default_pipeline


def ir(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def check(p: Pass, src: str, expected: str, modified: bool = True) -> Graph:
    """Run `p` on the parsed `src` and compare the printed result with `expected`."""
    src, expected = ir(src), ir(expected)
    g = parse_graph(src)
    assert print_graph(g) == src
    verify(g)
    res = p(g)
    verify(res.graph)
    assert print_graph(res.graph) == expected
    assert res.modified is modified
    assert print_graph(parse_graph(expected)) == expected
    return res.graph


def f32(*shape: int, fmt: str = "ND") -> TensorType:
    return TensorType(shape, DType.f32, fmt)


def typed_node(g: Graph, op: str, inputs: list, attrs: dict | None = None, names=None):
    outs = get_op(op).infer_types([v.type for v in inputs], attrs or {})
    return g.add_node(op, inputs, outs, attrs, names=names)


# --- dead code elimination -----------------------------------------------------------


def test_dce_removes_an_unused_node() -> None:
    # -- dce: %a is never read and is not an output --
    check(DeadCodeElimination(), """
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = exp(%x)
          return %b
        }
        """, """
        graph main(%x : f32[4]) {
          %b : f32[4] = exp(%x)
          return %b
        }
        """)


def test_dce_removes_a_dead_chain() -> None:
    # -- dce: removing %c frees %b, which frees %a, in one run --
    check(DeadCodeElimination(), """
        graph main(%x : f32[4], %unused : f32[2]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = mul(%a, %a)
          %c : f32[4] = add(%b, %x)
          %y : f32[4] = exp(%x)
          return %y
        }
        """, """
        graph main(%x : f32[4], %unused : f32[2]) {
          %y : f32[4] = exp(%x)
          return %y
        }
        """)


def test_dce_removes_unused_constants() -> None:
    # -- dce: @dead goes; @w is read; @out is a graph output; @only_dead_reader loses its reader --
    check(DeadCodeElimination(), """
        graph main(%x : f32[4]) {
          const @dead : f32[4]
          const @model.w : f32[4]
          const @out : f32[2]
          const @only_dead_reader : f32[4]
          %a : f32[4] = mul(%x, @model.w)
          %d : f32[4] = add(%x, @only_dead_reader)
          return %a, @out
        }
        """, """
        graph main(%x : f32[4]) {
          const @model.w : f32[4]
          const @out : f32[2]
          %a : f32[4] = mul(%x, @model.w)
          return %a, @out
        }
        """)


def test_dce_keeps_graph_outputs() -> None:
    # -- dce: outputs nobody reads inside the graph stay, as do returned inputs --
    check(DeadCodeElimination(), """
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = exp(%a)
          return %a, %b, %x
        }
        """, """
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = exp(%a)
          return %a, %b, %x
        }
        """, modified=False)


def test_dce_keeps_split_with_one_used_output() -> None:
    # -- dce: %k is unused but %q is returned, so the split stays whole; the second split goes --
    check(DeadCodeElimination(), """
        graph main(%x : f32[2,8]) {
          %q : f32[2,4], %k : f32[2,4] = split[axis=-1, sizes=[4,4]](%x)
          %u : f32[2,2], %v : f32[2,6] = split[axis=1, sizes=[2,6]](%x)
          %s : f32[2,4] = sigmoid(%q)
          return %s
        }
        """, """
        graph main(%x : f32[2,8]) {
          %q : f32[2,4], %k : f32[2,4] = split[axis=-1, sizes=[4,4]](%x)
          %s : f32[2,4] = sigmoid(%q)
          return %s
        }
        """)


def test_dce_updates_use_lists() -> None:
    g = parse_graph(ir("""
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = exp(%x)
          return %b
        }
        """))
    DeadCodeElimination()(g)
    assert g.inputs[0].uses == [(g.nodes[0], 0)]


# --- constant folding ------------------------------------------------------------------


def test_fold_source_chain_from_text() -> None:
    # -- constant-folding: arange -> reshape -> exp needs no stored data; add reads an input, so it stays --
    check(ConstantFolding(), """
        graph main(%x : f32[4,4]) {
          %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
          %p2 : f32[4,4] = reshape[shape=[4,4]](%pos)
          %e : f32[4,4] = exp(%p2)
          %y : f32[4,4] = add(%x, %e)
          return %y
        }
        """, """
        graph main(%x : f32[4,4]) {
          const @pos_folded : f32[16]
          const @p2_folded : f32[4,4]
          const @e_folded : f32[4,4]
          %y : f32[4,4] = add(%x, @e_folded)
          return %y
        }
        """)


def test_fold_refuses_graph_outputs() -> None:
    # -- constant-folding: %r is a graph output, so it keeps its producing node; %pos folds --
    check(ConstantFolding(), """
        graph main() {
          %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
          %r : f32[4,4] = reshape[shape=[4,4]](%pos)
          return %r
        }
        """, """
        graph main() {
          const @pos_folded : f32[16]
          %r : f32[4,4] = reshape[shape=[4,4]](@pos_folded)
          return %r
        }
        """)


def test_fold_nothing_when_the_only_candidate_is_an_output() -> None:
    # -- constant-folding: nothing to do --
    check(ConstantFolding(), """
        graph main(%x : f32[16]) {
          %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
          %y : f32[16] = add(%x, %x)
          return %pos, %y
        }
        """, """
        graph main(%x : f32[16]) {
          %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
          %y : f32[16] = add(%x, %x)
          return %pos, %y
        }
        """, modified=False)


_SMALL_SOURCE = """
    graph main(%x : f32[16]) {
      %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
      %y : f32[16] = add(%x, %pos)
      return %y
    }
    """


def test_fold_respects_max_bytes_of_the_result() -> None:
    # -- constant-folding[max_bytes=63]: the f32[16] result is 64 bytes, left alone --
    check(ConstantFolding(max_bytes=63), _SMALL_SOURCE, _SMALL_SOURCE, modified=False)
    # -- constant-folding[max_bytes=64]: exactly at the limit, folded --
    check(ConstantFolding(max_bytes=64), _SMALL_SOURCE, """
        graph main(%x : f32[16]) {
          const @pos_folded : f32[16]
          %y : f32[16] = add(%x, @pos_folded)
          return %y
        }
        """)


def _rope_graph() -> tuple[Graph, torch.Tensor]:
    """The folding docstring's chain, with real data for @inv_freq."""
    g = Graph()
    x = g.add_input("x", f32(16, 4))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    inv_freq = g.add_constant("inv_freq", f32(4), TensorSource(inv))
    pos = typed_node(g, "arange", [], {"dtype": DType.f32, "end": 16, "start": 0, "step": 1}, names="pos")
    p2 = typed_node(g, "reshape", [pos.output], {"shape": (16, 1)}, names="p2")
    f = typed_node(g, "mul", [p2.output, inv_freq], names="f")
    y = typed_node(g, "add", [x, f.output], names="y")
    g.set_outputs([y.output])
    verify(g)
    return g, inv


def test_fold_arange_reshape_mul_chain_with_data() -> None:
    g, inv = _rope_graph()
    assert print_graph(g) == ir("""
        graph main(%x : f32[16,4]) {
          const @inv_freq : f32[4]
          %pos : f32[16] = arange[dtype=f32, end=16, start=0, step=1]()
          %p2 : f32[16,1] = reshape[shape=[16,1]](%pos)
          %f : f32[16,4] = mul(%p2, @inv_freq)
          %y : f32[16,4] = add(%x, %f)
          return %y
        }
        """)
    res = ConstantFolding()(g)
    verify(g)
    assert res.modified
    # -- constant-folding: the whole chain folds in one run; dead intermediates wait for dce --
    assert print_graph(g) == ir("""
        graph main(%x : f32[16,4]) {
          const @inv_freq : f32[4]
          const @pos_folded : f32[16]
          const @p2_folded : f32[16,1]
          const @f_folded : f32[16,4]
          %y : f32[16,4] = add(%x, @f_folded)
          return %y
        }
        """)
    DeadCodeElimination()(g)
    # -- dce after constant-folding --
    assert print_graph(g) == ir("""
        graph main(%x : f32[16,4]) {
          const @f_folded : f32[16,4]
          %y : f32[16,4] = add(%x, @f_folded)
          return %y
        }
        """)
    folded = g.constants["f_folded"].const.load()
    want = torch.arange(16, dtype=torch.float32).reshape(16, 1) * inv
    assert folded.dtype == torch.float32 and folded.shape == (16, 4)
    torch.testing.assert_close(folded, want, rtol=0, atol=0)


def test_fold_respects_max_bytes_of_an_operand() -> None:
    # -- constant-folding[max_bytes=128]: a 4-byte sum of a 256-byte weight is left alone --
    g = Graph()
    w = g.add_constant("w", f32(64), TensorSource(torch.ones(64)))
    s = typed_node(g, "reduce_sum", [w], {"axes": (0,)}, names="s")
    x = g.add_input("x", f32())
    y = typed_node(g, "add", [x, s.output], names="y")
    g.set_outputs([y.output])
    before = print_graph(g)
    assert ConstantFolding(max_bytes=128)(g).modified is False
    assert print_graph(g) == before
    assert ConstantFolding(max_bytes=256)(g).modified is True
    verify(g)
    assert torch.equal(g.constants["s_folded"].const.load(), torch.tensor(64.0))


def _retype_graph(op: str, attrs: dict[str, object], second_reader: bool) -> Graph:
    """@w : f32[8,8] (256 bytes) -> op -> add with %x; optionally %w read by another add."""
    g = Graph()
    w = g.add_constant("w", f32(8, 8), TensorSource(torch.arange(64, dtype=torch.float32).reshape(8, 8)))
    t = typed_node(g, op, [w], attrs, names="t")
    x = g.add_input("x", t.output.type)
    outs = [typed_node(g, "add", [x, t.output], names="y").output]
    if second_reader:
        x2 = g.add_input("x2", f32(8, 8))
        outs.append(typed_node(g, "add", [x2, w], names="z").output)
    g.set_outputs(outs)
    return g


def test_fold_past_max_bytes_replaces_a_weight_it_retypes() -> None:
    """A precision cast or a layout change of a big weight folds in the weight's place (the
    runtime would otherwise redo it every run); a big copy beside the weight does not."""
    # -- constant-folding[max_bytes=64]: a narrowing cast folds, even beside the weight --
    g = _retype_graph("cast", {"dtype": DType.bf16}, second_reader=True)
    assert ConstantFolding(max_bytes=64)(g).modified is True
    assert torch.equal(g.constants["t_folded"].const.load(), torch.arange(64.0).reshape(8, 8).bfloat16())
    # -- a transpose that the weight's other reader would leave as a second copy: left alone --
    g = _retype_graph("transpose", {"perm": (1, 0)}, second_reader=True)
    assert ConstantFolding(max_bytes=64)(g).modified is False
    # -- the same transpose as the weight's only reader: folded in its place --
    g = _retype_graph("transpose", {"perm": (1, 0)}, second_reader=False)
    assert ConstantFolding(max_bytes=64)(g).modified is True
    assert torch.equal(g.constants["t_folded"].const.load(), torch.arange(64.0).reshape(8, 8).t())
    # -- a tile pad of the weight: folded (it grows by less than max_bytes) --
    g = _retype_graph("pad", {"pads": (0, 0, 0, 1)}, second_reader=False)
    assert ConstantFolding(max_bytes=64)(g).modified is True
    # -- an expand far past its operand: left alone --
    g = _retype_graph("expand", {"shape": (4, 8, 8)}, second_reader=False)
    assert ConstantFolding(max_bytes=64)(g).modified is False


def test_fold_multi_output_split() -> None:
    g = Graph()
    x = g.add_input("x", f32(2))
    c = g.add_constant("c", f32(6), TensorSource(torch.arange(6, dtype=torch.float32)))
    sp = typed_node(g, "split", [c], {"axis": 0, "sizes": (2, 4)}, names="part")
    r = typed_node(g, "reshape", [sp.outputs[1]], {"shape": (2, 2)}, names="r")
    y = typed_node(g, "mul", [x, sp.outputs[0]], names="y")
    z = typed_node(g, "add", [r.output, y.output], names="z")
    g.set_outputs([z.output])
    ConstantFolding()(g)
    DeadCodeElimination()(g)
    verify(g)
    # -- constant-folding + dce: both split outputs become constants --
    assert print_graph(g) == ir("""
        graph main(%x : f32[2]) {
          const @part_0_folded : f32[2]
          const @r_folded : f32[2,2]
          %y : f32[2] = mul(%x, @part_0_folded)
          %z : f32[2,2] = add(@r_folded, %y)
          return %z
        }
        """)
    assert torch.equal(g.constants["part_0_folded"].const.load(), torch.tensor([0.0, 1.0]))
    assert torch.equal(g.constants["r_folded"].const.load(), torch.tensor([[2.0, 3.0], [4.0, 5.0]]))


def test_fold_keeps_the_format() -> None:
    g = Graph()
    c = g.add_constant("c", f32(1, 2, fmt="NCHW"), TensorSource(torch.ones(1, 2)))
    n = typed_node(g, "neg", [c], names="n")
    x = g.add_input("x", f32(1, 2, fmt="NCHW"))
    y = typed_node(g, "mul", [x, n.output], names="y")
    g.set_outputs([y.output])
    verify(g)
    ConstantFolding()(g)
    assert g.constants["n_folded"].type == f32(1, 2, fmt="NCHW")


# --- pass manager ----------------------------------------------------------------------


@dataclass(frozen=True)
class ForgetUses(Pass):
    """Deliberately broken: empties an input's use list but leaves the operands."""

    name = "forget-uses"

    def call(self, g: Graph) -> PassResult:
        g.inputs[0].uses.clear()
        return PassResult(g, True)


@dataclass(frozen=True)
class Explodes(Pass):
    name = "explodes"

    def call(self, g: Graph) -> PassResult:
        raise InternalError("boom")


@dataclass(frozen=True)
class Recorder(Pass):
    name = "recorder"
    log: list = None  # type: ignore[assignment]

    def requires(self, g: Graph) -> None:
        self.log.append("requires")

    def call(self, g: Graph) -> PassResult:
        self.log.append("call")
        return PassResult(g, False)

    def ensures(self, g: Graph) -> None:
        self.log.append("ensures")


def _graph() -> Graph:
    return parse_graph(ir("""
        graph main(%x : f32[4]) {
          %pos : f32[4] = arange[dtype=f32, end=4, start=0, step=1]()
          %dead : f32[4] = neg(%x)
          %y : f32[4] = add(%x, %pos)
          return %y
        }
        """))


def test_verify_each_names_the_broken_pass_and_those_before() -> None:
    pm = PassManager([DeadCodeElimination(), ConstantFolding(), ForgetUses()], verify_each=True)
    with pytest.raises(InternalError) as info:
        pm.run(_graph())
    msg = str(info.value)
    assert msg.startswith("pass 'forget-uses' failed (after dce, constant-folding): ")
    assert "%x: use list does not match its operands" in msg
    assert [name for name, _ in pm.timings] == ["dce", "constant-folding"]


def test_without_verify_each_the_broken_pass_goes_unnoticed() -> None:
    g = PassManager([ForgetUses()], verify_each=False).run(_graph())
    assert g.inputs[0].uses == []


def test_a_failing_first_pass_is_named() -> None:
    with pytest.raises(InternalError, match=r"^pass 'explodes' failed \(after no passes\): boom$"):
        PassManager([Explodes(), DeadCodeElimination()]).run(_graph())


def test_verify_each_checks_the_input_graph() -> None:
    g = _graph()
    g.nodes.reverse()
    with pytest.raises(InternalError, match="used before it is defined"):
        PassManager([DeadCodeElimination()], verify_each=True).run(g)


def test_pass_call_order_and_on_after() -> None:
    log: list[str] = []
    seen: list[tuple[int, str]] = []
    pm = PassManager([Recorder(log=log), DeadCodeElimination()], verify_each=True,
                     on_after=lambda i, p, g: seen.append((i, p.name)))
    pm.run(_graph())
    assert log == ["requires", "call", "ensures"]
    assert seen == [(0, "recorder"), (1, "dce")]


def test_default_pipeline() -> None:
    g, _ = _rope_graph()
    g = PassManager(default_pipeline(), verify_each=True).run(g)
    # -- dce, constant-folding, dce --
    assert print_graph(g) == ir("""
        graph main(%x : f32[16,4]) {
          const @f_folded : f32[16,4]
          %y : f32[16,4] = add(%x, @f_folded)
          return %y
        }
        """)
