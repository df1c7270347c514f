"""om_fuzz's `.om` mutants against libnpucrt built with AddressSanitizer and UBSan.

    python -m tests.fuzz.om_fuzz_c --execs 1000000 --seed 0 --jobs 2 [--start I] [--save DIR]

The driver (npucrt/tests/fuzz_driver.c, every npucrt/src/*.c, -fsanitize=address,undefined
-fno-sanitize-recover=all -g -O1) is built once and cached under the temp folder, keyed by the
hash of the sources, the header and the compiler. Mutant i of seed S is om_fuzz.mutant(seeds,
S, i) (every checksum re-sealed). J worker processes (fork) each make the mutants of a batch of
indices and stream them to their own long-lived driver: load from the buffer, a session with
one thread, one run of every program on zeroed inputs, a 4-token generate when the model has
generation info; one answer line per mutant, and a leak checkpoint at the end of each batch.

Outcomes per mutant:

    ran        loaded, every program ran and (where it can) generate succeeded
    refused    load refused with an NPUC code (counted per code)
    run-refused  loaded, but a run or generate refused with an NPUC code (per code)
    crash      the driver died without a sanitizer report (a signal, an exit code)
    hang       no answer within --timeout seconds (the driver is killed and replaced)
    sanitizer  an ASan, UBSan or LeakSanitizer report
    memory     ASan's RSS cap (hard_rss_limit_mb) or an allocation it refuses
    contract   the driver saw the C API break its own contract (status 0 without a model, ...)

A driver that dies is replaced, and the mutants of its batch up to the one it died on are run
again one at a time, each in a fresh driver, to name the one that fails (a leak: every mutant
of the batch). Each failing mutant is saved as <save>/c-<class>-<hash>.om with the report
beside it (.txt). Every 100th mutant is also loaded by the Python reference of
tests/test_npucrt_loader.py (the ported checks, and the full ones) and its load code compared
with the C library's; the known divergences by design listed there (NUL strings, ranks past 8,
a table outside its table's dims, more than 64 sections, a tensor-parallel manifest) are not
counted, and a binder's refusal may differ in its code. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import npucrt_util
from tests.fuzz import om_fuzz

DRIVER = "npucrt/tests/fuzz_driver.c"
TIMEOUT_S = 10.0
BATCH = 256
XCHECK_EVERY = 100
MEMORY_CAP = "1G"  # the driver's max_memory (1 GiB); the Python reference gets the same cap
FAILURES = ("crash", "hang", "sanitizer", "memory", "contract")
CHECKPOINT = struct.pack("<Q", 2**64 - 1)
ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=86:hard_rss_limit_mb=3072:"
                    "handle_segv=1:handle_abort=1:symbolize=1:allocator_may_return_null=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87",
    "LSAN_OPTIONS": "exitcode=0",  # the driver's own checkpoint says "LEAK:" and exits 91
}


# ---------------------------------------------------------------- building

def libasan_available() -> bool:
    """Whether the C compiler links a trivial program with -fsanitize=address,undefined."""
    cc = npucrt_util.compiler()
    if cc is None:
        return False
    with tempfile.TemporaryDirectory(prefix="npuc-asan-probe-") as d:
        src = Path(d) / "p.c"
        src.write_text("int main(void) { return 0; }\n")
        r = subprocess.run([cc, *npucrt_util.SANITIZE, str(src), "-o", str(Path(d) / "p")], capture_output=True,
                           timeout=120)
        if r.returncode:
            return False
        return subprocess.run([str(Path(d) / "p")], capture_output=True, timeout=60).returncode == 0


def _source_key() -> str:
    h = hashlib.sha256()
    files = [npucrt_util.ROOT / DRIVER, npucrt_util.INCLUDE / "npucrt.h",
             *sorted(npucrt_util.SRC.glob("*.[ch]")), *sorted(npucrt_util.SRC.glob("third_party/*.h"))]
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    cc = npucrt_util.compiler() or ""
    h.update(cc.encode())
    h.update(subprocess.run([cc, "--version"], capture_output=True).stdout if cc else b"")
    return h.hexdigest()[:16]


def build_driver(cache: str | Path | None = None) -> Path:
    """The sanitized driver, built once per sources' hash under `cache` (default: the temp folder).
    The driver itself is held to -Wall -Wextra -Wpedantic -Werror -Wshadow -Wconversion; the
    library is built as the test suite builds it (warnings are its own tests' business)."""
    cc = npucrt_util.compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    root = Path(cache) if cache else Path(tempfile.gettempdir()) / "npuc-om-fuzz-c"
    exe = root / _source_key() / "fuzz_driver"
    if exe.is_file():
        return exe
    subprocess.run([cc, "-std=c11", "-fsyntax-only", *npucrt_util.WARNINGS, *npucrt_util.SANITIZE,
                    f"-I{npucrt_util.INCLUDE}", str(npucrt_util.ROOT / DRIVER)], check=True, timeout=120)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=root) as tmp:
        built = npucrt_util.build_exe(tmp, DRIVER, sanitize=True, warnings=False)
        exe.parent.mkdir(parents=True, exist_ok=True)
        os.replace(built, exe)  # atomic: concurrent builders leave one whole file
    return exe


