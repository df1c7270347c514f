"""Compile at scale: `npuc compile` of a ~1.1B-parameter Llama-shaped ONNX model, weights streamed.

    python bench/compile_scale.py --quick        # small models, a smoke check (< 30 s once cached)
    python bench/compile_scale.py                # 1.1B (22 layers) and 0.6B (11 layers); builds once, ~4 min

The model is a Hugging Face ``LlamaForCausalLM`` built from a config (TinyLlama's shapes:
22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000; random
weights, nothing downloaded), exported with ``torch.onnx.export(dynamo=True, opset 18)``
with a dynamic batch and sequence and its weights in one external data file. The export
runs in a child process (measured like the rest: on this 2-core, 24 GiB machine it took
1.5-2.5 minutes and 5.0 GB peak RSS for 1.1B, so no cheaper route was needed); the
result is cached under ``<cache>/<config key>/`` and reused by later runs.

Figures, each from a fresh child process:

* ``npuc compile model.onnx --input_shape input_ids:1,128 --soc_version cpu --log null``
  on the 22-layer model and on an 11-layer one with the same shapes (half the weights):
  wall time and peak RSS. With streamed weights the peak RSS stays flat as the weights
  double; it is not asserted here (benchmarks print, tests assert).
* onnxruntime's offline optimisation of the same files: an ``InferenceSession`` with
  ``optimized_model_filepath`` set, ``ORT_ENABLE_EXTENDED``, the optimised model's
  initializers written to an external data file (ORT must, past protobuf's 2 GB).
* ``shutil.copyfile`` of the external data file: the floor for anything that has to
  write every weight byte once; and the same copy followed by ``fsync``, the floor for a
  writer that, like npuc, puts its output on disk before renaming it into place.

npuc and the copies run in turn, ``--repeat`` times (3 by default), the order turning by one
each round, each after an ``os.sync()``, an emptied page cache where the bench may empty it
(root; ``page_cache_reset`` in the results; npuc's and torch's files are then read back in by
an import, the weight file by a read) and a second's pause, so that no measurement pays for
the writeback or the cached pages another left; the medians are reported, and every run's time beside them (the
page cache and the disk's writeback make single runs vary by 2x on a shared machine), and the
median of each round's npuc / (copy + fsync) ratio.

Peak RSS: each child is started with ``subprocess.Popen`` and reaped with ``os.wait4``,
whose rusage is that child's own (``ru_maxrss``: the peak RSS of the child, or of the
largest of its waited-for descendants); no process-wide ``RUSAGE_CHILDREN`` deltas.
Cross-checked against ``/usr/bin/time -f %M``. Before each measurement the weight file
is read through once (``cache="warm"``, the default) or dropped from the page cache with
``fsync`` + ``posix_fadvise(DONTNEED)`` (``cache="cold"``; pages mapped elsewhere may stay), so every
system starts from the same page-cache state. Outputs are deleted after each measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_CACHE = "/tmp/npuc_bench_scale"
SEQ = 128

# Runs in a child process: build the HF model from the config, export it, save it with external
# data. argv[1] is a JSON object of build_llama_onnx's arguments plus "path".
_EXPORT_SCRIPT = r"""
import json, os, sys, time, warnings
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch
import transformers as tf

a = json.loads(sys.argv[1])
t0 = time.perf_counter()
cfg = tf.LlamaConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], intermediate_size=a["inter"],
                     num_hidden_layers=a["layers"], num_attention_heads=a["heads"],
                     num_key_value_heads=a["kv_heads"], max_position_embeddings=2048,
                     tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cpu"):
    model = tf.LlamaForCausalLM(cfg).to(torch.float32).eval()
params = sum(p.numel() for p in model.parameters())
t_init = time.perf_counter() - t0
if a["seq"] == "dynamic":
    ids = torch.zeros(1, 16, dtype=torch.long)
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "use_cache": None}
else:
    ids = torch.zeros(1, int(a["seq"]), dtype=torch.long)
    dyn = None
