"""The trained byte-level Llama (tests/data/stdlib_llama/, docs/trained-model.md) and the
accuracy harness of trained_model.py: the shipped weights still give their recorded
held-out perplexity, npuc's fp32 .om gives HF's, bf16 costs at most a few percent, and an
int8 KV cache keeps the perplexity at context 1024 within x1.005 of an f32 cache."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from trained_model import (
    CHECK_SEQ,
    CHECK_WINDOWS,
    FP32,
    Harness,
    format_table,
    greedy_agreement,
    heldout_windows,
    label,
    logits_hf,
    logits_om,
    perplexity,
    stdlib_llama_dir,
    top1_agreement,
    training_meta,
)

BF16 = {"precision_mode": "allow_mix_precision_bf16"}
QUANT = [{"quant_type": "w8a16"}, {"quant_type": "w4a16", "group_size": 128}, {"quant_type": "w4a16", "group_size": 32}]
# int8 activations (issue 34's bounds on the perplexity ratio, docs/quantization.md has the full table)
ACT8 = [({"quant_type": "w8a8"}, 1.005), ({"quant_type": "w4a8", "group_size": 32}, 1.02)]
# --kv_cache_dtype int8 (issue 35): perplexity at this context within x1.005 of an f32 cache's.
# 1024 is twice the model's max_position_embeddings (512) and four times its training windows
# (256): the model is worse there (docs/precision.md), but both caches see the same positions.
KV_CONTEXT, KV_WINDOWS, KV_STEP = 1024, 16, 64


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return heldout_windows(CHECK_SEQ, CHECK_WINDOWS)


@pytest.fixture(scope="module")
def hf_logits(windows: torch.Tensor) -> torch.Tensor:
    return logits_hf(stdlib_llama_dir(), windows)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return Harness(tmp_path_factory.mktemp("trained"), seq=CHECK_SEQ, windows=CHECK_WINDOWS, prompts=4)


def test_shipped_model_gives_its_recorded_perplexity(windows: torch.Tensor, hf_logits: torch.Tensor) -> None:
    meta = training_meta()
    ppl = perplexity(hf_logits, windows)
    # The value training.json recorded with the same helper: fails if the weights or the harness change.
    assert ppl == pytest.approx(meta["check"]["perplexity"], rel=1e-4)
    assert math.log(ppl) < 2.5 < math.log(256)  # trained: far below uniform over 256 bytes
    assert (stdlib_llama_dir() / "model.safetensors").stat().st_size < 16 << 20


def test_byte_tokenizer_maps_text_to_its_bytes() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stdlib_llama_dir()), local_files_only=True)
    text = "def f(x):\n    return 'é'"
    assert tok(text)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


@pytest.fixture(scope="module")
def fp32_logits(harness: Harness, windows: torch.Tensor) -> torch.Tensor:
    return logits_om(harness.compile(FP32), windows)


def test_fp32_om_matches_hf(harness: Harness, windows: torch.Tensor, hf_logits: torch.Tensor,
                            fp32_logits: torch.Tensor) -> None:
    got = fp32_logits
    assert perplexity(got, windows) == pytest.approx(perplexity(hf_logits, windows), rel=1e-4)
    assert top1_agreement(got, hf_logits) >= 0.999
    _, prompts = harness.data()
    greedy = greedy_agreement(harness.compile(FP32, generate=True), stdlib_llama_dir(), prompts, harness.n_tokens)
    assert greedy.all_rate == 1.0, greedy.leading


def test_generate_prompt_text(harness: Harness) -> None:
    """The .om holds the byte tokenizer, so `npuc generate --prompt "def "` works."""
    from npuc.apps.generate import generate, load_tokenizer
    from npuc.runtime import Session

    sess = Session.load(str(harness.compile(FP32, generate=True)))
    encode, decode = load_tokenizer(sess)
    assert encode("def ") == list(b"def ")
    assert decode(generate(sess, encode("def "), 8, ignore_eos=True))  # some text, no crash


def test_bf16_costs_a_few_percent(harness: Harness, record_property: Callable[[str, object], None]) -> None:
    fp32, bf16 = harness.table([FP32, BF16])
    assert (fp32.ratio, fp32.top1, fp32.greedy.all_rate) == (1.0, 1.0, 1.0)
    assert abs(bf16.ratio - 1) < 0.03
    assert bf16.top1 > 0.95
    record_property("accuracy_table", format_table([fp32, bf16]))
    print("\n" + format_table([fp32, bf16]))  # greedy agreement is reported (-s), not asserted


@pytest.mark.parametrize("options", QUANT, ids=label)
def test_quantized_stays_close_to_fp32(harness: Harness, windows: torch.Tensor, fp32_logits: torch.Tensor,
                                       options: dict[str, object]) -> None:
    """Loose bounds (measured: within 0.4% perplexity, 97%+ top-1; docs/trained-model.md):
    they catch a broken quantizer, not a slightly worse one."""
    from npuc.compiler.driver import compile_model

    if not set(options) <= set(inspect.signature(compile_model).parameters):
        pytest.skip("compile_model has no quant_type yet (issue 14)")
    got = logits_om(harness.compile(options), windows)
    assert abs(perplexity(got, windows) / perplexity(fp32_logits, windows) - 1) < 0.05
    assert top1_agreement(got, fp32_logits) > 0.9


@pytest.mark.parametrize("options, bound", ACT8, ids=[label(o) for o, _ in ACT8])
def test_int8_activations_keep_perplexity(harness: Harness, windows: torch.Tensor, fp32_logits: torch.Tensor,
                                          options: dict[str, object], bound: float) -> None:
    """w8a8 within 0.5% of fp32's perplexity, w4a8 (group 32) within 2%, and most
    next-token predictions unchanged."""
    got = logits_om(harness.compile(options), windows)
    assert perplexity(got, windows) / perplexity(fp32_logits, windows) <= bound
    assert top1_agreement(got, fp32_logits) > 0.95


def test_harness_forwards_unknown_options(tmp_path: Path) -> None:
    """Options go to compile_model as they are: one it does not know fails there, not here."""
    with pytest.raises(TypeError, match="no_such_option"):
        Harness(tmp_path).compile({"no_such_option": 1})


def _decode_chunked(om: Path, windows: torch.Tensor) -> torch.Tensor:
    """[W, S, vocab] logits of each window fed from position 0 through the decode program,
    KV_STEP tokens a step: every query reads its keys and values from the cache, its own
    included (a prefill's attention reads the fresh keys, so the cache's dtype would not show)."""
    from npuc.runtime import Session

    sess = Session.load(str(om))
    out = []
    for w in windows:
        sess.reset_state()
        rows = [sess.run({"input_ids": w[None, i:i + KV_STEP], "position": torch.arange(i, i + KV_STEP)[None]},
                         "decode")["logits"].reshape(KV_STEP, -1).float() for i in range(0, w.numel(), KV_STEP)]
        out.append(torch.cat(rows))
    return torch.stack(out)


def test_int8_kv_cache_keeps_perplexity_at_context_1024(tmp_path: Path,
                                                         record_property: Callable[[str, object], None]) -> None:
    from npuc.compiler.driver import compile_model

    windows = heldout_windows(KV_CONTEXT, KV_WINDOWS)
    logits = {}
    for kv in ("f32", "int8"):
        om = compile_model(str(stdlib_llama_dir()), input_shape=f"input_ids:1,{KV_STEP}", max_seq_len=KV_CONTEXT,
                           decode_tokens=KV_STEP, kv_cache_dtype=kv, soc_version="cpu", output=str(tmp_path / kv))
        logits[kv] = _decode_chunked(Path(om), windows)
    # the decode path computes what one prefill of the window does (checked on two windows)
    full = logits_om(Harness(tmp_path, seq=KV_CONTEXT).compile(FP32), windows[:2])
    assert top1_agreement(logits["f32"][:2], full) >= 0.999
    assert perplexity(logits["f32"][:2], windows[:2]) == pytest.approx(perplexity(full, windows[:2]), rel=1e-4)
    f32, int8 = perplexity(logits["f32"], windows), perplexity(logits["int8"], windows)
    assert float((logits["int8"] - logits["f32"]).abs().max()) > 0  # the int8 cache is read
    record_property("kv_int8_perplexity", f"{int8:.4f} against f32 {f32:.4f}: x{int8 / f32:.5f}")
    assert abs(math.log(int8 / f32)) <= math.log(1.005)
    assert top1_agreement(logits["int8"], logits["f32"]) > 0.98
