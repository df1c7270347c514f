"""The C executor (libnpucrt) against the Python runtime it replaces, timed in turn.

    python bench/native_ab.py --work /tmp/nab [--quick] [--out docs/native-bench.json]

Models (random init, built once in --work):
    125M    Llama 768 wide, 12 layers (bench/run.py's FULL), in fp32, bf16, w8a16, w4a16
    small   Llama 256 wide, 4 layers: where dispatch, not the kernels, sets the step time
    dsv3    DeepSeek-V3-shaped, ~225M: 6 layers, 1024 wide, MLA, 16 routed experts top-4 in 4
            groups (2 kept, as V3's 8/4) + 1 shared, fp32, against HF transformers (eager, static
            cache). (With n_group 1, as DeepSeek-V2-Lite, moe-fusion finds no routed-experts
            combine today and the experts run unfused: a fusion gap, left for later.)

Figures, each the median of `reps` runs, A and B alternating:
    decode tokens/s and prefill ms: the Python runtime (runtime/session.py with its native
      kernels through ctypes: what every command ran before) against the C executor, both
      driven from Python (npuc.load's NativeSession), and the C command (`npucrt generate
      --timing`) alone;
    start-up: a whole process from exec to its first token (wall time of a 1-token
      generate, page cache warm): the C command, `npuc generate`, and `npuc generate`
      on the torch interpreter (NPUC_EXECUTOR=torch: today's), with prefill beside;
    per-op overhead: a decode step's time minus its kernels' own (the session's profile);
    memory: the C command's peak RSS less the bytes it maps and allocates by plan
      (weights, arena, state, packed prefill weights, scratch);
    dsv3's share of the bandwidth bound: bytes a token reads (the weights it activates:
      attention, the dense FFN, the shared expert and 4 routed experts a layer, the LM head,
      plus the latent cache) over the step time, against the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def build_cli(work: Path) -> Path:
    """The C command, built with CMake from npucrt/ (Release, -march=native)."""
    build = work / "npucrt-build"
    exe = build / "npucrt"
    subprocess.run(["cmake", "-S", str(ROOT / "npucrt"), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)
    subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
    return exe


def llama(work: Path, name: str, hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> Path:
    import torch
    import transformers

    path = work / name
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                                       max_position_embeddings=2048, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    return path


def dsv3(work: Path) -> Path:
    import torch
    import transformers

    path = work / "dsv3g"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        cfg = transformers.DeepseekV3Config(
            hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            intermediate_size=2816, moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=4,
            n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, vocab_size=32000,
            max_position_embeddings=2048, tie_word_embeddings=False, rope_scaling=None)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # routers away from ties
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        model.save_pretrained(str(path))
    return path


def compile_om(ckpt: Path, out: Path, prompt: int, max_len: int, **opts: Any) -> Path:
    from npuc.compiler.driver import compile_model

    om = out.with_suffix(".om")
    if not om.is_file():
        compile_model(str(ckpt), input_shape=f"input_ids:1,{prompt}", max_seq_len=max_len, output=str(out),
                      soc_version="cpu", **opts)
    return om


def prompt_ids(n: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(3, vocab, n)]


def py_measure(sess: Any, ids: list[int], new: int) -> tuple[float, float, list[int]]:
    """(prefill s, decode tokens/s, tokens) of one greedy run through apps/generate."""
    from npuc.apps.generate import steps

    t0 = time.perf_counter()
    gen = steps(sess, ids, new, ignore_eos=True, keep_logits=False)
    tokens, first, t_first = [], 0.0, 0.0
    for i, (tok, _) in enumerate(gen):
        if i == 0:
            t_first = time.perf_counter()
            first = t_first - t0
        tokens.append(tok)
    t_end = time.perf_counter()
    return first, (len(tokens) - 1) / (t_end - t_first), tokens


def cli_measure(exe: Path, om: Path, ids: list[int], new: int, threads: int) -> dict[str, float]:
    r = subprocess.run([str(exe), "generate", str(om), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
                        str(new), "--ignore-eos", "--threads", str(threads), "--timing"],
                       capture_output=True, text=True, check=True)
    # "npucrt: load L ms, first token F ms after start, prefill P ms, decode N tokens in D ms (T tokens/s)"
    import re

    m = re.search(r"load ([0-9.]+) ms, first token ([0-9.]+) ms after start, prefill ([0-9.]+) ms, decode ([0-9]+) "
                  r"tokens in ([0-9.]+) ms \(([0-9.]+) tokens/s\)", r.stderr)
    assert m, r.stderr
    return {"load_ms": float(m[1]), "first_ms": float(m[2]), "prefill_ms": float(m[3]), "tok_s": float(m[6]),
            "tokens": [int(t) for t in r.stdout.split()]}


def wall(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds of a whole process, and its own peak RSS in KiB (wait4's accounting)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return dt, int(usage.ru_maxrss)


MEMORY_PROBE = r"""
import re, sys, numpy as np
def anon():
    return sum(int(ln.split()[1]) for ln in open("/proc/self/smaps") if ln.startswith("Anonymous:")) * 1024
