"""The one rewrite engine behind every pattern fusion.

A rule is data: a pattern (a small graph with named variables), a check that can
refuse a match with a reason, and a rewrite that builds the replacement.

    rule = Rule(
        "rsqrt-of-sqrt",
        op("reciprocal", op("sqrt", var("x"))),
        rewrite=lambda b, m: b.op("rsqrt", [m["x"]]),
    )

Matching starts at a root value and follows producers. Variables bind consistently
(the same name must bind the same value); commutative ops try both operand orders
with backtracking; `any_of` gives alternatives, `opt(op, p)` an optional wrapping
node, `const` a constant (optionally equal to a value within a tolerance), and
`where=` predicates check shapes. A match whose interior values are used outside
the match is refused: a rule never removes a value someone else still reads.
`RewriteEngine.run` applies rules to a fixed point, counting for each rule how
often it matched, applied and was refused (and why); `explain` names the best
partial match of a rule that never fired.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from npuc.errors import InternalError
from npuc.ir import Graph, Node, TensorType, Value, get_op
from npuc.ir.ops import ShapeError
from npuc.passes.manager import Pass, PassResult

COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum", "eq", "ne", "bitwise_and", "bitwise_or",
                         "bitwise_xor"})


# -- patterns ---------------------------------------------------------------------------

class Pat:
    """Base of pattern nodes."""


@dataclass(frozen=True, eq=False)
class Var(Pat):
    name: str
    where: Callable[[Value], bool] | None = None


@dataclass(frozen=True, eq=False)
class Const(Pat):
    name: str | None = None
    value: float | None = None
    tol: float = 1e-6


@dataclass(frozen=True, eq=False)
class OpPat(Pat):
    op: str
    args: tuple[Pat, ...]
    name: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)  # value, or a predicate on the value
    where: Callable[[Node], bool] | None = None
    output: int | None = None  # for multi-output ops: which output the matched value must be


@dataclass(frozen=True, eq=False)
class AnyOf(Pat):
    alts: tuple[Pat, ...]


@dataclass(frozen=True, eq=False)
class Opt(Pat):
    """`op(inner)` or just `inner`: e.g. a cast that one exporter emits and another does not."""

    op: str
    inner: Pat
    name: str | None = None


def var(name: str, where: Callable[[Value], bool] | None = None) -> Var:
    return Var(name, where)


def const(name: str | None = None, value: float | None = None, tol: float = 1e-6) -> Const:
    return Const(name, value, tol)


def op(name: str, *args: Pat, bind: str | None = None, where: Callable[[Node], bool] | None = None,
       output: int | None = None, **attrs: Any) -> OpPat:
    return OpPat(name, tuple(args), bind, attrs, where, output)


def any_of(*alts: Pat) -> AnyOf:
    return AnyOf(tuple(alts))


def opt(name: str, inner: Pat, bind: str | None = None) -> Opt:
    return Opt(name, inner, bind)


def is_const(v: Value) -> bool:
    """A `var` predicate: a graph constant."""
    return v.is_const


def last_axis(n: Node, key: str = "axis") -> bool:
    """Whether a matched node's axis attribute (`key`, its default filled in) is its result's last."""
    rank = n.outputs[0].type.rank
    return int(get_op(n.op).full_attrs(n.attrs)[key]) % rank == rank - 1


# -- matching ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Match:
    values: Mapping[str, Value]
    nodes: Mapping[str, Node]
    matched: tuple[Node, ...]  # every node the pattern covered, root first
    vars: tuple[str, ...] = ()  # names bound by var() (not by a named op pattern)

    def __getitem__(self, name: str) -> Value:
        return self.values[name]

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def data(self, name: str) -> torch.Tensor:
        src = self.values[name].const
        if src is None:
            raise InternalError(f"{name} is not a constant")
        return src.load()

    def bind(self, values: Mapping[str, Value] | None = None, nodes: Mapping[str, Node] | None = None,
             node: Node | None = None, var: str | None = None) -> Match:
        return Match({**self.values, **(values or {})}, {**self.nodes, **(nodes or {})},
                     self.matched + ((node,) if node is not None and node not in self.matched else ()),
                     self.vars + ((var,) if var is not None else ()))


@dataclass
class _Progress:
    """The furthest any attempt got, for `explain`."""

    depth: int = -1
    message: str = "the root never matched"

    def fail(self, depth: int, message: str) -> None:
        if depth > self.depth:
            self.depth, self.message = depth, message


def _const_equals(v: Value, value: float, tol: float) -> bool:
    # Only constants already in memory are inspected: a weight is never read to be pattern-matched.
    if v.const is None or v.type.numel > 64 or not getattr(v.const, "in_memory", False):
        return False
    t = v.const.load().double()
    if value in (float("inf"), float("-inf")):
        return bool((t == value).all())
    return bool(torch.allclose(t, torch.full_like(t, value), atol=tol, rtol=0))


def _match(p: Pat, v: Value, m: Match, prog: _Progress) -> Iterator[Match]:
    depth = len(m.matched)
    if isinstance(p, Var):
        if p.name in m.values:
            if m.values[p.name] is v:
                yield m
            else:
                prog.fail(depth, f"%{p.name} is bound to {m.values[p.name].ref()}, not {v.ref()}")
            return
        if p.where is not None and not p.where(v):
            prog.fail(depth, f"{v.ref()} does not satisfy %{p.name}'s condition")
            return
        yield m.bind({p.name: v}, var=p.name)
    elif isinstance(p, Const):
        if v.const is None:
            prog.fail(depth, f"{v.ref()} is not a constant")
            return
        if p.value is not None and not _const_equals(v, p.value, p.tol):
            prog.fail(depth, f"constant {v.ref()} is not {p.value}")
            return
        if p.name is not None:
            if p.name in m.values and m.values[p.name] is not v:
                return
            yield m.bind({p.name: v})
        else:
            yield m
    elif isinstance(p, AnyOf):
        for alt in p.alts:
            yield from _match(alt, v, m, prog)
    elif isinstance(p, Opt):
        yield from _match(OpPat(p.op, (p.inner,), p.name), v, m, prog)
        yield from _match(p.inner, v, m, prog)
    elif isinstance(p, OpPat):
        n = v.producer
        if n is None or n.op != p.op:
            found = n.op if n is not None else ("a constant" if v.is_const else "a graph input")
            prog.fail(depth, f"expected {p.op} at {v.ref()}, found {found}")
            return
        if p.name is not None and p.name in m.values:
            if m.values[p.name] is v:  # the same sub-pattern reached twice (a DAG): already matched
                yield m
            else:
                prog.fail(depth, f"{p.name} is bound to {m.values[p.name].ref()}, not {v.ref()}")
            return
        if n in m.matched:
            prog.fail(depth, f"{n.op} {v.ref()} would be matched twice; name the sub-pattern to share it")
            return
        if p.output is not None and v.index != p.output:
            prog.fail(depth, f"{v.ref()} is output {v.index} of {n.op}, not {p.output}")
            return
        for k, want in p.attrs.items():
            got = n.attrs.get(k, get_op(n.op).full_attrs({}).get(k))
            if not (want(got) if callable(want) else got == want):
                prog.fail(depth, f"{n.op} {v.ref()} has {k}={got!r}")
                return
        if p.where is not None and not p.where(n):
            prog.fail(depth, f"{n.op} {v.ref()} does not satisfy the pattern's condition")
            return
        if len(n.inputs) != len(p.args):
            prog.fail(depth, f"{n.op} {v.ref()} has {len(n.inputs)} operands, the pattern {len(p.args)}")
            return
        m = m.bind({p.name: v} if p.name else None, {p.name: n} if p.name else None, node=n)
        orders = [p.args]
        if n.op in COMMUTATIVE and len(p.args) == 2:
            orders.append((p.args[1], p.args[0]))
        for order in orders:
            yield from _match_all(order, n.inputs, m, prog)
    else:
        raise InternalError(f"unknown pattern node {p!r}")


def _match_all(pats: Sequence[Pat], vals: Sequence[Value], m: Match, prog: _Progress) -> Iterator[Match]:
    if not pats:
        yield m
        return
    for m1 in _match(pats[0], vals[0], m, prog):
        yield from _match_all(pats[1:], vals[1:], m1, prog)


def match(p: Pat, v: Value) -> Iterator[Match]:
    """All matches of `p` rooted at `v` (for tests and passes that need only matching)."""
    return _match(p, v, Match({}, {}, ()), _Progress())


# -- rewriting ---------------------------------------------------------------------------

class Builder:
    """Builds replacement nodes just before the root of a match, typing them with the registry."""

    def __init__(self, g: Graph, before: Node, name: str) -> None:
        self.g, self.before, self.name = g, before, name
        self.created: list[Node] = []

    def op(self, op_name: str, inputs: Sequence[Value], attrs: Mapping[str, Any] | None = None,
           name: str | None = None) -> Value:
        return self.ops(op_name, inputs, attrs, name)[0]

    def ops(self, op_name: str, inputs: Sequence[Value], attrs: Mapping[str, Any] | None = None,
            name: str | None = None) -> list[Value]:
        try:
            types = get_op(op_name).infer_types([v.type for v in inputs], dict(attrs or {}))
        except ShapeError as e:
            raise InternalError(f"rewrite built an ill-typed {op_name}: {e}") from e
        node = self.g.add_node(op_name, list(inputs), types, attrs, names=name or f"{self.name}_{op_name}",
                               before=self.before)
        self.created.append(node)
        return node.outputs

    def const(self, name: str, tensor: torch.Tensor) -> Value:
        from npuc.ir import DType, TensorSource

        t = tensor.contiguous()
        return self.g.add_constant(name, TensorType(tuple(t.shape), DType.from_torch(t.dtype)),
                                   TensorSource(t, "rewrite"))


Refusal = str | None
RewriteFn = Callable[[Builder, Match], Value]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Pat
    rewrite: RewriteFn
    check: Callable[[Match], Refusal] = field(default=lambda m: None)


@dataclass
class RuleStats:
    matched: int = 0
    applied: int = 0
    refused: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Fusion:
    """Provenance for the fusion report: what a rule built and which nodes it replaced."""

    rule: str
    created: tuple[str, ...]
    replaced: tuple[str, ...]


@dataclass
class RewriteEngine:
    rules: Sequence[Rule]
    max_rounds: int = 50
    stats: dict[str, RuleStats] = field(default_factory=dict)
    fusions: list[Fusion] = field(default_factory=list)
    _progress: dict[str, _Progress] = field(default_factory=dict)

    def run(self, g: Graph) -> bool:
        """Apply the rules to a fixed point; returns whether the graph changed."""
        for r in self.rules:
            self.stats.setdefault(r.name, RuleStats())
            self._progress.setdefault(r.name, _Progress())
        changed_any = False
        for _ in range(self.max_rounds):
            changed = False
            roots = g.root_ids()  # changes only when a rewrite is applied
            for node in list(g.nodes):
                if not g.has_node(node) or len(node.outputs) != 1:
                    continue
                for rule in self.rules:
                    if self._try(g, rule, node, roots):
                        changed = True
                        roots = g.root_ids()
                        break
            changed_any |= changed
            if not changed:
                return changed_any
        raise InternalError(f"rewrite rules {[r.name for r in self.rules]} did not reach a fixed point")

    def _try(self, g: Graph, rule: Rule, root: Node, outputs: set[int]) -> bool:
        stats, prog = self.stats[rule.name], self._progress[rule.name]
        for m in _match(rule.pattern, root.outputs[0], Match({}, {}, ()), prog):
            stats.matched += 1
            inside = set(m.matched)
            leak = next((o for n in m.matched[1:] for o in n.outputs
                         if id(o) in outputs or any(u not in inside for u, _ in o.uses)), None)
            if leak is not None:
                stats.refused[f"{leak.ref()} is used outside the match"] += 1
                continue
            inner = next((name for name in m.vars if m.values[name].producer in inside), None)
            if inner is not None:  # the rewrite would read a value it is about to remove
                stats.refused[f"%{inner} binds a value computed inside the match"] += 1
                continue
            reason = rule.check(m)
            if reason:
                stats.refused[reason] += 1
                continue
            b = Builder(g, root, root.name)
            new = rule.rewrite(b, m)
            old = root.outputs[0]
            refusal = None
            if id(old) in outputs and (new.producer is None or new.producer not in b.created):
                refusal = "the root is a graph output and the rewrite gives an existing value"
            elif new.type != old.type:  # a broadcast the rule did not foresee: never a wrong program
                refusal = f"the rewrite would change {old.type} into {new.type}"
            if refusal is not None:
                for n in reversed(b.created):
                    if all(not o.uses for o in n.outputs):
                        g.remove_node(n)
                stats.refused[refusal] += 1
                continue
            g.replace_all_uses_with(old, new)
            outputs = g.root_ids()
            replaced = [n.name for n in m.matched]
            left = list(m.matched)
            while left:  # root first; a shared interior node goes once its last reader has
                dead = [n for n in left if all(not o.uses and id(o) not in outputs for o in n.outputs)]
                if not dead:
                    raise InternalError(f"rule {rule.name} left matched nodes with users: {left}")
                for n in dead:
                    g.remove_node(n)
                    left.remove(n)
            if new.producer is not None and new.producer in b.created and old.name not in g._names:
                g.rename(new, old.name)  # the fused value keeps the name users knew
            self.fusions.append(Fusion(rule.name, tuple(n.name for n in b.created), tuple(replaced)))
            stats.applied += 1
            return True
        return False

    def explain(self, rule_name: str) -> str:
        """Why a rule did not fire: its best partial match, or its most frequent refusal."""
        stats = self.stats.get(rule_name)
        if stats is None:
            return f"{rule_name}: never run"
        if stats.applied:
            return f"{rule_name}: applied {stats.applied} time(s)"
        if stats.refused:
            reason, count = stats.refused.most_common(1)[0]
            return f"{rule_name}: matched {stats.matched} time(s), refused: {reason} (x{count})"
        p = self._progress[rule_name]
        return f"{rule_name}: best partial match covered {max(p.depth, 0)} node(s), then {p.message}"


@dataclass(frozen=True)
class RewritePass(Pass):
    """A pass that is a list of rules run to a fixed point by the engine."""

    name = "rewrite"

    def rules(self) -> Sequence[Rule]:
        raise NotImplementedError

    def call(self, g: Graph) -> PassResult:
        engine = RewriteEngine(self.rules())
        modified = engine.run(g)
        details = {
            "rules": {k: {"matched": s.matched, "applied": s.applied, "refused": dict(s.refused)}
                      for k, s in engine.stats.items()},
            "fusions": [{"rule": f.rule, "created": list(f.created), "replaced": list(f.replaced)}
                        for f in engine.fusions],
            "explain": {k: engine.explain(k) for k, s in engine.stats.items() if not s.applied},
        }
        return PassResult(g, modified, details)
