"""Watching the pass pipeline: IR dumps, pass timings and the fusion report.

    npuc compile M --input_shape ... --dump-ir-after=all --dump-dir ir/   # ir/00-input.ir, ir/01-dce.ir, ...
    npuc compile M --input_shape ... --dump-ir-after=swiglu-fusion,dce --dump-dir ir/
    npuc compile M --input_shape ... --time-passes                        # a table on stderr
    npuc compile M --input_shape ... --fusion-report fusion.json

A dump file is numbered by the pass's position in the pipeline (`00` is the
frontend's graph, written whenever anything is dumped), so the files of one run
sort in pipeline order and a pass that runs twice gets two files. Dumps and the
report are written atomically: a reader never sees half a file.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError
from npuc.ir import Graph, Node, print_graph
from npuc.passes.manager import Pass, PassManager

REPORT_FORMAT = "npuc-fusion-report/1"


def select_passes(spec: str | Sequence[str], passes: Sequence[Pass]) -> frozenset[int]:
    """The pipeline positions that `--dump-ir-after` selects: `all`, or pass names.

    Every unknown name is reported at once, with the pipeline's pass names."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [s.strip() for s in items if s.strip()]
    known = list(dict.fromkeys(p.name for p in passes))
    listing = f"passes: {', '.join(known)}"
    hint = "write --dump-ir-after=all, or pass names separated by commas"
    if not names:
        raise NpucError("NPUC-E0120", "--dump-ir-after names no pass", hint, exit_code=EXIT_USAGE,
                        details=[listing])
    if "all" in names:
        return frozenset(range(len(passes)))
    unknown = [n for n in dict.fromkeys(names) if n not in known]
    if unknown:
        problems = []
        for n in unknown:
            close = difflib.get_close_matches(n, known, n=1, cutoff=0.5)
            problems.append(repr(n) + (f" (closest: {close[0]!r})" if close else ""))
        raise NpucError("NPUC-E0120", f"--dump-ir-after: no pass named {', '.join(problems)}", hint,
                        exit_code=EXIT_USAGE, details=[listing])
    return frozenset(i for i, p in enumerate(passes) if p.name in names)


def ensure_parent(path: str, flag: str) -> None:
    """Create the folder `path` will be written into, before any slow work is done."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot create the folder for {flag} {path!r}: {e.strerror}",
                        f"choose a writable {flag} path", exit_code=EXIT_IO) from None


def write_text_atomic(path: str, text: str, flag: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=directory, delete=False,
                                         prefix=f".{os.path.basename(path)}.", suffix=".tmp") as f:
            tmp = f.name
            f.write(text)
        os.chmod(tmp, 0o644)  # NamedTemporaryFile makes 0600; these are ordinary output files
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise NpucError("NPUC-E0406", f"cannot write {flag} {path!r}: {e.strerror or e}",
                        f"choose a writable {flag} path", exit_code=EXIT_IO) from None


@dataclass(frozen=True)
class IRDumper:
    """Writes `NN-<pass>.ir` into `directory` after each selected pass."""

    directory: str
    selected: frozenset[int]  # pipeline positions, 0-based
    width: int = 2

    @classmethod
    def create(cls, spec: str | Sequence[str] | None, directory: str | os.PathLike[str] | None,
               passes: Sequence[Pass]) -> IRDumper | None:
        if spec is None and directory is None:
            return None
        if spec is None or directory is None:
            given, missing = ("--dump-ir-after", "--dump-dir") if directory is None else ("--dump-dir",
                                                                                          "--dump-ir-after")
            raise NpucError("NPUC-E0121", f"{given} needs {missing}",
                            "write e.g. --dump-ir-after=all --dump-dir build/ir", exit_code=EXIT_USAGE)
        selected = select_passes(spec, passes)
        path = os.fspath(directory)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise NpucError("NPUC-E0406", f"cannot create --dump-dir {path!r}: {e.strerror}",
                            "choose a writable --dump-dir", exit_code=EXIT_IO) from None
        return cls(path, selected, max(2, len(str(len(passes)))))

    def input(self, g: Graph) -> None:
        self._write(0, "input", g)

    def after(self, index: int, p: Pass, g: Graph) -> None:
        if index in self.selected:
            self._write(index + 1, p.name, g)

    def _write(self, number: int, label: str, g: Graph) -> None:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label)
        path = os.path.join(self.directory, f"{number:0{self.width}d}-{safe}.ir")
        write_text_atomic(path, print_graph(g), "--dump-dir")


@dataclass(frozen=True)
class PassRun:
    """One pass's run: its pipeline position (1-based, as in dump file names), time and details."""

    index: int
    name: str
    seconds: float
    details: dict[str, Any]


