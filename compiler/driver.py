"""The compile driver: source -> frontend -> passes -> backend -> `.om`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.compiler.loaders import LoadedModel, describe_inputs, load_source, program_inputs
from npuc.compiler.shapes import check_names, parse_input_shape
from npuc.compiler.torch_frontend import import_exported_program
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph
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
    if loaded.program is not None:
        return _specialise_program(loaded.program, shapes)
    kwargs: dict[str, Any] = {
        name: torch.zeros(shape, dtype=loaded.input_dtypes.get(name, torch.float32)) for name, shape in shapes.items()}
    kwargs.update(loaded.fixed_kwargs)
    return _run_export(loaded.module, (), kwargs)


def _specialise_program(ep: torch.export.ExportedProgram, shapes: dict[str, tuple[int, ...]]
                        ) -> torch.export.ExportedProgram:
    """A .pt2 with static shapes is used as it is; one with dynamic dims is re-exported
    at the shapes the user gave."""
    inputs = program_inputs(ep)
    static = all(isinstance(d, int) for shape, _ in inputs.values() for d in shape)
    problems = [f"{name}: the .pt2 has {list(shape)}, --input_shape says {list(shapes[name])}"
                for name, (shape, _) in inputs.items() if static and name in shapes and tuple(shape) != shapes[name]]
    missing = [name for name in inputs if name not in shapes and not static]
    if problems or missing:
        raise NpucError("NPUC-E0111", "; ".join(problems + [f"{m}: no shape given" for m in missing]),
                        "a .pt2 exported with static shapes compiles only at those shapes; export it with "
                        "dynamic_shapes to choose them at compile time", exit_code=EXIT_USAGE)
    if static:
        return ep.run_decompositions({})
    flat: list[Any] = []
    user = [s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    for s in user:
        if s.arg.name in inputs:
            flat.append(torch.zeros(shapes[s.arg.name], dtype=inputs[s.arg.name][1]))
        else:
            flat.append(getattr(s.arg, "value", None))
    args, kwargs = torch.utils._pytree.tree_unflatten(flat, ep.call_spec.in_spec)
    return _run_export(ep.module(), tuple(args), kwargs)


def _run_export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> torch.export.ExportedProgram:
    try:
        with torch.no_grad():
            return torch.export.export(module, args, kwargs=kwargs, strict=False).run_decompositions({})
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


def build_graph(model: Any, input_shape: Any = None, input_dtypes: Mapping[str, Any] | None = None
                ) -> tuple[Graph, LoadedModel]:
    """Frontend only: the imported (unoptimised) graph."""
    loaded = load_source(model)
    for name, dt in (input_dtypes or {}).items():
        loaded.input_dtypes[name] = _torch_dtype(dt)
    shapes = parse_input_shape(input_shape)
    ep = _export(loaded, shapes)
    return import_exported_program(ep, loaded.resolve, output_names=_output_names(ep)), loaded


def _torch_dtype(dt: Any) -> torch.dtype:
    if isinstance(dt, torch.dtype):
        return dt
    try:
        return DType(str(dt)).torch if str(dt) in DType.__members__ else getattr(torch, str(dt))
    except AttributeError:
        raise NpucError("NPUC-E0112", f"unknown input dtype {dt!r}", "use a name like int64, float32 or f16",
                        exit_code=EXIT_USAGE) from None


def compile_model(
    model: Any,
    *,
    input_shape: Any = None,
    output: str,
    soc_version: str | None = None,
    input_dtypes: Mapping[str, Any] | None = None,
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
        raise NpucError("NPUC-E0406", f"cannot create output folder {parent!r}: {e.strerror}",
                        "choose a writable --output prefix", exit_code=EXIT_IO) from None
    graph, loaded = build_graph(model, input_shape, input_dtypes)
    graph = PassManager(default_pipeline(), verify_each=debug).run(graph)
    meta = {"source_kind": loaded.kind, "input_shape": str(input_shape)}
    low = lower(graph, target, meta)
    try:
        write_om(low, out_path)
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot write {out_path!r}: {e.strerror}", "check the output path",
                        exit_code=EXIT_IO) from None
    log.info("wrote %s", out_path)
    return out_path
