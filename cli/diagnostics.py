"""How the CLI reports: user errors as one line and a hint (or JSON), logging
levels, and keeping library chatter off stderr.

    npuc compile M ... --diagnostics-format json   # stderr holds JSON lines only:
    {"code": "NPUC-E0102", "details": [...], "exit_code": 2, "hint": "...", "message": "...", "severity": "error"}

Exit codes: 0 ok, 1 compile error, 2 usage error, 3 unsupported model, 4 I/O error.
A user error never shows a traceback (`--debug` does); anything else is a bug in
npuc and says so, with where to report it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from npuc.errors import EXIT_COMPILE, InternalError, NpucError

REPORT_URL = "the npuc issue tracker"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "null": logging.CRITICAL + 1}


class _JsonHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(json.dumps({"severity": record.levelname.lower(), "message": record.getMessage(),
                                     "logger": record.name}, sort_keys=True) + "\n")


class _TextHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"npuc: {record.levelname.lower()}: {record.getMessage()}\n")


def setup(log: str = "warning", diagnostics_format: str = "text") -> None:
    """Route npuc's log records to stderr at `log`'s level, as text or JSON lines, and
    keep third-party warnings (transformers, torch) off stderr."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if diagnostics_format == "json":
        warnings.simplefilter("ignore")
    logger = logging.getLogger("npuc")
    logger.handlers[:] = [_JsonHandler() if diagnostics_format == "json" else _TextHandler()]
    logger.setLevel(LOG_LEVELS[log])
    logger.propagate = False


def report(e: NpucError, diagnostics_format: str) -> None:
    if diagnostics_format == "json":
        sys.stderr.write(json.dumps(e.as_dict(), sort_keys=True) + "\n")
    else:
        click.echo(f"npuc: {e.render()}", err=True)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        fmt = kwargs.get("diagnostics_format") or "text"
        try:
            return fn(*args, **kwargs)
        except NpucError as e:
            if debug:
                raise
            report(e, fmt)
            sys.exit(e.exit_code)
        except Exception as e:  # anything else is our bug: say so, in one line
            if debug or isinstance(e, (click.exceptions.Exit, click.ClickException)):
                raise
            kind = "an internal invariant broke" if isinstance(e, InternalError) else type(e).__name__
            first = str(e).splitlines()[0] if str(e) else ""
            if fmt == "json":
                sys.stderr.write(json.dumps({"severity": "internal", "code": "NPUC-INTERNAL", "exit_code": 1,
                                             "message": f"internal error ({kind}): {first}",
                                             "hint": f"this is a bug in npuc: rerun with --debug and report it to "
                                                     f"{REPORT_URL}"}, sort_keys=True) + "\n")
            else:
                click.echo(f"npuc: internal error ({kind}): {first}\n  this is a bug in npuc, not in your model: "
                           f"rerun with --debug and report it to {REPORT_URL}", err=True)
            sys.exit(EXIT_COMPILE)

    return wrapper
