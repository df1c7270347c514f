"""Fusion and canonicalisation passes in FileCheck style: input IR -> one pass ->
the exact expected IR, each case headed by a comment. Every rule has a positive
case and the cases where it must refuse; a refusal leaves the text unchanged and
says why in the pass's details. A few fusions are also run before and after with
the registry's reference kernels on random inputs.

Parsed constants carry no data; constants whose data a pass needs (eps, cos/sin
tables, masks, scale scalars) get a `TensorSource` attached after parsing.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping

import pytest
import torch

from npuc.ir import Graph, TensorSource, get_op, parse_graph, print_graph, verify
from npuc.passes.attention_fusion import AttentionFusion
from npuc.passes.bias_fusion import BiasFusion
from npuc.passes.canonicalize import Canonicalize
from npuc.passes.cse import CommonSubexpressionElimination
from npuc.passes.manager import Pass, PassResult
from npuc.passes.rmsnorm_fusion import RMSNormFusion
from npuc.passes.rope_fusion import RoPEFusion
from npuc.passes.swiglu_fusion import SwiGLUFusion

Data = Mapping[str, torch.Tensor]


def ir(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def load(src: str, data: Data | None = None) -> Graph:
    """Parse `src` (which must round-trip) and give the constants named in `data` their tensors."""
    src = ir(src)
    g = parse_graph(src)
    assert print_graph(g) == src
    for name, t in (data or {}).items():
        assert g.constants[name].type.shape == tuple(t.shape), name
        g.constants[name].const = TensorSource(t)
    verify(g)
    return g


def interpret(g: Graph, feeds: Data) -> list[torch.Tensor]:
    """Run `g` node by node with the registry's reference kernels."""
    env = {id(v): feeds[v.name] for v in g.inputs}
    for c in g.constants.values():
        if c.uses or any(o is c for o in g.outputs):
            env[id(c)] = c.const.load()  # type: ignore[union-attr]
    for n in g.nodes:
        outs = get_op(n.op).run([env[id(v)] for v in n.inputs], n.attrs)
        for o, t in zip(n.outputs, outs, strict=True):
            env[id(o)] = t
    return [env[id(v)] for v in g.outputs]


def random_feeds(g: Graph, seed: int, ints: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Random inputs: floats from a normal distribution, integers (position ids) below `ints[name]`."""
    gen = torch.Generator().manual_seed(seed)
    feeds = {}
    for v in g.inputs:
        if v.type.dtype.is_float:
            feeds[v.name] = torch.randn(v.type.shape, generator=gen).to(v.type.dtype.torch)
        else:
            feeds[v.name] = torch.randint(0, (ints or {})[v.name], v.type.shape, generator=gen).to(v.type.dtype.torch)
    return feeds


def assert_same_numerics(before: Graph, after: Graph, ints: Mapping[str, int] | None = None,
                         atol: float = 1e-5) -> None:
    for seed in range(3):
        feeds = random_feeds(before, seed, ints)
        for want, got in zip(interpret(before, feeds), interpret(after, feeds), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5, equal_nan=True)


def check(p: Pass, src: str, expected: str, data: Data | None = None, modified: bool = True,
          numerics: bool = False, ints: Mapping[str, int] | None = None, atol: float = 1e-5) -> PassResult:
    """Run `p` on the parsed `src`, compare the printed result with `expected`, and with
    `numerics` compare the outputs of the graph before and after on random inputs."""
    g = load(src, data)
    res = p(g)
    verify(res.graph)
    assert print_graph(res.graph) == ir(expected)
    assert res.modified is modified
    assert print_graph(parse_graph(ir(expected))) == ir(expected)
    if numerics:
        assert_same_numerics(load(src, data), res.graph, ints, atol)
    return res


def refuses(p: Pass, src: str, rule: str, reason: str, data: Data | None = None) -> PassResult:
    """`p` leaves `src` unchanged, and says why `rule` did not fire: `reason` is one of its
    refusals, or (when the pattern never matched) the end of its explanation."""
    res = check(p, src, src, data, modified=False)
    stats = res.details["rules"][rule]
    assert stats["applied"] == 0
    explain = res.details["explain"][rule]
    assert reason in stats["refused"] or explain.endswith(reason), (stats, explain)
    return res


def assert_handled(p: Pass, src: str, data: Data, ints: Mapping[str, int] | None = None) -> None:
    """For cases a pass must handle one way or another (refuse, or rewrite correctly): the result
    verifies and computes what the input computed."""
    g = load(src, data)
    p(g)
    verify(g)
    assert_same_numerics(load(src, data), g, ints)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def freqs(seq: int, half: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    return torch.outer(torch.arange(seq, dtype=torch.float32), inv)


def causal(q: int, k: int, fill: float = -math.inf) -> torch.Tensor:
    return torch.full((q, k), fill).triu(1)


# =========================================================================================
# canonicalize
# =========================================================================================


def test_canonicalize_reciprocal_of_sqrt() -> None:
    # -- canonicalize (rsqrt-of-reciprocal-sqrt) --
    check(Canonicalize(), """
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          return %r
        }
        """, """
        graph main(%x : f32[4]) {
          %r : f32[4] = rsqrt(%x)
          return %r
        }
        """)


def test_canonicalize_one_over_sqrt() -> None:
    # -- canonicalize (rsqrt-of-one-over-sqrt): @one holds 1.0 --
    check(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = div(@one, %s)
          return %r
        }
        """, """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %r : f32[4] = rsqrt(%x)
          return %r
        }
        """, {"one": torch.tensor(1.0)}, numerics=True)


def test_canonicalize_one_over_sqrt_never_reads_a_weight_in_a_file() -> None:
    # -- canonicalize: @one has no data in memory, so it is not known to be 1: div-by-sqrt instead --
    res = check(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = div(@one, %s)
          return %r
        }
        """, """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %r_rsqrt : f32[4] = rsqrt(%x)
          %r : f32[4] = mul(@one, %r_rsqrt)
          return %r
        }
        """)
    assert res.details["rules"]["rsqrt-of-one-over-sqrt"]["applied"] == 0
    assert res.details["rules"]["div-by-sqrt"]["applied"] == 1


def test_canonicalize_one_over_sqrt_with_a_broadcasting_one() -> None:
    # -- canonicalize: @one : f32[1,1] makes the result [1,4]; rsqrt(%x) alone is [4] --
    assert_handled(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[1,1]
          %s : f32[4] = sqrt(%x)
          %r : f32[1,4] = div(@one, %s)
          return %r
        }
        """, {"one": torch.ones(1, 1)})


def test_canonicalize_div_by_sqrt() -> None:
    # -- canonicalize (div-by-sqrt) --
    check(Canonicalize(), """
        graph main(%x : f32[2,4], %v : f32[2,1]) {
          %s : f32[2,1] = sqrt(%v)
          %y : f32[2,4] = div(%x, %s)
          return %y
        }
        """, """
        graph main(%x : f32[2,4], %v : f32[2,1]) {
          %y_rsqrt : f32[2,1] = rsqrt(%v)
          %y : f32[2,4] = mul(%x, %y_rsqrt)
          return %y
        }
        """)


def test_canonicalize_div_by_const() -> None:
    # -- canonicalize (div-by-const): x / 4 -> x * 0.25 --
    res = check(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @c : f32[]
          %y : f32[4] = div(%x, @c)
          return %y
        }
        """, """
        graph main(%x : f32[4]) {
          const @c : f32[]
          const @c_inv : f32[]
          %y : f32[4] = mul(%x, @c_inv)
          return %y
        }
        """, {"c": torch.tensor(4.0)}, numerics=True)
    assert torch.equal(res.graph.constants["c_inv"].const.load(), torch.tensor(0.25))  # type: ignore[union-attr]


def test_canonicalize_leaves_division_by_a_vector() -> None:
    # -- canonicalize: @c has four elements; x / c is not x * (1/c) bit for bit --
    refuses(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @c : f32[4]
          %y : f32[4] = div(%x, @c)
          return %y
        }
        """, "div-by-const", "then @c does not satisfy %c's condition", {"c": torch.full((4,), 4.0)})


@pytest.mark.parametrize("mul", ["mul(%s, %x)", "mul(%x, %s)"])
def test_canonicalize_silu(mul: str) -> None:
    # -- canonicalize (silu): either operand order --
    check(Canonicalize(), f"""
        graph main(%x : f32[4]) {{
          %s : f32[4] = sigmoid(%x)
          %y : f32[4] = {mul}
          return %y
        }}
        """, """
        graph main(%x : f32[4]) {
          %y : f32[4] = silu(%x)
          return %y
        }
        """, numerics=True)


def test_canonicalize_silu_refuses_a_shared_sigmoid() -> None:
    # -- canonicalize: the sigmoid has another reader --
    refuses(Canonicalize(), """
        graph main(%x : f32[4]) {
          %s : f32[4] = sigmoid(%x)
          %y : f32[4] = mul(%x, %s)
          %z : f32[4] = add(%y, %s)
          return %z
        }
        """, "silu", "%s is used outside the match")


def test_canonicalize_silu_needs_the_same_operand() -> None:
    # -- canonicalize: x * sigmoid(y) is not a silu --
    refuses(Canonicalize(), """
        graph main(%x : f32[4], %y : f32[4]) {
          %s : f32[4] = sigmoid(%y)
          %z : f32[4] = mul(%x, %s)
          return %z
        }
        """, "silu", "then %x is bound to %x, not %y")  # pattern %x, value %x


def test_canonicalize_mul_by_one() -> None:
    # -- canonicalize (mul-by-one) --
    check(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %y : f32[4] = mul(@one, %x)
          %z : f32[4] = exp(%y)
          return %z
        }
        """, """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %z : f32[4] = exp(%x)
          return %z
        }
        """, {"one": torch.tensor(1.0)})


def test_canonicalize_mul_by_one_refuses_a_broadcast() -> None:
    # -- canonicalize: ones of [2,4] make the result bigger than %x --
    refuses(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[2,4]
          %y : f32[2,4] = mul(%x, @one)
          %z : f32[2,4] = exp(%y)
          return %z
        }
        """, "mul-by-one", "the constant broadcasts the result", {"one": torch.ones(2, 4)})


