"""Long contexts: decode at depth and a 4096-token prefill, npuc and llama.cpp in turn.

    python bench/long_context.py --llamacpp-python /tmp/lcpvenv/bin/python [--work DIR]
        [--depths 512,2048,4096,8000] [--rounds 4] [--new 32] [--out docs/benchmarks.md]

The 125M Llama of bench/run.py (hidden 768, 12 layers, 12 heads, 4 KV heads, random
weights) is compiled by npuc with `--input_shape input_ids:1,4096 --max_seq_len 8192
--soc_version cpu`, in fp32 and in w4a8 (its best 4-bit mode), each with an f32 and an f16
KV cache (`--kv_cache_dtype`); llama.cpp runs the same weights as F32 and Q4_0 GGUFs
(bench/llamacpp.py) with its K and V caches in f32 or f16 (`type_k`, `type_v`; f16 is its
default) and flash attention on (what `llama-cli` and `llama-server` resolve `-fa auto` to
on a CPU; llama-cpp-python's own default is off, and a row with it off is reported too).

Decode at depth d: each system is a process of its own (bench/decode_ab.py's worker
protocol) that first brings its cache to depth d, then, once per round, decodes `new`
tokens greedily at positions d, d+1, ... (the same positions every round: llama.cpp drops
its cache past d before each round, npuc overwrites the same rows). The systems take turns
in an order that rotates every round. npuc brings its cache to depth d with its 4096-token
prefill program; past 4096 the remaining rows keep what an earlier prompt left there
(zeros at first): a decode step reads every row up to its position whatever they hold, so
the step's work is that of a cache filled token by token (filling 3904 rows one decode
step at a time would take minutes per process). llama.cpp evaluates the whole d-token
prompt.

Prefill: the 4096-token prompt from an empty cache to its first token, the systems in turn.

The bandwidth bound of a step: (the weight bytes a step reads + the cache bytes it reads at
depth d) / the measured read bandwidth (bench/run.py's read_bandwidth_gbps). Benchmarks are
not tests: targets are printed beside the figures, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

PREFILL = 4096
MAX_SEQ = 8192
BEGIN, END = "<!-- bench/long_context.py -->", "<!-- /bench/long_context.py -->"

# argv: bench dir, kind (npuc|llamacpp), threads, ids file, mode (depth|prefill), depth, new,
# model path, then llama.cpp's options as JSON. "ready" once the cache is at depth; then per
# input line one JSON line: the decode steps' seconds (depth) or the prefill's seconds.
_WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
kind, threads, ids = sys.argv[2], int(sys.argv[3]), json.load(open(sys.argv[4]))
mode, depth, new, path, opts = sys.argv[5], int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], json.loads(sys.argv[9])
import numpy as np
if kind == "npuc":
    import torch
    torch.set_num_threads(threads)
    from npuc.apps.generate import LAST_TOKEN, generation_info, logits_f32
    from npuc.runtime.executor import open_session
    s = open_session(path, threads=threads)
    info = generation_info(s)
    dec = s.programs["decode"]
    pos_name = next(t.name for t in dec.inputs if t.name != info.ids_name)
    def prefill(n):
        s.reset_state()
        n = min(n, info.prefill_len)
        first = np.zeros((1, info.prefill_len), dtype=np.int64)
        first[0, :n] = np.asarray(ids[:n], dtype=np.int64)
        feeds = {info.ids_name: first}
        if info.takes_last:
            feeds[LAST_TOKEN] = np.array([n - 1], dtype=np.int64)
        out = s.run(feeds, "prefill", copy_outputs=False)["logits"]
        return int(logits_f32(out[0, 0 if info.last_token else n - 1]).argmax())
    def step(tok, pos):
        out = s.run({info.ids_name: np.array([[tok]], dtype=np.int64), pos_name: np.array([pos], dtype=np.int64)},
                    "decode", copy_outputs=False)
        return int(logits_f32(out["logits"][0, -1]).argmax())
else:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=opts["n_ctx"], n_batch=2048, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, type_k=opts["type_k"], type_v=opts["type_v"],
                          flash_attn=opts["flash_attn"], verbose=False)
    vocab = llm.n_vocab()
    def last():
        return int(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,)).argmax())
    def prefill(n):
        llm.reset()
        llm.eval(ids[:n])
        return last()
    def step(tok, pos):
        llm.n_tokens = pos  # eval drops the cache past n_tokens first
        llm.eval([tok])
        return last()
if mode == "depth":
    first = prefill(depth)
    step(first, depth)  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        tok, steps = first, []
        for i in range(new):
            t0 = time.perf_counter()
            tok = step(tok, depth + i)
            steps.append(time.perf_counter() - t0)
        print(json.dumps({"steps": steps}), flush=True)
else:
    prefill(min(len(ids), 64))  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        prefill(len(ids))
        print(json.dumps({"prefill": time.perf_counter() - t0}), flush=True)
"""


