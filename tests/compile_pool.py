"""Compiles of the tests' models in worker processes (NPUC_MATRIX_JOBS, default 2, as
tests/test_model_matrix.py's rows): tracing a tiny model is single-threaded Python, so two
workers on two cores about halve a fixture that compiles many, while the test's own process
builds the next checkpoints.

The workers are the session's, shared by every fixture that compiles through them: a worker
pays its start (spawning, importing torch and transformers, the first trace's lazy imports)
once, not once a test module."""

from __future__ import annotations

import atexit
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Any, TypeVar

from npuc.compiler.driver import compile_model

T = TypeVar("T")

_workers: list[ProcessPoolExecutor] = []  # the session's pool, started by the first CompilePool that needs it


def _shared(jobs: int) -> ProcessPoolExecutor:
    if not _workers:
        _workers.append(ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")))
        atexit.register(_workers[0].shutdown, cancel_futures=True)
    return _workers[0]


class CompilePool:
    """`with CompilePool() as pool: f = pool.compile(path, **kw)`: a future of
    compile_model(path, **kw)'s output path (run here, at once, with NPUC_MATRIX_JOBS=1).
    Leaving the block cancels the compiles it submitted that have not started."""

    def __init__(self) -> None:
        self._jobs = int(os.environ.get("NPUC_MATRIX_JOBS", "2"))
        self._pool = _shared(self._jobs) if self._jobs > 1 else None
        self._submitted: list[Future[Any]] = []

    def compile(self, path: str, **kw: Any) -> Future[str]:
        return self.run(compile_model, path, **kw)

    def run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> Future[T]:
        """fn(*args, **kw) in a worker: fn a module-level function, its arguments and result picklable."""
        if self._pool is not None:
            try:
                self._submitted.append(self._pool.submit(fn, *args, **kw))
            except BrokenProcessPool:  # a worker died (in an earlier fixture): fresh workers for the rest
                _workers.clear()
                self._pool = _shared(self._jobs)
                self._submitted.append(self._pool.submit(fn, *args, **kw))
            return self._submitted[-1]
        done: Future[T] = Future()
        done.set_result(fn(*args, **kw))
        return done

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        for f in self._submitted:
            f.cancel()
