"""Generation: `--max_seq_len` builds prefill + decode programs over one KV cache, and
greedy decoding matches HF transformers' `generate(do_sample=False)` token for token
(and logit for logit) on every test architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import GEN_ARCHS, GEN_MAX_SEQ, GEN_PREFILL

from npuc.apps.generate import generate, steps
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.tools.om_tools import model_info, validate_om

MAX_SEQ, PREFILL = GEN_MAX_SEQ, GEN_PREFILL  # what conftest's gen_models compiles
NEW = 32


def _hf(ckpt: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()


def _hf_generate(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]


class NaNArena(Session):
    """Fills the arena with NaN before every run: nothing may read a byte it did not write."""

    def run(self, inputs: Any, program: str | None = None, copy_outputs: bool = True) -> dict[str, torch.Tensor]:
        self.arena.fill_(0xFF)
        return super().run(inputs, program, copy_outputs)


@pytest.mark.parametrize("arch", GEN_ARCHS)
@pytest.mark.parametrize("prompt_len", [6, 13], ids=["prompt<prefill", "prompt>prefill"])
def test_greedy_generation_matches_hf(arch: str, prompt_len: int, gen_models: dict[str, Path],
                                      hf_checkpoints: dict[str, Path]) -> None:
    prompt = [(7 * i + 3) % 120 + 4 for i in range(prompt_len)]
    want, want_logits = _hf_generate(_hf(hf_checkpoints[arch]), prompt, NEW)
    sess = NaNArena.load(str(gen_models[arch]))
    got = list(steps(sess, prompt, NEW, ignore_eos=True))
    assert [t for t, _ in got] == want
    err = max(float((lg - w).abs().max()) for (_, lg), w in zip(got, want_logits, strict=True))
    assert err < 1e-4, f"logits differ from HF by {err}"


def test_state_persists_between_runs_and_resets(gen_models: dict[str, Path]) -> None:
    """Decode reads what prefill wrote: after a reset the same decode step gives other logits."""
    sess = Session.load(str(gen_models["llama"]))
    ids = torch.arange(PREFILL).reshape(1, PREFILL) + 3
    sess.run({"input_ids": ids, "last_token": torch.tensor([PREFILL - 1])}, "prefill")
    step = {"input_ids": torch.tensor([[5]]), "position": torch.tensor([PREFILL])}
    after_prefill = sess.run(step, "decode")["logits"]
    sess.reset_state()
    cold = sess.run(step, "decode")["logits"]
    assert not torch.allclose(after_prefill, cold)
    assert sess.state.abs().sum() > 0  # the cold step wrote its own row


@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_info_reports_tight_plans_for_both_programs(arch: str, gen_models: dict[str, Path]) -> None:
    info = model_info(str(gen_models[arch]))
    progs = {p["name"]: p for p in info["programs"]}
    assert set(progs) == {"prefill", "decode"}
    for p in progs.values():
        assert p["arena_bytes"] <= 1.01 * p["lower_bound_bytes"], (p["name"], p["arena_bytes"],
                                                                   p["lower_bound_bytes"])
    assert info["arena_bytes"] == max(p["arena_bytes"] for p in progs.values())
    assert progs["decode"]["inputs"] == [{"name": "input_ids", "dtype": "i64", "shape": [1, 1]},
                                         {"name": "position", "dtype": "i64", "shape": [1]}]
    # Prefill computes the logits of the row last_token names (--prefill_logits last, the default).
    assert progs["prefill"]["inputs"] == [{"name": "input_ids", "dtype": "i64", "shape": [1, PREFILL]},
                                          {"name": "last_token", "dtype": "i64", "shape": [1]}]
    assert info["metadata"]["option.prefill_logits"] == "last"
    assert info["metadata"]["max_seq_len"] == str(MAX_SEQ)
    assert "ok:" in validate_om(str(gen_models[arch]))


def test_kv_cache_size_is_layers_heads_dims(gen_models: dict[str, Path]) -> None:
    from hf_models import make_config

    cfg = make_config("llama")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    info = model_info(str(gen_models["llama"]))
    assert info["kv_cache_bytes_per_token"] == per_token
    assert info["state_bytes"] >= per_token * MAX_SEQ  # rows rounded up to the tile, each cache aligned


def test_cli_generate_prints_hf_tokens(gen_models: dict[str, Path], hf_checkpoints: dict[str, Path]) -> None:
    prompt = [5, 17, 3, 99, 42, 7]
    want, _ = _hf_generate(_hf(hf_checkpoints["qwen2"]), prompt, 12)
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(gen_models["qwen2"]), "--prompt-ids",
                        ",".join(map(str, prompt)), "--max-new-tokens", "12", "--ignore-eos"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(t) for t in want]


def test_generation_stops_at_eos_and_at_a_full_cache(gen_models: dict[str, Path]) -> None:
    sess = Session.load(str(gen_models["llama"]))
    free = generate(sess, [5, 6, 7], NEW, ignore_eos=True)
    eos = free[3]
    sess.model.metadata.add(key="eos_token_id", value=str(eos))
    stopped = generate(sess, [5, 6, 7], NEW)
    assert stopped == free[:free.index(eos) + 1]
    long = generate(sess, list(range(4, 4 + MAX_SEQ - 5)), NEW, ignore_eos=True)
    assert len(long) == 5 + 1  # positions 43..47 decode, plus the token chosen from the last


@pytest.mark.parametrize("argv, code, msg", [
    (["--prompt-ids", "1,x"], "NPUC-E0125", "'x' is not an ASCII decimal token id"),
    (["--prompt-ids", "5,128"], "NPUC-E0125", "token id 128 is outside the model's vocabulary of 128"),
    ([], "NPUC-E0125", "give the prompts one way"),
    (["--prompt-ids", ",".join(["1"] * MAX_SEQ)], "NPUC-E0125", "caches 48"),
    (["--prompt", "hello"], "NPUC-E0126", "no tokenizer"),
])
def test_cli_generate_errors(argv: list[str], code: str, msg: str, gen_models: dict[str, Path]) -> None:
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(gen_models["llama"]), *argv],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert code in r.stderr and msg in r.stderr and "Traceback" not in r.stderr


def test_prompt_ids_may_be_separated_by_spaces(gen_models: dict[str, Path]) -> None:
    runs = [subprocess.run([sys.executable, "-m", "npuc", "generate", str(gen_models["llama"]), "--prompt-ids", ids,
                            "--max-new-tokens", "4", "--ignore-eos"], capture_output=True, text=True, check=True)
            for ids in ("5,17,3", "5 17 3", "5, 17, 3")]
    assert len({r.stdout for r in runs}) == 1 and len(runs[0].stdout.split()) == 4


def test_generate_needs_a_decode_program(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / "m"))
    with pytest.raises(NpucError, match="NPUC-E0111"):
        generate(Session.load(om), [1, 2], 4)


def test_max_seq_len_must_leave_room(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                      max_seq_len=8)
    assert e.value.code == "NPUC-E0124" and e.value.exit_code == 2
    assert not list(tmp_path.iterdir())
    with pytest.raises(NpucError, match="NPUC-E0124"):
        compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                      max_seq_len=0)


def test_onnx_source_without_its_cache_cannot_decode(onnx_exports: dict[tuple[str, int], Path],
                                                     tmp_path: Path) -> None:
    """An export with no past inputs and present outputs (tests/test_onnx_generate.py: with them)."""
    with pytest.raises(NpucError) as e:
        compile_model(str(onnx_exports[("llama", 18)]), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                      max_seq_len=32)
    assert e.value.code == "NPUC-E0123" and e.value.exit_code == 3 and "with-past" in e.value.hint
    assert not list(tmp_path.iterdir())


# -- --prompt TEXT with the tokenizer stored in the .om ------------------------------------------

def _save_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def test_prompt_text_uses_the_stored_tokenizer(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "llama_tok"
    shutil.copytree(hf_checkpoints["llama"], ckpt)
    tok = _save_tokenizer(ckpt)
    om = compile_model(str(ckpt), input_shape="input_ids:1,8", output=str(tmp_path / "m"), max_seq_len=32)
    shutil.rmtree(ckpt)  # the .om alone must do
    text = "w5 w17 w3 w99 w42"
    prompt = tok(text)["input_ids"]
    want, _ = _hf_generate(_hf(hf_checkpoints["llama"]), prompt, 10)
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", om, "--prompt", text, "--max-new-tokens", "10",
                        "--ignore-eos"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ids_line, text_line = r.stdout.splitlines()
    assert ids_line.split() == [str(t) for t in want]
    assert text_line == tok.decode(want, skip_special_tokens=True)
    assert json.loads(Session.load(om).om.section("tokenizer").tobytes())  # stored as named files


@pytest.mark.parametrize("arch", GEN_ARCHS)
def test_decode_steps_allocate_nothing(arch: str, gen_models: dict[str, Path]) -> None:
    """Steady state: the arena, state and weights are allocated at load, and a decode
    step's ops write into planned slots and workspaces, so the step allocates no tensor."""
    from npuc.tools.alloc_profile import profile_run

    sess = Session.load(str(gen_models[arch]))
    arena, state = sess.arena.data_ptr(), sess.state.data_ptr()
    step = {"input_ids": torch.tensor([[5]]), "position": torch.tensor([3])}
    for _ in range(2):
        sess.run(step, "decode")
    r = profile_run(sess, step, "decode", copy_outputs=False)
    assert (r.count, r.bytes) == (0, 0)
    copied = profile_run(sess, step, "decode")  # the boundary copy of the logits is the only allocation
    assert copied.count == 1 and copied.net_bytes == copied.output_bytes == 128 * 4
    assert (sess.arena.data_ptr(), sess.state.data_ptr()) == (arena, state)


