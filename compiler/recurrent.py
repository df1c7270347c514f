"""Recurrent token mixers recognised at their source: the scans of state-space layers and
the delta rules of linear-attention layers become single ops (ir/recurrent_ops.py), whose
state passes/kv_cache.py then keeps per slot.

transformers writes each recurrence as a function it names for its kernel hub (the
`use_kernel_func_from_hub_with_fallback` name: "mamba_chunk_scan_combined",
"chunk_gated_delta_rule", ...), so that a runtime that manages the recurrent state itself
can replace it. That is what npuc is, and the rules below are data: the hub name, the
function names the modeling files give it, and an adapter that computes the same value
through an `npuc::` custom op. While a model is traced, each matching function in the
modules its layers come from is replaced by its adapter; torch.export then keeps one node
per layer where the torch fallback would leave hundreds (the chunked scan's cumsums,
einsums and segment sums, different for every chunk count).

Why at the source and not as a graph pattern: the fallback paths unroll a loop over
chunks (Mamba2, DeltaNet) or over tokens (Mamba), so their graphs change shape with the
prompt length; a pattern would have to re-derive a scan from them. The hub names are
transformers' own contract for exactly this replacement.

An adapter falls back to the original function where its call is outside the rule (an
initial state, a final state asked for: only a traced cache does that, and npuc traces
without one). A recurrence no rule covers stays as transformers wrote it, and the
decode-check pass refuses its decode program with the reason (`UNCOVERED` names the
families known to need a rule npuc does not have).

    mamba2_chunk_scan(x [b,S,H,P], dt [b,S,H], A [H], B, C [b,S,G,N], D [H], dt_bias, softplus, limit)
      -> selective_scan(x [b,S,H*P], dt', A, B, C, D per channel) reshaped to [b,S,H,P]
    mamba_selective_scan(u [b,Dc,S], delta, A [Dc,N], B, C [b,N,S], D, z, delta_bias, softplus)
      -> selective_scan(u^T, delta'^T, A, B^T [b,S,1,N], C^T, D)^T * silu(z)
    torch_chunk_gated_delta_rule(q, k [b,S,Hk,K], v [b,S,Hv,V], g, beta, use_qk_l2norm)
      -> gated_delta_rule(l2norm(q)/sqrt(K), l2norm(k), v, g, beta)   (heads repeated to Hv)
    chunk_kimi_delta_attention(...): the same, g per key channel [b,S,H,K]
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from npuc.compiler.torch_frontend import _Ctx, converts
from npuc.ir import Value, get_op


@torch.library.custom_op("npuc::selective_scan", mutates_args=())
def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor) -> torch.Tensor:
    return get_op("selective_scan").run([x, dt, A, B, C, D], {})[0]


@selective_scan.register_fake
def _(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
      D: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("npuc::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    return get_op("gated_delta_rule").run([q, k, v, g, beta], {})[0]


@gated_delta_rule.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return v.new_empty((*q.shape[:3], v.shape[3]))


@torch.library.custom_op("npuc::wkv", mutates_args=())
def wkv(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return get_op("wkv").run([k, v, w, u], {})[0]


@wkv.register_fake
def _(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(v)


@converts("npuc.wkv.default")
def _wkv_node(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("wkv", [ctx.value(a[k]) for k in ("k", "v", "w", "u")], like=node)


@torch.library.custom_op("npuc::linear_recurrence", mutates_args=())
def linear_recurrence(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return get_op("linear_recurrence").run([x, a], {})[0]


@linear_recurrence.register_fake
def _(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@converts("npuc.linear_recurrence.default")
def _linear_node(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("linear_recurrence", [ctx.value(a["x"]), ctx.value(a["a"])], like=node)


@torch.library.custom_op("npuc::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return get_op("linear_attention").run([q, k, v, g], {})[0]


@linear_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return v.new_empty((*q.shape[:3], v.shape[3]))


@converts("npuc.linear_attention.default")
def _lin_attn_node(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    return ctx.emit("linear_attention", [ctx.value(a[k]) for k in ("q", "k", "v", "g")], like=node)


@converts("npuc.selective_scan.default")
def _scan_node(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    ins = [ctx.value(a[k]) for k in ("x", "dt", "A", "B", "C", "D")]
    return ctx.emit("selective_scan", ins, like=node)


@converts("npuc.gated_delta_rule.default")
def _delta_node(ctx: _Ctx, node: torch.fx.Node, a: dict[str, Any]) -> Value:
    ins = [ctx.value(a[k]) for k in ("q", "k", "v", "g", "beta")]
    return ctx.emit("gated_delta_rule", ins, like=node)


# -- the adapters: transformers' call, computed through the ops ---------------------------------

Adapter = Callable[[Callable[..., Any], ModuleType], Callable[..., Any]]


def _time_step(dt: torch.Tensor, bias: torch.Tensor | None, softplus: bool,
               limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    dt = dt.float()
    if bias is not None:
        dt = dt + bias.float()
    if softplus:
        dt = F.softplus(dt)
    lo, hi = limit
    if lo > 0 or not softplus:  # softplus is positive already: clamping at 0 would change nothing
        dt = dt.clamp(min=lo)
    if hi != math.inf:
        dt = dt.clamp(max=hi)
    return dt


def _mamba2(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int = 256, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
             initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
             dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False,
             **kwargs: Any) -> Any:
        if initial_states is not None or return_final_states or A.dim() != 1:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        b, s, h, p = hidden_states.shape
        d = (D.float() if D is not None else A.new_zeros(h, dtype=torch.float32))[:, None].expand(h, p).reshape(h * p)
        y = torch.ops.npuc.selective_scan(hidden_states.reshape(b, s, h * p).float(),
                                          _time_step(dt, dt_bias, dt_softplus, dt_limit), A.float(), B.float(),
                                          C.float(), d)
        return y.reshape(b, s, h, p)  # float32, as transformers' torch path returns it

    return scan


def _mamba(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
             delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> Any:
        if return_last_state or A.dim() != 2 or B.dim() != 3:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs)
        b, dc, s = hidden_states.shape
        dt = dt.float() + (delta_bias.float()[:, None] if delta_bias is not None else 0.0)
        dt = F.softplus(dt) if delta_softplus else dt
        d = D.float() if D is not None else A.new_zeros(dc, dtype=torch.float32)
        y = torch.ops.npuc.selective_scan(hidden_states.transpose(1, 2).float(), dt.transpose(1, 2), A.float(),
                                          B.transpose(1, 2)[:, :, None].float(), C.transpose(1, 2)[:, :, None].float(),
                                          d)
        y = y.transpose(1, 2).to(hidden_states.dtype)
        return y * F.silu(z) if z is not None else y

    return scan


def _delta_rule(per_channel_gate: bool) -> Adapter:
    def adapt(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
        l2norm = getattr(module, "l2norm", None)

        @functools.wraps(original)
        def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                 use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> Any:
            gate_ok = g.dim() == (4 if per_channel_gate else 3)
            if initial_state is not None or output_final_state or not gate_ok or \
                    (use_qk_l2norm_in_kernel and l2norm is None):
                return original(query, key, value, g, beta, chunk_size, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            heads = value.shape[2]
            if key.shape[2] != heads:  # each query/key head serves heads / Hk consecutive value heads
                query = query.repeat_interleave(heads // key.shape[2], dim=2)
                key = key.repeat_interleave(heads // key.shape[2], dim=2)
            q, k = query.float(), key.float()
            if use_qk_l2norm_in_kernel:
                assert l2norm is not None  # else the original ran, above
                q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
            q = q * (1.0 / math.sqrt(q.shape[-1]))
            o = torch.ops.npuc.gated_delta_rule(q, k, value.float(), g.float(), beta.float())
            return o.to(query.dtype), None

        return rule

    return adapt


def _rwkv(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def attention(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  state: Any = None, return_state: bool = False) -> Any:
        if state is not None or return_state:
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        y = torch.ops.npuc.wkv(key.float(), value.float(), -torch.exp(time_decay.float()), time_first.float())
        return y.to(key.dtype), None

    return attention


def _rg_lru(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    @functools.wraps(original)
    def scan(self: nn.Module, hidden_states: torch.Tensor, recurrent_gate: torch.Tensor, reset: torch.Tensor,
             recurrent_states: torch.Tensor | None, acc_dtype: torch.dtype = torch.float32) -> Any:
        if recurrent_states is not None:
            return original(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        a = (recurrent_gate * ~reset).to(acc_dtype)
        y = torch.ops.npuc.linear_recurrence(hidden_states.to(acc_dtype), a)
        return y.type(hidden_states.dtype), None  # the layer keeps no state of its own: npuc's op does

    return scan


def _lightning(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    """MiniMax's lightning attention layer (its forward: the recurrence is written inline, in
    blocks): the same projections, norm and gate around linear_attention."""
    mask_padding = getattr(module, "apply_mask_to_padding_states", None)

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> Any:
        if cache is not None or mask_padding is None:
            return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        b, s, _ = hidden_states.shape
        h, d = self.num_attention_heads, self.head_dim
        qkv = mask_padding(self.act_fn(self.qkv_proj(hidden_states)), attention_mask).reshape(b, s, h, 3 * d)
        q, k, v = torch.split(qkv, d, dim=3)
        g = (-self.slope_rate.reshape(1, 1, h)).expand(b, s, h).float()
        o = torch.ops.npuc.linear_attention(q.float(), k.float(), v.float(), g).to(v.dtype)
        o = self.norm(o.reshape(b, s, h * d))
        o = torch.sigmoid(self.output_gate(hidden_states)) * o
        return self.out_proj(o), None

    return forward


@dataclass(frozen=True)
class Rule:
    """One recurrence: transformers' kernel-hub name for it (npuc's name where transformers
    gives it none), the names its modeling files give the torch fallback (`Class.method` for
    a method), and the adapter that computes it through npuc's op."""

    hub_name: str
    functions: tuple[str, ...]
    adapter: Adapter
    op: str


