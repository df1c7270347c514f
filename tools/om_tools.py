"""Looking inside a `.om` without running it: `npuc info`, `npuc validate`, `npuc dump --json`.

    $ npuc info build/llama.om          # sizes, op and unit counts, target, metadata (--json: one object)
    $ npuc validate build/llama.om      # every checksum, every tensor in bounds, the memory plan re-checked
    ok: build/llama.om: 2 sections, 2 checksums, 96 tensors in bounds, memory plan of 60 buffers valid, ...
    $ npuc dump build/llama.om --json   # the whole model definition, as JSON

`info` and `dump --json` check the container's structure and every header
section's SHA-256 but never read the weights (no byte of them is touched or
hashed), so they stay quick on large models; `validate` checks everything (each
weights chunk's XXH3-128 too), with the checks every load runs
(runtime/om_validate.py: tensors, the ops against the registry, writes outside the
weights, indices, memory and its cap, metadata, tokenizer). It trusts nothing the
compiler recorded: it rebuilds the planner's `Buffer`s from `MemoryPlan.buffers` and
the tensor offsets and runs the same `validate_plan` the compiler ran, and checks
that each buffer is live at every step its tensor is used. So a plan damaged or
edited after compiling (even with fresh checksums) is reported here as a bad
file, not found later as wrong numbers.

Needs torch, numpy and protobuf only, like the rest of the runtime.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict

from npuc.backend.manifest import Manifest, open_rank, read_manifest
from npuc.backend.om_format import FORMAT_VERSION, OmFile
from npuc.backend.om_schema import ROLLBACK_SUFFIX
from npuc.backend.om_sections import MODEL_SECTIONS, join_model
from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError
from npuc.runtime.om_validate import check_structure, prefix_pool_size, prefix_pool_tensors, validate_model

__all__ = ["dump_json", "model_info", "render_info", "validate_om"]

WEIGHTS = "weights"

E_PARSE = "NPUC-E0405"

_HINT = "the file is damaged or was edited after compiling; recompile the model with `npuc compile`"


def _bad(code: str, message: str) -> NpucError:
    return NpucError(code, message, _HINT, exit_code=EXIT_IO)


@contextlib.contextmanager
def _open(path: str, *, verify_weights: bool) -> Iterator[tuple[OmFile, Any]]:
    """The open container and its parsed, structurally checked model definition.

    The container checks every header section's SHA-256 on open; `verify_weights` adds the
    weights' chunk checksums (a read of the whole file)."""
    with OmFile.open(path, verify=verify_weights) as om:
        manifest = read_manifest(om)
        if manifest is not None:  # the tools that take one model (export-onnx) take one rank's
            raise NpucError("NPUC-E0150", f"{path} is the manifest of {manifest.world} rank files, not one model",
                            f"name one rank's file, e.g. {manifest.rank_path(path, 0)}", exit_code=EXIT_USAGE)
        raw: dict[str, bytes] = {}
        for name in MODEL_SECTIONS:
            with om.section(name) as view:
                raw[name] = bytes(view)
        model = join_model(path, raw)
        check_structure(path, model)
        yield om, model


def _tensor_brief(t: Any) -> dict[str, Any]:
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}


def _sections(om: OmFile) -> list[dict[str, Any]]:
    return [{"name": s.name, "offset": s.offset, "size": s.size, "align": s.align, "checksum": s.checksum,
             "digest": s.digest} for s in om.section_info()]


# --- npuc info -------------------------------------------------------------------


def _program_info(m: Any, prog: Any) -> dict[str, Any]:
    return {
        "name": prog.name,
        "inputs": [_tensor_brief(m.tensors[i]) for i in prog.inputs],
        "outputs": [_tensor_brief(m.tensors[i]) for i in prog.outputs],
        "arena_bytes": prog.plan.arena_bytes,
        "lower_bound_bytes": prog.plan.lower_bound_bytes,
        "op_total": len(prog.ops),
        "op_counts": dict(sorted(Counter(o.op for o in prog.ops).items())),
        "unit_counts": dict(sorted(Counter(o.unit for o in prog.ops).items())),
    }


