"""`--input_shape` in ATC's syntax: "name:d0,d1;name2:d0,d1", and by dim name.

Items split on `;`, each item on its *last* `:` (ONNX names like `x:0` occur),
dims on `,`. An item whose name is no input but a symbolic dim the inputs declare
(ONNX's dim_param) binds that dim once for every input that uses it:

    "batch_size:1;sequence_length:128"     input_ids [batch_size, sequence_length] -> [1, 128]

A dim the exporter wrote as a sum of names (optimum's attention mask is
[batch_size, "past_sequence_length + sequence_length"]) is computed from them.

An input's own item takes precedence over the names; where they disagree (or two
explicit inputs give one name two sizes) that is NPUC-E0132. A name that is both an
input and a dim is the input. Every problem in the string, and every disagreement
with the model's declared inputs, is reported in one error that lists the real inputs.

A dim of 0 is refused (E0101) unless the caller reads zero-length inputs (`empty_ok`:
the ONNX frontend, where a past KV cache of length 0 is the first step of generation).
"""

from __future__ import annotations

import ast
import difflib
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError

InputShapes = dict[str, tuple[int, ...]]
Dim = int | str | None  # a fixed size, a symbolic name, or unknown


@dataclass(frozen=True)
class DeclaredInput:
    """What the model says about one input: its dtype and dims (None: rank unknown)."""

    dtype: str
    dims: tuple[Dim, ...] | None
    required: bool = True

    def describe(self) -> str:
        if self.dims is None:
            return self.dtype
        return f"{self.dtype}[{','.join('?' if d is None else str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    hint: str = ""  # where it is not HINT's (the syntax)


HINT = ('write --input_shape as "name:d0,d1;name2:d0,d1", e.g. "input_ids:1,16", or bind the inputs\' '
        'dim names, e.g. "batch_size:1;sequence_length:16"')


def _parse(text: str) -> tuple[InputShapes, dict[str, str], list[Problem]]:
    problems: list[Problem] = []
    shapes: InputShapes = {}
    items: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, dims_text = item.rpartition(":")
        if not sep or not name.strip():
            problems.append(Problem("NPUC-E0101", f"{item!r} is not NAME:DIMS"))
            continue
        name = name.strip()
        dims: list[int] = []
        bad = False
        for j, d in enumerate(dims_text.split(",")):
            d = d.strip()
            try:
                v = int(d)
            except ValueError:
                problems.append(Problem("NPUC-E0101", f"{item!r}: dim {j} ({d!r}) is not an integer"))
                bad = True
                continue
            if v == -1:
                problems.append(Problem("NPUC-E0101", f"{item!r}: dim {j} is -1; npuc compiles static shapes only"))
                bad = True
            elif v < 0:
                problems.append(Problem("NPUC-E0101", f"{item!r}: dim {j} is {v}; dims must be positive"))
                bad = True
            dims.append(v)
        if name in items:
            problems.append(Problem("NPUC-E0116", f"input {name!r} is given twice ({items[name]!r} and {item!r})"))
            continue
        items[name] = item
        if not bad:
            shapes[name] = tuple(dims)
    return shapes, items, problems


def _check(shapes: InputShapes, items: Mapping[str, str], declared: Mapping[str, DeclaredInput]) -> list[Problem]:
    problems = []
    for name, item in items.items():
        if name not in declared:
            close = difflib.get_close_matches(name, [*declared, *sorted(_dim_names(declared))], n=1, cutoff=0.5)
            extra = f" (closest: {close[0]!r})" if close else ""
            problems.append(Problem("NPUC-E0102", f"{item!r}: the model has no input or dim named {name!r}{extra}"))
            continue
        decl = declared[name]
        if name not in shapes or decl.dims is None:
            continue
        got = shapes[name]
        if len(got) != len(decl.dims):
            problems.append(Problem("NPUC-E0114", f"{item!r}: rank {len(got)}, but input {name!r} is "
                                    f"{decl.describe()} (rank {len(decl.dims)})"))
            continue
        for j, (g, d) in enumerate(zip(got, decl.dims, strict=True)):
            if isinstance(d, int) and d != g:
                problems.append(Problem("NPUC-E0115", f"{item!r}: dim {j} is {g}, but the model fixes it to {d}"))
    for name, decl in declared.items():
        if name in items or not decl.required:
            continue
        dynamic = decl.dims is None or any(not isinstance(d, int) for d in decl.dims)
        if dynamic:
            problems.append(Problem("NPUC-E0113", f"input {name!r} ({decl.describe()}) has dynamic dims and "
                                    "--input_shape gives it no shape"))
    return problems