# ---------------------------------------------------------------- one driver

@dataclass
class Death:
    """How a driver ended without answering."""

    cls: str  # crash | hang | sanitizer | memory | contract
    signature: str
    report: str


def _signature(report: str, rc: int | None) -> tuple[str, str]:
    """(class, one line naming the bug) of a driver's stderr and exit status."""
    if "CONTRACT:" in report:
        return "contract", report[report.index("CONTRACT:"):].splitlines()[0]
    if "RSS limit" in report or "allocation-size-too-big" in report or (
            "out of memory" in report.lower() and "AddressSanitizer" in report):
        m = re.search(r"SUMMARY: AddressSanitizer: .*", report)
        return "memory", m.group(0) if m else "RSS limit exceeded"
    frame = re.search(r"#\d+ 0x[0-9a-f]+ in (\S+) (\S*npucrt/src/\S+)", report)
    where = f" at {frame.group(1)} {Path(frame.group(2)).name}" if frame else ""
    if m := re.search(r"(\S+\.c):(\d+):\d+: runtime error: (.*)", report):
        return "sanitizer", f"UBSan: {Path(m.group(1)).name}:{m.group(2)}: {m.group(3)[:160]}"
    if "LeakSanitizer" in report or "LEAK:" in report:
        return "sanitizer", "LeakSanitizer: leak" + where
    if m := re.search(r"SUMMARY: AddressSanitizer: (.*)", report):
        return "sanitizer", f"ASan: {m.group(1)[:200]}"
    if "Sanitizer" in report:
        return "sanitizer", report.strip().splitlines()[-1][:200]
    if rc is not None and rc < 0:
        return "crash", f"signal {signal.Signals(-rc).name}" + where
    return "crash", f"exit status {rc}" + where