def test_canonicalize_mul_by_one_keeps_a_graph_output() -> None:
    # -- canonicalize: %y is returned, so it keeps a node and its name --
    refuses(Canonicalize(), """
        graph main(%x : f32[4]) {
          const @one : f32[]
          %y : f32[4] = mul(%x, @one)
          return %y
        }
        """, "mul-by-one", "the root is a graph output and the rewrite gives an existing value",
            {"one": torch.tensor(1.0)})


def test_canonicalize_identity_cast() -> None:
    # -- canonicalize (identity-cast): the f32 -> f32 cast goes, the f32 -> f16 stays --
    check(Canonicalize(), """
        graph main(%x : f32[4]) {
          %c : f32[4] = cast[dtype=f32](%x)
          %h : f16[4] = cast[dtype=f16](%x)
          %z : f32[4] = exp(%c)
          return %z, %h
        }
        """, """
        graph main(%x : f32[4]) {
          %h : f16[4] = cast[dtype=f16](%x)
          %z : f32[4] = exp(%x)
          return %z, %h
        }
        """)


def test_canonicalize_reshape_chain() -> None:
    # -- canonicalize (reshape-chain) --
    check(Canonicalize(), """
        graph main(%x : f32[2,6]) {
          %a : f32[3,4] = reshape[shape=[3,4]](%x)
          %b : f32[12] = reshape[shape=[12]](%a)
          return %b
        }
        """, """
        graph main(%x : f32[2,6]) {
          %b : f32[12] = reshape[shape=[12]](%x)
          return %b
        }
        """)


def test_canonicalize_reshape_chain_refuses_a_shared_inner_reshape() -> None:
    # -- canonicalize: %a has another reader --
    refuses(Canonicalize(), """
        graph main(%x : f32[2,6]) {
          %a : f32[3,4] = reshape[shape=[3,4]](%x)
          %b : f32[12] = reshape[shape=[12]](%a)
          %e : f32[3,4] = exp(%a)
          return %b, %e
        }
        """, "reshape-chain", "%a is used outside the match")


def test_canonicalize_identity_reshape() -> None:
    # -- canonicalize (identity-reshape) --
    check(Canonicalize(), """
        graph main(%x : f32[2,6]) {
          %a : f32[2,6] = reshape[shape=[2,6]](%x)
          %z : f32[2,6] = exp(%a)
          return %z
        }
        """, """
        graph main(%x : f32[2,6]) {
          %z : f32[2,6] = exp(%x)
          return %z
        }
        """)


def test_canonicalize_reshape_there_and_back_reaches_a_fixed_point() -> None:
    # -- canonicalize: reshape-chain gives reshape(%x) to %x's own shape; identity-reshape removes it --
    res = check(Canonicalize(), """
        graph main(%x : f32[2,6]) {
          %a : f32[3,4] = reshape[shape=[3,4]](%x)
          %b : f32[2,6] = reshape[shape=[2,6]](%a)
          %z : f32[2,6] = exp(%b)
          return %z
        }
        """, """
        graph main(%x : f32[2,6]) {
          %z : f32[2,6] = exp(%x)
          return %z
        }
        """)
    assert [f["rule"] for f in res.details["fusions"]] == ["reshape-chain", "identity-reshape"]


def test_canonicalize_matmul_to_linear() -> None:
    # -- canonicalize (matmul-to-linear): the weight stays as stored (layout kn), never read or copied --
    class InFile:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.loads = t, 0

        def load(self) -> torch.Tensor:
            self.loads += 1
            return self.t

        def describe(self) -> str:
            return "model.safetensors"

    src = """
        graph main(%x : f32[2,3,4]) {
          const @w : f32[4,5]
          %y : f32[2,3,5] = matmul(%x, @w)
          return %y
        }
        """
    g = load(src)
    w = rand(4, 5)
    g.constants["w"].const = weight = InFile(w)
    res = Canonicalize()(g)
    verify(g)
    assert print_graph(g) == ir("""
        graph main(%x : f32[2,3,4]) {
          const @w : f32[4,5]
          %y : f32[2,3,5] = linear[weight_layout="kn"](%x, @w)
          return %y
        }
        """)
    assert res.modified and weight.loads == 0
    assert g.constants["w"].const is weight
    g.constants["w"].const = TensorSource(w)
    assert_same_numerics(load(src, {"w": w}), g)


def test_canonicalize_leaves_a_matmul_of_activations() -> None:
    # -- canonicalize: %w is not a constant --
    refuses(Canonicalize(), """
        graph main(%x : f32[2,3,4], %w : f32[4,5]) {
          %y : f32[2,3,5] = matmul(%x, %w)
          return %y
        }
        """, "matmul-to-linear", "then %w does not satisfy %w's condition")


# =========================================================================================
# cse
# =========================================================================================


def test_cse_merges_equal_nodes() -> None:
    # -- cse: %b computes what %a does; its readers move to %a (the dead %b is left for dce) --
    check(CommonSubexpressionElimination(), """
        graph main(%x : f32[4]) {
          %a : f32[4] = exp(%x)
          %b : f32[4] = exp(%x)
          %c : f32[4] = add(%a, %b)
          return %c
        }
        """, """
        graph main(%x : f32[4]) {
          %a : f32[4] = exp(%x)
          %b : f32[4] = exp(%x)
          %c : f32[4] = add(%a, %a)
          return %c
        }
        """)


def test_cse_keeps_nodes_whose_attributes_or_operands_differ() -> None:
    # -- cse: different axes, different operands, different operand order: nothing to merge --
    src = """
        graph main(%x : f32[4,4], %y : f32[4,4]) {
          %a : f32[4] = reduce_sum[axes=[0]](%x)
          %b : f32[4] = reduce_sum[axes=[1]](%x)
          %c : f32[4,4] = sub(%x, %y)
          %d : f32[4,4] = sub(%y, %x)
          return %a, %b, %c, %d
        }
        """
    check(CommonSubexpressionElimination(), src, src, modified=False)


def test_cse_merges_multi_output_nodes_then_their_readers() -> None:
    # -- cse: both outputs of the second split move to the first; %y and %z then read the same
    #    operands, so %z merges too, in the same run --
    check(CommonSubexpressionElimination(), """
        graph main(%x : f32[2,8]) {
          %a : f32[2,4], %b : f32[2,4] = split[axis=1, sizes=[4,4]](%x)
          %c : f32[2,4], %d : f32[2,4] = split[axis=1, sizes=[4,4]](%x)
          %y : f32[2,4] = add(%a, %d)
          %z : f32[2,4] = add(%c, %b)
          %o : f32[2,4] = mul(%y, %z)
          return %o
        }
        """, """
        graph main(%x : f32[2,8]) {
          %a : f32[2,4], %b : f32[2,4] = split[axis=1, sizes=[4,4]](%x)
          %c : f32[2,4], %d : f32[2,4] = split[axis=1, sizes=[4,4]](%x)
          %y : f32[2,4] = add(%a, %b)
          %z : f32[2,4] = add(%a, %b)
          %o : f32[2,4] = mul(%y, %y)
          return %o
        }
        """)


def test_cse_merges_equal_small_constants_then_their_readers() -> None:
    # -- cse: @c2 holds the bytes of @c1, so %m2 reads @c1 and then equals %m1; @c3 differs;
    #    @w (no data in memory) is never read, so it is never merged --
    check(CommonSubexpressionElimination(), """
        graph main(%x : f32[4]) {
          const @c1 : f32[]
          const @c2 : f32[]
          const @c3 : f32[]
          const @w : f32[]
          %m1 : f32[4] = mul(%x, @c1)
          %m2 : f32[4] = mul(%x, @c2)
          %m3 : f32[4] = mul(%x, @c3)
          %m4 : f32[4] = mul(%x, @w)
          %s : f32[4] = add(%m1, %m2)
          %t : f32[4] = add(%m3, %m4)
          return %s, %t
        }
        """, """
        graph main(%x : f32[4]) {
          const @c1 : f32[]
          const @c2 : f32[]
          const @c3 : f32[]
          const @w : f32[]
          %m1 : f32[4] = mul(%x, @c1)
          %m2 : f32[4] = mul(%x, @c1)
          %m3 : f32[4] = mul(%x, @c3)
          %m4 : f32[4] = mul(%x, @w)
          %s : f32[4] = add(%m1, %m1)
          %t : f32[4] = add(%m3, %m4)
          return %s, %t
        }
        """, {"c1": torch.tensor(0.5), "c2": torch.tensor(0.5), "c3": torch.tensor(2.0)})


def test_cse_never_compares_constants_over_the_limit() -> None:
    # -- cse[max_const_bytes=8]: two equal f32[4] constants (16 bytes) stay apart --
    src = """
        graph main(%x : f32[4]) {
          const @a : f32[4]
          const @b : f32[4]
          %y : f32[4] = add(%x, @a)
          %z : f32[4] = add(%x, @b)
          return %y, %z
        }
        """
    check(CommonSubexpressionElimination(max_const_bytes=8), src, src, {"a": torch.ones(4), "b": torch.ones(4)},
          modified=False)


def test_cse_keeps_the_names_of_graph_outputs() -> None:
    # -- cse: both are returned: the outputs keep their names --
    g = load("""
        graph main(%x : f32[4]) {
          %a : f32[4] = exp(%x)
          %b : f32[4] = exp(%x)
          return %a, %b
        }
        """)
    CommonSubexpressionElimination()(g)
    verify(g)
    assert [v.name for v in g.outputs] == ["a", "b"]


# =========================================================================================
# rmsnorm-fusion
# =========================================================================================

EPS = 2.0 ** -20  # exact in f32, so the eps attribute prints exactly

RMS = """
    graph main(%x : f32[2,8]) {
      const @two : f32[]
      const @eps : f32[]
      const @w : f32[8]
      %p : f32[2,8] = pow(%x, @two)
      %m : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%p)
      %a : f32[2,1] = add(%m, @eps)
      %r : f32[2,1] = rsqrt(%a)
      %n : f32[2,8] = mul(%x, %r)
      %y : f32[2,8] = mul(@w, %n)
      return %y
    }
    """
RMS_DATA = {"two": torch.tensor(2.0), "eps": torch.tensor(EPS), "w": rand(8)}


