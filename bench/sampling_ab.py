"""Sampling and structured output against greedy decoding (issue 32), same run, timed in turn.

    python bench/sampling_ab.py --work /tmp/sab --doc docs/benchmarks.md   # the 125M Llama, 4 slots
    python bench/sampling_ab.py --work /tmp/sab --quick                    # a small model: a smoke check

The model is bench/native_ab.py's 125M Llama (random weights, vocab 32,000) with a
byte-level BPE tokenizer trained here on the standard library's sources (what llguidance
needs to build a JSON grammar's token masks), compiled with 4 slots. Four requests decode
together through apps/scheduler.py, as `npuc serve` runs them; each mode refills a slot as
soon as a request ends, so all four stay busy. Only decode steps are timed (a step that
admitted a request, and so ran a prefill, is left out of both the time and the tokens), in
rounds that take the modes in turn:

    greedy   temperature 0
    sampled  temperature 0.8, top_p 0.95, seeded
    json     sampled as above, under a JSON schema (an array of strings: random weights keep
             writing it), the token mask computed each step

The mask's own cost (llguidance's mask and the token's consumption) is timed apart, as a
share of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {"type": "array", "items": {"type": "string"}}


def tokenizer(work: Path, vocab: int) -> Any:
    """A byte-level BPE trained on the standard library's .py files (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = work / f"tok{vocab}"
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def model(work: Path, quick: bool) -> Path:
    import shutil

    from native_ab import llama

    vocab = 4000 if quick else 32000
    ckpt = llama(work, "small" if quick else "125m", *((256, 4, 8, 4, 512) if quick else (768, 12, 12, 4, 2048)),
                 vocab)
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg.get("eos_token_id") != 1:
        cfg.update(bos_token_id=0, eos_token_id=1)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    tokenizer(work, vocab)
    for f in (work / f"tok{vocab}").iterdir():
        shutil.copy(f, ckpt / f.name)
    from npuc.compiler.driver import compile_model

    out = work / ("small_s4" if quick else "125m_s4")
    if not out.with_suffix(".om").is_file():
        compile_model(str(ckpt), input_shape="input_ids:4,32", max_seq_len=512, output=str(out))
    return out.with_suffix(".om")


def one_round(sess: Any, mode: str, steps: int, seed: int) -> dict[str, float]:
    """Decode-step tokens/s of one mode over `steps` steps with every slot busy."""
    from npuc.apps.sampling import SamplingParams
    from npuc.apps.scheduler import Scheduler
    from npuc.apps.structured import grammar_for

    sched = Scheduler(sess)
    grammar = grammar_for("json_schema", SCHEMA) if mode == "json" else None
    mask_s = [0.0]
    n = [0]

    def params() -> SamplingParams:
        n[0] += 1
        if mode == "greedy":
            return SamplingParams()
        return SamplingParams(temperature=0.8, top_p=0.95, seed=seed * 1000 + n[0], grammar=grammar)

    prompt = list(range(100, 116))
    runs = sess.run
    prefills = [0]

    def counting(inputs: Any, program: Any = None, copy_outputs: bool = True) -> Any:
        prefills[0] += program == "prefill"
        return runs(inputs, program, copy_outputs)

    sess.run = counting
    try:
        for _ in range(4):
            sched.submit(prompt, 400, True, params())
        for _ in range(3):  # warm: admissions, the grammar tokenizer's first masks
            sched.step()
        decode_s, tokens, step_times = 0.0, 0, []
        timed = 0
        while timed < steps:
            while sched.active + sched.queued < 4:
                sched.submit(prompt, 400, True, params())
            before = prefills[0]
            fill0 = _MASK["s"]
            t = time.perf_counter()
            events = sched.step()
            dt = time.perf_counter() - t
            if prefills[0] != before:
                continue
            mask_s[0] += _MASK["s"] - fill0
            decode_s += dt
            step_times.append(dt)
            tokens += sum(e.token is not None for e in events)
            timed += 1
    finally:
        sess.run = runs
    return {"tok_s": tokens / decode_s, "step_ms": 1e3 * statistics.median(step_times),
            "mask_ms": 1e3 * mask_s[0] / steps}