RULES: tuple[Rule, ...] = (
    Rule("mamba_chunk_scan_combined", ("mamba2_chunk_scan",), _mamba2, "selective_scan"),
    Rule("selective_scan_fn", ("mamba_selective_scan",), _mamba, "selective_scan"),
    Rule("chunk_gated_delta_rule", ("torch_chunk_gated_delta_rule",), _delta_rule(False), "gated_delta_rule"),
    Rule("chunk_kda", ("chunk_kimi_delta_attention",), _delta_rule(True), "gated_delta_rule"),
    # RWKV names no hub kernel; its torch path is this function (the CUDA one is not traced)
    Rule("rwkv_linear_attention", ("rwkv_linear_attention_cpu",), _rwkv, "wkv"),
    # RecurrentGemma's RG-LRU: a method of its layer (Class.method)
    Rule("rg_lru", ("RecurrentGemmaRglru._rnn_scan",), _rg_lru, "linear_recurrence"),
    # MiniMax's lightning attention: inline in its layer's forward
    Rule("lightning_attention", ("MiniMaxLightningAttention.forward",), _lightning, "linear_attention"),
)
# Config values that make a model's trace free of in-place weight edits, with the same float
# math: RWKV rescales two weights per layer by powers of two at its first inference forward
# (for fp16 range), and halves its hidden states to match; without it the sums are the same.
TRACE_CONFIG: dict[str, tuple[str, Any]] = {"rwkv": ("rescale_every", 0)}


