"""`--input_shape` in ATC's syntax: "name:d0,d1;name2:d0,d1".

Items split on `;`, each item on its *last* `:` (ONNX names like `x:0` occur),
dims on `,`. Every problem in the string is reported in one error.
"""

from __future__ import annotations

from collections.abc import Mapping

from npuc.errors import EXIT_USAGE, NpucError

InputShapes = dict[str, tuple[int, ...]]


def parse_input_shape(text: str | Mapping[str, tuple[int, ...]] | None) -> InputShapes:
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return {k: tuple(int(d) for d in v) for k, v in text.items()}
    problems: list[str] = []
    shapes: InputShapes = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, dims_text = item.rpartition(":")
        if not sep or not name:
            problems.append(f"{item!r} is not NAME:DIMS")
            continue
        dims: list[int] = []
        for j, d in enumerate(dims_text.split(",")):
            d = d.strip()
            try:
                v = int(d)
            except ValueError:
                problems.append(f"{item!r}: dim {j} ({d!r}) is not an integer")
                continue
            if v == -1:
                problems.append(f"{item!r}: dim {j} is -1; npuc compiles static shapes only")
            elif v <= 0:
                problems.append(f"{item!r}: dim {j} is {v}; dims must be positive")
            dims.append(v)
        if name in shapes:
            problems.append(f"{name!r} is given twice")
        shapes[name] = tuple(dims)
    if problems:
        raise NpucError("NPUC-E0101", "bad --input_shape " + repr(text) + ": " + "; ".join(problems),
                        'write it as "name:d0,d1;name2:d0,d1", e.g. "input_ids:1,16"', exit_code=EXIT_USAGE)
    return shapes


def check_names(shapes: InputShapes, known: Mapping[str, str]) -> None:
    """Refuse names the model does not have; `known` maps input names to a description."""
    import difflib

    problems = []
    for name in shapes:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"unknown input {name!r}{hint}")
    if problems:
        listing = ", ".join(f"{k}: {v}" for k, v in known.items())
        raise NpucError("NPUC-E0102", "; ".join(problems) + f"; the model's inputs are {listing}",
                        "name inputs exactly as the model does", exit_code=EXIT_USAGE)
