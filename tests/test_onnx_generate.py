"""Generation from ONNX (compiler/onnx_decode.py): optimum's `text-generation-with-past`
exports (tests/data/optimum) and a Llama written as onnxruntime-genai's builder writes it
(tests/genai_llama.py) compile with --max_seq_len into npuc's prefill and decode programs
over its own KV cache, and generate what HF's greedy search and onnxruntime's run of the
same file with its past inputs give. A past length of 0 is the first step, and a real
past is an input like any other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import npuc
from npuc.apps.generate import steps
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session

ort = pytest.importorskip("onnxruntime")
DATA = Path(__file__).parent / "data" / "optimum"
ARCHS = ["llama", "qwen2"]
MAX_SEQ, NEW, LAYERS = 64, 32, 2
PROMPT = [5, 17, 3, 99, 42, 7, 64, 11]


def _path(arch: str) -> str:
    return str(DATA / f"{arch}_with_past_opset18.onnx")


@pytest.fixture(scope="module")
def onnx_oms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx_gen")
    return {arch: Path(compile_model(_path(arch), input_shape="batch_size:1;sequence_length:8", max_seq_len=MAX_SEQ,
                                     output=str(root / arch))) for arch in ARCHS}


def _ort_greedy(path: str, prompt: list[int], new: int) -> tuple[list[int], list[np.ndarray]]:
    """onnxruntime running the export as optimum does: the prompt, then one token a step
    with the present outputs fed back as the past."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs()
            if i.name.startswith("past_key_values")}
    ids, tokens, logits = list(prompt), [], []
    feed_ids = np.array([prompt], np.int64)
    for _ in range(new):
        start = len(ids) - feed_ids.shape[1]
        feeds = {"input_ids": feed_ids, "attention_mask": np.ones((1, len(ids)), np.int64),
                 "position_ids": np.arange(start, len(ids), dtype=np.int64)[None], **past}
        outs = dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in takes}), strict=True))
        last = outs["logits"][0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        ids.append(tokens[-1])
        feed_ids = np.array([[tokens[-1]]], np.int64)
        past = {k: outs[k.replace("past_key_values", "present")] for k in past}
    return tokens, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_with_past_export_generates_like_hf_and_onnxruntime(arch: str, onnx_oms: dict[str, Path],
                                                            hf_checkpoints: dict[str, Path]) -> None:
    """32 greedy tokens equal HF's on the checkpoint the file was exported from, and each
    step's logits are onnxruntime's (fed its own present outputs) within 1e-4."""
    from hf_models import hf_greedy
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_checkpoints[arch])).eval()
    want = hf_greedy(hf, PROMPT, NEW)
    ort_tokens, ort_logits = _ort_greedy(_path(arch), PROMPT, NEW)
    assert ort_tokens == want  # the file is that checkpoint
    got = list(steps(Session.load(str(onnx_oms[arch])), PROMPT, NEW, ignore_eos=True))
    assert [t for t, _ in got] == want
    err = max(float(np.abs(lg.numpy().reshape(-1) - w).max()) for (_, lg), w in zip(got, ort_logits, strict=True))
    assert err < 1e-4, f"logits differ from onnxruntime by {err}"


@pytest.mark.parametrize("arch", ARCHS)
def test_with_past_programs_are_the_fused_programs_of_the_checkpoint(arch: str, onnx_oms: dict[str, Path],
                                                                     hf_checkpoints: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """The ONNX file's programs are, op for op, what the Hugging Face folder compiles to:
    attention, RoPE LUT, RMSNorm and SwiGLU fused, a KV cache of the same bytes."""
    from npuc.tools.om_tools import model_info

    hf = compile_model(str(hf_checkpoints[arch]), input_shape="input_ids:1,8", max_seq_len=MAX_SEQ,
                       output=str(tmp_path / "hf"))
    a, b = npuc.load(str(onnx_oms[arch]), executor="torch"), npuc.load(hf, executor="torch")
    for name in ("prefill", "decode"):
        ops = [st.opdef.name for st in a.programs[name].steps]
        assert ops == [st.opdef.name for st in b.programs[name].steps]
        assert ops.count("rope_lut") == 2 * LAYERS and ops.count("swiglu") == LAYERS
        assert ops.count("fused_attention" if name == "prefill" else "cached_attention") == LAYERS
        assert [(i.name, i.shape) for i in a.programs[name].inputs] == [(i.name, i.shape) for i in b.programs[name].inputs]
    assert model_info(str(onnx_oms[arch]))["state_bytes"] == model_info(hf)["state_bytes"]


def test_onnxruntime_optimized_with_past_export_generates_like_hf(hf_checkpoints: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """The with-past Llama after onnxruntime's transformer optimizer (Skip/Simplified
    LayerNormalization, com.microsoft RotaryEmbedding over position_ids) still generates."""
    from hf_models import hf_greedy
    from onnxruntime.transformers import optimizer
    from transformers import AutoModelForCausalLM

    opt = optimizer.optimize_model(_path("llama"), model_type="gpt2", num_heads=4, hidden_size=64, opt_level=0)
    opt.save_model_to_file(str(tmp_path / "opt.onnx"))
    om = compile_model(str(tmp_path / "opt.onnx"), input_shape="batch_size:1;sequence_length:8", max_seq_len=MAX_SEQ,
                       output=str(tmp_path / "m"))
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["llama"])).eval(), PROMPT, NEW)
    assert [t for t, _ in steps(Session.load(om), PROMPT, NEW, ignore_eos=True)] == want


