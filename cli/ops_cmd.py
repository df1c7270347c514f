"""`npuc ops`: the supported operators, from the op registry and the frontends' converter
tables (the same text as docs/ops.md, so an installed wheel carries what E0301's hint names).

    npuc ops                # print docs/ops.md's text
"""

from __future__ import annotations

import click


def render_ops() -> str:
    """The supported operators as Markdown: the op registry and both frontends' tables."""
    from npuc.compiler import recurrent as _recurrent  # noqa: F401  (its npuc:: ops' converters register on import)
    from npuc.compiler.onnx_frontend import CONVERTERS as ONNX
    from npuc.compiler.onnx_frontend import MAX_OPSET, MIN_OPSET
    from npuc.compiler.torch_frontend import COMPLEX_CONVERTERS
    from npuc.compiler.torch_frontend import CONVERTERS as ATEN
    from npuc.ir import all_ops

    ops = all_ops()
    lines = ["# Supported operators", "", "## npuc IR ops", "",
             "Each is declared once in `ir/ops.py` (primitives) or `ir/fused_ops.py` (fused ops): shape rule, torch reference kernel, FLOPs and unit.", "",
             "| op | inputs | attributes | unit |", "|---|---|---|---|"]
    for n in sorted(ops):
        o = ops[n]
        attrs = ", ".join(f"{k}: {a.kind}" for k, a in o.attrs.items())
        lines.append(f"| `{n}` | {', '.join(o.inputs) or '-'} | {attrs or '-'} | {o.unit} |")
    lines += ["", f"## ONNX frontend (opsets {MIN_OPSET} to {MAX_OPSET}, domain ai.onnx)", "",
              "Values that ops need as data (Reshape's shape, Slice's starts, ...) must be computable at compile "
              "time once the input shapes are fixed; shape arithmetic from dynamic exports is.", ""]
    lines += [f"- `{t}`" for t in sorted(ONNX)]
    lines += ["", "## torch frontend (ATen overloads)", "",
              "`torch.export` programs are taken in functional ATen without default decompositions. "
              "These overloads convert (ignored: `_assert_tensor_metadata` and other runtime asserts):", ""]
    lines += [f"- `{t}`" for t in sorted(ATEN)]
    lines += ["", "### on complex values", "",
              "npuc has no complex dtype: a complex tensor is carried as its real (re, im) pairs, a trailing "
              "axis of 2 (the layout of `view_as_real`). Complex inputs, outputs and weights on disk are refused "
              "(NPUC-E0309); complex buffers in memory become pair constants. These overloads take or make "
              "complex values:", ""]
    lines += [f"- `{t}`" for t in sorted(COMPLEX_CONVERTERS) if t != "getitem"]
    return "\n".join(lines) + "\n"



@click.command("ops")
def ops_cmd() -> None:
    """Print the supported operators (docs/ops.md): IR ops, ONNX ops, ATen overloads."""
    click.echo(render_ops(), nl=False)
