"""The compile driver: source -> frontend -> passes -> backend -> `.om`."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from npuc.backend.lower import lower
from npuc.backend.targets import check_dtypes, check_fits, get_target
from npuc.backend.writer import write_om
from npuc.compiler import instrument
from npuc.compiler.loaders import LoadedModel, declared_inputs, load_source, program_inputs
from npuc.compiler.shapes import resolve_input_shapes
from npuc.compiler.torch_frontend import import_exported_program
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph
from npuc.passes.pipeline import default_pipeline
from npuc.passes.precision import check_mode

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


def read_keep_dtype(keep: str | os.PathLike[str] | Sequence[str] | None) -> frozenset[str]:
    """Node names from a --keep_dtype file (one a line, # comments) or a list."""
    if keep is None:
        return frozenset()
    if not isinstance(keep, (str, os.PathLike)):
        return frozenset(keep)
    try:
        with open(keep) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read --keep_dtype file {os.fspath(keep)!r}: {e.strerror}",
                        "give a text file with one op name a line", exit_code=EXIT_IO) from None
    return frozenset(ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip())


def compile_model(
    model: Any,
    *,
    input_shape: Any = None,
    output: str,
    soc_version: str | None = None,
    input_dtypes: Mapping[str, Any] | None = None,
    debug: bool = False,
    dump_ir_after: str | Sequence[str] | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    time_passes: bool = False,
    fusion_report: str | os.PathLike[str] | None = None,
    precision_mode: str = "must_keep_origin_dtype",
    keep_dtype: str | os.PathLike[str] | Sequence[str] | None = None,
) -> str:
    """Compile `model` to `<output>.om` and return that path.

    `debug` runs the verifier after every pass. `dump_ir_after` ("all", or pass
    names) writes the textual IR into `dump_dir` after those passes; `time_passes`
    prints each pass's wall time to stderr; `fusion_report` writes a JSON report of
    what each rewrite rule matched, applied and refused (see compiler/instrument.py).
    `precision_mode` picks compute dtypes (passes/precision.py); `keep_dtype` names ops
    (a file with one node name a line, or a list) that keep their precision.
    Every option is checked before the model is read."""
    target = get_target(soc_version)
    passes = default_pipeline(check_mode(precision_mode), read_keep_dtype(keep_dtype), target.matrix_tile,
                              target.max_head_dim)
    dumper = instrument.IRDumper.create(dump_ir_after, dump_dir, passes)
    out_path = os.fspath(output)
    if not out_path.endswith(".om"):
        out_path += ".om"
    instrument.ensure_parent(out_path, "--output")
    report_path = os.fspath(fusion_report) if fusion_report is not None else None
    if report_path is not None:
        instrument.ensure_parent(report_path, "--fusion-report")
    graph, source = build_graph(model, input_shape, input_dtypes)
    run = instrument.run_pipeline(graph, passes, verify_each=debug, dumper=dumper)
    if time_passes:
        print(instrument.format_timings(run), file=sys.stderr)
    if report_path is not None:
        instrument.write_fusion_report(report_path, instrument.fusion_report(run))
    meta = {"source_kind": source.kind, "input_shape": str(input_shape)}
    used: dict[str, set[str]] = {}
    for v in run.graph.values():
        used.setdefault(v.type.dtype.value, set()).add(v.name)
    check_dtypes(target, used)
    low = lower(run.graph, target, meta)
    check_fits(target, low.weights_bytes, low.plan.arena_bytes)
    try:
        write_om(low, out_path)
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot write {out_path!r}: {e.strerror}", "check the output path",
                        exit_code=EXIT_IO) from None
    log.info("wrote %s", out_path)
    return out_path
