"""Quantized checkpoints for the import tests, packed here from each format's spec
(independently of npuc's unpacking code): known integer codes, zero points and scales go
in, and the tests check that npuc reads exactly those back.

Conventions: `codes` are [K, N] (GPTQ/AWQ, row k of input feature k) or [N, K]
(MatMulNBits); `zeros` and `scales` are [K/G, N] or [N, K/G] likewise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i holds column ORDER[i] of its 8


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """values [.., 32/bits] (unsigned) into one int32 per row, value i at bits i*bits.. (LSB first)."""
    out = np.zeros(values.shape[:-1], dtype=np.uint64)
    for i in range(values.shape[-1]):
        out |= (values[..., i].astype(np.uint64) & ((1 << bits) - 1)) << np.uint64(bits * i)
    return out.astype(np.uint32).view(np.int32)


def pack_gptq(codes: np.ndarray, zeros: np.ndarray, bits: int, version: int) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ qweight [K*bits/32, N] (along K) and qzeros [K/G, N*bits/32] (along N); v1 stores zero - 1."""
    per = 32 // bits
    k, n = codes.shape
    qweight = _words(codes.reshape(k // per, per, n).transpose(0, 2, 1), bits)
    stored = zeros - 1 if version == 1 else zeros
    qzeros = _words(stored.reshape(stored.shape[0], n // per, per), bits)
    return qweight, qzeros


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """AWQ's gemm packing of [R, C] codes: [R, C/8] int32, nibble i of word j = column 8j + ORDER[i]."""
    r, c = codes.shape
    groups = codes.reshape(r, c // 8, 8)[:, :, AWQ_PACK_ORDER]
    return _words(groups, 4)


def pack_matmul_nbits(codes: np.ndarray, block: int, bits: int) -> np.ndarray:
    """MatMulNBits' B [N, n_blocks, block*bits/8] u8 from codes [N, K] (K padded with 0 to whole blocks)."""
    n, k = codes.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), dtype=np.int64)
    padded[:, :k] = codes
    if bits == 8:
        return padded.astype(np.uint8).reshape(n, blocks, block)
    pairs = padded.reshape(n, blocks, block // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def pack_matmul_nbits_zeros(zeros: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' zero_points [N * ceil(n_blocks*bits/8)] u8 from zeros [N, n_blocks]."""
    n, blocks = zeros.shape
    if bits == 8:
        return zeros.astype(np.uint8).reshape(-1)
    padded = np.zeros((n, blocks + blocks % 2), dtype=np.int64)
    padded[:, :blocks] = zeros
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


@dataclass
class Layer:
    """One quantized linear as the test made it: W[n, k] = scales[g(k), n] * (codes[k, n] - zeros[g(k), n])."""

    codes: np.ndarray   # [K, N]
    zeros: np.ndarray   # [K/G, N], the real zero points
    scales: np.ndarray  # [K/G, N] f16
    g_idx: np.ndarray   # [K]

    def weight(self) -> torch.Tensor:
        g = self.g_idx
        w = self.scales[g].astype(np.float32) * (self.codes - self.zeros[g]).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(w.T))


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def random_layer(rng: np.random.Generator, k: int, n: int, bits: int, group: int, zero_range: tuple[int, int],
                 act_order: bool = False) -> Layer:
    groups = k // group
    codes = rng.integers(0, 1 << bits, (k, n))
    zeros = rng.integers(zero_range[0], zero_range[1] + 1, (groups, n))
    scales = (rng.random((groups, n)) * 0.008 + 0.002).astype(np.float16)
    if act_order:
        order = rng.permutation(k)
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[order] = np.arange(k) // group
    else:
        g_idx = (np.arange(k) // group).astype(np.int32)
    return Layer(codes, zeros, scales, g_idx)


def quantized_llama(base: Path, path: Path, method: str, bits: int = 4, group: int = 32, version: int = 2,
                    act_order: bool = False, seed: int = 0, config_extra: dict[str, Any] | None = None
                    ) -> tuple[Any, dict[str, Layer]]:
    """A GPTQ or AWQ folder at `path` made from the float checkpoint `base`: every decoder linear
    replaced by packed random codes (group -1: one group per row). Returns the float model with the dequantized weights
    loaded (the reference) and the layers' codes."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    state = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    layers: dict[str, Layer] = {}
    for i in range(model.config.num_hidden_layers):
        for name in LINEARS:
            prefix = f"model.layers.{i}.{name}"
            lin = model.get_submodule(prefix)
            n, k = lin.weight.shape
            top = (1 << bits) - 1
            zr = (1, top) if method == "gptq" and version == 1 else (0, top)
            layer = random_layer(rng, k, n, bits, k if group == -1 else group, zr, act_order)
            with torch.no_grad():
                lin.weight.copy_(layer.weight())
            del state[f"{prefix}.weight"]
            if method == "gptq":
                qweight, qzeros = pack_gptq(layer.codes, layer.zeros, bits, version)
                state[f"{prefix}.g_idx"] = torch.from_numpy(layer.g_idx)
            else:
                qweight, qzeros = pack_awq(layer.codes), pack_awq(layer.zeros)
            state[f"{prefix}.qweight"] = torch.from_numpy(qweight)
            state[f"{prefix}.qzeros"] = torch.from_numpy(qzeros)
            state[f"{prefix}.scales"] = torch.from_numpy(layer.scales)
            layers[prefix] = layer
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    if method == "gptq":
        qc: dict[str, Any] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                              "sym": False, "checkpoint_format": "gptq" if version == 1 else "gptq_v2"}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    qc.update(config_extra or {})
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return model, layers
