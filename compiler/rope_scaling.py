"""RoPE whose frequencies depend on the sequence length: dynamic NTK and LongRoPE.

Every other scaling (linear, llama3, YaRN, DeepSeek's) is a function of the position
alone: the model traced at --max_seq_len folds into one table that every program reads
(passes/rope_fusion.py, passes/kv_cache.py), exact at every position. transformers
computes these two from the longest position of each forward (`dynamic_rope_update`,
seq_len = max(position_ids) + 1), so a position's rotation depends on the call it is
computed in:

    dynamic   base * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (d / (d - 2))
              once seq_len > max_position_embeddings, the original base below it
    longrope  inv_freq / long_factor once seq_len > original_max_position_embeddings,
              inv_freq / short_factor below it

A compiled model has one table, shared by prefill and decode through the KV cache. What
each type's table holds with --max_seq_len (without it, a single program rotates as
transformers rotates a forward of its length):

    dynamic   row p = position p at the frequencies of length p + 1, as `generate` rotates
              the token it decodes there (after p cached ones; cached keys keep theirs):
              the original base up to max_position_embeddings - 1, then growing. Decode
              agrees with transformers at every position, and so does the prefill of a
              prompt within max_position_embeddings; a longer prompt that transformers
              takes in one forward it rotates by that prompt's length throughout.
    longrope  long_factor at every position if --max_seq_len > original_max_position_embeddings,
              else short_factor (vLLM and llama.cpp choose by the context length too). Phi-3's
              `generate` drops its cache when a sequence first passes the original context
              and prefills it again with long_factor, so from there on transformers agrees
              at every position; a sequence that stays within it transformers rotates by
              short_factor.

    dynamic, max_position_embeddings 64, factor 8, --max_seq_len 512:
      rows 0..63    base 10000
      row p >= 64   base 10000 * (8 * (p + 1) / 64 - 7) ** (d / (d - 2))

transformers writes its update as a Python branch on a tensor (dynamic's `if seq_len >
max_seq_len_cached`) and as state set on the module during the forward (its buffer,
LongRoPE's `long_inv_freq`): torch.export traces neither. While npuc traces, `traceable`
computes the same frequencies with tensor ops and writes nothing, so what the module ran
before does not matter: transformers' own frequency functions, except dynamic's base per
position (`_dynamic_rows`, its formula checked against transformers' at compile time). The
driver traces under `cache_length` (--max_seq_len), which picks the rows above.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from npuc.errors import EXIT_UNSUPPORTED, NpucError

T = TypeVar("T")

# --max_seq_len of the programs being traced (None: a single program)
_CACHE_LENGTH: contextvars.ContextVar[int | None] = contextvars.ContextVar("npuc_rope_cache_length", default=None)


@contextlib.contextmanager
def cache_length(n: int | None) -> Iterator[None]:
    """While building the programs of a --max_seq_len compile: `n`."""
    token = _CACHE_LENGTH.set(n)
    try:
        yield
    finally:
        _CACHE_LENGTH.reset(token)


def at_cache_length(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, whose `max_seq_len` argument names the cache length, tracing under cache_length."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        with cache_length(signature.bind(*args, **kwargs).arguments.get("max_seq_len")):
            return fn(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class Rotary:
    """One length-dependent rotation: the rotary module and the layer type it serves
    (None where the module has one rope_type for every layer)."""

    module: Any
    layer_type: str | None
    rope_type: str

    @property
    def prefix(self) -> str:
        return "" if self.layer_type is None else f"{self.layer_type}_"

    @property
    def limit(self) -> int:
        """The longest sequence that keeps the original frequencies."""
        if self.rope_type == "longrope":
            params = self.module.config.rope_parameters
            params = params if self.layer_type is None else params[self.layer_type]
            return int(params["original_max_position_embeddings"])
        # dynamic: max_seq_len_cached of a fresh module (transformers grows it as it runs)
        return int(self.module.original_max_seq_len)


def _is_scaled(rope_type: object) -> bool:
    # The same test as transformers' dynamic_rope_update wrapper
    return isinstance(rope_type, str) and (rope_type == "longrope" or "dynamic" in rope_type)


def _wrapper_code() -> types.CodeType | None:
    """The code of transformers' dynamic_rope_update wrapper: every rotary forward it
    decorates shares it."""
    if "transformers" not in sys.modules:
        return None  # not loaded (yet): no module of the model comes from it
    return _loaded_wrapper_code()


@functools.cache
def _loaded_wrapper_code() -> types.CodeType | None:
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def length_dependent(model: Any) -> list[Rotary]:
    """The rotations of `model` whose frequencies depend on the sequence length."""
    code = _wrapper_code()
    if code is None or not hasattr(model, "modules"):
        return []
    found: list[Rotary] = []
    seen: set[int] = set()
    for m in model.modules():
        if getattr(getattr(type(m), "forward", None), "__code__", None) is not code or id(m) in seen:
            continue
        seen.add(id(m))
        kinds = m.rope_type if isinstance(m.rope_type, dict) else {None: m.rope_type}
        found.extend(Rotary(m, lt, rt) for lt, rt in kinds.items() if _is_scaled(rt))
    return found


class _With:
    """The rotary module as its undecorated forward sees it, with other frequencies."""

    def __init__(self, module: Any, **attrs: Any) -> None:
        self.__dict__.update(attrs)
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _frequencies(r: Rotary, seq_len: torch.Tensor | int) -> torch.Tensor:
    """transformers' inv_freq for a forward whose longest sequence is `seq_len`: an int, a 0-d
    tensor, or one length per position ([.., n, 1] gives [.., n, d/2])."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = r.module
    original = getattr(m, f"{r.prefix}original_inv_freq")
    if isinstance(seq_len, int) and seq_len <= r.limit:
        return original
    kw = {} if r.layer_type is None else {"layer_type": r.layer_type}
    if r.rope_type == "longrope":
        # long_factor's frequencies, as transformers' update computes them
        grown, _ = ROPE_INIT_FUNCTIONS["longrope"](m.config, original.device, seq_len=r.limit + 1, **kw)
    elif r.rope_type == "dynamic" and isinstance(seq_len, torch.Tensor) and seq_len.dim() > 0:
        grown = _dynamic_rows(r, seq_len)
    else:
        # dynamic's attention factor is 1 at every length, as at init: the module's stands
        grown, _ = ROPE_INIT_FUNCTIONS[r.rope_type](m.config, original.device, seq_len=seq_len, **kw)
    grown = grown.to(original.dtype)
    return grown if isinstance(seq_len, int) else torch.where(seq_len > r.limit, grown, original)


