"""Building libnpucrt (npucrt/src/*.c) for the tests, and calling its loader through ctypes.

    lib = build(tmp_path)                   # the shared library, plain -O1 -g
    code, message = load(lib, "model.om")   # npuc_model_load_file; 0 and "" when it loads
    exe = build_exe(tmp_path, "npucrt/tests/load_driver.c", sanitize=True)

A sanitized (ASan + UBSan) library cannot be loaded into this Python without LD_PRELOAD of
libasan, so sanitized checks build a C driver from npucrt/tests/ as an executable and run it in
a subprocess. `sources` picks files of npucrt/src (default: all of them); `stub_exec` adds a
`npuc_exec_check` that accepts every model, for a loader built without the executor.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "npucrt" / "src"
INCLUDE = ROOT / "include"
# The loader's own files: enough for npuc_model_load_file with the stub below.
LOADER_SOURCES = ("util.c", "sha256.c", "om.c", "validate.c", "op_schema.c", "model_api.c")
WARNINGS = ["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wshadow", "-Wconversion"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
_STUB = """#include "exec.h"
/* The executor's load-time check, accepting everything: the loader's tests compare the
 * loader's own checks with the Python side's, without the binders' per-op rules. */
int npuc_exec_check(npuc_model *m, npuc_error *err) { (void)m; (void)err; return 0; }
"""


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _sources(out_dir: Path, sources: list[str] | tuple[str, ...] | None, stub_exec: bool) -> list[str]:
    files = [str(SRC / s) for s in sources] if sources is not None else sorted(str(p) for p in SRC.glob("*.c"))
    if stub_exec:
        stub = out_dir / "exec_stub.c"
        stub.write_text(_STUB)
        files.append(str(stub))
    return files


def _flags(sanitize: bool, warnings: bool) -> list[str]:
    flags = ["-std=c11", "-O1", "-g", f"-I{INCLUDE}", f"-I{SRC}"]
    if warnings:
        flags += WARNINGS
    if sanitize:
        flags += SANITIZE
    return flags


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stderr}")


def build(out_dir: str | Path, sanitize: bool = False, sources: list[str] | tuple[str, ...] | None = None,
          stub_exec: bool = False, warnings: bool = False, name: str = "libnpucrt.so",
          defines: tuple[str, ...] = ()) -> Path:
    """The shared library from `sources` (default: every npucrt/src/*.c) under `out_dir`."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / name
    _run([cc, *_flags(sanitize, warnings), *[f"-D{d}" for d in defines], "-shared", "-fPIC",
          *_sources(out_dir, sources, stub_exec), "-o", str(lib), "-lm", "-lpthread"])
    return lib


def build_exe(out_dir: str | Path, main_c: str | Path, sanitize: bool = True,
              sources: list[str] | tuple[str, ...] | None = None, stub_exec: bool = False,
              warnings: bool = True, name: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    """An executable of the C driver `main_c` (a path under the repository) and `sources`."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main = ROOT / main_c
    exe = out_dir / (name or main.stem)
    _run([cc, *_flags(sanitize, warnings), *[f"-D{d}" for d in defines], str(main),
          *_sources(out_dir, sources, stub_exec), "-o", str(exe), "-lm", "-lpthread"])
    return exe


class NpucError(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("message", ctypes.c_char * 768), ("hint", ctypes.c_char * 256)]


def open_lib(lib: str | Path) -> ctypes.CDLL:
    h = ctypes.CDLL(str(lib))
    h.npuc_model_load_file.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(NpucError)]
    h.npuc_model_load_file.restype = ctypes.c_int
    h.npuc_model_load_buffer.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(NpucError)]
    h.npuc_model_load_buffer.restype = ctypes.c_int
    h.npuc_model_free.argtypes = [ctypes.c_void_p]
    h.npuc_model_free.restype = ctypes.c_int
    return h


def load_raw(lib: ctypes.CDLL | str | Path, path: str | Path) -> tuple[int, bytes, bytes]:
    """(code, message bytes, hint bytes) of npuc_model_load_file on `path` (the model freed)."""
    h = lib if isinstance(lib, ctypes.CDLL) else open_lib(lib)
    model = ctypes.c_void_p()
    err = NpucError()
    code = h.npuc_model_load_file(str(path).encode(), None, ctypes.byref(model), ctypes.byref(err))
    if model.value:
        h.npuc_model_free(model)
    return code, (err.message if code else b""), (err.hint if code else b"")


def load(lib: ctypes.CDLL | str | Path, path: str | Path) -> tuple[int, str]:
    """(code, message) of loading `path` with the library: (0, "") when it loads."""
    code, message, _ = load_raw(lib, path)
    return code, message.decode("utf-8", "replace")
