"""GGUF files (llama.cpp's format) as a model source: `npuc compile model.gguf ...`.

The architecture and its hyper-parameters come from the file's metadata
(`general.architecture`, `<arch>.block_count`, ...), mapped onto a Hugging Face config;
transformers builds that model with no memory behind its parameters (as for a checkpoint
folder, compiler/loaders.py), and each parameter is found as a GGUF tensor that is read
only when the `.om` is written. Quantized tensors keep their codes where npuc's layout
(ir/quant.py) holds the format exactly, and become `dequantize` over them:

    blk.0.attn_q.weight  Q4_0 [N, K]  ->  %w = dequantize[bits=4, group_size=32](@q : u8[N,K/2],
                                                   @scale : f16[N,K/32], @zero : u8[N,K/32])

| GGUF | npuc | exact |
|---|---|---|
| Q8_0 | 8-bit, g32, f16 scale d, zero 0, codes as stored | yes |
| Q4_0 | 4-bit, g32, f16 scale d, zero 8, nibbles reordered | yes |
| Q5_0 | 8-bit codes q - 16, g32, f16 scale d, zero 0 | yes |
| Q6_K | 8-bit codes q - 32, g16, f32 scale d * sc, zero 0 | yes |
| Q4_1, Q5_1, Q4_K, Q5_K | float: gguf's own dequantized values | yes, at 32 bits a weight |
| F32, F16, BF16 | float, in the model's dtype | yes (a cast is checked) |

(a minimum per block, `d * q + m`, has no integer zero point). Each tensor's treatment is
logged (`--log info`), and a summary of those kept as floats is a warning. llama.cpp's
converter permutes the rows of q and k for its RoPE (llama, mistral); the permutation is
undone on the stored rows, codes included. docs/gguf.md has the details.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import ConstSource, DType, TensorType

log = logging.getLogger("npuc")


def is_gguf(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike)) and os.fspath(model).lower().endswith(".gguf")


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise NpucError("NPUC-E0104", "reading a GGUF file needs the gguf package", "pip install 'npuc[gguf]'",
                        exit_code=EXIT_USAGE) from None
    return gguf


def _damaged(path: str, what: str) -> NpucError:
    return NpucError("NPUC-E0407", f"cannot read GGUF file {path!r}: {what}"[:400],
                     "the file is damaged or truncated: download or convert it again", exit_code=EXIT_IO)


# -- architectures ---------------------------------------------------------------------------

# `<arch>.<key>` metadata -> Hugging Face config key, for every architecture below.
_COMMON_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
}
# Tensors of layer i, `blk.{i}.<gguf>` -> `model.layers.{i}.<hf>` (llama.cpp's names, gguf-py's constants).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # DeepSeek-V2/V3: multi-head latent attention and routed experts
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Layer tensors that make a whole Hugging Face tensor (suffix included), alone or joined:
# stacked experts, gate and up concatenated as transformers' fused experts; MLA's kv_b split
# in two; DeepSeek-V3's routing bias (a buffer).
_WHOLE = {"ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
          "ffn_down_exps": "mlp.experts.down_proj", "attn_k_b": "self_attn.kv_b_proj.weight",
          "attn_v_b": "self_attn.kv_b_proj.weight", "exp_probs_b": "mlp.gate.e_score_correction_bias"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto transformers."""

    model_type: str
    permute_qk: bool = False  # llama.cpp's converter permuted the rows of q and k (LlamaModel.permute)
    keys: Mapping[str, str] = field(default_factory=dict)  # beyond _COMMON_KEYS
    renames: Mapping[str, str] = field(default_factory=dict)  # beyond _LAYER_TENSORS
    norm_plus_one: bool = False  # Gemma: the converter stored norm weights + 1

    def layer_name(self, base: str) -> str | None:
        return self.renames.get(base, _LAYER_TENSORS.get(base))


_HEAD_DIM = {"attention.key_length": "head_dim"}
ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permute_qk=True, keys=_HEAD_DIM),
    "mistral": Arch("mistral", permute_qk=True, keys=_HEAD_DIM),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3", keys=_HEAD_DIM),
    "gemma": Arch("gemma", keys=_HEAD_DIM, norm_plus_one=True),
    "phi3": Arch("phi3", keys={"attention.sliding_window": "sliding_window"}, renames={"ffn_up": "mlp.gate_up_proj"}),
    "deepseek2": Arch("deepseek_v2", keys={
        "leading_dense_block_count": "first_k_dense_replace", "expert_feed_forward_length": "moe_intermediate_size",
        "expert_count": "n_routed_experts", "expert_shared_count": "n_shared_experts",
        "expert_used_count": "num_experts_per_tok", "expert_weights_scale": "routed_scaling_factor",
        "expert_weights_norm": "norm_topk_prob", "attention.q_lora_rank": "q_lora_rank",
        "attention.kv_lora_rank": "kv_lora_rank", "rope.dimension_count": "qk_rope_head_dim",
        "expert_group_count": "n_group", "expert_group_used_count": "topk_group"}),
}