# Recurrent states (passes/recurrent_state.py): a fixed size per slot, not rows per position
_RECURRENT = ("ssm_state.", "delta_state.", "wkv_state.", "lru_state.", "linear_state.", "conv_window.")


def _caches(m: Any) -> list[Any]:
    """The KV (and conv) caches: state tensors [slots, heads, positions, d] (not the prefix pool's)."""
    pools = prefix_pool_tensors(m)
    return [t for i, t in enumerate(m.tensors) if t.region == "state" and not t.HasField("base") and len(t.shape) == 4
            and t.shape[0] and t.shape[2] and not t.name.startswith(_RECURRENT) and i not in pools]


def _recurrent_bytes_per_slot(m: Any, by_row: bool = False) -> int:
    """Bytes of one sequence's recurrent states (scan and delta-rule states, conv windows), or
    (`by_row`) of their copies after each verify row (--speculative_tokens: a draft's rollback)."""
    return sum(t.nbytes // t.shape[0] for t in m.tensors if t.region == "state" and not t.HasField("base")
               and t.name.startswith(_RECURRENT) and t.shape and t.shape[0]
               and t.name.endswith(ROLLBACK_SUFFIX) == by_row)


def _kv_bytes_per_token(m: Any) -> int:
    """State bytes per cached position of one sequence: its rows of every cache."""
    return sum(t.nbytes // (t.shape[0] * t.shape[2]) for t in _caches(m))


def _kv_cache_dtype(m: Any) -> str | None:
    """The key and value caches' dtype (--kv_cache_dtype's name: int8 for packed int8 rows),
    several joined by '/' (a cache per layer kept apart by --keep_dtype); None: no KV cache."""
    names = sorted({"int8" if t.dtype == "i8" else t.dtype for t in _caches(m)
                    if t.name.startswith("kv_cache.") and t.name.endswith((".k", ".v", ".latent"))})
    return "/".join(names) or None


def _kv_slots(m: Any) -> int:
    """Sequences the caches hold at once (their batch): --input_shape's batch with --max_seq_len."""
    return min((int(t.shape[0]) for t in _caches(m)), default=0)


def _manifest(path: str) -> Manifest | None:
    # Header sections only: a model's weights are checked where they are used (validate, a load).
    with OmFile.open(path, verify=False) as om:
        return read_manifest(om)


def _rank_path(path: str, manifest: Manifest, rank: int) -> str:
    """Rank `rank`'s file, after checking it is the one the manifest names (fingerprint)."""
    with open_rank(path, manifest, rank, verify=False) as om:
        return str(om.path)


def model_info(path: str) -> dict[str, Any]:
    """The facts `npuc info` reports, as plain JSON-able data with stable keys. The
    top-level program fields are the first program's; `programs` has each one, and
    `arena_bytes` is what the runtime allocates (the largest program's arena).
    A tensor-parallel manifest: rank 0's facts, with `parallel` (world, tp, ep) and
    `ranks` (each rank's file, weights, arena, state and KV bytes per token)."""
    manifest = _manifest(path)
    if manifest is not None:
        ranks = [model_info(_rank_path(path, manifest, r)) for r in range(manifest.world)]
        info = dict(ranks[0])
        info["parallel"] = {"world": manifest.world, "tp": manifest.tp, "ep": manifest.ep}
        info["ranks"] = [{"file": f.file, "weights_bytes": i["weights_bytes"], "arena_bytes": i["arena_bytes"],
                          "state_bytes": i["state_bytes"], "kv_cache_bytes_per_token": i["kv_cache_bytes_per_token"],
                          "wire_bytes_per_step": i["wire_bytes_per_step"]}
                         for f, i in zip(manifest.ranks, ranks, strict=True)]
        return info
    with _open(path, verify_weights=False) as (om, m):
        prog = m.programs[0]
        sections = _sections(om)
        regions = Counter(t.region for t in m.tensors)
        entries, pool_bytes = prefix_pool_size(m)
        return {
            "programs": [_program_info(m, p) for p in m.programs],
            "kv_cache_bytes_per_token": _kv_bytes_per_token(m),
            "kv_cache_dtype": _kv_cache_dtype(m),
            "kv_slots": _kv_slots(m),
            "kv_cache_bytes_per_slot": sum(t.nbytes // t.shape[0] for t in _caches(m)),
            "recurrent_state_bytes_per_slot": _recurrent_bytes_per_slot(m),
            "recurrent_rollback_bytes_per_slot": _recurrent_bytes_per_slot(m, by_row=True),
            "prefix_pool_entries": entries,
            "prefix_pool_bytes": pool_bytes,
            "format_version": FORMAT_VERSION,
            "file_bytes": max((s["offset"] + s["size"] for s in sections), default=0),
            "sections": sections,
            "producer": m.producer,
            "producer_version": m.producer_version,
            "target": m.target,
            "program": prog.name,
            "inputs": [_tensor_brief(m.tensors[i]) for i in prog.inputs],
            "outputs": [_tensor_brief(m.tensors[i]) for i in prog.outputs],
            "weights_bytes": m.weights_bytes,
            "arena_bytes": max(p.plan.arena_bytes for p in m.programs),
            "lower_bound_bytes": max(p.plan.lower_bound_bytes for p in m.programs),
            "state_bytes": m.state_bytes,
            "alignment": prog.plan.alignment,
            "tensor_counts": dict(sorted(regions.items())),
            "op_total": len(prog.ops),
            "op_counts": dict(sorted(Counter(o.op for o in prog.ops).items())),
            "unit_counts": dict(sorted(Counter(o.unit for o in prog.ops).items())),
            "metadata": {e.key: e.value for e in m.metadata},
            "wire_bytes_per_step": {p.name: _wire_bytes(m, p) for p in m.programs},
        }


def _wire_bytes(m: Any, prog: Any) -> int:
    """Bytes one rank sends per run of `prog` in its collectives (ir/collectives.py)."""
    if not any(o.op in ("all_reduce", "all_gather") for o in prog.ops):
        return 0  # and no registry (torch) needed
    from npuc.ir import DType, TensorType, all_ops
    from npuc.runtime.om_validate import attr_value

    ops = all_ops()
    total = 0
    for o in prog.ops:
        od = ops.get(o.op)  # info reads files validate would refuse: an unknown op moves nothing here
        wire = od.extra.get("wire_bytes") if od is not None else None
        if od is None or wire is None:
            continue
        try:
            ins = [TensorType(tuple(m.tensors[i].shape), DType(m.tensors[i].dtype)) for i in o.inputs]
            outs = [TensorType(tuple(m.tensors[i].shape), DType(m.tensors[i].dtype)) for i in o.outputs]
            total += int(wire(ins, outs, od.full_attrs({a.name: attr_value(a.value) for a in o.attrs})))
        except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, ArithmeticError):
            continue  # a damaged collective: validate says what is wrong with it
    return total


def _table(rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """Columns padded to their widest cell; `right` columns (numbers) right-aligned."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                      for c, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]


def _b(n: int) -> str:
    return f"{n:,} B"


def _sig(t: dict[str, Any]) -> str:
    return f"{t['name']}: {t['dtype']}[{','.join(map(str, t['shape']))}]"


def render_info(path: str, info: dict[str, Any]) -> str:
    """`npuc info`'s human form: a key/value table, then sections, ops, units and metadata."""
    tc = info["tensor_counts"]
    head = [
        ("file", f"{path} ({_b(info['file_bytes'])}, .om v{info['format_version']})"),
        ("producer", f"{info['producer']} {info['producer_version']}"),
        ("target", info["target"]),
        ("tensors", ", ".join(f"{n} {r}" for r, n in tc.items())),
    ]
    for p in info["programs"]:
        head += [
            ("program", f"{p['name']}: {p['op_total']} ops, arena {_b(p['arena_bytes'])} "
                        f"(lower bound {_b(p['lower_bound_bytes'])})"),
            ("  inputs", ", ".join(map(_sig, p["inputs"])) or "(none)"),
            ("  outputs", ", ".join(map(_sig, p["outputs"])) or "(none)"),
        ]
    head += [
        ("weights", _b(info["weights_bytes"])),
        ("arena", _b(info["arena_bytes"])),
        ("lower bound", _b(info["lower_bound_bytes"])),
        ("state", _b(info["state_bytes"]) + (f" (KV cache, {_b(info['kv_cache_bytes_per_token'])} per token)"
                                             if info["state_bytes"] and info["kv_slots"] <= 1 else
                                             f" (KV cache: {info['kv_slots']} slots of "
                                             f"{_b(info['kv_cache_bytes_per_slot'])}, "
                                             f"{_b(info['kv_cache_bytes_per_token'])} per token)"
                                             if info["state_bytes"] else "")),
        *([("KV cache", f"{info['kv_cache_dtype']}, {info['kv_cache_bytes_per_token']:,} bytes per token")]
          if info.get("kv_cache_dtype") else []),
        *([("prefix pool", f"{info['prefix_pool_entries']} entries, {_b(info['prefix_pool_bytes'])} of the state "
                            f"(--prefix_cache: each up to {info['metadata'].get('max_seq_len', '?')} positions of "
                            "every cache)")]
          if info.get("prefix_pool_entries") else []),
        *([("recurrent state", f"{_b(info['recurrent_state_bytes_per_slot'])} per slot (scan and delta-rule "
                                "states, conv windows; the same at any --max_seq_len)")]
          if info.get("recurrent_state_bytes_per_slot") else []),
        *([("rollback copies", f"{_b(info['recurrent_rollback_bytes_per_slot'])} per slot (the recurrent states "
                                "after each row of a verify step, for a rejected draft's rollback)")]
          if info.get("recurrent_rollback_bytes_per_slot") else []),
        ("alignment", _b(info["alignment"])),
    ]
    if "parallel" in info:
        par = info["parallel"]
        head.insert(0, ("parallel", f"{par['world']} ranks (tp {par['tp']}, ep {par['ep']}); below: rank 0"))
    lines = _table(head)
    if "ranks" in info:
        lines += [""] + _table([("rank", "file", "weights", "arena", "state", "KV/token", "wire/decode step")]
                               + [(str(r), f["file"], _b(f["weights_bytes"]), _b(f["arena_bytes"]),
                                   _b(f["state_bytes"]), _b(f["kv_cache_bytes_per_token"]),
                                   _b(f["wire_bytes_per_step"].get("decode", max(f["wire_bytes_per_step"].values(),
                                                                                default=0))))
                                  for r, f in enumerate(info["ranks"])], right={2, 3, 4, 5, 6})
    lines += [""] + _table([("section", "offset", "size", "checksum", "digest")]
                           + [(s["name"], f"{s['offset']:,}", f"{s['size']:,}", s["checksum"], s["digest"][:16])
                              for s in info["sections"]], right={1, 2})
    progs = info["programs"]
    names = [p["name"] for p in progs]
    total: Counter[str] = Counter()
    for p in progs:
        total.update(p["op_counts"])
    ops = sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))
    lines += [""] + _table([("op", *names)] + [(k, *(str(p["op_counts"].get(k, 0)) for p in progs)) for k, _ in ops],
                           right=set(range(1, len(names) + 1)))
    units = sorted({u for p in progs for u in p["unit_counts"]})
    lines += [""] + _table([("unit", *names)] + [(u, *(str(p["unit_counts"].get(u, 0)) for p in progs))
                                                 for u in units], right=set(range(1, len(names) + 1)))
    if info["metadata"]:
        lines += [""] + _table([("metadata", "value")] + sorted(info["metadata"].items()))
    return "\n".join(lines)


