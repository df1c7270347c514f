"""Decode over several slots (issue 18): aggregate tokens/s at batch 1, 2, 4 and 8 on the
bench model, npuc's scheduler (apps/scheduler.py) beside HF `generate` on the same
prompts, padded on the left, in the same run.

    python bench/batch_decode.py [--quick] [--work DIR] [--merge docs/benchmarks.json]

(then the serving load test, bench/serve_load.py, on the batch-4 model as it is, with
--decode_tokens 4 and with --mixed_tokens 4 and 2).

npuc: one `.om` per batch (`--input_shape input_ids:B,<prompt> --max_seq_len ...`); B
prompts are admitted (a prefill each), then every step decodes one token of each slot. A
step's time is the scheduler's `step()`; aggregate tokens/s = B / the median step (steps
with every slot decoding). HF: `generate(max_new_tokens=new)` minus `generate(max_new_tokens=1)`
over B * (new - 1) tokens, eager, its dynamic cache. The batches are timed in turn, round
after round, so the machine's drift falls on all alike. Each sequence's tokens are checked
against batch 1's (greedy: they must be the same). With --merge the figures join a run's
JSON and docs/benchmarks.md is rendered again from it (bench/run.py --render).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from run import FULL, QUICK, Sizes, llama_checkpoint, prompt_ids  # noqa: E402

BATCHES = (1, 2, 4, 8)


def prompts(s: Sizes, n: int) -> list[list[int]]:
    base = prompt_ids(s)
    return [[3 + (t - 3 + 7919 * i) % (s.vocab - 3) for t in base] for i in range(n)]


def _npuc_round(om: Path, s: Sizes, b: int) -> tuple[list[float], list[list[int]]]:
    from npuc.apps.scheduler import Scheduler
    from npuc.runtime import Session

    sched = Scheduler(Session.load(str(om)))
    ids = [sched.submit(p, s.new, ignore_eos=True) for p in prompts(s, b)]
    steps = []
    while not sched.idle:
        full = sched.active == b and not sched.queued  # every slot decoding, no prefill in the step
        t0 = time.perf_counter()
        sched.step()
        if full:
            steps.append(time.perf_counter() - t0)
    return steps, [sched.requests[i].tokens for i in ids]


def _hf_round(model: Any, s: Sizes, b: int) -> float:
    batch = torch.tensor(prompts(s, b))
    mask = torch.ones_like(batch)
    times = []
    with torch.no_grad():
        for new in (1, s.new):
            t0 = time.perf_counter()
            model.generate(batch, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)
            times.append(time.perf_counter() - t0)
    return b * (s.new - 1) / max(times[1] - times[0], 1e-9)


def run(ckpt: Path, s: Sizes, work: Path, rounds: int, batches: tuple[int, ...] = BATCHES) -> dict[str, Any]:
    import transformers

    from npuc.compiler.driver import compile_model

    oms = {}
    for b in batches:
        om = work / f"batch_{s.hidden}x{s.layers}_b{b}.om"
        if not om.exists():
            compile_model(str(ckpt), input_shape=f"input_ids:{b},{s.prompt}", max_seq_len=s.max_len,
                          soc_version="cpu", output=str(om)[:-3])
        oms[b] = om
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    steps: dict[int, list[float]] = {b: [] for b in batches}
    hf: dict[int, list[float]] = {b: [] for b in batches}
    tokens: dict[int, list[list[int]]] = {}
    for r in range(rounds):
        for b in (batches if r % 2 == 0 else tuple(reversed(batches))):
            st, tokens[b] = _npuc_round(oms[b], s, b)
            steps[b].extend(st)
            hf[b].append(_hf_round(model, s, b))
    # Each prompt alone (one slot, one after another): what every batch must have generated.
    from npuc.apps.scheduler import generate_many
    from npuc.runtime import Session

    one = oms[1] if 1 in oms else Path(compile_model(str(ckpt), input_shape=f"input_ids:1,{s.prompt}",
                                                     max_seq_len=s.max_len, soc_version="cpu",
                                                     output=str(work / "batch_b1_ref")))
    alone = [generate_many(Session.load(str(one)), [p], s.new, ignore_eos=True)[0] for p in prompts(s, max(batches))]
    same = all(tokens[b][i] == alone[i] for b in batches for i in range(b))
    rows = []
    base = None
    for b in batches:
        med = statistics.median(steps[b])
        tok_s = b / med
        base = base or tok_s
        rows.append({"batch": b, "step_ms": 1e3 * med, "tok_per_s": tok_s, "vs_batch1": tok_s / base,
                     "hf_tok_per_s": statistics.median(hf[b]), "vs_hf": tok_s / statistics.median(hf[b]),
                     "steps": len(steps[b])})
    return {"rows": rows, "rounds": rounds, "same_tokens": same, "prompt": s.prompt, "new": s.new,
            "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat()}


DECODE_TOKENS = 4  # the chunked-prefill configuration the load test also serves
MIXED_TOKENS = (4, 2)  # the mixed prefill/decode step's prompt rows, served too (--quick: the first)


def load_test(work: Path, ckpt: Path, s: Sizes, quick: bool) -> list[dict[str, Any]]:
    """bench/serve_load.py on the batch-4 model (batch 2 with --quick) that run() compiled,
    on the same with --decode_tokens DECODE_TOKENS and on the same with each --mixed_tokens
    of MIXED_TOKENS, each in turn in the same run."""
    import serve_load

    from npuc.compiler.driver import compile_model

    b = 2 if quick else 4
    chunked = work / f"batch_{s.hidden}x{s.layers}_b{b}_c{DECODE_TOKENS}.om"
    if not chunked.exists():
        compile_model(str(ckpt), input_shape=f"input_ids:{b},{s.prompt}", max_seq_len=s.max_len, soc_version="cpu",
                      decode_tokens=DECODE_TOKENS, output=str(chunked)[:-3])
    oms = [work / f"batch_{s.hidden}x{s.layers}_b{b}.om", chunked]
    for c in MIXED_TOKENS[:1] if quick else MIXED_TOKENS:
        mixed = work / f"batch_{s.hidden}x{s.layers}_b{b}_m{c}.om"
        if not mixed.exists():
            compile_model(str(ckpt), input_shape=f"input_ids:{b},{s.prompt}", max_seq_len=s.max_len,
                          soc_version="cpu", mixed_tokens=c, output=str(mixed)[:-3])
        oms.append(mixed)
    return [serve_load.run(om, s.vocab, s.prompt, s.new, requests=8 if quick else 40, limit=120 if quick else 900,
                           floor_rounds=1 if quick else 10) for om in oms]


def render(batch: dict[str, Any]) -> list[str]:
    lines = ["", "## Decode over several slots", "",
             f"bench/batch_decode.py: one `.om` per batch B (`--input_shape input_ids:B,{batch['prompt']}`), B "
             f"sequences of {batch['prompt']} prompt tokens each, {batch['new']} new tokens, greedy, decoded "
             "together by the scheduler (apps/scheduler.py); a step is one token of every slot. HF: "
             "`generate` on the same B prompts as one batch. The batches in turn over "
             f"{batch['rounds']} rounds ({batch.get('date', 'this run')}, {batch['threads']} threads). Each "
             f"sequence's tokens equal batch 1's: {batch['same_tokens']}.", "",
             "| batch | npuc step (ms) | npuc tokens/s | vs batch 1 | HF generate tokens/s | vs HF |",
             "|---|---|---|---|---|---|"]
    for r in batch["rows"]:
        lines.append(f"| {r['batch']} | {r['step_ms']:.1f} | {r['tok_per_s']:.1f} | {r['vs_batch1']:.2f}x | "
                     f"{r['hf_tok_per_s']:.1f} | {r['vs_hf']:.2f}x |")
    at4 = next((r for r in batch["rows"] if r["batch"] == 4), None)
    if at4 is not None:
        lines += ["", f"Target: batch 4 at least 3x batch 1's tokens/s: {at4['vs_batch1']:.2f}x "
                      f"({'met' if at4['vs_batch1'] >= 3 else 'missed'})."]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--merge", default=None, metavar="JSON", help="add the figures to a bench/run.py JSON and "
                    "render its report again")
    ap.add_argument("--load-only", action="store_true", help="only the serving load test (the batch-B model "
                    "compiled if it is not in --work)")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    work = Path(args.work or tempfile.mkdtemp(prefix="npuc-bench-batch-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = llama_checkpoint(s, work / f"llama_{s.hidden}x{s.layers}")
    if args.load_only:
        from npuc.compiler.driver import compile_model

        b = 2 if args.quick else 4
        om = work / f"batch_{s.hidden}x{s.layers}_b{b}.om"
        if not om.exists():
            compile_model(str(ckpt), input_shape=f"input_ids:{b},{s.prompt}", max_seq_len=s.max_len,
                          soc_version="cpu", output=str(om)[:-3])
        batch = None
    else:
        batch = run(ckpt, s, work, args.rounds or (1 if args.quick else 3), (1, 2) if args.quick else BATCHES)
    load = load_test(work, ckpt, s, args.quick)
    print(json.dumps({"batch": batch, "serve_load": load}, indent=2))
    import serve_load

    print("\n".join((render(batch) if batch else []) + serve_load.render(load)), file=sys.stderr)
    if args.merge:
        import run as bench_run

        path = Path(args.merge)
        res = json.loads(path.read_text())
        if batch is not None:
            res["batch"] = batch
        res["serve_load"] = load
        path.write_text(json.dumps(res, indent=2, sort_keys=True))
        bench_run.main(["--render", str(path)])


if __name__ == "__main__":
    main()