def test_rmsnorm_fuses_in_two_steps() -> None:
    # -- rmsnorm-fusion: the normalisation becomes rms_norm(%x, @ones_8), then @w folds into its weight --
    res = check(RMSNormFusion(), RMS, """
        graph main(%x : f32[2,8]) {
          const @two : f32[]
          const @eps : f32[]
          const @w : f32[8]
          const @ones_8 : f32[8]
          %y : f32[2,8] = rms_norm[axis=1, eps=9.5367431640625e-07](%x, @w)
          return %y
        }
        """, RMS_DATA, numerics=True)
    assert res.details["fusions"] == [
        {"rule": "rmsnorm", "created": ["n"], "replaced": ["n", "r", "a", "m", "p"]},
        {"rule": "rmsnorm-weight", "created": ["y"], "replaced": ["y", "n"]},
    ]


def test_rmsnorm_mul_square_without_weight() -> None:
    # -- rmsnorm-fusion: x * x for the square, operands swapped everywhere, no weight (canonicalize
    #    removed a weight of ones): a unit weight --
    res = check(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @eps : f32[]
          %p : f32[2,8] = mul(%x, %x)
          %m : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%p)
          %a : f32[2,1] = add(@eps, %m)
          %r : f32[2,1] = rsqrt(%a)
          %y : f32[2,8] = mul(%r, %x)
          return %y
        }
        """, """
        graph main(%x : f32[2,8]) {
          const @eps : f32[]
          const @ones_8 : f32[8]
          %y : f32[2,8] = rms_norm[axis=1, eps=9.5367431640625e-07](%x, @ones_8)
          return %y
        }
        """, {"eps": torch.tensor(EPS)}, numerics=True)
    assert torch.equal(res.graph.constants["ones_8"].const.load(), torch.ones(8))  # type: ignore[union-attr]


def test_rmsnorm_gemma_weight_plus_one() -> None:
    # -- rmsnorm-fusion (rmsnorm-weight-gemma): mul(add(@w, 1), norm) folds as @w + 1 --
    check(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f32[8]
          const @one : f32[]
          %n : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, @ones)
          %w1 : f32[8] = add(@one, @w)
          %y : f32[2,8] = mul(%n, %w1)
          return %y
        }
        """, """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f32[8]
          const @one : f32[]
          %w_plus_one : f32[8] = add(@w, @one)
          %y : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, %w_plus_one)
          return %y
        }
        """, {"ones": torch.ones(8), "w": rand(8), "one": torch.tensor(1.0)}, numerics=True)


def test_rmsnorm_weight_of_rank_three_and_a_non_unit_scale() -> None:
    # -- rmsnorm-fusion (rmsnorm-weight): a [1,1,8] weight becomes a vector; the norm's own
    #    (non-unit) scale multiplies in --
    check(RMSNormFusion(), """
        graph main(%x : f32[1,2,8]) {
          const @s : f32[8]
          const @w : f32[1,1,8]
          %n : f32[1,2,8] = rms_norm[axis=2, eps=1e-05](%x, @s)
          %y : f32[1,2,8] = mul(%n, @w)
          return %y
        }
        """, """
        graph main(%x : f32[1,2,8]) {
          const @s : f32[8]
          const @w : f32[1,1,8]
          %y_reshape : f32[8] = reshape[shape=[8]](@w)
          %y_reshape_scale : f32[8] = mul(%y_reshape, @s)
          %y : f32[1,2,8] = rms_norm[axis=2, eps=1e-05](%x, %y_reshape_scale)
          return %y
        }
        """, {"s": rand(8, seed=1), "w": rand(1, 1, 8)}, numerics=True)


def test_rmsnorm_weight_through_casts() -> None:
    # -- rmsnorm-fusion (rmsnorm-weight): an f16 weight times the norm cast to f16: the weight is
    #    cast up, the norm computed with it, the result cast down --
    check(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f16[8]
          %n : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, @ones)
          %h : f16[2,8] = cast[dtype=f16](%n)
          %y : f16[2,8] = mul(@w, %h)
          return %y
        }
        """, """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f16[8]
          %y_cast : f32[8] = cast[dtype=f32](@w)
          %y_rms_norm : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, %y_cast)
          %y : f16[2,8] = cast[dtype=f16](%y_rms_norm)
          return %y
        }
        """, {"ones": torch.ones(8), "w": rand(8).half()}, numerics=True, atol=1e-2)


def test_rmsnorm_weight_varying_along_a_token_axis_is_refused() -> None:
    # -- rmsnorm-fusion: @w varies along the rows, not only along the normalised axis --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f32[2,8]
          %n : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, @ones)
          %y : f32[2,8] = mul(@w, %n)
          return %y
        }
        """, "rmsnorm-weight", "weight f32[2,8] does not broadcast along the normalised axis only",
            {"ones": torch.ones(8), "w": rand(2, 8)})


def test_rmsnorm_weight_that_broadcasts_the_result_up() -> None:
    # -- rmsnorm-fusion: @w : [1,1,8] makes the product [1,2,8], a bigger shape than the norm's --
    assert_handled(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @ones : f32[8]
          const @w : f32[1,1,8]
          %n : f32[2,8] = rms_norm[axis=1, eps=1e-05](%x, @ones)
          %y : f32[1,2,8] = mul(@w, %n)
          return %y
        }
        """, {"ones": torch.ones(8), "w": rand(1, 1, 8)})


def test_rmsnorm_mean_over_another_axis_is_refused() -> None:
    # -- rmsnorm-fusion: the mean runs over the tokens (axis 0), not the features --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @two : f32[]
          const @eps : f32[]
          %p : f32[2,8] = pow(%x, @two)
          %m : f32[1,8] = reduce_mean[axes=[0], keepdim=true](%p)
          %a : f32[1,8] = add(%m, @eps)
          %r : f32[1,8] = rsqrt(%a)
          %y : f32[2,8] = mul(%x, %r)
          return %y
        }
        """, "rmsnorm", "the mean is not over the last axis", {"two": torch.tensor(2.0), "eps": torch.tensor(EPS)})


def test_rmsnorm_mean_without_keepdim_is_refused() -> None:
    # -- rmsnorm-fusion: without keepdim the mean of row i scales column i: not a per-token norm --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[8,8]) {
          const @two : f32[]
          const @eps : f32[]
          %p : f32[8,8] = pow(%x, @two)
          %m : f32[8] = reduce_mean[axes=[1]](%p)
          %a : f32[8] = add(%m, @eps)
          %r : f32[8] = rsqrt(%a)
          %y : f32[8,8] = mul(%x, %r)
          return %y
        }
        """, "rmsnorm", "then reduce_mean %m has keepdim=False", {"two": torch.tensor(2.0), "eps": torch.tensor(EPS)})


def test_rmsnorm_refuses_an_eps_that_is_not_a_scalar() -> None:
    # -- rmsnorm-fusion: @eps : [8] --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @two : f32[]
          const @eps : f32[8]
          %p : f32[2,8] = pow(%x, @two)
          %m : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%p)
          %a : f32[2,8] = add(%m, @eps)
          %r : f32[2,8] = rsqrt(%a)
          %y : f32[2,8] = mul(%x, %r)
          return %y
        }
        """, "rmsnorm", "eps is not a scalar", {"two": torch.tensor(2.0), "eps": torch.full((8,), EPS)})


def test_rmsnorm_refuses_a_shared_interior_value() -> None:
    # -- rmsnorm-fusion: the inverse rms %r has another reader --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @two : f32[]
          const @eps : f32[]
          %p : f32[2,8] = pow(%x, @two)
          %m : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%p)
          %a : f32[2,1] = add(%m, @eps)
          %r : f32[2,1] = rsqrt(%a)
          %y : f32[2,8] = mul(%x, %r)
          %z : f32[2,8] = add(%y, %r)
          return %z
        }
        """, "rmsnorm", "%r is used outside the match", {"two": torch.tensor(2.0), "eps": torch.tensor(EPS)})


def test_rmsnorm_square_must_be_two() -> None:
    # -- rmsnorm-fusion: x ** 3 is not a mean of squares --
    refuses(RMSNormFusion(), """
        graph main(%x : f32[2,8]) {
          const @three : f32[]
          const @eps : f32[]
          %p : f32[2,8] = pow(%x, @three)
          %m : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%p)
          %a : f32[2,1] = add(%m, @eps)
          %r : f32[2,1] = rsqrt(%a)
          %y : f32[2,8] = mul(%x, %r)
          return %y
        }
        """, "rmsnorm", "then constant @three is not 2.0", {"three": torch.tensor(3.0), "eps": torch.tensor(EPS)})


def test_rmsnorm_mean_over_axis_minus_one() -> None:
    # -- rmsnorm-fusion: axes=[-1] is the last axis --
    check(RMSNormFusion(), RMS.replace("axes=[1]", "axes=[-1]"), """
        graph main(%x : f32[2,8]) {
          const @two : f32[]
          const @eps : f32[]
          const @w : f32[8]
          const @ones_8 : f32[8]
          %y : f32[2,8] = rms_norm[axis=1, eps=9.5367431640625e-07](%x, @w)
          return %y
        }
        """, RMS_DATA)


# =========================================================================================
# swiglu-fusion
# =========================================================================================


@pytest.mark.parametrize("mul", ["mul(%s, %u)", "mul(%u, %s)"])
def test_swiglu(mul: str) -> None:
    # -- swiglu-fusion: either operand order --
    check(SwiGLUFusion(), f"""
        graph main(%g : f32[2,8], %u : f32[2,8]) {{
          %s : f32[2,8] = silu(%g)
          %y : f32[2,8] = {mul}
          return %y
        }}
        """, """
        graph main(%g : f32[2,8], %u : f32[2,8]) {
          %y : f32[2,8] = swiglu(%g, %u)
          return %y
        }
        """, numerics=True)


@pytest.mark.parametrize(("g", "u", "y"), [("2,8", "1,8", "2,8"), ("1,8", "2,8", "2,8"), ("2,1", "2,8", "2,8")])
def test_swiglu_refuses_a_broadcast(g: str, u: str, y: str) -> None:
    # -- swiglu-fusion: gate and up of different shapes (a broadcast, not a gated MLP) --
    refuses(SwiGLUFusion(), f"""
        graph main(%g : f32[{g}], %u : f32[{u}]) {{
          %s : f32[{g}] = silu(%g)
          %y : f32[{y}] = mul(%s, %u)
          return %y
        }}
        """, "swiglu", f"gate f32[{g}] and up f32[{u}] differ (a broadcast)")


def test_swiglu_refuses_a_shared_silu() -> None:
    # -- swiglu-fusion: the silu has another reader --
    refuses(SwiGLUFusion(), """
        graph main(%g : f32[2,8], %u : f32[2,8]) {
          %s : f32[2,8] = silu(%g)
          %y : f32[2,8] = mul(%s, %u)
          %z : f32[2,8] = add(%y, %s)
          return %z
        }
        """, "swiglu", "%s is used outside the match")


def test_swiglu_of_a_squared_silu() -> None:
    # -- swiglu-fusion: silu(g)^2 after cse merged the two silus --
    assert_handled(SwiGLUFusion(), """
        graph main(%g : f32[2,8]) {
          %s : f32[2,8] = silu(%g)
          %y : f32[2,8] = mul(%s, %s)
          return %y
        }
        """, {})


# =========================================================================================
# rope-fusion
# =========================================================================================

FREQS = freqs(4, 4)
COS_HALF = torch.cat([FREQS.cos(), FREQS.cos()], -1)[None, None]  # [1,1,4,8], halves equal
SIN_HALF = torch.cat([FREQS.sin(), FREQS.sin()], -1)[None, None]

ROPE_HALF = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,8]
      const @sin : f32[1,1,4,8]
      %c : f32[1,2,4,8] = mul(%x, @cos)
      %hi : f32[1,2,4,4] = slice[axis=3, end=8, start=4, step=1](%x)
      %n : f32[1,2,4,4] = neg(%hi)
      %lo : f32[1,2,4,4] = slice[axis=3, end=4, start=0, step=1](%x)
      %rot : f32[1,2,4,8] = concat[axis=3](%n, %lo)
      %s : f32[1,2,4,8] = mul(%rot, @sin)
      %y : f32[1,2,4,8] = add(%c, %s)
      return %y
    }
    """
