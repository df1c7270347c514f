"""Tests for the IR core: def-use editing, the textual form and the verifier.

Graphs are built through the API or written as text; every text in this file is
checked to round-trip: `parse(print(g)) == g` and `print(parse(text)) == text`.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npuc.errors import InternalError, NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, get_op, parse_graph, print_graph, verify
from npuc.ir.verifier import collect_problems


def f32(*shape: int, fmt: str = "ND") -> TensorType:
    return TensorType(shape, DType.f32, fmt)


def roundtrip(text: str) -> Graph:
    """Parse `text`, check it prints back verbatim, and return the graph."""
    g = parse_graph(text)
    assert print_graph(g) == text
    assert parse_graph(print_graph(g)) == g
    return g


def typed_node(g: Graph, op: str, inputs: list, attrs: dict | None = None, names=None):
    """Add a node whose output types come from the op's shape rule."""
    outs = get_op(op).infer_types([v.type for v in inputs], attrs or {})
    return g.add_node(op, inputs, outs, attrs, names=names)


# --- def-use through the API -------------------------------------------------------


def test_add_node_registers_uses_in_operand_order() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    y = g.add_input("y", f32(4))
    sq = g.add_node("mul", [x, x], [f32(4)], names="sq")
    s = g.add_node("add", [sq.output, y], [f32(4)], names="s")
    assert x.uses == [(sq, 0), (sq, 1)]
    assert x.users() == [sq]  # one user, used twice
    assert y.uses == [(s, 1)]
    assert sq.output.uses == [(s, 0)]
    assert sq.output.producer is sq and sq.output.index == 0
    assert x.is_input and not x.is_const and sq.output.ref() == "%sq"
    assert [n.name for n in g.nodes] == ["sq", "s"]


def test_node_names_are_made_unique() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    a = g.add_node("neg", [x], [f32(4)])
    b = g.add_node("neg", [x], [f32(4)])
    c = g.add_node("neg", [x], [f32(4)], names="x")  # clashes with the input
    assert [a.name, b.name, c.name] == ["neg", "neg_1", "x_2"]
    s = g.add_node("split", [x], [f32(2), f32(2)], {"axis": 0, "sizes": (2, 2)}, names="part")
    assert [o.name for o in s.outputs] == ["part_0", "part_1"]
    with pytest.raises(InternalError):
        s.output  # noqa: B018  (a multi-output node has no single output)


def test_add_node_before() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    b = g.add_node("exp", [x], [f32(4)], names="b")
    a = g.add_node("neg", [x], [f32(4)], names="a", before=b)
    assert g.nodes == [a, b]


def test_duplicate_input_and_foreign_value_are_internal_errors() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    with pytest.raises(InternalError, match="duplicate"):
        g.add_input("x", f32(4))
    other = Graph("other")
    y = other.add_input("y", f32(4))
    with pytest.raises(InternalError, match="another graph"):
        g.add_node("add", [x, y], [f32(4)])


def test_constants_get_fresh_names() -> None:
    g = Graph()
    a = g.add_constant("w", f32(2), TensorSource(torch.zeros(2)))
    b = g.add_constant("w", f32(2), TensorSource(torch.ones(2)))
    assert (a.name, b.name) == ("w", "w_1")
    assert list(g.constants) == ["w", "w_1"] and b.ref() == "@w_1" and b.is_const
    assert torch.equal(b.const.load(), torch.ones(2))


def test_replace_all_uses_with() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    a = g.add_node("neg", [x], [f32(4)], names="a")
    b = g.add_node("exp", [x], [f32(4)], names="b")
    u = g.add_node("add", [a.output, a.output], [f32(4)], names="u")
    g.set_outputs([a.output, u.output])
    g.replace_all_uses_with(a.output, b.output)
    assert a.output.uses == []
    assert b.output.uses == [(u, 0), (u, 1)]
    assert u.inputs == [b.output, b.output]
    assert g.outputs == [b.output, u.output]
    g.replace_all_uses_with(b.output, b.output)  # a no-op, not a self-loop
    assert b.output.uses == [(u, 0), (u, 1)]
    g.remove_node(a)
    verify(g)
    assert str(g) == (
        "graph main(%x : f32[4]) {\n"
        "  %b : f32[4] = exp(%x)\n"
        "  %u : f32[4] = add(%b, %b)\n"
        "  return %b, %u\n"
        "}\n"
    )


