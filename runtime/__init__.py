"""The npuc runtime: executes a `.om` with nothing but the file."""

from npuc.runtime.session import Session

__all__ = ["Session"]
