"""Tensor-parallel compiles (--tp N [--ep N]): one `.om` per rank and their manifest.

The model is imported and fused once. Each rank then gets a copy of the fused programs
(constants shared, nothing loaded), `passes/tensor_parallel.py` keeps that rank's part,
the rest of the pipeline (quantization, precision, alignment, folding) runs on the
rank's shapes, and the rank's `.om` is planned and written before the next rank's
copy is made. A sharded weight is a `ShardSource` over the checkpoint's: read when its
rank's file is written (a leading-axis shard straight from its byte range of the file),
so the build holds one rank's pieces at a time, never the model N times.

`<output>.om` is written last, as the manifest naming the rank files
(backend/manifest.py); on any failure the files already written are removed. What a killed
compile left (its `.part` files) and rank files the new manifest does not name (an earlier
compile at a larger --tp) are swept.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from npuc.backend.lower import Lowered, lower
from npuc.backend.manifest import MAX_WORLD, Manifest, RankFile, fingerprint, rank_file_name, write_manifest
from npuc.backend.om_format import OmFile
from npuc.backend.targets import Target, check_dtypes, check_fits, dtypes_used
from npuc.compiler import instrument
from npuc.compiler.progress import Progress
from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir import Graph, get_op
from npuc.ir.graph import clone_graph
from npuc.passes.bias_fusion import BiasFusion
from npuc.passes.manager import Pass
from npuc.passes.tensor_parallel import SHARD_TAG, TensorParallel


def check_parallel(tp: Any, ep: Any) -> tuple[int, bool]:
    """(world size, whether experts are split across the ranks) from --tp and --ep."""
    def bad(flag: str, v: Any, hint: str) -> NpucError:
        return NpucError("NPUC-E0124", f"{flag} {v!r} is not valid", hint, exit_code=EXIT_USAGE)

    if tp is None:
        if ep not in (None, 1):
            raise bad("--ep", ep, "--ep N splits experts over the --tp N ranks: give --tp too")
        return 1, False
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_WORLD:
        raise bad("--tp", tp, f"the number of ranks: 1..{MAX_WORLD}")
    if ep not in (None, 1, tp):
        raise bad("--ep", ep, f"--ep is 1 (each expert's FFN split over the ranks) or equal to --tp ({tp}): "
                  "experts split across the same ranks")
    return tp, tp > 1 and ep == tp


def split_pipeline(passes: Sequence[Pass]) -> tuple[list[Pass], list[Pass]]:
    """The passes up to and including bias fusion (run once), and the rest (run per rank)."""
    cut = next(i for i, p in enumerate(passes) if isinstance(p, BiasFusion)) + 1
    return list(passes[:cut]), list(passes[cut:])


def rank_metadata(meta: dict[str, str], rank: int, world: int, expert_parallel: bool) -> dict[str, str]:
    return {**meta, "parallel.rank": str(rank), "parallel.world": str(world),
            "parallel.ep": str(world if expert_parallel else 1)}


@dataclass(frozen=True)
class RankPlan:
    """One rank's sizes, as planned (`npuc plan`): what its .om would hold and move."""
    rank: int
    weights_bytes: int
    replicated_bytes: int  # of weights_bytes: what every rank holds whole
    arena_bytes: int
    state_bytes: int
    kv_bytes_per_token: int  # per sequence
    wire_bytes: dict[str, int]  # per run of each program, sent by this rank in its collectives
    collectives: dict[str, int]  # per program
    capacity_bytes: int  # the target's
    # Each program's arena, and the planner's lower bound for it (the most bytes live at once)
    arenas: dict[str, int] = field(default_factory=dict)
    lower_bounds: dict[str, int] = field(default_factory=dict)
    prefix_pool_bytes: int = 0  # of state_bytes: --prefix_cache's pool

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.arena_bytes + self.state_bytes


