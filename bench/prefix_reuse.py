"""Time to first token with and without a prefix-cache hit: a shared system prompt of
`--system` tokens and a user turn of `--turn` tokens, on a .om compiled with
--prefix_cache P and --speculative_tokens K (its verify program feeds the turn K + 1
tokens a step) and a prefill of at least system + turn tokens.

    python bench/prefix_reuse.py MODEL.om [--system 1024] [--turn 16] [--rounds 5]

Each round, in turn: a miss (a scheduler whose pool book is empty: the whole prompt
prefilled) and a hit (a scheduler that answered another turn after the same system prompt
first, so the system prompt's positions are loaded from the pool). Prints the medians, the
ratio of the per-round ratios, and whether the hit's tokens equal the miss's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def _first_token(sched: Any, prompt: list[int], new: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    rid = sched.submit(prompt, new, True)
    first = None
    while not sched.idle:
        events = sched.step()
        if first is None and any(e.request == rid and e.token is not None for e in events):
            first = time.perf_counter() - t
    assert first is not None
    return first, sched.requests[rid].tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("om")
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--turn", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("NPUC_NUM_THREADS", str(args.threads))
    import numpy as np

    from npuc.apps.scheduler import Scheduler
    from npuc.apps.speculative import SpeculativeConfig
    from npuc.runtime.executor import open_session

    s = open_session(args.om)
    vocab = int(s.programs["decode"].outputs[0].shape[-1])
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(10, vocab, args.system)]
    off = SpeculativeConfig(method="off")
    miss_t, hit_t, ratios, same = [], [], [], True
    for _ in range(args.rounds):
        turn = [int(t) for t in rng.integers(10, vocab, args.turn)]
        miss = Scheduler(s, speculative=off)
        tm, want = _first_token(miss, system + turn, 4)
        hit = Scheduler(s, speculative=off)
        _first_token(hit, system + [int(t) for t in rng.integers(10, vocab, args.turn)], 1)  # fills the pool
        th, got = _first_token(hit, system + turn, 4)
        assert hit.prefixes is not None and hit.prefixes.stats.hits == 1, "no hit: is the .om compiled with a pool?"
        miss_t.append(tm)
        hit_t.append(th)
        ratios.append(th / tm)
        same = same and got == want
    print(json.dumps({"system": args.system, "turn": args.turn, "ttft_miss_ms": round(1e3 * statistics.median(miss_t), 1),
                      "ttft_hit_ms": round(1e3 * statistics.median(hit_t), 1),
                      "ratio": round(statistics.median(ratios), 4), "same_tokens": same}))


if __name__ == "__main__":
    main()
