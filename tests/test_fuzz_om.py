"""The `.om` reader under mutation (tests/fuzz/om_fuzz.py): a CI-sized fuzz run, the
validate/load agreement as a property over mutants, and a replay of every file the
fuzzer ever kept. The long run (10^6 executions, 0 failures; figures in docs/security.md):

    python -m tests.fuzz.om_fuzz --execs 1000000 --seed 0 --jobs 2 --save-corpus
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz import om_fuzz

CORPUS_FILES = sorted(om_fuzz.CORPUS.glob("*.om")) if om_fuzz.CORPUS.is_dir() else []


@pytest.fixture(scope="module")
def seeds() -> list[bytes]:
    return [p.read_bytes() for p in om_fuzz.seed_files()]


def test_fuzz_budget_has_no_failures() -> None:
    s = om_fuzz.fuzz(300, seed=0, jobs=2)
    assert s.execs == 300
    assert s.failures == 0, s.render()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(run=st.integers(0, 2**20), index=st.integers(0, 2**40))
def test_validate_and_load_agree(seeds: list[bytes], run: int, index: int) -> None:
    """On any mutant: a file that validates loads and runs every program (and generates,
    where it says it can); a file that loads validates; nothing raises but NpucError."""
    _, data = om_fuzz.mutant(seeds, run, index)
    fd, path = tempfile.mkstemp(suffix=".om")
    try:
        os.write(fd, data)
        os.close(fd)
        res = om_fuzz.execute(path)
    finally:
        os.unlink(path)
    assert res["exc"] is None, res["exc"]
    if res["validate"]:
        assert res["load"] and res["run"], res["npuc"]
    if res["load"]:
        assert res["validate"], res["npuc"]


@pytest.mark.skipif(not CORPUS_FILES, reason="no corpus files yet")
def test_corpus_replays_cleanly() -> None:
    """Each kept crasher now gives a coded error (validate and load agreeing) or loads and runs."""
    got = om_fuzz.replay([str(p) for p in CORPUS_FILES])
    bad = {Path(p).name: f"{o.cls}: {o.signature}" for p, o in got.items() if o.cls not in ("ok", "npuc")}
    assert not bad, bad
