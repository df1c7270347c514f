"""Where the decode step-latency tail comes from (issue 13: P99/P50 <= 1.15, or the tail traced).

    python bench/tail.py [--quick] [--work DIR] [--runs N] [--no-experiments]

Runs npuc's decode (the cpu-target .om, compiled as bench/run.py's run_npuc does and kept
in --work) for `runs` generations and reads, around every step, outside its timed window:

- every thread's on-CPU time and run-queue delay (/proc/self/task/*/schedstat: time spent
  runnable but not running) and its voluntary and involuntary context switches (.../status);
- the process's page faults and context switches (getrusage);
- the host's busy and steal time (/proc/stat, in 10 ms ticks) and runnable tasks (/proc/loadavg).

The main thread runs the step: it posts every kernel and waits for the chunks the pool's
workers claimed. Its wall time splits exactly into on-CPU + run-queue delay + the rest,
and the rest is steal of its vCPU or time blocked (with paravirtual time accounting, as on
this VM, a task's on-CPU time excludes steal). A step's excess over the median is split
the same way; on-CPU excess is then work that ran slower, or the main thread spinning
while a worker that holds a chunk is off its core (the worker's run-queue delay).

Then a second pass times every op of each step (Session.run's on_step) to show whether the
slow steps' excess sits in one kernel or wherever a stall happened to land, a third times
a 64 MB read by the step's GEMV before each step (do slow steps meet a slow memory system?),
generations without probes (interleaved with the probed ones) check that the probes change
nothing, and (unless --no-experiments) configurations run in turn, interleaved, each in its
own process: torch threads 2 or 1, native kernels or NPUC_NATIVE=0, and the main thread and
the pool's worker pinned to separate cores. Without /proc/*/schedstat the figures that need
it read "not available"."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import FULL, QUICK, Sizes, llama_checkpoint, prefill_feed, prompt_ids  # noqa: E402

_SWITCHES = re.compile(rb"^(nonvoluntary|voluntary)_ctxt_switches:\s+(\d+)", re.M)
MS = 1e-6  # ns -> ms


class Probe:
    """Counters read before and after a step. Files stay open and are re-read with pread
    (about 60 us a sample, outside the timed window)."""

    def __init__(self, roles: dict[int, str]) -> None:
        self.main = threading.get_native_id()
        self.tids = [self.main] + [t for t in roles if t != self.main]
        self.ok = all(os.path.exists(f"/proc/self/task/{t}/schedstat") for t in self.tids)
        self._sched = [os.open(f"/proc/self/task/{t}/schedstat", os.O_RDONLY) for t in self.tids] if self.ok else []
        self._status = [os.open(f"/proc/self/task/{t}/status", os.O_RDONLY) for t in self.tids] if self.ok else []
        # CPU time from each thread's CPU clock (Linux: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)):
        # schedstat's first field lags a running thread by up to a scheduler tick (4 ms here).
        self._clocks = [(~t << 3) | 6 for t in self.tids]
        self._stat = _open("/proc/stat")
        self._load = _open("/proc/loadavg")

    def sample(self, first_main: bool) -> list[float]:
        """[main CPU, main delay, then per thread (CPU, delay, voluntary, involuntary)...,
        process (minflt, majflt, nvcsw, nivcsw), host (busy, steal, all ticks), runnable].
        The main thread's pair is read closest to the timed window (last before, first after)."""
        if not self.ok:
            return []
        main = self._thread(0)[:2] if first_main else []
        out: list[float] = []
        for i in range(len(self.tids)):
            sw = dict(_SWITCHES.findall(os.pread(self._status[i], 4096, 0)))
            out += [*self._thread(i)[:2], float(sw.get(b"voluntary", 0)), float(sw.get(b"nonvoluntary", 0))]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out += [ru.ru_minflt, ru.ru_majflt, ru.ru_nvcsw, ru.ru_nivcsw]
        if self._stat is not None:
            f = [float(x) for x in os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()[1:]]
            out += [f[0] + f[1] + f[2] + f[5] + f[6], f[7] if len(f) > 7 else 0.0, sum(f[:8])]
        else:
            out += [0.0, 0.0, 0.0]
        out.append(float(os.pread(self._load, 64, 0).split()[3].split(b"/")[0]) if self._load is not None else 0.0)
        return (main or self._thread(0)[:2]) + out

    def close(self) -> None:
        for fd in [*self._sched, *self._status, self._stat, self._load]:
            if fd is not None:
                os.close(fd)

    def _thread(self, i: int) -> list[float]:
        """(CPU ns, run-queue delay ns)."""
        if not self.ok:
            return [0.0, 0.0]
        ss = os.pread(self._sched[i], 128, 0).split()
        try:
            cpu = float(time.clock_gettime_ns(self._clocks[i]))
        except OSError:
            cpu = float(ss[0])
        return [cpu, float(ss[1])]


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def thread_roles() -> dict[int, str]:
    """tid -> role, by who burns CPU during a native parallel call and during a torch one
    (the pool's workers and torch's OpenMP threads look alike from /proc otherwise)."""
    from npuc.runtime import native

    main = threading.get_native_id()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the probes will report "not available"
        return {main: "main"}

    def busy(fn: Callable[[], object]) -> set[int]:
        time.sleep(0.1)  # let spinning workers (ours: 200 us; OpenMP's: longer) fall asleep first
        before = {t: _exec_ns(t) for t in tids}
        fn()
        return {t for t in tids if _exec_ns(t) - before[t] > 2e6}

    m = torch.ones(8192, 1024)
    v, y = torch.ones(1024), torch.empty(8192)
    lib = native.library()
    pool = busy(lambda: [lib.npuc_linear_f32(v.data_ptr(), 1, 1024, m.data_ptr(), 0, 8192, 1024, None, y.data_ptr(),
                                             8192, torch.get_num_threads()) for _ in range(20)]) if lib else set()
    omp = busy(lambda: torch.mm(m[:2048], m[:1024].T))
    return {t: "main" if t == main else "npuc pool" if t in pool else "torch OpenMP" if t in omp else "other"
            for t in tids}