def test_prefill_holds_no_memory_beyond_its_outputs(gen_models: dict[str, Path]) -> None:
    """Prefill still runs some reference kernels (mla_attention under transformers 5); what they
    allocate is freed: all that stays is the output."""
    from npuc.tools.alloc_profile import profile_run

    sess = Session.load(str(gen_models["deepseek_v3"]))
    ids = {"input_ids": torch.zeros(1, PREFILL, dtype=torch.int64), "last_token": torch.tensor([PREFILL - 1])}
    sess.run(ids, "prefill")
    r = profile_run(sess, ids, "prefill")
    assert r.count >= 1 and r.net_bytes == r.output_bytes


def test_decode_position_outside_the_cache_is_a_user_error(gen_models: dict[str, Path]) -> None:
    sess = Session.load(str(gen_models["llama"]))
    for pos in (-1, 48):
        with pytest.raises(NpucError, match="NPUC-E0108.*outside the 48 positions the model caches"):
            sess.run({"input_ids": torch.tensor([[5]]), "position": torch.tensor([pos])}, "decode")


def test_token_ids_outside_the_embedding_are_a_user_error(gen_models: dict[str, Path], tmp_path: Path) -> None:
    import numpy as np

    ids, last = tmp_path / "ids.npy", tmp_path / "last.npy"
    np.save(ids, np.array([[5, 500, 3, 4, 5, 6, 7, 8]], dtype=np.int64))
    np.save(last, np.array([PREFILL - 1], dtype=np.int64))
    r = subprocess.run([sys.executable, "-m", "npuc", "run", str(gen_models["llama"]), "--input", f"input_ids={ids}",
                        "--input", f"last_token={last}", "--output-dir", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "NPUC-E0108" in r.stderr and "holds 500, outside the 128 rows" in r.stderr


@pytest.mark.parametrize("window", [4, 16], ids=["window<prefill", "prefill<window<cache"])
def test_sliding_window_generation_matches_hf(window: int, tmp_path: Path) -> None:
    """Mistral with a sliding window: a band in the prefill's own mask (4 < 8), or one the
    prefill cannot see (16 > 8) that the trace at the cache length shows. Decode attends the
    last `window` keys only: without the window it leaves HF's tokens once the cache is longer."""
    import transformers
    from hf_models import COMMON

    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=window)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    om = compile_model(str(tmp_path / "hf"), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                       max_seq_len=MAX_SEQ)
    sess = NaNArena.load(om)
    windows = {st.opdef.name: st.attrs.get("window") for p in sess.programs.values() for st in p.steps
               if st.opdef.name in ("fused_attention", "cached_attention")}
    assert windows == {"fused_attention": window, "cached_attention": window}
    prompt = [(5 * i + 2) % 120 + 4 for i in range(PREFILL)]
    want, want_logits = _hf_generate(model, prompt, NEW)
    got = list(steps(sess, prompt, NEW, ignore_eos=True))
    assert [t for t, _ in got] == want
    assert max(float((lg - w).abs().max()) for (_, lg), w in zip(got, want_logits, strict=True)) < 1e-4


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
@pytest.mark.parametrize("prompt_len", [6, 13], ids=["prompt<prefill", "prompt>prefill"])
def test_learned_positions_generation_matches_hf(arch: str, prompt_len: int, tmp_path: Path) -> None:
    """Models without RoPE whose positions are a learned embedding (GPT-2's wpe, OPT's offset
    table): the decode program takes the position as an input and looks its row up, where
    a trace at one position would bake that position's row in."""
    import transformers

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    else:
        cfg = transformers.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    om = compile_model(str(tmp_path / "hf"), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                       max_seq_len=MAX_SEQ)
    sess = NaNArena.load(om)
    assert not any(st.opdef.name == "rope_lut" for p in sess.programs.values() for st in p.steps)
    prompt = [(7 * i + 3) % 120 + 4 for i in range(prompt_len)]
    want, want_logits = _hf_generate(model, prompt, NEW)
    got = list(steps(sess, prompt, NEW, ignore_eos=True))
    assert [t for t, _ in got] == want
    assert max(float((lg - w).abs().max()) for (_, lg), w in zip(got, want_logits, strict=True)) < 1e-4


def test_a_max_seq_len_off_the_tile_generates_to_its_end(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The cache is rounded up to the matrix tile (39 -> 48 rows) and the RoPE tables hold the
    39 positions traced: the model loads, decodes every position up to 38 as HF does, and a
    position past max_seq_len is a user error, not a read past the tables."""
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                       max_seq_len=39)
    sess = Session.load(om)
    prompt = [5, 6, 7]
    got = generate(sess, prompt, 64, ignore_eos=True)
    assert len(got) == 39 - len(prompt) + 1
    assert got == _hf_generate(_hf(hf_checkpoints["llama"]), prompt, len(got))[0]
    with pytest.raises(NpucError, match="NPUC-E0108.*outside the 39 positions the model caches"):
        sess.run({"input_ids": torch.tensor([[5]]), "position": torch.tensor([39])}, "decode")
