"""The worker processes both fuzzers run their mutants in (om_fuzz.py, onnx_fuzz.py).

Each worker is a child process (forkserver on Linux, so it starts from a clean
interpreter, not a copy of the driver) running `target(conn, *args)`: it sends "ready",
then answers every job it receives with one picklable result, until it receives None.
The pool hands each idle worker the next job as soon as it answers (no batch barrier,
so one slow mutant does not idle the other workers) and classifies the ways a job can
end without an answer:

    crash    the worker died: a signal (SIGSEGV, SIGBUS, SIGABRT, ...) or an exit code
    memory   the worker was killed with SIGKILL (the kernel's OOM killer)
    hang     no answer within `timeout` seconds: the worker is killed

A worker that dies or hangs is replaced before its next job. A long run can be paused
and resumed (`kill -STOP -PGID`, `kill -CONT -PGID`): on SIGCONT every running job's
clock restarts, so the pause does not read as hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

J = TypeVar("J")


@dataclass(frozen=True)
class Died:
    """A job that ended without an answer."""

    cls: str  # crash | memory | hang
    detail: str


def context() -> Any:
    return mp.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")


class _Slot:
    def __init__(self, ctx: Any, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.ctx, self.target, self.args = ctx, target, args
        self.started = 0.0
        self._spawn()

    def _spawn(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(180) or self.conn.recv() != "ready":
            raise RuntimeError("a fuzz worker did not start")

    def send(self, job: Any) -> None:
        self.started = time.monotonic()
        self.conn.send(job)

    def result(self, timeout: float) -> tuple[bool, Any]:
        """(True, answer or Died) once the job has ended; (False, None) while it runs."""
        if self.conn.poll():
            try:
                return True, self.conn.recv()
            except (EOFError, OSError):
                return True, self._died()
        if not self.proc.is_alive():
            return True, self._died()
        if time.monotonic() - self.started > timeout:
            self.proc.kill()
            self.proc.join()
            self._spawn()
            return True, Died("hang", f"no answer in {timeout:.0f} s")
        return False, None

    def _died(self) -> Died:
        self.proc.join()
        code = self.proc.exitcode
        self.conn.close()
        self._spawn()
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            return Died("memory" if name == "SIGKILL" else "crash", name)
        return Died("crash", f"exit code {code}")

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class Pool(Generic[J]):
    """`jobs` workers; `args(k)` gives worker k's extra arguments. Use as a context manager."""

    def __init__(self, target: Callable[..., None], jobs: int, timeout: float,
                 args: Callable[[int], tuple[Any, ...]] = lambda k: ()) -> None:
        ctx = context()
        self.timeout = timeout
        self._slots = [_Slot(ctx, target, args(k)) for k in range(max(jobs, 1))]

    def __enter__(self) -> Pool[J]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resumed(self, *_: object) -> None:
        now = time.monotonic()
        for s in self._slots:
            s.started = now

    def run(self, jobs: Iterable[J]) -> Iterator[tuple[J, Any]]:
        """(job, answer or Died) for every job, in the order they finish."""
        if hasattr(signal, "SIGCONT") and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCONT, self._resumed)
        todo = iter(jobs)
        idle = list(self._slots)
        busy: dict[_Slot, J] = {}
        exhausted = False
        while True:
            while idle and not exhausted:
                try:
                    job = next(todo)
                except StopIteration:
                    exhausted = True
                    break
                slot = idle.pop()
                slot.send(job)
                busy[slot] = job
            if not busy:
                return
            waits: list[Any] = [s.conn for s in busy] + [s.proc.sentinel for s in busy]
            wait(waits, timeout=min(self.timeout, 1.0))
            for slot in list(busy):
                ended, answer = slot.result(self.timeout)
                if ended:
                    job = busy.pop(slot)
                    idle.append(slot)
                    yield job, answer

    def close(self) -> None:
        for s in self._slots:
            s.close()


def _echo(conn: Connection) -> None:  # pragma: no cover - runs in the child
    import os

    conn.send("ready")
    while (job := conn.recv()) is not None:
        if job == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif job == "sleep":
            time.sleep(60)
        elif job == "exit":
            os._exit(3)
        conn.send(("echo", job))
