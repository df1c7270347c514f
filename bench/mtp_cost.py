"""What MTP drafting costs against what it saves, from a `.om` compiled with --mtp: each
program's step time, and the speed-up those times give at a draft acceptance rate.

    python bench/mtp_cost.py MODEL_MTP.om [--rounds 200] [--threads 2] [--acceptance 0.62,0.8,0.99]

A verify step of K drafts costs `verify` plus the drafting: one `mtp_verify` (the catch-up
on the tokens the last step accepted, whose last row gives the first draft) and K - 1 `mtp`
(each next draft on the layer's own hidden output). With each draft accepted with chance a
while all before it were, the step yields 1 + a + ... + a^K tokens on average, where plain
decode yields one a `decode` step:

    speed-up = (1 + a + ... + a^K) * decode / (verify + mtp_verify + (K - 1) * mtp)

The times are measured (the median of `--rounds` runs of each program, in turn, on one
slot's rows, the arena warm); the acceptance is given: a random-init model's drafts are never
right, so a model whose MTP layer is random (bench/run.py's 125M Llama with one more layer)
measures the costs, and a trained one (bench/train_stdlib_mtp.py: 0.62 held-out top-1, 0.99
on greedy held-out text) says what acceptance to expect. It leaves out the scheduler's own
work (Python), which bench/speculative.py's end-to-end runs include.

A `.om` without MTP programs (compiled with --speculative_tokens alone) is timed the same
way with n-gram drafting, which costs nothing. Where the model keeps recurrent state, a step
that does not keep all its rows also rolls the slot's states back (Session.rollback: one
copy of each state), timed on slot 0 and counted with chance 1 - a^K:

    speed-up = (1 + a + ... + a^K) * decode / (verify + drafting + (1 - a^K) * rollback)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("om")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--acceptance", default="0.62,0.8,0.9,0.99")
    args = ap.parse_args()
    os.environ.setdefault("NPUC_NUM_THREADS", str(args.threads))
    import numpy as np

    from npuc.apps.generate import generation_info
    from npuc.runtime.executor import open_session

    s = open_session(args.om)
    mtp = "mtp" in s.programs
    rollback = generation_info(s).rollback  # a recurrent model's states kept by verify row
    programs = ("decode", "verify", "mtp", "mtp_verify") if mtp else ("decode", "verify")
    feeds = {}
    for name in programs:
        p = s.programs[name]
        feed = {}
        for t in p.inputs:
            shape = tuple(int(d) for d in t.shape)
            if t.name == "position":
                rows = shape[-1] if len(shape) > 1 else 1
                feed[t.name] = np.broadcast_to(100 + np.arange(rows), shape).copy().astype(np.int64)
            elif t.name == "hidden":
                feed[t.name] = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            else:
                feed[t.name] = np.full(shape, 7, dtype=np.int64)
        feeds[name] = feed
    k = int(s.programs["verify"].inputs[0].shape[1]) - 1
    times: dict[str, list[float]] = {n: [] for n in programs}
    for name in programs:  # warm: the first run touches the arena and packs weights
        s.run(feeds[name], name, copy_outputs=False)
    for _ in range(args.rounds):
        for name in programs:
            t = time.perf_counter()
            s.run(feeds[name], name, copy_outputs=False)
            times[name].append(time.perf_counter() - t)
        if rollback:
            t = time.perf_counter()
            s.rollback(0, 0)
            times.setdefault("rollback", []).append(time.perf_counter() - t)
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    draft = ms["mtp_verify"] + (k - 1) * ms["mtp"] if mtp else 0.0
    rows = []
    for a in (float(x) for x in args.acceptance.split(",")):
        tokens = sum(a ** i for i in range(k + 1))
        cost = ms["verify"] + draft + (1 - a ** k) * ms.get("rollback", 0.0)
        rows.append({"acceptance": a, "tokens_per_step": round(tokens, 3),
                     "speed_up": round(tokens * ms["decode"] / cost, 3)})
    print(json.dumps({"k": k, "step_ms": {n: round(v, 3) for n, v in ms.items()}, "draft_ms": round(draft, 3),
                      "verify_over_decode": round(ms["verify"] / ms["decode"], 3),
                      "draft_over_decode": round(draft / ms["decode"], 3), "modelled": rows}))


if __name__ == "__main__":
    main()
