"""The compile driver: source -> frontend -> passes -> backend -> `.om`."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec

from npuc.backend.lower import Lowered, lower, weight_chunks
from npuc.backend.memory_plan import align_up
from npuc.backend.om_format import WEIGHTS_ALIGN, Chunk, FileRange, FileSequenceHash, OmWriter
from npuc.backend.om_image import WeightImage
from npuc.backend.om_sections import METADATA, split_model
from npuc.backend.targets import Target, check_dtypes, check_fits, dtypes_used, get_target
from npuc.backend.writer import WEIGHTS
from npuc.compiler import instrument, sharded
from npuc.compiler.flag_checks import (
    KV_CACHE_DTYPE_NAMES,
    MIXED,
    VERIFY,
    check_decode_tokens,
    check_input_format,
    check_input_layout,
    check_kv_cache_dtype,
    check_max_seq_len,
    check_mixed_tokens,
    check_prefill_logits,
    check_prefix_cache,
    check_speculative_tokens,
)
from npuc.compiler.loaders import LoadedModel, declared_inputs, load_source, program_inputs
from npuc.compiler.model_files import generation_meta, is_onnx, tokenizer_section
from npuc.compiler.mtp import build_mtp_programs, check_mtp, mtp_layer, mtp_pipelines, with_hidden
from npuc.compiler.progress import NullProgress, Progress
from npuc.compiler.recurrent import recurrences_as_ops
from npuc.compiler.rope_scaling import at_cache_length, cache_length, traceable
from npuc.compiler.shapes import resolve_input_shapes
from npuc.compiler.torch_frontend import import_exported_program, unsupported_ops
from npuc.compiler.weight_image import hashed_files, image_source
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph, Node, Value, distinct_outputs
from npuc.ir.evaluate import evaluate_value, reads_inputs
from npuc.passes.attention_fusion import hides_nothing, mask_window
from npuc.passes.decode_check import DecodeCheck, DecodeProbe
from npuc.passes.kv_cache import FROM_DATA, UNCHECKED, KVCache, LongTrace
from npuc.passes.last_token_logits import LAST_TOKEN, LastTokenLogits
from npuc.passes.manager import Pass
from npuc.passes.mask_analysis import mask_window_of
from npuc.passes.pipeline import default_pipeline, rope_table_pipeline
from npuc.passes.precision import check_mode
from npuc.passes.quantize import Quantize, check_quant
from npuc.passes.recurrent_state import BY_ROW, STATE_PREFIXES, has_recurrent_state

log = logging.getLogger("npuc")


def _export(loaded: LoadedModel, shapes: dict[str, tuple[int, ...]],
            extra: Mapping[str, Any] | None = None) -> torch.export.ExportedProgram:
    """One static trace at `shapes`; `extra` kwargs (the decode trace's position_ids) are
    bound as constants."""
    if loaded.program is not None:
        if extra:
            raise NpucError("NPUC-E0123", f"cannot compile a decode program from {loaded.kind!r} sources: the "
                            "program is traced already and cannot be traced one token further on",
                            "compile from the Hugging Face folder or the nn.Module", exit_code=EXIT_UNSUPPORTED)
        return _specialise_program(loaded.program, shapes)
    kwargs: dict[str, Any] = {
        name: torch.zeros(shape, dtype=loaded.input_dtypes.get(name, torch.float32)) for name, shape in shapes.items()}
    return _trace(loaded, kwargs, {**loaded.fixed_kwargs, **(extra or {})})


def _trace(loaded: LoadedModel, kwargs: dict[str, Any], fixed: Mapping[str, Any],
           dynamic_shapes: dict[str, Any] | None = None) -> torch.export.ExportedProgram:
    """torch.export of the module on `kwargs`, with `fixed` kwargs as constants; static
    traces come back decomposed (functional ATen), dynamic ones as traced."""
    # With dynamic shapes every fixed kwarg is bound: torch.export cannot take the spec of one
    # that forward reads through **kwargs (GPT's use_cache).
    bound = {k: v for k, v in fixed.items() if isinstance(v, torch.Tensor) or dynamic_shapes is not None}
    kwargs = {**kwargs, **{k: v for k, v in fixed.items() if k not in bound}}
    if dynamic_shapes is not None:
        dynamic_shapes = {**{k: None for k in kwargs}, **dynamic_shapes}
    # Each recurrence transformers names for its kernel hub becomes one op (compiler/recurrent.py);
    # RoPE that depends on the sequence length, tensor ops (compiler/rope_scaling.py)
    with recurrences_as_ops(loaded.module), traceable(loaded.module):
        if not bound:
            return _run_export(loaded.module, (), kwargs, dynamic_shapes)
        # A tensor kwarg would become a graph input; bound into forward it is a constant
        # the graph folds. Bound on the instance, not by a wrapper module, so parameter
        # names keep matching the checkpoint.
        module = loaded.module
        module.forward = functools.partial(type(module).forward.__get__(module), **bound)
        try:
            return _run_export(module, (), kwargs, dynamic_shapes)
        finally:
            del module.forward


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


def _run_export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                dynamic_shapes: dict[str, Any] | None = None) -> torch.export.ExportedProgram:
    try:
        with torch.no_grad():
            ep = torch.export.export(module, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=False)
            return ep if dynamic_shapes is not None else ep.run_decompositions({})
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


def build_graph(model: Any, input_shape: Any = None, input_dtypes: Mapping[str, Any] | None = None,
                fixed_kwargs: Mapping[str, Any] | None = None, *, trust_pickle: bool = False
                ) -> tuple[Graph, Source]:
    """Frontend only: the imported (unoptimised) graph, and what it was read from.
    `fixed_kwargs` are passed to a torch model's forward as constants (not inputs);
    `trust_pickle` loads a `.pt2` that needs pickle (running its code, compiler/pt2_safety.py)."""
    if is_onnx(model):
        from npuc.compiler.onnx_frontend import import_onnx, load_onnx

        if not os.path.isfile(model):
            raise NpucError("NPUC-E0401", f"model path {os.fspath(model)!r} does not exist",
                            "pass a .onnx or .pt2 file or a Hugging Face checkpoint folder", exit_code=EXIT_IO)
        onnx_model = load_onnx(os.fspath(model))
        shapes = resolve_input_shapes(input_shape, onnx_model.inputs, empty_ok=True)
        return import_onnx(onnx_model, shapes), Source("onnx", onnx_model.files)
    loaded = _load(model, input_dtypes, trust_pickle)
    # Fixed kwargs are no inputs: declared_inputs leaves them out of the shape check.
    loaded.fixed_kwargs.update(fixed_kwargs or {})
    graph = _import(loaded, _export(loaded, _shapes(loaded, input_shape), fixed_kwargs))
    return graph, Source(loaded.kind, loaded.files)


def _load(model: Any, input_dtypes: Mapping[str, Any] | None, trust_pickle: bool = False) -> LoadedModel:
    loaded = load_source(model, trust_pickle=trust_pickle)
    for name, dt in (input_dtypes or {}).items():
        loaded.input_dtypes[name] = _torch_dtype(dt)
    return loaded


def _shapes(loaded: LoadedModel, input_shape: Any) -> dict[str, tuple[int, ...]]:
    return resolve_input_shapes(input_shape, declared_inputs(loaded))


def _import(loaded: LoadedModel, ep: torch.export.ExportedProgram) -> Graph:
    return import_exported_program(ep, loaded.resolve, output_names=_output_names(ep))


def _torch_dtype(dt: Any) -> torch.dtype:
    if isinstance(dt, torch.dtype):
        return dt
    try:
        return DType(str(dt)).torch if str(dt) in DType.__members__ else getattr(torch, str(dt))
    except AttributeError:
        raise NpucError("NPUC-E0112", f"unknown input dtype {dt!r}", "use a name like int64, float32 or f16",
                        exit_code=EXIT_USAGE) from None


DECODE_TRACE_POSITION = 1


def source_hash(files: Sequence[str]) -> str:
    """XXH3-128 over the model's files (name, size, bytes), in name order: the same model
    gives the same hash wherever it lies."""
    return FileSequenceHash(hashed_files(files)).hexdigest()


# source_xxh3 until the weights are written: the hash comes from the reads that copy them.
_HASH_PENDING = "0" * 32


def _metadata(source: Source, target: str, **options: Any) -> dict[str, str]:
    """What made this .om: the compiler, the target, the options, the input model's
    hash. No paths or times, so the same inputs give the same bytes."""
    import npuc

    meta = {"compiler": f"npuc {npuc.__version__}", "target": target, "source_kind": source.kind}
    if source.files:
        meta["source_files"] = ",".join(sorted(os.path.basename(f) for f in source.files))
        meta["source_xxh3"] = _HASH_PENDING  # see _write
    for k, v in sorted(options.items()):
        if v is None or v == frozenset():
            continue
        meta[f"option.{k}"] = ",".join(sorted(v)) if isinstance(v, frozenset) else str(v)
    return meta


def _token_ids(prefill: Graph, max_seq_len: int) -> Value:
    """The prefill's token ids [batch, seq], its only input, with room after it to decode."""
    ints = [v for v in prefill.inputs if not v.type.dtype.is_float and v.type.rank == 2]
    if len(prefill.inputs) != 1 or len(ints) != 1:
        raise NpucError("NPUC-E0124", "--max_seq_len needs a model whose only input is the token ids [batch, seq]; "
                        "this one takes " + ", ".join(f"{v.name}: {v.type}" for v in prefill.inputs),
                        "export the model with input_ids alone (attention masks are built from positions)",
                        exit_code=EXIT_USAGE)
    _check_room(ints[0].type.shape[1], max_seq_len)
    return ints[0]


def _check_room(seq: int, max_seq_len: int) -> None:
    if max_seq_len <= max(seq, DECODE_TRACE_POSITION):
        raise NpucError("NPUC-E0124", f"--max_seq_len {max_seq_len} leaves no room to decode after the prefill "
                        f"length {seq}", f"give --max_seq_len of at least {max(seq, DECODE_TRACE_POSITION) + 1}",
                        exit_code=EXIT_USAGE)


def _onnx_programs(model: Any, input_shape: Any, max_seq_len: int, decode_tokens: int = 1
                   ) -> tuple[Graph, Graph, LongTrace, Source]:
    """build_programs for an ONNX causal LM exported with its KV cache (compiler/onnx_decode.py)."""
    from npuc.compiler.onnx_decode import onnx_programs

    if not os.path.isfile(model):
        raise NpucError("NPUC-E0401", f"model path {os.fspath(model)!r} does not exist",
                        "pass a .onnx or .pt2 file or a Hugging Face checkpoint folder", exit_code=EXIT_IO)
    progs = onnx_programs(os.fspath(model), input_shape, max_seq_len, DECODE_TRACE_POSITION, decode_tokens,
                          check_room=lambda seq: _check_room(seq, max_seq_len))
    _token_ids(progs.prefill, max_seq_len)
    tables = dataclasses.replace(_rope_tables(progs.full), slots=progs.slots, decode_tokens=decode_tokens)
    return progs.prefill, progs.decode, tables, Source("onnx", progs.files)


# A mask at max_seq_len too large to fold is evaluated to read its window, up to this size.
MASK_EVAL_BYTES = 1 << 28


def _long_window(g: Graph, n: Node) -> int | None:
    """An attention's mask at max_seq_len: 0 causal, w a sliding window, None another mask,
    FROM_DATA one computed from the tokens, UNCHECKED one neither read from how it is built
    (passes/mask_analysis.py) nor small enough to evaluate."""
    if n.op == "mla_attention":
        return 0 if n.attrs.get("causal") else None
    if len(n.inputs) == 3 or hides_nothing(n.inputs[3]):  # no mask, or the slot before sinks
        return int(n.attrs.get("window", 0)) if n.attrs.get("causal") else None
    q_len, k_len = n.inputs[0].type.shape[2], n.inputs[1].type.shape[2]
    if n.inputs[3].is_const:
        return None  # attention fusion read it already: not causal, not a window
    if reads_inputs(n.inputs[3]):
        return FROM_DATA
    window = mask_window_of(n.inputs[3], q_len, k_len)  # read from how it is built: any length
    if not isinstance(window, str):  # else UNKNOWN: evaluated where small enough
        return window
    values = evaluate_value(g, n.inputs[3], max_bytes=MASK_EVAL_BYTES)
    if values is None:
        return UNCHECKED
    return mask_window(values, q_len, k_len)


def _check_position_scaling(loaded: LoadedModel, max_seq_len: int) -> None:
    """Llama 4 scales the queries of its NoPE layers by log(floor((pos + 1) / floor_scale) + 1)
    * attn_scale + 1: 1 below floor_scale positions, which is where the decode program is
    traced, so a cache reaching past it would decode with the wrong scale."""
    cfg = getattr(loaded.module, "config", None)
    floor = getattr(cfg, "floor_scale", None)
    if loaded.kind == "hf" and getattr(cfg, "attn_temperature_tuning", False) and isinstance(floor, int) \
            and 0 in (getattr(cfg, "no_rope_layers", None) or []) and max_seq_len >= floor:
        raise NpucError("NPUC-E0123", f"cannot compile a decode program: the attention temperature of the "
                        f"model's NoPE layers changes at position {floor - 1} (floor_scale - 1), and decode would keep "
                        "the scale of its first positions",
                        f"give --max_seq_len of at most {floor - 1}", exit_code=EXIT_UNSUPPORTED)


def _layers(loaded: LoadedModel) -> int:
    """The layers a Hugging Face model's config declares (0 for other sources: not known)."""
    if loaded.kind != "hf":
        return 0
    n = getattr(getattr(loaded.module, "config", None), "num_hidden_layers", 0)
    return n if isinstance(n, int) and n > 0 else 0


def _rope_tables(full: Graph) -> LongTrace:
    """The distinct RoPE tables of the model traced at max_seq_len (rows for every position to
    cache), and each attention's window there."""
    full = instrument.run_pipeline(full, rope_table_pipeline()).graph
    tables: list[tuple[torch.Tensor, torch.Tensor]] = []
    windows: list[int | None] = []
    alibi: list[tuple[float, ...]] = []
    for n in full.nodes:
        if n.op in ("mla_attention", "fused_attention"):
            windows.append(_long_window(full, n))
            alibi.append(tuple(n.attrs.get("alibi", ())))
            if windows[-1] == UNCHECKED:
                log.warning("attention %s: its mask at --max_seq_len is too large to check for a sliding "
                            "window; decode attends every cached position", n.name)
        if n.op != "rope_lut" or not all(v.is_const for v in n.inputs[2:]):
            continue
        c, s = (v.const.load() for v in n.inputs[2:] if v.const is not None)
        if not any(torch.equal(c, tc) and torch.equal(s, ts) for tc, ts in tables):
            tables.append((c, s))
    return LongTrace(tables, windows, alibi=alibi if any(alibi) else ())


@at_cache_length  # RoPE whose frequencies depend on the length: compiler/rope_scaling.py
def _decode_inputs(model: Any, prefill: Graph, max_seq_len: int, input_dtypes: Mapping[str, Any] | None,
                   loaded: LoadedModel | None = None, *, trust_pickle: bool = False, slots: int = 0,
                   decode_tokens: int = 1) -> tuple[Graph, LongTrace]:
    """The model traced for one token (the decode program's source: of every slot, with
    slots), and the RoPE tables of the model traced at max_seq_len: two more static traces
    (build_programs derives both from the prefill's trace where the model traces at any
    length)."""
    ids = _token_ids(prefill, max_seq_len)
    batch = max(slots, ids.type.shape[0])
    loaded = loaded or _load(model, input_dtypes, trust_pickle)
    positions = (DECODE_TRACE_POSITION + torch.arange(decode_tokens)).repeat(batch, 1)
    decode = _import(loaded, _export(loaded, {ids.name: (batch, decode_tokens)}, {"position_ids": positions}))
    full = _import(loaded, _export(loaded, {ids.name: (ids.type.shape[0], max_seq_len)}))
    return decode, dataclasses.replace(_rope_tables(full), layers=_layers(loaded))


@at_cache_length  # RoPE whose frequencies depend on the length: compiler/rope_scaling.py
def build_programs(model: Any, input_shape: Any, input_dtypes: Mapping[str, Any] | None, max_seq_len: int,
                   *, trust_pickle: bool = False, decode_tokens: int = 1,
                   one_sequence: bool = False) -> tuple[Graph, Graph, LongTrace, Source]:
    """What `--max_seq_len` compiles, imported: the prefill program (the --input_shape
    tokens at positions 0..), the decode program (one token, traced at
    DECODE_TRACE_POSITION) and the RoPE tables of every position to cache.

    One torch.export, at a symbolic sequence length with position_ids as an input, gives
    all three: `_at_length` specialises it to each length and positions without tracing
    again. A model that does not trace at a symbolic length (a branch on it, a
    data-dependent size) is traced three times at static shapes instead.

    A batch of B > 1 token ids makes B slots: prefill and the long trace run one sequence,
    decode all B (LongTrace.slots; passes/kv_cache.py), from a second trace at batch B.
    `decode_tokens` C > 1: decode runs C tokens of each slot a step (LongTrace.decode_tokens).
    `one_sequence`: decode is traced at batch 1 whatever the slots (the mixed step's rows,
    each of its own slot: LongTrace.mixed)."""
    _check_room(decode_tokens, max_seq_len - DECODE_TRACE_POSITION)
    if is_onnx(model) and one_sequence:
        raise NpucError("NPUC-E0124", "--mixed_tokens with an ONNX model is not supported yet",
                        "compile the model's PyTorch or Hugging Face form, or leave --mixed_tokens out",
                        exit_code=EXIT_USAGE)
    if is_onnx(model):
        return _onnx_programs(model, input_shape, max_seq_len, decode_tokens)
    loaded = _load(model, input_dtypes, trust_pickle)
    shapes = _shapes(loaded, input_shape)
    source = Source(loaded.kind, loaded.files)
    _check_position_scaling(loaded, max_seq_len)
    slots = _slots(shapes)
    if slots > 1:
        shapes = {k: (1, *v[1:]) for k, v in shapes.items()}
    programs = _one_trace(loaded, shapes, max_seq_len, decode_tokens)
    if programs is not None and slots > 1 and not one_sequence:
        batched = _one_trace(loaded, {k: (slots, *v[1:]) for k, v in shapes.items()}, max_seq_len, decode_tokens)
        programs = None if batched is None else (programs[0], batched[1], programs[2], batched[3], *programs[4:])
    if programs is not None:
        try:
            prefill, decode, full = (_import(loaded, ep) for ep in programs[:3])
            tables = _rope_tables(full)
        except NpucError as e:
            log.debug("the programs of one trace do not import (%s): tracing each length", e)
        else:
            tables = dataclasses.replace(tables, layers=_layers(loaded), slots=slots, decode_tokens=decode_tokens,
                                         probe=_probe(loaded, programs))
            if tables.tables:
                _token_ids(prefill, max_seq_len)
                return prefill, decode, tables, source
            # No RoPE: a model whose positions are learned or computed embeddings of its
            # position ids decodes with those ids an input; one that reads none (NoPE, a
            # state-space model) decodes as traced, and the decode check runs it token by token
            # (positions baked in otherwise show there); else the static traces say why not.
            try:
                with_ids = _import(loaded, programs[3])
            except NpucError as e:
                log.debug("the decode program with position ids does not import (%s)", e)
            else:
                if any(v.name == POSITIONS and v.uses for v in with_ids.inputs):
                    _token_ids(prefill, max_seq_len)
                    return prefill, with_ids, dataclasses.replace(tables, decode_positions=POSITIONS), source
                if not any(v.name == POSITIONS for v in decode.inputs):
                    _token_ids(prefill, max_seq_len)
                    return prefill, decode, tables, source
    prefill = _import(loaded, _export(loaded, shapes))
    decode, tables = _decode_inputs(model, prefill, max_seq_len, input_dtypes, loaded,
                                    slots=1 if one_sequence else slots, decode_tokens=decode_tokens)
    return prefill, decode, dataclasses.replace(tables, slots=slots, decode_tokens=decode_tokens), source


def _probe(loaded: LoadedModel, programs: tuple[torch.export.ExportedProgram, ...]) -> Graph | None:
    """The short prefill the decode check runs (PROBE_TOKENS), where the one trace gave one."""
    if len(programs) < 5:
        return None
    try:
        return _import(loaded, programs[4])
    except NpucError as e:
        log.debug("the short prefill for the decode check does not import (%s): it runs the prompt's", e)
        return None


def _slots(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The sequences a --max_seq_len compile caches at once: the token ids' batch."""
    batches = {v[0] for v in shapes.values() if len(v) == 2}
    return batches.pop() if len(batches) == 1 else 1


# The forward kwarg the one trace takes as an input; each program has it as a constant.
POSITIONS = "position_ids"
# The prefill length the decode-check pass runs (passes/decode_check.py), where the prompt is
# longer and the one trace gives that length too: its reference kernels then cost a few
# tokens' work at compile time, not three prompts' (LongTrace.probe)
PROBE_TOKENS = 8
# Size checks on the symbolic length; at a static length they are settled (see _at_length).
_SIZE_CHECKS = frozenset({"aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default",
                          "aten.sym_constrain_range.default"})


class _NotStatic(Exception):
    """A program traced at a symbolic length does not specialise to this one."""


def _one_trace(loaded: LoadedModel, shapes: dict[str, tuple[int, ...]], max_seq_len: int, decode_tokens: int = 1
               ) -> tuple[torch.export.ExportedProgram, ...] | None:
    """Prefill, decode and max_seq_len programs from one trace, or None where the model
    needs a trace per length."""
    ids = [n for n, shape in shapes.items() if len(shape) == 2 and not loaded.input_dtypes.get(
        n, torch.float32).is_floating_point]
    if loaded.program is not None or len(shapes) != 1 or len(ids) != 1 or POSITIONS in loaded.fixed_kwargs:
        return None  # not a decodable torch model: the static path says why
    batch, seq = shapes[ids[0]]
    _check_room(seq, max_seq_len)
    length = torch.export.Dim("seq_len", min=1, max=max_seq_len)
    kwargs = {ids[0]: torch.zeros((batch, seq), dtype=loaded.input_dtypes[ids[0]])}
    dims = {ids[0]: {1: length}}
    if _takes_positions(loaded.module):
        kwargs[POSITIONS] = torch.arange(seq).repeat(batch, 1)
        dims[POSITIONS] = {1: length}
    try:
        ep = _trace(loaded, kwargs, loaded.fixed_kwargs, dims)
        prefill = _at_length(ep, ids[0], seq, 0)
        if _mutates(prefill) or unsupported_ops(prefill):
            # An op npuc imports only in functional ATen, or one that writes in place.
            ep = _decomposed(ep)
            prefill = _at_length(ep, ids[0], seq, 0)
        c = decode_tokens
        probe = max(PROBE_TOKENS, c + 1)
        return (prefill, _at_length(ep, ids[0], c, DECODE_TRACE_POSITION), _at_length(ep, ids[0], max_seq_len, 0),
                _at_length(ep, ids[0], c, DECODE_TRACE_POSITION, keep_positions=True),
                *([_at_length(ep, ids[0], probe, 0)] if probe < seq else []))
    except Exception as e:  # noqa: BLE001 - any failure here (a torch version whose export internals
        # differ, too) only costs the static traces, which say what is wrong if anything is
        log.debug("no single trace at a symbolic length for this model (%s): tracing each length", e)
        return None


def _takes_positions(module: Any) -> bool:
    """Whether the model's forward names position ids (a state-space model's takes none: its
    one trace has the token ids alone)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    return POSITIONS in params


def _decomposed(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    try:
        with torch.no_grad():
            return ep.run_decompositions({})
    except Exception as e:
        raise _NotStatic(f"run_decompositions: {e}") from e


def _mutates(ep: torch.export.ExportedProgram) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in ep.graph.nodes if n.op == "call_function")


def _at_length(ep: torch.export.ExportedProgram, ids: str, n: int, start: int, keep_positions: bool = False
               ) -> torch.export.ExportedProgram:
    """`ep`, traced at a symbolic length, as the static program of `n` tokens at positions
    start..start+n-1: each size computation becomes its value, each symbolic shape its
    size, and the position_ids input a constant (with `keep_positions`, an input still).
    The ops are copied, not traced again; export has checked that the graph holds for
    every length in the Dim's range."""
    placeholders = {p.name: p for p in ep.graph.nodes if p.op == "placeholder"}
    sig = ep.graph_signature
    # A model that takes no position ids (a state-space model's forward) is traced without them
    has_positions = any(s.kind == InputKind.USER_INPUT and getattr(s.arg, "name", None) == POSITIONS
                        for s in sig.input_specs)
    length = placeholders[ids].meta["val"].shape[1]
    if not isinstance(length, torch.SymInt) or not isinstance(length.node.expr, sympy.Symbol):
        raise _NotStatic(f"the sequence length of {ids} was traced as {length}")
    subs = {length.node.expr: sympy.Integer(n)}

    def value(x: Any) -> Any:
        if not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return x
        e = x.node.expr.xreplace(subs)
        if e.free_symbols:
            raise _NotStatic(f"a size depends on {sorted(map(str, e.free_symbols))}, not only the length")
        return bool(e) if isinstance(x, torch.SymBool) else int(e) if isinstance(x, torch.SymInt) else float(e)

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty([value(d) for d in x.shape], dtype=x.dtype, device="meta")
        return value(x)

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            env[node] = value(val)
            continue
        if node.op == "call_function" and str(node.target) in _SIZE_CHECKS:
            if node.args and torch.fx.map_arg(node.args[0], env.__getitem__) is False:
                raise _NotStatic(f"length {n} fails the traced check {node.args[1:]}")
            continue
        new = graph.node_copy(node, env.__getitem__)
        if "val" in node.meta:
            new.meta["val"] = torch.utils._pytree.tree_map(meta, val)
        env[node] = new
    batch = value(placeholders[ids].meta["val"].shape[0])
    positions = torch.arange(start, start + n, dtype=torch.int64).expand(batch, n)
    specs = [InputSpec(InputKind.CONSTANT_TENSOR, s.arg, POSITIONS)
             if s.kind == InputKind.USER_INPUT and getattr(s.arg, "name", None) == POSITIONS and not keep_positions
             else s for s in sig.input_specs]
    constants = dict(ep.constants) if keep_positions or not has_positions else \
        {**ep.constants, POSITIONS: positions.contiguous()}
    return torch.export.ExportedProgram(
        root=ep.graph_module, graph=graph, graph_signature=ExportGraphSignature(specs, list(sig.output_specs)),
        state_dict=ep.state_dict, range_constraints={}, module_call_graph=ep.module_call_graph,
        constants=constants, verifiers=ep.verifiers)


def read_keep_dtype(keep: str | os.PathLike[str] | Sequence[str] | None, flag: str = "--keep_dtype"
                    ) -> frozenset[str]:
    """Node names from a --keep_dtype (or other `flag`) file (one a line, # comments) or a list."""
    if keep is None:
        return frozenset()
    if not isinstance(keep, (str, os.PathLike)):
        return frozenset(keep)
    try:
        with open(keep) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read {flag} file {os.fspath(keep)!r}: {e.strerror}",
                        "give a text file with one name a line", exit_code=EXIT_IO) from None
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
    max_seq_len: int | None = None,
    prefill_logits: str | None = None,
    decode_tokens: int | None = None,
    speculative_tokens: int | None = None,
    mtp: bool = False,
    mixed_tokens: int | None = None,
    prefix_cache: int | None = None,
    quant_type: str | None = None,
    group_size: int | None = None,
    quant_exclude: str | os.PathLike[str] | Sequence[str] | None = None,
    quant_strict: bool = False,
    kv_cache_dtype: str | None = None,
    out_nodes: str | Sequence[str] | None = None,
    input_format: str = "ND",
    depfile: str | os.PathLike[str] | None = None,
    extra_deps: Sequence[str] = (),
    progress: Progress | None = None,
    trust_pickle: bool = False,
    tp: int | None = None,
    ep: int | None = None,
    plan: list[sharded.RankPlan] | None = None,
    weight_image: WeightImage | None = None,
) -> str:
    """Compile `model` to `<output>.om` and return that path.

    `debug` runs the verifier after every pass. `dump_ir_after` ("all", or pass
    names) writes the textual IR into `dump_dir` after those passes; `time_passes`
    prints each pass's wall time to stderr; `fusion_report` writes a JSON report of
    what each rewrite rule matched, applied and refused (see compiler/instrument.py).
    `precision_mode` picks compute dtypes (passes/precision.py); `keep_dtype` names ops
    (a file with one node name a line, or a list) that keep their precision.
    `max_seq_len` makes a causal LM's `.om` hold two programs over one KV cache of
    that many positions: `prefill` (the --input_shape length, from position 0) and
    `decode` (one token at the `position` input); see passes/kv_cache.py.
    `prefill_logits` ("last", the default there, or "all"): whether prefill computes the
    logits of the row its `last_token` input names only, or of every row
    (passes/last_token_logits.py). `quant_type` ("w8a16", "w4a16") with `group_size`
    (32, 64, 128) stores matrix weights as integers (passes/quantize.py); `quant_exclude`
    names weights or nodes to leave as they are (a file, one a line, or a list), and
    `quant_strict` refuses a weight the group does not fit instead of storing it in int8.
    `speculative_tokens` K (with `max_seq_len`) adds a third program, `verify`: K + 1 tokens
    of each slot a step, every row's logits (speculative decoding's check of K drafted
    tokens, and prompt chunks after a prefix-cache hit: apps/speculative.py). `mtp` (with it)
    compiles the checkpoint's multi-token-prediction layer as three draft programs beside them
    (compiler/mtp.py).
    `mixed_tokens` C (with `max_seq_len`) adds the `mixed` program: B + C rows a step (B the
    slots), each of its own slot at its own position (a `slot` input [B + C]), every row's
    logits: each decoding slot's token beside a prompt's next C tokens (apps/scheduler.py).
    `prefix_cache` P (with `max_seq_len`) adds a pool of P prompt prefixes to the state
    region, each up to max_seq_len positions of every cache (backend/lower.py).
    `kv_cache_dtype` (with `max_seq_len`): the key and value caches' dtype, "auto" (the
    default: the model's, converted with its attention by the precision mode), "f32",
    "bf16", "f16" or "int8" (per head and per token, with scales; docs/precision.md).
    `out_nodes` ("name;name:1", ATC's syntax) picks the
    graph outputs; `input_format` (ND, NCHW) is checked against the inputs and recorded.
    `depfile` gets Make rules naming every file read (plus `extra_deps`, e.g. a config
    file); `progress` hears of each stage. `trust_pickle` loads a `.pt2` whose payload
    needs pickle, which runs code from the file (refused by default: compiler/pt2_safety.py).
    `tp` (> 1) writes one `.om` per rank of a tensor-parallel split and `<output>.om` as
    their manifest; `ep` (1 or `tp`) splits MoE experts across the ranks (compiler/sharded.py).
    `plan` (a list) receives each rank's sizes and nothing is written (`npuc plan`: a config
    alone, `config.json`, is enough).
    `weight_image` (compiler/weight_image.py `start`, which the command line calls before
    importing this module) has been copying the weights section's opening bytes into the
    output meanwhile: the writer adopts them, or discards them where the lowering lays the
    weights out otherwise; a caller whose compile fails discards it.
    Every option is checked before the model is read."""
    progress = progress or NullProgress()
    target = get_target(soc_version)
    mode, keep = check_mode(precision_mode), read_keep_dtype(keep_dtype)
    check_max_seq_len(max_seq_len)
    check_decode_tokens(decode_tokens, max_seq_len)
    check_speculative_tokens(speculative_tokens, max_seq_len, tp)
    check_mtp(mtp, speculative_tokens, tp)
    if mtp:
        mtp_layer(model)  # the checkpoint's config and index: refused before anything is traced
    check_mixed_tokens(mixed_tokens, max_seq_len, tp)
    check_prefix_cache(prefix_cache, max_seq_len, tp)
    prefill_logits = check_prefill_logits(prefill_logits, max_seq_len)
    quant = check_quant(quant_type, group_size)
    exclude = read_keep_dtype(quant_exclude, "--quant_exclude") if quant else frozenset()
    quantize = Quantize(quant[0], quant[1], exclude, bool(quant_strict), quant[2]) if quant else None
    kv_dtype = check_kv_cache_dtype(kv_cache_dtype, max_seq_len)
    input_format = check_input_format(input_format)
    world, expert_parallel = sharded.check_parallel(tp, ep)
    passes = pipelines(mode, keep, target, max_seq_len, prefill_logits=prefill_logits,
                       quantize=quantize, kv_cache_dtype=kv_dtype)[0]  # for --dump-ir-after
    dumper = instrument.IRDumper.create(dump_ir_after, dump_dir, passes)
    out_path = os.fspath(output)
    if not out_path.endswith(".om"):
        out_path += ".om"
    instrument.ensure_parent(out_path, "--output")
    report_path = os.fspath(fusion_report) if fusion_report is not None else None
    if report_path is not None:
        instrument.ensure_parent(report_path, "--fusion-report")
    depfile_path = os.fspath(depfile) if depfile is not None else None
    if depfile_path is not None:
        instrument.ensure_parent(depfile_path, "--depfile")
    progress.stage("import")
    decode_graph: Graph | None = None
    if max_seq_len is None:
        graph, source = build_graph(model, input_shape, input_dtypes, trust_pickle=trust_pickle)
    else:
        graph, decode_graph, tables, source = build_programs(model, input_shape, input_dtypes, max_seq_len,
                                                             trust_pickle=trust_pickle,
                                                             decode_tokens=decode_tokens or 1)
        if speculative_tokens:  # the decode program again, at K + 1 tokens of each slot
            verify_graph, verify_tables = build_programs(model, input_shape, input_dtypes, max_seq_len,
                                                         trust_pickle=trust_pickle,
                                                         decode_tokens=speculative_tokens + 1)[1:3]
            verify_tables = dataclasses.replace(verify_tables, by_row=True)  # a recurrent state's rollback
        if mixed_tokens:  # the decode program again, at batch 1: a row for each slot and the prompt's C
            mixed_graph, mixed_tables = build_programs(model, input_shape, input_dtypes, max_seq_len,
                                                       trust_pickle=trust_pickle, one_sequence=True,
                                                       decode_tokens=max(tables.slots, 1) + mixed_tokens)[1:3]
            mixed_tables = dataclasses.replace(mixed_tables, mixed=True)
        if mtp:  # the checkpoint's MTP layer, at the prompt's, one and K + 1 rows a slot
            with cache_length(max_seq_len):
                mtp_progs = build_mtp_programs(model, tables.slots, _token_ids(graph, max_seq_len).type.shape[1],
                                               (speculative_tokens or 0) + 1, max_seq_len, DECODE_TRACE_POSITION,
                                               lambda m, shapes, fixed: _import(m, _export(m, dict(shapes), fixed)),
                                               _rope_tables)
    select_outputs(graph, out_nodes)
    check_input_layout(graph, input_format)
    meta = _metadata(source, target.name, input_shape=input_shape, precision_mode=mode, keep_dtype=keep,
                     max_seq_len=max_seq_len, decode_tokens=decode_tokens, soc_version=soc_version,
                     speculative_tokens=speculative_tokens, mtp=mtp or None, mixed_tokens=mixed_tokens, prefix_cache=prefix_cache,
                     out_nodes=out_nodes, quant_type=quant_type,
                     group_size=quant[1] if quant else None,
                     kv_cache_dtype=KV_CACHE_DTYPE_NAMES[kv_dtype] if kv_dtype is not None else None,
                     quant_exclude=exclude or None,
                     input_format=None if input_format == "ND" else input_format,
                     tp=world if world > 1 else None, ep=(world if expert_parallel else 1) if world > 1 else None)
    extra: dict[str, bytes] = {}
    if decode_graph is not None and max_seq_len is not None:
        select_outputs(decode_graph, out_nodes)
        passes, decode_passes, *more = pipelines(mode, keep, target, max_seq_len, tables, prefill_logits, quantize,
                                                 kv_dtype, verify_tables if speculative_tokens else None,
                                                 mixed_tables if mixed_tokens else None)
        if mtp:  # the main programs return their hidden state; the MTP programs' passes
            passes, decode_passes, *more = (with_hidden(p) for p in (passes, decode_passes, *more))
            mtp_passes = mtp_pipelines(
                mtp_progs, lambda kv: default_pipeline(mode, keep, target.matrix_tile, target.max_head_dim, kv,
                                                       quantize=quantize, quant_activations=target.quant_activations),
                align_up(max_seq_len, target.matrix_tile), DECODE_TRACE_POSITION, kv_dtype)
        graph.name = "prefill"
        decode_graph.name = "decode"
        if speculative_tokens:
            select_outputs(verify_graph, out_nodes)
            verify_graph.name, verify_passes = VERIFY, more.pop(0)
        if mixed_tokens:
            select_outputs(mixed_graph, out_nodes)
            mixed_graph.name, mixed_passes = MIXED, more.pop(0)
        gen_meta, read = generation_meta(model, max_seq_len)
        meta.update(gen_meta)
        extra, tok_files = tokenizer_section(model)
        extra_deps = [*extra_deps, *read, *tok_files]
    tails: list[list[Pass]] = []
    if world > 1 or plan is not None:  # the passes after fusion run once per rank, after the split
        (passes, tail), (decode_passes, decode_tail) = (sharded.split_pipeline(passes),
                                                        sharded.split_pipeline(decode_passes)
                                                        if decode_graph is not None else ([], []))
        tails = [tail, decode_tail] if decode_graph is not None else [tail]
        if speculative_tokens:
            verify_passes, verify_tail = sharded.split_pipeline(verify_passes)
            tails.append(verify_tail)
    if decode_graph is not None and max_seq_len is not None and tables.probe is not None:
        passes = _probe_first(tables.probe, passes, debug)
    progress.stage("optimise", len(passes))
    run = instrument.run_pipeline(graph, passes, verify_each=debug, dumper=dumper, on_pass=progress.advance)
    graphs = [run.graph]
    if decode_graph is not None:
        # What prefill computes (recorded once known): "last" by default, "all" where the model's
        # logits do not come from an LM head the pass can follow (it warned).
        # (a recurrent model's prefill takes last_token whatever it computes: the row whose state it keeps)
        one_row = any(v.name == LAST_TOKEN for v in run.graph.inputs) and run.graph.outputs[0].type.rank == 3 \
            and run.graph.outputs[0].type.shape[1] == 1
        meta["option.prefill_logits"] = "last" if one_row else "all"
        if has_recurrent_state(run.graph):  # what generate and serve must know (apps/scheduler.py)
            meta["recurrent_state"] = ",".join(sorted(n for n in run.graph.states if n.startswith(STATE_PREFIXES)))
        progress.stage("optimise decode", len(decode_passes))
        decode_run = instrument.run_pipeline(decode_graph, decode_passes, verify_each=debug,
                                             on_pass=progress.advance)
        graphs.append(decode_run.graph)
        if speculative_tokens:
            progress.stage("optimise verify", len(verify_passes))
            graphs.append(instrument.run_pipeline(verify_graph, verify_passes, verify_each=debug,
                                                  on_pass=progress.advance).graph)
            if by_row := sorted(n for n in graphs[-1].states if n.endswith(BY_ROW)):
                meta["recurrent_rollback"] = ",".join(by_row)  # apps/scheduler.py undoes a rejected draft
        if mixed_tokens:
            progress.stage("optimise mixed", len(mixed_passes))
            graphs.append(instrument.run_pipeline(mixed_graph, mixed_passes, verify_each=debug,
                                                  on_pass=progress.advance).graph)
        if mtp:
            for name, g in mtp_progs.graphs.items():
                progress.stage(f"optimise {name}", len(mtp_passes[name]))
                graphs.append(instrument.run_pipeline(g, mtp_passes[name], verify_each=debug,
                                                      on_pass=progress.advance).graph)
    if time_passes:
        print(instrument.format_timings(run), file=sys.stderr)
    if report_path is not None:
        instrument.write_fusion_report(report_path, instrument.fusion_report(run))
    if plan is not None:
        plan.extend(sharded.compile_ranks(graphs, tails, world, expert_parallel, target, meta, out_path, progress,
                                          None, debug=debug))
        return out_path
    if world > 1:
        def write_model() -> None:
            sharded.compile_ranks(graphs, tails, world, expert_parallel, target, meta, out_path, progress,
                                  lambda low, path: _write(low, path, extra, source.files, progress.advance),
                                  debug=debug)
    else:
        check_dtypes(target, dtypes_used(graphs))
        progress.stage("plan memory")
        low = lower(graphs, target, meta, image_source(source.kind, source.files, world))
        check_fits(target, low.weights_bytes, low.arena_bytes, low.state_bytes)
        if weight_image is not None and weight_image.source != low.image:
            weight_image.discard()  # copied ahead in vain: the weights are laid out one by one
            weight_image = None
        if low.image is not None:
            log.info("weights: the section begins with %s (%d bytes, %s)", low.image.path, low.image.length,
                     "copied ahead" if weight_image is not None else "copied with the rest")
        progress.stage("write", low.weights_bytes)
        image = weight_image

        def write_model() -> None:
            _write(low, out_path, extra, source.files, progress.advance, image)
    try:
        write_model()
        if depfile_path is not None:
            deps = [*source.files, *([target.path] if target.path else []),
                    *([os.fspath(keep_dtype)] if isinstance(keep_dtype, (str, os.PathLike)) else []), *extra_deps]
            write_depfile(depfile_path, out_path, deps)
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot write {e.filename or out_path!r}: {e.strerror}",
                        "check the output path", exit_code=EXIT_IO) from None
    progress.done()
    log.info("wrote %s", out_path)
    return out_path


