"""Unit tests of the rewrite engine (`npuc.passes.rewrite`) on small graphs: how
patterns bind, backtrack and refuse, how the engine counts, explains and records
what it did. The passes built on it are tested in test_fusion_passes.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from npuc.errors import InternalError
from npuc.ir import Graph, TensorSource, Value, parse_graph, print_graph, verify
from npuc.passes.rewrite import (
    Fusion,
    Match,
    Pat,
    RewriteEngine,
    Rule,
    any_of,
    const,
    match,
    op,
    opt,
    var,
)


def ir(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def graph(text: str, **data: torch.Tensor) -> Graph:
    """Parse `text`; constants named in `data` get that tensor as an in-memory `TensorSource`."""
    g = parse_graph(ir(text))
    for name, t in data.items():
        g.constants[name].const = TensorSource(t)
    verify(g)
    return g


def value(g: Graph, name: str) -> Value:
    return next(v for v in g.values() if v.name == name)


def matches(p: Pat, g: Graph, root: str) -> list[Match]:
    return list(match(p, value(g, root)))


def rsqrt_rule() -> Rule:
    return Rule("rsqrt", op("reciprocal", op("sqrt", var("x"))), lambda b, m: b.op("rsqrt", [m["x"]]))


class FileBacked:
    """A weight in a file: no `in_memory`, so the engine must never read it to match."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.loads = t, 0

    def load(self) -> torch.Tensor:
        self.loads += 1
        return self.t

    def describe(self) -> str:
        return "a file"


# --- variables ---------------------------------------------------------------------------


SQUARES = """
    graph main(%x : f32[4], %y : f32[4]) {
      %xx : f32[4] = mul(%x, %x)
      %xy : f32[4] = mul(%x, %y)
      return %xx, %xy
    }
    """


def test_a_variable_binds_one_value_everywhere() -> None:
    g = graph(SQUARES)
    square = op("mul", var("a"), var("a"))
    ms = matches(square, g, "xx")  # twice: mul is commutative and both orders bind %a = %x
    assert ms and all(m["a"] is value(g, "x") for m in ms)
    assert matches(square, g, "xy") == []


def test_distinct_variables_may_bind_the_same_value() -> None:
    g = graph(SQUARES)
    [m1, m2] = matches(op("mul", var("a"), var("b")), g, "xx")  # mul is commutative: both orders match
    assert m1["a"] is m1["b"] is value(g, "x")
    [m, swapped] = matches(op("mul", var("a"), var("b")), g, "xy")
    assert (m["a"].name, m["b"].name) == ("x", "y")
    assert (swapped["a"].name, swapped["b"].name) == ("y", "x")


def test_a_failed_binding_is_explained() -> None:
    g = graph("""
        graph main(%x : f32[4], %y : f32[4]) {
          %xy : f32[4] = mul(%x, %y)
          return %xy
        }
        """)
    engine = RewriteEngine([Rule("square", op("mul", var("a"), var("a")), lambda b, m: b.op("abs", [m["a"]]))])
    assert engine.run(g) is False
    assert engine.explain("square").endswith("then %a is bound to %x, not %y")


# --- commutative operands and backtracking ---------------------------------------------------


def test_commutative_op_matches_with_operands_swapped() -> None:
    # The first ordering matches neg and then fails two nodes deep (sigmoid is not exp);
    # the swapped ordering succeeds, and %a still binds consistently.
    g = graph("""
        graph main(%x : f32[4]) {
          %s : f32[4] = sigmoid(%x)
          %ns : f32[4] = neg(%s)
          %e : f32[4] = exp(%x)
          %ne : f32[4] = neg(%e)
          %y : f32[4] = mul(%ns, %ne)
          return %y
        }
        """)
    p = op("mul", op("neg", op("exp", var("a")), bind="n"), var("b"))
    [m] = matches(p, g, "y")
    assert m["a"] is value(g, "x")
    assert m["n"] is value(g, "ne")
    assert m["b"] is value(g, "ns")
    assert [n.name for n in m.matched] == ["y", "ne", "e"]


def test_backtracking_revisits_an_inner_commutative_choice() -> None:
    # add(mul(%q, %p), %q) against add(mul(%a, %b), %b): the inner first ordering binds
    # %b = %p, the outer operand then needs %b = %q, so the matcher must go back into the
    # inner mul and swap it.
    g = graph("""
        graph main(%p : f32[4], %q : f32[4]) {
          %m : f32[4] = mul(%q, %p)
          %y : f32[4] = add(%m, %q)
          return %y
        }
        """)
    ms = matches(op("add", op("mul", var("a"), var("b")), var("b")), g, "y")
    assert [(m["a"].name, m["b"].name) for m in ms] == [("p", "q")]


