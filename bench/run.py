"""npuc's benchmarks, each figure next to its peer's from the same run.

    pip install -e ".[bench]"
    python bench/run.py --quick            # < 3 minutes: small models, a smoke check of the harness
    python bench/run.py                    # the full run; writes docs/benchmarks.md and docs/bench-*.png
    python bench/run.py --quant-only       # the quantized decode and its peers alone, into a temp file

Decode and prefill: a Llama-shaped model built from a config (random weights,
nothing downloaded), run by `npuc` (the .om's prefill + decode programs), by HF
transformers (eager, a static cache), and by onnxruntime (an ONNX export with
explicit KV-cache inputs and outputs, bench/ort_llama.py), all with the same
thread count, all greedy, and checked to produce the same tokens; npuc's and
onnxruntime's prefill are also timed in turn (bench/prefill_ab.py). Quantized decode
(bench/quant_bench.py): npuc's --quant_type modes beside onnxruntime's MatMulNBits,
llama.cpp's GGUF Q8_0, Q4_0 and Q4_K_M (bench/llamacpp.py) and OpenVINO GenAI's int8 and
int4 exports (bench/openvino_peer.py), the last two in venvs of their own
(bench/setup_llamacpp.sh, bench/setup_openvino.sh: --llamacpp-python, --openvino-python),
left out with a note where not given. Memory plans:
every program of every test architecture, with ExecuTorch's planner on the same
torch.export program where an ExecuTorch environment is given. Compile at scale:
bench/compile_scale.py. Pass scaling: the optimiser alone at 8, 16, 32 layers. Decode over
several slots: bench/batch_decode.py.

Benchmarks are not tests: targets are printed beside the figures, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    prompt: int
    new: int
    reps: int

    @property
    def max_len(self) -> int:
        return -(-(self.prompt + self.new) // 16) * 16


FULL = Sizes(hidden=768, layers=12, heads=12, kv_heads=4, inter=2048, vocab=32000, prompt=128, new=64, reps=5)
QUICK = Sizes(hidden=256, layers=4, heads=8, kv_heads=4, inter=512, vocab=4000, prompt=32, new=16, reps=2)


def llama_checkpoint(s: Sizes, path: Path, seed: int = 0) -> Path:
    import transformers

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.inter,
        vocab_size=s.vocab,
        max_position_embeddings=max(2048, s.max_len),
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    return path


def prompt_ids(s: Sizes) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, s.vocab, (s.prompt,), generator=g).tolist()


def prefill_feed(sess: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """The prefill's inputs: the ids and, where the program takes it (compiled with
    `--prefill_logits last`: apps/generate.py's LAST_TOKEN), the row to compute logits for."""
    feed = {"input_ids": torch.tensor([ids])}
    if any(t.name == "last_token" for t in sess.programs["prefill"].inputs):
        feed["last_token"] = torch.tensor([len(ids) - 1])
    return feed


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))]


def decode_stats(name: str, tokens: list[int], steps: list[float], prefill: list[float]) -> dict[str, Any]:
    return {
        "system": name,
        "tokens": tokens,
        "tok_per_s": len(steps) / sum(steps),
        "steps_ms": [1e3 * x for x in steps],
        "p50_ms": 1e3 * pct(steps, 50),
        "p99_ms": 1e3 * pct(steps, 99),
        "prefill_ms": 1e3 * statistics.median(prefill),
    }


# -- the three systems ------------------------------------------------------------------------------

# npuc's configurations: (row label, --soc_version, --precision_mode)
NPUC_SYSTEMS = [
    ("npuc (--soc_version cpu)", "cpu", "must_keep_origin_dtype"),
    ("npuc (default target npu: 16-row tiles)", "npu", "must_keep_origin_dtype"),
    ("npuc (cpu, allow_mix_precision_bf16)", "cpu", "allow_mix_precision_bf16"),
]


def run_npuc(
    ckpt: Path,
    s: Sizes,
    work: Path,
    label: str = NPUC_SYSTEMS[0][0],
    soc: str = "cpu",
    precision: str = "must_keep_origin_dtype",
    quant_type: str | None = None,
) -> dict[str, Any]:
    from npuc.apps.generate import steps as gen_steps
    from npuc.compiler.driver import compile_model
    from npuc.runtime import Session

    t0 = time.perf_counter()
    om = compile_model(
        str(ckpt),
        input_shape=f"input_ids:1,{s.prompt}",
        output=str(work / f"npuc_{soc}_{precision}{'_' + quant_type if quant_type else ''}"),
        max_seq_len=s.max_len,
        soc_version=soc,
        precision_mode=precision,
        quant_type=quant_type,
    )
    compile_s = time.perf_counter() - t0
    sess = Session.load(om)
    ids = prompt_ids(s)
    prefill = []
    feed = prefill_feed(sess, ids)
    for _ in range(s.reps):
        t0 = time.perf_counter()
        sess.run(feed, "prefill", copy_outputs=False)
        prefill.append(time.perf_counter() - t0)
    tokens, steps = [], []
    gen = gen_steps(sess, ids, s.new, ignore_eos=True, keep_logits=False)
    t0 = time.perf_counter()
    for i, (tok, _) in enumerate(gen):
        t1 = time.perf_counter()
        if i > 0:  # the first token comes from prefill
            steps.append(t1 - t0)
        tokens.append(tok)
        t0 = time.perf_counter()
    out = decode_stats(label, tokens, steps, prefill)
    out["compile_s"] = compile_s
    out["om"] = om
    out["bytes"] = os.path.getsize(om)
    out["profile"] = decode_profile(sess, s)
    out["kernels"] = dict(sess.launchers.kinds)
    return out


def run_hf(ckpt: Path, s: Sizes) -> dict[str, Any]:
    import transformers
    from transformers import StaticCache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids(s)])
    prefill = []
    with torch.no_grad():
        for _ in range(s.reps):  # prefill latency: one eager forward, no cache
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            prefill.append(time.perf_counter() - t0)
        cache = StaticCache(config=model.config, max_cache_len=s.max_len)
        out = model(
            input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(s.prompt)
        )
        tok = int(out.logits[0, -1].argmax())
        tokens, steps = [tok], []
        for i in range(s.new - 1):
            t0 = time.perf_counter()
            out = model(
                input_ids=torch.tensor([[tok]]),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([s.prompt + i]),
            )
            tok = int(out.logits[0, -1].argmax())
            steps.append(time.perf_counter() - t0)
            tokens.append(tok)
    return decode_stats("HF transformers (eager, static cache)", tokens, steps, prefill)


