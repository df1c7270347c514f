"""The ONNX frontend fuzzer (tests/fuzz/onnx_fuzz.py) on a CI budget, and its regression corpus.

The longer run, for the issue's 100,000 executions, is
`python -m tests.fuzz.onnx_fuzz --execs 100000 --seed 15 --jobs 1`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")
sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root, so `tests.fuzz` imports
from tests.fuzz import onnx_fuzz  # noqa: E402

CORPUS_FILES = sorted(onnx_fuzz.CORPUS.glob("*.onnx"))


def test_fuzz_budget(tmp_path: Path) -> None:
    """A few hundred mutants: every one compiles or gets an NpucError."""
    lines: list[str] = []
    counts = onnx_fuzz.run(300, seed=2024, jobs=1, corpus=tmp_path, log=lines.append)
    assert sum(counts.values()) == 300
    assert not any(counts[c] for c in onnx_fuzz.FAILURES), "\n".join(lines)
    assert counts["npuc"] and counts["ok"]  # the mutants reach both the refusals and the compiler


def test_mutants_are_deterministic() -> None:
    assert onnx_fuzz.mutant(7, 123) == onnx_fuzz.mutant(7, 123)
    assert onnx_fuzz.mutant(7, 123) != onnx_fuzz.mutant(7, 124)


def test_corpus_is_not_empty() -> None:
    assert CORPUS_FILES


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_replays(path: Path) -> None:
    """Every failure the fuzzer ever found now compiles or gets an NpucError."""
    cls, detail = onnx_fuzz.replay(path)
    assert cls in ("ok", "npuc"), detail