def _exec_ns(tid: int) -> float:
    try:
        return float(time.clock_gettime_ns((~tid << 3) | 6))
    except OSError:  # the thread ended, or no per-thread CPU clocks
        return 0.0


# -- running steps ----------------------------------------------------------------------------------

def decode_steps(sess: Any, s: Sizes, runs: int, probe: Probe | None = None,
                 on_step: Callable[[str, str, list[torch.Tensor]], None] | None = None,
                 before_step: Callable[[], None] | None = None, steps: int | None = None) -> dict[str, list[Any]]:
    """`runs` generations (reset, prefill, then s.new - 1 decode steps, or `steps`), each step
    generate.steps' own: one decode run and an argmax. Per step: wall (s), index in its run,
    and the difference of the probe's samples after and before."""
    ids_name = sess.programs["decode"].inputs[0].name
    pos_name = next(t.name for t in sess.programs["decode"].inputs if t.name != ids_name)
    feed = prefill_feed(sess, prompt_ids(s))
    rec: dict[str, list[Any]] = defaultdict(list)
    for _ in range(runs):
        sess.reset_state()
        # the prompt fills the prefill: its last row of logits is the prompt's last position's
        tok = int(sess.run(feed, "prefill", copy_outputs=False)["logits"][0, -1].argmax())
        for i in range(s.new - 1 if steps is None else min(steps, s.new - 1)):
            if before_step:
                before_step()
            a = probe.sample(first_main=False) if probe and probe.ok else []
            t0 = time.perf_counter()
            out = sess.run({ids_name: torch.tensor([[tok]]), pos_name: torch.tensor([s.prompt + i])}, "decode",
                           copy_outputs=False, on_step=on_step)
            tok = int(out["logits"][0, -1].argmax())
            t1 = time.perf_counter()
            if probe and probe.ok:
                b = probe.sample(first_main=True)
                rec["delta"].append([y - x for x, y in zip(a, b, strict=True)])
                rec["runnable"].append(b[-1])
            rec["wall"].append(t1 - t0)
            rec["index"].append(i)
    return dict(rec)


