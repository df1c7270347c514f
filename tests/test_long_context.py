"""Long prompts (issue 35): the mask and window checks read a mask from how the graph builds
it (passes/mask_analysis.py), so an 8,192-token prompt and a 32,768-token --max_seq_len
compile, keep their causal mask or sliding window, and generate HF's greedy tokens.

The models are tiny (hidden 64, 2 layers): the cost is the lengths, not the weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import COMMON, hf_greedy
from ir_build import const, node

from npuc.apps.generate import steps
from npuc.compiler.driver import compile_model
from npuc.ir import Graph, Value
from npuc.ir.evaluate import evaluate_value
from npuc.passes.attention_fusion import mask_window
from npuc.passes.mask_analysis import UNKNOWN, mask_window_of

LONG_PROMPT, LONG_CACHE, WINDOW, NEW = 8192, 32768, 64, 6


def _prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 120 + 4 for i in range(n)]


@pytest.fixture(scope="session")
def long_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama (plain causal), a Mistral with a 64-key sliding window and a Qwen2 with one on
    its second layer, all with room for the lengths below."""
    import transformers as tf

    root = tmp_path_factory.mktemp("long")
    cfg = {**COMMON, "max_position_embeddings": LONG_CACHE}
    out = {}
    configs = (("llama", tf.LlamaConfig(**cfg)), ("mistral", tf.MistralConfig(**cfg, sliding_window=WINDOW)),
               # layer 0 attends every key, layer 1 a window: one mask each
               ("qwen2", tf.Qwen2Config(**cfg, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)))
    for name, config in configs:
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(str(root / name))
        out[name] = root / name
    return out


