"""The compile driver: source -> frontend -> passes -> backend -> `.om`."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.compiler.loaders import LoadedModel, describe_inputs, load_source
from npuc.compiler.shapes import check_names, parse_input_shape
from npuc.compiler.torch_frontend import import_exported_program
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import Graph
from npuc.passes.manager import PassManager
from npuc.passes.pipeline import default_pipeline

log = logging.getLogger("npuc")


def _export(loaded: LoadedModel, shapes: dict[str, tuple[int, ...]]) -> torch.export.ExportedProgram:
    known = describe_inputs(loaded)
    if known:
        check_names(shapes, known)
    if not shapes:
        listing = ", ".join(f"{k}: {v}" for k, v in known.items()) or "unknown"
        raise NpucError("NPUC-E0106", "--input_shape is required: npuc compiles static shapes only",
                        f'give every input a shape, e.g. --input_shape "input_ids:1,16" (inputs: {listing})',
                        exit_code=EXIT_USAGE)
    kwargs: dict[str, Any] = {
        name: torch.zeros(shape, dtype=loaded.input_dtypes.get(name, torch.float32)) for name, shape in shapes.items()}
    kwargs.update(loaded.fixed_kwargs)
    try:
        with torch.no_grad():
            return torch.export.export(loaded.module, (), kwargs=kwargs, strict=False).run_decompositions({})
    except NpucError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NpucError("NPUC-E0307", f"torch.export could not trace the model: {first}",
                        "check the input names and shapes; run with --debug for torch's full report",
                        exit_code=EXIT_UNSUPPORTED) from e


def _output_names(ep: torch.export.ExportedProgram) -> list[str] | None:
    spec = ep.call_spec.out_spec
    ctx = getattr(spec, "context", None)
    if isinstance(ctx, list) and all(isinstance(c, str) for c in ctx) and len(ctx) == spec.num_children:
        return list(ctx)
    return None


def build_graph(model: Any, input_shape: Any = None) -> tuple[Graph, LoadedModel]:
    """Frontend only: the imported (unoptimised) graph."""
    loaded = load_source(model)
    shapes = parse_input_shape(input_shape)
    ep = _export(loaded, shapes)
    return import_exported_program(ep, loaded.resolve, output_names=_output_names(ep)), loaded


def compile_model(
    model: Any,
    *,
    input_shape: Any = None,
    output: str,
    soc_version: str | None = None,
    debug: bool = False,
) -> str:
    """Compile `model` to `<output>.om` and return that path."""
    target = get_target(soc_version)
    out_path = os.fspath(output)
    if not out_path.endswith(".om"):
        out_path += ".om"
    parent = os.path.dirname(os.path.abspath(out_path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise NpucError("NPUC-E0403", f"cannot create output folder {parent!r}: {e.strerror}",
                        "choose a writable --output prefix", exit_code=EXIT_IO) from None
    graph, loaded = build_graph(model, input_shape)
    graph = PassManager(default_pipeline(), verify_each=debug).run(graph)
    meta = {"source_kind": loaded.kind, "input_shape": str(input_shape)}
    low = lower(graph, target, meta)
    try:
        write_om(low, out_path)
    except OSError as e:
        raise NpucError("NPUC-E0403", f"cannot write {out_path!r}: {e.strerror}", "check the output path",
                        exit_code=EXIT_IO) from None
    log.info("wrote %s", out_path)
    return out_path