def test_remove_node_refuses_a_used_node() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    a = g.add_node("neg", [x], [f32(4)], names="a")
    b = g.add_node("exp", [a.output], [f32(4)], names="b")
    g.set_outputs([b.output])
    with pytest.raises(InternalError, match="still used"):
        g.remove_node(a)  # b reads it
    with pytest.raises(InternalError, match="still used"):
        g.remove_node(b)  # a graph output
    assert g.nodes == [a, b] and a.output.uses == [(b, 0)]  # nothing half-done
    g.set_outputs([x])
    g.remove_node(b)
    assert a.output.uses == []
    g.remove_node(a)
    assert g.nodes == [] and x.uses == []
    assert g.fresh_name("a") == "a"  # the name is free again
    verify(g)


def test_remove_constant_refuses_a_used_constant() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    w = g.add_constant("w", f32(4), TensorSource(torch.ones(4)))
    n = g.add_node("mul", [x, w], [f32(4)])
    g.set_outputs([n.output])
    with pytest.raises(InternalError):
        g.remove_constant(w)
    n.set_input(1, x)
    g.remove_constant(w)
    assert g.constants == {}


def test_set_input() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    y = g.add_input("y", f32(4))
    n = g.add_node("add", [x, x], [f32(4)])
    g.set_outputs([n.output])
    n.set_input(1, y)
    assert n.inputs == [x, y]
    assert x.uses == [(n, 0)] and y.uses == [(n, 1)]
    n.set_input(0, y)
    assert x.uses == [] and y.uses == [(n, 1), (n, 0)]
    verify(g)


def test_rename() -> None:
    g = Graph()
    x = g.add_input("x", f32(4))
    w = g.add_constant("w", f32(4), TensorSource(torch.ones(4)))
    n = g.add_node("mul", [x, w], [f32(4)])
    g.set_outputs([n.output])
    g.rename(n.output, "logits")
    g.rename(w, "lm_head.weight")
    with pytest.raises(InternalError):
        g.rename(x, "logits")
    assert list(g.constants) == ["lm_head.weight"]
    assert "%logits : f32[4] = mul(%x, @lm_head.weight)" in str(g)
    verify(g)


# --- printing ----------------------------------------------------------------------


def test_print_small_graph_exactly() -> None:
    g = Graph("tiny")
    x = g.add_input("x", f32(2, 4))
    w = g.add_constant("model.norm.weight", f32(4), TensorSource(torch.ones(4)))
    m = g.add_node("mul", [x, w], [f32(2, 4)], names="m")
    s = g.add_node("split", [m.output], [f32(2, 1), f32(2, 3)], {"sizes": (1, 3), "axis": -1}, names="part")
    r = g.add_node("reduce_sum", [s.outputs[1]], [f32(2)], {"axes": (1,)}, names="r")
    g.set_outputs([r.output, s.outputs[0]])
    verify(g)
    assert print_graph(g) == (
        "graph tiny(%x : f32[2,4]) {\n"
        "  const @model.norm.weight : f32[4]\n"
        "  %m : f32[2,4] = mul(%x, @model.norm.weight)\n"
        "  %part_0 : f32[2,1], %part_1 : f32[2,3] = split[axis=-1, sizes=[1,3]](%m)\n"
        "  %r : f32[2] = reduce_sum[axes=[1]](%part_1)\n"
        "  return %r, %part_0\n"
        "}\n"
    )
    g2 = parse_graph(print_graph(g))
    assert g2 == g
    verify(g2)


# --- round trips -------------------------------------------------------------------