from npuc.runtime.native_session import NativeSession, runtime_library
runtime_library()
before = anon()
s = NativeSession(sys.argv[1], threads=2)
p = s.programs["prefill"]
feeds = {t.name: np.zeros(t.shape, dtype=t.np_dtype) for t in p.inputs}
s.run(feeds, "prefill")
for i in range(4):
    s.run({"input_ids": np.array([[5]]), "position": np.array([130 + i])}, "decode")
grew = anon() - before
planned = s.arena_bytes + s.state_bytes + s.extra_bytes
print(grew, planned, s.extra_bytes, int("torch" in sys.modules))
"""


def memory_beyond_plan(om: Path) -> dict[str, int]:
    """The C executor's anonymous memory after a prefill and 4 decode steps, in a process
    that imports no torch, against what it allocates by plan (arena, state, packed weights,
    scratch): what the runtime itself costs beyond the mapped weights and its plan."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(om)], capture_output=True, text=True, check=True)
    grew, planned, extra, torch_loaded = map(int, out.stdout.split())
    assert not torch_loaded
    return {"anon_grew": grew, "planned": planned, "packed_and_scratch": extra, "beyond": grew - planned}


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def ab_speed(om: Path, ids: list[int], new: int, reps: int, threads: int, exe: Path) -> dict[str, Any]:
    """Python runtime vs C executor (from Python) vs the C command, in turn."""
    from npuc.runtime.native_session import NativeSession
    from npuc.runtime.session import Session

    old, c = Session.load(str(om)), NativeSession(str(om), threads=threads)
    py_measure(old, ids, 4)
    py_measure(c, ids, 4)
    res: dict[str, list[float]] = {k: [] for k in ("old_pf", "old_tps", "c_pf", "c_tps", "cli_pf", "cli_tps")}
    tokens = {}
    for _ in range(reps):
        pf, tps, tokens["old"] = py_measure(old, ids, new)
        res["old_pf"].append(pf)
        res["old_tps"].append(tps)
        pf, tps, tokens["c"] = py_measure(c, ids, new)
        res["c_pf"].append(pf)
        res["c_tps"].append(tps)
        cli = cli_measure(exe, om, ids, new, threads)
        res["cli_pf"].append(cli["prefill_ms"] / 1e3)
        res["cli_tps"].append(cli["tok_s"])
        tokens["cli"] = cli["tokens"]
    # per-op overhead of a decode step: its time less its kernels' own (the session's profile)
    c.profile(True)
    feeds = {"input_ids": np.zeros((1, 1), dtype=np.int64), "position": np.array([len(ids)], dtype=np.int64)}
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        c.run(feeds, "decode", copy_outputs=False)
    step = (time.perf_counter() - t0) / n
    kernel_ns, runs = c.profile_read("decode")
    c.profile(False)
    kernels = kernel_ns / max(runs, 1) / 1e9
    out = {k: median(v) for k, v in res.items()}
    out.update({"same_tokens": tokens["old"] == tokens["c"] == tokens["cli"][:len(tokens["c"])],
                "step_ms": step * 1e3, "kernels_ms": kernels * 1e3, "overhead_ms": (step - kernels) * 1e3,
                "extra_bytes": c.extra_bytes, "arena": c.arena_bytes, "state": c.state_bytes,
                "weights": c.weights_bytes})
    return out


