"""The npuc runtime: executes a `.om` with nothing but the file.

`open_session` (runtime/executor.py) picks the executor: the C library (native_session)
by default, the torch interpreter (session) as the reference and the fallback. Nothing
here imports torch until the torch interpreter is asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Session", "open_session"]


def __getattr__(name: str) -> Any:
    if name == "Session":
        from npuc.runtime.session import Session

        return Session
    if name == "open_session":
        from npuc.runtime.executor import open_session

        return open_session
    raise AttributeError(name)
