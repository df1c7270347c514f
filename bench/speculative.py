"""Speculative decoding against plain decode on one .om compiled with --speculative_tokens K:
the same prompts decoded with `--speculative off` and `ngram`, timed in turn, one process.

    python bench/speculative.py MODEL.om [--rounds 5] [--new 128] [--threads 2] [--cases copy,rejected]
    python bench/speculative.py STDLIB.om --draft SMALL.om --cases text,copy
    python bench/speculative.py STDLIB_MTP.om --mtp --cases text,copy
    python bench/speculative.py MODEL.om --c --cases copy,plain,sampled

With --draft, the speculative runs draft with a small model's `.om` (method "draft",
apps/draft_model.py) instead of n-grams; with --mtp, with the model's own MTP layer (a `.om`
compiled with --mtp; apps/mtp_draft.py, bench/train_stdlib_mtp.py trains one). With --c, both
run libnpucrt's own decode loop (npuc_generate_speculative, as a C application calls it) instead
of the scheduler: n-gram drafts of K tokens, or none.

Prompts (token ids, so any vocabulary serves):
- copy: a 64-token block, then the block again cut short: where the model continues the
  copy, n-gram drafts are right;
- plain: 128 distinct ids, no repeats: drafts come only from what the model itself repeats;
- sampled: the plain prompt sampled at temperature 1 (seeded): drafts are rarely found;
- rejected: the copy prompt sampled at temperature 1 with 1-gram drafts (a draft wherever the
  last token occurred before): drafts that are checked are mostly rejected, and speculation must
  switch itself off;
- found-rejected: the plain prompt sampled at temperature 1 among the 16 likeliest tokens, with
  1-gram drafts: after a few dozen tokens nearly every last token occurred before, so a draft
  is found at every step, and about 1 in 16 is right: speculation must switch itself off;
- text: 128 bytes of held-out Python source (tests/data/stdlib_llama/heldout.bin), for the
  byte-level model trained on the standard library (bench/train_stdlib_llama.py), whose
  tokens are not random: a draft model's acceptance there is a real one.
Prints one JSON line per prompt: tokens/s of each, the ratio (median over rounds), and the
speculative run's acceptance rate and tokens per step. The tokens of both are compared (they
must be equal, sampled ones too: a seeded draw is the same with speculation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("om")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="copy,plain,sampled,rejected", help="which prompts, comma-separated")
    ap.add_argument("--draft", default=None, metavar="SMALL.om", help="draft with this model instead of n-grams")
    ap.add_argument("--mtp", action="store_true", help="draft with the model's MTP layer instead of n-grams")
    ap.add_argument("--c", action="store_true", help="time libnpucrt's decode loop (npuc_generate_speculative)")
    args = ap.parse_args()
    os.environ.setdefault("NPUC_NUM_THREADS", str(args.threads))
    from npuc.apps.sampling import GREEDY, SamplingParams
    from npuc.apps.scheduler import generate_many
    from npuc.apps.speculative import SpeculationStats, SpeculativeConfig
    from npuc.runtime.executor import open_session

    s = open_session(args.om)
    draft = open_session(args.draft) if args.draft else None
    method = "draft" if draft is not None else "mtp" if args.mtp else "ngram"
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = int(s.programs["decode"].outputs[0].shape[-1])
    block = [int(t) for t in rng.choice(np.arange(10, min(vocab, 30000)), 64, replace=False)]
    prompts = {"copy": block + block[:24], "plain": [int(t) for t in rng.choice(np.arange(10, min(vocab, 30000)), 128,
                                                                               replace=False)]}
    if any(c.startswith("text") for c in args.cases.split(",")):
        from pathlib import Path

        held = (Path(__file__).resolve().parent.parent / "tests/data/stdlib_llama/heldout.bin").read_bytes()
        prompts["text"] = list(held[:128])
    hot = SamplingParams(temperature=1.0, seed=1)
    cases = [("copy", prompts["copy"], GREEDY, {}), ("plain", prompts["plain"], GREEDY, {}),
             ("sampled", prompts["plain"], hot, {}),
             # 1-gram drafts, sampled away where checked: auto-off's case
             ("rejected", prompts["copy"], hot, {"ngram_min": 1}),
             ("found-rejected", prompts["plain"], SamplingParams(temperature=1.0, top_k=16, seed=1), {"ngram_min": 1}), ("text", prompts.get("text"), GREEDY, {}),
             ("text-sampled", prompts.get("text"), hot, {})]
    wanted = args.cases.split(",")
    for name, prompt, sampling, extra in [c for c in cases if c[0] in wanted]:
        if method != "ngram":
            extra = {k: v for k, v in extra.items() if not k.startswith("ngram")}
        times: dict[str, list[float]] = {"off": [], method: []}
        outs: dict[str, list[int]] = {}
        stats = SpeculationStats()
        if args.c:
            print(json.dumps({"prompt": name, "loop": "libnpucrt", **c_loop(args, s, prompt, sampling, extra)}),
                  flush=True)
            continue
        for rnd in range(args.rounds):
            for m in ("off", method) if rnd % 2 == 0 else (method, "off"):  # either first in turn
                st = SpeculationStats()
                t = time.perf_counter()
                out = generate_many(s, [prompt], args.new, True, sampling,
                                    speculative=SpeculativeConfig(method=m, **extra), stats=st,
                                    draft=draft if m == "draft" else None)[0]
                times[m].append(time.perf_counter() - t)
                outs[m] = out
                if m == method:
                    stats = st
        tps = {m: args.new / statistics.median(v) for m, v in times.items()}
        ratios = [a / b for a, b in zip(times["off"], times[method], strict=True)]
        print(json.dumps({"prompt": name, "method": method, "tokens_per_s_plain": round(tps["off"], 1),
                          f"tokens_per_s_{method}": round(tps[method], 1),
                          "ratio": round(statistics.median(ratios), 3),
                          "same_tokens": outs["off"] == outs[method], **stats.as_dict()}), flush=True)


def c_loop(args: argparse.Namespace, s: Any, prompt: list[int], sampling: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The same prompt through libnpucrt's own loop (NativeSession.generate), without drafts and
    with n-gram drafts of the verify program's K tokens, in turn."""
    from npuc.apps.sampling import TokenChooser
    from npuc.runtime.native_session import NativeSession

    if not isinstance(s, NativeSession):
        raise SystemExit("--c needs the native runtime (libnpucrt)")
    k = int(s.programs["verify"].inputs[0].shape[1]) - 1
    spec = (k, extra.get("ngram_min", 2), 4, 1.0)
    times: dict[str, list[float]] = {"off": [], "ngram": []}
    outs: dict[str, list[int]] = {}
    stats: Any = None
    for rnd in range(args.rounds):
        for m in ("off", "ngram") if rnd % 2 == 0 else ("ngram", "off"):
            chooser = None if sampling.plain else TokenChooser(sampling, prompt, args.new, 1 << 20, ())
            t = time.perf_counter()
            out, st = s.generate([prompt], args.new, spec if m == "ngram" else None,
                                 [chooser._c if chooser else None])
            times[m].append(time.perf_counter() - t)
            outs[m] = out[0]
            if m == "ngram":
                stats = st
    ratios = [a / b for a, b in zip(times["off"], times["ngram"], strict=True)]
    return {"tokens_per_s_plain": round(args.new / statistics.median(times["off"]), 1),
            "tokens_per_s_ngram": round(args.new / statistics.median(times["ngram"]), 1),
            "ratio": round(statistics.median(ratios), 3), "same_tokens": outs["off"] == outs["ngram"],
            "steps": stats.steps, "verify_steps": stats.verify_steps, "drafted_tokens": stats.drafted,
            "accepted_tokens": stats.accepted, "tokens_per_step": round(stats.tokens / max(stats.steps, 1), 3)}


if __name__ == "__main__":
    main()