ROPE_HALF_FUSED = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,8]
      const @sin : f32[1,1,4,8]
      const @cos_lut : f32[4,4]
      const @sin_lut : f32[4,4]
      const @positions_4 : i64[4]
      %y : f32[1,2,4,8] = rope_lut[layout="half"](%x, @positions_4, @cos_lut, @sin_lut)
      return %y
    }
    """


def test_rope_half() -> None:
    # -- rope-fusion (rope-half): rotate_half with broadcast [1,1,seq,d] tables -> [seq, d/2] tables --
    res = check(RoPEFusion(), ROPE_HALF, ROPE_HALF_FUSED, {"cos": COS_HALF, "sin": SIN_HALF}, numerics=True)
    c = res.graph.constants
    assert torch.equal(c["cos_lut"].const.load(), FREQS.cos())  # type: ignore[union-attr]
    assert torch.equal(c["sin_lut"].const.load(), FREQS.sin())  # type: ignore[union-attr]
    assert torch.equal(c["positions_4"].const.load(), torch.arange(4))  # type: ignore[union-attr]


def test_rope_half_tables_equal_along_batch() -> None:
    # -- rope-fusion: [2,1,4,8] tables whose batch rows are equal are one table --
    src = ROPE_HALF.replace("1,2,4,8", "2,2,4,8").replace("1,2,4,4", "2,2,4,4").replace("1,1,4,8", "2,1,4,8")
    check(RoPEFusion(), src, ROPE_HALF_FUSED.replace("1,2,4,8", "2,2,4,8").replace("1,1,4,8", "2,1,4,8"),
          {"cos": COS_HALF.expand(2, 1, 4, 8).clone(), "sin": SIN_HALF.expand(2, 1, 4, 8).clone()}, numerics=True)


def test_rope_half_refuses_tables_that_vary_along_batch() -> None:
    # -- rope-fusion: batch 1 has other positions than batch 0 --
    src = ROPE_HALF.replace("1,2,4,8", "2,2,4,8").replace("1,2,4,4", "2,2,4,4").replace("1,1,4,8", "2,1,4,8")
    cos = torch.cat([COS_HALF, COS_HALF.roll(1, dims=2)])
    sin = torch.cat([SIN_HALF, SIN_HALF.roll(1, dims=2)])
    refuses(RoPEFusion(), src, "rope-half", "the cos/sin tables vary along batch or heads", {"cos": cos, "sin": sin})


def test_rope_half_refuses_tables_that_vary_along_heads() -> None:
    # -- rope-fusion: a table per head --
    src = ROPE_HALF.replace("1,1,4,8", "1,2,4,8")
    cos = torch.cat([COS_HALF, 2 * COS_HALF], dim=1)
    refuses(RoPEFusion(), src, "rope-half", "the cos/sin tables vary along batch or heads",
            {"cos": cos, "sin": torch.cat([SIN_HALF, SIN_HALF], dim=1)})


def test_rope_half_refuses_cos_halves_that_differ() -> None:
    # -- rope-fusion: the table's two halves differ: not the rotate_half form of one frequency set --
    refuses(RoPEFusion(), ROPE_HALF, "rope-half", "the cos/sin halves differ: not a rotate_half RoPE",
            {"cos": rand(1, 1, 4, 8), "sin": SIN_HALF})


def test_rope_half_refuses_slices_that_are_not_the_halves() -> None:
    # -- rope-fusion: both slices take the first half --
    refuses(RoPEFusion(), ROPE_HALF.replace("end=8, start=4", "end=4, start=0"), "rope-half",
            "the slices are not the two halves of the head dim", {"cos": COS_HALF, "sin": SIN_HALF})


def test_rope_half_refuses_a_shared_rotation() -> None:
    # -- rope-fusion: the rotated copy %rot has another reader --
    src = ROPE_HALF.replace("      return %y\n", "      %z : f32[1,2,4,8] = add(%y, %rot)\n      return %z\n")
    refuses(RoPEFusion(), src, "rope-half", "%rot is used outside the match", {"cos": COS_HALF, "sin": SIN_HALF})


def test_rope_half_with_axis_minus_one() -> None:
    # -- rope-fusion: concat[axis=-1] is the last axis --
    check(RoPEFusion(), ROPE_HALF.replace("concat[axis=3]", "concat[axis=-1]"), ROPE_HALF_FUSED,
          {"cos": COS_HALF, "sin": SIN_HALF})


def test_rope_half_with_default_slice_attributes() -> None:
    # -- rope-fusion: slice[axis=3, end=4] is slice[axis=3, end=4, start=0, step=1] --
    check(RoPEFusion(), ROPE_HALF.replace("end=4, start=0, step=1", "end=4"), ROPE_HALF_FUSED,
          {"cos": COS_HALF, "sin": SIN_HALF})


def test_rope_half_tables_that_broadcast_x_up() -> None:
    # -- rope-fusion: the tables have a bigger batch than x --
    src = ROPE_HALF.replace("1,1,4,8", "2,1,4,8").replace("%c : f32[1,2,4,8]", "%c : f32[2,2,4,8]") \
        .replace("%s : f32[1,2,4,8]", "%s : f32[2,2,4,8]").replace("%y : f32[1,2,4,8]", "%y : f32[2,2,4,8]")
    assert_handled(RoPEFusion(), src, {"cos": COS_HALF.expand(2, 1, 4, 8).clone(),
                                    "sin": SIN_HALF.expand(2, 1, 4, 8).clone()})


ROPE_PAIRS = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,4]
      const @sin : f32[1,1,4,4]
      %xe : f32[1,2,4,4] = slice[axis=3, end=8, start=0, step=2](%x)
      %xo : f32[1,2,4,4] = slice[axis=3, end=8, start=1, step=2](%x)
      %ec : f32[1,2,4,4] = mul(%xe, @cos)
      %os : f32[1,2,4,4] = mul(@sin, %xo)
      %re : f32[1,2,4,4] = sub(%ec, %os)
      %oc : f32[1,2,4,4] = mul(%xo, @cos)
      %es : f32[1,2,4,4] = mul(%xe, @sin)
      %im : f32[1,2,4,4] = add(%es, %oc)
      %y : f32[1,2,4,8] = concat[axis=3](%re, %im)
      return %y
    }
    """
PAIRS_DATA = {"cos": FREQS.cos()[None, None], "sin": FREQS.sin()[None, None]}


