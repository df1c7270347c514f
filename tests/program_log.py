"""Which programs a session runs: the scheduler's and the drafter's choices, read from outside."""

from __future__ import annotations

from typing import Any


def record_programs(s: Any) -> list[str]:
    """The list that the names of the programs `s` runs from now on are appended to, in order
    (its `run` wrapped)."""
    programs: list[str] = []
    run = s.run

    def recorded(feeds: Any, program: str, **kw: Any) -> Any:
        programs.append(program)
        return run(feeds, program, **kw)

    s.run = recorded
    return programs