class Driver:
    """One long-lived sanitized driver process, answering one line per buffer."""

    def __init__(self, exe: Path, timeout: float = TIMEOUT_S) -> None:
        self.exe, self.timeout = exe, timeout
        self.errf = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errf,
                                     env=dict(os.environ, **ENV))
        self.pending = b""
        self.killed = False

    def _line(self) -> bytes | None:
        """The next line, or None when the driver is gone or silent past the timeout (then killed)."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.proc.kill()
                self.killed = True
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def _send(self, payload: bytes) -> bool:
        try:
            self.proc.stdin.write(payload)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            return True
        except (BrokenPipeError, OSError):
            return False

    def execute(self, data: bytes) -> tuple[int, int, int] | None:
        """(load, run, generate) codes, or None when the driver did not answer (see death())."""
        if not self._send(struct.pack("<Q", len(data)) + data):
            return None
        line = self._line()
        if line is None:
            return None
        a, b, c = (int(x) for x in line.split())
        return a, b, c

    def checkpoint(self) -> bool:
        """No leak so far."""
        return self._send(CHECKPOINT) and self._line() == b"L"

    def death(self, timed_out: bool) -> Death:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.errf.seek(0)
        report = self.errf.read().decode("utf-8", "replace")
        self.errf.close()
        if timed_out:
            return Death("hang", f"no answer within {self.timeout:.0f} s", report)
        cls, sig = _signature(report, rc)
        return Death(cls, sig, report)

    def close(self) -> Death | None:
        """End the driver (its exit runs the last leak check): None when it ends cleanly."""
        if self.proc.poll() is None and self.checkpoint():
            self.proc.stdin.close()  # type: ignore[union-attr]
            if self.proc.wait(60) == 0:
                self.errf.close()
                return None
        return self.death(False)

    def timed_out(self) -> bool:
        return self.killed


def run_alone(exe: Path, data: bytes, timeout: float = TIMEOUT_S) -> tuple[tuple[int, int, int] | None, Death | None]:
    """One buffer in a fresh driver, then its leak check: (codes, how it died or None)."""
    d = Driver(exe, timeout)
    codes = d.execute(data)
    if codes is None:
        return None, d.death(d.timed_out())
    return codes, d.close()


# ---------------------------------------------------------------- the Python reference (sampled)

def _reference(data: bytes, tmp: str) -> tuple[int, int, str]:
    """(ported code, full code, full message) of tests/test_npucrt_loader.py's Python reference."""
    from tests.test_npucrt_loader import python_load

    path = os.path.join(tmp, f"x{os.getpid()}.om")
    Path(path).write_bytes(data)
    try:
        full, message, _ = python_load(path, ported=False)
        return python_load(path, ported=True)[0], full, message
    finally:
        os.unlink(path)


def _gist(message: str) -> str:
    """A message without its path, names and numbers: one line per kind of refusal."""
    message = message.split(": ", 1)[-1]
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", message)
    return re.sub(r"-?\d+", "N", message)[:120]