ROUNDTRIP_TEXTS = {
    "multi_output_split": (
        "graph main(%x : f32[1,16,64]) {\n"
        "  %q : f32[1,16,32], %k : f32[1,16,32] = split[axis=-1, sizes=[32,32]](%x)\n"
        "  %s : f32[1,16,32] = add(%q, %k)\n"
        "  return %s, %k\n"
        "}\n"
    ),
    "quoted_names": (
        'graph "my-model"(%"x:0" : f32[2,3], %attention_mask : i64[1,3]) {\n'
        '  const @"onnx::MatMul_42" : f32[3,3]\n'
        '  %"/model/layers.0/Add_output_0" : f32[2,3] = add(%"x:0", %"x:0")\n'
        '  %"/model/MatMul_output_0" : f32[2,3] = matmul(%"/model/layers.0/Add_output_0", @"onnx::MatMul_42")\n'
        '  return %"/model/MatMul_output_0"\n'
        "}\n"
    ),
    "constants_with_dots_and_formats": (
        "graph main(%x : f32[1,2]{NCHW}, %ids : i64[1,16]) {\n"
        "  const @model.embed_tokens.weight : bf16[128,64]\n"
        "  const @model.layers.0.input_layernorm.weight : f16[64]\n"
        "  const @scalar : f32[]\n"
        "  %e : bf16[1,16,64] = gather(@model.embed_tokens.weight, %ids)\n"
        "  %n : f32[1,2]{NCHW} = neg(%x)\n"
        "  return %e, %n, @scalar\n"
        "}\n"
    ),
    "every_attribute_kind": (
        "graph main(%x : f32[4]) {\n"
        '  %y : f32[4] = attr_zoo[b_false=false, b_true=true, dt=bf16, empty=[], eps=1e-06, '
        'fl=[0.5,-1.5,1e-06,2.0], huge=1e+20, i=3, ints=[1,-2,3], lo=-inf, n=nan, neg=-7, '
        'nothing=none, pos_inf=inf, s="say \\"hi\\"\\\\n\\ttab \\u00e9", zero=-0.0](%x)\n'
        "  return %y\n"
        "}\n"
    ),
    "no_inputs_no_nodes": "graph empty() {\n  return \n}\n",
    "zero_output_node_and_source": (
        "graph main() {\n"
        "  %r : i64[16] = arange[dtype=i64, end=16, start=0, step=1]()\n"
        "  side_effect(%r)\n"
        "  return %r\n"
        "}\n"
    ),
}


@pytest.mark.parametrize("name", sorted(ROUNDTRIP_TEXTS))
def test_text_roundtrip(name: str) -> None:
    roundtrip(ROUNDTRIP_TEXTS[name])


def test_parsed_attribute_values() -> None:
    g = roundtrip(ROUNDTRIP_TEXTS["every_attribute_kind"])
    a = dict(g.nodes[0].attrs)
    assert math.isnan(a.pop("n"))
    assert math.copysign(1.0, a.pop("zero")) == -1.0
    assert a == {
        "b_true": True, "b_false": False, "dt": DType.bf16, "empty": (), "eps": 1e-06,
        "fl": (0.5, -1.5, 1e-06, 2.0), "huge": 1e20, "i": 3, "ints": (1, -2, 3), "lo": -math.inf,
        "neg": -7, "nothing": None, "pos_inf": math.inf, "s": 'say "hi"\\n\ttab \u00e9',
    }
    assert type(a["i"]) is int and type(a["fl"][3]) is float and type(a["b_true"]) is bool


def test_parsed_names_and_types() -> None:
    g = roundtrip(ROUNDTRIP_TEXTS["quoted_names"])
    assert g.name == "my-model"
    assert [v.name for v in g.inputs] == ["x:0", "attention_mask"]
    assert list(g.constants) == ["onnx::MatMul_42"]
    assert g.nodes[0].output.name == "/model/layers.0/Add_output_0"
    assert g.nodes[0].inputs == [g.inputs[0], g.inputs[0]]
    verify(g)
    g = roundtrip(ROUNDTRIP_TEXTS["constants_with_dots_and_formats"])
    assert g.inputs[0].type == TensorType((1, 2), DType.f32, "NCHW")
    assert g.constants["scalar"].type == TensorType((), DType.f32)
    verify(g)