def test_rope_deinterleave() -> None:
    # -- rope-fusion (rope-deinterleave): DeepSeek's interleaved pairs in, halves out --
    check(RoPEFusion(), ROPE_PAIRS, """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,1,4,4]
          const @sin : f32[1,1,4,4]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y : f32[1,2,4,8] = rope_lut[layout="deinterleave"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, PAIRS_DATA, numerics=True)


def test_rope_deinterleave_refuses_pairs_that_are_not_even_and_odd() -> None:
    # -- rope-fusion: %xe and %xo swapped: odd elements first --
    src = ROPE_PAIRS.replace("start=0, step=2", "start=9, step=2").replace("start=1, step=2", "start=0, step=2") \
        .replace("start=9, step=2", "start=1, step=2")
    refuses(RoPEFusion(), src, "rope-deinterleave", "the slices are not the even/odd elements", PAIRS_DATA)


def test_rope_deinterleave_refuses_tables_that_vary_along_heads() -> None:
    # -- rope-fusion: a [1,2,4,4] table per head --
    cos = torch.cat([FREQS.cos(), FREQS.cos() + 1])[None].reshape(1, 2, 4, 4)
    refuses(RoPEFusion(), ROPE_PAIRS.replace("const @cos : f32[1,1,4,4]", "const @cos : f32[1,2,4,4]"),
            "rope-deinterleave", "the cos/sin tables vary along batch or heads",
            {"cos": cos, "sin": PAIRS_DATA["sin"]})


ROPE_EVERY_TWO = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,8]
      const @sin : f32[1,1,4,8]
      %xe : f32[1,2,4,4] = slice[axis=3, end=8, start=0, step=2](%x)
      %xo : f32[1,2,4,4] = slice[axis=3, end=8, start=1, step=2](%x)
      %n : f32[1,2,4,4] = neg(%xo)
      %n1 : f32[1,2,4,4,1] = reshape[shape=[1,2,4,4,1]](%n)
      %e1 : f32[1,2,4,4,1] = reshape[shape=[1,2,4,4,1]](%xe)
      %p : f32[1,2,4,4,2] = concat[axis=4](%n1, %e1)
      %r : f32[1,2,4,8] = reshape[shape=[1,2,4,8]](%p)
      %xc : f32[1,2,4,8] = mul(%x, @cos)
      %rs : f32[1,2,4,8] = mul(%r, @sin)
      %y : f32[1,2,4,8] = add(%xc, %rs)
      return %y
    }
    """
EVERY_TWO_DATA = {"cos": FREQS.cos().repeat_interleave(2, -1)[None, None],
                  "sin": FREQS.sin().repeat_interleave(2, -1)[None, None]}


ROPE_SPLIT = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,4]
      const @sin : f32[1,1,4,4]
      %a : f32[1,2,4,4], %b : f32[1,2,4,4] = split[axis=3, sizes=[4,4]](%x)
      %ac : f32[1,2,4,4] = mul(%a, @cos)
      %bs : f32[1,2,4,4] = mul(%b, @sin)
      %f : f32[1,2,4,4] = sub(%ac, %bs)
      %bc : f32[1,2,4,4] = mul(%b, @cos)
      %as : f32[1,2,4,4] = mul(%a, @sin)
      %s : f32[1,2,4,4] = add(%bc, %as)
      %y : f32[1,2,4,8] = concat[axis=3](%f, %s)
      return %y
    }
    """


def test_rope_split_halves() -> None:
    # -- rope-fusion (rope-split-halves): gpt-oss's rotation of the two halves of one split --
    check(RoPEFusion(), ROPE_SPLIT, """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,1,4,4]
          const @sin : f32[1,1,4,4]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %a : f32[1,2,4,4], %b : f32[1,2,4,4] = split[axis=3, sizes=[4,4]](%x)
          %y : f32[1,2,4,8] = rope_lut[layout="half"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, PAIRS_DATA, numerics=True)  # (the split, dead now, is dead-code elimination's)


def test_rope_split_halves_refuses_an_uneven_split() -> None:
    # -- rope-fusion: a split of 4 and 4 along the heads' axis, not the head dim --
    src = ROPE_SPLIT.replace("%a : f32[1,2,4,4], %b : f32[1,2,4,4] = split[axis=3, sizes=[4,4]](%x)",
                             "%x2 : f32[1,2,8,4] = reshape[shape=[1,2,8,4]](%x)\n"
                             "      %a : f32[1,2,4,4], %b : f32[1,2,4,4] = split[axis=2, sizes=[4,4]](%x2)")
    refuses(RoPEFusion(), src, "rope-split-halves",
            "the split is not the two halves of the last axis of [batch, heads, seq, dim]", PAIRS_DATA)