def run_ort(ckpt: Path, s: Sizes, work: Path, threads: int) -> dict[str, Any]:
    import transformers
    from ort_llama import OrtLlama, export_llama_kv

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    pre, dec = export_llama_kv(model, str(work / "ort"), s.prompt, s.max_len)
    del model
    tokens, steps, prefill = OrtLlama(pre, dec, threads).measure(prompt_ids(s), s.new, s.reps)
    return decode_stats("onnxruntime (KV-cache export)", list(tokens), list(steps), prefill) | {
        "models": [pre, dec]
    }


def read_bandwidth_gbps(nbytes: int) -> float:
    """Memory read bandwidth: the best of five full reads of a buffer far larger than the
    caches, each by a sum, a matrix-vector product (torch's) and npuc's native GEMV (what
    decode does, where the native kernels build): whichever reads fastest. The bound is
    then what the best reader measured here achieves, not a datasheet figure."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    m = t.view(-1, 1024)
    v = torch.ones(1024)
    y = torch.empty(m.shape[0])
    probes = [t.sum, lambda: torch.mv(m, v)]
    from npuc.runtime import native

    lib = native.library()
    if lib is not None:
        probes.append(
            lambda: lib.npuc_linear_f32(
                v.data_ptr(),
                1,
                1024,
                m.data_ptr(),
                0,
                m.shape[0],
                1024,
                None,
                y.data_ptr(),
                m.shape[0],
                torch.get_num_threads(),
            )
        )
    best = float("inf")
    for fn in probes:
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def decode_read_bytes(ckpt: Path) -> tuple[int, int]:
    """(bytes every fp32 decode step reads, of which matrix weights): every weight but the
    input embedding table, of which a step reads one row (unless it is tied to the LM head)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt))
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(p.numel() for p in model.parameters()) * 4
    return total - (0 if tied else emb.numel() * 4 - emb.shape[1] * 4), total


def decode_profile(sess: Any, s: Sizes) -> list[tuple[str, float]]:
    """Share of a decode step's time per op type (timed between the runtime's per-op callbacks)."""
    from collections import defaultdict

    share: dict[str, float] = defaultdict(float)
    last = [0.0]

    def tick(name: str, op: str, outs: list[torch.Tensor]) -> None:
        now = time.perf_counter()
        share[op] += now - last[0]
        last[0] = now

    step = {"input_ids": torch.tensor([[5]]), "position": torch.tensor([s.prompt])}
    for _ in range(10):
        last[0] = time.perf_counter()
        sess.run(step, "decode", copy_outputs=False, on_step=tick)
    total = sum(share.values())
    return sorted(((k, v / total) for k, v in share.items()), key=lambda kv: -kv[1])


def run_quant(
    ckpt: Path,
    s: Sizes,
    work: Path,
    threads: int,
    llamacpp_python: str | None,
    fp32_tokens: list[int],
    openvino_python: str | None = None,
) -> dict[str, Any]:
    """npuc's quantized modes beside onnxruntime's MatMulNBits, llama.cpp and OpenVINO GenAI
    (bench/quant_bench.py). A mode with int8 activations that does not compile or load here
    is left out with a note; a peer that fails is left out with a note too."""
    import quant_bench as qb

    rows, notes = [], []
    ids = prompt_ids(s)
    for label, qtype, _ in qb.QUANT_SYSTEMS:
        print(f"[bench] {label}", file=sys.stderr)
        try:
            r = run_npuc(ckpt, s, work, label, "cpu", quant_type=qtype)
        except Exception as e:
            if qtype not in qb.OPTIONAL_MODES:
                raise
            notes.append(
                f"{label} left out: it did not compile or run here ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
            )
            continue
        rows.append(
            {
                k: r[k]
                for k in ("system", "tokens", "tok_per_s", "steps_ms", "p50_ms", "prefill_ms", "bytes", "om")
            }
        )
    print("[bench] onnxruntime MatMulNBits", file=sys.stderr)
    o = qb.run_ort_nbits(ckpt, s, work, threads, ids)
    rows.append(
        qb.stats(qb.ORT_LABEL, o["tokens"], o["steps"], o["prefill"])
        | {"bytes": o["bytes"], "models": o["models"]}
    )
    if llamacpp_python:
        for qtype in qb.LLAMACPP_TYPES:
            print(f"[bench] llama.cpp {qtype}", file=sys.stderr)
            try:
                r = qb.run_llamacpp(llamacpp_python, ckpt, qtype, work, ids, s.new, threads, s.reps)
            except RuntimeError as e:
                notes.append(f"llama.cpp {qtype} left out: {str(e)[-300:]}")
                print(f"[bench] llama.cpp {qtype} failed: {e}", file=sys.stderr)
                continue
            rows.append(
                qb.stats(qb.llamacpp_label(qtype), r["tokens"], r["steps"], r["prefill"])
                | {
                    "bytes": r["gguf_bytes"],
                    "version": r["version"],
                    "gguf": r["gguf"],
                    "python": llamacpp_python,
                    "tensor_types": r.get("tensor_types"),
                }
            )
    else:
        notes.append("llama.cpp not run: give --llamacpp-python (a venv from bench/setup_llamacpp.sh)")
    if openvino_python:
        for fmt in qb.OPENVINO_TYPES:
            print(f"[bench] OpenVINO GenAI {fmt}", file=sys.stderr)
            try:
                r = qb.run_openvino(openvino_python, ckpt, fmt, work, ids, s.new, threads, s.reps)
            except RuntimeError as e:
                notes.append(f"OpenVINO GenAI {fmt} left out: {str(e)[-300:]}")
                print(f"[bench] OpenVINO GenAI {fmt} failed: {e}", file=sys.stderr)
                continue
            rows.append(
                qb.stats(qb.openvino_label(fmt), r["tokens"], r["steps"], r["prefill"])
                | {
                    "bytes": r["bytes"],
                    "version": r["version"],
                    "ov_model": r["model"],
                    "python": openvino_python,
                    "cpu_defaults": r.get("cpu_defaults"),
                }
            )
    else:
        notes.append("OpenVINO GenAI not run: give --openvino-python (a venv from bench/setup_openvino.sh)")
    return {"rows": rows, "notes": notes, "fp32_tokens": fp32_tokens}


# -- compile time -----------------------------------------------------------------------------------


def _child(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a fresh child process (os.wait4: its own rusage)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"{cmd} failed: {p.stderr.read().decode()[-500:] if p.stderr else ''}")
    return wall, ru.ru_maxrss * 1024


