"""llama.cpp beside npuc's quantized decode: the same weights written as GGUF Q8_0 or Q4_0,
run by llama-cpp-python with the same thread count, prompt and greedy decoding.

Runs in the venv that bench/setup_llamacpp.sh makes (it sees this machine's torch and
transformers too); bench/run.py starts it as a child and reads the JSON it prints:

    /tmp/lcpvenv/bin/python bench/llamacpp.py --ckpt DIR --qtype Q4_0 --work DIR \
        --prompt-ids '[1, 2, 3]' --new 64 --threads 2

The GGUF is written here from the Hugging Face checkpoint, as llama.cpp's own
convert_hf_to_gguf.py would: the LLaMA tensor names, q and k rows permuted from HF's
rotate-half RoPE order to llama.cpp's interleaved one, norms in f32, and a synthetic
vocabulary (the benchmark feeds token ids, never text). Every matrix, the embedding table
included, takes the requested type, except `output.weight`, which stays Q8_0 under Q4_0:
the choice npuc makes for its LM head (docs/quantization.md), so both run the same mix.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (each head's first half, then its second) to llama.cpp's pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Path, out: Path, qtype: str) -> Path:
    import gguf
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    cfg = model.config
    if cfg.model_type != "llama":
        raise SystemExit(f"bench/llamacpp.py writes LLaMA GGUFs only, not {cfg.model_type}")
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    w.add_tokenizer_model("llama")
    vocab = cfg.vocab_size
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, t: Any, kind: Any = qt) -> None:
        a = t.detach().float().numpy()
        w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    def vector(name: str, t: Any) -> None:
        w.add_tensor(name, t.detach().float().numpy())

    sd = model.state_dict()
    matrix("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        vector(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        matrix(f"blk.{i}.attn_q.weight", torch.from_numpy(_permute(
            sd[p + "self_attn.q_proj.weight"].numpy(), cfg.num_attention_heads)))
        matrix(f"blk.{i}.attn_k.weight", torch.from_numpy(_permute(
            sd[p + "self_attn.k_proj.weight"].numpy(), cfg.num_key_value_heads)))
        matrix(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        matrix(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        vector(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        matrix(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        matrix(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        matrix(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    vector("output_norm.weight", sd["model.norm.weight"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    matrix("output.weight", head, gguf.GGMLQuantizationType.Q8_0 if qtype == "Q4_0" else qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


class Generator:
    """The GGUF loaded once; `prefill()` evaluates the prompt from an empty cache, and
    `generate()` does that and then greedy-decodes: (the new tokens, seconds of each decode
    step; the first token comes from prefill, untimed). bench/decode_ab.py runs one too."""

    def __init__(self, gguf_path: Path, prompt: list[int], new: int, threads: int) -> None:
        import llama_cpp

        self.prompt, self.new = prompt, new
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=max(256, len(prompt) + new + 16), n_batch=512,
                                   n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.version = llama_cpp.__version__

    def _last(self) -> int:
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab,)).argmax())

    def prefill(self) -> None:
        self.llm.reset()
        self.llm.eval(self.prompt)

    def generate(self) -> tuple[list[int], list[float]]:
        self.prefill()
        tokens, steps = [self._last()], []
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
    return {"tokens": tokens, "steps": steps, "prefill": prefill, "version": g.version,
            "gguf_bytes": gguf_path.stat().st_size, "gguf": str(gguf_path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--qtype", choices=["Q8_0", "Q4_0"], required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    out = Path(a.work) / f"model-{a.qtype}.gguf"
    if not out.is_file():
        write_gguf(Path(a.ckpt), out, a.qtype)
    res = run(out, json.loads(a.prompt_ids), a.new, a.threads, a.reps)
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