def test_rope_every_two() -> None:
    # -- rope-fusion (rope-every-two): GPT-J's rotate_every_two (Cohere, GLM): stack([-odd, even], -1)
    #    flattened, tables repeat_interleave'd: the interleaved layout, every other column the table --
    check(RoPEFusion(), ROPE_EVERY_TWO, """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,1,4,8]
          const @sin : f32[1,1,4,8]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y : f32[1,2,4,8] = rope_lut[layout="interleaved"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, EVERY_TWO_DATA, numerics=True)


def test_rope_every_two_refuses_halves_and_unpaired_tables() -> None:
    # -- rope-fusion: (even, -odd) is the other rotation; tables whose columns are not in pairs --
    swapped = ROPE_EVERY_TWO.replace("concat[axis=4](%n1, %e1)", "concat[axis=4](%e1, %n1)")
    res = RoPEFusion()(load(swapped, EVERY_TWO_DATA))
    assert "rope_lut" not in [n.op for n in res.graph.nodes]
    refuses(RoPEFusion(), ROPE_EVERY_TWO, "rope-every-two",
            "the cos/sin columns do not come in equal pairs: not an interleaved RoPE",
            {"cos": FREQS.cos().repeat(1, 2)[None, None], "sin": FREQS.sin().repeat(1, 2)[None, None]})


ROPE_COMPLEX = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,1,4,4,1]
      const @sin : f32[1,1,4,4,1]
      %p : f32[1,2,4,4,2] = reshape[shape=[1,2,4,4,2]](%x)
      %a : f32[1,2,4,4,1] = slice[axis=4, end=1, start=0, step=1](%p)
      %b : f32[1,2,4,4,1] = slice[axis=4, end=2, start=1, step=1](%p)
      %ac : f32[1,2,4,4,1] = mul(%a, @cos)
      %bs : f32[1,2,4,4,1] = mul(%b, @sin)
      %re : f32[1,2,4,4,1] = sub(%ac, %bs)
      %as : f32[1,2,4,4,1] = mul(@sin, %a)
      %bc : f32[1,2,4,4,1] = mul(%b, @cos)
      %im : f32[1,2,4,4,1] = add(%bc, %as)
      %c : f32[1,2,4,4,2] = concat[axis=4](%re, %im)
      %y : f32[1,2,4,8] = reshape[shape=[1,2,4,8]](%c)
      return %y
    }
    """
COMPLEX_DATA = {"cos": FREQS.cos()[None, None, :, :, None], "sin": FREQS.sin()[None, None, :, :, None]}


def test_rope_complex_pairs() -> None:
    # -- rope-fusion (rope-complex): view_as_complex(x) * freqs_cis, as the torch frontend writes it --
    check(RoPEFusion(), ROPE_COMPLEX, """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,1,4,4,1]
          const @sin : f32[1,1,4,4,1]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y : f32[1,2,4,8] = rope_lut[layout="interleaved"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, COMPLEX_DATA, numerics=True)


def test_rope_complex_single_head_viewed_straight_as_pairs() -> None:
    # -- rope-fusion (rope-complex): DeepSeek's shared k [batch, seq, d] reshaped to one head's pairs --
    src = ROPE_COMPLEX.replace("%x : f32[1,2,4,8]", "%x : f32[1,4,8]").replace("1,2,4,", "1,1,4,")
    check(RoPEFusion(), src, """
        graph main(%x : f32[1,4,8]) {
          const @cos : f32[1,1,4,4,1]
          const @sin : f32[1,1,4,4,1]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y_reshape : f32[1,1,4,8] = reshape[shape=[1,1,4,8]](%x)
          %y : f32[1,1,4,8] = rope_lut[layout="interleaved"](%y_reshape, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, COMPLEX_DATA, numerics=True)


def test_rope_complex_refuses_parts_swapped() -> None:
    # -- rope-fusion: %a is the imaginary part and %b the real one: not this rotation --
    src = ROPE_COMPLEX.replace("end=1, start=0", "end=9, start=8").replace("end=2, start=1", "end=1, start=0") \
        .replace("end=9, start=8", "end=2, start=1")
    refuses(RoPEFusion(), src, "rope-complex", "the slices are not the real and imaginary parts", COMPLEX_DATA)


def test_rope_complex_refuses_tables_that_vary_along_heads() -> None:
    # -- rope-fusion: a [1,2,4,4,1] table per head --
    cos = torch.stack([FREQS.cos(), FREQS.cos() + 1])[None, :, :, :, None]
    refuses(RoPEFusion(), ROPE_COMPLEX.replace("const @cos : f32[1,1,4,4,1]", "const @cos : f32[1,2,4,4,1]"),
            "rope-complex", "the cos/sin tables vary along batch or heads", {"cos": cos, "sin": COMPLEX_DATA["sin"]})


ROPE_ONNX = """
    graph main(%x : f32[1,2,4,8]) {
      const @cos : f32[1,4,4]
      const @sin : f32[1,4,4]
      %y : f32[1,2,4,8] = rotary_embedding{attrs}(%x, @cos, @sin)
      return %y
    }
    """


@pytest.mark.parametrize(("attrs", "layout"), [("", "half"), ("[interleaved=true]", "interleaved")])
def test_rope_onnx_three_inputs(attrs: str, layout: str) -> None:
    # -- rope-fusion (rope-onnx): caches [batch, seq, r/2] become tables --
    check(RoPEFusion(), ROPE_ONNX.replace("{attrs}", attrs), f"""
        graph main(%x : f32[1,2,4,8]) {{
          const @cos : f32[1,4,4]
          const @sin : f32[1,4,4]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y : f32[1,2,4,8] = rope_lut[layout="{layout}"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }}
        """, {"cos": FREQS.cos()[None], "sin": FREQS.sin()[None]}, numerics=True)


def test_rope_onnx_partial_rotary() -> None:
    # -- rope-fusion (rope-onnx): rotary_dim=4 of 8: the tables are [seq, 2] and the rest passes through --
    f = freqs(4, 2)
    check(RoPEFusion(), """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,4,2]
          const @sin : f32[1,4,2]
          %y : f32[1,2,4,8] = rotary_embedding[rotary_dim=4](%x, @cos, @sin)
          return %y
        }
        """, """
        graph main(%x : f32[1,2,4,8]) {
          const @cos : f32[1,4,2]
          const @sin : f32[1,4,2]
          const @cos_lut : f32[4,2]
          const @sin_lut : f32[4,2]
          const @positions_4 : i64[4]
          %y : f32[1,2,4,8] = rope_lut[layout="half"](%x, @positions_4, @cos_lut, @sin_lut)
          return %y
        }
        """, {"cos": f.cos()[None], "sin": f.sin()[None]}, numerics=True)


def test_rope_onnx_four_inputs() -> None:
    # -- rope-fusion (rope-onnx-positions): caches indexed by position ids are the tables already --
    f = freqs(16, 4)
    check(RoPEFusion(), """
        graph main(%x : f32[1,2,4,8], %pos : i64[1,4]) {
          const @cos : f32[16,4]
          const @sin : f32[16,4]
          %y : f32[1,2,4,8] = rotary_embedding(%x, @cos, @sin, %pos)
          return %y
        }
        """, """
        graph main(%x : f32[1,2,4,8], %pos : i64[1,4]) {
          const @cos : f32[16,4]
          const @sin : f32[16,4]
          %y : f32[1,2,4,8] = rope_lut[layout="half"](%x, %pos, @cos, @sin)
          return %y
        }
        """, {"cos": f.cos(), "sin": f.sin()}, numerics=True, ints={"pos": 16})


ROPE_3D = """
    graph main(%x : f32[1,4,16]) {
      const @cos : f32[1,4,4]
      const @sin : f32[1,4,4]
      %y : f32[1,4,16] = rotary_embedding{attrs}(%x, @cos, @sin)
      return %y
    }
    """


def test_rope_onnx_3d_input_splits_the_heads_around_the_lut() -> None:
    # -- rope-fusion: com.microsoft's x [batch, seq, heads*dim] with num_heads --
    check(RoPEFusion(), ROPE_3D.replace("{attrs}", "[num_heads=2]"), """
        graph main(%x : f32[1,4,16]) {
          const @cos : f32[1,4,4]
          const @sin : f32[1,4,4]
          const @cos_lut : f32[4,4]
          const @sin_lut : f32[4,4]
          const @positions_4 : i64[4]
          %y_reshape : f32[1,4,2,8] = reshape[shape=[1,4,2,8]](%x)
          %y_transpose : f32[1,2,4,8] = transpose[perm=[0,2,1,3]](%y_reshape)
          %y_rope_lut : f32[1,2,4,8] = rope_lut[layout="half"](%y_transpose, @positions_4, @cos_lut, @sin_lut)
          %y_transpose_1 : f32[1,4,2,8] = transpose[perm=[0,2,1,3]](%y_rope_lut)
          %y : f32[1,4,16] = reshape[shape=[1,4,16]](%y_transpose_1)
          return %y
        }
        """, {"cos": FREQS.cos()[None], "sin": FREQS.sin()[None]}, numerics=True)


def test_rope_onnx_refuses_caches_that_vary_along_batch() -> None:
    # -- rope-fusion: per-batch positions (left padding) cannot be one table --
    refuses(RoPEFusion(), ROPE_ONNX.replace("{attrs}", "").replace("1,2,4,8", "2,2,4,8").replace("1,4,4", "2,4,4"), "rope-onnx",
            "the cos/sin caches vary along batch",
            {"cos": torch.stack([FREQS.cos(), FREQS.cos().roll(1, 0)]), "sin": torch.stack([FREQS.sin(), FREQS.sin().roll(1, 0)])})


def test_rope_onnx_refuses_a_sin_cache_that_varies_along_batch() -> None:
    # -- rope-fusion: cos is the same for both batch rows, sin is not --
    refuses(RoPEFusion(), ROPE_ONNX.replace("{attrs}", "").replace("1,2,4,8", "2,2,4,8").replace("1,4,4", "2,4,4"), "rope-onnx",
            "the cos/sin caches vary along batch",
            {"cos": torch.stack([FREQS.cos(), FREQS.cos()]), "sin": torch.stack([FREQS.sin(), FREQS.sin().roll(1, 0)])})


# =========================================================================================
# attention-fusion
# =========================================================================================

SDPA_MASK = """
    graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {{
      const @mask : {mask}
      %y : f32[1,2,4,8] = sdpa[scale=0.25](%q, %k, %v, @mask)
      return %y
    }}
    """


@pytest.mark.parametrize(("mtype", "mask"), [
    ("f32[1,1,4,4]", causal(4, 4)[None, None]),
    ("f32[4,4]", causal(4, 4, fill=-1e9)),
    ("bool[4,4]", torch.ones(4, 4, dtype=torch.bool).tril()),
])
def test_attention_sdpa_with_a_causal_mask(mtype: str, mask: torch.Tensor) -> None:
    # -- attention-fusion (sdpa-to-fused-attention): a constant causal mask becomes causal=true and
    #    no operand (additive -inf or -1e9, or boolean) --
    check(AttentionFusion(), SDPA_MASK.format(mask=mtype), f"""
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {{
          const @mask : {mtype}
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }}
        """, {"mask": mask}, numerics=True)


@pytest.mark.parametrize("boolean", [False, True], ids=["additive", "bool"])
def test_attention_sdpa_with_a_sliding_window_band(boolean: bool) -> None:
    # -- attention-fusion: the causal band of a 2-key sliding window (query i sees keys i-1..i)
    #    becomes causal=true, window=2 and no operand --
    band = torch.ones(4, 4, dtype=torch.bool).tril() & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)
    mask, mtype = (band, "bool[4,4]") if boolean else (torch.zeros(4, 4).masked_fill(~band, -math.inf), "f32[4,4]")
    check(AttentionFusion(), SDPA_MASK.format(mask=mtype), f"""
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {{
          const @mask : {mtype}
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25, window=2](%q, %k, %v)
          return %y
        }}
        """, {"mask": mask}, numerics=True)


NON_CAUSAL = torch.zeros(1, 1, 4, 4).index_fill(3, torch.tensor([3]), -1e9)  # the last key is padding


def test_attention_sdpa_keeps_a_non_causal_mask() -> None:
    # -- attention-fusion: a padding mask is not causal: it stays an operand, causal stays false --
    check(AttentionFusion(), SDPA_MASK.format(mask="f32[1,1,4,4]"), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @mask : f32[1,1,4,4]
          %y : f32[1,2,4,8] = fused_attention[causal=false, scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, {"mask": NON_CAUSAL}, numerics=True)


def test_attention_sdpa_keeps_an_upper_triangular_mask() -> None:
    # -- attention-fusion: the transpose of the causal mask (anti-causal) stays an operand --
    check(AttentionFusion(), SDPA_MASK.format(mask="f32[1,1,4,4]"), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @mask : f32[1,1,4,4]
          %y : f32[1,2,4,8] = fused_attention[causal=false, scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, {"mask": causal(4, 4).t()[None, None].contiguous()}, numerics=True)


def test_attention_sdpa_keeps_a_non_square_mask() -> None:
    # -- attention-fusion: 16 queries over 8 keys, a [1,1,16,8] padding mask: kept, causal stays false --
    mask = torch.zeros(1, 1, 16, 8).index_fill(3, torch.tensor([6, 7]), -1e9)
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,16,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,16,8]
          %y : f32[1,2,16,8] = sdpa(%q, %k, %v, @mask)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,16,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,16,8]
          %y : f32[1,2,16,8] = fused_attention[causal=false, scale=0.35355339059327373](%q, %k, %v, @mask)
          return %y
        }
        """, {"mask": mask}, numerics=True)


def test_attention_sdpa_keeps_a_bottom_right_causal_mask() -> None:
    # -- attention-fusion: 4 new queries after 4 cached keys (bottom-right aligned) is not the
    #    top-left causal mask the flag means: kept as an operand --
    mask = torch.full((4, 8), -math.inf).triu(5)[None, None]
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,4,8]
          %y : f32[1,2,4,8] = sdpa[scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,4,8]
          %y : f32[1,2,4,8] = fused_attention[causal=false, scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, {"mask": mask}, numerics=True)


def test_attention_sdpa_top_left_non_square_mask_is_the_causal_flag() -> None:
    # -- attention-fusion: 4 queries over 8 keys, a top-left aligned tril mask: that is exactly what
    #    causal=true means for fused_attention (torch's is_causal), so the operand goes --
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,4,8]
          %y : f32[1,2,4,8] = sdpa[scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,8,8], %v : f32[1,2,8,8]) {
          const @mask : f32[1,1,4,8]
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }
        """, {"mask": causal(4, 8)[None, None]}, numerics=True)


