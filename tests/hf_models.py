"""Tiny random-init Hugging Face configs shared by the tests (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def make_config(arch: str) -> Any:
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if arch == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        return tf.Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "deepseek_v3":
        # Dense layers only (first_k_dense_replace == num_hidden_layers), MLA attention, YaRN RoPE.
        return tf.DeepseekV3Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, max_position_embeddings=64,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                              beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    raise KeyError(arch)


ARCHS = ["llama", "qwen2", "mistral", "phi3", "deepseek_v3"]


def save_checkpoint(arch: str, path: str, seed: int = 0) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(make_config(arch))
    model.save_pretrained(path)