_MASK = {"s": 0.0}  # seconds in llguidance's mask and consumption, this process (instrument_masks)


def instrument_masks() -> None:
    """Time llguidance's mask and consumption (apps/structured.Matcher) process-wide."""
    from npuc.apps import structured

    fill, consume = structured.Matcher.fill, structured.Matcher.consume

    def timed_fill(self: Any) -> Any:
        t = time.perf_counter()
        try:
            return fill(self)
        finally:
            _MASK["s"] += time.perf_counter() - t

    def timed_consume(self: Any, token: int) -> None:
        t = time.perf_counter()
        try:
            consume(self, token)
        finally:
            _MASK["s"] += time.perf_counter() - t

    structured.Matcher.fill = timed_fill  # type: ignore[method-assign,unused-ignore]
    structured.Matcher.consume = timed_consume  # type: ignore[method-assign,unused-ignore]


def render(r: dict[str, Any], machine: str) -> str:
    from run import SAMPLING_BEGIN, SAMPLING_END

    g = r["greedy"]["tok_s"]
    lines = [SAMPLING_BEGIN, "", "## Sampling and structured output against greedy", "",
             f"Generated by `python bench/sampling_ab.py` ({machine}; {r['threads']} threads; {r['model']}, 4 slots, "
             f"every slot busy; {r['rounds']} rounds of {r['steps']} decode steps, the modes in turn; medians). "
             "Decode steps only: a step that admitted a request (a prefill) is left out.", "",
             "| mode | tokens/s | of greedy | step ms | mask ms a step | mask share of the step |",
             "|---|---|---|---|---|---|"]
    names = {"greedy": "greedy", "sampled": "temperature 0.8, top_p 0.95, seeded",
             "json": "the same under a JSON schema (llguidance masks)"}
    for k, name in names.items():
        x = r[k]
        share = f"{100 * x['mask_ms'] / x['step_ms']:.1f}%" if k == "json" else ""
        mask = f"{x['mask_ms']:.3f}" if k == "json" else ""
        lines.append(f"| {name} | {x['tok_s']:.1f} | **{x['tok_s'] / g:.3f}x** | {x['step_ms']:.2f} | {mask} | "
                     f"{share} |")
    lines += ["", f"Target: sampling with top-p and a JSON schema costs at most 10% of greedy tokens/s: "
              f"**{100 * (1 - r['json']['tok_s'] / g):.1f}%** here. The mask is computed in the scheduler's thread "
              "between steps, not overlapped with the step.", "", SAMPLING_END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--quick", action="store_true", help="a small model, 1 round: a smoke check")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--doc", default=None, help="write the section into this report (docs/benchmarks.md)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    om = model(work, args.quick)
    instrument_masks()
    from npuc.runtime.executor import open_session

    sess = open_session(str(om), threads=args.threads)
    rounds = args.rounds or (1 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 24)
    got: dict[str, list[dict[str, float]]] = {m: [] for m in ("greedy", "sampled", "json")}
    for i in range(rounds):
        for mode in got:
            got[mode].append(one_round(sess, mode, steps, i))
            print(mode, got[mode][-1], flush=True)
    report: dict[str, Any] = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in got.items()}
    report.update(threads=args.threads, rounds=rounds, steps=steps,
                  model="a 4 x 256 Llama (vocab 4,000)" if args.quick else "the 125M Llama (vocab 32,000)")
    print(json.dumps(report, indent=1))
    if args.doc:
        from run import SAMPLING_BEGIN, SAMPLING_END, machine, write_section

        write_section(Path(args.doc), SAMPLING_BEGIN, SAMPLING_END,
                      render(report, f"{machine()}, {time.strftime('%Y-%m-%d')}"))

if __name__ == "__main__":
    main()
