"""Quantized decode, side by side (bench/run.py calls these; issue 14's figures):

* npuc `--quant_type w8a16` and `w4a16` (group 128) on the cpu target;
* onnxruntime over the same model's ONNX export quantized by its own
  `MatMulNBitsQuantizer` (4 bits, block 128, asymmetric: its defaults), every MatMul;
* llama.cpp (GGUF Q8_0 and Q4_0 of the same weights, bench/llamacpp.py), where a venv
  from bench/setup_llamacpp.sh is given.

Tokens are compared with the fp32 tokens of the same run: quantization changes them,
so the share that agrees is reported, never required.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# (row label, --quant_type, llama.cpp's type of the same bit width)
ORT_LABEL = "onnxruntime (MatMulNBits, 4 bits, block 128)"
QUANT_SYSTEMS = [("npuc (cpu, --quant_type w8a16)", "w8a16", "Q8_0"),
                 ("npuc (cpu, --quant_type w4a16, group 128)", "w4a16", "Q4_0")]


def agreement(tokens: list[int], ref: list[int]) -> int:
    """Leading tokens equal to the reference's."""
    n = 0
    for a, b in zip(tokens, ref, strict=False):
        if a != b:
            break
        n += 1
    return n


def ort_matmulnbits(prefill: str, decode: str, work: Path) -> tuple[str, str]:
    """The exported prefill/decode graphs with every MatMul weight as MatMulNBits (4 bits,
    block 128), by onnxruntime's own quantizer; cached in `work`."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    out = []
    for path in (prefill, decode):
        dst = work / ("q4_" + Path(path).name)
        if not dst.is_file():
            q = MatMulNBitsQuantizer(onnx.load(path), bits=4, block_size=128, is_symmetric=False)
            q.process()
            q.model.save_model_to_file(str(dst), use_external_data_format=True)
        out.append(str(dst))
    return out[0], out[1]


def run_ort_nbits(ckpt: Path, s: Any, work: Path, threads: int, prompt: list[int]) -> dict[str, Any]:
    import transformers
    from ort_llama import OrtLlama, export_llama_kv

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    pre, dec = export_llama_kv(model, str(work / "ort"), s.prompt, s.max_len)
    del model
    qpre, qdec = ort_matmulnbits(pre, dec, work / "ort")
    tokens, steps, prefill = OrtLlama(qpre, qdec, threads).measure(prompt, s.new, s.reps)
    return {"tokens": list(tokens), "steps": list(steps), "prefill": prefill, "models": [qpre, qdec],
            "bytes": sum(os.path.getsize(p) for p in Path(qdec).parent.glob("q4_*decode*"))}


def run_llamacpp(python: str, ckpt: Path, qtype: str, work: Path, prompt: list[int], new: int, threads: int,
                 reps: int) -> dict[str, Any]:
    cmd = [python, str(ROOT / "bench/llamacpp.py"), "--ckpt", str(ckpt), "--qtype", qtype, "--work", str(work),
           "--prompt-ids", json.dumps(prompt), "--new", str(new), "--threads", str(threads), "--reps", str(reps)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout[r.stdout.index("{"):])


def stats(name: str, tokens: list[int], steps: list[float], prefill: list[float]) -> dict[str, Any]:
    ys = sorted(steps)
    return {"system": name, "tokens": tokens, "tok_per_s": len(steps) / sum(steps),
            "steps_ms": [1e3 * x for x in steps], "p50_ms": 1e3 * ys[len(ys) // 2],
            "prefill_ms": 1e3 * statistics.median(prefill)}


def render(rows: list[dict[str, Any]], vs_hf: Any, ref_tokens: list[int], fp32_bytes: int) -> list[str]:
    """`vs_hf(row)`: the row's tokens/s over HF fp32's (per-round ratios where timed in turn)."""
    out = ["## Quantized decode", "",
           "The decode model and prompt above; npuc's rows are compiled with `--soc_version cpu`; tokens/s over the "
           "new tokens. `agree` counts the leading greedy tokens equal to npuc's fp32 tokens (quantization is "
           "expected to change some); weight bytes are the model file's (`.om`, ONNX with its data, GGUF) over the "
           "fp32 `.om`'s. llama.cpp's GGUF keeps `output.weight` in Q8_0 under Q4_0, as npuc keeps its LM head in "
           "int8 (bench/llamacpp.py).", "",
           "Decode timed in turn with the rows above (bench/decode_ab.py; a row marked `own phase` was not), and "
           "vs HF fp32 is the median of the per-round ratios.", "",
           "| system | tokens/s | vs HF fp32 | P50 step (ms) | prefill (ms) | weight bytes (x fp32) | agree |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['bytes'] / fp32_bytes:.3f}" if r.get("bytes") else "n/a"
        turn = "" if r.get("in_turn") else " (own phase)"
        out.append(f"| {r['system']}{turn} | {r['tok_per_s']:.1f} | {vs_hf(r):.2f}x | {r['p50_ms']:.2f} | "
                   f"{r['prefill_ms']:.1f} | {size} | {agreement(r['tokens'], ref_tokens)}/{len(ref_tokens)} |")
    return out
