"""Compiles of a test module's models in worker processes (NPUC_MATRIX_JOBS, default 2, as
tests/test_model_matrix.py's rows): tracing a tiny model is single-threaded Python, so two
workers on two cores about halve a fixture that compiles many, while the test's own process
builds the next checkpoints."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from types import TracebackType
from typing import Any

from npuc.compiler.driver import compile_model


class CompilePool:
    """`with CompilePool() as pool: f = pool.compile(path, **kw)`: a future of
    compile_model(path, **kw)'s output path (run here, at once, with NPUC_MATRIX_JOBS=1)."""

    def __init__(self) -> None:
        jobs = int(os.environ.get("NPUC_MATRIX_JOBS", "2"))
        self._pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs > 1 else None

    def compile(self, path: str, **kw: Any) -> Future[str]:
        if self._pool is not None:
            return self._pool.submit(compile_model, path, **kw)
        done: Future[str] = Future()
        done.set_result(compile_model(path, **kw))
        return done

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
