"""How much one run of a program allocates outside the planned regions.

The arena, the state region and the weights map are allocated once, at load. Ops
with an out-kernel (ir/out_kernels.py) write into their planned slots and keep
their scratch in a planned workspace; any other op's reference kernel allocates its
result, which is copied into its slot and dropped before the run returns. So a run
allocates only for ops without an out-kernel, plus the copies of the outputs it
hands back (none with `copy_outputs=False`).

    python -m npuc.tools.alloc_profile build/lm.om decode
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from npuc.runtime.session import Session

_MARK = "npuc::profiled_run"


@dataclass(frozen=True)
class RunAllocations:
    count: int  # profiler events that allocated (an op's own allocations count once)
    bytes: int  # bytes they asked for
    net_bytes: int  # still held when the run returned
    output_bytes: int  # what the run returned (copies of the outputs)
    collective_count: int = 0  # allocations inside torch.distributed's collectives (not npuc's)
    collective_bytes: int = 0
    ops: tuple[str, ...] = ()  # the allocating events' names, for a failure to name them


def profile_run(s: Session, inputs: Mapping[str, Any], program: str | None = None, copy_outputs: bool = True
                ) -> RunAllocations:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_MARK):  # names the calling thread among the profiler's
            outs = s.run(inputs, program, copy_outputs=copy_outputs)
    every = prof.events()
    main_thread = next(e.thread for e in every if e.name == _MARK)
    # A tensor-parallel program's collectives (torch.distributed: gloo, NCCL) allocate inside
    # the library, under a c10d:: op or on its own threads: theirs, counted apart. Other
    # threads' events (a process's other work) are not this run's.
    events = [e for e in every if e.thread == main_thread and not _in_collective(e)]
    lib = [e for e in every if e.self_cpu_memory_usage > 0 and (e.thread != main_thread or _in_collective(e))]
    return RunAllocations(
        count=sum(1 for e in events if e.self_cpu_memory_usage > 0),
        bytes=sum(e.self_cpu_memory_usage for e in events if e.self_cpu_memory_usage > 0),
        net_bytes=sum(e.self_cpu_memory_usage for e in events),
        output_bytes=sum(t.numel() * t.element_size() for t in outs.values()) if copy_outputs else 0,
        collective_count=len(lib), collective_bytes=sum(e.self_cpu_memory_usage for e in lib),
        ops=tuple(f"{e.name}:{e.self_cpu_memory_usage}" for e in events if e.self_cpu_memory_usage > 0))


def _in_collective(e: Any) -> bool:
    p = e
    while p is not None:
        if p.name.startswith("c10d::"):
            return True
        p = p.cpu_parent
    return False


def _example_inputs(s: Session, program: str | None) -> dict[str, torch.Tensor]:
    p = s._program(program)
    return {t.name: torch.zeros(t.shape, dtype=t.dtype.torch) for t in p.inputs}


def main(argv: list[str]) -> None:
    path, program = argv[0], (argv[1] if len(argv) > 1 else None)
    s = Session.load(path)
    feeds = _example_inputs(s, program)
    for _ in range(3):  # warm up: first runs touch lazily mapped weights and torch's one-time setup
        s.run(feeds, program)
    r = profile_run(s, feeds, program, copy_outputs=False)
    p = s._program(program)
    left = sorted({st.opdef.name for st in p.steps if st.opdef.out_kernel is None and st.opdef.inplace is None
                   and st.opdef.name not in ("reshape", "transpose", "slice", "expand", "split")})
    print(f"{path} {program or 'default program'}: {len(p.steps)} ops; per run (outputs not copied) "
          f"{r.count} allocating kernel calls, {r.bytes:,} B; arena {s.arena_bytes:,} B and state "
          f"{s.state_bytes:,} B allocated once; kernels chosen at load (all programs): "
          + ", ".join(f"{k} {v}" for k, v in sorted(s.launchers.kinds.items()))
          + (f"; ops without an out-kernel: {', '.join(left)}" if left else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
