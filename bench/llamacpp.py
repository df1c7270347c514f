"""llama.cpp beside npuc's quantized decode: the same weights as GGUF Q8_0, Q4_0 and
Q4_K_M, run by llama-cpp-python with the same thread count, prompt and greedy decoding.

Two halves, two pythons, so that the venv of bench/setup_llamacpp.sh needs no torch:

* the parent (bench/run.py, the main python): `export_weights()` reads the Hugging Face
  checkpoint and writes its tensors as .npy files under llama.cpp's names, q and k rows
  already permuted, with the hyperparameters in hparams.json;
* the child (the venv: llama-cpp-python, gguf, numpy and the standard library, nothing
  else) writes the GGUF from those files, quantizes it, and runs it; it prints one JSON
  object.

    python bench/llamacpp.py run --weights DIR --qtype Q4_K_M --work DIR \
        --prompt-ids '[1, 2, 3]' --new 64 --threads 2        # with the venv's python
    python bench/llamacpp.py tokens --gguf X.gguf --prompt-ids '[1, 2, 3]' --new 32

The GGUF is written as llama.cpp's own convert_hf_to_gguf.py would: the LLaMA tensor
names, q and k rows permuted from HF's rotate-half RoPE order to llama.cpp's interleaved
one, norms in f32, and a synthetic vocabulary (the benchmark feeds token ids, never text).
Q8_0 and Q4_0 are quantized by gguf's own numpy quantizers: every matrix, the embedding
table included, takes the type, except `output.weight`, which stays Q8_0 under Q4_0, the
choice npuc makes for its LM head (docs/quantization.md), so both run the same mix.
Q4_K_M is what users download: an F32 GGUF quantized by llama.cpp's own quantizer
(`llama_model_quantize`, as `llama-quantize` does), with its own mix (Q6_K for
`output.weight` and some of the attn_v and ffn_down matrices, Q4_K elsewhere; a matrix
whose rows are not a multiple of 256 falls back to another type). The tensor types each
file ended with are reported.

`tokens` runs any GGUF, such as one that `npuc compile model.gguf` reads: its greedy token
ids for given prompt ids (`greedy_tokens()` asks for them from the parent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
QTYPES = ("Q8_0", "Q4_0", "Q4_K_M")
# The types written here by gguf's quantizers; the others come from llama.cpp's quantizer.
GGUF_PY_TYPES = ("F32", "Q8_0", "Q4_0")


# -- the parent: the checkpoint's tensors, for the child ---------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (each head's first half, then its second) to llama.cpp's pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_weights(ckpt: Path, out: Path) -> Path:
    """The checkpoint's tensors as `out/NAME.npy` (float32, llama.cpp's names and row order)
    and `out/hparams.json` (written last: its presence means the folder is complete)."""
    if (out / "hparams.json").is_file():
        return out
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    cfg = model.config
    if cfg.model_type != "llama":
        raise SystemExit(f"bench/llamacpp.py writes LLaMA GGUFs only, not {cfg.model_type}")
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors: list[tuple[str, str, np.ndarray]] = [
        ("token_embd.weight", "matrix", sd["model.embed_tokens.weight"])
    ]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors += [
            (f"blk.{i}.attn_norm.weight", "vector", sd[p + "input_layernorm.weight"]),
            (
                f"blk.{i}.attn_q.weight",
                "matrix",
                _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads),
            ),
            (
                f"blk.{i}.attn_k.weight",
                "matrix",
                _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
            ),
            (f"blk.{i}.attn_v.weight", "matrix", sd[p + "self_attn.v_proj.weight"]),
            (f"blk.{i}.attn_output.weight", "matrix", sd[p + "self_attn.o_proj.weight"]),
            (f"blk.{i}.ffn_norm.weight", "vector", sd[p + "post_attention_layernorm.weight"]),
            (f"blk.{i}.ffn_gate.weight", "matrix", sd[p + "mlp.gate_proj.weight"]),
            (f"blk.{i}.ffn_up.weight", "matrix", sd[p + "mlp.up_proj.weight"]),
            (f"blk.{i}.ffn_down.weight", "matrix", sd[p + "mlp.down_proj.weight"]),
        ]
    tensors += [
        ("output_norm.weight", "vector", sd["model.norm.weight"]),
        ("output.weight", "head", sd.get("lm_head.weight", sd["model.embed_tokens.weight"])),
    ]
    for name, _, a in tensors:
        np.save(out / f"{name}.npy", np.ascontiguousarray(a, dtype=np.float32))
    rope_theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    hp = {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "head_count": cfg.num_attention_heads,
        "head_count_kv": cfg.num_key_value_heads,
        "rope_dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "rope_freq_base": float(rope_theta),
        "layer_norm_rms_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "tensors": [[name, role] for name, role, _ in tensors],
    }
    (out / "hparams.json").write_text(json.dumps(hp, indent=1))
    return out


def greedy_tokens(python: str, gguf_path: Path, prompt: list[int], new: int, threads: int = 2) -> list[int]:
    """llama.cpp's greedy token ids after `prompt` for any GGUF, from the venv's python."""
    cmd = [
        python,
        str(BENCH / "llamacpp.py"),
        "tokens",
        "--gguf",
        str(gguf_path),
        "--prompt-ids",
        json.dumps(prompt),
        "--new",
        str(new),
        "--threads",
        str(threads),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return list(json.loads(r.stdout[r.stdout.index("{") :])["tokens"])


# -- the child: GGUF files and llama.cpp (llama_cpp, gguf, numpy, stdlib only) ------------------------


def write_gguf(weights: Path, out: Path, qtype: str) -> Path:
    """A GGUF of type `qtype` (F32, Q8_0 or Q4_0) from export_weights()' folder."""
    import gguf

    hp = json.loads((weights / "hparams.json").read_text())
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(hp["context_length"])
    w.add_embedding_length(hp["embedding_length"])
    w.add_block_count(hp["block_count"])
    w.add_feed_forward_length(hp["feed_forward_length"])
    w.add_head_count(hp["head_count"])
    w.add_head_count_kv(hp["head_count_kv"])
    w.add_rope_dimension_count(hp["rope_dimension_count"])
    w.add_rope_freq_base(hp["rope_freq_base"])
    w.add_layer_norm_rms_eps(hp["layer_norm_rms_eps"])
    w.add_file_type(
        {
            "F32": gguf.LlamaFileType.ALL_F32,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        }[qtype]
    )
    w.add_tokenizer_model("llama")
    vocab = hp["vocab_size"]
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.NORMAL] * (vocab - 3)
    )
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, role in hp["tensors"]:
        a = np.load(weights / f"{name}.npy")
        kind = gguf.GGMLQuantizationType.Q8_0 if role == "head" and qtype == "Q4_0" else qt
        if role == "vector" or kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def llama_quantize(src: Path, out: Path, qtype: str, threads: int) -> Path:
    """llama.cpp's own quantizer (what `llama-quantize SRC OUT Q4_K_M` runs), its default mix."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {qtype} failed ({rc})")
    os.replace(tmp, out)
    return out


def make_gguf(weights: Path, work: Path, qtype: str, threads: int) -> Path:
    """work/model-QTYPE.gguf, written once (Q4_K_M through an F32 GGUF that is then removed)."""
    out = work / f"model-{qtype}.gguf"
    if out.is_file():
        return out
    if qtype in GGUF_PY_TYPES:
        return write_gguf(weights, out, qtype)
    f32 = write_gguf(weights, work / "model-F32.gguf", "F32")
    try:
        return llama_quantize(f32, out, qtype, threads)
    finally:
        f32.unlink()


def tensor_types(gguf_path: Path) -> dict[str, int]:
    """How many tensors of each type the file holds (a K-quant's fallbacks show here)."""
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


class Generator:
    """The GGUF loaded once; `prefill()` evaluates the prompt from an empty cache, and
    `generate()` does that and then greedy-decodes: (the new tokens, seconds of each decode
    step; the first token comes from prefill, untimed). bench/decode_ab.py runs one too."""

    def __init__(self, gguf_path: Path, prompt: list[int], new: int, threads: int) -> None:
        import llama_cpp

        self.prompt, self.new = prompt, new
        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=max(256, len(prompt) + new + 16),
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.vocab = self.llm.n_vocab()
        self.version = llama_cpp.__version__
        self.last_prefill_s = 0.0

    def _last(self) -> int:
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab,)).argmax())

    def prefill(self) -> None:
        self.llm.reset()
        self.llm.eval(self.prompt)

    def generate(self) -> tuple[list[int], list[float]]:
        t0 = time.perf_counter()
        self.prefill()
        tokens, steps = [self._last()], []
        self.last_prefill_s = time.perf_counter() - t0  # the prompt to its first token
        for _ in range(self.new - 1):
            t0 = time.perf_counter()
            self.llm.eval([tokens[-1]])
            tok = self._last()
            steps.append(time.perf_counter() - t0)
            tokens.append(tok)
        return tokens, steps