def startup(om: Path, ids: list[int], reps: int, threads: int, exe: Path) -> dict[str, Any]:
    """Whole processes to their first token (1 new token), in turn, page cache warm."""
    prompt = ",".join(map(str, ids))
    env = dict(os.environ)
    cmds = {
        "c": [str(exe), "generate", str(om), "--prompt-ids", prompt, "--max-new-tokens", "1", "--threads",
              str(threads)],
        "npuc": [sys.executable, "-m", "npuc", "generate", str(om), "--prompt-ids", prompt, "--max-new-tokens", "1"],
        "today": [sys.executable, "-m", "npuc", "generate", str(om), "--prompt-ids", prompt, "--max-new-tokens", "1"],
    }
    if "--no-verify" in subprocess.run([str(exe), "generate", "--help"], capture_output=True, text=True).stdout:
        cmds["c_noverify"] = [*cmds["c"], "--no-verify"]
    envs = {"c": env, "c_noverify": env, "npuc": {**env, "NPUC_EXECUTOR": "native"},
            "today": {**env, "NPUC_EXECUTOR": "torch"}}
    for k in cmds:
        wall(cmds[k], envs[k])  # warm the page cache and the built library
    times: dict[str, list[float]] = {k: [] for k in cmds}
    rss: dict[str, int] = {}
    for _ in range(reps):
        for k in cmds:
            dt, peak = wall(cmds[k], envs[k])
            times[k].append(dt)
            if peak > 0:
                rss[k] = max(rss.get(k, 0), peak)
    return {"wall_s": {k: median(v) for k, v in times.items()}, "peak_rss_kib": rss}


def hf_decode(ckpt: Path, ids: list[int], new: int, reps: int) -> float:
    import torch
    import transformers
    from transformers import StaticCache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    rates = []
    with torch.no_grad():
        for _ in range(reps):
            cache = StaticCache(config=model.config, max_cache_len=len(ids) + new + 1)
            out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                        cache_position=torch.arange(len(ids)))
            tok = int(out.logits[0, -1].argmax())
            t0 = time.perf_counter()
            for i in range(new - 1):
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([len(ids) + i]))
                tok = int(out.logits[0, -1].argmax())
            rates.append((new - 1) / (time.perf_counter() - t0))
    return median(rates)


def dsv3_bytes_per_token(ckpt: Path, depth: int) -> int:
    """Bytes a decode step reads at `depth` cached positions: the weights one token activates
    (every non-expert weight but the embedding table, whose one row is read; the shared expert
    and top-k of the routed experts per MoE layer) and the latent cache."""
    import json as _json

    from safetensors import safe_open

    cfg = _json.loads((ckpt / "config.json").read_text())
    k, e = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    total = 0
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                n = int(np.prod(st.get_slice(name).get_shape())) * 4
                if "embed_tokens" in name:
                    total += cfg["hidden_size"] * 4
                elif ".experts." in name and "shared" not in name:
                    total += n * k // e
                else:
                    total += n
    latent = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4 * depth
    return total + latent


def bandwidth_gbps() -> float:
    from run import read_bandwidth_gbps  # bench/run.py's probe: the best reader of a big buffer

    return float(read_bandwidth_gbps(1 << 30))