def test_cli_compile_and_generate_on_an_onnx_file(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """ATC's per-input syntax names the token ids only: the mask, positions and past are the
    programs' own."""
    from hf_models import hf_greedy
    from transformers import AutoModelForCausalLM

    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["llama"])).eval(), PROMPT, 12)
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", _path("llama"), "--input_shape", "input_ids:1,8",
                        "--max_seq_len", str(MAX_SEQ), "--output", str(tmp_path / "m")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(tmp_path / "m.om"), "--prompt-ids",
                        ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--ignore-eos"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(t) for t in want]


def _ort_run(path: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


@pytest.mark.parametrize("past", [0, 5])
def test_one_step_with_a_past_matches_onnxruntime(past: int, tmp_path: Path) -> None:
    """Without --max_seq_len the file compiles as one step: past 0 (the prompt: the past inputs
    are fed empty, as onnxruntime takes them) or a past of 5 (concatenated before the new
    keys); the mask's `past_sequence_length + sequence_length` dim is computed from the names."""
    path = _path("llama")
    seq = 8 if past == 0 else 1
    om = npuc.compile(path, input_shape=f"batch_size:1;sequence_length:{seq};past_sequence_length:{past}",
                      output=str(tmp_path / "m"))
    sess = npuc.load(om, executor="torch")
    rng = np.random.default_rng(past)
    feeds = {"input_ids": rng.integers(0, 128, (1, seq)).astype(np.int64),
             "attention_mask": np.ones((1, past + seq), np.int64),
             "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}
    pasts = {f"past_key_values.{i}.{kv}": rng.standard_normal((1, 2, past, 16)).astype(np.float32)
             for i in range(LAYERS) for kv in ("key", "value")}
    got = sess.run({**feeds, **pasts})
    want = _ort_run(path, {**feeds, **pasts})
    assert set(want) <= set(got)
    for name, w in want.items():
        np.testing.assert_allclose(got[name].numpy(), w, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("shape,code,text", [
    ("batch_size:1;sequence_length:8;past_sequence_length:3", "NPUC-E0132", "past_key_values.0.key"),
    ("batch_size:1;sequence_length:0", "NPUC-E0124", "input_ids"),
    # past an input's bound (compiler/shapes.py): refused at shape resolution, before anything is built
    ("batch_size:1;sequence_length:99999999999", "NPUC-E0101", "99999999999"),
])
def test_max_seq_len_shape_errors(shape: str, code: str, text: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(_path("llama"), input_shape=shape, max_seq_len=MAX_SEQ, output=str(tmp_path / "m"))
    assert e.value.code == code and text in e.value.message and e.value.exit_code == 2
    assert not list(tmp_path.iterdir())


def test_a_zero_dim_for_a_torch_model_stays_e0101(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,0", output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0101" and "is 0" in e.value.message


def test_a_model_without_its_cache_cannot_decode(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(str(DATA / "llama_opset18.onnx"), input_shape="batch_size:1;sequence_length:8",
                      max_seq_len=MAX_SEQ, output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0123" and e.value.exit_code == 3 and "with-past" in e.value.hint



# -- onnxruntime-genai builder style: GroupQueryAttention, Skip/SimplifiedLayerNormalization ------

@pytest.fixture(scope="module")
def genai_files(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from genai_llama import build

    root = tmp_path_factory.mktemp("genai")
    return {r: build(hf_checkpoints["llama"], root / f"genai_{r}.onnx", r) for r in ("node", "gqa")}


@pytest.mark.parametrize("rotary", ["node", "gqa"])
def test_genai_builder_llama_compiles_fused_and_matches_onnxruntime(rotary: str, genai_files: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """The prompt step (past 0): logits and present key/values within 1e-4 of onnxruntime,
    with attention, RoPE (com.microsoft RotaryEmbedding nodes, or GQA's own), RMSNorm (the
    Skip norms' residual sums kept) and SwiGLU fused in every layer."""
    path = str(genai_files[rotary])
    sess = npuc.load(npuc.compile(path, input_shape="batch_size:1;sequence_length:8;total_sequence_length:8;"
                                  "past_sequence_length:0", output=str(tmp_path / "m")), executor="torch")
    ops = [st.opdef.name for st in sess.programs[next(iter(sess.programs))].steps]
    assert {op: ops.count(op) for op in ("fused_attention", "rope_lut", "rms_norm", "swiglu")} == \
        {"fused_attention": LAYERS, "rope_lut": 2 * LAYERS, "rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert not {"rotary_embedding", "sdpa", "softmax", "matmul", "sigmoid"} & set(ops)
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 128, (1, 8)).astype(np.int64), "attention_mask": np.ones((1, 8), np.int64)}
    if rotary == "node":
        feeds["position_ids"] = np.arange(8, dtype=np.int64)[None]
    feeds.update({f"past_key_values.{i}.{kv}": np.zeros((1, 2, 0, 16), np.float32)
                  for i in range(LAYERS) for kv in ("key", "value")})
    got = sess.run(feeds)
    want = _ort_run(path, feeds)
    for name, w in want.items():
        np.testing.assert_allclose(got[name].numpy(), w, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("rotary", ["node", "gqa"])
def test_genai_builder_llama_generates_like_hf_and_onnxruntime(rotary: str, genai_files: dict[str, Path],
                                                               hf_checkpoints: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """With --max_seq_len: 32 tokens equal HF's greedy ones, each step's logits within 1e-4 of
    onnxruntime running GroupQueryAttention over its past. With rotary inside GQA there is no
    position_ids input: the decode program is traced with the mask of a later position."""
    from hf_models import hf_greedy
    from transformers import AutoModelForCausalLM

    path = str(genai_files[rotary])
    om = compile_model(path, input_shape="batch_size:1;sequence_length:8", max_seq_len=MAX_SEQ,
                       output=str(tmp_path / "m"))
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["llama"])).eval(), PROMPT, NEW)
    ort_tokens, ort_logits = _ort_greedy(path, PROMPT, NEW)
    assert ort_tokens == want
    got = list(steps(Session.load(om), PROMPT, NEW, ignore_eos=True))
    assert [t for t, _ in got] == want
    err = max(float(np.abs(lg.numpy().reshape(-1) - w).max()) for (_, lg), w in zip(got, ort_logits, strict=True))
    assert err < 1e-4, f"logits differ from onnxruntime by {err}"


def test_gqa_after_earlier_tokens_without_their_past_is_refused(genai_files: dict[str, Path], tmp_path: Path) -> None:
    """A total_sequence_length beyond the keys GroupQueryAttention is given (here: a mask of 9
    over 8 new tokens and no past) is no program npuc can compile outside its own decode."""
    with pytest.raises(NpucError) as e:
        npuc.compile(str(genai_files["gqa"]), input_shape="batch_size:1;sequence_length:8;total_sequence_length:9;"
                     "past_sequence_length:0", output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0304" and "total_sequence_length 9" in e.value.message


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_against_the_with_past_file(arch: str, onnx_oms: dict[str, Path]) -> None:
    """`npuc verify` feeds onnxruntime what the .om holds as constants: the prompt's mask and
    positions and an empty past; the present outputs are not the .om's."""
    from npuc.tools.verify import verify

    report = verify(str(onnx_oms[arch]), _path(arch))
    assert report.ok and [o.source_name for o in report.outputs] == ["logits"]
    assert any("present.0.key" in n for n in report.notes)


def test_with_past_export_over_slots(onnx_oms: dict[str, Path], tmp_path: Path) -> None:
    """--input_shape batch_size:3 caches three sequences: prefill at batch 1 into a slot,
    decode at batch 3; each sequence's tokens are the ones it gets alone."""
    from npuc.apps.scheduler import generate_many

    om = compile_model(_path("qwen2"), input_shape="batch_size:3;sequence_length:8", max_seq_len=MAX_SEQ,
                       output=str(tmp_path / "m"))
    sess = Session.load(om)
    assert [t.shape for t in sess.programs["decode"].inputs] == [(3, 1), (3,)]
    prompts = [PROMPT, PROMPT[:3], list(range(30, 42)), [4, 4, 4, 4]]
    want = [[t for t, _ in steps(Session.load(str(onnx_oms["qwen2"])), p, 8, ignore_eos=True)] for p in prompts]
    assert generate_many(sess, prompts, 8, ignore_eos=True) == want
