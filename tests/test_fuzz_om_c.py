"""om_fuzz's `.om` mutants against libnpucrt under AddressSanitizer and UBSan
(tests/fuzz/om_fuzz_c.py, npucrt/tests/fuzz_driver.c): a CI-sized run, a replay of the fuzz
corpus, and the harness's own failure handling on a fake driver. The long run (figures in
docs/security.md):

    python -m tests.fuzz.om_fuzz_c --execs 1000000 --seed 0 --jobs 2 --save /tmp/fzc/long/save
"""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from tests import npucrt_util
from tests.fuzz import om_fuzz, om_fuzz_c

CORPUS_FILES = sorted(om_fuzz.CORPUS.glob("*.om")) if om_fuzz.CORPUS.is_dir() else []


@pytest.fixture(scope="module")
def driver() -> Path:
    if npucrt_util.compiler() is None:
        pytest.skip("no C compiler")
    if not om_fuzz_c.libasan_available():
        pytest.skip("the C compiler cannot build with -fsanitize=address,undefined (no libasan/libubsan)")
    return om_fuzz_c.build_driver()


def test_fuzz_budget_has_no_failures(driver: Path) -> None:
    s = om_fuzz_c.fuzz(2000, seed=0, jobs=2, exe=driver)
    assert s.execs == 2000
    assert s.n_failures == 0, s.render()
    # the mutants reach the executor: some load and run, and generate where the model can
    assert s.counts["ran"] > 50 and s.counts["ran (no generate)"] > 50, s.render()
    assert sum(s.xchecks.values()) == 20, s.render()


@pytest.mark.skipif(not CORPUS_FILES, reason="no corpus files yet")
def test_corpus_replays_cleanly(driver: Path) -> None:
    """Every file the fuzzers kept (c-* ones included) loads, or is refused with a code, and
    nothing the sanitizers see."""
    got = list(om_fuzz_c.replay(CORPUS_FILES, exe=driver))
    assert len(got) == len(CORPUS_FILES)
    bad = {Path(p).name: f"{cls}: {sig}" for p, cls, sig in got if cls in om_fuzz_c.FAILURES}
    assert not bad, bad


def test_seeds_load_run_and_generate(driver: Path) -> None:
    got = {Path(p).name: cls for p, cls, _ in om_fuzz_c.replay(om_fuzz.seed_files(), exe=driver)}
    assert got == {"plain.om": "ran (no generate)", "kv.om": "ran", "w4.om": "ran"}, got


# ---------------------------------------------------------------- the harness, on a fake driver

_FAKE = r'''#!PYTHON
"""Speaks fuzz_driver's protocol; misbehaves on buffers that say so."""
import os, signal, struct, sys, time
leak = False
while True:
    head = sys.stdin.buffer.read(8)
    if len(head) < 8:
        break
    (n,) = struct.unpack("<Q", head)
    if n == 2**64 - 1:
        if leak:
            sys.stderr.write("ERROR: LeakSanitizer: detected memory leaks\n"
                             "    #1 0x4 in rt_alloc /src/npucrt/src/util.c:9\nLEAK: found\n")
            sys.exit(91)
        sys.stdout.write("L\n"); sys.stdout.flush()
        continue
    data = sys.stdin.buffer.read(n)
    if data == b"segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if data == b"hang":
        time.sleep(60)
    if data == b"asan":
        sys.stderr.write("==1==ERROR: AddressSanitizer: heap-buffer-overflow\n"
                         "    #0 0x1 in om_read /src/npucrt/src/om.c:12\n"
                         "SUMMARY: AddressSanitizer: heap-buffer-overflow /src/npucrt/src/om.c:12 in om_read\n")
        sys.exit(86)
    if data == b"ubsan":
        sys.stderr.write("/src/npucrt/src/validate.c:77:5: runtime error: signed integer overflow\n")
        sys.exit(87)
    if data == b"leak":
        leak = True
    sys.stdout.write("404 -1 -1\n"); sys.stdout.flush()
'''


@pytest.fixture()
def fake(tmp_path: Path) -> Path:
    exe = tmp_path / "fake_driver"
    exe.write_text(_FAKE.replace("PYTHON", sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@pytest.mark.parametrize("payload,cls,words", [
    (b"segv", "crash", "SIGSEGV"), (b"hang", "hang", "no answer"), (b"asan", "sanitizer", "heap-buffer-overflow"),
    (b"ubsan", "sanitizer", "validate.c:77"), (b"leak", "sanitizer", "LeakSanitizer"),
    (b"fine", None, "")])
def test_harness_classifies(fake: Path, payload: bytes, cls: str | None, words: str) -> None:
    codes, death = om_fuzz_c.run_alone(fake, payload, timeout=2)
    if cls is None:
        assert death is None and codes == (404, -1, -1)
    else:
        assert death is not None and death.cls == cls and words in death.signature, death


def test_harness_isolates_the_culprit(fake: Path, tmp_path: Path) -> None:
    """A driver that dies mid-batch (or leaks by the checkpoint): the mutant named is the one that
    does it alone, and it is saved with its report."""
    sigint = signal.getsignal(signal.SIGINT)
    try:
        om_fuzz_c._init_worker(str(fake), [], 0, 2.0, str(tmp_path))
    finally:
        signal.signal(signal.SIGINT, sigint)
        os.environ.pop("NPUC_MAX_MEMORY", None)
    for bad, cls in ((b"asan", "sanitizer"), (b"leak", "sanitizer"), (b"segv", "crash")):
        res = om_fuzz_c.BatchResult()
        batch = [(10, "x", b"a"), (11, "y", bad), (12, "z", b"c")]
        om_fuzz_c._isolate(batch, 2 if bad == b"leak" else 1, om_fuzz_c.Death(cls, "s", ""), res)
        (f,) = res.failures
        assert (f.index, f.cls, f.reproduced, f.data) == (11, cls, True, bad), f
        saved = Path(om_fuzz_c._save(tmp_path / "save", f.cls, f.data, f.report))
        assert saved.name.startswith(f"c-{cls}-") and saved.read_bytes() == bad
        assert saved.with_suffix(".txt").is_file()


def test_compare_load() -> None:
    assert om_fuzz_c.compare_load(404, 404, 404) == "agree"
    assert om_fuzz_c.compare_load(410, 0, 410) == "agree"
    assert om_fuzz_c.compare_load(413, 0, 408) == "binder"
    assert om_fuzz_c.compare_load(0, 0, 0) == "agree"
    assert om_fuzz_c.compare_load(405, 404, 404).startswith("C 405")
    assert om_fuzz_c.compare_load(0, 0, 410, "f.om: x").startswith("C loads")
