"""libnpucrt, the native runtime (npucrt/src/*.c), compiled for this host the first time a
model loads: the C executor (`npuc.runtime.native_session`) and the CPU kernels that the
Python executor (runtime/launch.py) also calls.

The sources ship with npuc and are built with the system C compiler (`$CC`, else `cc`),
`-O3 -march=native`, into a per-user cache keyed by the source, the flags, the
compiler and the CPU's feature flags; later loads reuse the library. Code tuned to the
host's ISA belongs here, at load time, never in the `.om` (which stays portable). Where
no compiler works, or `NPUC_NATIVE=0`, `library()` is None and the runtime runs its
torch kernels: slower, never wrong.

    NPUC_NATIVE=0              never build or load the library
    NPUC_CACHE_DIR=path        where the built library is kept (default ~/.cache/npuc)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("npuc")

ROOT = Path(__file__).resolve().parent.parent.parent  # the npuc package: npucrt/ and include/ beside runtime/
SOURCE_DIR = ROOT / "npucrt" / "src"
INCLUDE_DIR = ROOT / "include"
ABI = 9


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def _headers() -> list[Path]:
    # third_party/: the vendored xxhash.h that sha256.c inlines
    return sorted([*SOURCE_DIR.glob("*.h"), *SOURCE_DIR.glob("third_party/*.h"), *INCLUDE_DIR.glob("*.h")])


_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-fno-math-errno", f"-I{INCLUDE_DIR}", f"-I{SOURCE_DIR}")
_LIBS = ("-lm", "-lpthread")
# Tried in order: the host's ISA, then without -march (an old or cross compiler: the plain C paths).
_VARIANTS = (("-march=native",), ())

I64 = ctypes.c_int64
INT = ctypes.c_int
PTR = ctypes.c_void_p
FLOAT = ctypes.c_float


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc.split()[0] if cc else None


def cache_dir() -> Path:
    base = os.environ.get("NPUC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "npuc")
    return Path(base) / "kernels"


def _build(cc: str, out: Path) -> list[str] | None:
    """Compile into `out` atomically (a temporary file renamed into place); the flags that
    worked, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for extra in _VARIANTS:
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
        cmd = [cc, *_FLAGS, *extra, "-o", tmp, *(str(p) for p in sources()), *_LIBS]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)
                return list(extra)
            log.debug("native kernels: %s failed: %s", " ".join(cmd), r.stderr[-500:])
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("native kernels: %s failed: %s", " ".join(cmd), e)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.npuc_kernels_abi.restype = INT
    lib.npuc_kernels_abi.argtypes = []
    lib.npuc_linear_f32.argtypes = [PTR, I64, I64, PTR, INT, I64, I64, PTR, PTR, I64, INT]
    lib.npuc_linear_bf16.argtypes = [PTR, INT, I64, I64, PTR, I64, I64, PTR, INT, PTR, INT, I64, PTR, INT]
    lib.npuc_rms_norm_f32.argtypes = [PTR, PTR, FLOAT, PTR, I64, I64, INT]
    lib.npuc_rope_f32.argtypes = [PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, INT, I64, INT]
    lib.npuc_kv_write.argtypes = [PTR, INT, PTR, INT, PTR, I64, I64, I64, I64, I64, I64, I64]
    lib.npuc_cached_attention_scratch_floats.argtypes = [I64, I64, I64, I64, I64, I64, I64, INT]
    lib.npuc_cached_attention_scratch_floats.restype = I64
    lib.npuc_cached_attention.argtypes = [PTR, INT, PTR, PTR, INT, PTR, I64, PTR, INT, I64, I64, I64, I64, I64,
                                          I64, I64, FLOAT, PTR, INT]
    lib.npuc_swiglu_f32.argtypes = [PTR, PTR, PTR, I64, INT]
    lib.npuc_add_f32.argtypes = [PTR, PTR, PTR, I64, INT]
    lib.npuc_cast.argtypes = [PTR, INT, PTR, INT, I64, INT]
    lib.npuc_permute.argtypes = [PTR, PTR, I64, PTR, PTR, INT]
    lib.npuc_gather_rows.argtypes = [PTR, I64, I64, PTR, I64, PTR]
    lib.npuc_pad_rows.argtypes = [PTR, PTR, I64, I64, I64, I64, I64, I64, I64]
    lib.npuc_dequantize.argtypes = [PTR, INT, PTR, INT, PTR, I64, I64, I64, PTR, INT]
    lib.npuc_attention_gemm_scratch_floats.argtypes = [I64, I64, I64, I64, I64, INT]
    lib.npuc_attention_gemm_scratch_floats.restype = I64
    lib.npuc_attention_gemm.argtypes = [PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64, I64, FLOAT, PTR, INT]
    lib.npuc_gemm_packed_floats.argtypes = [I64, I64]
    lib.npuc_gemm_packed_floats.restype = I64
    lib.npuc_gemm_scratch_floats.argtypes = [I64, I64, I64, INT]
    lib.npuc_gemm_scratch_floats.restype = I64
    lib.npuc_gemm_pack_b.argtypes = [PTR, INT, INT, I64, I64, PTR, INT]
    lib.npuc_gemm_f32.argtypes = [PTR, INT, I64, I64, PTR, I64, I64, PTR, PTR, INT, I64, PTR, INT]
    lib.npuc_qlinear_scratch_floats.argtypes = [I64, I64, I64]
    lib.npuc_qlinear_scratch_floats.restype = I64
    lib.npuc_qgemm_scratch_floats.argtypes = [I64, I64, I64, INT, INT]
    lib.npuc_qgemm_scratch_floats.restype = I64
    # x, xbf, M, xs, q, bits, scale, zero, N, K, G, bias, y, ybf, ys, scratch, nt
    for name in ("npuc_qlinear", "npuc_qgemm"):
        getattr(lib, name).argtypes = [PTR, INT, I64, I64, PTR, INT, PTR, PTR, I64, I64, I64, PTR, PTR, INT, I64, PTR,
                                       INT]
    lib.npuc_i8_packed_bytes.argtypes = [INT, I64, I64]
    lib.npuc_i8_packed_bytes.restype = I64
    lib.npuc_i8_pack.argtypes = [PTR, INT, PTR, PTR, I64, I64, I64, PTR]
    lib.npuc_i8linear_scratch_bytes.argtypes = [I64, I64]
    lib.npuc_i8linear_scratch_bytes.restype = I64
    # x, xbf, M, xs, packed, bits, N, K, bias, y, ybf, ys, scratch, nt
    lib.npuc_i8linear.argtypes = [PTR, INT, I64, I64, PTR, INT, I64, I64, PTR, PTR, INT, I64, PTR, INT]
    lib.npuc_i8_path.restype = ctypes.c_char_p
    lib.npuc_i8_path.argtypes = []
    for name in ("npuc_i8_pack", "npuc_i8linear", "npuc_linear_f32", "npuc_linear_bf16", "npuc_rms_norm_f32",
                 "npuc_rope_f32", "npuc_kv_write",
                 "npuc_cached_attention", "npuc_swiglu_f32", "npuc_add_f32", "npuc_cast", "npuc_gemm_pack_b",
                 "npuc_gemm_f32", "npuc_qlinear", "npuc_qgemm", "npuc_permute", "npuc_gather_rows", "npuc_pad_rows", "npuc_dequantize", "npuc_attention_gemm"):
        getattr(lib, name).restype = INT
    return lib


