"""ONNX Runtime baseline for the Llama decode benchmark.

This is an export wrapper written for the benchmark harness; it is *not* part of npuc.
It turns a Hugging Face ``LlamaForCausalLM`` (fp32, eval) into two static-shape ONNX
graphs -- a prefill step (``seq = prompt_len``) and a decode step (``seq = 1``) -- that
carry an explicit KV cache as graph inputs/outputs, and runs them with onnxruntime.

Graph interface (both files)::

    inputs:  input_ids   int64 [1, s]
             position    int64 [s]                          absolute positions of the s tokens
             k_cache     f32   [L, 1, n_kv_heads, max_len, head_dim]
             v_cache     f32   [L, 1, n_kv_heads, max_len, head_dim]
    outputs: logits      f32   [1, s, vocab]
             k_cache_out f32   [L, 1, n_kv_heads, max_len, head_dim]   (rows ``position`` replaced)
             v_cache_out f32   [L, 1, n_kv_heads, max_len, head_dim]

The forward is re-implemented here from the model's weights (``model.forward`` and the HF
cache classes are not used), attending over the whole static cache with the mask
``key_j <= position_i``.

Self-check: ``python bench/ort_llama.py`` (small random model) or
``python bench/ort_llama.py --size bench --new 8`` (benchmark size).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

_TWO_GB = 2 * 1024**3


class _LlamaKVStep(nn.Module):
    """Functional Llama step over a static KV cache (export-friendly)."""

    def __init__(self, model: Any, max_len: int) -> None:
        super().__init__()
        cfg = model.config
        self.model = model  # registered so that the weights become graph initializers
        self.n_layers: int = int(cfg.num_hidden_layers)
        self.n_heads: int = int(cfg.num_attention_heads)
        self.n_kv: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps: float = float(cfg.rms_norm_eps)
        self.max_len = max_len
        rot = model.model.rotary_emb
        self.attn_scaling: float = float(getattr(rot, "attention_scaling", 1.0) or 1.0)
        self.register_buffer("inv_freq", rot.inv_freq.detach().clone().float(), persistent=False)
        self.register_buffer("key_idx", torch.arange(max_len, dtype=torch.int64), persistent=False)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(
        self,
        input_ids: torch.Tensor,
        position: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = input_ids.shape[1]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        rep = nh // nkv
        inner = self.model.model

        x = inner.embed_tokens(input_ids)  # [1, s, H]

        # RoPE tables, [1, 1, s, hd]
        freqs = position.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attn_scaling)[None, None]
        sin = (emb.sin() * self.attn_scaling)[None, None]

        # mask [1, 1, 1, s, max_len]: key j visible to query i iff j <= position_i
        visible = self.key_idx[None, :] <= position[:, None]
        mask = visible[None, None, None]
        scale = hd**-0.5

        k_out: list[torch.Tensor] = []
        v_out: list[torch.Tensor] = []
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = self._rms(x, layer.input_layernorm.weight)
            q = attn.q_proj(h).view(1, s, nh, hd).transpose(1, 2)  # [1, nh, s, hd]
            k = attn.k_proj(h).view(1, s, nkv, hd).transpose(1, 2)  # [1, nkv, s, hd]
            v = attn.v_proj(h).view(1, s, nkv, hd).transpose(1, 2)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin

            kc = torch.index_copy(k_cache[li], 2, position, k)  # [1, nkv, max_len, hd]
            vc = torch.index_copy(v_cache[li], 2, position, v)
            k_out.append(kc)
            v_out.append(vc)

            # grouped-query attention without materialising repeated K/V
            qg = q.reshape(1, nkv, rep * s, hd)
            scores = torch.matmul(qg, kc.transpose(-1, -2)) * scale  # [1, nkv, rep*s, max_len]
            scores = scores.view(1, nkv, rep, s, self.max_len)
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(1, nkv, rep * s, self.max_len)
            ctx = torch.matmul(probs, vc)  # [1, nkv, rep*s, hd]
            ctx = ctx.view(1, nh, s, hd).transpose(1, 2).reshape(1, s, nh * hd)
            x = x + attn.o_proj(ctx)

            h = self._rms(x, layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            x = x + mlp.down_proj(nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

        x = self._rms(x, inner.norm.weight)
        logits = self.model.lm_head(x)
        return logits, torch.stack(k_out, dim=0), torch.stack(v_out, dim=0)


def _cache_shape(model: Any, max_len: int) -> tuple[int, int, int, int, int]:
    cfg = model.config
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return (int(cfg.num_hidden_layers), 1, int(cfg.num_key_value_heads), max_len, hd)


def _export_one(step: _LlamaKVStep, path: str, seq: int, max_len: int, shape: tuple[int, ...]) -> None:
    ids = torch.zeros((1, seq), dtype=torch.int64)
    pos = torch.arange(seq, dtype=torch.int64)
    kc = torch.zeros(shape, dtype=torch.float32)
    vc = torch.zeros(shape, dtype=torch.float32)
    n_bytes = sum(p.numel() * p.element_size() for p in step.parameters())
    torch.onnx.export(
        step,
        (ids, pos, kc, vc),
        path,
        dynamo=True,
        opset_version=18,
        input_names=["input_ids", "position", "k_cache", "v_cache"],
        output_names=["logits", "k_cache_out", "v_cache_out"],
        external_data=n_bytes > _TWO_GB - 64 * 1024**2,
        optimize=True,
        verbose=False,
    )


def export_llama_kv(model: Any, out_dir: str, prompt_len: int, max_len: int) -> tuple[str, str]:
    """Export ``model`` as (prefill, decode) ONNX files in ``out_dir``; returns their paths.

    Prefill takes ``prompt_len`` tokens, decode takes 1; both carry a static KV cache of
    ``max_len`` rows (see the module docstring for the exact interface).
    """
    if prompt_len < 1 or prompt_len > max_len:
        raise ValueError(f"need 1 <= prompt_len <= max_len, got {prompt_len}, {max_len}")
    os.makedirs(out_dir, exist_ok=True)
    model = model.float().eval()
    step = _LlamaKVStep(model, max_len).eval()
    shape = _cache_shape(model, max_len)
    prefill_path = os.path.join(out_dir, f"llama_prefill_p{prompt_len}_m{max_len}.onnx")
    decode_path = os.path.join(out_dir, f"llama_decode_m{max_len}.onnx")
    with torch.no_grad():
        _export_one(step, prefill_path, prompt_len, max_len, shape)
        _export_one(step, decode_path, 1, max_len, shape)
    return prefill_path, decode_path


class OrtLlama:
    """Greedy decoding with the exported prefill/decode graphs on onnxruntime (CPU).

    With ``use_iobinding`` (default) the KV caches live in two preallocated numpy buffer
    pairs wrapped as OrtValues; each call reads one pair and writes the other (ping-pong),
    so caches are never copied between calls on the Python side.
    """

    def __init__(self, prefill_path: str, decode_path: str, threads: int, use_iobinding: bool = True) -> None:
        self.last_prefill_s = 0.0  # generate()'s, the prompt to its first token
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers = ["CPUExecutionProvider"]
        self.prefill_sess = ort.InferenceSession(prefill_path, sess_options=opts, providers=providers)
        self.decode_sess = ort.InferenceSession(decode_path, sess_options=opts, providers=providers)
        self.use_iobinding = use_iobinding

        ins = {i.name: i for i in self.prefill_sess.get_inputs()}
        self.prompt_len: int = int(ins["input_ids"].shape[1])
        self.cache_shape: tuple[int, ...] = tuple(int(d) for d in ins["k_cache"].shape)
        self.max_len: int = self.cache_shape[3]
        self.vocab: int = int(self.decode_sess.get_outputs()[0].shape[2])

        self._zero = np.zeros(self.cache_shape, dtype=np.float32)
        # ping-pong cache buffers: index 0/1, each (k, v)
        self._bufs = [
            (np.zeros(self.cache_shape, np.float32), np.zeros(self.cache_shape, np.float32)) for _ in range(2)
        ]
        self._ov = [
            (ort.OrtValue.ortvalue_from_numpy(k), ort.OrtValue.ortvalue_from_numpy(v)) for k, v in self._bufs
        ]
        self._zero_ov = ort.OrtValue.ortvalue_from_numpy(self._zero)
        self._cur = 0  # which buffer pair holds the live cache
        self._step_logits = np.zeros((1, 1, self.vocab), np.float32)
        self._step_logits_ov = ort.OrtValue.ortvalue_from_numpy(self._step_logits)
        self._pre_logits = np.zeros((1, self.prompt_len, self.vocab), np.float32)
        self._pre_logits_ov = ort.OrtValue.ortvalue_from_numpy(self._pre_logits)
        self._ids = np.zeros((1, 1), np.int64)
        self._pos = np.zeros((1,), np.int64)
        self._ids_ov = ort.OrtValue.ortvalue_from_numpy(self._ids)
        self._pos_ov = ort.OrtValue.ortvalue_from_numpy(self._pos)
        self._dec_bind = [self._make_decode_binding(i) for i in range(2)]
        # plain-run state
        self._k: np.ndarray = self._zero
        self._v: np.ndarray = self._zero

    def _make_decode_binding(self, src: int) -> ort.IOBinding:
        b = self.decode_sess.io_binding()
        b.bind_ortvalue_input("input_ids", self._ids_ov)
        b.bind_ortvalue_input("position", self._pos_ov)
        b.bind_ortvalue_input("k_cache", self._ov[src][0])
        b.bind_ortvalue_input("v_cache", self._ov[src][1])
        b.bind_ortvalue_output("logits", self._step_logits_ov)
        b.bind_ortvalue_output("k_cache_out", self._ov[1 - src][0])
        b.bind_ortvalue_output("v_cache_out", self._ov[1 - src][1])
        return b

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Run the prompt ``ids`` [1, prompt_len] from empty caches; returns last-row logits [vocab]."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(1, -1)
        if ids.shape[1] != self.prompt_len:
            raise ValueError(
                f"prefill graph is static: expected {self.prompt_len} tokens, got {ids.shape[1]}"
            )
        pos = np.arange(self.prompt_len, dtype=np.int64)
        if not self.use_iobinding:
            logits, self._k, self._v = self.prefill_sess.run(
                None, {"input_ids": ids, "position": pos, "k_cache": self._zero, "v_cache": self._zero}
            )
            return np.array(logits[0, -1])
        b = self.prefill_sess.io_binding()
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position", pos)
        b.bind_ortvalue_input("k_cache", self._zero_ov)
        b.bind_ortvalue_input("v_cache", self._zero_ov)
        b.bind_ortvalue_output("logits", self._pre_logits_ov)
        b.bind_ortvalue_output("k_cache_out", self._ov[0][0])
        b.bind_ortvalue_output("v_cache_out", self._ov[0][1])
        self.prefill_sess.run_with_iobinding(b)
        self._cur = 0
        return self._pre_logits[0, -1].copy()

    def step(self, token: int, pos: int) -> np.ndarray:
        """Decode one ``token`` at absolute position ``pos``; returns its logits [vocab]."""
        if not 0 <= pos < self.max_len:
            raise ValueError(f"position {pos} outside the cache (max_len {self.max_len})")
        if not self.use_iobinding:
            logits, self._k, self._v = self.decode_sess.run(
                None,
                {
                    "input_ids": np.array([[token]], np.int64),
                    "position": np.array([pos], np.int64),
                    "k_cache": self._k,
                    "v_cache": self._v,
                },
            )
            return np.array(logits[0, 0])
        self._ids[0, 0] = token
        self._pos[0] = pos
        self.decode_sess.run_with_iobinding(self._dec_bind[self._cur])
        self._cur = 1 - self._cur
        return self._step_logits[0, 0].copy()

    def generate(self, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
        """Greedy-decode ``new`` tokens after ``prompt``.

        Returns (the ``new`` generated tokens, seconds of each decode step). The first token
        comes from prefill (not timed), so there are ``new - 1`` timed decode steps.
        """
        if len(prompt) + new - 1 > self.max_len:
            raise ValueError("prompt + new tokens exceed the cache length")
        t0 = time.perf_counter()
        logits = self.prefill(np.asarray(prompt, dtype=np.int64)[None, :])
        tok = int(np.argmax(logits))
        self.last_prefill_s = time.perf_counter() - t0
        tokens = [tok]
        times: list[float] = []
        pos = len(prompt)
        for _ in range(new - 1):
            t0 = time.perf_counter()
            logits = self.step(tok, pos)
            times.append(time.perf_counter() - t0)
            tok = int(np.argmax(logits))
            tokens.append(tok)
            pos += 1
        return tokens, times

    def measure(self, prompt: list[int], new: int, reps: int) -> tuple[list[int], list[float], list[float]]:
        """What bench/run.py reports of a system: (tokens, seconds of each decode step,
        seconds of each of `reps` prefills of the prompt)."""
        prefill = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.prefill(np.array([prompt], dtype=np.int64))
            prefill.append(time.perf_counter() - t0)
        tokens, steps = self.generate(prompt, new)
        return tokens, steps, prefill


# ---------------------------------------------------------------------------- self-check


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _self_check(size: str, new: int, threads: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == "small":
        cfg = LlamaConfig(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=512,
            vocab_size=1000,
            max_position_embeddings=512,
        )
        prompt_len, max_len = 16, 64
    else:
        cfg = LlamaConfig(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
            vocab_size=32000,
            max_position_embeddings=2048,
        )
        prompt_len, max_len = 128, 192
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{size}] params {n_params / 1e6:.1f}M prompt {prompt_len} max_len {max_len} new {new}")

    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pre, dec = export_llama_kv(model, tmp, prompt_len, max_len)
        t_export = time.perf_counter() - t0
        sizes = (os.path.getsize(pre) / 1e6, os.path.getsize(dec) / 1e6)
        print(
            f"export {t_export:.1f}s, files {sizes[0]:.0f} MB + {sizes[1]:.0f} MB, peak RSS {_peak_rss_mb():.0f} MB"
        )

        with torch.no_grad():
            ref_logits = model(ids, use_cache=False).logits[0].numpy()
            model.generation_config.eos_token_id = None
            ref_out = model.generate(
                ids,
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            )
        ref_tokens = ref_out[0, prompt_len:].tolist()

        for use_binding in (True, False):
            t0 = time.perf_counter()
            runner = OrtLlama(pre, dec, threads, use_iobinding=use_binding)
            t_load = time.perf_counter() - t0
            # full prefill logits through the raw session
            kz = np.zeros(runner.cache_shape, np.float32)
            full = runner.prefill_sess.run(
                ["logits"],
                {
                    "input_ids": ids.numpy(),
                    "position": np.arange(prompt_len, dtype=np.int64),
                    "k_cache": kz,
                    "v_cache": kz,
                },
            )[0][0]
            err = float(np.abs(full - ref_logits).max())
            last = runner.prefill(ids.numpy())
            err_last = float(np.abs(last - ref_logits[-1]).max())
            runner.generate(ids[0].tolist(), min(new, 4))  # warm-up
            tokens, times = runner.generate(ids[0].tolist(), new)
            ok_logits = err < 1e-4 and err_last < 1e-4
            ok_tokens = tokens == ref_tokens
            ms = np.array(times) * 1e3
            print(
                f"  iobinding={use_binding}: load {t_load:.1f}s, prefill max|err| {err:.2e} "
                f"(last row {err_last:.2e}) {'OK' if ok_logits else 'FAIL'}; tokens "
                f"{'match' if ok_tokens else 'MISMATCH'} ({len(tokens)}); decode step ms "
                f"median {np.median(ms):.3f} min {ms.min():.3f} max {ms.max():.3f} (threads {threads})"
            )
            if not ok_tokens:
                print(f"    ort {tokens}\n    hf  {ref_tokens}")
            assert ok_logits and ok_tokens
            del runner
    print(f"OK, peak RSS {_peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size", choices=["small", "bench"], default="small")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    _self_check(a.size, a.new, a.threads)