def test_api_graph_with_every_attribute_kind_roundtrips() -> None:
    g = Graph("zoo")
    x = g.add_input("x:0", f32(4))
    attrs = {
        "i": 0, "neg": -1, "eps": 1e-06, "lo": -math.inf, "n": math.nan, "t": True, "f": False, "none": None,
        "s": 'a "quoted" \\ back\nslash', "dt": DType.i8, "ints": (0, -1), "empty": (), "fl": (1e-06, -2.5),
        "tiny": 5e-324, "strs": ("a", "b"),
    }
    n = g.add_node("attr_zoo", [x], [f32(4)], attrs, names="/out/y:0")
    g.set_outputs([n.output])
    text = print_graph(g)
    g2 = parse_graph(text)
    assert g2 == g and print_graph(g2) == text
    back = dict(g2.nodes[0].attrs)
    assert math.isnan(back.pop("n")) and math.isnan(attrs.pop("n"))
    assert back == attrs


def test_graph_name_starting_with_digit_roundtrips() -> None:
    g = Graph("2layer_mlp")
    g.set_outputs([g.add_input("x", f32(2))])
    assert parse_graph(print_graph(g)) == g


# --- parse errors ------------------------------------------------------------------

LINE_COL = re.compile(r"\b(\d+):(\d+)\b")

PARSE_ERRORS = {
    "undefined_value": (
        "graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%y)\n  return %a\n}\n", "undefined value %y", 2),
    "undefined_output": ("graph main(%x : f32[1]) {\n  return %nope\n}\n", "undefined value %nope", None),
    "duplicate_definition": (
        "graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%x)\n  %a : f32[1] = exp(%x)\n  return %a\n}\n",
        "defined twice", None),
    "bad_dtype": ("graph main(%x : f31[1]) {\n  return %x\n}\n", "expected a dtype", 1),
    "bad_dimension": ("graph main(%x : f32[1.5]) {\n  return %x\n}\n", "integer dimension", 1),
    "garbage_character": ("graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%x) $$\n  return %a\n}\n",
                          "unexpected character", 2),
    "garbage_start": ("hello world", "expected 'graph'", 1),
    "truncated": ("graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%x)\n", "end of input", 2),
    "trailing_text": ("graph main(%x : f32[1]) {\n  return %x\n}\nextra", "trailing text", 4),
    "bad_attribute": ("graph main(%x : f32[1]) {\n  %a : f32[1] = neg[k=(](%x)\n  return %a\n}\n",
                      "bad attribute value", 2),
}


@pytest.mark.parametrize("name", sorted(PARSE_ERRORS))
def test_parse_errors_name_line_and_column(name: str) -> None:
    text, what, line = PARSE_ERRORS[name]
    with pytest.raises(NpucError) as info:
        parse_graph(text)
    err = info.value
    assert err.code == "NPUC-E0201"
    assert what in err.message
    m = LINE_COL.search(err.message)
    assert m, err.message
    if line is not None:
        assert int(m.group(1)) == line, err.message


def test_duplicate_definition_points_at_its_line() -> None:
    text = "graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%x)\n  %a : f32[1] = exp(%x)\n  return %a\n}\n"
    with pytest.raises(NpucError, match=r"at 3:3:"):
        parse_graph(text)


@pytest.mark.parametrize("text, where", [
    ("graph main(%x : f32[1]) {\n  %a : f32[1] = neg(%y)\n  return %a\n}\n", "2:21"),  # reported 2:23
    ("graph main(%x : f32[1]) {\n  return %nope\n}\n", "2:10"),  # reported 3:1
], ids=["operand", "return_value"])
def test_undefined_value_points_at_the_reference(text: str, where: str) -> None:
    with pytest.raises(NpucError, match=f"at {where}:"):
        parse_graph(text)


def test_duplicate_input_is_a_parse_error() -> None:
    with pytest.raises(NpucError):
        parse_graph("graph main(%x : f32[1], %x : f32[1]) {\n  return %x\n}\n")


