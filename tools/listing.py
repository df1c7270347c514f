"""`npuc dump`: a readable listing of a compiled program, like a disassembly.

    #3    cube    linear   %q : f32[1,16,64] @arena+4096
                           <- %h : f32[1,16,64] @arena+0, @w_q : f32[64,64] @weights+16384
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from npuc.runtime.om_validate import attr_value, prefix_pool_size, registry_available


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    region: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Program:
    proto: Any
    inputs: list[_Tensor]
    outputs: list[_Tensor]


@dataclass(frozen=True)
class _Listed:
    """What the listing reads of a loaded model: the checked definition, never its weights."""
    path: str
    model: Any
    tensors: list[_Tensor]
    programs: dict[str, _Program]
    state_bytes: int


def _load(path: str, rank: int | None) -> _Listed:
    """The model definition of `path` (rank `rank`'s file of a manifest), checked as a load
    checks it: by the torch interpreter's loader where the op registry imports, else by
    om_validate without the registry and the C library's loader for the ops."""
    from npuc.backend.manifest import open_rank, read_manifest
    from npuc.backend.om_format import OmFile
    from npuc.backend.om_sections import MODEL_SECTIONS, join_model
    from npuc.runtime.om_validate import validate_model

    if registry_available():
        from npuc.runtime.session import Session

        s = Session.load(path, inspect_rank=rank)
        tensors = [_Tensor(t.name, str(t.dtype), t.shape, t.region, t.offset, t.nbytes) for t in s.tensors]
        progs = {n: _Program(p.proto, [tensors[i] for i in p.input_ids], [tensors[i] for i in p.output_ids])
                 for n, p in s.programs.items()}
        return _Listed(str(s.om.path), s.model, tensors, progs, s.state_bytes)
    om = OmFile.open(path)
    manifest = read_manifest(om)
    if manifest is not None:
        om.close()
        om = open_rank(path, manifest, rank or 0)
    with om:
        model = join_model(om.path, {name: bytes(om.section(name)) for name in MODEL_SECTIONS})
        tokenizer = bytes(om.section("tokenizer")) if "tokenizer" in om.section_names() else None
        checked = validate_model(str(om.path), model, om.section("weights"), tokenizer)
        listed_path = str(om.path)
    if not checked.ops_checked:
        from npuc.runtime.native_session import check_ops

        check_ops(listed_path)
    tensors = [_Tensor(t.name, t.dtype, tuple(t.shape), t.region, t.offset, t.nbytes) for t in model.tensors]
    progs = {p.name: _Program(p, [tensors[i] for i in p.inputs], [tensors[i] for i in p.outputs])
             for p in model.programs}
    return _Listed(listed_path, model, tensors, progs, int(model.state_bytes))


def _t(t: _Tensor, kind: str) -> str:
    sigil = "@" if t.region == "weights" else "%"
    return f"{sigil}{t.name} : {t.dtype}[{','.join(map(str, t.shape))}] @{t.region}+{t.offset}"


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B"


def render_listing(path: str, summary: bool = False, rank: int | None = None) -> str:
    """The listing of `path`; of a tensor-parallel manifest, rank `rank`'s file (0 by default)
    under a line naming every rank's."""
    from npuc.backend.manifest import read_manifest
    from npuc.backend.om_format import OmFile

    with OmFile.open(path, verify=False) as om:
        manifest = read_manifest(om)
    lines = []
    if manifest is not None:
        rank = rank or 0
        lines.append(f"manifest {path}: {manifest.world} ranks (tp {manifest.tp}, ep {manifest.ep}): "
                     + ", ".join(r.file for r in manifest.ranks) + f"; listing rank {rank}")
    s = _load(path, rank if manifest is not None or rank is not None else 0)
    if manifest is not None:
        path = s.path
    m: Any = s.model
    meta = {e.key: e.value for e in m.metadata}
    entries, pool = prefix_pool_size(m)
    lines += [f"model {path}: produced by {m.producer} {m.producer_version}, target {m.target}; weights "
             f"{_fmt_bytes(m.weights_bytes)} in {sum(1 for t in s.tensors if t.region == 'weights')} tensors"
             + (f", state {_fmt_bytes(s.state_bytes)} in {sum(1 for t in s.tensors if t.region == 'state')} "
                "tensors (KV cache)" if s.state_bytes else "")
             + (f", of which prefix pool {_fmt_bytes(pool)} ({entries} entries)" if entries else "")
             + (f"; rank {meta['parallel.rank']} of {meta['parallel.world']}" if "parallel.world" in meta else "")]
    for p in s.programs.values():
        lines += _program(s, p, summary)
    return "\n".join(lines)


def _program(s: _Listed, p: _Program, summary: bool) -> list[str]:
    prog, inputs, outputs = p.proto, p.inputs, p.outputs
    counts = Counter(o.op for o in prog.ops)
    units = Counter(o.unit for o in prog.ops)
    lines = [
        "",
        f"program {prog.name}: {len(prog.ops)} ops, arena {_fmt_bytes(prog.plan.arena_bytes)} "
        f"(lower bound {_fmt_bytes(prog.plan.lower_bound_bytes)})",
        "inputs:  " + ", ".join(_t(t, "in") for t in inputs),
        "outputs: " + ", ".join(_t(t, "out") for t in outputs),
        "units:   " + ", ".join(f"{u} {n}" for u, n in sorted(units.items())),
        "ops:     " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
    ]
    if summary:
        return lines
    lines.append("")
    width = max((len(o.op) for o in prog.ops), default=4)
    for i, o in enumerate(prog.ops):
        attrs = ", ".join(f"{a.name}={attr_value(a.value)!r}" for a in o.attrs)
        outs = ", ".join(_t(s.tensors[j], "out") for j in o.outputs)
        ins = ", ".join(_t(s.tensors[j], "in") for j in o.inputs)
        head = f"#{i:<4} {o.unit:<6} {o.op:<{width}}  {outs}"
        lines.append(head + (f"  [{attrs}]" if attrs else ""))
        lines.append(" " * (13 + width) + f"<- {ins}" if ins else " " * (13 + width) + "<- (none)")
    return lines