class _TokenShift(nn.Module):
    """RWKV's token shift (nn.ZeroPad2d((0, 0, 1, -1)) over [b, S, C]: each token sees the
    previous one's channels, the first zeros) as the causal depthwise conv it is, kernel
    [1, 0]: the kv-cache pass then keeps its one-token window as state (conv_window)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[-1]
        w = torch.tensor([1.0, 0.0], dtype=x.dtype).expand(c, 1, 2)
        return F.conv1d(x.transpose(1, 2), w, padding=1, groups=c)[..., :x.shape[1]].transpose(1, 2)


def _is_token_shift(m: nn.Module) -> bool:
    return isinstance(m, nn.ZeroPad2d) and tuple(m.padding) == (0, 0, 1, -1)


@contextlib.contextmanager
def recurrences_as_ops(model: nn.Module) -> Iterator[list[str]]:
    """While tracing `model`: each recurrence a rule covers, in the modules its layers come
    from, computed through npuc's op. Yields the `module.function` names replaced."""
    names = {type(m).__module__ for m in model.modules()}
    modules = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    replaced: list[tuple[Any, str, Any]] = []
    config = getattr(model, "config", None)
    try:
        for mod in modules:
            for rule in RULES:
                for fn in rule.functions:
                    cls, _, meth = fn.rpartition(".")
                    owner = mod.__dict__.get(cls) if cls else mod
                    original = owner.__dict__.get(meth) if owner is not None else None
                    if callable(original):
                        setattr(owner, meth, rule.adapter(original, mod))
                        replaced.append((owner, meth, original))
        if replaced:  # a model with recurrences: its token shifts are convs too
            for name, sub in list(model.named_modules()):
                if _is_token_shift(sub):
                    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
                    attr = name.rpartition(".")[2]
                    replaced.append((parent, attr, sub))
                    setattr(parent, attr, _TokenShift())
            key = TRACE_CONFIG.get(getattr(config, "model_type", ""))
            if key is not None and config is not None and hasattr(config, key[0]):
                replaced.append((config, key[0], getattr(config, key[0])))
                setattr(config, key[0], key[1])
        yield [f"{getattr(m, '__name__', type(m).__name__)}.{fn}" for m, fn, _ in replaced]
    finally:
        for owner, name, original in reversed(replaced):
            setattr(owner, name, original)