def op_times(sess: Any, s: Sizes, runs: int) -> dict[str, Any]:
    """Per step, each op's time (between the runtime's per-op callbacks)."""
    stamps: list[float] = []
    rows: list[list[float]] = []

    def tick(name: str, op: str, outs: list[torch.Tensor]) -> None:
        stamps.append(time.perf_counter())

    def start() -> None:
        if stamps:
            rows.append(np.diff(stamps).tolist())
        stamps.clear()
        stamps.append(time.perf_counter())

    rec = decode_steps(sess, s, runs, on_step=tick, before_step=start)
    rows.append(np.diff(stamps).tolist())
    prog = sess.programs["decode"]
    return {"wall": rec["wall"], "ops": rows, "op_type": [st.opdef.name for st in prog.steps],
            "op_name": [st.name for st in prog.steps]}


def bandwidth_pass(sess: Any, s: Sizes, runs: int) -> dict[str, Any]:
    """Before each step, one timed read of a 64 MB matrix by the step's own GEMV (torch.mv
    without the native kernels): a slow step that meets a slow read met a slow memory system,
    which a guest cannot otherwise see (other tenants' use of the host's memory bandwidth)."""
    from npuc.runtime import native

    lib, n, k = native.library(), 16384, 1024
    m, v, y = torch.ones(n, k), torch.ones(k), torch.empty(n)
    nt = torch.get_num_threads()
    reads: list[float] = []

    def read() -> None:
        t0 = time.perf_counter()
        if lib:
            lib.npuc_linear_f32(v.data_ptr(), 1, k, m.data_ptr(), 0, n, k, None, y.data_ptr(), n, nt)
        else:
            torch.mv(m, v, out=y)
        reads.append(time.perf_counter() - t0)

    w = np.asarray(decode_steps(sess, s, runs, before_step=read)["wall"]) * 1e3
    r = np.asarray(reads) * 1e3
    tail = w > np.percentile(w, 90)
    ref = (w >= np.percentile(w, 40)) & (w <= np.percentile(w, 60))
    return {"steps": len(w), "wall": stats(w), "read": stats(r), "gbps": m.numel() * 4 / np.median(r) / 1e6,
            "corr": _corr(w, r), "tail_read_over_ref": float(r[tail].mean() / r[ref].mean())}


# -- analysis -------------------------------------------------------------------------------------