@pytest.mark.parametrize("text", [
    "graph main() {\n  const @w : f32[1]\n  const @w : f32[1]\n  return @w\n}\n",
    "graph main(%w : f32[1]) {\n  const @w : f32[1]\n  return @w\n}\n",
], ids=["const_twice", "const_named_like_input"])
def test_duplicate_constant_is_a_parse_error(text: str) -> None:
    with pytest.raises(NpucError, match="defined twice"):
        parse_graph(text)


# --- verifier ----------------------------------------------------------------------


def _valid() -> tuple[Graph, dict]:
    g = Graph()
    x = g.add_input("x", f32(2, 3))
    w = g.add_constant("w", f32(3), TensorSource(torch.ones(3)))
    a = typed_node(g, "mul", [x, w], names="a")
    b = typed_node(g, "softmax", [a.output], {"axis": -1}, names="b")
    c = typed_node(g, "add", [a.output, b.output], names="c")
    g.set_outputs([c.output])
    return g, {"x": x, "w": w, "a": a, "b": b, "c": c}


def test_verifier_accepts_a_valid_graph() -> None:
    g, _ = _valid()
    assert collect_problems(g) == []
    verify(g)


def _wrong_output_type(g: Graph, v: dict) -> None:
    g.add_node("add", [v["x"], v["x"]], [f32(3, 2)], names="bad")


def _unknown_op(g: Graph, v: dict) -> None:
    g.add_node("frobnicate", [v["x"]], [f32(2, 3)], names="bad")


def _unknown_attr(g: Graph, v: dict) -> None:
    g.add_node("neg", [v["x"]], [f32(2, 3)], {"alpha": 1.0}, names="bad")


def _missing_attr(g: Graph, v: dict) -> None:
    g.add_node("softmax", [v["x"]], [f32(2, 3)], names="bad")


def _attr_of_wrong_kind(g: Graph, v: dict) -> None:
    g.add_node("softmax", [v["x"]], [f32(2, 3)], {"axis": "last"}, names="bad")


def _wrong_arity(g: Graph, v: dict) -> None:
    g.add_node("neg", [v["x"], v["x"]], [f32(2, 3)], names="bad")


def _shape_rule_refuses(g: Graph, v: dict) -> None:
    g.add_node("reshape", [v["x"]], [f32(7)], {"shape": (7,)}, names="bad")


def _use_before_def(g: Graph, v: dict) -> None:
    g.nodes[:] = [v["b"], v["a"], v["c"]]


def _corrupt_use_list(g: Graph, v: dict) -> None:
    v["x"].uses.clear()


def _stale_use(g: Graph, v: dict) -> None:
    v["w"].uses.append((v["c"], 0))


def _duplicate_names(g: Graph, v: dict) -> None:
    v["b"].output.name = "a"


def _output_not_defined(g: Graph, v: dict) -> None:
    other = Graph()
    g.set_outputs([other.add_input("ghost", f32(2, 3))])


def _backpointer_broken(g: Graph, v: dict) -> None:
    v["a"].output.index = 1


VERIFIER_CASES = {
    "wrong_output_type": (_wrong_output_type, "the shape rule infers ['f32[2,3]']"),
    "unknown_op": (_unknown_op, "bad = frobnicate: unknown op"),
    "unknown_attr": (_unknown_attr, "unknown attribute 'alpha'"),
    "missing_attr": (_missing_attr, "missing attribute 'axis'"),
    "attr_of_wrong_kind": (_attr_of_wrong_kind, "attribute axis='last' is not a int"),
    "wrong_arity": (_wrong_arity, "takes ('x',), got 2 operands"),
    "shape_rule_refuses": (_shape_rule_refuses, "cannot reshape"),
    "use_before_def": (_use_before_def, "operand 0 %a is used before it is defined"),
    "corrupt_use_list": (_corrupt_use_list, "%x: use list does not match its operands"),
    "stale_use": (_stale_use, "@w: use list does not match its operands"),
    "duplicate_names": (_duplicate_names, "name 'a' defined twice"),
    "output_not_defined": (_output_not_defined, "graph output %ghost is not defined"),
    "backpointer_broken": (_backpointer_broken, "does not point back to its node"),
}


