"""Parse the textual IR (see `npuc.ir.printer`) back into a `Graph`.

Constants come back without data (`MissingSource`): the text form describes a
program, not its weights. Errors name the line and column.
"""

from __future__ import annotations

import json
import re
from typing import Any

from npuc.errors import NpucError
from npuc.ir.graph import Graph, MissingSource, Value
from npuc.ir.types import DType, TensorType

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<num>-?(?:inf|nan|\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+)(?![A-Za-z_]))
    | (?P<ref>[%@](?:"(?:[^"\\]|\\.)*"|[A-Za-z0-9_.]+))
    | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<punct>->|[()\[\]{},:=])
    )""",
    re.VERBOSE,
)
_DTYPES = {d.value: d for d in DType}


class _Lexer:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str, int]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise self._err(text, pos, "unexpected character")
            kind = m.lastgroup or ""
            self.toks.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
        self.text = text
        self.i = 0

    def _err(self, text: str, pos: int, msg: str) -> NpucError:
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        snippet = text.splitlines()[line - 1] if text else ""
        return NpucError("NPUC-E0201", f"IR parse error at {line}:{col}: {msg}: {snippet.strip()!r}",
                         "the textual IR grammar is in docs/ir.md")

    def error(self, msg: str, at: int | None = None) -> NpucError:
        i = self.i if at is None else at
        pos = self.toks[i][2] if i < len(self.toks) else len(self.text)
        return self._err(self.text, pos, msg)

    def peek(self) -> tuple[str, str]:
        if self.i >= len(self.toks):
            return ("eof", "")
        k, v, _ = self.toks[self.i]
        return (k, v)

    def next(self) -> tuple[str, str]:
        t = self.peek()
        if t[0] == "eof":
            raise self.error("unexpected end of input")
        self.i += 1
        return t

    def expect(self, value: str) -> None:
        k, v = self.next()
        if v != value:
            self.i -= 1
            raise self.error(f"expected {value!r}, got {v!r}")

    def accept(self, value: str) -> bool:
        if self.peek()[1] == value and self.peek()[0] in ("punct", "ident"):
            self.i += 1
            return True
        return False


def _unquote(s: str) -> str:
    return json.loads(s) if s.startswith('"') else s


def _parse_type(lx: _Lexer) -> TensorType:
    k, v = lx.next()
    if k != "ident" or v not in _DTYPES:
        lx.i -= 1
        raise lx.error(f"expected a dtype, got {v!r}")
    lx.expect("[")
    dims: list[int] = []
    while not lx.accept("]"):
        k, d = lx.next()
        if k != "num" or not d.lstrip("-").isdigit():
            lx.i -= 1
            raise lx.error("expected an integer dimension")
        dims.append(int(d))
        lx.accept(",")
    fmt = "ND"
    if lx.accept("{"):
        fmt = lx.next()[1]
        lx.expect("}")
    return TensorType(tuple(dims), _DTYPES[v], fmt)


def _parse_attr_value(lx: _Lexer) -> Any:
    k, v = lx.next()
    if k == "num":
        if v.lstrip("-").isdigit():
            return int(v)
        return float(v)
    if k == "str":
        return json.loads(v)
    if k == "ident":
        if v == "true":
            return True
        if v == "false":
            return False
        if v == "none":
            return None
        if v in _DTYPES:
            return _DTYPES[v]
    if v == "[":
        items = []
        while not lx.accept("]"):
            items.append(_parse_attr_value(lx))
            lx.accept(",")
        return tuple(items)
    lx.i -= 1
    raise lx.error(f"bad attribute value {v!r}")


def parse_graph(text: str) -> Graph:
    lx = _Lexer(text)
    lx.expect("graph")
    g = Graph(_unquote(lx.next()[1]))
    env: dict[str, Value] = {}

    def lookup(ref: str) -> Value:
        name = ref[0] + _unquote(ref[1:])
        if name not in env:
            raise lx.error(f"use of undefined value {ref}", at=lx.i - 1)
        return env[name]

    def fresh(ref: str, at: int) -> str:
        name = _unquote(ref[1:])
        if name in g._names:
            raise lx.error(f"value {ref} is defined twice", at=at)
        return name

    def declare(sigil: str, what: str) -> tuple[str, TensorType]:
        """`%name : type` (an input) or `@name : type` (a constant)."""
        k, ref = lx.next()
        if k != "ref" or not ref.startswith(sigil):
            lx.i -= 1
            raise lx.error(f"expected {what} {sigil}name")
        name = fresh(ref, lx.i - 1)
        lx.expect(":")
        return name, _parse_type(lx)

    lx.expect("(")
    while not lx.accept(")"):
        name, t = declare("%", "an input")
        env["%" + name] = g.add_input(name, t)
        lx.accept(",")
    lx.expect("{")
    while True:
        if lx.accept("const"):
            name, t = declare("@", "a constant")
            env["@" + name] = g.add_constant(name, t, MissingSource())
            continue
        if lx.accept("state"):
            name, t = declare("%", "a state")
            env["%" + name] = g.add_state(name, t)
            continue
        if lx.accept("update"):
            st = lookup(lx.next()[1])
            lx.expect("=")
            val = lookup(lx.next()[1])
            if not st.state or val.type != st.type:
                raise lx.error(f"{st.ref()} is not a state of type {val.type}", at=lx.i - 1)
            g.set_state_update(st, val)
            continue
        if lx.accept("return"):
            outs = []
            while lx.peek()[0] == "ref":
                outs.append(lookup(lx.next()[1]))
                lx.accept(",")
            g.set_outputs(outs)
            lx.expect("}")
            break
        # node: outs = op[attrs](args)
        out_decls: list[tuple[str, TensorType]] = []
        while lx.peek()[0] == "ref":
            ref = lx.next()[1]
            name = fresh(ref, lx.i - 1)
            if any(name == n for n, _ in out_decls):
                raise lx.error(f"value {ref} is defined twice", at=lx.i - 1)
            lx.expect(":")
            out_decls.append((name, _parse_type(lx)))
            if not lx.accept(","):
                break
        if out_decls:
            lx.expect("=")
        k, op = lx.next()
        if k != "ident":
            lx.i -= 1
            raise lx.error(f"expected an op name, got {op!r}")
        attrs: dict[str, Any] = {}
        if lx.accept("["):
            while not lx.accept("]"):
                key = lx.next()[1]
                lx.expect("=")
                attrs[key] = _parse_attr_value(lx)
                lx.accept(",")
        lx.expect("(")
        args = []
        while not lx.accept(")"):
            k, ref = lx.next()
            if k != "ref":
                lx.i -= 1
                raise lx.error("expected an operand")
            args.append(lookup(ref))
            lx.accept(",")
        node = g.add_node(op, args, [t for _, t in out_decls], attrs, names=[n for n, _ in out_decls])
        for o in node.outputs:
            env["%" + o.name] = o
    if lx.peek()[0] != "eof":
        raise lx.error("trailing text after the graph")
    return g
