"""Generation from ONNX: the programs `--max_seq_len` compiles, read from a causal LM
exported with its KV cache as inputs and outputs.

optimum's `text-generation-with-past` export and onnxruntime-genai's model builder spell
the cache alike: `past_key_values.<i>.key/value` inputs, concatenated before the new keys
(or handed to GroupQueryAttention), and `present.<i>.key/value` outputs. npuc keeps the
cache itself (passes/kv_cache.py), so each program is the model at past length 0, as a
torch model is traced with an empty cache: the past inputs are empty constants (their
Concat drops them, GroupQueryAttention takes them as no past), the present outputs are
dropped, and the attention mask and position ids are constants for the positions the
program runs at:

    prefill: input_ids [b, S]            positions 0..S-1
    decode:  input_ids [b, 1]            position `trace_position` (kv_cache moves it to run time)
    full:    input_ids [b, max_seq_len]  positions 0..max_seq_len-1: the RoPE tables, the windows

    attention_mask -> ones [b, S]        [b, 1] in decode ([b, position + 1] for a model
                                         with no position_ids input: its positions come from the mask)
    position_ids   -> [[0, 1, .., S-1]]  [[position]] in decode
    past_key_values.0.key [b, 2, past, 16] -> f32[b, 2, 0, 16], unread
    present.0.key                          -> not an output

The past length's dim (optimum's `past_sequence_length`) is 0 unless `--input_shape`
binds it, which must then be 0 too. A model without past inputs or present outputs is
refused (NPUC-E0123): nothing says it is an autoregressive LM.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from npuc.compiler.onnx_frontend import import_onnx, load_onnx
from npuc.compiler.shapes import DeclaredInput, dim_sizes, resolve_input_shapes, shape_at
from npuc.errors import EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import Graph

PAST = re.compile(r"past", re.IGNORECASE)
PRESENT = re.compile(r"present", re.IGNORECASE)
MASK = "attention_mask"
POSITIONS = "position_ids"


@dataclass(frozen=True)
class OnnxPrograms:
    prefill: Graph
    decode: Graph
    full: Graph
    files: list[str]
    slots: int = 1


def onnx_programs(path: str, input_shape: Any, max_seq_len: int, trace_position: int, decode_tokens: int = 1,
                  check_room: Callable[[int], None] | None = None) -> OnnxPrograms:
    """The prefill, decode and max_seq_len programs of the ONNX causal LM at `path`.
    `check_room(prefill length)` refuses a prefill the cache has no room after, before any
    program is built."""
    model = load_onnx(path)
    past = [n for n in model.inputs if PAST.search(n)]
    present = [o.name for o in model.proto.graph.output if PRESENT.search(o.name)]
    if not past or not present:
        raise NpucError("NPUC-E0123", "cannot compile a decode program from an ONNX model without its KV cache: "
                        f"it has no past_key_values.* inputs and present.* outputs (inputs: {', '.join(model.inputs)})",
                        "export it with the cache (optimum-cli export onnx --task text-generation-with-past), or "
                        "compile without --max_seq_len", exit_code=EXIT_UNSUPPORTED)
    past_dims = _past_dims(model.inputs, past)
    # The mask, the positions and the past are the programs' constants: their shapes need not
    # be given ("input_ids:1,8" is enough), and are checked where they are.
    declared = {n: dataclasses.replace(d, required=False) if n in (MASK, POSITIONS, *past) else d
                for n, d in model.inputs.items()}
    shapes = resolve_input_shapes(_with_past_zero(input_shape, past_dims), declared, empty_ok=True)
    sizes = dim_sizes(model.inputs, shapes)
    for name in past:
        if name in shapes and 0 not in shapes[name]:
            raise NpucError("NPUC-E0132", f"--max_seq_len compiles a prefill from position 0, but --input_shape "
                            f"gives {name!r} the shape {list(shapes[name])}", "leave the past length unbound (it is "
                            f"0), or bind it to 0: e.g. \"{next(iter(past_dims), 'past_sequence_length')}:0\"",
                            exit_code=EXIT_USAGE)
    ids = _token_input(model.inputs, past)
    dims = model.inputs[ids].dims
    seq = dims[1] if dims is not None and len(dims) == 2 else None
    if not isinstance(seq, str):
        raise NpucError("NPUC-E0124", f"--max_seq_len needs the token ids' length to be a dim the ONNX model leaves "
                        f"open; {ids!r} is {model.inputs[ids].describe()}",
                        "export the model with a dynamic sequence length", exit_code=EXIT_USAGE)
    batch, length = shapes[ids]
    if length == 0:
        raise NpucError("NPUC-E0124", f"--max_seq_len needs a prefill of at least one token; --input_shape gives "
                        f"{ids!r} the shape {list(shapes[ids])}", "bind the sequence length to 1 or more",
                        exit_code=EXIT_USAGE)
    if check_room is not None:
        check_room(length)

    batch_dim = dims[0] if dims is not None and isinstance(dims[0], str) else None
    if batch > 1 and batch_dim is None:
        raise NpucError("NPUC-E0124", f"--max_seq_len at batch {batch} caches {batch} sequences, one prefilled at a "
                        f"time; {ids!r} is {model.inputs[ids].describe()}, its batch fixed",
                        "export the model with a dynamic batch", exit_code=EXIT_USAGE)

    def program(n: int, start: int, what: str, batch: int) -> Graph:
        at = {**sizes, seq: n, **dict.fromkeys(past_dims, 0), **({batch_dim: batch} if batch_dim else {})}
        fixed: dict[str, torch.Tensor] = {name: torch.zeros(shape_at(model.inputs[name], at) or ()) for name in past}
        if POSITIONS in model.inputs:
            fixed[POSITIONS] = torch.arange(start, start + n).repeat(batch, 1)
        if MASK in model.inputs:
            fixed[MASK] = torch.ones(batch, n if POSITIONS in model.inputs else start + n, dtype=torch.int64)
        program_shapes = {}
        for name, decl in model.inputs.items():
            shape = tuple(fixed[name].shape) if name in fixed else shape_at(decl, at)
            if shape is None:
                raise NpucError("NPUC-E0123", f"cannot size ONNX input {name!r} ({decl.describe()}) for the {what} "
                                "program", "bind its dims with --input_shape", exit_code=EXIT_UNSUPPORTED)
            program_shapes[name] = shape
        try:
            g = import_onnx(model, program_shapes, fixed, past_elsewhere=start > 0)
        except NpucError as e:
            if what == "prefill":
                raise
            raise NpucError("NPUC-E0123", f"cannot compile a decode program from this ONNX model: its {what} program "
                            f"(input_ids [{batch}, {n}] at position {start}, past length 0) does not import: "
                            f"{e.message}", "compile without --max_seq_len", exit_code=EXIT_UNSUPPORTED) from e
        g.set_outputs([v for v in g.outputs if v.name not in present])
        return g

    # With a batch of B > 1 the cache holds B sequences: prefill fills one, decode runs them all.
    return OnnxPrograms(program(length, 0, "prefill", 1), program(decode_tokens, trace_position, "decode", batch),
                        program(max_seq_len, 0, f"max_seq_len ({max_seq_len})", 1), list(model.files), batch)


def _past_dims(declared: Mapping[str, DeclaredInput], past: Sequence[str]) -> list[str]:
    """The past length's dim names: the past inputs' symbolic dims that no other input has as
    a dim of its own (the attention mask's `past_sequence_length + sequence_length` is a sum)."""
    others = {d for n, decl in declared.items() if n not in past for d in (decl.dims or ())}
    return list(dict.fromkeys(d for n in past for d in (declared[n].dims or ())
                              if isinstance(d, str) and d not in others))


def _with_past_zero(input_shape: Any, past_dims: Sequence[str]) -> Any:
    """`input_shape` with each past-length dim bound to 0 where it does not bind it."""
    if isinstance(input_shape, Mapping):
        return {**{d: (0,) for d in past_dims}, **input_shape}
    text = str(input_shape or "")
    given = {item.rpartition(":")[0].strip() for item in text.split(";") if ":" in item}
    extra = [f"{d}:0" for d in past_dims if d not in given]
    return ";".join(filter(None, [text.strip().rstrip(";"), *extra]))


def _token_input(declared: Mapping[str, DeclaredInput], past: Sequence[str]) -> str:
    """The token ids: the one input besides the mask, the positions and the past."""
    rest = [n for n in declared if n not in past and n not in (MASK, POSITIONS)]
    if len(rest) != 1:
        raise NpucError("NPUC-E0124", f"--max_seq_len on an ONNX model needs the token ids as its one input besides "
                        f"{MASK}, {POSITIONS} and the past KV cache; this one has "
                        f"{', '.join(rest) if rest else 'none'}",
                        "export the model with input_ids, attention_mask, position_ids and past_key_values only",
                        exit_code=EXIT_USAGE)
    return rest[0]

