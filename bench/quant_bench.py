"""Quantized decode, side by side (bench/run.py calls these; issue 14's and 34's figures):

* npuc `--quant_type w8a16` and `w4a16` (group 128), `w8a8` and `w4a8` (int8 activations,
  group 32) on the cpu target; a mode that does not compile is left out with a note;
* onnxruntime over the same model's ONNX export quantized by its own
  `MatMulNBitsQuantizer` (4 bits, block 128, asymmetric: its defaults), every MatMul;
* llama.cpp (GGUF Q8_0, Q4_0 and Q4_K_M of the same weights, bench/llamacpp.py), where a
  venv from bench/setup_llamacpp.sh is given;
* OpenVINO GenAI (the same checkpoint exported by optimum-intel with int8 and int4
  weights, bench/openvino_peer.py), where a venv from bench/setup_openvino.sh is given.

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

ORT_LABEL = "onnxruntime (MatMulNBits, 4 bits, block 128)"
# (row label, --quant_type, weight bits)
QUANT_SYSTEMS = [
    ("npuc (cpu, --quant_type w8a16)", "w8a16", 8),
    ("npuc (cpu, --quant_type w8a8, group 32)", "w8a8", 8),
    ("npuc (cpu, --quant_type w4a16, group 128)", "w4a16", 4),
    ("npuc (cpu, --quant_type w4a8, group 32)", "w4a8", 4),
]
# Modes left out with a note, not failing the run, where they do not compile here yet.
OPTIONAL_MODES = frozenset({"w8a8", "w4a8"})
# llama.cpp's GGUF types: weight bits
LLAMACPP_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_K_M": 4}
# OpenVINO's weight formats: (bits, group size; None: per channel)
OPENVINO_TYPES = {"int8": (8, None), "int4": (4, 128)}


def llamacpp_label(qtype: str) -> str:
    return f"llama.cpp ({qtype})"


def openvino_label(fmt: str) -> str:
    bits, group = OPENVINO_TYPES[fmt]
    return f"OpenVINO GenAI ({fmt}" + (f", group {group})" if group else ")")


def bits_of(system: str) -> int | None:
    """A quantized row's weight bits, from its label; None for any other row."""
    for label, _, bits in QUANT_SYSTEMS:
        if system == label:
            return bits
    for qtype, bits in LLAMACPP_TYPES.items():
        if system == llamacpp_label(qtype):
            return bits
    for fmt, (bits, _) in OPENVINO_TYPES.items():
        if system == openvino_label(fmt):
            return bits
    return 4 if system == ORT_LABEL else None


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
    return {
        "tokens": list(tokens),
        "steps": list(steps),
        "prefill": prefill,
        "models": [qpre, qdec],
        "bytes": sum(os.path.getsize(p) for p in Path(qdec).parent.glob("q4_*decode*")),
    }


def run_llamacpp(
    python: str, ckpt: Path, qtype: str, work: Path, prompt: list[int], new: int, threads: int, reps: int
) -> dict[str, Any]:
    """One GGUF type timed by llama.cpp in `python` (its venv: no torch there); the
    checkpoint's tensors are exported here, by this python, once."""
    from llamacpp import export_weights  # bench/llamacpp.py: its parent half

    work = work / "llamacpp" / ckpt.name  # one folder a checkpoint: the files are kept between runs
    weights = export_weights(ckpt, work / "weights")
    cmd = [
        python,
        str(ROOT / "bench/llamacpp.py"),
        "run",
        "--weights",
        str(weights),
        "--qtype",
        qtype,
        "--work",
        str(work),
        "--prompt-ids",
        json.dumps(prompt),
        "--new",
        str(new),
        "--threads",
        str(threads),
        "--reps",
        str(reps),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench/llamacpp.py {qtype} failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout[r.stdout.index("{") :])