def test_non_commutative_op_is_not_swapped() -> None:
    g = graph("""
        graph main(%x : f32[4], %y : f32[4]) {
          %e : f32[4] = exp(%y)
          %d : f32[4] = div(%x, %e)
          return %d
        }
        """)
    assert matches(op("div", op("exp", var("a")), var("b")), g, "d") == []
    assert len(matches(op("div", var("b"), op("exp", var("a"))), g, "d")) == 1


def test_a_shared_subpattern_must_be_named() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %e : f32[4] = exp(%x)
          %y : f32[4] = mul(%e, %e)
          return %y
        }
        """)
    assert matches(op("mul", op("exp", var("x")), op("exp", var("x"))), g, "y") == []
    shared = op("exp", var("x"), bind="e")
    ms = matches(op("mul", shared, shared), g, "y")
    assert ms and all([n.name for n in m.matched] == ["y", "e"] for m in ms)

    engine = RewriteEngine([Rule("unnamed", op("mul", op("exp", var("x")), op("exp", var("x"))),
                                 lambda b, m: b.op("abs", [m["x"]]))])
    engine.run(g)
    assert "name the sub-pattern to share it" in engine.explain("unnamed")


# --- any_of, opt, const, where -------------------------------------------------------------


def test_any_of_tries_each_alternative() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %e : f32[4] = exp(%x)
          %n : f32[4] = neg(%x)
          %s : f32[4] = sigmoid(%x)
          return %e, %n, %s
        }
        """)
    p = any_of(op("exp", var("a")), op("neg", var("a")))
    assert [m["a"].name for m in matches(p, g, "e")] == ["x"]
    assert [m["a"].name for m in matches(p, g, "n")] == ["x"]
    assert matches(p, g, "s") == []
    [m, m2] = matches(any_of(op("exp", var("a")), var("a")), g, "e")  # both alternatives yield, in order
    assert (m["a"].name, m2["a"].name) == ("x", "e")


def test_opt_wrapping_node_present_and_absent() -> None:
    g = graph("""
        graph main(%x : f16[4], %z : f32[4]) {
          %c : f32[4] = cast[dtype=f32](%x)
          %a : f32[4] = neg(%c)
          %b : f32[4] = neg(%z)
          return %a, %b
        }
        """)
    p = op("neg", opt("cast", var("v"), bind="cast"))
    first, *rest = matches(p, g, "a")
    assert first["v"].name == "x" and first["cast"].name == "c"
    assert [n.name for n in first.matched] == ["a", "c"]
    assert [m["v"].name for m in rest] == ["c"]  # without the optional node: %v is the cast itself
    [m] = matches(p, g, "b")
    assert m["v"].name == "z" and "cast" not in m.values
    assert [n.name for n in m.matched] == ["b"]


CONST_GRAPH = """
    graph main(%x : f32[4]) {
      const @c : f32[]
      %y : f32[4] = mul(%x, @c)
      return %y
    }
    """


@pytest.mark.parametrize(("tol", "hits"), [(1e-3, 1), (1e-4, 0)])
def test_const_value_within_tolerance(tol: float, hits: int) -> None:
    g = graph(CONST_GRAPH, c=torch.tensor(1.0005))
    assert len(matches(op("mul", var("a"), const(value=1.0, tol=tol)), g, "y")) == hits


def test_const_value_default_tolerance_is_tight() -> None:
    assert matches(op("mul", var("a"), const(value=1.0)), graph(CONST_GRAPH, c=torch.tensor(1.0 + 1e-5)), "y") == []
    assert len(matches(op("mul", var("a"), const(value=1.0)), graph(CONST_GRAPH, c=torch.tensor(1.0)), "y")) == 1


def test_const_value_never_inspects_a_big_constant() -> None:
    # Over 64 elements a constant is a weight, not a scalar to compare, even in memory.
    g = graph("""
        graph main(%x : f32[65]) {
          const @c : f32[65]
          %y : f32[65] = mul(%x, @c)
          return %y
        }
        """, c=torch.ones(65))
    assert matches(op("mul", var("a"), const(value=1.0)), g, "y") == []