def test_attention_sdpa_without_a_mask() -> None:
    # -- attention-fusion: no mask, is_causal, and the default scale 1/sqrt(16) --
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          %y : f32[1,2,4,8] = sdpa[causal=true](%q, %k, %v)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }
        """, numerics=True)


def test_attention_sdpa_absorbs_repeat_kv() -> None:
    # -- attention-fusion: GQA: k and v repeated 2x by reshape -> expand -> reshape are read from before the
    #    repeat (the repeats are left for dce) --
    check(AttentionFusion(), """
        graph main(%q : f32[1,4,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @mask : f32[1,1,4,4]
          %k1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%k)
          %k2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%k1)
          %kr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%k2)
          %v1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%v)
          %v2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%v1)
          %vr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%v2)
          %y : f32[1,4,4,8] = sdpa[scale=0.25](%q, %kr, %vr, @mask)
          return %y
        }
        """, """
        graph main(%q : f32[1,4,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @mask : f32[1,1,4,4]
          %k1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%k)
          %k2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%k1)
          %kr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%k2)
          %v1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%v)
          %v2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%v1)
          %vr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%v2)
          %y : f32[1,4,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }
        """, {"mask": causal(4, 4)[None, None]}, numerics=True)


def test_attention_sdpa_does_not_absorb_a_reshape_that_is_not_repeat_kv() -> None:
    # -- attention-fusion: the repeated keys are viewed as 8 heads of 2 positions, not 4 heads of 4 --
    assert_handled(AttentionFusion(), """
        graph main(%q : f32[1,8,2,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          %k1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%k)
          %k2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%k1)
          %kr : f32[1,8,2,8] = reshape[shape=[1,8,2,8]](%k2)
          %v1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%v)
          %v2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%v1)
          %vr : f32[1,8,2,8] = reshape[shape=[1,8,2,8]](%v2)
          %y : f32[1,8,2,8] = sdpa[scale=0.25](%q, %kr, %vr)
          return %y
        }
        """, {})


def test_attention_sdpa_refuses_a_mask_that_broadcasts_the_scores_up() -> None:
    # -- attention-fusion: a [2,1,4,4] mask on a batch of 1 --
    refuses(AttentionFusion(), SDPA_MASK.format(mask="f32[2,1,4,4]"), "sdpa-to-fused-attention",
            "mask f32[2,1,4,4] broadcasts the scores to another shape", {"mask": torch.zeros(2, 1, 4, 4)})


def test_attention_sdpa_refuses_3d_operands() -> None:
    # -- attention-fusion: [heads, seq, dim] operands --
    refuses(AttentionFusion(), """
        graph main(%q : f32[2,4,8], %k : f32[2,4,8], %v : f32[2,4,8]) {
          %y : f32[2,4,8] = sdpa(%q, %k, %v)
          return %y
        }
        """, "sdpa-to-fused-attention", "attention operands are not 4-D [batch, heads, seq, dim]")


ATTN18 = """
    graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
      const @cq : f32[]
      const @ck : f32[]
      const @mask : f32[1,1,4,4]
      const @zero : f32[]
      %qs : f32[1,2,4,16] = mul(%q, @cq)
      %kt : f32[1,2,16,4] = transpose[perm=[0,1,3,2]](%k)
      %ks : f32[1,2,16,4] = mul(@ck, %kt)
      %s : f32[1,2,4,4] = matmul(%qs, %ks)
      %sm_in : f32[1,2,4,4] = add(%s, @mask)
      %sm : f32[1,2,4,4] = softmax[axis=3](%sm_in)
      %nan : bool[1,2,4,4] = is_nan(%sm)
      %p : f32[1,2,4,4] = where(%nan, @zero, %sm)
      %y : f32[1,2,4,8] = matmul(%p, %v)
      return %y
    }
    """
ATTN18_DATA = {"cq": torch.tensor(0.5), "ck": torch.tensor(0.5), "mask": causal(4, 4)[None, None],
               "zero": torch.tensor(0.0)}


def test_attention_decomposed_opset18() -> None:
    # -- attention-fusion (decomposed-attention): sqrt(scale) on q and on k^T, an additive causal mask,
    #    the NaN guard; v's head dim differs from q's (MLA) --
    res = check(AttentionFusion(), ATTN18, """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          const @cq : f32[]
          const @ck : f32[]
          const @mask : f32[1,1,4,4]
          const @zero : f32[]
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }
        """, ATTN18_DATA, numerics=True)
    [f] = res.details["fusions"]
    assert f["replaced"] == ["y", "p", "nan", "sm", "sm_in", "s", "qs", "ks", "kt"]


def test_attention_decomposed_keeps_a_non_causal_mask() -> None:
    # -- attention-fusion: the same with a padding mask: an operand --
    check(AttentionFusion(), ATTN18, """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          const @cq : f32[]
          const @ck : f32[]
          const @mask : f32[1,1,4,4]
          const @zero : f32[]
          %y : f32[1,2,4,8] = fused_attention[causal=false, scale=0.25](%q, %k, %v, @mask)
          return %y
        }
        """, {**ATTN18_DATA, "mask": NON_CAUSAL}, numerics=True)


def test_attention_decomposed_3d_key_transpose_and_divided_scores() -> None:
    # -- attention-fusion (decomposed-attention): k^T through a [batch*heads, seq, dim] view, the scores
    #    divided by sqrt(d), a mask that is an input (an operand), no NaN guard --
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,16], %mask : f32[1,1,4,4]) {
          const @d : f32[]
          %k3 : f32[2,4,16] = reshape[shape=[2,4,16]](%k)
          %kt3 : f32[2,16,4] = transpose[perm=[0,2,1]](%k3)
          %kt : f32[1,2,16,4] = reshape[shape=[1,2,16,4]](%kt3)
          %s : f32[1,2,4,4] = matmul(%q, %kt)
          %sd : f32[1,2,4,4] = div(%s, @d)
          %sm_in : f32[1,2,4,4] = add(%mask, %sd)
          %sm : f32[1,2,4,4] = softmax[axis=3](%sm_in)
          %y : f32[1,2,4,16] = matmul(%sm, %v)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,16], %mask : f32[1,1,4,4]) {
          const @d : f32[]
          %y : f32[1,2,4,16] = fused_attention[causal=false, scale=0.25](%q, %k, %v, %mask)
          return %y
        }
        """, {"d": torch.tensor(4.0)}, numerics=True)


@pytest.mark.parametrize("divide", [True, False], ids=["div", "mul-by-inverse"])
def test_attention_decomposed_with_soft_capped_scores(divide: bool) -> None:
    # -- attention-fusion (decomposed-attention): Gemma 2's soft-capped scores, cap * tanh(s / cap),
    #    under a causal mask: softcap=cap; cap and divisor that differ are no soft-cap (left alone) --
    by = "div(%ss, @cd)" if divide else "mul(%ss, @cd)"
    src = f"""
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,16]) {{
          const @c : f32[]
          const @cd : f32[]
          const @cap : f32[]
          const @mask : f32[1,1,4,4]
          %kt : f32[1,2,16,4] = transpose[perm=[0,1,3,2]](%k)
          %s : f32[1,2,4,4] = matmul(%q, %kt)
          %ss : f32[1,2,4,4] = mul(%s, @c)
          %sc : f32[1,2,4,4] = {by}
          %th : f32[1,2,4,4] = tanh(%sc)
          %cp : f32[1,2,4,4] = mul(%th, @cap)
          %sm_in : f32[1,2,4,4] = add(%cp, @mask)
          %sm : f32[1,2,4,4] = softmax[axis=3](%sm_in)
          %y : f32[1,2,4,16] = matmul(%sm, %v)
          return %y
        }}
        """
    data = {"c": torch.tensor(0.25), "cd": torch.tensor(2.0 if divide else 0.5), "cap": torch.tensor(2.0),
            "mask": causal(4, 4)[None, None]}
    check(AttentionFusion(), src, """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,16]) {
          const @c : f32[]
          const @cd : f32[]
          const @cap : f32[]
          const @mask : f32[1,1,4,4]
          %y : f32[1,2,4,16] = fused_attention[causal=true, scale=0.25, softcap=2.0](%q, %k, %v)
          return %y
        }
        """, data, numerics=True)
    res = AttentionFusion()(load(src, {**data, "cap": torch.tensor(3.0)}))
    assert [n.op for n in res.graph.nodes][-1] == "matmul"  # not fused


SINKS = """
    graph main(%q : f32[1,4,8,16], %k : f32[1,2,8,16], %v : f32[1,2,8,16]) {
      const @c : f32[]
      const @mask : f32[1,1,8,8]
      const @sinks : f32[1,4,8,1]
      %k5 : f32[1,2,1,8,16] = reshape[shape=[1,2,1,8,16]](%k)
      %ke : f32[1,2,2,8,16] = expand[shape=[1,2,2,8,16]](%k5)
      %kr : f32[1,4,8,16] = reshape[shape=[1,4,8,16]](%ke)
      %v5 : f32[1,2,1,8,16] = reshape[shape=[1,2,1,8,16]](%v)
      %ve : f32[1,2,2,8,16] = expand[shape=[1,2,2,8,16]](%v5)
      %vr : f32[1,4,8,16] = reshape[shape=[1,4,8,16]](%ve)
      %kt : f32[1,4,16,8] = transpose[perm=[0,1,3,2]](%kr)
      %s : f32[1,4,8,8] = matmul(%q, %kt)
      %ss : f32[1,4,8,8] = mul(%s, @c)
      %sm_in : f32[1,4,8,8] = add(%ss, @mask)
      %cat : f32[1,4,8,9] = concat[axis=3](%sm_in, @sinks)
      %mx : f32[1,4,8,1] = reduce_max[axes=[3], keepdim=true](%cat)
      %sh : f32[1,4,8,9] = sub(%cat, %mx)
      %sm : f32[1,4,8,9] = softmax[axis=3](%sh)
      %p : f32[1,4,8,8] = slice[axis=3, end=8, start=0, step=1](%sm)
      %y : f32[1,4,8,16] = matmul(%p, %vr)
      return %y
    }
    """
SINK_LOGITS = torch.tensor([0.5, -1.0, 2.0, 0.0])
SINKS_DATA = {"c": torch.tensor(0.25), "mask": causal(8, 8)[None, None],
              "sinks": SINK_LOGITS[None, :, None, None].expand(1, 4, 8, 1).contiguous()}


def test_attention_with_sinks() -> None:
    # -- attention-fusion (attention-with-sinks): gpt-oss's per-head sink logits, a column joined to
    #    the scores before the softmax and dropped after: sinks [heads] after a mask slot of zeros
    #    (the causal mask is the flag); GQA's repeated k/v read from before the repeat --
    res = check(AttentionFusion(), SINKS, """
        graph main(%q : f32[1,4,8,16], %k : f32[1,2,8,16], %v : f32[1,2,8,16]) {
          const @c : f32[]
          const @mask : f32[1,1,8,8]
          const @sinks : f32[1,4,8,1]
          const @sinks_heads : f32[4]
          const @no_mask : f32[]
          %k5 : f32[1,2,1,8,16] = reshape[shape=[1,2,1,8,16]](%k)
          %ke : f32[1,2,2,8,16] = expand[shape=[1,2,2,8,16]](%k5)
          %kr : f32[1,4,8,16] = reshape[shape=[1,4,8,16]](%ke)
          %v5 : f32[1,2,1,8,16] = reshape[shape=[1,2,1,8,16]](%v)
          %ve : f32[1,2,2,8,16] = expand[shape=[1,2,2,8,16]](%v5)
          %vr : f32[1,4,8,16] = reshape[shape=[1,4,8,16]](%ve)
          %y : f32[1,4,8,16] = fused_attention[causal=true, scale=0.25](%q, %k, %v, @no_mask, @sinks_heads)
          return %y
        }
        """, SINKS_DATA, numerics=True)
    assert torch.equal(res.graph.constants["sinks_heads"].const.load(), SINK_LOGITS)  # type: ignore[union-attr]


def test_attention_with_sinks_refuses_logits_that_vary_along_queries() -> None:
    # -- attention-fusion: a sink column that is not one logit per head --
    refuses(AttentionFusion(), SINKS, "attention-with-sinks", "the sink logits vary along batch or queries",
            {**SINKS_DATA, "sinks": torch.randn(1, 4, 8, 1)})


