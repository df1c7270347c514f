"""`npuc dump`: a readable listing of a compiled program, like a disassembly.

    #3    cube    linear   %q : f32[1,16,64] @arena+4096
                           <- %h : f32[1,16,64] @arena+0, @w_q : f32[64,64] @weights+16384
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from npuc.runtime.om_validate import attr_value
from npuc.runtime.session import Program, Session, TensorInfo


def _t(t: TensorInfo, kind: str) -> str:
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
    s = Session.load(path, inspect_rank=rank if manifest is not None or rank is not None else 0)
    if manifest is not None:
        path = str(s.om.path)
    m: Any = s.model
    meta = {e.key: e.value for e in m.metadata}
    lines += [f"model {path}: produced by {m.producer} {m.producer_version}, target {m.target}; weights "
             f"{_fmt_bytes(m.weights_bytes)} in {sum(1 for t in s.tensors if t.region == 'weights')} tensors"
             + (f", state {_fmt_bytes(s.state_bytes)} in {sum(1 for t in s.tensors if t.region == 'state')} "
                "tensors (KV cache)" if s.state_bytes else "")
             + (f"; rank {meta['parallel.rank']} of {meta['parallel.world']}" if "parallel.world" in meta else "")]
    for p in s.programs.values():
        lines += _program(s, p, summary)
    return "\n".join(lines)


def _program(s: Session, p: Program, summary: bool) -> list[str]:
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