def render(r: dict[str, Any], machine: str) -> str:
    """The report's section for docs/benchmarks.md."""
    from run import NATIVE_BEGIN, NATIVE_END

    def row(name: str, x: dict[str, Any]) -> str:
        return (f"| {name} | {x['old_tps']:.1f} | {x['c_tps']:.1f} | {x['cli_tps']:.1f} | "
                f"**{x['cli_tps'] / x['old_tps']:.2f}x** | {1e3 * x['old_pf']:.1f} | {1e3 * x['c_pf']:.1f} | "
                f"{1e3 * x['cli_pf']:.1f} | {x['old_pf'] / x['cli_pf']:.2f}x | {x['step_ms']:.2f} | "
                f"{x['overhead_ms']:.3f} | {'yes' if x['same_tokens'] else 'NO'} |")

    lines = [NATIVE_BEGIN, "", "## The native runtime (libnpucrt) against the Python runtime", "",
             f"Generated by `python bench/native_ab.py` ({machine}; {r['threads']} threads). Each figure is the "
             "median of the runs, the systems timed in turn. *Python runtime*: runtime/session.py with its native "
             "kernels through ctypes, what every command ran before this runtime; *C from Python*: the C executor "
             "driven by npuc's Python loop (`npuc.load`, apps/generate); *C command*: `npucrt generate --timing`. "
             "The first token is prefill's. Overhead: a decode step's time (C from Python, 50 steps) less its "
             "kernels' own time (the session's profile): the executor's dispatch and the Python loop.", "",
             "| model | Python runtime tok/s | C from Python tok/s | C command tok/s | decode C/Python | Python "
             "prefill ms | C from Python prefill ms | C command prefill ms | prefill Python/C | step ms | "
             "overhead ms | same tokens |", "|" + "---|" * 12]
    names = {"small": "Llama 4 x 256 (dispatch-bound), fp32", "125m_f32": "Llama 125M fp32",
             "125m_bf16": "Llama 125M bf16", "125m_w8a16": "Llama 125M w8a16", "125m_w4a16": "Llama 125M w4a16",
             "dsv3": "DeepSeek-V3-shaped 225M fp32"}
    lines += [row(names[k], r[k]) for k in names if k in r]
    if "dsv3" in r:
        d = r["dsv3"]
        lines += ["", f"DeepSeek-V3-shaped (6 layers, 1024 wide, MLA with kv_lora_rank 256, 16 routed experts top-4 "
                  f"in 4 groups of which 2 are kept, and a shared expert, about 225M parameters; prompt 128, fp32): the C command decodes "
                  f"{d['cli_tps']:.1f} tokens/s, HF transformers (eager, static cache) {d['hf_tok_s']:.2f}: "
                  f"**{d['cli_tps'] / d['hf_tok_s']:.2f}x HF** (target 2.5x; the Python runtime, on torch's "
                  f"mla_attention and fused_moe, was {d['old_tps'] / d['hf_tok_s']:.2f}x). A step reads "
                  f"{d['bytes_per_token'] / 1e6:.0f} MB (the weights one token activates, with 4 of 16 routed "
                  f"experts, and the latent cache), so it runs at {d['bytes_per_token'] * d['cli_tps'] / 1e9:.1f} "
                  f"GB/s, **{100 * d['bound_share']:.0f}% of the {d['bandwidth_gbps']:.1f} GB/s** this machine "
                  "reads at (bench/run.py's probe)."]
    if "startup_125m" in r:
        st = r["startup_125m"]
        w, pf = st["wall_s"], st["prefill_ms"]
        lines += ["", "Start-up, Llama 125M fp32 (500 MB of weights), page cache warm: a whole process from exec "
                  "to its first token (a 1-token generate, wall time), in turn:", "",
                  "| process | first token s | minus prefill ms | target |", "|---|---|---|---|",
                  f"| `npucrt generate` (C) | {w['c']:.3f} | {1e3 * w['c'] - pf:.0f} | prefill + 50 ms |",
                  f"| `npuc generate` (C executor) | {w['npuc']:.3f} | {1e3 * w['npuc'] - pf:.0f} | prefill + 500 ms |",
                  f"| `npuc generate`, torch interpreter (before) | {w['today']:.3f} | {1e3 * w['today'] - pf:.0f} "
                  "| |", "", f"Prefill (128 tokens) alone: {pf:.0f} ms."]
        if "c_noverify" in w:
            lines += [f"The C command without the SHA-256 of every weight byte (`--no-verify`): "
                      f"{w['c_noverify']:.3f} s, {1e3 * w['c_noverify'] - pf:.0f} ms over prefill."]
        if "memory_125m" in r and "125m_f32" in r:
            mm, x = r["memory_125m"], r["125m_f32"]
            lines += ["", f"Memory (Llama 125M fp32): after a prefill and 4 decode steps, in a process without torch, "
                      f"the C executor's anonymous memory grew by {mm['anon_grew'] / 2**20:.1f} MiB, of which its "
                      f"arena, state ({(x['arena'] + x['state']) / 2**20:.1f} MiB), prefill's packed weights and scratch "
                      f"({mm['packed_and_scratch'] / 2**20:.1f} MiB) are the plan: **{mm['beyond'] / 2**20:.1f} MiB** "
                      f"beyond it (target under 20 MB); the weights ({x['weights'] / 2**20:.0f} MiB) stay in the "
                      "file's mapping, shared with the page cache. The packed copy is the largest cost of all: "
                      "prefill's GEMM wants its weights in 16-column panels (docs/performance.md)."]
            if st.get("peak_rss_kib", {}).get("c"):
                lines += [f"The C command's whole peak RSS for a 1-token generate: "
                          f"{st['peak_rss_kib']['c'] / 1024:.0f} MiB."]
    lines += ["", NATIVE_END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default=None, help="the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="small models only, 2 reps: a smoke check")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc", default=None, help="write the section into this report (docs/benchmarks.md)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(args.threads)
    exe = build_cli(work)
    reps = 2 if args.quick else 5
    report: dict[str, Any] = {"threads": args.threads}
    small = llama(work, "small", 256, 4, 8, 4, 512, 4000)
    om = compile_om(small, work / "small_f32", 32, 128)
    report["small"] = ab_speed(om, prompt_ids(32, 4000), 64, reps, args.threads, exe)
    print("small", report["small"], flush=True)
    if not args.quick:
        big = llama(work, "125m", 768, 12, 12, 4, 2048, 32000)
        ids = prompt_ids(128, 32000)
        for mode, opts in (("f32", {}), ("bf16", {"precision_mode": "allow_mix_precision_bf16"}),
                           ("w8a16", {"quant_type": "w8a16"}), ("w4a16", {"quant_type": "w4a16"})):
            om = compile_om(big, work / f"125m_{mode}", 128, 256, **opts)
            report[f"125m_{mode}"] = ab_speed(om, ids, 64, reps, args.threads, exe)
            print(mode, report[f"125m_{mode}"], flush=True)
        om = compile_om(big, work / "125m_f32", 128, 256)
        report["startup_125m"] = startup(om, ids, reps, args.threads, exe)
        report["startup_125m"]["prefill_ms"] = report["125m_f32"]["cli_pf"] * 1e3
        report["memory_125m"] = memory_beyond_plan(om)
        print("startup", report["startup_125m"], flush=True)
        ds = dsv3(work)
        om = compile_om(ds, work / "dsv3g_f32", 128, 256)
        ids = prompt_ids(128, 32000)
        r = ab_speed(om, ids, 32, reps, args.threads, exe)
        r["hf_tok_s"] = hf_decode(ds, ids, 32, reps)
        r["bytes_per_token"] = dsv3_bytes_per_token(ds, 128 + 16)
        r["bandwidth_gbps"] = bandwidth_gbps()
        r["bound_share"] = r["bytes_per_token"] * r["cli_tps"] / (r["bandwidth_gbps"] * 1e9)
        report["dsv3"] = r
        print("dsv3", r, flush=True)
    text = json.dumps(report, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if args.doc:
        from run import NATIVE_BEGIN, NATIVE_END, machine, write_section

        write_section(Path(args.doc), NATIVE_BEGIN, NATIVE_END, render(report, f"{machine()}, {time.strftime('%Y-%m-%d')}"))

if __name__ == "__main__":
    main()