def _unsupported_arch(arch: str) -> NpucError:
    return NpucError("NPUC-E0306", f"GGUF architecture {arch!r} is not supported",
                     "npuc imports GGUF files of: " + ", ".join(sorted(ARCHS)), exit_code=EXIT_UNSUPPORTED)


# -- the file ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor lies in the file. `shape` is torch's order (GGUF lists ne0 first)."""

    name: str
    type_name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    block: tuple[int, int]  # (values, bytes) per block; (1, itemsize) for plain types

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.block[0] * self.block[1]


def _field_value(f: Any, gguf: Any) -> Any:
    """A metadata field's value: str, int, float, bool or a list of them."""
    vt = gguf.GGUFValueType

    def one(part: Any, kind: Any) -> Any:
        if kind == vt.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        v = part.tolist()
        v = v[0] if isinstance(v, list) and len(v) == 1 else v
        return bool(v) if kind == vt.BOOL else v

    if not f.types:
        return None
    if f.types[0] == vt.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


@dataclass
class GgufFile:
    """A GGUF file's metadata and tensor table (no tensor data read)."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, size: int, mtime: float) -> GgufFile:
    gguf = _gguf()
    if size < 24:
        raise _damaged(path, f"{size} bytes is too short for a GGUF header")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise _damaged(path, "no GGUF magic at the start")
    try:
        reader = gguf.GGUFReader(path, "r")
        metadata = {k: _field_value(v, gguf) for k, v in reader.fields.items()}
        tensors = {}
        for t in reader.tensors:
            qt = gguf.GGMLQuantizationType(int(t.tensor_type))
            block = gguf.GGML_QUANT_SIZES[qt]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[t.name] = GgufTensor(t.name, qt.name, int(qt), shape, int(t.data_offset), int(t.n_bytes), block)
    except NpucError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf's reader on a damaged file: ValueError, IndexError, KeyError...
        raise _damaged(path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for t in tensors.values():
        if t.offset + t.nbytes > size:
            raise _damaged(path, f"tensor {t.name} ends at byte {t.offset + t.nbytes}, past the file's {size}")
    return GgufFile(path, metadata, tensors)


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read {p!r}: {e.strerror}", "check the path", exit_code=EXIT_IO) from None
    return _read_cached(os.path.abspath(p), st.st_size, st.st_mtime)


def _read_rows(path: str, t: GgufTensor) -> np.ndarray:
    """The tensor's stored bytes as uint8 [rows, row_bytes]."""
    with open(path, "rb") as f:
        f.seek(t.offset)
        buf = f.read(t.nbytes)
    if len(buf) != t.nbytes:
        raise _damaged(path, f"tensor {t.name} is cut short")
    return np.frombuffer(buf, dtype=np.uint8).reshape(t.rows, t.row_bytes)


# -- llama.cpp's q/k row permutation -------------------------------------------------------------

def qk_rows_order(rows: int, heads: int) -> torch.Tensor:
    """Which stored row each Hugging Face row is: llama.cpp's converter writes q (and k, with
    the KV heads) as w.reshape(heads, 2, d/2, K).swapaxes(1, 2), interleaving each head's two
    halves for its RoPE; HF row (h, j, i) is stored at (h, i, j). gguf[order] is HF's."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


# -- conversions of a tensor's stored rows (pure: uint8 [N, row_bytes] in) --------------------------

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _blocks(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    return raw.reshape(raw.shape[0], -1, nbytes)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 from its two bytes [..., 2]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """A 32-value block's 16 bytes [..., 16] as codes [..., 32]: GGUF's Q4_0/Q5_0 put values
    0..15 in the low nibbles and 16..31 in the high ones."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1).to(torch.int32)