def run_openvino(
    python: str, ckpt: Path, fmt: str, work: Path, prompt: list[int], new: int, threads: int, reps: int
) -> dict[str, Any]:
    """One weight format exported by optimum-intel and timed by OpenVINO GenAI, both in
    `python` (bench/openvino_peer.py)."""
    _, group = OPENVINO_TYPES[fmt]
    work = work / "openvino" / ckpt.name  # one folder a checkpoint: the exports are kept between runs
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        str(ROOT / "bench/openvino_peer.py"),
        "run",
        "--ckpt",
        str(ckpt),
        "--weight-format",
        fmt,
        "--work",
        str(work),
        "--prompt-ids",
        json.dumps(prompt),
        "--new",
        str(new),
        "--threads",
        str(threads),
        "--reps",
        str(reps),
    ] + (["--group-size", str(group)] if group else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench/openvino_peer.py {fmt} failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout[r.stdout.index("{") :])


def stats(name: str, tokens: list[int], steps: list[float], prefill: list[float]) -> dict[str, Any]:
    ys = sorted(steps)
    return {
        "system": name,
        "tokens": tokens,
        "tok_per_s": len(steps) / sum(steps),
        "steps_ms": [1e3 * x for x in steps],
        "p50_ms": 1e3 * ys[len(ys) // 2],
        "prefill_ms": 1e3 * statistics.median(prefill),
    }


def render(rows: list[dict[str, Any]], vs_hf: Any, ref_tokens: list[int], fp32_bytes: int) -> list[str]:
    """`vs_hf(row)`: the row's tokens/s over HF fp32's (per-round ratios where timed in turn)."""
    out = [
        "## Quantized decode",
        "",
        "The decode model and prompt above; npuc's rows are compiled with `--soc_version cpu`; tokens/s over the "
        "new tokens; prefill: the prompt to its first token, the median over the rounds in turn (a row's own "
        "phase's median where marked). `agree` counts the leading greedy "
        "tokens equal to npuc's fp32 tokens (quantization is expected to change some); weight bytes are the "
        "model file's (`.om`, ONNX with its data, GGUF, OpenVINO IR) over the fp32 `.om`'s. llama.cpp's Q8_0 and "
        "Q4_0 GGUFs are written by gguf's quantizers and keep `output.weight` in Q8_0 under Q4_0, as npuc keeps "
        "its LM head in int8; its Q4_K_M is llama.cpp's own quantizer's mix (bench/llamacpp.py). OpenVINO's "
        "are optimum-intel's exports, NNCF's data-free weight compression: int8 per channel, int4 in groups "
        "of 128, asymmetric, its embedding table and LM head in int8 (bench/openvino_peer.py).",
        "",
        "Decode timed in turn with the rows above (bench/decode_ab.py; a row marked `own phase` was not), and "
        "vs HF fp32 is the median of the per-round ratios; so are the targets' ratios below, prefill's too.",
        "",
        "| system | bits | tokens/s | vs HF fp32 | P50 step (ms) | prefill (ms) | weight bytes (x fp32) | agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['bytes'] / fp32_bytes:.3f}" if r.get("bytes") else "n/a"
        turn = "" if r.get("in_turn") else " (own phase)"
        out.append(
            f"| {r['system']}{turn} | {bits_of(r['system'])} | {r['tok_per_s']:.1f} | {vs_hf(r):.2f}x | "
            f"{r['p50_ms']:.2f} | {prefill_ms(r):.1f} | {size} | "
            f"{agreement(r['tokens'], ref_tokens)}/{len(ref_tokens)} |"
        )
    peers = [r for r in rows if r.get("version")]
    if peers:
        out += [""] + [
            f"- {r['system']}: version {r['version']}"
            + (
                ", tensor types " + ", ".join(f"{k} {v}" for k, v in r["tensor_types"].items())
                if r.get("tensor_types")
                else ""
            )
            + (
                ", CPU defaults " + ", ".join(f"{k} {v}" for k, v in r["cpu_defaults"].items())
                if r.get("cpu_defaults")
                else ""
            )
            + "."
            for r in peers
        ]
    return out


def prefill_ms(r: dict[str, Any]) -> float:
    """The row's prefill: in turn where timed so, else its phase's median."""
    return float(r.get("prefill_turn_ms", r["prefill_ms"]))


def best(rows: list[dict[str, Any]], bits: int, prefill: bool = False) -> dict[str, Any] | None:
    """npuc's row of these weight bits with the most tokens/s (prefill: the fastest prefill)."""
    mine = [r for r in rows if r["system"] in {label for label, _, b in QUANT_SYSTEMS if b == bits}]
    if not mine:
        return None
    return min(mine, key=prefill_ms) if prefill else max(mine, key=lambda r: r["tok_per_s"])


def targets(rows: list[dict[str, Any]], vs: Any, vs_hf: Any, prefill_vs: Any) -> list[str]:
    """The quantized targets' rows (issues 14 and 34): `vs(a, b)`, a's tokens/s over b's;
    `prefill_vs(a, b)`, a's prefill time over b's."""
    by = {r["system"]: r for r in rows}
    mode = {label: qtype for label, qtype, _ in QUANT_SYSTEMS}

    def row(what: str, ratio: float, met: bool) -> str:
        return f"| {what} | {ratio:.2f}x | {'yes' if met else 'no'} |"

    out = ["", "| target | measured | met |", "|---|---|---|"]
    for label, qtype, aim in ((QUANT_SYSTEMS[0][0], "w8a16", 3.0), (QUANT_SYSTEMS[2][0], "w4a16", 5.0)):
        if label in by:
            out.append(
                row(f"{qtype} >= {aim:g}x HF fp32 tokens/s", vs_hf(by[label]), vs_hf(by[label]) >= aim)
            )
    w4, ort = by.get(QUANT_SYSTEMS[2][0]), by.get(ORT_LABEL)
    if w4 and ort:
        out.append(
            row(
                "w4a16 >= 1.0x onnxruntime MatMulNBits (4 bits, block 128) tokens/s",
                vs(w4, ort),
                vs(w4, ort) >= 1.0,
            )
        )
    peers = [
        (8, llamacpp_label("Q8_0"), 1.2),
        (4, llamacpp_label("Q4_0"), 1.2),
        (4, llamacpp_label("Q4_K_M"), 1.0),
        (8, openvino_label("int8"), 1.0),
        (4, openvino_label("int4"), 1.0),
    ]
    for bits, peer, aim in peers:
        b = best(rows, bits)
        if b is not None and peer in by:
            out.append(
                row(
                    f"best {bits}-bit mode ({mode[b['system']]}) >= {aim:g}x {peer} tokens/s",
                    vs(b, by[peer]),
                    vs(b, by[peer]) >= aim,
                )
            )
    for bits, peer in ((8, "Q8_0"), (4, "Q4_0"), (4, "Q4_K_M")):
        b, p = best(rows, bits, prefill=True), by.get(llamacpp_label(peer))
        if b is not None and p is not None:
            ratio = prefill_vs(b, p)
            out.append(
                f"| prefill of the prompt, fastest {bits}-bit mode ({mode[b['system']]}) <= 0.8x llama.cpp "
                f"{peer}'s time | {ratio:.2f}x ({prefill_ms(b):.1f} ms vs {prefill_ms(p):.1f} ms) | "
                f"{'yes' if ratio <= 0.8 else 'no'} |"
            )
    info = []
    for bits, fmt in ((8, "int8"), (4, "int4")):
        b, p = best(rows, bits, prefill=True), by.get(openvino_label(fmt))
        if b is not None and p is not None:
            info.append(
                f"fastest {bits}-bit mode ({mode[b['system']]}) {prefill_vs(b, p):.2f}x OpenVINO GenAI {fmt}'s "
                f"({prefill_ms(b):.1f} ms vs {prefill_ms(p):.1f} ms)"
            )
    if info:
        out += ["", "Prefill against OpenVINO GenAI at the same bits (no target): " + "; ".join(info) + "."]
    return out
