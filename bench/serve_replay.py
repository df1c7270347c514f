"""The serving load test's steady phase replayed in one process, without HTTP: where the
inter-token latency's tail comes from (bench/serve_load.py measures it end to end).

    python bench/serve_replay.py OM [--rate R] [--requests 40] [--prompt 128] [--new 64] [--vocab 32000]

Requests of `prompt` random token ids arrive evenly spaced at `rate` per second (default:
about half the 125M bench model's capacity at 4 slots) and go straight to the scheduler
(apps/scheduler.py); each step's program run is timed, and each request's gaps between
tokens. Prints the gaps' P50/P90/P99 and each program's step times (P50, P99, max).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from typing import Any

from serve_load import pct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("om")
    ap.add_argument("--rate", type=float, default=1.1)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    from npuc.apps.scheduler import Scheduler
    from npuc.runtime.executor import open_session

    s = open_session(args.om)
    runs: dict[str, list[float]] = collections.defaultdict(list)
    run = s.run

    def timed(feeds: Any, program: str, **kw: Any) -> Any:
        t = time.perf_counter()
        out = run(feeds, program, **kw)
        runs[program].append(time.perf_counter() - t)
        return out

    s.run = timed
    sched = Scheduler(s)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    sched.submit(prompts[0], 4, ignore_eos=True)  # warm-up: every program's first run
    while not sched.idle:
        sched.step()
    runs.clear()
    start, arrived, last, gaps = time.perf_counter(), 0, {}, []
    while arrived < len(prompts) or not sched.idle:
        while arrived < len(prompts) and time.perf_counter() - start >= arrived / args.rate:
            sched.submit(prompts[arrived], args.new, ignore_eos=True)
            arrived += 1
        if sched.idle:
            time.sleep(0.001)
            continue
        events = sched.step()
        now = time.perf_counter()
        for e in events:
            if e.token is not None:
                if e.request in last:
                    gaps.append(now - last[e.request])
                last[e.request] = now
    ms = {q: 1e3 * pct(gaps, q) for q in (50, 90, 99)}
    print(json.dumps({"gaps": len(gaps), "itl_p50_ms": round(ms[50], 2), "itl_p90_ms": round(ms[90], 2),
                      "itl_p99_ms": round(ms[99], 2), "itl_p99_over_p50": round(ms[99] / ms[50], 3),
                      "steps": {p: {"runs": len(v), "p50_ms": round(1e3 * pct(v, 50), 2),
                                    "p99_ms": round(1e3 * pct(v, 99), 2), "max_ms": round(1e3 * max(v), 2)}
                                for p, v in runs.items()}}, indent=1))


if __name__ == "__main__":
    main()