def q8_0_parts(raw: torch.Tensor) -> Parts:
    """Q8_0 (34-byte blocks: f16 d, 32 i8 q; w = d * q): 8-bit codes as stored, g32."""
    b = _blocks(raw, 34)
    n, nb = b.shape[:2]
    q = b[..., 2:].contiguous().view(torch.int8).reshape(n, nb * 32)
    return q, _f16(b[..., :2]), torch.zeros(n, nb, dtype=torch.int8)


def q4_0_parts(raw: torch.Tensor) -> Parts:
    """Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles; w = d * (q - 8)): 4-bit, g32, zero 8."""
    from npuc.ir.quant import pack4

    b = _blocks(raw, 18)
    n, nb = b.shape[:2]
    codes = _nibbles_32(b[..., 2:]).reshape(n, nb * 32)
    return pack4(codes), _f16(b[..., :2]), torch.full((n, nb), 8, dtype=torch.uint8)


def q5_0_parts(raw: torch.Tensor) -> Parts:
    """Q5_0 (22-byte blocks: f16 d, u32 of fifth bits, 16 bytes of nibbles; w = d * (q - 16)):
    8-bit codes q - 16, g32, zero 0."""
    b = _blocks(raw, 22)
    n, nb = b.shape[:2]
    qh = b[..., 2:6].to(torch.int64)
    bits = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
    high = (bits.unsqueeze(-1) >> torch.arange(32)) & 1
    codes = _nibbles_32(b[..., 6:]) | (high.to(torch.int32) << 4)
    return (codes - 16).to(torch.int8).reshape(n, nb * 32), _f16(b[..., :2]), torch.zeros(n, nb, dtype=torch.int8)


def q6_k_parts(raw: torch.Tensor) -> Parts:
    """Q6_K (210-byte super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs,
    16 i8 scales, f16 d; w = d * sc[j] * (q - 32) for the 16 values of sub-block j): 8-bit codes
    q - 32, g16, f32 scale d * sc (a product of an f16 and an i8, exact in f32)."""
    b = _blocks(raw, 210)
    n, nb = b.shape[:2]
    ql, qh = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32)
    sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[..., 208:210]).to(torch.float32)
    # value 128h + 64s + c (h, s < 2, c < 64): low bits (ql[64h + c] >> 4s) & 15; value 128h + 32s + c
    # (s < 4, c < 32): high bits (qh[32h + c] >> 2s) & 3 (gguf-py's Q6_K.dequantize_blocks).
    low = ((ql.reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4]).reshape(1, 1, 1, 2, 1)) & 0xF).reshape(n, nb, 256)
    high = ((qh.reshape(n, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 1, 4, 1)) & 3).reshape(n, nb, 256)
    q = ((low | (high << 4)) - 32).to(torch.int8).reshape(n, nb * 256)
    scale = (d.unsqueeze(-1) * sc).reshape(n, nb * 16)
    return q, scale, torch.zeros(n, nb * 16, dtype=torch.int8)


@dataclass(frozen=True)
class Kept:
    """A GGUF type npuc's layout holds exactly: its conversion and the layout it gives."""

    bits: int
    group: int
    scale_dtype: DType
    convert: Callable[[torch.Tensor], Parts]
    how: str


KEPT: dict[str, Kept] = {
    "Q8_0": Kept(8, 32, DType.f16, q8_0_parts, "8-bit g32 (codes kept)"),
    "Q4_0": Kept(4, 32, DType.f16, q4_0_parts, "4-bit g32 (codes kept, nibbles reordered)"),
    "Q5_0": Kept(8, 32, DType.f16, q5_0_parts, "8-bit g32 (5-bit codes kept as q - 16)"),
    "Q6_K": Kept(8, 16, DType.f32, q6_k_parts, "8-bit g16, f32 scales (6-bit codes kept as q - 32)"),
}
# Decoded to floats by gguf's own dequantize: exact, but not codes.
DEQUANTIZED = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
FLOATS = {"F32": DType.f32, "F16": DType.f16, "BF16": DType.bf16}
SUPPORTED_TYPES = (*FLOATS, *KEPT, *DEQUANTIZED)


