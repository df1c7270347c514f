"""GGUF import (compiler/gguf_import.py, docs/gguf.md): tiny random-init Llama and Qwen2 files
written with gguf-py (tests/gguf_models.py), compiled, and run against HF eager on the file's
own dequantized weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from gguf_models import (  # noqa: E402
    bpe_tokenizer,
    decode,
    encode,
    hf_model,
    permute,
    reference,
    unpermute,
    write_gguf,
)
from hf_models import hf_greedy, prefill_vs_hf  # noqa: E402

from npuc.apps.generate import generate  # noqa: E402
from npuc.compiler.driver import build_graph, compile_model  # noqa: E402
from npuc.compiler.gguf_import import (  # noqa: E402
    KEPT,
    SUPPORTED_TYPES,
    float_rows,
    load_gguf,
    model_dtype,
    qk_rows_order,
    read_gguf,
    treatments,
)
from npuc.compiler.quant_import import QuantizedWeight  # noqa: E402
from npuc.errors import NpucError  # noqa: E402
from npuc.ir import DType, TensorType  # noqa: E402
from npuc.ir.quant import dequantize_ref  # noqa: E402
from npuc.runtime import Session  # noqa: E402

ARCHS = ("llama", "qwen2")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# One file per architecture holds every type, q and k among the codes kept (their rows permuted
# by llama.cpp for Llama) and among those dequantized.
MIXED = {
    "model.embed_tokens.weight": "Q6_K", "lm_head.weight": "Q8_0",
    "model.layers.0.self_attn.q_proj.weight": "Q4_0", "model.layers.0.self_attn.k_proj.weight": "Q6_K",
    "model.layers.0.self_attn.v_proj.weight": "Q5_0", "model.layers.0.self_attn.o_proj.weight": "Q8_0",
    "model.layers.0.mlp.gate_proj.weight": "Q4_K", "model.layers.0.mlp.up_proj.weight": "Q5_K",
    "model.layers.0.mlp.down_proj.weight": "Q4_1",
    "model.layers.1.self_attn.q_proj.weight": "Q5_K", "model.layers.1.self_attn.k_proj.weight": "Q8_0",
    "model.layers.1.self_attn.v_proj.weight": "Q5_1", "model.layers.1.self_attn.o_proj.weight": "BF16",
    "model.layers.1.mlp.gate_proj.weight": "F16", "model.layers.1.mlp.up_proj.weight": "F32",
    "model.layers.1.mlp.down_proj.weight": "Q4_0",
}
PREFILL, MAX_SEQ, NEW = 8, 24, 6
TOL = 1e-4  # f32 activations (the cpu target) over weights equal to gguf's dequantized ones


@pytest.fixture(scope="session")
def models() -> dict[str, Any]:
    return {arch: hf_model(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def mixed(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Any]]:
    """arch -> (the .gguf, its .om compiled with a KV cache, HF eager on the GGUF's weights)."""
    root = tmp_path_factory.mktemp("gguf")
    tok = bpe_tokenizer(models["llama"].config.vocab_size)
    out = {}
    for arch in ARCHS:
        path = root / f"{arch}.gguf"
        ref = reference(models[arch], write_gguf(path, models[arch], MIXED, tok))
        om = compile_model(str(path), input_shape=f"input_ids:1,{PREFILL}", output=str(root / arch),
                           max_seq_len=MAX_SEQ, soc_version="cpu")
        out[arch] = (path, Path(om), ref)
    assert set(MIXED.values()) | {"F32"} == set(TYPES)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("type_name", TYPES)
def test_a_file_of_each_type_compiles_and_matches_hf(models: dict[str, Any], tmp_path: Path, arch: str,
                                                   type_name: str) -> None:
    """Every matrix in one type (the norms F32, as llama.cpp writes them): the compiled prefill
    gives HF eager's logits on the file's dequantized weights."""
    model = models[arch]
    ref = reference(model, write_gguf(tmp_path / "m.gguf", model, {n: type_name for n, p in
                                                                   model.state_dict().items() if p.dim() == 2}))
    om = compile_model(str(tmp_path / "m.gguf"), input_shape="input_ids:1,4", output=str(tmp_path / "m"),
                       soc_version="cpu")
    assert prefill_vs_hf(Session.load(om), ref) < TOL


# -- the conversions are gguf's own dequantize, bit for bit ----------------------------------------

@pytest.mark.parametrize("type_name", sorted(KEPT))
def test_kept_codes_dequantize_to_ggufs_values_bit_for_bit(type_name: str) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (16, 512)).astype(np.float32) * rng.uniform(1e-3, 10, (16, 1)).astype(np.float32)
    w[3] = 0  # an all-zero row: d = 0
    raw = encode(w, type_name)
    # Random codes too: every bit pattern of the code bytes, beside the encoder's scales.
    noisy = raw.copy()
    block = {"Q8_0": (34, 2, 34), "Q4_0": (18, 2, 18), "Q5_0": (22, 2, 22), "Q6_K": (210, 0, 192)}[type_name]
    b = noisy.reshape(16, -1, block[0])
    b[..., block[1]:block[2]] = rng.integers(0, 256, b[..., block[1]:block[2]].shape, dtype=np.uint8)
    k = KEPT[type_name]
    for data in (raw, noisy):
        q, scale, zero = k.convert(torch.from_numpy(data.copy()))
        got = dequantize_ref(q, scale, zero, k.bits, k.group)
        want = torch.from_numpy(decode(data, type_name)).reshape(16, 512)
        assert torch.equal(got, want), float((got - want).abs().max())
        assert scale.dtype == k.scale_dtype.torch and scale.shape == (16, 512 // k.group)


def test_q4_0_nibbles_are_reordered_into_npucs_order() -> None:
    """GGUF's block: byte j holds values j (low) and j + 16 (high); npuc's: 2i (low) and 2i + 1 (high)."""
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([1.0], np.float16).view(np.uint8)
    block[0, 2:] = np.arange(16, dtype=np.uint8) | (15 - np.arange(16, dtype=np.uint8)) << 4
    q, scale, zero = KEPT["Q4_0"].convert(torch.from_numpy(np.tile(block, (1, 1))).reshape(1, 18))
    codes = torch.stack((q & 0xF, q >> 4), dim=-1).flatten().tolist()
    assert codes == list(range(16)) + list(range(15, -1, -1)) and zero.tolist() == [[8]]


def test_qk_rows_order_undoes_llama_cpps_permute() -> None:
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    for heads in (1, 2, 4):
        order = qk_rows_order(64, heads).numpy()
        assert np.array_equal(permute(w, heads)[order], w)
        assert np.array_equal(unpermute(permute(w, heads), heads), w)


# -- each architecture in each type: the weights npuc reads are the GGUF's ------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("type_name", TYPES)
def test_every_weight_reads_as_ggufs_dequantized_value(models: dict[str, Any], tmp_path: Path, arch: str,
                                                       type_name: str) -> None:
    model = models[arch]
    types = {n: type_name for n, p in model.named_parameters() if p.dim() == 2}
    want = write_gguf(tmp_path / "m.gguf", model, types)
    loaded = load_gguf(tmp_path / "m.gguf")
    # the model's dtype: f32, since the norms are F32 (an F16 matrix is widened, not its norms rounded)
    dtype = torch.float32
    assert model_dtype(read_gguf(tmp_path / "m.gguf")) == dtype
    for name, w in want.items():
        src = loaded.sources[name]
        assert torch.equal(src.load(), torch.from_numpy(w).to(dtype)), name
        if len(w.shape) == 2 and type_name in KEPT:
            assert isinstance(src, QuantizedWeight) and src.bits == KEPT[type_name].bits, name
        elif len(w.shape) == 2 and type_name == "F32":
            permuted = arch == "llama" and ("q_proj" in name or "k_proj" in name)
            where = src.file_range(TensorType(tuple(w.shape), DType.from_torch(dtype)))
            assert (where is None) == permuted, name  # copied file to file unless its rows are reordered


# -- compiled: the same logits and greedy tokens as HF eager on the GGUF's weights -------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_gguf_matches_hf_on_its_dequantized_weights(mixed: dict[str, tuple[Path, Path, Any]],
                                                           arch: str) -> None:
    path, om, ref = mixed[arch]
    sess = Session.load(str(om))
    assert prefill_vs_hf(sess, ref, "prefill") < TOL
    prompt = [5, 70, 9, 31, 200, 11]
    assert generate(sess, prompt, NEW, ignore_eos=True) == hf_greedy(ref, prompt, NEW)
    # The q/k guess matters: the other one (permuted rows for Qwen2, un-permuted ones for Llama) is far off.
    wrong = {}
    for name, w in ref.state_dict().items():
        heads = ref.config.num_attention_heads if "q_proj" in name else ref.config.num_key_value_heads
        x = w.numpy()
        if "q_proj" in name or "k_proj" in name:
            x = permute(x, heads) if arch == "llama" else unpermute(x, heads)
        wrong[name] = x
    assert prefill_vs_hf(sess, reference(ref, wrong), "prefill") > 100 * TOL


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma", "phi3", "deepseek2-v2", "deepseek2-v3"])
def test_other_architectures_match_hf(tmp_path: Path, arch: str) -> None:
    """Qwen3 (q/k norms), Mistral (q/k permuted), Gemma (norms stored + 1, tied head), Phi-3 (fused
    qkv and gate_up), DeepSeek-V2 (MLA, softmax-routed experts) and V3 (q LoRA, sigmoid routing with
    its bias, kv_b stored split): Q8_0 codes where the rows hold whole blocks, F32 elsewhere."""
    from gguf_models import write_arch

    model, weights = write_arch(tmp_path / f"{arch}.gguf", arch, "Q8_0")
    om = compile_model(str(tmp_path / f"{arch}.gguf"), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                       soc_version="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(model, weights)(ids, use_cache=False).logits
    assert float((Session.load(om).run({"input_ids": ids})["logits"] - want).abs().max()) < TOL


def test_llama3_rope_freqs_tensor_scales_the_frequencies(models: dict[str, Any], tmp_path: Path) -> None:
    """Llama 3.1's RoPE scaling is stored as `rope_freqs.weight`, a divisor per frequency (as
    llama.cpp applies it): prefill and decode both rotate with inv_freq / rope_freqs."""
    model = models["llama"]
    half = model.config.hidden_size // model.config.num_attention_heads // 2
    factors = np.linspace(1.0, 8.0, half).astype(np.float32)
    path = tmp_path / "llama3.gguf"
    weights = write_gguf(path, model, {}, extra={"rope_freqs.weight": factors})
    ref = reference(model, weights)
    rope = ref.model.rotary_emb
    rope.inv_freq = rope.inv_freq / torch.from_numpy(factors)
    om = compile_model(str(path), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                       max_seq_len=MAX_SEQ, soc_version="cpu")
    sess = Session.load(om)
    assert prefill_vs_hf(sess, ref, "prefill") < TOL
    prompt = [3, 50, 7, 120]
    assert generate(sess, prompt, NEW, ignore_eos=True) == hf_greedy(ref, prompt, NEW)


def test_kept_codes_become_quantized_products(mixed: dict[str, tuple[Path, Path, Any]]) -> None:
    sess = Session.load(str(mixed["llama"][1]))
    kept = {n.removesuffix(".weight") for n, t in MIXED.items() if t in KEPT}
    codes = {t.name.removesuffix(".weight.q") for t in sess.tensors if t.name.endswith(".q")}
    assert codes == kept
    six = next(t for t in sess.tensors if t.name == "model.layers.0.self_attn.k_proj.weight.scale")
    assert six.shape == (128, 256 // 16) and six.dtype.value == "f32"  # Q6_K: g16, f32 scales


def test_treatments_are_logged_per_tensor(mixed: dict[str, tuple[Path, Path, Any]]) -> None:
    import logging

    class Keep(logging.Handler):  # on npuc's logger itself: a CLI test may have stopped it propagating
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    log, keep = logging.getLogger("npuc"), Keep()
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        build_graph(str(mixed["llama"][0]), f"input_ids:1,{PREFILL}")
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    lines = {r.getMessage() for r in keep.records}
    assert "blk.0.attn_q.weight Q4_0 -> 4-bit g32 (codes kept, nibbles reordered), q/k rows un-permuted" in lines
    assert "blk.0.ffn_gate.weight Q4_K -> f32 (dequantized by gguf, exact values; no npuc layout keeps its codes)" \
        in lines
    assert "blk.1.attn_output.weight BF16 -> f32 (widened, exact)" in lines
    listed = treatments(mixed["llama"][0])  # every tensor of the file, once, as logged
    assert sorted(t.tensor for t in listed) == sorted(read_gguf(mixed["llama"][0]).tensors)
    assert {str(t) for t in listed} <= lines
    assert any(r.levelname == "WARNING" and "1 Q4_K tensor(s)" in r.getMessage() and "stored as f32 values" in
               r.getMessage() for r in keep.records)


# -- the tokenizer from the metadata, and the CLI -----------------------------------------------------------

def test_generate_prompt_uses_the_ggufs_tokenizer(mixed: dict[str, tuple[Path, Path, Any]]) -> None:
    path, om, ref = mixed["qwen2"]
    tok = bpe_tokenizer(ref.config.vocab_size)
    text = "the cat sat on the mat"
    prompt = tok.encode(text).ids
    want = hf_greedy(ref, prompt, NEW)
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(om), "--prompt", text, "--max-new-tokens",
                        str(NEW), "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ids_line, text_line = r.stdout.splitlines()[:2]
    assert ids_line.split() == [str(t) for t in want]
    assert text_line == tok.decode(want)
    assert read_gguf(path).metadata["tokenizer.ggml.eos_token_id"] == 1
    assert {m.key: m.value for m in Session.load(str(om)).model.metadata}["eos_token_id"] == "1"


def _rewrite(src: Path, dst: Path, edit: Any) -> None:
    data = bytearray(src.read_bytes())
    dst.write_bytes(bytes(edit(data)))


def test_damaged_files_are_refused(mixed: dict[str, tuple[Path, Path, Any]], tmp_path: Path) -> None:
    src = mixed["llama"][0]
    cases = {"truncated.gguf": lambda d: d[: len(d) - 4096], "header.gguf": lambda d: d[:20],
             "garbage.gguf": lambda d: b"GGUF" + bytes(range(256)) * 4, "magic.gguf": lambda d: b"XXXX" + d[4:]}
    for name, edit in cases.items():
        _rewrite(src, tmp_path / name, edit)
        with pytest.raises(NpucError) as e:
            compile_model(str(tmp_path / name), input_shape="input_ids:1,8", output=str(tmp_path / "out" / "m"))
        assert e.value.code == "NPUC-E0407" and e.value.exit_code == 4, (name, e.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_cli_refuses_an_unsupported_architecture_in_one_line(models: dict[str, Any], tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(path), "--input_shape", "input_ids:1,8",
                        "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "NPUC-E0306" in r.stderr and "'mamba' is not supported" in r.stderr and "llama, mistral" in r.stderr
    assert not (tmp_path / "out.om").exists()


def test_a_tensor_type_npuc_does_not_import_is_refused(models: dict[str, Any], tmp_path: Path) -> None:
    write_gguf(tmp_path / "q2k.gguf", models["qwen2"], {"model.layers.1.mlp.up_proj.weight": "Q2_K"})
    with pytest.raises(NpucError) as e:
        build_graph(str(tmp_path / "q2k.gguf"), "input_ids:1,8")
    assert e.value.code == "NPUC-E0309" and "blk.1.ffn_up.weight is stored as Q2_K" in e.value.message
    assert "Q4_K" in e.value.hint


def test_a_missing_tensor_is_named(models: dict[str, Any], tmp_path: Path) -> None:
    write_gguf(tmp_path / "cut.gguf", models["llama"], {}, drop=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(NpucError) as e:
        build_graph(str(tmp_path / "cut.gguf"), "input_ids:1,8")
    assert e.value.code == "NPUC-E0305" and "model.layers.1.mlp.down_proj.weight" in e.value.message


def test_missing_gguf_package_is_a_usage_error(mixed: dict[str, tuple[Path, Path, Any]],
                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from npuc.compiler import gguf_import

    gguf_import._read_cached.cache_clear()
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(NpucError) as e:
        build_graph(str(mixed["llama"][0]), "input_ids:1,8")
    assert e.value.code == "NPUC-E0104" and "npuc[gguf]" in e.value.hint


def _block(type_name: str) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def test_float_rows_of_every_supported_type() -> None:
    """float_rows (the dequantized path) is gguf's dequantize, for every type the importer takes."""
    from npuc.compiler.gguf_import import GgufTensor

    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (4, 256)).astype(np.float32)
    for t in SUPPORTED_TYPES:
        data = encode(w, t)
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(4, -1)
        info = GgufTensor("x", t, 0, (4, 256), 0, raw.nbytes, _block(t))
        assert torch.equal(float_rows(raw, info).float().reshape(4, 256), torch.from_numpy(decode(data, t)).reshape(4, 256)), t


def test_conversions_by_row_blocks_equal_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors are converted a block of rows at a time (bounded temporaries): the same parts."""
    from npuc.compiler import gguf_import

    w = np.random.default_rng(3).normal(0, 1, (10, 256)).astype(np.float32)
    for t in ("Q6_K", "Q4_0", "Q4_K"):
        data = np.ascontiguousarray(encode(w, t)).view(np.uint8).reshape(10, -1)
        info = gguf_import.GgufTensor("x", t, 0, (10, 256), 0, data.nbytes, _block(t))
        whole = [gguf_import.float_rows(data, info)]
        if t in KEPT:
            whole += list(KEPT[t].convert(torch.from_numpy(data.copy())))
        monkeypatch.setattr(gguf_import, "_ROWS", 3)
        parts = [gguf_import.float_rows(data, info)]
        if t in KEPT:
            parts += list(gguf_import.by_rows(KEPT[t].convert)(torch.from_numpy(data.copy())))
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True)), t


def test_a_bf16_file_generates_alike_on_both_executors(models: dict[str, Any], tmp_path: Path) -> None:
    """An all-BF16 file compiles to a bf16 model, whose logits leave the C executor as their
    16 bits: generation must read them as numbers (the torch executor's tokens are the check)."""
    from npuc.runtime import Session
    from npuc.runtime.native_session import NativeSession

    model = models["llama"]
    write_gguf(tmp_path / "b.gguf", model, {n: "BF16" for n in model.state_dict()})  # the norms too
    assert model_dtype(read_gguf(tmp_path / "b.gguf")) == torch.bfloat16
    om = compile_model(str(tmp_path / "b.gguf"), input_shape="input_ids:1,8", max_seq_len=24,
                       output=str(tmp_path / "b"), soc_version="cpu")
    prompt = [5, 17, 3, 99, 42, 7, 64, 11]
    want = generate(Session.load(om), prompt, 8, ignore_eos=True)
    assert generate(NativeSession(om), prompt, 8, ignore_eos=True) == want