def _dim_names(declared: Mapping[str, DeclaredInput]) -> set[str]:
    """Every symbolic dim the inputs declare, and the names an expression dim is made of."""
    names = set()
    for d in (d for decl in declared.values() for d in (decl.dims or ()) if isinstance(d, str)):
        names.add(d)
        names.update(_expr_names(d))
    return names


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _expr_names(dim: str) -> set[str]:
    """The names of a dim written as an expression ("past_sequence_length + sequence_length");
    nothing for a plain name or text that is no sum, difference or product of names and integers."""
    try:
        tree = ast.parse(dim, mode="eval").body
    except (SyntaxError, ValueError):
        return set()
    if isinstance(tree, ast.Name) or not _arith(tree):
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _arith(e: ast.AST) -> bool:
    if isinstance(e, ast.BinOp):
        return type(e.op) in _OPS and _arith(e.left) and _arith(e.right)
    return isinstance(e, ast.Name) or (isinstance(e, ast.Constant) and type(e.value) is int)


def _evaluate(dim: str, bound: Mapping[str, int]) -> int | None:
    """An expression dim's size from the bound names, or None if one is unbound."""
    def ev(e: ast.AST) -> int | None:
        if isinstance(e, ast.BinOp):
            a, b = ev(e.left), ev(e.right)
            return None if a is None or b is None else _OPS[type(e.op)](a, b)
        if isinstance(e, ast.Name):
            return bound.get(e.id)
        return e.value if isinstance(e, ast.Constant) and isinstance(e.value, int) else None
    if not _expr_names(dim):
        return None
    return ev(ast.parse(dim, mode="eval").body)


def _bind_names(shapes: InputShapes, items: dict[str, str], declared: Mapping[str, DeclaredInput]
                ) -> list[Problem]:
    """Move the dim-name items out of `items` and `shapes` into the inputs they size (in place)."""
    names = _dim_names(declared) - set(declared)
    bound: dict[str, tuple[int, str]] = {}
    problems = []
    for name in [n for n in items if n in names]:
        item = items.pop(name)
        dims = shapes.pop(name, None)
        if dims is None:
            continue  # its parse problem is reported already
        if len(dims) != 1:
            problems.append(Problem("NPUC-E0132", f"{item!r}: dim name {name!r} binds one size, not {len(dims)}"))
            continue
        bound[name] = (dims[0], item)
    seen: dict[str, tuple[int, str]] = {}  # a dim name's size in the inputs given explicitly
    for inp, decl in declared.items():
        if decl.dims is None:
            continue
        if inp in shapes and len(shapes[inp]) == len(decl.dims):
            for d, g in zip(decl.dims, shapes[inp], strict=True):
                if not isinstance(d, str):
                    continue
                total = _evaluate(d, {k: v[0] for k, v in bound.items()})
                if total is not None and total != g:
                    problems.append(Problem("NPUC-E0132", f"{items[inp]!r} makes dim {d!r} {g}, but the dim names "
                                            f"bound make it {total}"))
                if d in bound and bound[d][0] != g:
                    problems.append(Problem("NPUC-E0132", f"{items[inp]!r} makes dim {d!r} {g}, but "
                                            f"{bound[d][1]!r} binds it to {bound[d][0]}"))
                elif d in seen and seen[d][0] != g:
                    problems.append(Problem("NPUC-E0132", f"dim {d!r} is {seen[d][0]} in {seen[d][1]!r} and {g} "
                                            f"in {items[inp]!r}"))
                seen.setdefault(d, (g, items[inp]))
        elif inp not in items and any(isinstance(d, str) and (d in bound or _expr_names(d) & set(bound))
                                      for d in decl.dims):
            shape = shape_at(decl, {k: v[0] for k, v in bound.items()})
            if shape is not None:
                shapes[inp] = shape
                used = [n for d in decl.dims if isinstance(d, str) for n in ([d] if d in bound else _expr_names(d))]
                items[inp] = ";".join(dict.fromkeys(bound[n][1] for n in used))
    return problems


def _check_empty(shapes: InputShapes, items: Mapping[str, str]) -> list[Problem]:
    """A 0 dim, once per item that gives one."""
    bad = {items.get(name, name): (name, shape.index(0)) for name, shape in shapes.items() if 0 in shape}
    return [Problem("NPUC-E0101", f"{item!r}: dim {j} of input {name!r} is 0; dims must be positive")
            for item, (name, j) in bad.items()]


SIZE_HINT = ("give the shape one run feeds, e.g. sequence_length:4096; for a longer context compile the prompt's "
             "length with --max_seq_len N (the KV cache's positions)")
