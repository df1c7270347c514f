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
# What conftest's `gen_models` compiles with --max_seq_len (one slot each).
GEN_ARCHS = ["llama", "qwen2", "mistral", "deepseek_v3", "phi3"]
GEN_PREFILL, GEN_MAX_SEQ = 8, 48


def save_checkpoint(arch: str, path: str, seed: int = 0) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(make_config(arch))
    model.save_pretrained(path)


def hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    """The `new` tokens HF `generate(do_sample=False)` picks after `prompt` (no end-of-sequence stop)."""
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def prefill_vs_hf(sess: Any, model: Any, program: str | None = None, seed: int = 3) -> float:
    """Max abs difference of the logits of `sess` (arena filled with NaN first: nothing may read
    a byte it did not write) and of HF's `model` on seeded random ids of the program's shape.
    A prefill that computes one row (its `last_token` input) is run once per row: every row is
    compared."""
    import torch

    prog = sess.programs[program or next(iter(sess.programs))]
    ids_shape = prog.inputs[0].shape
    ids = torch.randint(0, model.config.vocab_size, ids_shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    if not any(t.name == "last_token" for t in prog.inputs):
        sess.arena.fill_(0xFF)
        got = sess.run({prog.inputs[0].name: ids}, prog.name)["logits"]
        return float((got - ref).abs().max())
    err = 0.0
    for row in range(ids_shape[1]):
        sess.arena.fill_(0xFF)
        rows = torch.full((ids_shape[0],), row)
        got = sess.run({prog.inputs[0].name: ids, "last_token": rows}, prog.name)["logits"]
        assert got.shape == ref[:, row:row + 1].shape, (got.shape, ref.shape)
        err = max(err, float((got - ref[:, row:row + 1]).abs().max()))
    return err


def moe_config(**overrides: Any) -> Any:
    import transformers as tf

    return tf.DeepseekV3Config(**{**dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=64), **overrides})


def export_onnx(ckpt: str, paths: dict[int, str]) -> None:
    """The checkpoint exported with torch.onnx.export(dynamo=True) to paths[opset] at each opset,
    with a dynamic batch and sequence, as deployment exports usually are."""
    import warnings

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.zeros(1, 16, dtype=torch.long)
    for opset, path in paths.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(model, (), kwargs={"input_ids": ids, "use_cache": False}, dynamo=True,
                                     opset_version=opset, verbose=False,
                                     dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "use_cache": None})
        prog.save(path)
