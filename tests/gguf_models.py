"""Tiny GGUF files for the tests, written with gguf-py's own writer (nothing is downloaded).

gguf-py quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; for the K-quants
(Q4_K, Q5_K, Q6_K) it can only dequantize, so `encode_k` below writes their blocks from
the block layouts (round to nearest; it only has to make valid blocks: the reference is
always gguf's dequantize of the bytes written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256

# Hugging Face -> GGUF names of the Llama/Qwen2 tensors (llama.cpp's convert_hf_to_gguf.py).
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{_LAYER[rest]}.{suffix}"
    return f"{_GLOBAL[stem]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's q/k rows into its RoPE's interleaved order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# -- K-quant blocks --------------------------------------------------------------------------------

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(-1)                                           # [n, 16]
    d = (amax.max(-1) / 32 / 127).astype(np.float16).astype(np.float32)  # [n]
    sc = np.clip(np.round(_safe_div(amax / 32, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.round(_safe_div(sub, step[..., None])) + 32, 0, 63).astype(np.uint8).reshape(n, 256)
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    e = np.arange(256)
    h, r = e // 128, e % 128
    for s in range(2):  # low nibbles: value 128h + 64s + c in ql[64h + c] >> 4s
        m = (r // 64) == s
        np.bitwise_or.at(ql, (slice(None), 64 * h[m] + r[m] % 64), (q[:, m] & 0xF) << (4 * s))
    for s in range(4):  # high pairs: value 128h + 32s + c in qh[32h + c] >> 2s
        m = (r // 32) == s
        np.bitwise_or.at(qh, (slice(None), 32 * h[m] + r[m] % 32), (q[:, m] >> 4) << (2 * s))
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)


def _scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (gguf-py's Q4_K.get_scale_min, inverted)."""
    d_ = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_ = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return np.concatenate([d_, m_, md], axis=1).astype(np.uint8)