class Provenance:
    """Which nodes each rewrite-built node stands for, followed through fusions of fusions.

    Rewrites record nodes by name, and a name is unique only among live nodes (a
    fused node takes its root's name; other passes rebuild nodes and rename), so
    names are resolved to nodes right after the pass that recorded them and
    provenance is kept by node identity. A node that a pass without provenance
    records rebuilds (alignment, precision) starts afresh."""

    def __init__(self, g: Graph) -> None:
        self._live = {n.name: n for n in g.nodes}
        self._of: dict[int, tuple[Node, list[str], list[str]]] = {}  # id -> (node, replaced, rules)

    def after(self, g: Graph, fusions: Sequence[dict[str, Any]]) -> None:
        made: dict[str, tuple[list[str], list[str]]] = {}  # by name, within this pass
        for f in fusions:
            replaced: list[str] = []
            rules: list[str] = []
            for name in f["replaced"]:
                before = made.get(name) or self.get(self._live.get(name))
                replaced += before[0] if before else [name]
                rules += before[1] if before else []
            prov = (list(dict.fromkeys(replaced)), list(dict.fromkeys([*rules, f["rule"]])))
            for name in f["created"]:
                made[name] = prov
        self._live = {n.name: n for n in g.nodes}
        for name, prov in made.items():
            node = self._live.get(name)
            if node is not None:
                self._of[id(node)] = (node, *prov)

    def get(self, node: Node | None) -> tuple[list[str], list[str]] | None:
        """(the nodes it replaced, the rules that built it), or None for a node no rewrite built."""
        entry = self._of.get(id(node)) if node is not None else None
        return (entry[1], entry[2]) if entry is not None and entry[0] is node else None


@dataclass
class PipelineRun:
    graph: Graph
    runs: list[PassRun]
    provenance: Provenance
    verified: bool = False  # the verifier ran after each pass (and its time is in the pass's)


def run_pipeline(g: Graph, passes: Sequence[Pass], *, verify_each: bool = False,
                 dumper: IRDumper | None = None, on_pass: Callable[[int], None] | None = None) -> PipelineRun:
    """Run `passes` over `g` with the PassManager, recording each run and dumping as asked."""
    runs: list[PassRun] = []
    provenance = Provenance(g)
    pm = PassManager(passes, verify_each=verify_each)

    def after(i: int, p: Pass, graph: Graph) -> None:
        # The manager keys details by pass name; take them per run, so that a pass the
        # pipeline runs twice reports twice instead of its last run overwriting the first.
        details = pm.details.pop(p.name, {})
        runs.append(PassRun(i + 1, p.name, pm.timings[-1][1], details))
        provenance.after(graph, details.get("fusions", []))
        if dumper is not None:
            dumper.after(i, p, graph)
        if on_pass is not None:
            on_pass(1)

    pm.on_after = after
    if dumper is not None:
        dumper.input(g)
    g = pm.run(g)
    return PipelineRun(g, runs, provenance, verify_each)


def format_timings(run: PipelineRun) -> str:
    """`--time-passes`: each pass's wall time and the total, in pipeline order."""
    total = sum(r.seconds for r in run.runs)
    width = max([len("pass")] + [len(r.name) for r in run.runs])
    lines = ["npuc: time per pass (wall clock)",
             f"  {'#':>3}  {'pass':<{width}}  {'ms':>10}  {'%':>6}"]
    for r in run.runs:
        share = 100.0 * r.seconds / total if total else 0.0
        lines.append(f"  {r.index:>3}  {r.name:<{width}}  {r.seconds * 1e3:>10.2f}  {share:>6.1f}")
    lines.append(f"  {'':>3}  {'total':<{width}}  {total * 1e3:>10.2f}  {100.0 if total else 0.0:>6.1f}")
    if run.verified:
        lines.append("  (--debug: each time includes the verifier run after the pass)")
    return "\n".join(lines)


def fusion_report(run: PipelineRun) -> dict[str, Any]:
    """The fusion report, in the spirit of ATC's fusion_result.json.

    `passes`: for each rewrite pass run, each rule's matched/applied counts, its
    refusals (reason -> count) and, for a rule that never applied, why not; any
    other pass that reports details (alignment's padded ops, ...) with those.
    `fusions`: each rewrite in order, the nodes it created and the nodes it replaced.
    `fused_ops`: each node of the final program a rewrite built, with the rules that
    built it and the nodes it replaced, through fusions of fusions (names as the
    rewrite saw them: those of `00-input.ir` unless an earlier pass renamed them).
    `op_counts`: the ops of the final program (lowering is one op per node)."""
    passes: list[dict[str, Any]] = []
    fusions: list[dict[str, Any]] = []
    for r in run.runs:
        if not r.details:
            continue
        entry: dict[str, Any] = {"index": r.index, "pass": r.name}
        why_not = r.details.get("explain", {})
        for key, value in r.details.items():
            if key == "fusions":
                fusions.extend({"index": r.index, "pass": r.name, **f} for f in value)
            elif key == "rules":
                entry["rules"] = {rule: {**stats, **_why_not(rule, why_not)} for rule, stats in value.items()}
            elif key != "explain":
                entry[key] = value
        passes.append(entry)
    ops = Counter(n.op for n in run.graph.nodes)
    return {"format": REPORT_FORMAT, "passes": passes, "fusions": fusions, "fused_ops": _fused_ops(run),
            "op_counts": dict(sorted(ops.items())), "nodes": len(run.graph.nodes)}


def _fused_ops(run: PipelineRun) -> dict[str, dict[str, Any]]:
    fused: dict[str, dict[str, Any]] = {}
    for n in run.graph.nodes:
        prov = run.provenance.get(n)
        if prov is not None:
            fused[n.name] = {"op": n.op, "replaced": prov[0], "rules": prov[1]}
    return fused


def _why_not(rule: str, explain: dict[str, str]) -> dict[str, str]:
    text = explain.get(rule)
    if text is None:
        return {}
    return {"why_not": text.removeprefix(f"{rule}: ")}


def write_fusion_report(path: str, report: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(report, indent=2, sort_keys=True) + "\n", "--fusion-report")