def float_rows(raw: np.ndarray, t: GgufTensor) -> torch.Tensor:
    """Any supported type's values as stored ([rows, K]): float types as they are, the
    others through gguf.quants.dequantize (f32)."""
    if t.type_name == "F32":
        return torch.from_numpy(raw.copy().view(np.float32))
    if t.type_name == "F16":
        return torch.from_numpy(raw.copy().view(np.float16))
    if t.type_name == "BF16":
        return torch.from_numpy(raw.copy().view(np.int16)).view(torch.bfloat16)
    gguf = _gguf()
    qt = gguf.GGMLQuantizationType[t.type_name]
    out = np.empty((raw.shape[0], raw.shape[1] // t.block[1] * t.block[0]), np.float32)
    for r in range(0, raw.shape[0], _ROWS):  # gguf's temporaries are a few times the rows it is given
        out[r:r + _ROWS] = gguf.quants.dequantize(raw[r:r + _ROWS], qt)
    return torch.from_numpy(out)


_ROWS = 1024  # rows converted at a time: bounds the temporaries of a 150k-row embedding


def by_rows(convert: Callable[[torch.Tensor], Parts]) -> Callable[[torch.Tensor], Parts]:
    """`convert` applied to row blocks of at most _ROWS rows, the parts concatenated."""

    def run(raw: torch.Tensor) -> Parts:
        if raw.shape[0] <= _ROWS:
            return convert(raw)
        chunks = [convert(raw[r:r + _ROWS]) for r in range(0, raw.shape[0], _ROWS)]
        q, scale, zero = (torch.cat([c[i] for c in chunks]) for i in range(3))
        return q, scale, zero

    return run


# -- lazy sources ------------------------------------------------------------------------------

class GgufRows:
    """One tensor's stored bytes, uint8 [rows, row_bytes], its rows in Hugging Face's order
    (`order`: llama.cpp's q/k permutation undone). The input of a `Repacked`."""

    in_memory = False

    def __init__(self, path: str, t: GgufTensor, order: torch.Tensor | None) -> None:
        self.path, self.t, self.order = path, t, order

    def load(self) -> torch.Tensor:
        raw = torch.from_numpy(_read_rows(self.path, self.t).copy())
        return raw if self.order is None else raw[self.order].contiguous()

    def describe(self) -> str:
        return f"{os.path.basename(self.path)}:{self.t.name}" + (" (q/k rows un-permuted)" if self.order is not None
                                                                 else "")


class GgufFloatSource:
    """Tensors read as floats in the model's dtype: rows un-permuted (`order`), `offset`
    subtracted (Gemma's norms), several joined along dim 1 (the experts' gate and up, MLA's
    k_b and v_b). A cast that changes a value is logged as a warning when the weight is written."""

    in_memory = False

    def __init__(self, path: str, ts: list[GgufTensor], dtype: torch.dtype, shape: tuple[int, ...],
                 order: torch.Tensor | None = None, offset: float = 0.0) -> None:
        self.path, self.ts, self.dtype, self.shape, self.order, self.offset = path, ts, dtype, shape, order, offset

    def file_range(self, want: TensorType) -> tuple[str, int, int] | None:
        t = self.ts[0] if len(self.ts) == 1 else None
        if t is None or self.order is not None or self.offset or FLOATS.get(t.type_name) != want.dtype \
                or t.shape != want.shape or t.nbytes != want.nbytes:
            return None
        return self.path, t.offset, t.nbytes

    def _one(self, t: GgufTensor) -> torch.Tensor:
        w = float_rows(_read_rows(self.path, t), t).reshape(t.shape)
        if self.order is not None:
            w = w[self.order]
        if self.offset:
            w = w.float() - self.offset
        return w

    def load(self) -> torch.Tensor:
        parts = [self._one(t) for t in self.ts]
        if len(parts) == 2 and self.ts[0].name.endswith("attn_k_b.weight"):
            # MLA's kv_b_proj, which llama.cpp (since 2025) stores split: k_b [heads, kv_lora, nope]
            # (transposed, for its absorbed attention) and v_b [heads, v_dim, kv_lora].
            parts = [parts[0].transpose(1, 2), parts[1]]
        w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        out = w.to(self.dtype).reshape(self.shape).contiguous()
        if w.dtype != self.dtype and w.is_floating_point():
            changed = int((out.to(w.dtype) != w).sum())
            if changed:
                log.warning("%s: %d of %d values rounded in the cast from %s to %s", self.describe(), changed,
                            w.numel(), w.dtype, self.dtype)
        return out

    def describe(self) -> str:
        names = "+".join(t.name for t in self.ts)
        return f"{os.path.basename(self.path)}:{names}" + (" (q/k rows un-permuted)" if self.order is not None else "")


# -- building the model --------------------------------------------------------------------------

@dataclass
class Treatment:
    """What one GGUF tensor became: logged, and listed by `treatments`."""

    tensor: str
    gguf_type: str
    how: str
    exact: bool = True

    def __str__(self) -> str:
        return f"{self.tensor} {self.gguf_type} -> {self.how}"


def hf_config(g: GgufFile) -> Any:
    """The Hugging Face config that the file's metadata describes."""
    import transformers

    arch = ARCHS.get(g.arch)
    if arch is None:
        raise _unsupported_arch(g.arch or "(none)")
    kw: dict[str, Any] = {}
    for key, name in {**_COMMON_KEYS, **arch.keys}.items():
        v = g.get(key)
        if v is not None:
            kw[name] = v
    if "vocab_size" not in kw:
        tokens = g.metadata.get("tokenizer.ggml.tokens")
        emb = g.tensors.get("token_embd.weight")
        kw["vocab_size"] = emb.shape[0] if emb is not None else len(tokens or [])
    kw["tie_word_embeddings"] = "output.weight" not in g.tensors
    for gk, hk in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                   ("padding_token_id", "pad_token_id")):
        v = g.metadata.get(f"tokenizer.ggml.{gk}")
        # The config class's defaults (Phi-3's pad 32000) may lie outside a small vocabulary.
        kw[hk] = int(v) if v is not None and int(v) < kw["vocab_size"] else None
    scaling = str(g.get("rope.scaling.type", "none"))
    if scaling not in ("none", ""):
        factor = float(g.get("rope.scaling.factor", 1.0))
        rope: dict[str, Any] = {"rope_type": scaling, "factor": factor}
        if g.get("rope.scaling.original_context_length") is not None:
            rope["original_max_position_embeddings"] = int(g.get("rope.scaling.original_context_length"))
        if scaling == "yarn" and g.get("rope.scaling.yarn_log_multiplier") is not None:
            mscale = float(g.get("rope.scaling.yarn_log_multiplier")) / 0.1  # llama.cpp stores 0.1 * mscale_all_dim
            rope.update(mscale=mscale, mscale_all_dim=mscale)
        kw["rope_scaling"] = rope
    longrope = _longrope(g)
    if longrope is not None:
        kw["rope_scaling"] = longrope
        kw["original_max_position_embeddings"] = longrope["original_max_position_embeddings"]
    model_type = arch.model_type
    if g.arch == "deepseek2":
        model_type = _deepseek_config(g, kw)
    if model_type == "mistral":
        kw.setdefault("sliding_window", g.get("attention.sliding_window"))
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kw)
    except (ValueError, KeyError, TypeError) as e:
        raise NpucError("NPUC-E0306", f"transformers cannot make a {model_type} config from {g.path!r}: {e}",
                        "check that your transformers version supports this architecture",
                        exit_code=EXIT_UNSUPPORTED) from None
    cfg.architectures = [f"{type(cfg).__name__.removesuffix('Config')}ForCausalLM"]
    return cfg