def _known_divergence(data: bytes) -> str | None:
    """A file whose load code C may give differently by design (tests/test_npucrt_loader.py)."""
    if len(data) >= om_fuzz._HEADER.size:
        count = om_fuzz._HEADER.unpack_from(data, 0)[3]
        if count > 64:
            return "more than 64 sections"
        for k in range(min(count, (len(data) - om_fuzz._HEADER.size) // om_fuzz._ENTRY.size)):
            raw = om_fuzz._ENTRY.unpack_from(data, om_fuzz._HEADER.size + om_fuzz._ENTRY.size * k)[0]
            if raw.rstrip(b"\0") == b"manifest":
                return "a tensor-parallel manifest"
    return None


def compare_load(c_code: int, ported: int, full: int, message: str = "") -> str:
    """'agree', 'binder' (both refuse at a binder's check, codes may differ) or a disagreement."""
    if ported == -1 or full == -1:
        return "the Python reference crashed: " + message[:120]
    if ported != 0:
        return "agree" if c_code == ported else f"C {c_code}, Python {ported}"
    if full != 0:
        if c_code == 0:
            return f"C loads, Python's full checks refuse ({full}): {_gist(message)}"
        return "agree" if c_code == full else "binder"
    return "agree" if c_code == 0 else f"C {c_code}, Python loads"


# ---------------------------------------------------------------- the workers

@dataclass
class Failure:
    cls: str
    index: int
    kind: str
    signature: str
    report: str
    data: bytes
    reproduced: bool


@dataclass
class BatchResult:
    counts: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    xchecks: Counter[str] = field(default_factory=Counter)
    disagreements: list[tuple[int, str, bytes]] = field(default_factory=list)


_W: dict[str, Any] = {}


def _init_worker(exe: str, seed_paths: list[str], seed: int, timeout: float, tmp: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["NPUC_MAX_MEMORY"] = MEMORY_CAP
    _W.update(exe=Path(exe), seeds=[Path(p).read_bytes() for p in seed_paths], seed=seed, timeout=timeout, tmp=tmp,
              driver=None)


def _driver() -> Driver:
    if _W["driver"] is None:
        _W["driver"] = Driver(_W["exe"], _W["timeout"])
    return _W["driver"]


def _outcome(codes: tuple[int, int, int]) -> str:
    load, run, gen = codes
    if load:
        return f"refused {load}"
    if run:
        return f"run-refused {run}"
    if gen > 0:
        return f"generate-refused {gen}"
    return "ran" if gen == 0 else "ran (no generate)"


def _isolate(batch: list[tuple[int, str, bytes]], upto: int, death: Death, res: BatchResult) -> None:
    """The driver died on batch[upto] (or, for a leak, somewhere before it): each candidate alone."""
    exe, timeout = _W["exe"], _W["timeout"]
    leak = "Leak" in death.signature
    candidates = batch[:upto + 1] if leak else [batch[upto]] + batch[:upto]
    for i, kind, data in candidates:
        _, alone = run_alone(exe, data, timeout)
        if alone is not None:
            res.failures.append(Failure(alone.cls, i, kind, alone.signature, alone.report, data, True))
            return
    i, kind, data = batch[upto]
    res.failures.append(Failure(death.cls, i, kind, death.signature + " (not reproduced alone)", death.report, data,
                                False))


def run_batch(rng_: tuple[int, int]) -> BatchResult:
    first, last = rng_
    res = BatchResult()
    seeds, seed = _W["seeds"], _W["seed"]
    batch = []
    for i in range(first, last):
        kind, data = om_fuzz.mutant(seeds, seed, i)
        batch.append((i, kind, data))
        d = _driver()
        codes = d.execute(data)
        if codes is None:
            death = d.death(d.timed_out())
            _W["driver"] = None
            res.counts[death.cls] += 1
            _isolate(batch, len(batch) - 1, death, res)
            continue
        res.counts[_outcome(codes)] += 1
        if i % XCHECK_EVERY == 0:
            why = _known_divergence(data)
            if why:
                res.xchecks[f"skipped: {why}"] += 1
            else:
                verdict = compare_load(codes[0], *_reference(data, _W["tmp"]))
                res.xchecks[verdict if verdict in ("agree", "binder") else "disagree"] += 1
                if verdict not in ("agree", "binder"):
                    res.disagreements.append((i, verdict, data))
    d = _driver()
    if not d.checkpoint():
        death = d.death(d.timed_out())
        _W["driver"] = None
        res.counts[death.cls] += 1
        _isolate(batch, len(batch) - 1, death, res)
    return res


# ---------------------------------------------------------------- the run

@dataclass
class Summary:
    execs: int = 0
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    xchecks: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    disagreements: list[tuple[int, str]] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)

    @property
    def n_failures(self) -> int:
        return sum(self.counts[c] for c in FAILURES)

    def render(self) -> str:
        ran = sum(n for k, n in self.counts.items() if k.startswith("ran"))
        lines = [f"executions: {self.execs} in {self.seconds:.1f} s ({self.execs / max(self.seconds, 1e-9):.1f}/s)",
                 f"loaded and ran: {ran}; failures: {self.n_failures} ("
                 + ", ".join(f"{c} {self.counts[c]}" for c in FAILURES) + ")",
                 "outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))]
        lines.append(f"Python cross-check (every {XCHECK_EVERY}th): "
                     + ", ".join(f"{k} {n}" for k, n in sorted(self.xchecks.items())))
        kinds = Counter(why for _, why in self.disagreements)
        for why, n in kinds.most_common():
            first = next(i for i, w in self.disagreements if w == why)
            lines.append(f"  {n:6d}  disagree: {why} (first: mutant {first})")
        sigs = Counter((f.cls, f.signature) for f in self.failures)
        for (cls, sig), n in sigs.most_common():
            lines.append(f"  {n:6d}  {cls}: {sig}")
        for f in self.failures[:20]:
            lines.append(f"  failure: mutant {f.index} ({f.kind}) {f.cls}")
        if self.saved:
            lines.append(f"saved {len(self.saved)} files under {Path(self.saved[0]).parent}")
        return "\n".join(lines)


def _save(save: Path, cls: str, data: bytes, report: str) -> str:
    save.mkdir(parents=True, exist_ok=True)
    name = f"c-{cls}-{hashlib.sha256(data).hexdigest()[:16]}"
    (save / f"{name}.om").write_bytes(data)
    (save / f"{name}.txt").write_text(report)
    return str(save / f"{name}.om")


def fuzz(execs: int, seed: int = 0, jobs: int = 1, start: int = 0, save: str | Path | None = None,
         timeout: float = TIMEOUT_S, batch: int = BATCH, log: Callable[[str], None] | None = None,
         exe: Path | None = None) -> Summary:
    """Mutants start .. start + execs - 1 of `seed` through the sanitized driver."""
    exe = exe or build_driver()
    seeds = [str(p) for p in om_fuzz.seed_files()]
    summary = Summary()
    t0 = time.monotonic()
    ranges = [(a, min(a + batch, start + execs)) for a in range(start, start + execs, batch)]
    ctx = mp.get_context("fork")
    next_log = 10000
    with tempfile.TemporaryDirectory(prefix="npuc-om-fuzz-c-") as tmp, \
            ctx.Pool(jobs, _init_worker, (str(exe), seeds, seed, timeout, tmp), maxtasksperchild=None) as pool:
        for res in pool.imap_unordered(run_batch, ranges):
            summary.execs += sum(res.counts.values())
            summary.counts.update(res.counts)
            summary.xchecks.update(res.xchecks)
            for f in res.failures:
                summary.failures.append(f)
                if log:
                    log(f"[mutant {f.index}] {f.cls}: {f.signature}")
                if save is not None:
                    summary.saved.append(_save(Path(save), f.cls, f.data,
                                               f"mutant {f.index} of seed {seed} ({f.kind}): {f.signature}\n\n{f.report}"))
            for i, why, data in res.disagreements:
                summary.disagreements.append((i, why))
                if log:
                    log(f"[mutant {i}] disagree: {why}")
                if save is not None:
                    summary.saved.append(_save(Path(save), "disagree", data, f"mutant {i} of seed {seed}: {why}\n"))
            if log and summary.execs >= next_log:
                next_log += 10000
                el = time.monotonic() - t0
                log(f"[{summary.execs} executions, {el:.0f} s, {summary.execs / el:.0f}/s] failures "
                    f"{summary.n_failures}, ran {sum(n for k, n in summary.counts.items() if k.startswith('ran'))}")
    summary.seconds = time.monotonic() - t0
    return summary


def replay(paths: list[str | Path], exe: Path | None = None, timeout: float = TIMEOUT_S) -> Iterator[
        tuple[str, str, str]]:
    """Each file alone through the sanitized driver: (path, outcome, failure signature or "")."""
    exe = exe or build_driver()
    for p in paths:
        codes, death = run_alone(exe, Path(p).read_bytes(), timeout)
        if death is not None:
            yield str(p), death.cls, death.signature + "\n" + death.report[-4000:]
        else:
            assert codes is not None
            yield str(p), _outcome(codes), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.om_fuzz_c", description=__doc__.split("\n")[0])
    ap.add_argument("--execs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first mutant index (to split a long run into shards)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per execution before a hang")
    ap.add_argument("--batch", type=int, default=BATCH, help="mutants per batch (and per leak checkpoint)")
    ap.add_argument("--save", default=None, help="directory for failing mutants (c-<class>-<hash>.om + .txt)")
    a = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    exe = build_driver()
    log(f"driver: {exe}")
    s = fuzz(a.execs, a.seed, a.jobs, a.start, a.save, a.timeout, a.batch, log=log, exe=exe)
    print(s.render(), flush=True)
    return 1 if s.n_failures else 0


if __name__ == "__main__":
    sys.exit(main())