def compile_npuc(ckpt: Path, out: Path, quant: str | None, kv: str) -> Path:
    om = out.with_suffix(".om")
    if om.is_file():
        return om
    cmd = [sys.executable, "-m", "npuc", "compile", str(ckpt), "--input_shape", f"input_ids:1,{PREFILL}",
           "--max_seq_len", str(MAX_SEQ), "--soc_version", "cpu", "--output", str(out), "--log", "error"]
    if kv != "auto":
        cmd += ["--kv_cache_dtype", kv]
    if quant:
        cmd += ["--quant_type", quant]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"[long] compiled {om.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return om


def make_ggufs(ckpt: Path, work: Path, python: str, threads: int) -> dict[str, Path]:
    import llamacpp

    weights = llamacpp.export_weights(ckpt, work / "llamacpp" / "weights")
    out = {}
    for q in ("F32", "Q4_0"):
        script = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import llamacpp; "
                  "print(llamacpp.make_gguf(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])))")
        r = subprocess.run([python, "-c", script, str(BENCH), str(weights), str(work / "llamacpp"), q, str(threads)],
                           check=True, capture_output=True, text=True)
        out[q] = Path(r.stdout.strip().splitlines()[-1])
    return out


def start(spec: dict[str, Any], ids_file: Path, mode: str, depth: int, new: int, threads: int) -> subprocess.Popen[str]:
    import decode_ab

    return decode_ab.start_worker(spec.get("python"), _WORKER, [
        spec["kind"], str(threads), str(ids_file), mode, str(depth), str(new), str(spec["path"]),
        json.dumps(spec.get("opts", {}))])


def in_turn(specs: dict[str, dict[str, Any]], ids_file: Path, mode: str, depth: int, new: int, threads: int,
            rounds: int) -> dict[str, list[dict[str, Any]]]:
    import decode_ab

    names = list(specs)
    procs: dict[str, subprocess.Popen[str]] = {}
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for n in names:
            t0 = time.perf_counter()
            procs[n] = start(specs[n], ids_file, mode, depth, new, threads)
            print(f"[long] {mode} {depth}: {n} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order if r % 2 == 0 else order[::-1]:
                out[n].append(json.loads(decode_ab.ask(procs[n])))
    finally:
        decode_ab.stop_workers(procs.values(), 120)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp-python", required=True)
    ap.add_argument("--work", default="/tmp/npuc-bench-long")
    ap.add_argument("--depths", default="512,2048,4096,8000")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefill-rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks.md"))
    ap.add_argument("--only", default=None, help='"|"-separated substrings: only the systems whose names hold one')
    args = ap.parse_args(argv)
    import run as B
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    s = B.FULL
    ckpt = B.llama_checkpoint(s, work / "llama_768x12")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s.vocab, (MAX_SEQ,), generator=g).tolist()
    ids_file = work / "ids.json"
    depths = [int(x) for x in args.depths.split(",")]
    ggufs = make_ggufs(ckpt, work, args.llamacpp_python, args.threads)
    ctx = MAX_SEQ + 64
    lc = args.llamacpp_python

    def llama(q: str, kv: int, fa: bool = True) -> dict[str, Any]:
        return {"kind": "llamacpp", "path": ggufs[q], "python": lc,
                "opts": {"n_ctx": ctx, "type_k": kv, "type_v": kv, "flash_attn": fa}}

    def npuc(quant: str | None, kv: str) -> dict[str, Any]:
        name = f"npuc_{quant or 'fp32'}_kv{kv}_p{PREFILL}_m{MAX_SEQ}"
        return {"kind": "npuc", "path": compile_npuc(ckpt, work / name, quant, kv)}

    F32, F16 = 0, 1  # GGML_TYPE_F32, GGML_TYPE_F16
    kinds: dict[str, Any] = {  # made when chosen: the .om files are compiled once, into --work
        "npuc fp32, f32 KV": lambda: npuc(None, "f32"),
        "llama.cpp F32, f32 KV": lambda: llama("F32", F32),
        "npuc fp32, f16 KV": lambda: npuc(None, "f16"),
        "llama.cpp F32, f16 KV": lambda: llama("F32", F16),
        "llama.cpp F32, f16 KV, flash attention off": lambda: llama("F32", F16, fa=False),
        "npuc w4a8, f16 KV": lambda: npuc("w4a8", "f16"),
        "llama.cpp Q4_0, f16 KV": lambda: llama("Q4_0", F16),
    }
    if args.only:
        kinds = {k: v for k, v in kinds.items() if any(o in k for o in args.only.split("|"))}
    specs = {k: make() for k, make in kinds.items()}
    pairs = [p for p in (("npuc fp32, f32 KV", "llama.cpp F32, f32 KV"), ("npuc fp32, f16 KV", "llama.cpp F32, f16 KV"),
                         ("npuc w4a8, f16 KV", "llama.cpp Q4_0, f16 KV")) if p[0] in specs and p[1] in specs]
    read_bytes, _ = B.decode_read_bytes(ckpt)
    bw = B.read_bandwidth_gbps(1024 << 20)
    cfg = json.loads((ckpt / "config.json").read_text())
    kv_row = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": B.machine(), "threads": args.threads,
                           "bandwidth_gbps": bw, "weight_read_bytes": read_bytes, "kv_elems_per_token": kv_row,
                           "depths": {}, "new": args.new, "rounds": args.rounds}
    ids_file.write_text(json.dumps(ids))
    for d in depths:
        turns = in_turn(specs, ids_file, "depth", d, args.new, args.threads, args.rounds)
        res["depths"][str(d)] = {n: [len(t["steps"]) / sum(t["steps"]) for t in ts] for n, ts in turns.items()}
        (work / "long.json").write_text(json.dumps(res, indent=2))
    ids_file.write_text(json.dumps(ids[:PREFILL]))
    pre_specs: dict[str, dict[str, Any]] = {k: specs[k] for k in ("npuc fp32, f32 KV", "llama.cpp F32, f16 KV", "npuc w4a8, f16 KV",
                                       "llama.cpp Q4_0, f16 KV") if k in specs}
    turns = in_turn(pre_specs, ids_file, "prefill", 0, 0, args.threads, args.prefill_rounds)
    res["prefill"] = {n: [t["prefill"] for t in ts] for n, ts in turns.items()}
    res["pairs"] = pairs
    (work / "long.json").write_text(json.dumps(res, indent=2))
    B.write_section(Path(args.out), BEGIN, END, render(res))
    print(f"[long] wrote {args.out}", file=sys.stderr)