def stats(xs: Any) -> dict[str, float]:
    a = np.asarray(xs, dtype=float)
    p50 = float(np.percentile(a, 50))
    return {"p50": p50, "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "p99_over_p50": float(np.percentile(a, 99)) / p50 if p50 else float("nan")}


def _corr(x: np.ndarray, y: np.ndarray) -> float | None:
    return float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 and x.std() > 0 and y.std() > 0 else None


def analyse(rec: dict[str, list[Any]], roles: list[str], raw: bool = False) -> dict[str, Any]:
    """The step-time distribution and, where the probes worked, what the slow steps spent their
    excess on. Tail: steps above P90; reference: steps between P40 and P60 (their means make
    the split of the excess exact)."""
    w = np.asarray(rec["wall"]) * 1e3
    # consecutive steps' correlation: high when slow steps come in runs (a cause that lasts)
    out: dict[str, Any] = {"steps": len(w), "wall": stats(w), "lag1": _corr(w[:-1], w[1:])}
    tail = w > np.percentile(w, 90)
    ref = (w >= np.percentile(w, 40)) & (w <= np.percentile(w, 60))
    idx = np.asarray(rec["index"])
    out["tail_first_of_run"] = float((idx[tail] == 0).mean()) if tail.any() else 0.0
    d = np.asarray(rec.get("delta", []), dtype=float)
    if d.size == 0:
        out["probes"] = False
        return out
    nt = len(roles)
    main_exec, main_delay = d[:, 0] * MS, d[:, 1] * MS
    per = d[:, 2:2 + 4 * nt].reshape(len(w), nt, 4)  # exec, delay, voluntary, involuntary per thread
    minflt, majflt, _, nivcsw = d[:, 2 + 4 * nt:6 + 4 * nt].T
    busy, steal, ticks = d[:, 6 + 4 * nt:9 + 4 * nt].T
    runnable = np.asarray(rec["runnable"])  # a level read after the step, our main thread included
    rest = w - main_exec - main_delay  # steal of the main thread's vCPU, or blocked
    all_delay = per[:, :, 1].sum(1) * MS
    pool = [i for i, r in enumerate(roles) if r == "npuc pool"]
    pool_delay = per[:, pool, 1].sum(1) * MS if pool else np.zeros(len(w))
    pool_sleeps = per[:, pool, 2].sum(1) if pool else np.zeros(len(w))
    our_cpu = per[:, :, 0].sum(1) * MS
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit: 10 ms, coarse against a step
    others = np.clip(busy * tick_ms - our_cpu, 0, None)  # ms of CPU that other processes used

    def split(x: np.ndarray) -> float:
        return float(x[tail].mean() - x[ref].mean()) if tail.any() and ref.any() else 0.0

    excess = w - w[ref].mean()
    pos = np.clip(excess[tail], 0, None)
    extra = np.clip(main_delay[tail] - main_delay[ref].mean(), 0, None)  # more run-queue delay than usual
    out.update({
        "probes": True,
        "main_on_cpu": stats(main_exec), "wall_minus_main_delay": stats(w - main_delay),
        "corr": {k: _corr(excess, v) for k, v in {
            "main thread's run-queue delay": main_delay, "the pool's run-queue delay": pool_delay,
            "all threads' run-queue delay": all_delay, "main thread's steal or blocked": rest,
            "main thread's on-CPU time": main_exec, "main thread's involuntary switches": per[:, 0, 3],
            "the pool's sleeps (its voluntary switches)": pool_sleeps, "minor faults": minflt,
            "other processes' CPU (host ticks)": others,
        }.items()},
        "tail": {"steps": int(tail.sum()), "excess_ms": split(w), "run_queue_ms": split(main_delay),
                 "steal_or_blocked_ms": split(rest), "on_cpu_ms": split(main_exec), "pool_run_queue_ms": split(pool_delay),
                 # step by step: how much of each tail step's excess its own extra run-queue delay covers
                 "covered_by_delay": float(np.minimum(pos, extra).sum() / pos.sum()) if pos.sum() else 0.0,
                 "steps_mostly_delay": float((extra >= 0.5 * pos).mean()),
                 "involuntary_per_step": float(nivcsw[tail].mean()), "involuntary_per_step_ref": float(nivcsw[ref].mean()),
                 "pool_sleeps": float(pool_sleeps[tail].mean()), "pool_sleeps_ref": float(pool_sleeps[ref].mean()),
                 "others_cores": float(others[tail].sum() / w[tail].sum()),
                 "others_cores_ref": float(others[ref].sum() / w[ref].sum()),
                 "runnable": float(runnable[tail].mean()), "runnable_ref": float(runnable[ref].mean())},
        "threads": {r: {"on_cpu_ms": float(per[:, i, 0].mean() * MS), "run_queue_ms": float(per[:, i, 1].mean() * MS),
                        "voluntary": float(per[:, i, 2].mean()), "involuntary": float(per[:, i, 3].mean())}
                    for i, r in enumerate(_unique(roles))},
        "faults": {"minor": int(minflt.sum()), "major": int(majflt.sum())},
        "host": {"steal_share": float(steal.sum() / ticks.sum()) if ticks.sum() else None,
                 "busy_cores": float(busy.sum() / ticks.sum() * (os.cpu_count() or 1)) if ticks.sum() else None},
        "main_delay_share": float(main_delay.sum() / w.sum()), "ref_delay_ms": float(main_delay[ref].mean()),
        # on-CPU time that grows with the others' load: the same work running slower beside them
        "on_cpu_vs_others": _corr(main_exec, others),
    })
    if raw:
        out["raw"] = {k: np.round(v, 3).tolist() for k, v in {
            "wall_ms": w, "main_cpu_ms": main_exec, "main_delay_ms": main_delay, "pool_delay_ms": pool_delay,
            "pool_sleeps": pool_sleeps, "others_ms": others}.items()}
    return out


def _unique(roles: list[str]) -> list[str]:
    seen: dict[str, int] = defaultdict(int)
    out = []
    for r in roles:
        seen[r] += 1
        out.append(r if seen[r] == 1 else f"{r} {seen[r]}")
    return out


def analyse_ops(p: dict[str, Any]) -> dict[str, Any]:
    """Slow steps (above P90) against the median per op: which op types hold the excess, and
    how much of each slow step's excess sits in its single slowest-against-median op."""
    w = np.asarray(p["wall"]) * 1e3
    t = np.asarray(p["ops"]) * 1e3
    med = np.median(t, axis=0)
    tail = w > np.percentile(w, 90)
    ex = t[tail] - med
    types = np.asarray(p["op_type"])
    by: dict[str, float] = defaultdict(float)
    share: dict[str, float] = defaultdict(float)
    for ty in set(p["op_type"]):
        by[ty] = float(ex[:, types == ty].sum())
        share[ty] = float(med[types == ty].sum() / med.sum())
    total = sum(max(v, 0) for v in by.values()) or 1.0
    top = ex.argmax(1)
    pos_ex = np.clip(ex, 0, None).sum(1)
    return {"steps": len(w), "wall": stats(w), "median_step_ms": float(med.sum()),
            "excess_by_type": sorted(((k, v / total, share[k]) for k, v in by.items()), key=lambda kv: -kv[1]),
            "top_op_share": float(np.median(ex.max(1) / np.maximum(pos_ex, 1e-9))) if tail.any() else 0.0,
            "top_ops": _count(f"{p['op_name'][i]} ({types[i]})" for i in top)}


def _count(xs: Any) -> list[tuple[str, int]]:
    c: dict[str, int] = defaultdict(int)
    for x in xs:
        c[x] += 1
    return sorted(c.items(), key=lambda kv: -kv[1])[:5]


# -- experiments: each configuration in its own process, interleaved ------------------------------

# (label, torch threads, NPUC_NATIVE, pin the main thread and the pool's worker to separate cores)
CONFIGS = [("2 threads, native kernels", 2, "1", False), ("1 thread, native kernels", 1, "1", False),
           ("2 threads, NPUC_NATIVE=0", 2, "0", False), ("1 thread, NPUC_NATIVE=0", 1, "0", False),
           ("2 threads, native, main and pool worker pinned to cores 0 and 1", 2, "1", True)]


def experiments(om: Path, s: Sizes, rounds: int, steps: int) -> list[dict[str, Any]]:
    """Each configuration's process loads the .om once and then waits on its stdin, asleep, while
    the others run: `rounds` turns of one generation of `steps` steps each, so that drifting
    load falls on all of them alike."""
    procs = []
    for _, threads, nat, pin in CONFIGS:
        cmd = [sys.executable, __file__, "--serve", str(om), "--threads", str(threads), "--sizes", json.dumps(s.__dict__)]
        procs.append(subprocess.Popen(cmd + (["--pin"] if pin else []), env={**os.environ, "NPUC_NATIVE": nat},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    recs: list[dict[str, list[Any]]] = [defaultdict(list) for _ in CONFIGS]
    roles: list[list[str]] = [[] for _ in CONFIGS]
    try:
        for p, r in zip(procs, roles, strict=True):
            r += json.loads(_line(p))["roles"]
        for _ in range(rounds):
            for p, rec in zip(procs, recs, strict=True):
                assert p.stdin
                p.stdin.write(f"{steps}\n")
                p.stdin.flush()
                for k, v in json.loads(_line(p)).items():
                    rec[k] += v
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=60)
    return [{"config": c[0], **analyse(rec, r)} for c, rec, r in zip(CONFIGS, recs, roles, strict=True)]


def _line(p: subprocess.Popen[str]) -> str:
    assert p.stdout
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"experiment process {p.args!r} ended")
    return line


def serve(om: str, threads: int, s: Sizes, pin: bool) -> None:
    from npuc.runtime import Session

    torch.set_num_threads(threads)  # before the load: the launchers take the thread count then
    sess = Session.load(om)
    decode_steps(sess, s, 1)  # warm-up: threads started, pages touched
    roles = thread_roles()
    if pin and (os.cpu_count() or 1) > 1:  # a woken worker then cannot take the main thread's core
        for tid, role in roles.items():
            if role in ("main", "npuc pool"):
                os.sched_setaffinity(tid, {0 if role == "main" else 1})
    probe = Probe(roles)
    print(json.dumps({"roles": [roles[t] for t in probe.tids]}), flush=True)
    for line in sys.stdin:
        print(json.dumps(decode_steps(sess, s, 1, probe, steps=int(line))), flush=True)
    probe.close()


# -- the whole trace --------------------------------------------------------------------------------

def trace(om: Path, s: Sizes, runs: int, profile_runs: int, control_runs: int, exp_rounds: int = 0,
          exp_steps: int = 21, raw: bool = False) -> dict[str, Any]:
    """The probed trace with its control generations, the per-op pass, then the experiments
    (if exp_rounds); `raw` keeps the probed steps' figures too."""
    from npuc.runtime import Session

    sess = Session.load(str(om))
    decode_steps(sess, s, 1)
    roles = thread_roles()
    probe = Probe(roles)
    role_list = [roles[t] for t in probe.tids]
    res: dict[str, Any] = {"sizes": s.__dict__, "threads": torch.get_num_threads(), "roles": _unique(role_list),
                           "schedstat": probe.ok, "runs": runs}
    # Generations with and without probes alternate, so that both see the same drifting load.
    probed: dict[str, list[Any]] = defaultdict(list)
    control: list[float] = []
    for r in range(runs):
        for k, v in decode_steps(sess, s, 1, probe).items():
            probed[k] += v
        if r < control_runs:
            control += decode_steps(sess, s, 1)["wall"]
    probe.close()
    res["trace"] = analyse(probed, role_list, raw)
    res["control"] = stats(np.asarray(control) * 1e3)
    res["ops"] = analyse_ops(op_times(sess, s, profile_runs))
    res["bandwidth"] = bandwidth_pass(sess, s, profile_runs)
    del sess
    res["experiments"] = experiments(om, s, exp_rounds, exp_steps) if exp_rounds else []
    return res


def compiled_om(s: Sizes, work: Path) -> Path:
    """The cpu-target .om as run_npuc compiles it, reused from `work` when already there."""
    from npuc.compiler.driver import compile_model

    om = work / "npuc_cpu_must_keep_origin_dtype.om"
    if om.is_file():
        return om
    ckpt = llama_checkpoint(s, work / f"llama_{s.hidden}x{s.layers}")
    return Path(compile_model(str(ckpt), input_shape=f"input_ids:1,{s.prompt}", output=str(om.with_suffix("")),
                              max_seq_len=s.max_len, soc_version="cpu", precision_mode="must_keep_origin_dtype"))


# -- the report -------------------------------------------------------------------------------------

def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(res: dict[str, Any]) -> list[str]:
    """The "Step-latency tail" section of docs/benchmarks.md (and this tool's output)."""
    t, o = res["trace"], res["ops"]

    def row(name: str, st: dict[str, float]) -> str:
        return (f"| {name} | {st['p50']:.2f} | {st['p90']:.2f} | {st['p99']:.2f} | {st['max']:.2f} | "
                f"{st['p99_over_p50']:.2f} |")

    lines = ["## Step-latency tail", "",
             f"`bench/tail.py`: {t['steps']} decode steps of the cpu-target .om ({res['runs']} generations, "
             f"{res['threads']} threads), each read around from /proc; what it means: docs/performance.md.", "",
             "| per step (ms) | P50 | P90 | P99 | max | P99/P50 |", "|---|---|---|---|---|---|",
             row("wall", t["wall"]), row("wall, generations without probes (interleaved)", res["control"])]
    if not t.get("probes"):
        return lines + ["", "Run-queue delay, switches and faults: not available (no /proc/self/task/*/schedstat)."]
    th, tl, h = t["threads"], t["tail"], t["host"]
    pool = th.get("npuc pool")
    lines += [row("wall minus the main thread's run-queue delay", t["wall_minus_main_delay"]),
              row("main thread on-CPU (also minus steal)", t["main_on_cpu"]), "",
              f"- A step, on average: the main thread {th['main']['on_cpu_ms']:.1f} ms on-CPU and "
              f"{th['main']['run_queue_ms']:.1f} ms waiting for a core ({t['main_delay_share']:.0%} of the wall), "
              f"{th['main']['involuntary']:.1f} involuntary switches"
              + (f"; the npuc pool's worker {pool['on_cpu_ms']:.1f} ms on-CPU, {pool['run_queue_ms']:.1f} ms waiting, "
                 f"{pool['voluntary']:.1f} sleeps" if pool else "")
              + f". Host steal {_f(h['steal_share'], '.1%')}; page faults over all steps {t['faults']['minor']} minor, "
              f"{t['faults']['major']} major.",
              f"- Tail (the {tl['steps']} steps above P90) against the median band (P40-P60): "
              f"+{tl['excess_ms']:.2f} ms a step = main thread's run-queue delay {tl['run_queue_ms']:+.2f}, on-CPU "
              f"{tl['on_cpu_ms']:+.2f}, steal or blocked {tl['steal_or_blocked_ms']:+.2f} (the pool's run-queue delay "
              f"{tl['pool_run_queue_ms']:+.2f}). Step by step, a tail step's run-queue delay beyond the band's "
              f"{t['ref_delay_ms']:.1f} ms covers {tl['covered_by_delay']:.0%} of its excess, half or more of it in "
              f"{tl['steps_mostly_delay']:.0%} of them. Other processes used {tl['others_cores']:.2f} cores during "
              f"tail steps, {tl['others_cores_ref']:.2f} during the band; runnable tasks {tl['runnable']:.1f} against "
              f"{tl['runnable_ref']:.1f}; the pool slept {tl['pool_sleeps']:.1f} times a tail step against "
              f"{tl['pool_sleeps_ref']:.1f}; {t['tail_first_of_run']:.0%} of the tail steps are the first of a generation. "
              f"The main thread's on-CPU time correlates {_f(t['on_cpu_vs_others'])} with the other processes' CPU.",
              "- Correlation with a step's excess over the median: "
              + ", ".join(f"{k} {_f(v)}" for k, v in t["corr"].items()) + ".",
              f"- Op by op ({o['steps']} steps): the slow steps' excess by op type (its share of the median step): "
              + ", ".join(f"{k} {v:.0%} ({s:.0%})" for k, v, s in o["excess_by_type"][:4])
              + f"; a slow step's single slowest op holds {o['top_op_share']:.0%} of its excess (median)."]
    bw = res.get("bandwidth")
    if bw:
        lines.append(f"- Memory ({bw['steps']} steps, each after a timed read of 64 MB by the step's GEMV): the read "
                     f"ran at {bw['gbps']:.1f} GB/s (P50; its own P99/P50 {bw['read']['p99_over_p50']:.2f}); before "
                     f"slow steps it took {bw['tail_read_over_ref']:.2f}x its time before median ones; correlation "
                     f"of a step's wall with it {_f(bw['corr'])}. Consecutive steps' walls correlate "
                     f"{_f(t['lag1'])} (slow steps come in runs when high).")
    if res["experiments"]:
        lines += ["", "| configuration (one process each, interleaved) | steps | P50 (ms) | P99 (ms) | P99/P50 | "
                  "main on-CPU P99/P50 | main run-queue delay / wall | tail excess that is run-queue delay |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in res["experiments"]:
            el = e.get("tail", {})
            share = el["run_queue_ms"] / el["excess_ms"] if el.get("excess_ms") else None
            cpu = e.get("main_on_cpu", {}).get("p99_over_p50")
            lines.append(f"| {e['config']} | {e['steps']} | {e['wall']['p50']:.2f} | {e['wall']['p99']:.2f} | "
                         f"{e['wall']['p99_over_p50']:.2f} | {_f(cpu)} | {_f(e.get('main_delay_share'), '.0%')} | "
                         f"{_f(share, '.0%')} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the small model, few steps")
    ap.add_argument("--work", default=None, help="folder for the checkpoint and .om (kept between runs)")
    ap.add_argument("--runs", type=int, default=None, help="generations traced (default 6, quick 2)")
    ap.add_argument("--no-experiments", action="store_true", help="leave out the thread / kernel configurations")
    ap.add_argument("--serve", metavar="OM", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.threads, Sizes(**json.loads(args.sizes)), args.pin)
        return
    s = QUICK if args.quick else FULL
    work = Path(args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"npuc-tail-{s.hidden}x{s.layers}")
    work.mkdir(parents=True, exist_ok=True)
    runs = args.runs or (2 if args.quick else 6)
    t0 = time.perf_counter()
    res = trace(compiled_om(s, work), s, runs, profile_runs=1 if args.quick else 2, control_runs=runs,
                exp_rounds=0 if args.no_experiments else (1 if args.quick else 6), raw=True)
    (work / "tail.json").write_text(json.dumps(res, indent=1))
    print("\n".join(render(res)))
    print(f"[tail] {time.perf_counter() - t0:.0f} s; JSON: {work / 'tail.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