def test_const_value_never_reads_a_file_backed_weight() -> None:
    g = graph(CONST_GRAPH)
    src = FileBacked(torch.tensor(1.0))
    g.constants["c"].const = src
    assert matches(op("mul", var("a"), const(value=1.0)), g, "y") == []
    assert src.loads == 0
    # Without a value the constant matches whatever its source.
    [m] = matches(op("mul", var("a"), const("k")), g, "y")
    assert m["k"].name == "c" and src.loads == 0


def test_const_value_without_data_does_not_match() -> None:
    g = graph(CONST_GRAPH)  # parsed: MissingSource, not in memory
    assert matches(op("mul", var("a"), const(value=1.0)), g, "y") == []
    assert len(matches(op("mul", var("a"), const()), g, "y")) == 1


def test_const_rejects_a_non_constant() -> None:
    g = graph(SQUARES)
    assert matches(op("mul", var("a"), const()), g, "xy") == []
    engine = RewriteEngine([Rule("by-const", op("mul", var("a"), const()), lambda b, m: m["a"])])
    engine.run(g)
    assert "is not a constant" in engine.explain("by-const")


def test_where_predicates_check_shapes() -> None:
    g = graph("""
        graph main(%x : f32[2,4], %v : f32[4]) {
          %a : f32[2,4] = exp(%x)
          %b : f32[4] = exp(%v)
          return %a, %b
        }
        """)
    p = op("exp", var("t", lambda v: v.type.rank == 2))
    assert len(matches(p, g, "a")) == 1 and matches(p, g, "b") == []
    q = op("exp", var("t"), where=lambda n: n.outputs[0].type.shape == (4,))
    assert matches(q, g, "a") == [] and len(matches(q, g, "b")) == 1

    g = graph("""
        graph main(%v : f32[4]) {
          %b : f32[4] = exp(%v)
          return %b
        }
        """)
    engine = RewriteEngine([Rule("rank2", p, lambda b, m: b.op("sigmoid", [m["t"]]))])
    assert engine.run(g) is False
    assert engine.explain("rank2").endswith("then %v does not satisfy %t's condition")


def test_attribute_patterns_take_values_or_predicates_and_defaults() -> None:
    g = graph("""
        graph main(%x : f32[2,4]) {
          %a : f32[2,1] = reduce_mean[axes=[1], keepdim=true](%x)
          %b : f32[2] = reduce_mean[axes=[1]](%x)
          return %a, %b
        }
        """)
    assert len(matches(op("reduce_mean", var("x"), keepdim=True), g, "a")) == 1
    assert matches(op("reduce_mean", var("x"), keepdim=True), g, "b") == []  # the schema default, false
    assert len(matches(op("reduce_mean", var("x"), axes=lambda a: len(a) == 1), g, "b")) == 1


# --- checks and refusals ---------------------------------------------------------------------


def test_a_check_refuses_with_its_reason() -> None:
    src = """
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          return %r
        }
        """
    g = graph(src)
    rule = Rule("rsqrt", op("reciprocal", op("sqrt", var("x"))), lambda b, m: b.op("rsqrt", [m["x"]]),
                check=lambda m: "not today")
    engine = RewriteEngine([rule])
    assert engine.run(g) is False
    assert print_graph(g) == ir(src)
    s = engine.stats["rsqrt"]
    assert (s.matched, s.applied, dict(s.refused)) == (1, 0, {"not today": 1})
    assert engine.explain("rsqrt") == "rsqrt: matched 1 time(s), refused: not today (x1)"


def test_an_interior_value_used_outside_the_match_is_refused() -> None:
    src = """
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          %z : f32[4] = add(%r, %s)
          return %z
        }
        """
    g = graph(src)
    engine = RewriteEngine([rsqrt_rule()])
    assert engine.run(g) is False
    assert print_graph(g) == ir(src)
    assert dict(engine.stats["rsqrt"].refused) == {"%s is used outside the match": 1}
    assert engine.fusions == []


def test_an_interior_value_that_is_a_graph_output_is_refused() -> None:
    src = """
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          return %r, %s
        }
        """
    g = graph(src)
    engine = RewriteEngine([rsqrt_rule()])
    assert engine.run(g) is False
    assert print_graph(g) == ir(src)
    assert dict(engine.stats["rsqrt"].refused) == {"%s is used outside the match": 1}


