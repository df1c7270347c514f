"""The verifier: run after every pass in tests and under `--debug`.

Checks that use lists mirror the operands, that the node list is in topological
order, that names are unique, that every op is declared with valid attributes
and arity, and that every output type is what the op's shape rule infers.
"""

from __future__ import annotations

from npuc.errors import InternalError
from npuc.ir.graph import Graph, Value
from npuc.ir.ops import ShapeError
from npuc.ir.registry import all_ops


def verify(g: Graph) -> None:
    problems = collect_problems(g)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InternalError(f"graph {g.name!r} fails verification:\n  {shown}{more}")


def collect_problems(g: Graph) -> list[str]:
    ops = all_ops()
    problems: list[str] = []
    defined: set[int] = set()
    names: set[str] = set()

    def define(v: Value, where: str) -> None:
        if v.graph is not g:
            problems.append(f"{where}: {v.ref()} belongs to another graph")
        if v.name in names:
            problems.append(f"{where}: name {v.name!r} defined twice")
        names.add(v.name)
        defined.add(id(v))

    for v in g.inputs:
        if v.producer is not None or v.const is not None:
            problems.append(f"input {v.ref()} has a producer or data")
        define(v, "input")
    for name, st in g.states.items():
        if not st.state or st.producer is not None or st.const is not None or st.name != name:
            problems.append(f"state {name!r} is malformed")
        define(st, "state")
    for name, c in g.constants.items():
        if c.const is None or c.name != name:
            problems.append(f"constant {name!r} is malformed")
        define(c, "constant")

    expected_uses: dict[int, list[tuple[int, int]]] = {}
    for node in g.nodes:
        where = f"{node.name} = {node.op}"
        for i, v in enumerate(node.inputs):
            if id(v) not in defined:
                problems.append(f"{where}: operand {i} {v.ref()} is used before it is defined")
            expected_uses.setdefault(id(v), []).append((id(node), i))
        od = ops.get(node.op)
        if od is None:
            problems.append(f"{where}: unknown op")
        else:
            if not od.arity_ok(len(node.inputs)):
                problems.append(f"{where}: takes {od.inputs}, got {len(node.inputs)} operands")
            bad = od.check_attrs(node.attrs)
            problems += [f"{where}: {b}" for b in bad]
            if od.inplace is not None and od.inplace < len(node.inputs):
                target = node.inputs[od.inplace]
                if not target.state or len(target.uses) != 1:
                    problems.append(f"{where}: writes operand {od.inplace} in place, which must be a state "
                                    "read by nothing else")
            if not bad and od.arity_ok(len(node.inputs)):
                try:
                    inferred = od.infer_types([v.type for v in node.inputs], node.attrs)
                except ShapeError as e:
                    problems.append(f"{where}: {e}")
                else:
                    got = [o.type for o in node.outputs]
                    if inferred != got:
                        problems.append(
                            f"{where}: outputs typed {[str(t) for t in got]}, "
                            f"the shape rule infers {[str(t) for t in inferred]}")
        for j, out in enumerate(node.outputs):
            if out.producer is not node or out.index != j:
                problems.append(f"{where}: output {j} does not point back to its node")
            define(out, where)

    for v in g.values():
        have = sorted((id(n), i) for n, i in v.uses)
        if have != sorted(expected_uses.get(id(v), [])):
            problems.append(f"{v.ref()}: use list does not match its operands")
    for v in g.outputs:
        if id(v) not in defined:
            problems.append(f"graph output {v.ref()} is not defined")
    for name, u in g.state_updates.items():
        st = g.states.get(name)
        if st is None or id(u) not in defined or u.type != st.type:
            problems.append(f"update of state {name!r} by {u.ref()} is malformed")
    return problems