@pytest.mark.parametrize("name", sorted(VERIFIER_CASES))
def test_verifier_catches(name: str) -> None:
    corrupt, expected = VERIFIER_CASES[name]
    g, v = _valid()
    corrupt(g, v)
    problems = collect_problems(g)
    assert any(expected in p for p in problems), problems
    with pytest.raises(InternalError, match="fails verification"):
        verify(g)


# --- property: random graphs verify and round-trip ---------------------------------

_UNARY = ["neg", "exp", "tanh", "relu", "sigmoid", "abs"]
_BINARY = ["add", "mul", "sub", "maximum", "minimum"]
_NAMES = st.one_of(
    st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True),
    st.from_regex(r"/[a-z]{1,3}\.[0-9]/[A-Za-z]{1,4}_output_[0-9]", fullmatch=True),
    st.from_regex(r"[a-z]{1,3}:[0-9]", fullmatch=True),
)


@st.composite
def random_graphs(draw: st.DrawFn) -> Graph:
    g = Graph(draw(st.sampled_from(["main", "m.0", "my model"])))
    shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
    for i in range(draw(st.integers(1, 3))):
        g.add_input(f"in{i}", f32(*draw(shapes)))
    if draw(st.booleans()):
        shape = draw(shapes)
        g.add_constant("model.w", f32(*shape), TensorSource(torch.zeros(shape)))
    values = list(g.inputs) + list(g.constants.values())
    for _ in range(draw(st.integers(1, 8))):
        a = draw(st.sampled_from(values))
        kind = draw(st.sampled_from(["unary", "binary", "reshape", "transpose", "concat"]))
        name = draw(_NAMES)
        if kind == "unary":
            node = typed_node(g, draw(st.sampled_from(_UNARY)), [a], names=name)
        elif kind == "binary":
            # any value whose shape broadcasts with a's, or a itself; or a size-1 broadcast
            fits = [v for v in values if v.type.shape in (a.type.shape, a.type.shape[1:], (1,))]
            node = typed_node(g, draw(st.sampled_from(_BINARY)), [a, draw(st.sampled_from(fits))], names=name)
        elif kind == "reshape":
            shape = draw(st.sampled_from([(a.type.numel,), (1,) + a.type.shape, a.type.shape[::-1]]))
            node = typed_node(g, "reshape", [a], {"shape": shape}, names=name)
        elif kind == "transpose":
            perm = tuple(draw(st.permutations(range(a.type.rank))))
            node = typed_node(g, "transpose", [a], {"perm": perm}, names=name)
        else:
            axis = draw(st.integers(-a.type.rank, a.type.rank - 1))
            ax = axis % a.type.rank
            fits = [v for v in values
                    if v.type.rank == a.type.rank
                    and all(v.type.shape[i] == a.type.shape[i] for i in range(a.type.rank) if i != ax)]
            operands = [a] + draw(st.lists(st.sampled_from(fits), min_size=0, max_size=2))
            node = typed_node(g, "concat", operands, {"axis": axis}, names=name)
        values.extend(node.outputs)
    produced = [o for n in g.nodes for o in n.outputs]
    g.set_outputs(draw(st.lists(st.sampled_from(produced), min_size=1, max_size=3, unique_by=id)))
    return g


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_random_graphs_verify_and_roundtrip(g: Graph) -> None:
    assert collect_problems(g) == []
    text = print_graph(g)
    g2 = parse_graph(text)
    assert print_graph(g2) == text
    assert g2 == g
    assert collect_problems(g2) == []
    assert [v.name for v in g2.values()] == [v.name for v in g.values()]
    for v2, v in zip(g2.values(), g.values(), strict=True):
        assert v2.type == v.type and len(v2.uses) == len(v.uses)


def test_byte_view_of_one_element_with_any_strides() -> None:
    # torch calls a one-element tensor contiguous whatever its strides; its bytes still come out
    from npuc.ir.graph import byte_view

    t = torch.arange(4, dtype=torch.float32)[1::2][:1].reshape(1, 1)
    assert t.stride() == (2, 2) and t.is_contiguous()
    assert byte_view(t).tolist() == list(torch.tensor([1.0]).view(torch.uint8).tolist())