def compile_vs_load(ckpt: Path, s: Sizes, work: Path, reps: int) -> dict[str, Any]:
    """`npuc compile` of the HF folder with --max_seq_len 256 (prefill + decode + tables), and
    `AutoModelForCausalLM.from_pretrained` of the same folder, each in a fresh process, in turn."""
    max_len = max(256, s.max_len)
    npuc_cmd = [
        sys.executable,
        "-m",
        "npuc",
        "compile",
        str(ckpt),
        "--input_shape",
        f"input_ids:1,{s.prompt}",
        "--max_seq_len",
        str(max_len),
        "--soc_version",
        "cpu",
        "--output",
        str(work / "compile_time"),
        "--log",
        "null",
    ]
    hf_cmd = [
        sys.executable,
        "-c",
        "import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])",
        str(ckpt),
    ]
    runs: dict[str, list[tuple[float, int]]] = {"npuc": [], "hf": []}
    for _ in range(reps):
        runs["npuc"].append(_child(npuc_cmd))
        runs["hf"].append(_child(hf_cmd))
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    return {
        "max_seq_len": max_len,
        "reps": reps,
        "npuc_s": med["npuc"],
        "from_pretrained_s": med["hf"],
        "ratio": med["npuc"] / med["hf"],
        "npuc_peak_rss": max(r for _, r in runs["npuc"]),
    }


# -- memory plans ---------------------------------------------------------------------------------


def memory_plans(work: Path, et_python: str | None, quick: bool) -> list[dict[str, Any]]:
    from hf_models import ARCHS, save_checkpoint

    from npuc.backend.memory_plan import align_up
    from npuc.compiler.driver import compile_model
    from npuc.tools.om_tools import _open

    rows = []
    prefill = 16 if quick else 64
    for arch in ARCHS:
        ck = work / f"plan_{arch}"
        if not ck.is_dir():
            save_checkpoint(arch, str(ck))
        om = compile_model(
            str(ck),
            input_shape=f"input_ids:1,{prefill}",
            output=str(work / f"plan_{arch}"),
            max_seq_len=prefill * 2,
        )
        et: dict[str, Any] = {}
        if et_python:
            r = subprocess.run(
                [et_python, str(ROOT / "bench/et_plan.py"), str(ck), str(prefill)],
                capture_output=True,
                text=True,
                timeout=900,
            )
            et = (
                json.loads(r.stdout.strip().splitlines()[-1])
                if r.returncode == 0
                else {"error": r.stderr[-300:]}
            )
        with _open(om, verify_weights=False) as (_, m):
            for prog in m.programs:
                pm = prog.plan
                no_reuse = sum(align_up(max(m.tensors[b.tensor].nbytes, 1), pm.alignment) for b in pm.buffers)
                rows.append(
                    {
                        "arch": arch,
                        "program": prog.name,
                        "arena": pm.arena_bytes,
                        "lower_bound": pm.lower_bound_bytes,
                        "no_reuse": no_reuse,
                        "executorch": et.get("arena_bytes") if prog.name == "prefill" else None,
                        "executorch_error": et.get("error") if prog.name == "prefill" else None,
                    }
                )
    return rows


# -- pass pipeline scaling ------------------------------------------------------------------------


def pass_scaling(work: Path, quick: bool) -> list[dict[str, Any]]:
    from npuc.compiler import instrument
    from npuc.compiler.driver import build_graph
    from npuc.passes.pipeline import default_pipeline

    rows = []
    for layers in (2, 4, 8) if quick else (8, 16, 32):
        s = Sizes(
            hidden=256, layers=layers, heads=8, kv_heads=4, inter=512, vocab=4000, prompt=128, new=1, reps=1
        )
        ck = llama_checkpoint(s, work / f"scale_{layers}")
        t0 = time.perf_counter()
        g, _ = build_graph(str(ck), "input_ids:1,128")
        t1 = time.perf_counter()
        nodes = len(g.nodes)
        instrument.run_pipeline(g, default_pipeline())
        t2 = time.perf_counter()
        rows.append(
            {
                "layers": layers,
                "nodes": nodes,
                "import_s": t1 - t0,
                "passes_s": t2 - t1,
                "us_per_node": 1e6 * (t2 - t1) / nodes,
            }
        )
    return rows


# -- the report -----------------------------------------------------------------------------------


