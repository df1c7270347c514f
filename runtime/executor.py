"""Which executor runs a `.om`: the C library, or the torch interpreter.

    native  libnpucrt (runtime/native_session.py): the default on the CPU. Needs no torch.
    torch   the registry's reference kernels (runtime/session.py): the reference that
            `npuc verify` and the tests compare against; what runs a model the C library
            refuses (an op it has no kernel for, NPUC-E0413: a one-line notice says which),
            a tensor-parallel manifest (ranks on torch.distributed), and a device other
            than the CPU.

NPUC_EXECUTOR=torch (or native) forces one; a forced native executor that cannot run the
model is an error, not a fallback.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from npuc.errors import EXIT_USAGE, NpucError

EXECUTORS = ("native", "torch")


def chosen(executor: str | None = None) -> str | None:
    """The executor asked for (argument, else NPUC_EXECUTOR), or None for the default."""
    name = executor or os.environ.get("NPUC_EXECUTOR", "").strip().lower() or None
    if name is not None and name not in EXECUTORS:
        raise NpucError("NPUC-E0100", f"NPUC_EXECUTOR={name!r} is not an executor", "use native or torch",
                        exit_code=EXIT_USAGE)
    return name


def _is_manifest(path: str) -> bool:
    from npuc.backend.manifest import MANIFEST
    from npuc.backend.om_format import OmFile

    try:
        with OmFile.open(path, verify=False) as om:
            return MANIFEST in om.section_names()
    except NpucError:
        return False  # the executor that loads it says what is wrong, with its own check


def open_session(path: str, device: str = "cpu", executor: str | None = None, threads: int | None = None,
                 quiet: bool = False) -> Any:
    """A session over `path` on the executor that can run it (module docstring)."""
    name = chosen(executor)
    torch_only = device != "cpu" or "WORLD_SIZE" in os.environ or _is_manifest(path)
    if name == "torch" or (name is None and torch_only):
        from npuc.runtime.session import Session

        return Session.load(path, device=device)
    if name == "native" and torch_only:
        raise NpucError("NPUC-E0413", f"the native runtime cannot run {path} here (a tensor-parallel manifest, a "
                        f"rank under torchrun, or device {device!r})", "run it with NPUC_EXECUTOR=torch",
                        exit_code=EXIT_USAGE)
    from npuc.runtime.native_session import E_NO_KERNEL, NativeSession, runtime_library

    if runtime_library() is None and name is None:
        from npuc.runtime.session import Session

        if not quiet:
            print("npuc: note: the native runtime is not built (no C compiler, or NPUC_NATIVE=0); running on the "
                  "torch interpreter", file=sys.stderr)
        return Session.load(path, device=device)
    try:
        return NativeSession(path, threads=threads)
    except NpucError as e:
        if e.code != E_NO_KERNEL or name == "native":
            raise
        from npuc.runtime.session import Session

        if not quiet:
            print(f"npuc: note: {e.message}; running it on the torch interpreter", file=sys.stderr)
        return Session.load(path, device=device)
