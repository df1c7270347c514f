"""Prefill, npuc against onnxruntime, interleaved: the figure the prefill target is judged on.

Each system's own phase of bench/run.py times its prefill minutes apart from the other's;
on a shared machine the speed drifts by 20% or more between such phases, which is the
size of the margin being judged. Here both are loaded at once, each in its own process
(two thread pools never share one), and timed in turn: round r runs npuc then
onnxruntime, or the reverse on odd rounds, each waiting 50 ms first (onnxruntime's
workers spin a while after a run, which would tax the next one), so drift falls on both
alike. Reported: each system's median, and the median and quartiles of the per-round
ratio npuc / onnxruntime.

    python bench/prefill_ab.py MODEL.om PREFILL.onnx DECODE.onnx [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import decode_ab  # noqa: E402

# argv: kind (npuc|ort), threads, prompt ids as JSON, then the model path(s). Answers "ready"
# after two warm-up runs, then one line of seconds per line it reads.
_WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
kind, threads, ids = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
import numpy as np, torch
torch.set_num_threads(threads)
if kind == "npuc":
    import run as B
    from npuc.runtime import Session
    sess = Session.load(sys.argv[5])
    feed = B.prefill_feed(sess, ids)
    f = lambda: sess.run(feed, "prefill", copy_outputs=False)
else:
    from ort_llama import OrtLlama
    ort = OrtLlama(sys.argv[5], sys.argv[6], threads)
    a = np.array([ids], dtype=np.int64)
    f = lambda: ort.prefill(a)
f(); f()
print("ready", flush=True)
for _ in sys.stdin:
    t0 = time.perf_counter(); f(); print(time.perf_counter() - t0, flush=True)
"""


def _start(args: list[str]) -> subprocess.Popen[str]:
    return decode_ab.start_worker(None, _WORKER, args)


def _time(p: subprocess.Popen[str]) -> float:
    return float(decode_ab.ask(p))


def interleaved(om: str, ort_prefill: str, ort_decode: str, ids: list[int], threads: int,
                rounds: int = 15) -> dict[str, Any]:
    """Medians (ms) of npuc's and onnxruntime's prefill, timed in turn, and the per-round ratios."""
    procs = {"npuc": _start(["npuc", str(threads), json.dumps(ids), om]),
             "ort": _start(["ort", str(threads), json.dumps(ids), ort_prefill, ort_decode])}
    times: dict[str, list[float]] = {"npuc": [], "ort": []}
    try:
        for r in range(rounds):
            for name in (("npuc", "ort") if r % 2 == 0 else ("ort", "npuc")):
                times[name].append(_time(procs[name]))
    finally:
        decode_ab.stop_workers(procs.values(), 30)
    r = decode_ab.median_quartiles([a / b for a, b in zip(times["npuc"], times["ort"], strict=True)])
    return {"rounds": rounds, "npuc_ms": 1e3 * statistics.median(times["npuc"]),
            "ort_ms": 1e3 * statistics.median(times["ort"]), "ratio": r["median"],
            "ratio_q1": r["q1"], "ratio_q3": r["q3"],
            "npuc_runs_ms": [round(1e3 * t, 1) for t in times["npuc"]],
            "ort_runs_ms": [round(1e3 * t, 1) for t in times["ort"]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("om")
    ap.add_argument("prefill_onnx")
    ap.add_argument("decode_onnx")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(BENCH))
    import run as B

    print(json.dumps(interleaved(args.om, args.prefill_onnx, args.decode_onnx, B.prompt_ids(B.FULL), args.threads,
                                 args.rounds), indent=2))


if __name__ == "__main__":
    main()
