"""The pass pipeline, readable on one screen."""

from __future__ import annotations

from npuc.ir import DType
from npuc.passes.align import TargetAlignment
from npuc.passes.attention_fusion import AttentionFusion
from npuc.passes.bias_fusion import BiasFusion
from npuc.passes.canonicalize import Canonicalize
from npuc.passes.constant_folding import ConstantFolding
from npuc.passes.cse import CommonSubexpressionElimination
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.decode_check import DecodeCheck
from npuc.passes.kv_cache import KVCache
from npuc.passes.last_token_logits import LastTokenLogits
from npuc.passes.manager import Pass
from npuc.passes.mla_fusion import MLAFusion
from npuc.passes.moe_fusion import MoEFusion
from npuc.passes.precision import Precision
from npuc.passes.quant_fusion import QuantFusion
from npuc.passes.quantize import Quantize
from npuc.passes.rmsnorm_fusion import RMSNormFusion
from npuc.passes.rope_fusion import RoPEFusion
from npuc.passes.score_chain import ScoreChain
from npuc.passes.swiglu_fusion import SwiGLUFusion


def default_pipeline(precision_mode: str = "must_keep_origin_dtype", keep_dtype: frozenset[str] = frozenset(),
                     tile: int = 16, max_head_dim: int = 256, kv_cache: KVCache | None = None,
                     last_token: LastTokenLogits | None = None, quantize: Quantize | None = None,
                     quant_activations: DType | None = DType.bf16,
                     decode_check: DecodeCheck | None = None) -> list[Pass]:
    """`kv_cache` (a prefill or decode program of a model with --max_seq_len) runs once
    attention is fused, before precision and alignment see the result, and `decode_check`
    (the two programs' DecodeCheck, sharing one probe) right after it; so does
    `last_token` (a prefill program computing the logits of one row). `quantize`
    (--quant_type) stores the weights of the fused products packed; quant-fusion, which
    always runs, makes products over packed weights (quantized or imported) read them so;
    `quant_activations` is the target's dtype for their activations (passes/precision.py).
    A `kv_cache` with a cache_dtype (--kv_cache_dtype) keeps its key and value caches in that
    dtype through the precision pass."""
    return [
        DeadCodeElimination(),
        ConstantFolding(),          # masks and cos/sin tables become constants
        Canonicalize(),             # one spelling per idiom, whatever the exporter
        ConstantFolding(),          # what canonicalisation made constant (a sparse mask that selects all)
        CommonSubexpressionElimination(),
        DeadCodeElimination(),
        RMSNormFusion(),
        SwiGLUFusion(),
        MoEFusion(),                # DeepSeek's router and routed experts (after SwiGLU)
        RoPEFusion(),
        ScoreChain(),               # hand-written attention's scale and mask, in one spelling
        AttentionFusion(),
        MLAFusion(),                # DeepSeek's latent attention, before the cache is laid out
        *([kv_cache] if kv_cache is not None else []),
        *([decode_check] if decode_check is not None else []),  # decode agrees with prefill
        *([last_token] if last_token is not None else []),  # then precision and alignment see a 1-row head
        BiasFusion(),
        *([quantize] if quantize is not None else []),  # once products and their biases are whole
        QuantFusion(),
        Precision(precision_mode, keep_dtype, quant_activations=quant_activations,
                  kv_cache_fixed=kv_cache is not None and kv_cache.cache_dtype is not None),
        TargetAlignment(tile, max_head_dim),   # pad matrix products and attention to the tile
        ConstantFolding(),
        CommonSubexpressionElimination(),
        DeadCodeElimination(),
    ]


def rope_table_pipeline() -> list[Pass]:
    """What the model needs to go through before its RoPE tables are `rope_lut` operands and
    its attention is fused (the masks then say causal, sliding window or other)."""
    passes = default_pipeline()
    return passes[:next(i for i, p in enumerate(passes) if isinstance(p, MLAFusion)) + 1]