def _k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w = d * sc * q - dmin * m per sub-block of 32: (codes [n, 256], d, dmin, sc, m)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    mn = np.maximum(-sub.min(-1), 0)
    scale = (sub.max(-1) + mn) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(mn, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc.astype(np.float32)
    off = dmin[:, None] * m.astype(np.float32)
    q = np.clip(np.round(_safe_div(sub + off[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return q.reshape(n, 256), d, dmin, sc, m


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Value 64c + 32s + i in nibble s of qs[32c + i]."""
    q = q.reshape(-1, 4, 2, 32) & 0xF
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _k_affine(x, 15)
    return np.concatenate([_f16(d), _f16(dmin), _scales_mins(sc, m), _nibbles_k(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _k_affine(x, 31)
    hi = (q >> 4).reshape(-1, 8, 32)                     # value 32s + i: bit s of qh[i]
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= hi[:, s] << s
    return np.concatenate([_f16(d), _f16(dmin), _scales_mins(sc, m), qh, _nibbles_k(q)], axis=1)


_K = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def encode(w: np.ndarray, type_name: str) -> np.ndarray:
    """w (f32 [..., K]) in GGUF type `type_name`: gguf-py's quantizer, or encode_k's."""
    import gguf

    qt = gguf.GGMLQuantizationType[type_name]
    if type_name not in _K and type_name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return gguf.quants.quantize(w.astype(np.float32), qt)
    if type_name not in _K:  # a type nobody here encodes (Q2_K, ...): valid-sized blocks of seeded bytes
        block, size = gguf.GGML_QUANT_SIZES[qt]
        rows = int(np.prod(w.shape[:-1]))
        raw = np.random.default_rng(0).integers(0, 256, (rows, w.shape[-1] // block * size), dtype=np.uint8)
        return raw.reshape(*w.shape[:-1], -1)
    rows = w.reshape(-1, w.shape[-1]).astype(np.float32)
    blocks = _K[type_name](rows.reshape(-1, QK_K))
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // QK_K * blocks.shape[-1])


def decode(data: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    with np.errstate(all="ignore"):  # seeded bytes of a type nobody encodes may decode to NaN
        return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).astype(np.float32)


# -- the tokenizer -------------------------------------------------------------------------------

CORPUS = ["the cat sat on the mat", "the dog ran in the park", "a cat and a dog", "hello world"] * 5


def bpe_tokenizer(vocab: int) -> Any:
    """A byte-level BPE (GPT-2 style) trained on CORPUS: <s>, </s>, the 256 byte symbols, merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok


def _tokenizer_metadata(w: Any, tok: Any, vocab: int) -> None:
    import json

    state = json.loads(tok.to_str())["model"]
    ids = sorted(state["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in ids] + [f"[PAD{i}]" for i in range(vocab - len(ids))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") or t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)


# -- the models ------------------------------------------------------------------------------------

DIMS = dict(vocab_size=288, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=0, eos_token_id=1)


def hf_model(arch: str, seed: int = 0) -> Any:
    """A random-init Llama or Qwen2 (f32), weights larger than HF's init so that greedy
    tokens are far from ties."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = (tf.LlamaConfig if arch == "llama" else tf.Qwen2Config)(**DIMS, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.05)
    return model


def write_gguf(path: Path, model: Any, types: dict[str, str], tokenizer: Any = None,
               extra: dict[str, np.ndarray] | None = None, drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """`model` (llama or qwen2) as a GGUF file, each 2-D weight in types[its HF name] (F32
    otherwise; 1-D tensors F32, as llama.cpp keeps them). Returns what HF should load to run
    the GGUF's own weights: each tensor dequantized by gguf-py, q/k rows un-permuted."""
    import gguf

    cfg = model.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer is not None:
        _tokenizer_metadata(w, tokenizer, cfg.vocab_size)
    ref: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        if name in drop:
            continue
        x = p.detach().float().numpy()
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        qk = arch == "llama" and ("q_proj" in name or "k_proj" in name)
        if qk:
            x = permute(x, heads)
        t = types.get(name, "F32")  # 1-D tensors F32 unless named (llama.cpp keeps them so)
        data = encode(x, t)
        back = decode(data, t).reshape(x.shape)
        ref[name] = unpermute(back, heads) if qk else back
        w.add_tensor(gguf_name(name), data, raw_dtype=gguf.GGMLQuantizationType[t])
    for name, x in (extra or {}).items():  # F32 tensors of llama.cpp's own (rope_freqs.weight)
        w.add_tensor(name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def reference(model: Any, weights: dict[str, np.ndarray]) -> Any:
    """A copy of `model` running `weights` (HF eager, f32)."""
    import copy

    import torch

    ref = copy.deepcopy(model)
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()})
    return ref.eval()


# -- the other architectures: tiny models written as llama.cpp's converter would ---------------------

_MORE_LAYER = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
               "mlp.gate_up_proj": "ffn_up", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
               "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
               "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
               "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def small_config(arch: str) -> Any:
    """Hugging Face configs of the GGUF architectures beyond llama and qwen2 (dims of 64: F32 and Q8_0)."""
    import transformers as tf
    from hf_models import COMMON, make_config, moe_config

    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)
    if arch == "gemma":
        return tf.GemmaConfig(**COMMON, head_dim=16)
    if arch in ("mistral", "phi3"):
        return make_config(arch)
    if arch == "deepseek2-v3":  # sigmoid routing, a q LoRA, grouped experts; kv_b stored split (llama.cpp 2025)
        return moe_config()
    if arch == "deepseek2-v2":  # softmax routing, no q LoRA
        return tf.DeepseekV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                   num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                                   num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, max_position_embeddings=64, tie_word_embeddings=False)
    raise KeyError(arch)


def _metadata(w: Any, cfg: Any, a: str) -> None:
    u32 = {"context_length": cfg.max_position_embeddings, "block_count": cfg.num_hidden_layers,
           "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
           "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
           "vocab_size": cfg.vocab_size}
    f32 = {"attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "rope.freq_base": cfg.rope_parameters["rope_theta"]}
    if a in ("qwen3", "gemma"):
        u32.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim})
    if a == "deepseek2":
        rope = cfg.qk_rope_head_dim
        u32.update({"leading_dense_block_count": cfg.first_k_dense_replace,
                    "expert_feed_forward_length": cfg.moe_intermediate_size, "expert_count": cfg.n_routed_experts,
                    "expert_shared_count": cfg.n_shared_experts, "expert_used_count": cfg.num_experts_per_tok,
                    "attention.kv_lora_rank": cfg.kv_lora_rank, "rope.dimension_count": rope,
                    "attention.key_length": cfg.qk_nope_head_dim + rope, "attention.value_length": cfg.v_head_dim,
                    "expert_gating_func": 2 if cfg.model_type == "deepseek_v3" else 1,
                    "expert_group_count": cfg.n_group or 1, "expert_group_used_count": cfg.topk_group or 1})
        if cfg.q_lora_rank:
            u32["attention.q_lora_rank"] = cfg.q_lora_rank
        f32["expert_weights_scale"] = cfg.routed_scaling_factor
        w.add_bool(f"{a}.expert_weights_norm", bool(cfg.norm_topk_prob))
        rs = cfg.rope_parameters
        if rs.get("rope_type") == "yarn":
            w.add_string(f"{a}.rope.scaling.type", "yarn")
            f32["rope.scaling.factor"] = rs["factor"]
            u32["rope.scaling.original_context_length"] = rs["original_max_position_embeddings"]
            f32["rope.scaling.yarn_log_multiplier"] = 0.1 * rs["mscale_all_dim"]
    for k, v in u32.items():
        w.add_uint32(f"{a}.{k}", int(v))
    for k, v in f32.items():
        w.add_float32(f"{a}.{k}", float(v))


def write_arch(path: Path, arch: str, type_name: str = "F32", seed: int = 0, tokenizer: Any = None
               ) -> tuple[Any, dict[str, np.ndarray]]:
    """A tiny random-init model of `arch` (small_config) as a GGUF file, its 2-D weights in
    `type_name` where their rows allow it (F32 otherwise): (the HF model, the weights HF runs
    the GGUF with: gguf's dequantized values, q/k un-permuted, Gemma's norms as HF keeps them)."""
    import gguf
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = small_config(arch)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() >= 2 else 0.3).add_(1.0 if p.dim() == 1 else 0.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: picks other experts
                b.normal_(0, 0.5)
    a = "deepseek2" if arch.startswith("deepseek2") else arch
    w = gguf.GGUFWriter(str(path), a)
    _metadata(w, cfg, a)
    if tokenizer is not None:
        _tokenizer_metadata(w, tokenizer, cfg.vocab_size)
    tied = getattr(cfg, "tie_word_embeddings", False)
    ref: dict[str, np.ndarray] = {}

    def put(name: str, x: np.ndarray, t: str) -> np.ndarray:
        t = t if x.ndim >= 2 and x.shape[-1] % 32 == 0 else "F32"
        data = encode(x, t)
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[t])
        return decode(data, t).reshape(x.shape)

    for name, p in model.state_dict().items():
        x = p.detach().float().numpy()
        if name == "lm_head.weight" and tied:
            continue
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            if rest == "mlp.experts":  # fused experts: llama.cpp stores gate, up and down stacked over the experts
                if suffix == "gate_up_proj":
                    half = x.shape[1] // 2
                    ref[name] = np.concatenate([put(f"blk.{i}.ffn_gate_exps.weight", x[:, :half], type_name),
                                                put(f"blk.{i}.ffn_up_exps.weight", x[:, half:], type_name)], axis=1)
                else:
                    ref[name] = put(f"blk.{i}.ffn_down_exps.weight", x, type_name)
                continue
            if suffix == "e_score_correction_bias":
                ref[name] = put(f"blk.{i}.exp_probs_b.bias", x, "F32")
                continue
            if rest == "self_attn.kv_b_proj" and arch == "deepseek2-v3":  # split, as llama.cpp's converter now does
                heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
                kv = x.reshape(heads, nope + v, cfg.kv_lora_rank)
                kb = put(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), "F32")
                vb = put(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv[:, nope:]), "F32")
                ref[name] = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(x.shape)
                continue
            base = _MORE_LAYER.get(rest) or _LAYER[rest]
            gname = f"blk.{i}.{base}.{suffix}"
        else:
            gname = f"{_GLOBAL[stem]}.{suffix}"
        qk = arch == "mistral" and rest in ("self_attn.q_proj", "self_attn.k_proj") if stem.startswith("model.l") \
            else False
        heads = cfg.num_attention_heads if qk and rest.endswith("q_proj") else cfg.num_key_value_heads
        if qk:
            ref[name] = unpermute(put(gname, permute(x, heads), type_name), heads)
        elif arch == "gemma" and name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms + 1
            ref[name] = put(gname, x + 1, "F32") - 1
        else:
            ref[name] = put(gname, x, type_name)
    if tied:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, ref