def compile_ranks(graphs: Sequence[Graph], tails: Sequence[Sequence[Pass]], world: int, expert_parallel: bool,
                  target: Target, meta: dict[str, str], out_path: str, progress: Progress,
                  write: Callable[[Lowered, str], None] | None, *, debug: bool = False) -> list[RankPlan]:
    """Each rank's programs, planned, and (with `write`) its .om, then the manifest; without
    `write` nothing is written and the plans are the result."""
    written: list[str] = []
    ranks: list[RankFile] = []
    plans: list[RankPlan] = []
    if write is not None:
        remove_dead_parts(out_path)
    try:
        for rank in range(world):
            progress.stage(f"rank {rank}", 0)
            programs = []
            for g, tail in zip(graphs, tails, strict=True):
                part = clone_graph(g)
                run = instrument.run_pipeline(part, [TensorParallel(rank, world, expert_parallel), *tail],
                                              verify_each=debug)
                programs.append(run.graph)
            check_dtypes(target, dtypes_used(programs))
            replicated = {c.name: c.type.nbytes for g in programs for c in g.constants.values()
                          if c.const is not None and SHARD_TAG not in c.const.describe()}
            extra = {"parallel.replicated_bytes": str(sum(replicated.values())),
                     "parallel.replicated": ",".join(sorted(replicated))} if world > 1 else {}
            low = lower(programs, target, {**(rank_metadata(meta, rank, world, expert_parallel)
                                              if world > 1 else meta), **extra})
            if write is None:
                plans.append(_plan(rank, programs, low, sum(replicated.values()), target))
                continue
            check_fits(target, low.weights_bytes, low.arena_bytes, low.state_bytes)
            final = rank_file_name(out_path, rank)
            # Beside the output under a temporary name until every rank is written: a failed
            # compile leaves no rank file, and a previous compile's files and manifest intact.
            path = os.path.join(os.path.dirname(final) or ".", f".{os.path.basename(final)}.{os.getpid()}.part")
            written.append(path)
            write(low, path)
            with contextlib.closing(OmFile.open(path, verify=False)) as om:
                ranks.append(RankFile(os.path.basename(final), fingerprint(om), low.weights_bytes))
            del low, programs
        if write is not None:
            for rank, path in enumerate(written):
                os.replace(path, rank_file_name(out_path, rank))
            written.clear()
            write_manifest(out_path, Manifest(world, world, world if expert_parallel else 1, tuple(ranks)))
            remove_stale_ranks(out_path, world)
        return plans
    except BaseException:
        for p in written:
            with contextlib.suppress(OSError):
                os.unlink(p)
        raise


def _rank_files(out_path: str) -> Iterator[tuple[str, re.Match[str]]]:
    """The names in the output's folder that a compile of `out_path` writes or leaves: rank
    files (model.rank<r>.om), their temporaries (.model.rank<r>.om.<pid>.part) and the temporaries
    of those temporaries' writer (..model.rank<r>.om.<pid>.part.<pid>.<random>.tmp)."""
    directory = os.path.dirname(os.path.abspath(out_path))
    stem = re.escape(os.path.basename(out_path).removesuffix(".om"))
    pattern = re.compile(rf"(?P<temp>\.{{1,2}})?{stem}\.rank(?P<rank>\d+)\.om(?:\.(?P<pid>\d+)\.part(?:\..*\.tmp)?)?")
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = pattern.fullmatch(name)
            if m is not None and (m["temp"] is None) == (m["pid"] is None):
                yield os.path.join(directory, name), m


def remove_dead_parts(out_path: str) -> None:
    """Delete the rank temporaries that a killed compile of this output left (its process is
    gone: SIGKILL skips the cleanup below); a live compile's are left alone, as
    backend/om_format.py's writer does for its own."""
    for path, m in _rank_files(out_path):
        pid = m["pid"]
        if pid is None or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError:
            pass  # alive, but another user's


def remove_stale_ranks(out_path: str, world: int) -> None:
    """Delete the rank files of an earlier compile of this output at a larger world (a --tp 4
    output compiled over with --tp 2 kept rank2 and rank3): the new manifest names none of
    them, so nothing would ever read or replace them."""
    for path, m in _rank_files(out_path):
        if m["pid"] is None and int(m["rank"]) >= world:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _plan(rank: int, programs: Sequence[Graph], low: Lowered, replicated: int, target: Target) -> RankPlan:
    wire: dict[str, int] = {}
    colls: dict[str, int] = {}
    for g in programs:
        wire[g.name] = colls[g.name] = 0
        for n in g.nodes:
            fn = get_op(n.op).extra.get("wire_bytes")
            if fn is not None:
                wire[g.name] += fn([v.type for v in n.inputs], [o.type for o in n.outputs],
                                   get_op(n.op).full_attrs(n.attrs))
                colls[g.name] += 1
    states = {s.name: s.type for g in programs for s in g.states.values()}
    kv = sum(t.nbytes // (t.shape[0] * t.shape[2]) for t in states.values() if t.rank == 4 and t.shape[0] * t.shape[2])
    return RankPlan(rank, low.weights_bytes, replicated, low.arena_bytes, low.state_bytes, kv, wire, colls,
                    target.capacity_bytes, {g.name: p.arena_bytes for g, p in zip(programs, low.plans, strict=True)},
                    {g.name: p.lower_bound for g, p in zip(programs, low.plans, strict=True)}, low.prefix_pool_bytes)