def test_a_variable_bound_inside_the_match_does_not_break_the_graph() -> None:
    # mul(neg(%a), %b) on mul(%n, %n): %b binds %n, which the matched neg produces.
    g = graph("""
        graph main(%x : f32[4]) {
          %n : f32[4] = neg(%x)
          %y : f32[4] = mul(%n, %n)
          return %y
        }
        """)
    engine = RewriteEngine([Rule("f", op("mul", op("neg", var("a")), var("b")),
                                 lambda b, m: b.op("sub", [m["b"], m["a"]]))])
    engine.run(g)  # either refuses, or fuses and keeps %n for the new reader
    verify(g)


# --- running to a fixed point -----------------------------------------------------------------


def _abs_rules() -> list[Rule]:
    return [
        Rule("sqrt-of-square", op("sqrt", op("mul", var("x"), var("x"))), lambda b, m: b.op("abs", [m["x"]])),
        Rule("abs-of-abs", op("abs", op("abs", var("x"))), lambda b, m: b.op("abs", [m["x"]])),
    ]


def test_rules_run_to_a_fixed_point() -> None:
    # sqrt(%a * %a) -> abs(%a) = abs(abs(%x)), which only then matches abs-of-abs (in the next round:
    # the new node was not in the first round's node list).
    g = graph("""
        graph main(%x : f32[4]) {
          %a : f32[4] = abs(%x)
          %m : f32[4] = mul(%a, %a)
          %s : f32[4] = sqrt(%m)
          %e : f32[4] = exp(%s)
          return %e
        }
        """)
    engine = RewriteEngine(_abs_rules())
    assert engine.run(g) is True
    verify(g)
    assert print_graph(g) == ir("""
        graph main(%x : f32[4]) {
          %s : f32[4] = abs(%x)
          %e : f32[4] = exp(%s)
          return %e
        }
        """)
    counts = {k: (s.matched, s.applied, dict(s.refused)) for k, s in engine.stats.items()}
    assert counts == {"sqrt-of-square": (1, 1, {}), "abs-of-abs": (1, 1, {})}
    assert engine.fusions == [Fusion("sqrt-of-square", ("s",), ("s", "m")), Fusion("abs-of-abs", ("s",), ("s", "a"))]
    # A second run finds nothing to do.
    assert engine.run(g) is False
    assert engine.stats["abs-of-abs"].applied == 1


def test_every_site_is_rewritten_and_counted() -> None:
    g = graph("""
        graph main(%x : f32[4], %y : f32[4]) {
          %sx : f32[4] = sqrt(%x)
          %rx : f32[4] = reciprocal(%sx)
          %sy : f32[4] = sqrt(%y)
          %ry : f32[4] = reciprocal(%sy)
          return %rx, %ry
        }
        """)
    engine = RewriteEngine([rsqrt_rule()])
    assert engine.run(g) is True
    assert (engine.stats["rsqrt"].matched, engine.stats["rsqrt"].applied) == (2, 2)
    assert print_graph(g) == ir("""
        graph main(%x : f32[4], %y : f32[4]) {
          %rx : f32[4] = rsqrt(%x)
          %ry : f32[4] = rsqrt(%y)
          return %rx, %ry
        }
        """)


def test_a_rule_that_never_settles_is_an_internal_error() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %n : f32[4] = neg(%x)
          return %n
        }
        """)
    forever = Rule("renew", op("neg", var("x")), lambda b, m: b.op("neg", [m["x"]]))
    with pytest.raises(InternalError, match="did not reach a fixed point"):
        RewriteEngine([forever], max_rounds=3).run(g)


# --- explain ---------------------------------------------------------------------------------


def test_explain_names_the_best_partial_match() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %n : f32[4] = neg(%x)
          %a : f32[4] = abs(%x)
          %r : f32[4] = reciprocal(%n)
          return %r, %a
        }
        """)
    engine = RewriteEngine([rsqrt_rule()])
    engine.run(g)
    assert engine.stats["rsqrt"].matched == 0
    # The deepest attempt (at %r) got past reciprocal and failed at its operand, not the root
    # failures at %n or %a.
    assert engine.explain("rsqrt").endswith("then expected sqrt at %n, found neg")
    assert engine.explain("nonesuch") == "nonesuch: never run"


