"""Decode, every system in turn: the figures the decode targets are judged on.

Each system's own phase of bench/run.py generates minutes apart from the others'; on a
shared machine the speed drifts by 20% or more between such phases, the size of the
margins being judged (npu target within 1.1x of cpu, w4a16 at 5x HF). Here every system
is loaded at once, each in its own process (thread pools never share one), and each
round runs one whole generation of each (prompt, then the new tokens greedy, the decode
steps timed), in an order that rotates from round to round, each waiting 50 ms first
(onnxruntime's workers spin a while after a run). Drift then falls on all alike.

Reported per system: tokens/s (the median over rounds of each generation's tokens/s),
the P50 and P99 step over all rounds, the median over rounds of each generation's
P99/P50, and for any two systems the median and quartiles of the per-round ratio of
their tokens/s.

    python bench/decode_ab.py npuc:A.om npuc:B.om hf:CKPT_DIR ort:PREFILL.onnx,DECODE.onnx \
        [llamacpp:X.gguf --llamacpp-python PY] [openvino:DIR --openvino-python PY] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent

# argv: bench dir, kind (npuc|hf|ort|llamacpp|openvino), threads, prompt ids as JSON, new
# tokens, max_len, then the model path(s). Answers "ready" after a warm-up generation, then
# per line it reads one JSON line: the generation's tokens, the seconds of each decode step,
# and the seconds from the call to the first token (the prompt's prefill and its argmax).
_WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
kind, threads, ids, new, max_len = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
paths = sys.argv[7:]
if kind not in ("llamacpp", "openvino"):  # those run in venvs of their own, without torch
    import torch
    torch.set_num_threads(threads)
if kind in ("llamacpp", "openvino"):
    from pathlib import Path
    if kind == "llamacpp":
        from llamacpp import Generator
    else:
        from openvino_peer import Generator
    gen = Generator(Path(paths[0]), ids, new, threads)
    def generate():
        tokens, steps = gen.generate()
        return tokens, steps, gen.last_prefill_s
elif kind == "npuc":
    from npuc.apps.generate import steps as gen_steps
    from npuc.runtime.executor import open_session
    # what npuc.load gives users: the C executor (libnpucrt), the torch interpreter where it refuses
    sess = open_session(paths[0], threads=threads)
    def generate():
        tokens, steps = [], []
        t0 = time.perf_counter()
        for i, (tok, _) in enumerate(gen_steps(sess, ids, new, ignore_eos=True, keep_logits=False)):
            t1 = time.perf_counter()
            if i > 0:  # the first token comes from prefill
                steps.append(t1 - t0)
            else:
                prefill = t1 - t0
            tokens.append(tok)
            t0 = time.perf_counter()
        return tokens, steps, prefill
elif kind == "hf":
    import transformers
    from transformers import StaticCache
    model = transformers.AutoModelForCausalLM.from_pretrained(paths[0], attn_implementation="eager").eval()
    def generate():
        with torch.no_grad():
            cache = StaticCache(config=model.config, max_cache_len=max_len)
            t0 = time.perf_counter()
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(len(ids)))
            tok = int(out.logits[0, -1].argmax())
            prefill = time.perf_counter() - t0
            tokens, steps = [tok], []
            for i in range(new - 1):
                t0 = time.perf_counter()
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([len(ids) + i]))
                tok = int(out.logits[0, -1].argmax())
                steps.append(time.perf_counter() - t0)
                tokens.append(tok)
        return tokens, steps, prefill
else:
    from ort_llama import OrtLlama
    ort = OrtLlama(paths[0], paths[1], threads)
    def generate():
        tokens, steps = ort.generate(ids, new)
        return [int(t) for t in tokens], list(steps), ort.last_prefill_s
generate()
print("ready", flush=True)
for _ in sys.stdin:
    tokens, steps, prefill = generate()
    print(json.dumps({"tokens": tokens, "steps": steps, "prefill": prefill}), flush=True)
"""