def _deepseek_config(g: GgufFile, kw: dict[str, Any]) -> str:
    """DeepSeek-V2 (softmax routing) or V3 (sigmoid routing with a score bias): the MLA head
    sizes and the routing from the metadata."""
    rope = int(g.get("rope.dimension_count", 64))
    key = int(g.get("attention.key_length_mla", g.get("attention.key_length", 192)))
    kw["qk_nope_head_dim"] = key - rope
    kw["v_head_dim"] = int(g.get("attention.value_length_mla", g.get("attention.value_length", 128)))
    kw.setdefault("q_lora_rank", None)
    kw.setdefault("n_group", 1)
    kw.setdefault("topk_group", 1)
    kw.setdefault("n_shared_experts", 0)
    kw.setdefault("first_k_dense_replace", kw.get("num_hidden_layers", 0))
    if "norm_topk_prob" in kw:
        kw["norm_topk_prob"] = bool(kw["norm_topk_prob"])
    sigmoid = int(g.get("expert_gating_func", 1)) == 2
    if not sigmoid:
        kw["topk_method"] = "group_limited_greedy" if kw["n_group"] > 1 else "greedy"
    return "deepseek_v3" if sigmoid else "deepseek_v2"


def model_dtype(g: GgufFile) -> torch.dtype:
    """f16 (bf16) when every tensor is stored F16 (BF16), so that nothing is rounded on the
    way in; f32 otherwise (llama.cpp computes in f32 too), which is the case of llama.cpp's
    own F16 and BF16 files: their norms are F32, and rounding them would run the model on
    other weights than the file's (docs/gguf.md)."""
    kinds = {t.type_name for t in g.tensors.values()}
    if kinds == {"F16"}:
        return torch.float16
    if kinds == {"BF16"}:
        return torch.bfloat16
    return torch.float32