# The most elements one input may hold (2^31 - 1, an int32's range, 8 GiB of f32): a shape past
# it is a typo or a context meant for --max_seq_len, and tracing at it would allocate the
# input (and the constants sized by it) before any memory check could refuse the plan.
MAX_INPUT_ELEMENTS = 2**31 - 1


def _check_sizes(shapes: InputShapes, items: Mapping[str, str]) -> list[Problem]:
    problems = []
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        if numel > MAX_INPUT_ELEMENTS:
            what = f"{items[name]!r}: input {name!r} would hold" if name in items else f"input {name!r} declares"
            problems.append(Problem("NPUC-E0101", f"{what} {numel:,} elements, past npuc's bound of "
                                    f"{MAX_INPUT_ELEMENTS:,} for one input", SIZE_HINT))
    return problems


def _check_declared(declared: Mapping[str, DeclaredInput]) -> None:
    """A model whose own input declares a negative dim (ONNX's dim_value is a size) is malformed:
    refused here, before a shape built from it reaches an op."""
    for name, decl in declared.items():
        for j, d in enumerate(decl.dims or ()):
            if isinstance(d, int) and d < 0:
                raise NpucError("NPUC-E0315", f"input {name!r} ({decl.describe()}) declares dim {j} as {d}: a dim "
                                "is a size (0 or more) or a name", "the model file is malformed: re-export it "
                                "with its dims as sizes or as names (dim_param), and give them with --input_shape",
                                exit_code=EXIT_IO)


def resolve_input_shapes(text: str | Mapping[str, Sequence[int]] | None,
                         declared: Mapping[str, DeclaredInput], *, empty_ok: bool = False) -> InputShapes:
    """The static shape of every input: from `text` (by input, or by dim name), or the
    model's own static dims.

    Raises one NpucError (exit 2) listing every problem together with the model's inputs;
    NPUC-E0315 for a model that declares a negative dim."""
    _check_declared(declared)
    if isinstance(text, Mapping):
        shapes: InputShapes = {k: tuple(int(d) for d in v) for k, v in text.items()}
        items = {k: f"{k}:{','.join(map(str, v))}" for k, v in shapes.items()}
        problems: list[Problem] = []
    else:
        shapes, items, problems = _parse(text or "")
    problems += _bind_names(shapes, items, declared)
    problems += _check(shapes, items, declared)
    if not empty_ok:
        problems += _check_empty(shapes, items)
    problems += _check_sizes(shapes, items)
    if problems:
        listing = ", ".join(f"{n}: {d.describe()}" for n, d in declared.items()) or "none known"
        shown = f"--input_shape {text!r}" if isinstance(text, str) else "input shapes"
        if len(problems) == 1:
            raise NpucError(problems[0].code, problems[0].message, problems[0].hint or HINT, exit_code=EXIT_USAGE,
                            details=[f"model inputs: {listing}"])
        raise NpucError(problems[0].code, f"{len(problems)} problems with {shown}", HINT, exit_code=EXIT_USAGE,
                        details=[f"- {p.message} [{p.code}]" for p in problems] + [f"model inputs: {listing}"])
    for name, decl in declared.items():
        if name not in shapes and decl.required and decl.dims is not None \
                and all(isinstance(d, int) for d in decl.dims):
            shapes[name] = tuple(d for d in decl.dims if isinstance(d, int))  # fully static: nothing to choose
    declared_sizes = _check_sizes({n: s for n, s in shapes.items() if n not in items}, {})
    if declared_sizes:
        raise NpucError(declared_sizes[0].code, declared_sizes[0].message, "the model fixes this shape: re-export it "
                        "with a smaller one, or with named dims to give with --input_shape", exit_code=EXIT_USAGE)
    return shapes


def dim_sizes(declared: Mapping[str, DeclaredInput], shapes: InputShapes) -> dict[str, int]:
    """The size each plain symbolic dim name has in `shapes` (resolved: consistent)."""
    sizes: dict[str, int] = {}
    for name, decl in declared.items():
        if decl.dims is not None and name in shapes and len(shapes[name]) == len(decl.dims):
            for d, n in zip(decl.dims, shapes[name], strict=True):
                if isinstance(d, str) and not _expr_names(d):
                    sizes.setdefault(d, n)
    return sizes


def shape_at(decl: DeclaredInput, sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    """`decl`'s dims with its names (and sums of names) at `sizes`; None if one is unbound."""
    if decl.dims is None:
        return None
    dims = [d if isinstance(d, int) else sizes.get(d, _evaluate(d, sizes)) if isinstance(d, str) else None
            for d in decl.dims]
    return None if any(d is None for d in dims) else tuple(int(d) for d in dims if d is not None)