def test_explain_counts_the_nodes_the_best_partial_match_covered() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %n : f32[4] = neg(%x)
          %r : f32[4] = reciprocal(%n)
          return %r
        }
        """)
    engine = RewriteEngine([rsqrt_rule()])
    engine.run(g)
    assert engine.explain("rsqrt") == \
        "rsqrt: best partial match covered 1 node(s), then expected sqrt at %n, found neg"


def test_explain_of_an_applied_rule() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          return %r
        }
        """)
    engine = RewriteEngine([rsqrt_rule()])
    engine.run(g)
    assert engine.explain("rsqrt") == "rsqrt: applied 1 time(s)"


# --- graph outputs, names and provenance ----------------------------------------------------------


def test_a_graph_output_root_keeps_its_name() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %out : f32[4] = reciprocal(%s)
          return %out
        }
        """)
    engine = RewriteEngine([rsqrt_rule()])
    engine.run(g)
    assert print_graph(g) == ir("""
        graph main(%x : f32[4]) {
          %out : f32[4] = rsqrt(%x)
          return %out
        }
        """)
    assert engine.fusions == [Fusion("rsqrt", ("out",), ("out", "s"))]


def test_an_interior_value_read_by_two_matches_blocks_both() -> None:
    src = """
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = neg(%a)
          %c : f32[4] = neg(%a)
          %d : f32[4] = add(%b, %c)
          return %d
        }
        """
    g = graph(src)
    engine = RewriteEngine([Rule("neg-neg", op("neg", op("neg", var("x"))), lambda b, m: m["x"])])
    assert engine.run(g) is False
    assert print_graph(g) == ir(src)
    assert dict(engine.stats["neg-neg"].refused) == {"%a is used outside the match": 2}


def test_a_graph_output_root_keeps_a_node_of_its_own() -> None:
    # neg(neg(%x)) -> %x would make the graph return its input under another name: refused.
    src = """
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = neg(%a)
          return %b
        }
        """
    g = graph(src)
    engine = RewriteEngine([Rule("neg-neg", op("neg", op("neg", var("x"))), lambda b, m: m["x"])])
    assert engine.run(g) is False
    assert dict(engine.stats["neg-neg"].refused) == \
        {"the root is a graph output and the rewrite gives an existing value": 1}
    assert print_graph(g) == ir(src)


def test_a_rewrite_to_an_existing_value_inside_the_graph() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %a : f32[4] = neg(%x)
          %b : f32[4] = neg(%a)
          %d : f32[4] = exp(%b)
          return %d
        }
        """)
    engine = RewriteEngine([Rule("neg-neg", op("neg", op("neg", var("x"))), lambda b, m: m["x"])])
    assert engine.run(g) is True
    assert print_graph(g) == ir("""
        graph main(%x : f32[4]) {
          %d : f32[4] = exp(%x)
          return %d
        }
        """)
    assert engine.fusions == [Fusion("neg-neg", (), ("b", "a"))]


def test_provenance_lists_created_and_replaced_nodes() -> None:
    g = graph("""
        graph main(%x : f32[4], %w : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          %y : f32[4] = mul(%r, %w)
          return %y
        }
        """)
    rule = Rule("scaled-rsqrt", op("mul", op("reciprocal", op("sqrt", var("x"))), var("w")),
                lambda b, m: b.op("mul", [b.op("rsqrt", [m["x"]], name="inv"), m["w"]]))
    engine = RewriteEngine([rule])
    engine.run(g)
    verify(g)
    assert print_graph(g) == ir("""
        graph main(%x : f32[4], %w : f32[4]) {
          %inv : f32[4] = rsqrt(%x)
          %y : f32[4] = mul(%inv, %w)
          return %y
        }
        """)
    assert engine.fusions == [Fusion("scaled-rsqrt", ("inv", "y"), ("y", "r", "s"))]


def test_a_rewrite_of_the_wrong_type_is_refused_and_undone() -> None:
    g = graph("""
        graph main(%x : f32[4]) {
          %s : f32[4] = sqrt(%x)
          %r : f32[4] = reciprocal(%s)
          return %r
        }
        """)
    bad = Rule("bad", op("reciprocal", op("sqrt", var("x"))),
               lambda b, m: b.op("reduce_sum", [m["x"]], {"axes": (0,)}))
    before = str(g)
    engine = RewriteEngine([bad])
    assert not engine.run(g)
    assert str(g) == before  # the nodes the rewrite built are gone again
    assert engine.stats["bad"].refused == {"the rewrite would change f32[4] into f32[]": 1}