def _write(low: Lowered, path: str, extra: Mapping[str, bytes], files: Sequence[str],
           on_bytes: Callable[[int], None], image: WeightImage | None = None) -> None:
    """writer.write_om, with the weights copied file to file where they are stored as they
    are (weight_chunks' FileRanges), and the input model's hash (metadata source_xxh3)
    taken from the reads that hash them: so the metadata section is written last. An
    `image` copied ahead brings that hash along, where it hashes the same files."""
    sections = split_model(low.model)
    if image is not None and image.model_hash is not None and image.hashed_files == hashed_files(files):
        model_hash: FileSequenceHash | None = image.model_hash
    else:
        model_hash = FileSequenceHash(hashed_files(files), _stored_ranges(low)) if files else None

    def metadata() -> bytes:
        assert model_hash is not None
        digest = model_hash.hexdigest()
        for entry in low.model.metadata:
            if entry.key == "source_xxh3":
                entry.value = digest
        return split_model(low.model)[METADATA]

    def counted(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for c in chunks:
            yield c
            on_bytes(len(c))

    with OmWriter(path) as w:
        for name, data in sections.items():
            if name == METADATA and model_hash is not None:
                w.add_late_section(name, len(data), metadata)
            else:
                w.add_section(name, data)
        for name in sorted(extra):
            w.add_section(name, extra[name])
        w.add_streamed_section(WEIGHTS, counted(weight_chunks(low, ranges=True)), low.weights_bytes,
                               WEIGHTS_ALIGN, also=model_hash, first=low.image is not None, image=image)


def _stored_ranges(low: Lowered) -> list[FileRange]:
    """The file ranges weight_chunks(low, ranges=True) will give, in its order (read off
    the sources, nothing loaded): the model's hash plans which to take from the copy."""
    out = [low.image] if low.image is not None else []
    for v in low.weights[low.pinned:]:
        where = getattr(v.const, "file_range", None)
        stored = where(v.type) if where is not None else None
        if stored is not None:
            out.append(FileRange(*stored))
    return out


def _probe_first(probe: Graph, passes: list[Pass], debug: bool) -> list[Pass]:
    """Run the prefill pipeline's head, through the decode check, on the short prefill
    (LongTrace.probe), which records what decode is checked against; the prompt-long prefill's
    own check then only screens its ops. Returns the prefill's passes so."""
    at = next((i for i, p in enumerate(passes) if isinstance(p, DecodeCheck)), None)
    if at is None:
        return passes
    probe.name = "prefill"
    instrument.run_pipeline(probe, passes[:at + 1], verify_each=debug)
    return [dataclasses.replace(p, record=False) if isinstance(p, DecodeCheck) else p for p in passes]


def pipelines(mode: str, keep: frozenset[str], target: Target, max_seq_len: int | None = None,
              trace: LongTrace | None = None, prefill_logits: str | None = None,
              quantize: Quantize | None = None, kv_cache_dtype: DType | None = None,
              verify: LongTrace | None = None, mixed: LongTrace | None = None) -> list[list[Pass]]:
    """The pass list of each program: the one program, or with `max_seq_len` prefill and
    decode over a KV cache of that many positions (the RoPE tables and attention windows
    from build_programs).
    `prefill_logits` as check_prefill_logits returns it: None (the default) computes the
    last row's logits where the model allows, "last" insists, "all" keeps every row.
    `kv_cache_dtype` as check_kv_cache_dtype returns it (None: auto). `verify` (the trace at
    --speculative_tokens + 1 tokens a step) adds the verify program's passes, a decode's;
    `mixed` (the trace at batch 1 of --mixed_tokens + slots rows) the mixed program's after it."""
    if max_seq_len is None:
        return [default_pipeline(mode, keep, target.matrix_tile, target.max_head_dim, quantize=quantize,
                                 quant_activations=target.quant_activations)]
    cache_len = align_up(max_seq_len, target.matrix_tile)
    last = None if prefill_logits == "all" else LastTokenLogits(required=prefill_logits == "last")
    probe = DecodeProbe()  # prefill's pipeline records it, decode's checks against it
    programs = [("prefill", 0, trace), ("decode", DECODE_TRACE_POSITION, trace)]
    if verify is not None:
        programs.append(("decode", DECODE_TRACE_POSITION, verify))
    if mixed is not None:
        programs.append(("decode", DECODE_TRACE_POSITION, mixed))
    return [default_pipeline(mode, keep, target.matrix_tile, target.max_head_dim,
                             KVCache(role, cache_len, t.tables, position, t.windows,
                                     t.decode_positions, t.layers, t.alibi, t.slots,
                                     t.decode_tokens, kv_cache_dtype, t.mixed, by_row=t.by_row) if t else
                             KVCache(role, cache_len, (), position, cache_dtype=kv_cache_dtype),
                             last if role == "prefill" else None,
                             quantize, quant_activations=target.quant_activations,
                             decode_check=DecodeCheck(role, probe, position_ids=bool(t and t.decode_positions))
                             if not (t and t.mixed) else None)  # the decode program of the same trace is checked
            for role, position, t in programs]


def select_outputs(g: Graph, spec: str | Sequence[str] | None) -> None:
    """ATC's --out_nodes: "name;name:index" (a value, or a node's index-th output) become
    the graph's outputs, in that order. Every unknown name is reported at once."""
    if spec is None:
        return
    items = [s.strip() for s in (spec.split(";") if isinstance(spec, str) else spec) if s.strip()]
    values = {v.name: v for v in g.values()}
    picked: list[Value] = []
    problems: list[str] = []
    for item in items:
        name, sep, idx = item.rpartition(":")
        if not sep or not idx.isdigit():
            name, idx = item, ""
        v = values.get(name)
        if v is not None and idx:
            node = v.producer
            v = node.outputs[int(idx)] if node is not None and int(idx) < len(node.outputs) else None
        if v is None:
            close = difflib.get_close_matches(name, list(values), n=1)
            problems.append(repr(item) + (f" (closest: {close[0]!r})" if close else ""))
        else:
            picked.append(v)
    if problems or not picked:
        raise NpucError("NPUC-E0127", f"--out_nodes: no value {', '.join(problems) or 'named'}",
                        "name values as `npuc compile --dump-ir-after=all` shows them (the frontend's 00-input.ir), "
                        "or node:index", exit_code=EXIT_USAGE)
    g.set_outputs(distinct_outputs(g, picked))


def _make_escape(path: str) -> str:
    return path.replace("\\", "\\\\").replace(" ", "\\ ").replace("#", "\\#").replace("$", "$$")


def write_depfile(path: str, target: str, deps: Sequence[str]) -> None:
    """Make syntax: `target: dep dep ...`, absolute paths, written atomically."""
    seen = list(dict.fromkeys(os.path.abspath(d) for d in deps))
    text = _make_escape(os.path.abspath(target)) + ": " + " \\\n  ".join(_make_escape(d) for d in seen) + "\n"
    instrument.write_text_atomic(path, text, "--depfile")