def _hf_names(g: GgufFile, arch: Arch) -> dict[str, list[str]]:
    """Hugging Face parameter name -> the GGUF tensors it is read from."""
    out: dict[str, list[str]] = {}
    for name in g.tensors:
        stem, _, suffix = name.rpartition(".")
        if name.startswith("blk."):
            _, layer, base = stem.split(".", 2) if stem.count(".") >= 2 else ("", "", stem)
            if base in _WHOLE:
                out.setdefault(f"model.layers.{layer}.{_WHOLE[base]}", []).append(name)
                continue
            hf = arch.layer_name(base)
            if hf is not None:
                out[f"model.layers.{layer}.{hf}.{suffix}"] = [name]
        elif stem in _GLOBAL_TENSORS:
            out[f"{_GLOBAL_TENSORS[stem]}.{suffix}"] = [name]
    for names in out.values():  # experts: gate before up, as transformers concatenates them; k_b before v_b
        names.sort(key=lambda n: "ffn_up_exps" in n or "attn_v_b" in n)
    return out


def _weight(g: GgufFile, name: str, tensors: list[str], shape: tuple[int, ...], dtype: torch.dtype, arch: Arch,
            cfg: Any) -> tuple[ConstSource, Treatment]:
    """The source of parameter `name` and what was done to it."""
    from npuc.compiler.quant_import import QuantizedWeight, Repacked, RepackedSource

    ts = [g.tensors[n] for n in tensors]
    for t in ts:
        if t.type_name not in SUPPORTED_TYPES:
            raise NpucError("NPUC-E0309", f"{t.name} is stored as {t.type_name}, which npuc does not import",
                            "npuc imports GGUF tensors of types " + ", ".join(SUPPORTED_TYPES)
                            + "; requantize the file with llama-quantize", exit_code=EXIT_UNSUPPORTED)
    numel = sum(int(np.prod(t.shape)) for t in ts)
    if numel != int(np.prod(shape)) or (len(ts) == 1 and len(shape) == 2 and ts[0].shape != shape):
        stored = " + ".join(f"{t.name} {list(t.shape)}" for t in ts)
        raise NpucError("NPUC-E0314", f"{stored}: the metadata makes {name} {list(shape)}",
                        "the file's tensors do not match its metadata", exit_code=EXIT_IO)
    order = None
    t0 = ts[0]
    if arch.permute_qk and len(ts) == 1 and (".attn_q." in t0.name or ".attn_k." in t0.name):
        heads = cfg.num_attention_heads if ".attn_q." in t0.name else cfg.num_key_value_heads
        order = qk_rows_order(t0.rows, heads)
    unpermuted = ", q/k rows un-permuted" if order is not None else ""
    kept = KEPT.get(t0.type_name)
    if kept is not None and len(ts) == 1 and len(shape) == 2 and shape[1] % kept.group == 0:
        rep = Repacked(by_rows(kept.convert), [GgufRows(g.path, t0, order)], f"GGUF {t0.type_name}")
        parts = [RepackedSource(rep, i) for i in range(3)]
        qw = QuantizedWeight(parts[0], parts[1], parts[2], shape[0], shape[1], kept.bits, kept.group,
                             kept.scale_dtype, DType.from_torch(dtype), f"GGUF {t0.type_name}")
        return qw, Treatment(t0.name, t0.type_name, kept.how + unpermuted)
    offset = 1.0 if arch.norm_plus_one and len(shape) == 1 and name.endswith("norm.weight") else 0.0
    src = GgufFloatSource(g.path, ts, dtype, shape, order, offset)
    stored_dt = FLOATS.get(t0.type_name)
    want = DType.from_torch(dtype)
    if stored_dt is None:
        why = "no npuc layout keeps its codes" if t0.type_name not in KEPT else \
            "stacked experts and joined tensors are read as floats"
        how, exact = f"{want} (dequantized by gguf, exact values; {why})", True
        if want != DType.f32:
            how, exact = f"{want} (dequantized, rounded to {want})", False
    elif stored_dt == want:
        how, exact = f"{want} (as stored)", True
    else:
        widening = stored_dt.itemsize < want.itemsize
        how, exact = f"{want} ({'widened, exact' if widening else 'cast; rounding is logged when written'})", widening
    if offset:
        how += ", minus 1 (Gemma's norm)"
    return src, Treatment("+".join(tensors), t0.type_name, how + unpermuted, exact)


