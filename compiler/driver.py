"""The compile driver: source -> frontend -> passes -> backend -> `.om`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.compiler.loaders import LoadedModel, declared_inputs, load_source, program_inputs
from npuc.compiler.shapes import resolve_input_shapes
from npuc.compiler.torch_frontend import import_exported_program
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph
from npuc.passes.manager import PassManager
from npuc.passes.pipeline import default_pipeline

log = logging.getLogger("npuc")


def _export(loaded: LoadedModel, shapes: dict[str, tuple[int, ...]]) -> torch.export.ExportedProgram:
    if loaded.program is not None:
        return _specialise_program(loaded.program, shapes)
    kwargs: dict[str, Any] = {
        name: torch.zeros(shape, dtype=loaded.input_dtypes.get(name, torch.float32)) for name, shape in shapes.items()}
    kwargs.update(loaded.fixed_kwargs)
    return _run_export(loaded.module, (), kwargs)


def _specialise_program(ep: torch.export.ExportedProgram, shapes: dict[str, tuple[int, ...]]
                        ) -> torch.export.ExportedProgram:
    """A .pt2 with static shapes is used as it is; one with dynamic dims is re-exported
    at the shapes given (resolve_input_shapes has checked them against its dims)."""
    inputs = program_inputs(ep)
    if all(isinstance(d, int) for shape, _ in inputs.values() for d in shape):
        return ep.run_decompositions({})
    flat: list[Any] = []
    for s in ep.graph_signature.input_specs:
        if s.kind.name != "USER_INPUT":
            continue
        name = getattr(s.arg, "name", None)
        if name is not None and name in inputs:
            flat.append(torch.zeros(shapes[name], dtype=inputs[name][1]))
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


@dataclass
class Source:
    kind: str  # "onnx" | "hf" | "pt2" | "module"
    files: list[str] = field(default_factory=list)


def build_graph(model: Any, input_shape: Any = None, input_dtypes: Mapping[str, Any] | None = None
                ) -> tuple[Graph, Source]:
    """Frontend only: the imported (unoptimised) graph, and what it was read from."""
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx"):
        from npuc.compiler.onnx_frontend import import_onnx, load_onnx

        if not os.path.isfile(model):
            raise NpucError("NPUC-E0401", f"model path {os.fspath(model)!r} does not exist",
                            "pass a .onnx or .pt2 file or a Hugging Face checkpoint folder", exit_code=EXIT_IO)
        onnx_model = load_onnx(os.fspath(model))
        shapes = resolve_input_shapes(input_shape, onnx_model.inputs)
        return import_onnx(onnx_model, shapes), Source("onnx", onnx_model.files)
    loaded = load_source(model)
    for name, dt in (input_dtypes or {}).items():
        loaded.input_dtypes[name] = _torch_dtype(dt)
    shapes = resolve_input_shapes(input_shape, declared_inputs(loaded))
    ep = _export(loaded, shapes)
    graph = import_exported_program(ep, loaded.resolve, output_names=_output_names(ep))
    return graph, Source(loaded.kind, loaded.files)


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
    graph, source = build_graph(model, input_shape, input_dtypes)
    graph = PassManager(default_pipeline(), verify_each=debug).run(graph)
    meta = {"source_kind": source.kind, "input_shape": str(input_shape)}
    low = lower(graph, target, meta)
    try:
        write_om(low, out_path)
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot write {out_path!r}: {e.strerror}", "check the output path",
                        exit_code=EXIT_IO) from None
    log.info("wrote %s", out_path)
    return out_path
