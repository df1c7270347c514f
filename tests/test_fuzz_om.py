"""The `.om` reader under mutation (tests/fuzz/om_fuzz.py): a CI-sized fuzz run and a
replay of every file the fuzzer ever kept. A long run (the issue asks for 10^6):

    python -m tests.fuzz.om_fuzz --execs 1000000 --seed 0 --jobs 2 --save-corpus
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz import om_fuzz

CORPUS_FILES = sorted(om_fuzz.CORPUS.glob("*.om")) if om_fuzz.CORPUS.is_dir() else []


def test_fuzz_budget_has_no_failures() -> None:
    s = om_fuzz.fuzz(300, seed=0, jobs=2)
    assert s.execs == 300
    assert s.failures == 0, s.render()


@pytest.mark.skipif(not CORPUS_FILES, reason="no corpus files yet")
def test_corpus_replays_cleanly() -> None:
    """Each kept crasher now gives a coded error (validate and load agreeing) or loads and runs."""
    got = om_fuzz.replay([str(p) for p in CORPUS_FILES])
    bad = {Path(p).name: f"{o.cls}: {o.signature}" for p, o in got.items() if o.cls not in ("ok", "npuc")}
    assert not bad, bad