def load_gguf(path: str | os.PathLike[str]) -> Any:
    """A GGUF file as a LoadedModel: the module transformers builds from the mapped config, its
    parameters on no memory, each one a lazy source over the file (compiler/loaders.py)."""
    return _build(path)[0]


def treatments(path: str | os.PathLike[str]) -> list[Treatment]:
    """What each tensor of a GGUF file becomes (the model is built again; no weight is read)."""
    return _build(path)[1]


def _build(path: str | os.PathLike[str]) -> tuple[Any, list[Treatment]]:
    from npuc.compiler.loaders import (
        _INT_INPUTS,
        LoadedModel,
        _has_experts_choice,
        _parameters_without_memory,
        give_storage,
        missing_weights,
        parameter_owners,
    )

    try:
        import transformers
    except ImportError:
        raise NpucError("NPUC-E0104", "reading a GGUF file needs transformers", "pip install 'npuc[hf,gguf]'",
                        exit_code=EXIT_USAGE) from None
    g = read_gguf(path)
    arch = ARCHS.get(g.arch)
    if arch is None:
        raise _unsupported_arch(g.arch or "(none)")
    cfg = hf_config(g)
    dtype = model_dtype(g)
    build: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if _has_experts_choice(transformers):
        build["experts_implementation"] = "batched_mm"
    try:
        with _parameters_without_memory():
            module = transformers.AutoModelForCausalLM.from_config(cfg, **build)
    except (ValueError, TypeError, AssertionError) as e:
        raise NpucError("NPUC-E0306", f"transformers cannot build {cfg.model_type} from {g.path!r}: {e}",
                        "check that your transformers version supports this architecture",
                        exit_code=EXIT_UNSUPPORTED) from None
    module.eval()
    names = _hf_names(g, arch)
    owners, params = parameter_owners(module)
    sources: dict[str, ConstSource] = {}
    done: list[Treatment] = []
    missing = []
    for pid, ns in owners.items():
        p = params[pid]
        hit = next((n for n in ns if n in names), None)
        if hit is None:
            missing.append(ns[0])
            continue
        src, how = _weight(g, hit, names[hit], tuple(p.shape), p.dtype, arch, cfg)
        done.append(how)
        for n in ns:
            sources[n] = src
    if missing:
        raise missing_weights(missing, repr(g.path), f"the file's tensors do not make the {cfg.model_type} "
                              "model its metadata describes")
    for n, b in module.named_buffers():  # DeepSeek-V3's routing bias is a buffer: small, read now
        if n in names and len(names[n]) == 1:
            t = g.tensors[names[n][0]]
            value = float_rows(_read_rows(g.path, t), t).reshape(b.shape).to(b.dtype)
            b.copy_(value)
            done.append(Treatment(t.name, t.type_name, f"{DType.from_torch(b.dtype)} buffer {n}"))
    done += _rope_freqs(g, module)
    done += [Treatment(n, g.tensors[n].type_name, "LongRoPE factors (rope_scaling)") for n in LONGROPE_TENSORS
             if n in g.tensors]
    _report(g, done)
    give_storage(module, params)
    loaded = LoadedModel(module, "hf", {"use_cache": False}, sources, {n: torch.int64 for n in _INT_INPUTS},
                         [g.path])
    return loaded, done


def _report(g: GgufFile, ts: list[Treatment]) -> None:
    for t in ts:
        log.info("%s", t)
    used = {n for t in ts for n in t.tensor.split("+")}
    unused = sorted(set(g.tensors) - used)
    if unused:
        log.warning("%s: %d GGUF tensor(s) not used by the model: %s", os.path.basename(g.path), len(unused),
                    ", ".join(unused[:5]) + ("..." if len(unused) > 5 else ""))
    name = os.path.basename(g.path)

    def counted(pick: Callable[[Treatment], bool]) -> str:
        n: dict[str, int] = {}
        for t in ts:
            if pick(t):
                n[t.gguf_type] = n.get(t.gguf_type, 0) + 1
        return ", ".join(f"{c} {k} tensor(s)" for k, c in sorted(n.items()))

    floats = counted(lambda t: t.gguf_type in DEQUANTIZED)
    if floats:
        log.warning("%s: %s stored as f32 values, not codes (exact, but larger); `--log info` lists each tensor",
                    name, floats)
    rounded = counted(lambda t: not t.exact)
    if rounded:
        log.warning("%s: %s narrowed to the model's dtype; a rounded value is reported when written", name, rounded)


