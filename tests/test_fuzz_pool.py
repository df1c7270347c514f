"""The fuzzers' worker pool (tests/fuzz/pool.py): each way a job can end is classified,
and a worker that dies or hangs is replaced so the jobs after it still run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo root, so `tests.fuzz` imports
from tests.fuzz.pool import Died, Pool, _echo  # noqa: E402


def test_pool_classifies_and_replaces_workers() -> None:
    jobs = ["a", "segv", "b", "exit", "sleep", "c"]
    with Pool[str](_echo, 2, timeout=2.0) as pool:
        got = dict(pool.run(jobs))
    assert set(got) == set(jobs)
    assert got["a"] == ("echo", "a") and got["b"] == ("echo", "b") and got["c"] == ("echo", "c")
    assert got["segv"] == Died("crash", "SIGSEGV")
    assert got["exit"] == Died("crash", "exit code 3")
    assert isinstance(got["sleep"], Died) and got["sleep"].cls == "hang"