# --- npuc dump --json ------------------------------------------------------------


def dump_json(path: str, rank: int | None = None) -> str:
    """The section table and the whole model definition as JSON (proto3 JSON mapping:
    64-bit integers are strings, unset fields are left out), keys sorted. The plan,
    tasks and metadata sections are shown merged into it, where the runtime uses them.
    A tensor-parallel manifest: the manifest, and rank `rank`'s (default 0) file."""
    manifest = _manifest(path)
    parallel: dict[str, Any] = {}
    if manifest is not None:
        rank = rank or 0
        if not 0 <= rank < manifest.world:
            raise NpucError("NPUC-E0150", f"{path} has ranks 0..{manifest.world - 1}, not {rank}",
                            f"--rank 0..{manifest.world - 1}", exit_code=EXIT_USAGE)
        parallel = {"manifest": json.loads(manifest.to_json()), "rank": rank}
        path = _rank_path(path, manifest, rank)
    with _open(path, verify_weights=False) as (om, m):
        doc = {
            **parallel,
            "format_version": FORMAT_VERSION,
            "sections": _sections(om),
            "modeldef": MessageToDict(m, preserving_proto_field_name=True),
        }
    return json.dumps(doc, indent=2, sort_keys=True)


# --- npuc validate ---------------------------------------------------------------