with warnings.catch_warnings(), torch.no_grad():
    warnings.simplefilter("ignore")
    prog = torch.onnx.export(model, (), kwargs={"input_ids": ids, "use_cache": False}, dynamo=True,
                             opset_version=18, verbose=False, dynamic_shapes=dyn, external_data=True)
t_export = time.perf_counter() - t0 - t_init
prog.save(a["path"], external_data=True)
t_save = time.perf_counter() - t0 - t_init - t_export
print(json.dumps({"params": params, "init_s": t_init, "export_s": t_export, "save_s": t_save}))
"""

# Runs in a child process: onnxruntime's offline graph optimisation. argv: model, optimised model path.
_ORT_SCRIPT = r"""
import os, sys
import onnxruntime as ort

so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
so.optimized_model_filepath = sys.argv[2]
so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                            os.path.basename(sys.argv[2]) + ".data")
so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped config."""

    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int | str = "dynamic"

    def key(self) -> str:
        return (f"llama_L{self.layers}_h{self.hidden}_i{self.inter}_a{self.heads}_kv{self.kv_heads}"
                f"_v{self.vocab}_s{self.seq}_opset18")


FULL = Shape(layers=22, hidden=2048, inter=5632, heads=32, kv_heads=4, vocab=32000)
QUICK = Shape(layers=2, hidden=512, inter=1376, heads=8, kv_heads=2, vocab=8000)


class BenchError(RuntimeError):
    """A measured child process failed."""


def measure(cmd: list[str], log: str | os.PathLike[str] | None = None,
            env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd`` to completion; return (wall seconds, the child's peak RSS in bytes).

    The child is reaped with ``os.wait4``, whose rusage is the child's own (plus that of any
    descendants it waited for; ``ru_maxrss`` is the largest of them), so the figure is per
    child and unaffected by earlier children of this process. stdout and stderr go to ``log``
    (or are discarded); a non-zero exit raises BenchError with the log's tail.
    """
    with open(log if log is not None else os.devnull, "wb") as sink:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = Path(log).read_text(errors="replace")[-3000:] if log is not None else ""
        raise BenchError(f"{cmd[:4]}... exited {proc.returncode}\n{tail}")
    return wall, usage.ru_maxrss * 1024  # Linux: kilobytes


def _data_file(model: Path) -> Path:
    return model.with_name(model.name + ".data")