def _dynamic_rows(r: Rotary, seq_len: torch.Tensor) -> torch.Tensor:
    """transformers' _compute_dynamic_ntk_parameters at one length per position ([.., n, 1]
    -> [.., n, d/2]). Its decode step computes the base on a 0-d float32 tensor, where torch's
    power is the correctly rounded one; a vector of lengths would take the vectorised float32
    power, up to 3 ulp off, which moves row 32767's rotation by 5e-4. The power is taken in
    float64 and rounded instead, which gives the 0-d result."""
    config = r.module.config
    params = config.rope_parameters if r.layer_type is None else config.rope_parameters[r.layer_type]
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    factor, positions = params["factor"], config.max_position_embeddings
    seq = torch.maximum(seq_len, torch.tensor(positions, dtype=seq_len.dtype))
    stretch = (factor * seq / positions) - (factor - 1)  # float32, as transformers computes it
    base = params["rope_theta"] * (stretch.double() ** (dim / (dim - 2))).float()
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _inner(module: Any) -> Any:
    """The rotary forward without transformers' update."""
    return type(module).forward.__wrapped__


def _rotate(r: Rotary, x: torch.Tensor, position_ids: torch.Tensor, freqs: torch.Tensor) -> Any:
    kw = {} if r.layer_type is None else {"layer_type": r.layer_type}
    return _inner(r.module)(_With(r.module, **{f"{r.prefix}inv_freq": freqs}), x, position_ids, **kw)


def _seq_len(r: Rotary, position_ids: torch.Tensor) -> torch.Tensor | int:
    """The length whose frequencies rotate `position_ids` (module docstring)."""
    n = _CACHE_LENGTH.get()
    if n is None:
        # amax over every axis: transformers' torch.max(position_ids) + 1 (aten.max.default
        # has no converter)
        return position_ids.amax() + 1
    if r.rope_type == "longrope":
        return n
    return (position_ids + 1)[..., None]  # dynamic: each position its own


def _static_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None) -> Any:
    """transformers' decorated rotary forward as tensor ops that torch.export traces and
    that write nothing into the module."""
    rope_type = self.rope_type if layer_type is None else self.rope_type[layer_type]
    if not _is_scaled(rope_type):
        return _inner(self)(self, x, position_ids, **({} if layer_type is None else {"layer_type": layer_type}))
    r = Rotary(self, layer_type, rope_type)
    return _rotate(r, x, position_ids, _frequencies(r, _seq_len(r, position_ids)))


def _check_per_position(r: Rotary, n: int) -> None:
    """Dynamic NTK tabulated by position (cache length `n`) needs _dynamic_rows to be
    transformers' frequencies, and a rotary forward that takes a row of frequencies per
    position (its elementwise outer product does; a matmul by one [d/2] vector would not):
    both checked against transformers' own functions, one position at a time."""
    x = torch.zeros(1)
    with torch.no_grad():
        try:
            ends = torch.tensor([r.limit, r.limit + 1, 2 * r.limit, n])
            ok = torch.allclose(_frequencies(r, ends[:, None]),
                                torch.stack([_frequencies(r, t) for t in ends]), rtol=1e-6, atol=0)
            pos = torch.tensor([[0, r.limit - 1, r.limit, r.limit + 7]])  # few radians: rounding stays small
            cos, sin = _rotate(r, x, pos, _frequencies(r, (pos + 1)[..., None]))
            ok = ok and cos.shape[-2] == pos.shape[1] and all(
                torch.allclose(cos[..., i:i + 1, :], c, rtol=0, atol=1e-5)
                and torch.allclose(sin[..., i:i + 1, :], s, rtol=0, atol=1e-5)
                for i, p in enumerate(pos[0].tolist())
                for c, s in [_rotate(r, x, pos[:, i:i + 1], _frequencies(r, torch.tensor(p + 1)))])
        except (RuntimeError, KeyError, TypeError):
            ok = False
    if not ok:
        raise NpucError("NPUC-E0123", f"cannot compile a decode program: npuc cannot tabulate the dynamic NTK "
                        f"RoPE of {type(r.module).__name__} by position as transformers computes it",
                        "compile without --max_seq_len for a single program (rotated as transformers rotates a "
                        "forward of its length)", exit_code=EXIT_UNSUPPORTED)


@contextlib.contextmanager
def traceable(model: Any) -> Iterator[list[Rotary]]:
    """While tracing `model`: its length-dependent rotations through `_static_forward`."""
    rotaries = length_dependent(model)
    n = _CACHE_LENGTH.get()
    if n is not None:
        for r in rotaries:
            if r.rope_type != "longrope":
                _check_per_position(r, n)
    modules = list({id(r.module): r.module for r in rotaries}.values())
    try:
        for m in modules:
            m.forward = types.MethodType(_static_forward, m)
        yield rotaries
    finally:
        for m in modules:
            m.__dict__.pop("forward", None)
