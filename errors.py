"""Errors for users, asserts for us.

`NpucError` is anything a user can cause (a bad flag, an unsupported model, a
corrupt file): the CLI prints it as one line plus a hint and exits with its
`exit_code`, never with a traceback. `InternalError` is a broken invariant in
npuc itself; the CLI says so and asks for a report.
"""

from __future__ import annotations

# Exit codes shared by every command (see docs/errors.md).
EXIT_OK = 0
EXIT_COMPILE = 1
EXIT_USAGE = 2
EXIT_UNSUPPORTED = 3
EXIT_IO = 4


class NpucError(Exception):
    """A user-facing error: a stable code, a message and a hint."""

    def __init__(self, code: str, message: str, hint: str = "", exit_code: int = EXIT_COMPILE,
                 details: list[str] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.hint = hint
        self.exit_code = exit_code
        self.details = list(details or [])  # context lines, e.g. the model's real inputs

    def as_dict(self) -> dict[str, object]:
        """The machine-readable form (`--diagnostics-format json`, precheck reports)."""
        return {"severity": "error", "code": self.code, "message": self.message, "hint": self.hint,
                "details": self.details, "exit_code": self.exit_code}

    def render(self) -> str:
        text = f"error {self.code}: {self.message}"
        for d in self.details:
            text += f"\n  {d}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class InternalError(AssertionError):
    """An invariant of npuc itself was broken: a bug, not a user mistake."""
