"""A Llama written as onnxruntime-genai's model builder writes one (fp32, CPU), by hand from
a Hugging Face checkpoint's weights, following the builder's node patterns and the
com.microsoft op schemas (the builder itself is not installed here):

    attention_mask -> ReduceSum - 1 -> seqlens_k (int32); Shape[1] -> total_sequence_length
    Gather(embed_tokens) -> SimplifiedLayerNormalization (first layer's input norm)
    per layer: MatMul q/k/v -> [com.microsoft RotaryEmbedding(q|k, position_ids)]
               -> GroupQueryAttention(q, k, v, past.key, past.value, seqlens_k, total[, cos, sin])
               -> MatMul o -> SkipSimplifiedLayerNormalization (post-attention norm + residual)
               -> MatMul gate/up -> Sigmoid * gate * up -> MatMul down
               -> SkipSimplifiedLayerNormalization (next layer's input norm, or the final norm)
    MatMul lm_head -> logits;  GQA's present key/value -> present.<i>.key/value

`rotary="node"` rotates q and k with RotaryEmbedding nodes over a position_ids input (the
builder's older layout); `rotary="gqa"` inside GroupQueryAttention (do_rotary), with no
position_ids input: the positions come from the attention mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

MS = "com.microsoft"


def build(ckpt: Path, out: Path, rotary: str = "node") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt))
    sd = {k: v.detach().numpy() for k, v in AutoModelForCausalLM.from_pretrained(str(ckpt)).state_dict().items()}
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def init(name: str, a: np.ndarray) -> str:
        inits.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape),
                                        np.ascontiguousarray(a).ravel()))
        return name

    def node(op: str, ins: list[str], outs: list[str], domain: str = "", **attrs: object) -> list[str]:
        nodes.append(helper.make_node(op, ins, outs, name=f"/{op}_{len(nodes)}", domain=domain, **attrs))
        return outs

    def matmul(x: str, weight: str, out: str) -> str:
        return node("MatMul", [x, init(weight + ".T", sd[weight].T)], [out])[0]

    eps = float(cfg.rms_norm_eps)
    freqs = np.outer(np.arange(cfg.max_position_embeddings), 1.0 / theta ** (np.arange(0, d, 2) / d))
    cos, sin = init("cos_cache", np.cos(freqs).astype(np.float32)), init("sin_cache", np.sin(freqs).astype(np.float32))
    node("ReduceSum", ["attention_mask", init("one_axis", np.array([1], np.int64))], ["mask_sum"], keepdims=0)
    node("Sub", ["mask_sum", init("one", np.array(1, np.int64))], ["seqlens_i64"])
    node("Cast", ["seqlens_i64"], ["seqlens_k"], to=TensorProto.INT32)
    node("Shape", ["attention_mask"], ["mask_shape"])
    node("Gather", ["mask_shape", init("idx1", np.array(1, np.int64))], ["total_i64"], axis=0)
    node("Cast", ["total_i64"], ["total_sequence_length"], to=TensorProto.INT32)
    node("Gather", [init("embed", sd["model.embed_tokens.weight"]), "input_ids"], ["emb"], axis=0)
    node("SimplifiedLayerNormalization", ["emb", init("ln_in.0", sd["model.layers.0.input_layernorm.weight"])],
         ["norm.0"], axis=-1, epsilon=eps, stash_type=1)
    x, residual = "norm.0", "emb"
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = matmul(x, p + "self_attn.q_proj.weight", f"q.{i}"), matmul(x, p + "self_attn.k_proj.weight", f"k.{i}")
        v = matmul(x, p + "self_attn.v_proj.weight", f"v.{i}")
        if rotary == "node":
            q = node("RotaryEmbedding", [q, "position_ids", cos, sin], [f"q_rot.{i}"], MS, num_heads=hq)[0]
            k = node("RotaryEmbedding", [k, "position_ids", cos, sin], [f"k_rot.{i}"], MS, num_heads=hkv)[0]
        gqa_ins = [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
                   "total_sequence_length"] + ([cos, sin] if rotary == "gqa" else [])
        node("GroupQueryAttention", gqa_ins, [f"attn.{i}", f"present.{i}.key", f"present.{i}.value"], MS,
             num_heads=hq, kv_num_heads=hkv, do_rotary=int(rotary == "gqa"))
        o = matmul(f"attn.{i}", p + "self_attn.o_proj.weight", f"o.{i}")
        node("SkipSimplifiedLayerNormalization", [o, residual, init(f"ln_post.{i}", sd[p + "post_attention_layernorm.weight"])],
             [f"norm_post.{i}", "", "", f"res_post.{i}"], MS, epsilon=eps)
        gate = matmul(f"norm_post.{i}", p + "mlp.gate_proj.weight", f"gate.{i}")
        up = matmul(f"norm_post.{i}", p + "mlp.up_proj.weight", f"up.{i}")
        node("Sigmoid", [gate], [f"sig.{i}"])
        node("Mul", [gate, f"sig.{i}"], [f"silu.{i}"])
        node("Mul", [f"silu.{i}", up], [f"act.{i}"])
        down = matmul(f"act.{i}", p + "mlp.down_proj.weight", f"down.{i}")
        last = i == cfg.num_hidden_layers - 1
        w = sd["model.norm.weight"] if last else sd[f"model.layers.{i + 1}.input_layernorm.weight"]
        node("SkipSimplifiedLayerNormalization", [down, f"res_post.{i}", init(f"ln_next.{i}", w)],
             [f"norm.{i + 1}", "", "", f"res.{i + 1}"], MS, epsilon=eps)
        x, residual = f"norm.{i + 1}", f"res.{i + 1}"
    matmul(x, "lm_head.weight", "logits")

    kv = ["batch_size", hkv, "past_sequence_length", d]
    present = ["batch_size", hkv, "total_sequence_length", d]
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    if rotary == "node":
        ins.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", cfg.vocab_size])]
    for i in range(cfg.num_hidden_layers):
        for kind in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv))
            outs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present))
    g = helper.make_graph(nodes, "genai_llama", ins, outs, initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    onnx.save(model, str(out))
    return out