def validate_om(path: str) -> str:
    """Check the file end to end; return the one-line "ok: ..." summary or raise NpucError.
    The checks are the ones every load runs (runtime/om_validate.py), with every checksum.
    A tensor-parallel manifest: each rank's file in full, and that it is the rank file the
    manifest names (its fingerprint, its recorded rank and world size)."""
    manifest = _manifest(path)
    if manifest is not None:
        for r in range(manifest.world):
            rank_path = _rank_path(path, manifest, r)
            validate_om(rank_path)
            with _open(rank_path, verify_weights=False) as (_, m):
                meta = {e.key: e.value for e in m.metadata}
            if meta.get("parallel.rank") != str(r) or meta.get("parallel.world") != str(manifest.world):
                raise _bad("NPUC-E0152", f"{rank_path} says it is rank {meta.get('parallel.rank')} of "
                           f"{meta.get('parallel.world')}, the manifest names it rank {r} of {manifest.world}")
        return (f"ok: {path}: manifest of {manifest.world} ranks (tp {manifest.tp}, ep {manifest.ep}); every rank "
                "file valid: " + ", ".join(f"{f.file} weights {_b(f.weights_bytes)}" for f in manifest.ranks))
    with _open(path, verify_weights=True) as (om, m):
        sections = om.section_info()
        tokenizer = bytes(om.section("tokenizer")) if "tokenizer" in om.section_names() else None
        with om.section(WEIGHTS) as weights:
            checked = validate_model(path, m, weights, tokenizer)
    if not checked.ops_checked:  # no torch here: the C loader checks the ops against its kernels
        from npuc.runtime.native_session import check_ops

        check_ops(path)
    how = "against their schemas" if checked.ops_checked else "by the native runtime's kernels (no torch here)"
    plans = ", ".join(f"{p.name} arena {_b(p.plan.arena_bytes)}, lower bound {_b(p.plan.lower_bound_bytes)}"
                      for p in m.programs)
    return (f"ok: {path}: {len(sections)} sections (checksums match), {len(m.tensors)} tensors in bounds, "
            f"{sum(len(p.ops) for p in m.programs)} ops checked {how}, memory plan of "
            f"{checked.buffers} buffers valid ({plans}), weights {_b(m.weights_bytes)}"
            + (f", state {_b(m.state_bytes)}" if m.state_bytes else ""))