def start_worker(python: str | None, script: str, args: list[str]) -> subprocess.Popen[str]:
    """A worker (`python -c script BENCH args...`) that has answered "ready"."""
    p = subprocess.Popen(
        [python or sys.executable, "-c", script, str(BENCH), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if line != "ready":
        p.kill()
        raise RuntimeError(f"benchmark worker {args} did not start (said {line!r})")
    return p


def ask(p: subprocess.Popen[str]) -> str:
    """One run of the worker's job, after 50 ms (another worker's spinning threads settle): its line."""
    assert p.stdin is not None and p.stdout is not None
    time.sleep(0.05)
    p.stdin.write("go\n")
    p.stdin.flush()
    return p.stdout.readline()


def _start(
    kind: str, paths: list[str], python: str | None, threads: int, ids: list[int], new: int, max_len: int
) -> subprocess.Popen[str]:
    return start_worker(
        python, _WORKER, [kind, str(threads), json.dumps(ids), str(new), str(max_len), *paths]
    )


def _generate(p: subprocess.Popen[str]) -> dict[str, Any]:
    return json.loads(ask(p))


def stop_workers(procs: Any, timeout: float) -> None:
    """Close each worker's input (its loop ends) and wait for it."""
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()
        p.wait(timeout)


def median_quartiles(xs: list[float]) -> dict[str, float]:
    """Median and quartiles (one value: itself for all three)."""
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2]}


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))]


def interleaved(
    systems: dict[str, tuple[str, list[str], str | None]],
    ids: list[int],
    new: int,
    max_len: int,
    threads: int,
    rounds: int = 9,
) -> dict[str, Any]:
    """`systems`: label -> (kind, model paths, the python to run it, None: this one): kind
    npuc (an .om), hf (a checkpoint folder), ort (prefill and decode ONNX, bench/ort_llama.py)
    llamacpp (a GGUF, bench/llamacpp.py; its python has llama-cpp-python) or openvino (a
    folder exported by optimum-intel, bench/openvino_peer.py; its python has openvino-genai).
    Every system's generations, timed in turn."""
    names = list(systems)
    procs: dict[str, subprocess.Popen[str]] = {}
    gens: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for n in names:
            procs[n] = _start(*systems[n], threads, ids, new, max_len)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order if r % 2 == 0 else order[::-1]:
                gens[n].append(_generate(procs[n]))
    finally:
        stop_workers(procs.values(), 60)
    out: dict[str, Any] = {"rounds": rounds, "order": "rotating, reversed on odd rounds", "systems": {}}
    for n in names:
        tps = [len(g["steps"]) / sum(g["steps"]) for g in gens[n]]
        steps = [x for g in gens[n] for x in g["steps"]]
        out["systems"][n] = {
            "tok_per_s_rounds": tps,
            "tok_per_s": statistics.median(tps),
            "p50_ms": 1e3 * _pct(steps, 50),
            "p99_ms": 1e3 * _pct(steps, 99),
            "p99_p50_per_generation": statistics.median(
                _pct(g["steps"], 99) / _pct(g["steps"], 50) for g in gens[n]
            ),
            "prefill_s_rounds": [g["prefill"] for g in gens[n]],
            "prefill_ms": 1e3 * statistics.median(g["prefill"] for g in gens[n]),
            "tokens": gens[n][0]["tokens"],
            "same_tokens_every_round": all(g["tokens"] == gens[n][0]["tokens"] for g in gens[n]),
        }
    return out


def ratio(turns: dict[str, Any], a: str, b: str) -> dict[str, float]:
    """Per-round ratio of a's tokens/s to b's: median and quartiles."""
    ta, tb = turns["systems"][a]["tok_per_s_rounds"], turns["systems"][b]["tok_per_s_rounds"]
    return median_quartiles([x / y for x, y in zip(ta, tb, strict=True)])


def prefill_ratio(turns: dict[str, Any], a: str, b: str) -> dict[str, float]:
    """Per-round ratio of a's prefill time to b's (the prompt to its first token): median and quartiles."""
    ta, tb = turns["systems"][a]["prefill_s_rounds"], turns["systems"][b]["prefill_s_rounds"]
    return median_quartiles([x / y for x, y in zip(ta, tb, strict=True)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "systems",
        nargs="+",
        help="kind:path[,path] (npuc:X.om, hf:DIR, ort:PREFILL,DECODE, llamacpp:X.gguf, openvino:DIR)",
    )
    ap.add_argument("--llamacpp-python", default=None, help="the python for llamacpp systems")
    ap.add_argument("--openvino-python", default=None, help="the python for openvino systems")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(BENCH))
    import run as B

    s = B.FULL
    specs = {}
    for spec in args.systems:
        kind, _, paths = spec.partition(":")
        python = {"llamacpp": args.llamacpp_python, "openvino": args.openvino_python}.get(kind)
        specs[spec] = (kind, paths.split(","), python)
    print(
        json.dumps(interleaved(specs, B.prompt_ids(s), s.new, s.max_len, args.threads, args.rounds), indent=2)
    )


if __name__ == "__main__":
    main()
