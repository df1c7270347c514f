"""The model definition as `.om` v1 sections, and back.

In memory, one `ModelDef` holds everything (programs with their memory plans, ops
with their execution units and costs, metadata). On disk it is split so each part
can be read, hashed and replaced on its own:

    modeldef   tensors, programs (inputs, outputs, ops and attributes), region sizes
    plan       Plans: each program's MemoryPlan (alignment, arena, lower bound, buffer lifetimes)
    tasks      Tasks: per program, one task per op in schedule order: its unit, FLOPs and bytes
    metadata   Metadata: compiler version, target, options, the input model's hash

`split_model` and `join_model` are inverses; the reader checks that the sections
agree (one plan and one task list per program, one task per op) before merging.
"""

from __future__ import annotations

from typing import Any

from npuc.backend.om_schema import Metadata, ModelDef, Plans, Tasks
from npuc.errors import EXIT_IO, NpucError

MODELDEF, PLAN, TASKS, METADATA = "modeldef", "plan", "tasks", "metadata"
MODEL_SECTIONS = (MODELDEF, PLAN, TASKS, METADATA)


def split_model(model: Any) -> dict[str, bytes]:
    """The four model sections, each serialised deterministically."""
    core = ModelDef()
    core.CopyFrom(model)
    plans, tasks, meta = Plans(), Tasks(), Metadata()
    for prog in core.programs:
        p = plans.plans.add()
        p.CopyFrom(prog.plan)
        p.program = prog.name
        prog.ClearField("plan")
        pt = tasks.programs.add(program=prog.name)
        for i, op in enumerate(prog.ops):
            pt.tasks.add(op=i, unit=op.unit, flops=op.flops, bytes=op.bytes)
            for f in ("unit", "flops", "bytes"):
                op.ClearField(f)
    meta.entries.extend(core.metadata)
    core.ClearField("metadata")
    return {name: msg.SerializeToString(deterministic=True)
            for name, msg in ((MODELDEF, core), (PLAN, plans), (TASKS, tasks), (METADATA, meta))}


def _bad(path: str, what: str) -> NpucError:
    return NpucError("NPUC-E0405", f"{path}: {what}", "the file is damaged or was edited after compiling; "
                     "recompile the model with `npuc compile`", exit_code=EXIT_IO)


def join_model(path: str, sections: dict[str, bytes]) -> Any:
    """One ModelDef from the sections; a section that does not parse, or that does not
    match the programs and ops of the model definition, is a damaged file."""
    model, plans, tasks, meta = ModelDef(), Plans(), Tasks(), Metadata()
    for name, msg in ((MODELDEF, model), (PLAN, plans), (TASKS, tasks), (METADATA, meta)):
        try:
            msg.ParseFromString(sections[name])
        except Exception:  # protobuf's decode errors differ between its implementations
            raise _bad(path, f"the {name} section does not parse") from None
    names = [p.name for p in model.programs]
    if [p.program for p in plans.plans] != names or [t.program for t in tasks.programs] != names:
        raise _bad(path, "the plan and tasks sections do not list the model's programs")
    for prog, plan, pt in zip(model.programs, plans.plans, tasks.programs, strict=True):
        if [t.op for t in pt.tasks] != list(range(len(prog.ops))):
            raise _bad(path, f"the tasks of program {prog.name!r} do not match its ops")
        prog.plan.CopyFrom(plan)
        prog.plan.ClearField("program")
        for op, t in zip(prog.ops, pt.tasks, strict=True):
            op.unit, op.flops, op.bytes = t.unit, t.flops, t.bytes
    model.metadata.extend(meta.entries)
    return model