def render(res: dict[str, Any]) -> str:
    med = statistics.median
    bw = res["bandwidth_gbps"]
    lines = [BEGIN, "## Long contexts", "",
             f"bench/long_context.py ({res['date']}, {res['machine']}, {res['threads']} threads): the 125M Llama "
             f"compiled with `--input_shape input_ids:1,{PREFILL} --max_seq_len {MAX_SEQ}`; decode of {res['new']} "
             f"tokens at each depth, every system in turn over {res['rounds']} rounds (tokens/s: the median over "
             "rounds; ratios: the median of the per-round ratios). llama.cpp with flash attention on unless a row "
             "says otherwise. Bound: (weights read per step + the cache bytes read at that depth) / "
             f"{bw:.1f} GB/s measured read bandwidth.", ""]
    depths = list(res["depths"])
    names = list(res["depths"][depths[0]])
    lines += ["| system | " + " | ".join(f"depth {d} tok/s" for d in depths) + " |",
              "|---|" + "---|" * len(depths)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{med(res['depths'][d][n]):.1f}" for d in depths) + " |")
    lines += ["", "| npuc vs llama.cpp, same weights and KV precision | "
              + " | ".join(f"depth {d}" for d in depths) + " |", "|---|" + "---|" * len(depths)]
    for a, b in res["pairs"]:
        cells = []
        for d in depths:
            ta, tb = res["depths"][d][a], res["depths"][d][b]
            cells.append(f"{med(x / y for x, y in zip(ta, tb, strict=True)):.2f}x")
        lines.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    lines += ["", "fp32 weights, step time against the bandwidth bound:", "",
              "| depth | KV | step (ms) | bytes read (MB) | bound (ms) | share of bound |", "|---|---|---|---|---|---|"]
    for d in depths:
        for n, elem in (("npuc fp32, f32 KV", 4), ("npuc fp32, f16 KV", 2)):
            if n not in res["depths"][d]:
                continue
            step = 1e3 / med(res["depths"][d][n])
            nbytes = res["weight_read_bytes"] + res["kv_elems_per_token"] * elem * (int(d) + 1)
            bound = 1e3 * nbytes / (bw * 1e9)
            lines.append(f"| {d} | {n.split(', ')[1]} | {step:.2f} | {nbytes / 1e6:.0f} | {bound:.2f} | "
                         f"{100 * bound / step:.0f}% |")
    pre = res["prefill"]
    lines += ["", f"Prefill of {PREFILL} tokens (to the first token), in turn over {len(next(iter(pre.values())))} "
              "rounds:", "", "| system | time (s) |", "|---|---|"]
    for n, ts in pre.items():
        lines.append(f"| {n} | {med(ts):.2f} |")
    for a, b in (("npuc fp32, f32 KV", "llama.cpp F32, f16 KV"), ("npuc w4a8, f16 KV", "llama.cpp Q4_0, f16 KV")):
        if a not in pre or b not in pre:
            continue
        r = med(x / y for x, y in zip(pre[a], pre[b], strict=True))
        lines.append(f"\n{a} / {b}: {r:.2f}x the time (target <= 1.0x: {'met' if r <= 1.0 else 'missed'}).")
    d4 = "4096"
    if d4 in res["depths"]:
        lines.append("")
        for a, b in res["pairs"]:
            ta, tb = res["depths"][d4][a], res["depths"][d4][b]
            r = med(x / y for x, y in zip(ta, tb, strict=True))
            lines.append(f"Decode at depth 4096, {a} / {b}: {r:.2f}x (target >= 1.0x: {'met' if r >= 1.0 else 'missed'}).")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