# Phi-3's LongRoPE factors: llama.cpp stores them as tensors, not metadata
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(g: GgufFile) -> dict[str, Any] | None:
    """Phi-3's LongRoPE as rope_scaling: llama.cpp's two tensors of per-frequency factors and the
    original context from the metadata (compiler/rope_scaling.py). None without the tensors."""
    tensors = [g.tensors.get(n) for n in LONGROPE_TENSORS]
    if all(t is None for t in tensors):
        return None
    orig = g.get("rope.scaling.original_context_length")
    missing = [n for n, t in zip(LONGROPE_TENSORS, tensors, strict=True) if t is None]
    missing += ["rope.scaling.original_context_length"] if orig is None else []
    if missing:
        raise NpucError("NPUC-E0314", f"{os.path.basename(g.path)} has LongRoPE factors without {', '.join(missing)}",
                        "the file's tensors do not match its metadata", exit_code=EXIT_IO)
    long_f, short_f = (float_rows(_read_rows(g.path, t), t).reshape(-1).tolist() for t in tensors if t is not None)
    rope: dict[str, Any] = {"rope_type": "longrope", "long_factor": long_f, "short_factor": short_f,
                            "original_max_position_embeddings": int(orig)}
    attn = g.get("rope.scaling.attn_factor")
    if attn is not None:
        rope["attention_factor"] = float(attn)
    return rope


def _rope_freqs(g: GgufFile, module: nn.Module) -> list[Treatment]:
    """Llama 3.x's RoPE scaling, which llama.cpp stores as a tensor of per-frequency divisors
    (`rope_freqs.weight`) instead of metadata: the module's inverse frequencies divided by it."""
    t = g.tensors.get("rope_freqs.weight")
    if t is None:
        return []
    factors = float_rows(_read_rows(g.path, t), t).reshape(-1).float()
    scaled = 0
    for m in module.modules():
        inv = getattr(m, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.shape == factors.shape:
            m.inv_freq = inv / factors
            scaled += 1
            if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
                m.original_inv_freq = m.inv_freq.clone()
    if not scaled:
        raise NpucError("NPUC-E0314", f"rope_freqs.weight has {factors.numel()} factors; the model has no RoPE of "
                        "as many frequencies", "the file's tensors do not match its metadata", exit_code=EXIT_IO)
    return [Treatment(t.name, t.type_name, "the RoPE's inverse frequencies divided by it")]


# -- the tokenizer and generation metadata ----------------------------------------------------------

def eos_token_ids(path: str | os.PathLike[str]) -> list[int]:
    g = read_gguf(path)
    eos = g.metadata.get("tokenizer.ggml.eos_token_id")
    return [int(eos)] if eos is not None else []


def tokenizer_files(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """The tokenizer that transformers builds from the file's `tokenizer.ggml.*` metadata,
    as the files save_pretrained writes (what an HF folder's tokenizer section holds); empty,
    with a warning, when it cannot build one."""
    p = Path(os.fspath(path)).resolve()
    g = read_gguf(p)
    if "tokenizer.ggml.tokens" not in g.metadata:
        log.warning("%s has no tokenizer: `npuc generate` will need token ids, not --prompt", p.name)
        return {}
    try:
        import transformers

        tok = None
        errors = []
        for make in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
            try:
                tok = make.from_pretrained(str(p.parent), gguf_file=p.name)
                break
            except Exception as e:  # noqa: BLE001 - transformers' GGUF tokenizer support varies by version and arch
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if tok is None:
            raise RuntimeError("; ".join(errors))
        with tempfile.TemporaryDirectory() as d:
            tok.save_pretrained(d)
            return {f.name: f.read_bytes() for f in sorted(Path(d).iterdir()) if f.is_file()}
    except Exception as e:  # noqa: BLE001 - a model without a usable tokenizer still compiles
        log.warning("%s: transformers cannot build its tokenizer (%s): `npuc generate` will need token ids",
                    p.name, str(e)[:200])
        return {}


__all__ = ["ARCHS", "DEQUANTIZED", "KEPT", "SUPPORTED_TYPES", "GgufFile", "GgufTensor", "Treatment",
           "eos_token_ids", "hf_config", "is_gguf", "load_gguf", "q4_0_parts", "q5_0_parts", "q6_k_parts",
           "q8_0_parts", "qk_rows_order", "read_gguf", "tokenizer_files", "treatments"]