def test_attention_decomposed_3d_key_transpose_of_a_flat_key() -> None:
    # -- attention-fusion: the key is [batch*heads, seq, dim] already: it is viewed back as 4-D --
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,16], %k : f32[2,4,16], %v : f32[1,2,4,16]) {
          %k3 : f32[2,4,16] = reshape[shape=[2,4,16]](%k)
          %kt3 : f32[2,16,4] = transpose[perm=[0,2,1]](%k3)
          %kt : f32[1,2,16,4] = reshape[shape=[1,2,16,4]](%kt3)
          %s : f32[1,2,4,4] = matmul(%q, %kt)
          %sm : f32[1,2,4,4] = softmax[axis=3](%s)
          %y : f32[1,2,4,16] = matmul(%sm, %v)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,16], %k : f32[2,4,16], %v : f32[1,2,4,16]) {
          %k_4d : f32[1,2,4,16] = reshape[shape=[1,2,4,16]](%k)
          %y : f32[1,2,4,16] = fused_attention[causal=false, scale=1.0](%q, %k_4d, %v)
          return %y
        }
        """, numerics=True)


def test_attention_decomposed_absorbs_repeat_kv() -> None:
    # -- attention-fusion: GQA in the decomposed form: k^T and v read from before repeat_kv --
    check(AttentionFusion(), """
        graph main(%q : f32[1,4,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          %k1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%k)
          %k2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%k1)
          %kr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%k2)
          %v1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%v)
          %v2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%v1)
          %vr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%v2)
          %kt : f32[1,4,8,4] = transpose[perm=[0,1,3,2]](%kr)
          %s : f32[1,4,4,4] = matmul(%q, %kt)
          %sm : f32[1,4,4,4] = softmax[axis=3](%s)
          %y : f32[1,4,4,8] = matmul(%sm, %vr)
          return %y
        }
        """, """
        graph main(%q : f32[1,4,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          %k1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%k)
          %k2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%k1)
          %kr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%k2)
          %v1 : f32[1,2,1,4,8] = reshape[shape=[1,2,1,4,8]](%v)
          %v2 : f32[1,2,2,4,8] = expand[shape=[1,2,2,4,8]](%v1)
          %vr : f32[1,4,4,8] = reshape[shape=[1,4,4,8]](%v2)
          %y : f32[1,4,4,8] = fused_attention[causal=false, scale=1.0](%q, %k, %v)
          return %y
        }
        """, numerics=True)


def test_attention_decomposed_refuses_a_shared_softmax() -> None:
    # -- attention-fusion: the attention probabilities are also returned --
    src = ATTN18.replace("return %y", "return %y, %sm")
    refuses(AttentionFusion(), src, "decomposed-attention", "%sm is used outside the match", ATTN18_DATA)


def test_attention_decomposed_leaves_a_shared_scale_outside() -> None:
    # -- attention-fusion: the scaled query %qs has another reader: the match that takes its scale in
    #    is refused, the one that reads %qs as the query fuses, with k's scale only --
    res = check(AttentionFusion(), ATTN18.replace("return %y", "return %y, %qs"), """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          const @cq : f32[]
          const @ck : f32[]
          const @mask : f32[1,1,4,4]
          const @zero : f32[]
          %qs : f32[1,2,4,16] = mul(%q, @cq)
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.5](%qs, %k, %v)
          return %y, %qs
        }
        """, ATTN18_DATA, numerics=True)
    assert res.details["rules"]["decomposed-attention"] == \
        {"matched": 2, "applied": 1, "refused": {"%qs is used outside the match": 1}}


def test_attention_decomposed_refuses_a_mask_that_broadcasts_the_scores_up() -> None:
    # -- attention-fusion: a [2,1,4,4] mask on a batch of 1 --
    src = ATTN18.replace("@mask : f32[1,1,4,4]", "@mask : f32[2,1,4,4]") \
        .replace("f32[1,2,4,4]", "f32[2,2,4,4]").replace("bool[1,2,4,4]", "bool[2,2,4,4]") \
        .replace("%s : f32[2,2,4,4]", "%s : f32[1,2,4,4]").replace("%y : f32[1,2,4,8]", "%y : f32[2,2,4,8]")
    refuses(AttentionFusion(), src, "decomposed-attention", "mask f32[2,1,4,4] broadcasts the scores to another shape",
            {**ATTN18_DATA, "mask": torch.zeros(2, 1, 4, 4)})


def test_attention_decomposed_refuses_a_softmax_over_another_axis() -> None:
    # -- attention-fusion: a softmax over the queries is not attention --
    refuses(AttentionFusion(), ATTN18.replace("softmax[axis=3]", "softmax[axis=2]"), "decomposed-attention",
            "then softmax %sm has axis=2", ATTN18_DATA)


def test_attention_decomposed_leaves_a_scale_that_is_not_a_scalar_outside() -> None:
    # -- attention-fusion: a per-head scale on q is not a softmax scale: it stays, and the query is %qs --
    check(AttentionFusion(), ATTN18.replace("const @cq : f32[]", "const @cq : f32[1,2,1,1]"), """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          const @cq : f32[1,2,1,1]
          const @ck : f32[]
          const @mask : f32[1,1,4,4]
          const @zero : f32[]
          %qs : f32[1,2,4,16] = mul(%q, @cq)
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.5](%qs, %k, %v)
          return %y
        }
        """, {**ATTN18_DATA, "cq": torch.tensor([0.5, 0.25]).reshape(1, 2, 1, 1)}, numerics=True)


def test_attention_decomposed_softmax_over_axis_minus_one() -> None:
    # -- attention-fusion: softmax[axis=-1] is the last axis --
    check(AttentionFusion(), ATTN18.replace("softmax[axis=3]", "softmax[axis=-1]"), """
        graph main(%q : f32[1,2,4,16], %k : f32[1,2,4,16], %v : f32[1,2,4,8]) {
          const @cq : f32[]
          const @ck : f32[]
          const @mask : f32[1,1,4,4]
          const @zero : f32[]
          %y : f32[1,2,4,8] = fused_attention[causal=true, scale=0.25](%q, %k, %v)
          return %y
        }
        """, ATTN18_DATA)


# =========================================================================================
# bias-fusion
# =========================================================================================


@pytest.mark.parametrize("add", ["add(%y, @b)", "add(@b, %y)"])
def test_bias(add: str) -> None:
    # -- bias-fusion: either operand order --
    check(BiasFusion(), f"""
        graph main(%x : f32[4,8]) {{
          const @w : f32[16,8]
          const @b : f32[16]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[4,16] = {add}
          return %z
        }}
        """, """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[16]
          %z : f32[4,16] = linear(%x, @w, @b)
          return %z
        }
        """, {"w": rand(16, 8), "b": rand(16, seed=1)}, numerics=True)


def test_bias_of_rank_two_is_flattened() -> None:
    # -- bias-fusion: a [1,16] bias becomes the [16] vector linear takes --
    check(BiasFusion(), """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[1,16]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[4,16] = add(%y, @b)
          return %z
        }
        """, """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[1,16]
          %b_flat : f32[16] = reshape[shape=[16]](@b)
          %z : f32[4,16] = linear(%x, @w, %b_flat)
          return %z
        }
        """, {"w": rand(16, 8), "b": rand(1, 16, seed=1)}, numerics=True)


def test_bias_refuses_a_bias_that_broadcasts_the_result_up() -> None:
    # -- bias-fusion: a [1,1,16] bias makes the [4,16] product [1,4,16] --
    refuses(BiasFusion(), """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[1,1,16]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[1,4,16] = add(%y, @b)
          return %z
        }
        """, "linear-bias", "the bias broadcasts the result to another shape")


def test_bias_refuses_a_bias_along_the_tokens() -> None:
    # -- bias-fusion: a [4,1] "bias" runs along the rows, not the output features --
    refuses(BiasFusion(), """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[4,1]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[4,16] = add(%y, @b)
          return %z
        }
        """, "linear-bias", "bias f32[4,1] does not run along the output features (16)")


def test_bias_refuses_a_shared_product() -> None:
    # -- bias-fusion: the product before the bias has another reader --
    refuses(BiasFusion(), """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b : f32[16]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[4,16] = add(%y, @b)
          return %z, %y
        }
        """, "linear-bias", "%y is used outside the match")


def test_bias_refuses_a_bias_that_is_an_activation() -> None:
    # -- bias-fusion: a residual add is not a bias --
    refuses(BiasFusion(), """
        graph main(%x : f32[4,8], %r : f32[4,16]) {
          const @w : f32[16,8]
          %y : f32[4,16] = linear(%x, @w)
          %z : f32[4,16] = add(%y, %r)
          return %z
        }
        """, "linear-bias", "then %r does not satisfy %b's condition")


def test_bias_leaves_a_linear_that_has_a_bias() -> None:
    # -- bias-fusion: linear already has a bias operand --
    refuses(BiasFusion(), """
        graph main(%x : f32[4,8]) {
          const @w : f32[16,8]
          const @b0 : f32[16]
          const @b : f32[16]
          %y : f32[4,16] = linear(%x, @w, @b0)
          %z : f32[4,16] = add(%y, @b)
          return %z
        }
        """, "linear-bias", "then linear %y has 3 operands, the pattern 2")


def test_attention_decomposed_with_a_boolean_mask_through_where() -> None:
    # scores hidden by where(mask, s, -inf) instead of an additive mask: the mask stays an operand
    mask = torch.rand(1, 1, 4, 4, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    check(AttentionFusion(), """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @m : bool[1,1,4,4]
          const @ninf : f32[]
          const @c : f32[]
          %kt : f32[1,2,8,4] = transpose[perm=[0,1,3,2]](%k)
          %s : f32[1,2,4,4] = matmul(%q, %kt)
          %ss : f32[1,2,4,4] = mul(%s, @c)
          %w : f32[1,2,4,4] = where(@m, %ss, @ninf)
          %p : f32[1,2,4,4] = softmax[axis=3](%w)
          %y : f32[1,2,4,8] = matmul(%p, %v)
          return %y
        }
        """, """
        graph main(%q : f32[1,2,4,8], %k : f32[1,2,4,8], %v : f32[1,2,4,8]) {
          const @m : bool[1,1,4,4]
          const @ninf : f32[]
          const @c : f32[]
          %y : f32[1,2,4,8] = fused_attention[causal=false, scale=0.25](%q, %k, %v, @m)
          return %y
        }
        """, data={"m": mask, "ninf": torch.tensor(float("-inf")), "c": torch.tensor(0.25)}, numerics=True)