def build_llama_onnx(out_dir: str | os.PathLike[str], layers: int = 22, hidden: int = 2048, inter: int = 5632,
                     heads: int = 32, kv_heads: int = 4, vocab: int = 32000,
                     seq: int | str = "dynamic") -> Path:
    """Export a random-weight Llama of this shape to ``<out_dir>/<key>/model.onnx`` (+ ``model.onnx.data``).

    Reuses the folder when a finished build is there (``build.json`` is written last). The
    export runs in a child process; its wall time, peak RSS and the parameter count land in
    ``build.json``.
    """
    shape = Shape(layers, hidden, inter, heads, kv_heads, vocab, seq)
    folder = Path(out_dir) / shape.key()
    model = folder / "model.onnx"
    if (folder / "build.json").is_file() and model.is_file() and _data_file(model).is_file():
        return model
    tmp = Path(out_dir) / (shape.key() + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = {**asdict(shape), "path": str(tmp / "model.onnx")}
    log = tmp / "export.log"
    print(f"[compile_scale] building {shape.key()} (1.1B parameters: ~2 min, ~5 GB RAM)"
          if layers * hidden >= 22 * 2048 else f"[compile_scale] building {shape.key()}", file=sys.stderr)
    wall, rss = measure([sys.executable, "-c", _EXPORT_SCRIPT, json.dumps(args)], log=log)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    info: dict[str, Any] = json.loads(lines[-1])
    info.update(config=asdict(shape), build_wall_s=wall, build_peak_rss_bytes=rss,
                weight_bytes=_data_file(tmp / "model.onnx").stat().st_size,
                graph_bytes=(tmp / "model.onnx").stat().st_size)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    (folder / "build.json").write_text(json.dumps(info, indent=2))
    return model


def _build_info(model: Path) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((model.parent / "build.json").read_text())
    return info


def _reset_page_cache() -> bool:
    """Empty the page cache where this process may (root: /proc/sys/vm/drop_caches), so that
    every measurement starts from the same memory: on this host a writer that follows one
    whose 4.4 GB output is still cached pays 3-4x the system time to get pages (a copy and
    fsync: 9-10 s instead of 2.6 s; docs/performance.md), whichever writer it is."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def _prepare_cache(path: Path, cache: str) -> None:
    """Put ``path`` in the page cache (warm) or drop it from there (cold), after the disk
    has settled: the writeback the last measurement left (a copy without fsync) is not
    charged to the next."""
    os.sync()
    if _reset_page_cache():  # the compiler's own files back in too (torch's libraries: ~1 GB), as a user's are
        subprocess.run([sys.executable, "-c", "import npuc.compiler.driver"], check=True)
    time.sleep(1.0)
    with open(path, "rb", buffering=0) as f:
        if cache == "cold":
            os.fsync(f.fileno())  # dirty pages cannot be dropped; Linux allows fsync on a read-only fd
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def _npuc_compile(model: Path, scratch: Path, cache: str) -> dict[str, Any]:
    out = scratch / "model"
    _prepare_cache(_data_file(model), cache)
    cmd = [sys.executable, "-m", "npuc", "compile", str(model), "--input_shape", f"input_ids:1,{SEQ}",
           "--output", str(out), "--soc_version", "cpu", "--log", "null"]
    wall, rss = measure(cmd, log=scratch / "npuc.log")
    om = out.with_suffix(".om")
    res = {"wall_s": wall, "peak_rss_bytes": rss, "om_bytes": om.stat().st_size}
    om.unlink()
    return res


def _ort_optimise(model: Path, scratch: Path, cache: str) -> dict[str, Any]:
    opt = scratch / "optimized.onnx"
    _prepare_cache(_data_file(model), cache)
    wall, rss = measure([sys.executable, "-c", _ORT_SCRIPT, str(model), str(opt)], log=scratch / "ort.log")
    res = {"wall_s": wall, "peak_rss_bytes": rss,
           "out_bytes": opt.stat().st_size + (_data_file(opt).stat().st_size if _data_file(opt).exists() else 0)}
    opt.unlink()
    _data_file(opt).unlink(missing_ok=True)
    return res


def _copy(model: Path, scratch: Path, cache: str, fsync: bool = False) -> dict[str, Any]:
    src = _data_file(model)
    dst = scratch / "copy.data"
    _prepare_cache(src, cache)
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    if fsync:
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
    wall = time.perf_counter() - t0
    dst.unlink()
    return {"wall_s": wall, "bytes": src.stat().st_size}


def _in_turn(runs: dict[str, Any], repeat: int) -> dict[str, dict[str, Any]]:
    """Each measurement `repeat` times, in turn; the median wall time (peak RSS: the
    largest) with every run's time beside it."""
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(repeat):  # the order turns by one each round: none always follows the same one
        for name in names[i % len(names):] + names[:i % len(names)]:
            seen[name].append(runs[name]())
    out = {}
    for name, rs in seen.items():
        med = dict(sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2])
        med["wall_s_runs"] = [round(r["wall_s"], 3) for r in rs]
        if "peak_rss_bytes" in med:
            med["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rs)
        out[name] = med
    return out


def run(out_dir: str | os.PathLike[str], quick: bool, cache_dir: str | os.PathLike[str] | None = None,
        cache: str = "warm", repeat: int = 1, ort: bool = True) -> dict[str, Any]:
    """Build (or reuse) the models, measure, and return the figures.

    ``out_dir`` holds the scratch outputs (deleted as it goes); the models are cached in
    ``cache_dir`` (default: ``$NPUC_BENCH_SCALE_CACHE`` or /tmp/npuc_bench_scale). ``quick``:
    a 2-layer, hidden-512 model and its 1-layer half instead of the 22- and 11-layer ones.
    ``repeat``: how many times npuc and the copies run, in turn (medians reported); ``ort``:
    whether to measure onnxruntime's offline optimisation too (once).
    """
    if cache not in ("warm", "cold"):
        raise ValueError(f"cache must be 'warm' or 'cold', not {cache!r}")
    root = Path(cache_dir or os.environ.get("NPUC_BENCH_SCALE_CACHE", DEFAULT_CACHE))
    scratch = Path(out_dir) / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    big = QUICK if quick else FULL
    half = Shape(**{**asdict(big), "layers": big.layers // 2})
    try:
        models: dict[str, Path] = {}
        for name, shape in (("full", big), ("half", half)):
            t0 = time.perf_counter()
            models[name] = build_llama_onnx(root, **asdict(shape))
            print(f"[compile_scale] {shape.key()}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        res: dict[str, Any] = {"quick": quick, "page_cache": cache, "input_shape": f"input_ids:1,{SEQ}",
                               "page_cache_reset": _reset_page_cache(),
                               "rss_method": "os.wait4 rusage of each child (ru_maxrss)",
                               "cache_dir": str(root), "repeat": repeat}
        for name, model in models.items():
            info = _build_info(model)
            cfg = info["config"]
            print(f"[compile_scale] measuring {name} ({cfg['layers']} layers)", file=sys.stderr)
            res[name] = {
                "layers": cfg["layers"], "config": cfg, "params": info["params"],
                "weight_bytes": info["weight_bytes"], "graph_bytes": info["graph_bytes"],
                "build": {"wall_s": info["build_wall_s"], "peak_rss_bytes": info["build_peak_rss_bytes"],
                          "init_s": info["init_s"], "export_s": info["export_s"], "save_s": info["save_s"]},
                **_in_turn({"npuc_compile": lambda m=model: _npuc_compile(m, scratch, cache),
                            "copy": lambda m=model: _copy(m, scratch, cache),
                            "copy_fsync": lambda m=model: _copy(m, scratch, cache, fsync=True)}, repeat),
                "ort_optimize": _ort_optimise(model, scratch, cache) if ort else
                {"wall_s": float("nan"), "peak_rss_bytes": float("nan"), "skipped": True},
            }
        f, h = res["full"], res["half"]
        res["ratios_full_over_half"] = {
            "weight_bytes": f["weight_bytes"] / h["weight_bytes"],
            "npuc_peak_rss": f["npuc_compile"]["peak_rss_bytes"] / h["npuc_compile"]["peak_rss_bytes"],
            "ort_peak_rss": f["ort_optimize"]["peak_rss_bytes"] / h["ort_optimize"]["peak_rss_bytes"],
            "npuc_wall": f["npuc_compile"]["wall_s"] / h["npuc_compile"]["wall_s"],
        }
        res["npuc_peak_rss_over_weights"] = f["npuc_compile"]["peak_rss_bytes"] / f["weight_bytes"]
        res["npuc_wall_over_copy"] = f["npuc_compile"]["wall_s"] / f["copy"]["wall_s"]
        res["npuc_wall_over_copy_fsync"] = f["npuc_compile"]["wall_s"] / f["copy_fsync"]["wall_s"]
        # the same, as the median of each round's ratio: the disk's speed drifts between rounds
        per_round = [a / b for a, b in zip(f["npuc_compile"]["wall_s_runs"], f["copy_fsync"]["wall_s_runs"],
                                           strict=True)]
        res["npuc_over_copy_fsync_rounds"] = [round(r, 3) for r in per_round]
        res["npuc_over_copy_fsync_median"] = statistics.median(per_round)
        return res
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models (2 and 1 layers, hidden 512)")
    ap.add_argument("--out", default=DEFAULT_CACHE, help=f"scratch folder (default {DEFAULT_CACHE})")
    ap.add_argument("--cache-dir", default=None,
                    help=f"model cache (default $NPUC_BENCH_SCALE_CACHE or {DEFAULT_CACHE})")
    ap.add_argument("--cold", action="store_true",
                    help="drop the weight file from the page cache before each measurement (default: warm)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of npuc and of each copy, in turn (default 3)")
    ap.add_argument("--skip-ort", action="store_true", help="leave out onnxruntime's offline optimisation")
    args = ap.parse_args(argv)
    res = run(args.out, args.quick, cache_dir=args.cache_dir, cache="cold" if args.cold else "warm",
              repeat=args.repeat, ort=not args.skip_ort)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