def _hf(ckpt: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()


def _npuc_tokens(om: str, prompt: list[int]) -> list[int]:
    import npuc

    return [t for t, _ in steps(npuc.load(om), prompt, NEW, ignore_eos=True)]


def test_8192_token_prompt_compiles_and_generates_hf_tokens(long_checkpoints: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """Was NPUC-E0123 "a mask that is not the plain causal one": the prompt's mask, too large
    to fold, stayed an S x S input of the attention."""
    om = compile_model(str(long_checkpoints["llama"]), input_shape=f"input_ids:1,{LONG_PROMPT}",
                       output=str(tmp_path / "long"), max_seq_len=LONG_PROMPT + 16)
    prompt = _prompt(LONG_PROMPT)
    with torch.no_grad():
        want = hf_greedy(_hf(long_checkpoints["llama"]), prompt, NEW)
    assert _npuc_tokens(om, prompt) == want


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_32768_max_seq_len_compiles_and_generates_hf_tokens(arch: str, long_checkpoints: dict[str, Path],
                                                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The model traced at 32,768 positions: its mask is read there, not skipped with a
    warning. Mistral's window (64 keys) is wider than the 16-token prefill, so only that long
    trace shows it; the prompt runs past it, where attending every cached key would differ.
    Qwen2's second layer alone has one."""
    caplog.set_level("WARNING", logger="npuc")
    om = compile_model(str(long_checkpoints[arch]), input_shape="input_ids:1,16", output=str(tmp_path / arch),
                       max_seq_len=LONG_CACHE)
    assert "too large to check" not in caplog.text
    prompt = _prompt(2 * WINDOW + 5)
    with torch.no_grad():
        want = hf_greedy(_hf(long_checkpoints[arch]), prompt, NEW)
    assert _npuc_tokens(om, prompt) == want


# -- the analysis itself, on the constructions transformers' masking utils build ---------------

def _mask(s: int, k_len: int, window: int = 0, float_mask: bool = False, extra: str = "") -> tuple[Graph, Value]:
    """kv_idx <= q_idx (and > q_idx - window), anded with an all-true padding mask and equal
    packed-sequence ids, as a bool or a 0/-inf float mask expanded over 4 heads."""
    g = Graph("mask")
    q = const(g, "q", torch.arange(s).reshape(1, 1, s, 1))
    k = const(g, "k", torch.arange(k_len).reshape(1, 1, 1, k_len))
    m = node(g, "bitwise_and", [const(g, "ones", torch.tensor(True)), node(g, "le", [k, q])])
    same = node(g, "eq", [const(g, "pq", torch.zeros(1, 1, s, 1, dtype=torch.int64)),
                          const(g, "pk", torch.zeros(1, 1, 1, k_len, dtype=torch.int64))])
    m = node(g, "bitwise_and", [m, same])
    if window:
        m = node(g, "bitwise_and", [m, node(g, "gt", [k, node(g, "sub", [q, const(g, "w", torch.tensor(window))])])])
    if extra == "rows":  # the first 5 queries see every key: not a function of j - i
        m = node(g, "bitwise_or", [m, node(g, "lt", [q, const(g, "five", torch.tensor(5))])])
    if extra == "future":  # each query sees the next key too
        m = node(g, "le", [k, node(g, "add", [q, const(g, "one", torch.tensor(1))])])
    if extra == "holes":  # the band misses the key 2 back
        m = node(g, "bitwise_and", [m, node(g, "ne", [node(g, "sub", [q, k]), const(g, "two", torch.tensor(2))])])
    if extra == "position_offset":  # queries at positions 3.., keys at 3..: still causal
        q3 = node(g, "add", [q, const(g, "three", torch.tensor(3))])
        k3 = node(g, "add", [k, const(g, "three_k", torch.tensor(3))])
        m = node(g, "le", [k3, q3])
    if float_mask:
        m = node(g, "where", [m, const(g, "zero", torch.tensor(0.0)), const(g, "ninf", torch.tensor(float("-inf")))])
    return g, node(g, "expand", [m], {"shape": (1, 4, s, k_len)})


@pytest.mark.parametrize("extra", ["", "future", "holes", "position_offset"])
@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "float"])
@pytest.mark.parametrize("s,k_len", [(48, 48), (40, 56)])
def test_mask_read_from_its_construction_agrees_with_its_values(s: int, k_len: int, float_mask: bool, window: int,
                                                               extra: str) -> None:
    g, m = _mask(s, k_len, window, float_mask, extra)
    want = mask_window(evaluate_value(g, m), s, k_len)
    assert mask_window_of(m, s, k_len) == want


def test_a_mask_not_of_the_diagonal_is_left_undecided() -> None:
    """Undecided, not a verdict: the caller evaluates it where it is small, else refuses."""
    g, m = _mask(48, 48, extra="rows")
    assert mask_window_of(m, 48, 48) == UNKNOWN
    assert mask_window(evaluate_value(g, m), 48, 48) is None


@pytest.mark.parametrize("window", [0, 4096])
def test_a_131072_position_mask_is_read_in_linear_time(window: int) -> None:
    """131,072^2 bools would be 16 GiB; the diagonals are 262,143 values."""
    _, m = _mask(131072, 131072, window, float_mask=True)
    start = time.perf_counter()
    assert mask_window_of(m, 131072, 131072) == window
    assert time.perf_counter() - start < 20


def test_prefill_arena_grows_linearly_with_the_prompt(long_checkpoints: dict[str, Path]) -> None:
    """Issue 35's target: the arena of a prefill program at 4x the prompt is at most 4.5x as
    large. Attention keeps its scores in session scratch; an S x S mask or score tensor in the
    arena (16x here) would break it. The 125M figures are in docs/performance.md."""
    arenas = {}
    for s in (2048, 8192):
        plans: list[Any] = []
        compile_model(str(long_checkpoints["llama"]), input_shape=f"input_ids:1,{s}", output="plan",
                      max_seq_len=s + 16, plan=plans)
        (plan,) = plans
        assert plan.arenas["prefill"] >= plan.lower_bounds["prefill"] > 0
        arenas[s] = plan.arenas["prefill"]
    assert arenas[8192] <= 4.5 * arenas[2048], arenas


@pytest.mark.parametrize("dtype,s", [(torch.bfloat16, 64), (torch.bfloat16, 600), (torch.float16, 3000),
                                     (torch.float32, 4096)])
def test_positions_a_float_dtype_rounds_are_not_read_as_exact(dtype: torch.dtype, s: int) -> None:
    """bf16 holds integers exactly to 256: past it the graph's q - 16 rounds (its band is no
    window), and the exact forms would say one. Undecided there, never a wrong window."""
    g = Graph("mask")
    q = const(g, "q", torch.arange(s).reshape(1, 1, s, 1).to(dtype))
    k = const(g, "k", torch.arange(s).reshape(1, 1, 1, s).to(dtype))
    band = node(g, "gt", [k, node(g, "sub", [q, const(g, "w", torch.tensor(16, dtype=dtype))])])
    m = node(g, "bitwise_and", [band, node(g, "le", [k, q])])
    got, want = mask_window_of(m, s, s), mask_window(evaluate_value(g, m), s, s)
    assert got == want or (got == UNKNOWN and want is None), (got, want)
    assert got == (UNKNOWN if s > 256 and dtype != torch.float32 else 16)