def _open(path: Path) -> ctypes.CDLL | None:
    try:
        return _declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as e:
        log.debug("native kernels: %s does not load (%s)", path, e)
        return None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if need be; None where they cannot be had.

    NPUC_NATIVE is read on every call, outside the per-process cache: a caller that turns the
    library off for a while (NPUC_NATIVE=0 in a CLI invocation's environment) must not turn it
    off for the rest of the process."""
    if os.environ.get("NPUC_NATIVE", "1") == "0" or platform.system() == "Windows":
        return None
    return _load()


def reset() -> None:
    """Forget the loaded library: the next library() looks it up again (the compiler, the
    cache folder and the flags as they are then)."""
    _load.cache_clear()


@functools.cache
def _load() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: the runtime uses its torch kernels (set CC to use native ones)")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256("\0".join([*(p.name + p.read_text() for p in [*sources(), *_headers()]), " ".join(_FLAGS),
                                    repr(_VARIANTS), version, platform.machine(), _cpu_flags()]).encode()
                         ).hexdigest()[:20]
    path = cache_dir() / f"libnpucrt-{key}.so"
    lib = _open(path) if path.is_file() else None
    if lib is None:  # not built yet, or a cached file that does not load (damaged): build it
        try:
            flags = _build(cc, path)
        except OSError as e:  # the cache is not writable: build into a private temporary folder
            log.debug("native kernels: cannot write %s (%s)", path.parent, e)
            path = Path(tempfile.mkdtemp(prefix="npuc-kernels-")) / path.name
            flags = _build(cc, path)
        if flags is None:
            log.info("the native kernels did not compile with %s: the runtime uses its torch kernels", cc)
            return None
        lib = _open(path)
        if lib is None:
            log.info("the native kernels did not load: the runtime uses its torch kernels")
            return None
    if lib.npuc_kernels_abi() != ABI:
        return None
    return lib
