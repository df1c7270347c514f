"""Progress of a compile: stages, and steps or bytes within a stage.

The driver reports to a `Progress`; it does not know how it is shown. The CLI
shows a rich progress bar when stderr is a terminal and stays silent otherwise
(pipes, CI logs, `--diagnostics-format json`).
"""

from __future__ import annotations

from typing import Any, Protocol


class Progress(Protocol):
    def stage(self, name: str, total: int | None = None) -> None:
        """A new stage starts; `total` steps or bytes, when known."""

    def advance(self, n: int = 1) -> None:
        """`n` more steps or bytes of the current stage are done."""

    def done(self) -> None:
        """The compile finished."""


class NullProgress:
    def stage(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def done(self) -> None:
        pass


class RichProgress:
    """One bar per stage on stderr (rich is imported only when a terminal shows it)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description:<16}"), BarColumn(), TaskProgressColumn(),
                             TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task: Any = None

    def stage(self, name: str, total: int | None = None) -> None:
        if self._task is not None:
            self._bar.update(self._task, completed=self._bar.tasks[-1].total or 1)
        self._task = self._bar.add_task(name, total=total)

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def done(self) -> None:
        self._bar.stop()