def run(gguf_path: Path, prompt: list[int], new: int, threads: int, reps: int) -> dict[str, Any]:
    g = Generator(gguf_path, prompt, new, threads)
    prefill = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.prefill()
        prefill.append(time.perf_counter() - t0)
    tokens, steps = g.generate()
    return {
        "tokens": tokens,
        "steps": steps,
        "prefill": prefill,
        "version": g.version,
        "gguf_bytes": gguf_path.stat().st_size,
        "gguf": str(gguf_path),
        "tensor_types": tensor_types(gguf_path),
        "torch_imported": "torch" in sys.modules,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="write the GGUF (once), then time prefill and greedy decode")
    r.add_argument("--weights", required=True, help="export_weights()' folder")
    r.add_argument("--qtype", choices=QTYPES, required=True)
    r.add_argument("--work", required=True)
    r.add_argument("--reps", type=int, default=5)
    t = sub.add_parser("tokens", help="greedy token ids of any GGUF")
    t.add_argument("--gguf", required=True)
    for p in (r, t):
        p.add_argument("--prompt-ids", required=True)
        p.add_argument("--new", type=int, default=64)
        p.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    ids = json.loads(a.prompt_ids)
    if a.cmd == "tokens":
        json.dump({"tokens": Generator(Path(a.gguf), ids, a.new, a.threads).generate()[0]}, sys.stdout)
        return
    gguf_path = make_gguf(Path(a.weights), Path(a.work), a.qtype, a.threads)
    json.dump(run(gguf_path, ids, a.new, a.threads, a.reps), sys.stdout)


if __name__ == "__main__":
    main()
