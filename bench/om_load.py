"""Cold-cache load of a `.om`: `npuc run` with and without the weights' checksums, and `npuc info`.

    python bench/om_load.py build/model.om [--reps 3]

Before each timed command the file is evicted from the page cache (posix_fadvise
DONTNEED on the whole file; the file must be clean, as a finished compile leaves it), so
every timing reads the file from the disk. `run`: a fresh process that does what `npuc run`
does (open_session, one run of the first program on zero inputs) with libnpucrt's
`verify_checksums` on, then off, alternately; `info`: `python -m npuc info FILE` in a fresh
process, and model_info() alone. Prints the median of each, and the ratio verify/no-verify
(docs/om-format.md records the figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

_RUN = r"""
import sys, time, numpy as np
t0 = time.perf_counter()
from npuc.runtime.native_session import NativeSession
s = NativeSession(sys.argv[1], verify=sys.argv[2] == "1")
t1 = time.perf_counter()
feeds = {t.name: np.zeros(t.shape, dtype={"i64": np.int64, "i32": np.int32}.get(t.dtype, np.float32))
         for t in s.inputs}
s.run(feeds)
t2 = time.perf_counter()
print(f"{t1 - t0:.4f} {t2 - t0:.4f}")
"""

_INFO = r"""
import sys, time
t0 = time.perf_counter()
from npuc.tools.om_tools import model_info
t1 = time.perf_counter()
model_info(sys.argv[1])
print(f"{time.perf_counter() - t1:.4f}")
"""


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: str) -> float:
    """The share of the file in the page cache (mincore over a mapping)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: ctypes can take its address
        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        head = (ctypes.c_char * 1).from_buffer(mm)  # the mapping's address; no page is touched
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(head)), ctypes.c_size_t(size), vec)
        del head
        mm.close()
    return sum(v & 1 for v in vec) / pages if rc == 0 else float("nan")


def timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("om")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    py = sys.executable
    runs: dict[str, list[tuple[float, float, float]]] = {"verify": [], "no verify": []}
    for _ in range(a.reps):
        for name, flag in (("verify", "1"), ("no verify", "0")):
            evict(a.om)
            wall, out = timed([py, "-c", _RUN, a.om, flag])
            load, total = map(float, out.split())
            runs[name].append((wall, load, total))
    info_cli, info_fn = [], []
    for _ in range(a.reps):
        evict(a.om)
        info_cli.append(timed([py, "-m", "npuc", "info", a.om])[0])
        evict(a.om)
        info_fn.append(float(timed([py, "-c", _INFO, a.om])[1]))
    print(f"file: {a.om}, {os.path.getsize(a.om):,} bytes; {a.reps} cold runs each (medians)")
    for name, rs in runs.items():
        print(f"  npuc run ({name}): process {statistics.median(r[0] for r in rs):.2f} s, "
              f"load {statistics.median(r[1] for r in rs):.2f} s, load + first run {statistics.median(r[2] for r in rs):.2f} s"
              f"   all: {[round(r[0], 2) for r in rs]}")
    v, n = (statistics.median(r[0] for r in runs[k]) for k in ("verify", "no verify"))
    print(f"  ratio verify / no verify (process): {v / n:.3f}")
    print(f"  npuc info: process {statistics.median(info_cli):.2f} s, model_info() {statistics.median(info_fn):.3f} s "
          f"  all: {[round(x, 2) for x in info_cli]} / {[round(x, 3) for x in info_fn]}")
    evict(a.om)
    subprocess.run([py, "-c", _INFO, a.om], check=True, capture_output=True)
    print(f"  after a cold model_info(): {resident(a.om):.1%} of the file is in the page cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