def versions(et_python: str | None) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("npuc", "torch", "transformers", "onnxruntime", "onnx"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    out["executorch"] = "not run"
    if et_python:
        r = subprocess.run(
            [et_python, "-c", "import importlib.metadata as m; print(m.version('executorch'))"],
            capture_output=True,
            text=True,
        )
        out["executorch"] = r.stdout.strip() or "not installed"
    return out


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB memory, {platform.system()} {platform.release()}"


def fmt_b(n: Any) -> str:
    return "n/a" if n is None else f"{int(n):,}"


def share_of_bound(res: dict[str, Any], d: dict[str, Any]) -> float:
    return d["tok_per_s"] * d.get("read_bytes", res["read_bytes"]) / (res["bandwidth_gbps"] * 1e9)


def prefill_ratio(res: dict[str, Any]) -> float:
    """npuc (cpu target) / onnxruntime prefill: timed in turn where measured, else the phases' medians."""
    if res.get("prefill_turns"):
        return float(res["prefill_turns"]["ratio"])
    d = systems(res)
    return float(d["cpu"]["prefill_ms"] / d["ort"]["prefill_ms"])


def in_turn(res: dict[str, Any], ckpt: Path, s: Sizes, threads: int, rounds: int) -> dict[str, Any]:
    """Every decode system of the run (npuc's .om files, HF, onnxruntime's exports, fp32 and
    quantized) generating in turn (bench/decode_ab.py); each row's tokens/s, P50 and P99
    then come from there, its phase's own figures kept under "phase", and its prefill in
    turn (the prompt to its first token, the median over rounds) under "prefill_turn_ms"."""
    import decode_ab

    rows = res["decode"] + (res["quant"]["rows"] if res.get("quant") else [])
    specs: dict[str, tuple[str, list[str], str | None]] = {}
    for d in rows:
        if d.get("om"):
            specs[d["system"]] = ("npuc", [str(d["om"])], None)
        elif d["system"].startswith("HF"):
            specs[d["system"]] = ("hf", [str(ckpt)], None)
        elif d.get("models"):
            specs[d["system"]] = ("ort", [str(m) for m in d["models"]], None)
        elif d.get("gguf"):
            specs[d["system"]] = ("llamacpp", [str(d["gguf"])], d["python"])
        elif d.get("ov_model"):
            specs[d["system"]] = ("openvino", [str(d["ov_model"])], d["python"])
    turns = decode_ab.interleaved(specs, prompt_ids(s), s.new, s.max_len, threads, rounds)
    for d in rows:
        t = turns["systems"].get(d["system"])
        if t is None:
            continue
        d["phase"] = {k: d[k] for k in ("tok_per_s", "p50_ms", "p99_ms") if k in d}
        d.update(
            tok_per_s=t["tok_per_s"],
            p50_ms=t["p50_ms"],
            p99_ms=t["p99_ms"],
            p99_p50=t["p99_p50_per_generation"],
            prefill_turn_ms=t["prefill_ms"],
            in_turn=True,
        )
        if t["tokens"] != d["tokens"] or not t["same_tokens_every_round"]:
            res["notes"].append(
                f"{d['system']}: its tokens in turn differ from its phase's or between rounds"
            )
    return turns


def vs(res: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> float:
    """a's tokens/s over b's: the median of the per-round ratios where both were timed in
    turn, else the ratio of their phases' figures."""
    turns = res.get("decode_turns")
    if turns and a["system"] in turns["systems"] and b["system"] in turns["systems"]:
        import decode_ab

        return float(decode_ab.ratio(turns, a["system"], b["system"])["median"])
    return float(a["tok_per_s"] / b["tok_per_s"])


def prefill_vs(res: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> float:
    """a's prefill time over b's: the median of the per-round ratios where both were timed in
    turn (bench/decode_ab.py), else the ratio of their phases' medians."""
    turns = res.get("decode_turns")
    if turns and a["system"] in turns["systems"] and b["system"] in turns["systems"]:
        import decode_ab

        return float(decode_ab.prefill_ratio(turns, a["system"], b["system"])["median"])
    return float(a["prefill_ms"] / b["prefill_ms"])


def p99_p50(d: dict[str, Any]) -> float:
    """One generation's P99/P50 (the median over the rounds where timed in turn)."""
    return float(d.get("p99_p50", d["p99_ms"] / d["p50_ms"]))


def systems(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The decode rows by role: cpu, npu, bf16 (npuc's), hf, ort."""
    d = res["decode"]
    return {"cpu": d[0], "npu": d[1], "bf16": d[2], "hf": d[3], "ort": d[4]}


NATIVE_BEGIN, NATIVE_END = "<!-- bench/native_ab.py -->", "<!-- /bench/native_ab.py -->"
SAMPLING_BEGIN, SAMPLING_END = "<!-- bench/sampling_ab.py -->", "<!-- /bench/sampling_ab.py -->"
RECURRENT_BEGIN, RECURRENT_END = "<!-- bench/recurrent_ab.py -->", "<!-- /bench/recurrent_ab.py -->"
LONG_BEGIN, LONG_END = "<!-- bench/long_context.py -->", "<!-- /bench/long_context.py -->"
# Sections other scripts write into the report, which this run does not measure: kept.
SPEC_BEGIN, SPEC_END = "<!-- bench/speculative.py -->", "<!-- /bench/speculative.py -->"
KEPT_SECTIONS = ((NATIVE_BEGIN, NATIVE_END), (SAMPLING_BEGIN, SAMPLING_END), (RECURRENT_BEGIN, RECURRENT_END),
                 (LONG_BEGIN, LONG_END), (SPEC_BEGIN, SPEC_END))


def write_section(doc: Path, begin: str, end: str, section: str) -> None:
    """Put `section` (which starts with begin and ends with end) in place of the report's one."""
    text = doc.read_text() if doc.is_file() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)


def keep_sections(out: Path, text: str) -> str:
    """The report with the sections other scripts wrote into the previous one (bench/native_ab.py:
    the native runtime against the Python one; bench/sampling_ab.py: sampling and structured
    output against greedy), which this run does not measure, kept at its end."""
    old = out.read_text() if out.is_file() else ""
    for begin, end in KEPT_SECTIONS:
        if begin in old and end in old:
            text = text.rstrip("\n") + "\n\n" + old[old.index(begin) : old.index(end) + len(end)] + "\n"
    return text


# The report's Setup section: the peers that run in venvs of their own.
SETUP = [
    "## Setup",
    "",
    "llama.cpp, OpenVINO GenAI and ExecuTorch each run in a venv of their own, made once; `bench/run.py` starts "
    "their processes with that venv's python and leaves out, with a note, a peer whose python is not given:",
    "",
    "```",
    "bash bench/setup_llamacpp.sh /tmp/lcpvenv    # llama-cpp-python built for this host, gguf, numpy; no torch",
    "bash bench/setup_openvino.sh /tmp/ovvenv     # openvino-genai, optimum-intel, NNCF; this machine's torch",
    "bash bench/setup_executorch.sh /tmp/etvenv   # ExecuTorch's memory planner",
    "python bench/run.py --llamacpp-python /tmp/lcpvenv/bin/python --openvino-python /tmp/ovvenv/bin/python \\",
    "    --executorch-python /tmp/etvenv/bin/python",
    "python bench/run.py --quant-only --llamacpp-python /tmp/lcpvenv/bin/python \\",
    "    --openvino-python /tmp/ovvenv/bin/python   # the quantized decode alone, into a temp file",
    "```",
    "",
]


def render(res: dict[str, Any]) -> str:
    s: Sizes = res["sizes"]
    lines = (
        [
            "# Benchmarks",
            "",
            f"Generated by `python bench/run.py{' --quick' if res['quick'] else ''}` on {res['date']}.",
            f"Machine: {res['machine']}. Threads: {res['threads']} for every system.",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
            "",
            "Every figure is from one run, the systems side by side; ratios are npuc / peer. These machines are "
            "shared, so absolute times drift between runs; the ratios are the point.",
            "",
        ]
        + SETUP
        + [
            "## Decode",
            "",
            f"Llama-shaped, {res['params'] / 1e6:.0f}M parameters (hidden {s.hidden}, {s.layers} layers, {s.heads} "
            f"heads, {s.kv_heads} KV heads, intermediate {s.inter}, vocab {s.vocab}), fp32, random weights. Prompt "
            f"{s.prompt} tokens, {s.new} new tokens, greedy; step latency is one token's forward pass plus argmax "
            f"(the first token comes from prefill). All three produce the same tokens: {res['same_tokens']}.",
            "",
            "| system | tokens/s | P50 step (ms) | P99 step (ms) | P99/P50 | of the bandwidth bound | vs HF | vs onnxruntime |",
            "|---|---|---|---|---|---|---|---|",
        ]
    )
    turns = res.get("decode_turns")
    if turns:
        lines[-3:-3] = [
            "",
            f"Timed in turn (bench/decode_ab.py): every system loaded at once, each in its own process, "
            f"{turns['rounds']} rounds of one generation each, the order rotating and reversed every other round, "
            "so that the machine's drift falls on all alike. tokens/s: the median over rounds of a generation's; "
            "P50 and P99: over every step of every round; P99/P50: a generation's, the median over rounds; "
            "vs: the median of the per-round ratios (the targets are judged on these).",
        ]
    bound = res["bound_tok_per_s"]
    sy = systems(res)
    hf_d, ort_d = sy["hf"], sy["ort"]
    for d in res["decode"]:
        lines.append(
            f"| {d['system']} | {d['tok_per_s']:.1f} | {d['p50_ms']:.2f} | {d['p99_ms']:.2f} | "
            f"{p99_p50(d):.2f} | {share_of_bound(res, d):.0%} | "
            f"{vs(res, d, hf_d):.2f}x | {vs(res, d, ort_d):.2f}x |"
        )
    cpu, npu, bf16 = sy["cpu"], sy["npu"], sy["bf16"]
    diverge = next(
        (i for i, (a, b) in enumerate(zip(bf16["tokens"], cpu["tokens"], strict=True)) if a != b), None
    )
    ct = res.get("compile_time")

    def row(what: str, measured: str, met: bool) -> str:
        return f"| {what} | {measured} | {'yes' if met else 'no'} |"

    lines += [
        "",
        f"Bandwidth bound: a step reads {res['read_bytes'] / 1e6:.0f} MB in fp32 (every weight but the input "
        f"embedding table, of which one row; {res['weight_bytes'] / 1e6:.0f} MB of weights in all) / the best "
        f"read bandwidth measured here, {res['bandwidth_gbps']:.1f} GB/s = {bound:.1f} tokens/s; bf16 reads "
        "half the bytes.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        row(
            "decode (cpu target) >= 1.5x HF tokens/s", f"{vs(res, cpu, hf_d):.2f}x", vs(res, cpu, hf_d) >= 1.5
        ),
        row(
            "decode (cpu target) >= 1.0x onnxruntime tokens/s",
            f"{vs(res, cpu, ort_d):.2f}x",
            vs(res, cpu, ort_d) >= 1.0,
        ),
        row(
            "decode (cpu target): share of the bandwidth bound, aim 85%",
            f"{share_of_bound(res, cpu):.0%}",
            share_of_bound(res, cpu) >= 0.85,
        ),
        row(
            "decode (default target npu) within 1.1x of the cpu target's step time",
            f"{vs(res, cpu, npu):.2f}x",
            vs(res, cpu, npu) <= 1.1,
        ),
        row(
            "decode (bf16) >= 2.5x HF fp32 tokens/s",
            f"{vs(res, bf16, hf_d):.2f}x",
            vs(res, bf16, hf_d) >= 2.5,
        ),
        row(
            f"bf16 greedy tokens agree with the fp32 .om ({len(cpu['tokens'])} tokens)",
            "all agree" if diverge is None else f"first differs at token {diverge}",
            diverge is None,
        ),
        row(
            "prefill <= 0.8x onnxruntime's time (timed in turn: median ratio)",
            f"{prefill_ratio(res):.3f}x",
            prefill_ratio(res) <= 0.8,
        ),
        row("P99/P50 step latency <= 1.15 (cpu target)", f"{p99_p50(cpu):.2f}", p99_p50(cpu) <= 1.15),
    ]
    if ct:
        lines.append(
            row(
                f"compile of the HF folder (--max_seq_len {ct['max_seq_len']}) <= 3x from_pretrained, "
                "fresh processes",
                f"{ct['ratio']:.2f}x ({ct['npuc_s']:.1f} s vs "
                f"{ct['from_pretrained_s']:.1f} s; peak RSS {ct['npuc_peak_rss'] / 2**30:.2f} GiB)",
                ct["ratio"] <= 3,
            )
        )
    lines += [
        "",
        "![decode step latency](bench-decode.png)" if res.get("plot") else "",
        "",
        "Where the decode step goes (share of the step per op type, timed between the runtime's per-op "
        "callbacks; views that the runtime drops count nothing):",
        "",
    ]
    for d in (cpu, npu, bf16):
        lines.append(
            f"- {d['system']}: "
            + ", ".join(f"{k} {v:.0%}" for k, v in d["profile"][:8])
            + "; kernels chosen at load: "
            + ", ".join(f"{k} {v}" for k, v in sorted(d.get("kernels", {}).items()))
            + "."
        )
    if res.get("tail"):
        import tail  # bench/tail.py, which imports this module: imported when used

        lines += [""] + tail.render(res["tail"])
    lines += [
        "",
        "## Prefill",
        "",
        f"{s.prompt} tokens, median of {s.reps} runs.",
        "",
        "| system | latency (ms) | npuc (cpu target) / system |",
        "|---|---|---|",
    ]
    for d in res["decode"]:
        lines.append(f"| {d['system']} | {d['prefill_ms']:.1f} | {cpu['prefill_ms'] / d['prefill_ms']:.2f} |")
    pt = res.get("prefill_turns")
    if pt:
        lines += [
            "",
            f"Timed in turn (bench/prefill_ab.py: both loaded, each in its own process, {pt['rounds']} "
            "rounds, the order alternating, so that drift falls on both alike; the target is judged on this): "
            f"npuc (cpu target) {pt['npuc_ms']:.1f} ms, onnxruntime {pt['ort_ms']:.1f} ms (medians); "
            f"npuc / onnxruntime per round: median {pt['ratio']:.3f}x, quartiles {pt['ratio_q1']:.2f}x-"
            f"{pt['ratio_q3']:.2f}x. onnxruntime's prefill computes the logits of all {s.prompt} rows, as "
            "the exported model's output says; npuc's .om computes the last row's only "
            "(`--prefill_logits last`, its default: passes/last_token_logits.py).",
        ]
    if res.get("quant"):
        lines += render_quant(res, cpu, hf_d)
    lines += [
        "",
        "## Memory plans",
        "",
        "Every program of every test architecture (tiny configs from tests/hf_models.py; prefill at the length "
        "shown, decode over a KV cache of twice that), npu target (512 B alignment). `no reuse` gives every "
        "buffer its own bytes. ExecuTorch: its default memory planning (`to_executorch()`) on the torch.export "
        "program of the same model and length (no KV cache, unfused ATen ops), where an ExecuTorch environment "
        "was given.",
        "",
        "| arch | program | arena (B) | lower bound (B) | arena / LB | no reuse (B) | ExecuTorch (B) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["plans"]:
        lines.append(
            f"| {r['arch']} | {r['program']} | {fmt_b(r['arena'])} | {fmt_b(r['lower_bound'])} | "
            f"{r['arena'] / r['lower_bound']:.3f} | {fmt_b(r['no_reuse'])} | {fmt_b(r['executorch'])} |"
        )
    worst = max(r["arena"] / r["lower_bound"] for r in res["plans"])
    et_rows = [r for r in res["plans"] if r["executorch"]]
    lines += [
        "",
        f"Target arena / LB <= 1.01 on every program: worst {worst:.3f} "
        f"({'met' if worst <= 1.01 else 'missed'}). Never larger than ExecuTorch's plan: "
        + (
            ("met" if all(r["arena"] <= r["executorch"] for r in et_rows) else "missed")
            + f" on {len(et_rows)} prefill programs"
            if et_rows
            else "not measured (no ExecuTorch)"
        )
        + ".",
    ]
    if res.get("scale"):
        lines += render_scale(res["scale"])
    lines += [
        "",
        "## Pass-pipeline scaling",
        "",
        "The optimiser alone (no weights read or written), Llama-shaped, prompt 128.",
        "",
        "| layers | nodes | import (s) | passes (s) | us per node |",
        "|---|---|---|---|---|",
    ]
    for r in res["passes"]:
        lines.append(
            f"| {r['layers']} | {r['nodes']} | {r['import_s']:.2f} | {r['passes_s']:.2f} | "
            f"{r['us_per_node']:.0f} |"
        )
    per = [r["us_per_node"] for r in res["passes"]]
    lines += ["", f"Target: flat from the smallest to the largest: {per[-1] / per[0]:.2f}x."]
    if res.get("batch"):
        import batch_decode  # bench/batch_decode.py, which imports this module

        lines += batch_decode.render(res["batch"])
    if res.get("serve_load"):
        import serve_load

        lines += serve_load.render(res["serve_load"])
    lines += ["", "## GPU", "", res["gpu"], ""]
    lines += analysis(res)
    lines += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


def render_quant(res: dict[str, Any], cpu: dict[str, Any], hf_d: dict[str, Any]) -> list[str]:
    """The quantized rows, their targets and the run's notes on them."""
    import quant_bench

    q = res["quant"]
    lines = [""] + quant_bench.render(q["rows"], lambda r: vs(res, r, hf_d), cpu["tokens"], cpu["bytes"])
    lines += quant_bench.targets(
        q["rows"], lambda a, b: vs(res, a, b), lambda r: vs(res, r, hf_d), lambda a, b: prefill_vs(res, a, b)
    )
    notes = q.get("notes", [])
    return lines + ([""] + [f"- {n}" for n in notes] if notes else [])


def analysis(res: dict[str, Any]) -> list[str]:
    """The facts of this run behind each missed target (the analysis is docs/performance.md's)."""
    sy = systems(res)
    cpu, npu, bf16, hf_d, ort_d = sy["cpu"], sy["npu"], sy["bf16"], sy["hf"], sy["ort"]
    out = ["## Missed targets: this run's facts", "", "Why, with profiles: docs/performance.md.", ""]

    def share(d: dict[str, Any], op: str) -> str:
        return f"{dict(d['profile']).get(op, 0.0):.0%}"

    if vs(res, cpu, hf_d) < 1.5 or vs(res, cpu, ort_d) < 1.0:
        out.append(
            f"- Decode (cpu target): {share_of_bound(res, cpu):.0%} of the bandwidth bound (HF "
            f"{share_of_bound(res, hf_d):.0%}, onnxruntime {share_of_bound(res, ort_d):.0%}); "
            f"`linear` is {share(cpu, 'linear')} of the step."
        )
    if vs(res, bf16, hf_d) < 2.5:
        out.append(
            f"- Decode (bf16): {bf16['p50_ms']:.2f} ms a step, `linear` {share(bf16, 'linear')} of it; "
            f"2.5x HF would be {hf_d['p50_ms'] / 2.5:.2f} ms."
        )
    if vs(res, cpu, npu) > 1.1:
        out.append(
            f"- Default target: {npu['p50_ms']:.2f} ms against {cpu['p50_ms']:.2f} ms; its step: "
            + ", ".join(f"{k} {v:.0%}" for k, v in npu["profile"][:5])
            + "."
        )
    if prefill_ratio(res) > 0.8:
        pt = res.get("prefill_turns") or {"npuc_ms": cpu["prefill_ms"], "ort_ms": ort_d["prefill_ms"]}
        out.append(
            f"- Prefill: {pt['npuc_ms']:.1f} ms against onnxruntime's {pt['ort_ms']:.1f} ms, "
            f"{prefill_ratio(res):.3f}x (0.8x would be {0.8 * pt['ort_ms']:.1f} ms)."
        )
    if p99_p50(cpu) > 1.15:
        out.append(
            f"- P99/P50 {p99_p50(cpu):.2f} (of a generation of {len(cpu['steps_ms'])} steps, the "
            f"second-slowest step); in the same run HF's is {p99_p50(hf_d):.2f} and "
            f"onnxruntime's {p99_p50(ort_d):.2f}." + tail_fact(res.get("tail"))
        )
    ct = res.get("compile_time")
    if ct and ct["ratio"] > 3:
        out.append(
            f"- Compile of the HF folder: {ct['npuc_s']:.1f} s against from_pretrained's "
            f"{ct['from_pretrained_s']:.1f} s."
        )
    sc = res.get("scale")
    if sc and not res["quick"] and sc["npuc_wall_over_copy"] > 2:
        out.append(f"- Compile at scale: {sc['npuc_wall_over_copy']:.1f}x a plain copy of the weights.")
    if len(out) == 4:
        out.append("- None.")
    return out + [""]


def tail_fact(tr: dict[str, Any] | None) -> str:
    """One sentence from bench/tail.py's trace: where the slow steps' extra time went."""
    if not tr:
        return ""
    t = tr["trace"]
    if not t.get("probes"):
        return " The tracer's run-queue figures: not available."
    tl = t["tail"]
    return (
        f" Traced (Step-latency tail): over {t['steps']} steps (P99/P50 {t['wall']['p99_over_p50']:.2f}), the "
        f"steps above P90 took {tl['excess_ms']:.1f} ms more than the median band, of which the main thread "
        f"waited {tl['run_queue_ms']:.1f} ms for a core and ran {tl['on_cpu_ms']:+.1f} ms longer; its on-CPU "
        f"time's P99/P50 is {t['main_on_cpu']['p99_over_p50']:.2f}"
        + (
            f"; a step's wall correlates {bw['corr']:.2f} with a timed memory read before it."
            if (bw := tr.get("bandwidth")) and bw.get("corr") is not None
            else "."
        )
    )


def render_scale(sc: dict[str, Any]) -> list[str]:
    f, h = sc["full"], sc["half"]
    gb = 1e9
    lines = [
        "",
        "## Compile at scale",
        "",
        f"Llama-shaped ONNX with external data (opset 18, dynamic batch and sequence), compiled at "
        f"`{sc['input_shape']}` for `--soc_version cpu`; each figure from a fresh process, the weight file "
        f"in the page cache ({sc['page_cache']}). Peak RSS: {sc['rss_method']}.",
        "",
        "| model | weights (GB) | npuc compile (s) | npuc peak RSS (GB) | onnxruntime offline optimisation (s) | "
        "ORT peak RSS (GB) | copy of the weight file (s) | copy and fsync (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (f, h):
        fsync = f"{r['copy_fsync']['wall_s']:.1f}" if "copy_fsync" in r else ""
        lines.append(
            f"| {r['params'] / 1e9:.2f}B ({r['layers']} layers) | {r['weight_bytes'] / gb:.2f} | "
            f"{r['npuc_compile']['wall_s']:.1f} | {r['npuc_compile']['peak_rss_bytes'] / gb:.2f} | "
            f"{r['ort_optimize']['wall_s']:.1f} | {r['ort_optimize']['peak_rss_bytes'] / gb:.2f} | "
            f"{r['copy']['wall_s']:.1f} | {fsync} |"
        )
    ra = sc["ratios_full_over_half"]
    rss = f["npuc_compile"]["peak_rss_bytes"] / gb
    lines += [
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| peak RSS <= 1.5 GB on the big model | {rss:.2f} GB | {'yes' if rss <= 1.5 else 'no'} |",
        f"| peak RSS does not grow with the weights | x{ra['npuc_peak_rss']:.2f} for x{ra['weight_bytes']:.2f} "
        f"the weights (onnxruntime: x{ra['ort_peak_rss']:.2f}) | {'yes' if ra['npuc_peak_rss'] < 1.15 else 'no'} |",
        f"| time <= 2x a plain copy of the weights | {sc['npuc_wall_over_copy']:.1f}x | "
        f"{'yes' if sc['npuc_wall_over_copy'] <= 2 else 'no'} |",
    ]
    if "npuc_wall_over_copy_fsync" in sc:  # issue 35's form: against a copy that is on disk, as npuc's output is
        r = sc.get("npuc_over_copy_fsync_median", sc["npuc_wall_over_copy_fsync"])
        rounds = sc.get("npuc_over_copy_fsync_rounds")
        each = f" (median of the rounds' ratios: {', '.join(f'{x:.2f}' for x in rounds)})" if rounds else ""
        lines.append(f"| time <= 2x a copy of the weights and its fsync | {r:.2f}x{each} | "
                     f"{'yes' if r <= 2 else 'no'} |")
    return lines


def plot(res: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for d in res["decode"]:
        ax.plot(d["steps_ms"], label=d["system"])
    ax.set_xlabel("decode step")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Decode step latency (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def quant_only(
    args: argparse.Namespace, s: Sizes, ckpt: Path, work: Path, threads: int, params: int, t_start: float
) -> None:
    """`--quant-only`: the quantized section alone, with the rows it is judged against."""
    print(f"[bench] model {params / 1e6:.0f}M params; {NPUC_SYSTEMS[0][0]}", file=sys.stderr)
    cpu = run_npuc(ckpt, s, work)
    print("[bench] HF", file=sys.stderr)
    hf_d = run_hf(ckpt, s)
    quant = run_quant(ckpt, s, work, threads, args.llamacpp_python, cpu["tokens"], args.openvino_python)
    res: dict[str, Any] = {"decode": [cpu, hf_d], "quant": quant, "notes": []}
    print("[bench] decode, every system in turn (bench/decode_ab.py)", file=sys.stderr)
    res["decode_turns"] = in_turn(res, ckpt, s, threads, rounds=2 if args.quick else 12)
    lines = [
        f"# Quantized decode only (`python bench/run.py --quant-only{' --quick' if args.quick else ''}`)",
        "",
        f"{datetime.date.today().isoformat()}. Machine: {machine()}. Threads: {threads} for every system. "
        f"Model: {params / 1e6:.0f}M parameters (hidden {s.hidden}, {s.layers} layers), prompt {s.prompt} "
        f"tokens, {s.new} new. References, timed in turn with the rest: {cpu['system']} "
        f"{cpu['tok_per_s']:.1f} tokens/s, prefill {cpu.get('prefill_turn_ms', cpu['prefill_ms']):.1f} ms; {hf_d['system']} "
        f"{hf_d['tok_per_s']:.1f} tokens/s.",
    ]
    lines += render_quant(res, cpu, hf_d) + [f"- {n}" for n in res["notes"]]
    out = Path(args.out) if args.out else work / "benchmarks-quant.md"
    out.write_text("\n".join(lines) + "\n")
    (out.parent / (out.stem + ".json")).write_text(json.dumps(res, indent=2, sort_keys=True, default=str))
    print(f"[bench] wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models: a smoke check in under 3 minutes")
    ap.add_argument(
        "--out", default=None, help="report path (default: docs/benchmarks.md; --quick: a temp file)"
    )
    ap.add_argument("--work", default=None, help="folder for checkpoints and .om files (kept between runs)")
    ap.add_argument(
        "--llamacpp-python",
        default=os.environ.get("NPUC_BENCH_LLAMACPP_PYTHON"),
        help="a python that has llama-cpp-python and gguf (bench/setup_llamacpp.sh)",
    )
    ap.add_argument(
        "--openvino-python",
        default=os.environ.get("NPUC_BENCH_OPENVINO_PYTHON"),
        help="a python that has openvino-genai and optimum-intel (bench/setup_openvino.sh)",
    )
    ap.add_argument(
        "--quant-only",
        action="store_true",
        help="only the quantized decode: npuc's fp32 (cpu target) and HF as references, npuc's quantized "
        "modes and the peers, timed in turn; a report of that section alone (default: a temp file)",
    )
    ap.add_argument(
        "--executorch-python",
        default=os.environ.get("NPUC_BENCH_EXECUTORCH_PYTHON"),
        help="a python that has executorch (its requirements clash with npuc's; bench/setup_executorch.sh makes one)",
    )
    ap.add_argument("--skip-scale", action="store_true", help="leave out compile at scale")
    ap.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="only re-render the report (and plot) from a run's JSON, next to it",
    )
    args = ap.parse_args(argv)
    if args.render:
        src = Path(args.render)
        res = json.loads(src.read_text())
        res["sizes"] = Sizes(**res["sizes"])
        res["plot"] = plot(res, src.parent / "bench-decode.png")
        out = src.with_suffix(".md")
        out.write_text(keep_sections(out, render(res)))
        return
    s = QUICK if args.quick else FULL
    threads = torch.get_num_threads()
    work = Path(args.work or tempfile.mkdtemp(prefix="npuc-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    t_start = time.perf_counter()

    ckpt = llama_checkpoint(s, work / f"llama_{s.hidden}x{s.layers}")
    params = sum(
        p.numel()
        for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(str(ckpt)).parameters()
    )
    if args.quant_only:
        quant_only(args, s, ckpt, work, threads, params, t_start)
        return
    decode = []
    for label, soc, precision in NPUC_SYSTEMS:
        print(f"[bench] model {params / 1e6:.0f}M params; {label}", file=sys.stderr)
        decode.append(run_npuc(ckpt, s, work, label, soc, precision))
    print("[bench] step-latency tail (bench/tail.py)", file=sys.stderr)
    import tail  # bench/tail.py, which imports this module: imported when used

    step_tail = tail.trace(
        Path(decode[0]["om"]),
        s,
        runs=2 if args.quick else 6,
        profile_runs=1 if args.quick else 2,
        control_runs=2 if args.quick else 6,
        exp_rounds=0 if args.quick else 6,
    )
    print("[bench] HF", file=sys.stderr)
    decode.append(run_hf(ckpt, s))
    print("[bench] onnxruntime", file=sys.stderr)
    decode.append(run_ort(ckpt, s, work, threads))
    print("[bench] prefill, npuc and onnxruntime in turn (bench/prefill_ab.py)", file=sys.stderr)
    import prefill_ab

    prefill_turns = prefill_ab.interleaved(
        decode[0]["om"], *decode[-1]["models"], prompt_ids(s), threads, rounds=3 if args.quick else 15
    )
    quant = run_quant(ckpt, s, work, threads, args.llamacpp_python, decode[0]["tokens"], args.openvino_python)
    print("[bench] decode, every system in turn (bench/decode_ab.py)", file=sys.stderr)
    decode_turns = in_turn(
        {"decode": decode, "quant": quant, "notes": notes}, ckpt, s, threads, rounds=2 if args.quick else 12
    )
    fp32 = [d for d in decode if "bf16" not in d["system"]]
    same = len({tuple(d["tokens"]) for d in fp32}) == 1
    if not same:
        notes.append(
            "the fp32 systems disagree on the generated tokens: see the tokens in the JSON next to this file"
        )
    print("[bench] decode over several slots (bench/batch_decode.py)", file=sys.stderr)
    import batch_decode

    batch = batch_decode.run(
        ckpt, s, work, rounds=1 if args.quick else 3, batches=(1, 2) if args.quick else batch_decode.BATCHES
    )
    print("[bench] serving under load (bench/serve_load.py)", file=sys.stderr)
    serve = batch_decode.load_test(work, ckpt, s, args.quick)
    print("[bench] compile time", file=sys.stderr)
    compile_time = compile_vs_load(ckpt, s, work, reps=1 if args.quick else 3)
    read_bytes, weight_bytes = decode_read_bytes(ckpt)
    for d in decode:  # bf16 matrix weights: half the bytes (the norms' few stay f32)
        d["read_bytes"] = read_bytes // 2 if "bf16" in d["system"] else read_bytes
    bw = read_bandwidth_gbps((256 if args.quick else 1024) << 20)
    print("[bench] memory plans", file=sys.stderr)
    plans = memory_plans(work, args.executorch_python, args.quick)
    if not args.executorch_python:
        notes.append("ExecuTorch column empty: run with --executorch-python (a venv with executorch)")
    print("[bench] pass scaling", file=sys.stderr)
    passes = pass_scaling(work, args.quick)
    scale = None
    if not args.skip_scale:
        print("[bench] compile at scale", file=sys.stderr)
        # Its own process: a child forked from this one (models loaded, GBs resident)
        # would report this process's pages as its peak RSS.
        cmd = [sys.executable, str(ROOT / "bench/compile_scale.py"), "--out", str(work / "scale")]
        # --quick: one round of each (three rounds of page-cache resets took CI two minutes)
        r = subprocess.run(
            cmd + (["--quick", "--repeat", "1"] if args.quick else []), capture_output=True, text=True, check=True
        )
        scale = json.loads(r.stdout[r.stdout.index("{") :])
    res: dict[str, Any] = {
        "quick": args.quick,
        "sizes": s,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "threads": threads,
        "versions": versions(args.executorch_python),
        "params": params,
        "decode": decode,
        "same_tokens": same,
        "weight_bytes": weight_bytes,
        "read_bytes": read_bytes,
        "bandwidth_gbps": bw,
        "bound_tok_per_s": bw * 1e9 / read_bytes,
        "plans": plans,
        "passes": passes,
        "scale": scale,
        "notes": notes,
        "compile_time": compile_time,
        "tail": step_tail,
        "quant": quant,
        "prefill_turns": prefill_turns,
        "decode_turns": decode_turns,
        "batch": batch,
        "serve_load": serve,
        "gpu": (
            "Not run: this machine has no GPU (torch.cuda.is_available() is False)."
            if not torch.cuda.is_available()
            else "A GPU is present, but the CUDA benchmark is not written yet."
        ),
    }
    out = (
        Path(args.out)
        if args.out
        else (work / "benchmarks.md" if args.quick else ROOT / "docs/benchmarks.md")
    )
    res["plot"] = plot(res, out.parent / "bench-decode.png")
    out.write_text(keep_sections(out, render(res)))
    (out.parent / (out.stem + ".json")).write_text(
        json.dumps(
            {k: (v.__dict__ if isinstance(v, Sizes) else v) for k, v in res.items()}, indent=2, sort_keys=True
        )
    )
    print(f"[bench] wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
