"""libnpucrt's attention kernels alone, at depth: decode over each KV cache layout, and prefill.

    python bench/kv_attention.py [--threads 1] [--kv-heads 4] [--depths 512,2048,4096,8000]
        [--layouts f32,bf16,f16,int8] [--prefill 128,4096] [--baseline OTHER_LIB.so ...]

Decode: `npuc_cached_attention` for one query of 12 heads (head dim 64, bench/run.py's 125M
with --kv-heads 4, the issue's shape with 12) over 12 layers' caches of 8,192 rows each, so
that a step reads its rows from memory, not from the last level cache; ms per step (12 layers)
and the rate at which it reads the cache's bytes. Prefill: `npuc_attention_gemm`, causal, one
layer of S queries. With --baseline, each other build of kernels.c (a .so exporting the same
functions: `cc -O3 -march=native -shared -fPIC kernels.c util-stub.c`) runs in turn with the
current one, call by call, and its column is printed beside.

With one thread the time is that thread's CPU time (`time.thread_time`): on a shared machine
it leaves out the time the process is descheduled, which wall time does not (memory stalls
from the neighbours' traffic stay in). The minimum over --reps rounds is reported.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch

from npuc.ir.fused_ops import quantize_kv_rows
from npuc.runtime import native

I64, PTR, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
LAYOUTS = {"f32": (torch.float32, 0), "bf16": (torch.bfloat16, 1), "f16": (torch.float16, 2), "int8": (torch.int8, 3)}
HEADS, D, L, LAYERS = 12, 64, 8192, 12


def _open(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.npuc_attention_gemm_scratch_floats.restype = ctypes.c_int64
    if hasattr(lib, "npuc_cached_attention_scratch_floats"):
        lib.npuc_cached_attention_scratch_floats.restype = ctypes.c_int64
    return lib


def _decode_scratch(lib: ctypes.CDLL, dims: list[ctypes.c_int64], threads: int) -> int:
    """Floats of scratch; a build before the KV layouts (no sizing function) took threads x (L + D + DV)."""
    if hasattr(lib, "npuc_cached_attention_scratch_floats"):
        return lib.npuc_cached_attention_scratch_floats(*dims, threads)
    return threads * (L + 2 * D)


def _timed(run: dict[str, Callable[[], object]], reps: int, threads: int) -> dict[str, float]:
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = {name: float("inf") for name in run}
    for _ in range(reps):
        for name in run:
            t = clock()
            run[name]()
            best[name] = min(best[name], clock() - t)
    return best


def _decode_step(lib: ctypes.CDLL, layers: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, kind: int,
                 pos: torch.Tensor, out: torch.Tensor, dims: list[ctypes.c_int64], ws: torch.Tensor,
                 threads: int) -> None:
    for kc, vc in layers:
        lib.npuc_cached_attention(PTR(q.data_ptr()), 0, PTR(kc.data_ptr()), PTR(vc.data_ptr()), kind,
                                  PTR(pos.data_ptr()), I64(0), PTR(out.data_ptr()), 0, *dims, FLOAT(D ** -0.5),
                                  PTR(ws.data_ptr()), threads)


def decode(libs: dict[str, ctypes.CDLL], layout: str, kv_heads: int, depths: list[int], threads: int,
           reps: int) -> None:
    dtype, kind = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)

    def cache() -> torch.Tensor:
        rows = torch.randn(1, kv_heads, L, D, generator=g)
        return quantize_kv_rows(rows) if dtype == torch.int8 else rows.to(dtype)

    layers = [(cache(), cache()) for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, 1, D, generator=g)
    row_bytes = D + 4 if dtype == torch.int8 else D * layers[0][0].element_size()
    dims = [I64(x) for x in (1, HEADS, 1, D, kv_heads, L, D)]
    for depth in depths:
        pos = torch.tensor([depth - 1])
        run: dict[str, Callable[[], object]] = {}
        for name, lib in libs.items():
            if kind > 1 and not hasattr(lib, "npuc_cached_attention_scratch_floats"):
                continue  # a build before the f16 and int8 layouts
            ws = torch.empty(_decode_scratch(lib, dims, threads))
            run[name] = functools.partial(_decode_step, lib, layers, q, kind, pos, torch.empty(1, HEADS, 1, D), dims,
                                          ws, threads)
        best = _timed(run, reps, threads)
        nbytes = LAYERS * 2 * depth * kv_heads * row_bytes
        print(f"decode {layout:>4} depth {depth:>5}: " + "  ".join(
            f"{name} {t * 1e3:7.2f} ms ({nbytes / t / 1e9:5.1f} GB/s)" for name, t in best.items()), flush=True)


def prefill(libs: dict[str, ctypes.CDLL], kv_heads: int, lengths: list[int], threads: int, reps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for s in lengths:
        q = torch.randn(1, HEADS, s, D, generator=g)
        k, v = torch.randn(1, kv_heads, s, D, generator=g), torch.randn(1, kv_heads, s, D, generator=g)
        pos = torch.arange(s)
        run: dict[str, Callable[[], object]] = {}
        keep = []  # the calls hold addresses only: each build's scratch and output live until the timing ends
        for name, lib in libs.items():
            ws = torch.empty(lib.npuc_attention_gemm_scratch_floats(I64(1), I64(kv_heads), I64(D), I64(s), I64(D),
                                                                    threads))
            out = torch.empty(1, HEADS, s, D)
            keep += [ws, out]
            run[name] = functools.partial(lib.npuc_attention_gemm, *[PTR(t.data_ptr()) for t in (q, k, v, pos, out)],
                                          *[I64(x) for x in (1, HEADS, s, D, kv_heads, s, D)], FLOAT(D ** -0.5),
                                          PTR(ws.data_ptr()), threads)
        best = _timed(run, reps if s <= 1024 else max(1, reps // 4), threads)
        print(f"prefill S={s:>5}: " + "  ".join(f"{name} {t * 1e3:8.2f} ms a layer" for name, t in best.items()),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--depths", default="512,2048,4096,8000")
    ap.add_argument("--layouts", default="f32,bf16,f16,int8")
    ap.add_argument("--prefill", default="128,4096")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--baseline", nargs="*", default=[])
    a = ap.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels do not build here")
    libs = {"now": _open(lib._name)}
    libs.update({Path(p).stem: _open(p) for p in a.baseline})
    depths = [int(x) for x in a.depths.split(",") if x]
    for layout in [x for x in a.layouts.split(",") if x]:
        decode(libs, layout, a.kv_heads, depths, a.threads, a.reps)
    prefill(libs, a.kv_heads, [int(x) for x in a.prefill.split(",") if x], a.threads, a.reps)


if __name__ == "__main__":
    main()
