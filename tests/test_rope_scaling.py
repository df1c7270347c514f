"""RoPE scaling past the original context: each of transformers' scalings (linear, llama3,
YaRN, dynamic NTK, LongRoPE) on a tiny model whose original context is ORIG positions,
compiled with --max_seq_len MAX = 8 x ORIG, agrees with transformers at positions across
the whole cache: a prompt of PREFILL tokens (last-token logits) and decode steps from
there to the last position, and a short prompt decoded past the original context.

What "agrees" means where transformers' rotation depends on the sequence length is
compiler/rope_scaling.py's docstring: dynamic NTK as transformers' decode steps rotate each
position, LongRoPE by long_factor throughout once --max_seq_len passes the original
context (Phi-3's generate re-prefills with it when a sequence first does)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import COMMON, prefill_vs_hf

import npuc
from npuc.apps.generate import generation_info, steps
from npuc.compiler.driver import compile_model
from npuc.compiler.precheck import precheck
from npuc.runtime import Session

ORIG, MAX, PREFILL = 64, 512, 448
KINDS = ["linear", "llama3", "yarn", "dynamic", "longrope"]
TOL = 1e-4
THETA = 10000.0


def _config(kind: str, rope: bool = True) -> Any:
    """A tiny config of `kind` whose scaling extends ORIG positions 8 times (`rope`=False:
    the same model with plain RoPE)."""
    import transformers as tf

    # Weights 5x the default init's: attention peaks, so the logits follow the rotation closely
    base = {**COMMON, "max_position_embeddings": MAX, "initializer_range": 0.1}
    if kind == "longrope":
        half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
        scaling = dict(rope_type="longrope", rope_theta=THETA, factor=MAX / ORIG, short_factor=[1.0 + 0.02 * i for i in range(half)],
                       long_factor=[1.0 + 2.0 * i for i in range(half)])
        return tf.Phi3Config(**base, original_max_position_embeddings=ORIG, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, rope_parameters=scaling if rope else None)
    if kind == "dynamic":  # scales past max_position_embeddings itself
        base["max_position_embeddings"] = ORIG
        scaling = dict(rope_type="dynamic", rope_theta=THETA, factor=8.0)
    elif kind == "linear":
        scaling = dict(rope_type="linear", rope_theta=THETA, factor=8.0)
    elif kind == "llama3":
        scaling = dict(rope_type="llama3", rope_theta=THETA, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=ORIG)
    else:
        scaling = dict(rope_type="yarn", rope_theta=THETA, factor=8.0, original_max_position_embeddings=ORIG)
    cls = tf.Qwen2Config if kind == "yarn" else tf.LlamaConfig
    return cls(**base, rope_parameters=scaling if rope else None)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each kind's checkpoint, saved on first use."""
    import transformers as tf

    root = tmp_path_factory.mktemp("rope_scaling")
    saved: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in saved:
            torch.manual_seed(0)
            tf.AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(root / kind)
            saved[kind] = root / kind
        return saved[kind]

    return get


@pytest.fixture(scope="session")
def compiled(checkpoints: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[..., Session]:
    """A kind compiled (prefill and max_seq_len given), once per session."""
    root = tmp_path_factory.mktemp("rope_om")
    done: dict[tuple[str, int, int], str] = {}

    def get(kind: str, prefill: int = PREFILL, max_seq_len: int = MAX, executor: str = "torch") -> Any:
        key = (kind, prefill, max_seq_len)
        if key not in done:
            done[key] = compile_model(str(checkpoints(kind)), input_shape=f"input_ids:1,{prefill}",
                                      output=str(root / f"{kind}_{prefill}_{max_seq_len}"), max_seq_len=max_seq_len)
        return Session.load(done[key]) if executor == "torch" else npuc.load(done[key])

    return get


def _hf(path: Path) -> Any:
    """A freshly loaded model: dynamic NTK keeps the longest length it ran in the module."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(path)).eval()


def _hf_generate(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits each was chosen from."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]


def _hf_steps(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """As _hf_generate, the prompt taken in one forward up to ORIG tokens and one token at a time
    after them, as transformers' decode steps take them."""
    with torch.no_grad():
        out = model(torch.tensor([prompt[:ORIG]]), use_cache=True)
        for t in prompt[ORIG:]:
            out = model(torch.tensor([[t]]), cache=out.cache, use_cache=True)
        tokens, logits = [], []
        for _ in range(new):
            logits.append(out.logits[0, -1])
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens, logits


def _npuc_logits(sess: Session, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    """npuc's logits after `prompt` (a prefill, then decode steps for what it does not hold)
    and after each of the `forced` tokens decoded in turn."""
    info = generation_info(sess)
    pos_name = next(t.name for t in sess.programs["decode"].inputs if t.name != info.ids_name)
    sess.reset_state()
    n = min(len(prompt), info.prefill_len)
    ids = torch.zeros((1, info.prefill_len), dtype=torch.long)
    ids[0, :n] = torch.tensor(prompt[:n])
    feeds = {info.ids_name: ids, **({"last_token": torch.tensor([n - 1])} if info.takes_last else {})}
    logits = [sess.run(feeds, "prefill")["logits"][0, 0 if info.last_token else n - 1].clone()]
    for pos, t in enumerate(prompt[n:] + forced, start=n):
        out = sess.run({info.ids_name: torch.tensor([[t]]), pos_name: torch.tensor([pos])}, "decode")
        logits.append(out["logits"][0, -1].clone())
    return logits[len(prompt) - n:]


def _errors(sess: Session, prompt: list[int], want: tuple[list[int], list[torch.Tensor]]) -> dict[int, float]:
    """Max |npuc - transformers| of the logits, by the position they are computed at."""
    tokens, ref = want
    got = _npuc_logits(sess, prompt, tokens[:-1])
    assert len(got) == len(ref)
    return {len(prompt) - 1 + i: float((g - r).abs().max()) for i, (g, r) in enumerate(zip(got, ref, strict=True))}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_prompt_and_decode_to_the_last_position(kind: str, checkpoints: Callable[[str], Path],
                                                       compiled: Callable[..., Session]) -> None:
    """A prompt of PREFILL tokens (7 x ORIG), then decode steps at every position up to MAX - 1:
    the prefill's rows and the decode table's rows past the original context."""
    prompt = _prompt(PREFILL)
    model = _hf(checkpoints(kind))
    want = (_hf_steps if kind == "dynamic" else _hf_generate)(model, prompt, MAX - PREFILL)
    err = _errors(compiled(kind), prompt, want)
    assert sorted(err) == list(range(PREFILL - 1, MAX - 1))
    assert max(err.values()) < TOL, {p: e for p, e in err.items() if e >= TOL}
    # The scaling is what is being compared: the same weights under plain RoPE differ there
    import transformers as tf

    plain = tf.AutoModelForCausalLM.from_config(_config(kind, rope=False)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        unscaled = plain(torch.tensor([prompt])).logits[0, -1]
    assert float((unscaled - want[1][0]).abs().max()) > 100 * TOL


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_prompt_decodes_past_the_original_context(kind: str, checkpoints: Callable[[str], Path],
                                                          compiled: Callable[..., Session]) -> None:
    """A prompt of 8 tokens, padded into the prefill, then decode steps across position ORIG
    to 2 x ORIG. transformers' generate is the reference for every kind: dynamic NTK grows its
    base step by step; Phi-3's LongRoPE rotates by short_factor until the sequence passes
    ORIG, then prefills it again by long_factor, the rotation npuc's cache holds throughout."""
    prompt, new = _prompt(8, seed=1), 2 * ORIG - 8
    want = _hf_generate(_hf(checkpoints(kind)), prompt, new)
    err = _errors(compiled(kind), prompt, want)
    past = {p: e for p, e in err.items() if p >= ORIG}
    assert max(past.values()) < TOL, {p: e for p, e in past.items() if e >= TOL}
    within = max(e for p, e in err.items() if p < ORIG)
    if kind == "longrope":  # transformers: short_factor there; npuc: long_factor (--max_seq_len > ORIG)
        assert within > 100 * TOL
    else:
        assert within < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_the_table_is_transformers_rotation_at_every_position(kind: str, checkpoints: Callable[[str], Path],
                                                              compiled: Callable[..., Session]) -> None:
    """The cos/sin table decode reads, row p against transformers' rotary module at position p:
    one forward over every position (dynamic: a freshly loaded module stepped one position at
    a time, as its decode steps run it)."""
    sess = compiled(kind)
    step = next(st for st in sess.programs["decode"].steps if st.opdef.name == "rope_lut")
    cos, sin = (sess.views[i].float() for i in step.inputs[2:4])
    assert cos.shape[0] >= MAX
    rotary, x = _hf(checkpoints(kind)).model.rotary_emb, torch.zeros(1)
    with torch.no_grad():
        if kind == "dynamic":
            rows = [rotary(x, torch.tensor([[p]])) for p in range(MAX)]
            want_cos, want_sin = (torch.cat([r[k][0] for r in rows]) for k in (0, 1))
        else:
            want_cos, want_sin = (t[0] for t in rotary(x, torch.arange(MAX)[None]))
    half = cos.shape[1]
    assert torch.equal(want_cos[:, :half], want_cos[:, half:])  # rotate_half's: the table holds one half
    assert float((cos[:MAX] - want_cos[:, :half]).abs().max()) < 1e-6
    assert float((sin[:MAX] - want_sin[:, :half]).abs().max()) < 1e-6


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_the_c_executor_generates_transformers_tokens(kind: str, checkpoints: Callable[[str], Path],
                                                      compiled: Callable[..., Any]) -> None:
    """`npuc generate`'s own path: libnpucrt runs the same tables, greedy from the long prompt
    to the last position."""
    sess = compiled(kind, executor="native")
    assert type(sess).__name__ == "NativeSession"
    prompt = _prompt(PREFILL, seed=4)
    tokens, logits = (_hf_steps if kind == "dynamic" else _hf_generate)(_hf(checkpoints(kind)), prompt, MAX - PREFILL)
    got = list(steps(sess, prompt, MAX - PREFILL, ignore_eos=True))
    assert [t for t, _ in got] == tokens
    assert max(float((torch.as_tensor(g) - w).abs().max()) for (_, g), w in zip(got, logits, strict=True)) < TOL


def test_longrope_within_the_original_context_is_short_factor(compiled: Callable[..., Session],
                                                              checkpoints: Callable[[str], Path]) -> None:
    """--max_seq_len at the original context keeps LongRoPE's short_factor: transformers'
    generate at every position up to the last."""
    prompt = _prompt(8, seed=2)
    want = _hf_generate(_hf(checkpoints("longrope")), prompt, ORIG - 8)
    err = _errors(compiled("longrope", prefill=8, max_seq_len=ORIG), prompt, want)
    assert sorted(err) == list(range(7, ORIG - 1))
    assert max(err.values()) < TOL


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_one_program_rotates_as_a_forward_of_its_length(kind: str, checkpoints: Callable[[str], Path],
                                                        tmp_path: Path) -> None:
    """Without --max_seq_len the program is one forward of its length, past the original
    context here: transformers' frequencies of that length at every row (they did not trace:
    a branch on the positions' values, state written into the module)."""
    om = compile_model(str(checkpoints(kind)), input_shape=f"input_ids:1,{2 * ORIG}", output=str(tmp_path / "m"))
    assert prefill_vs_hf(Session.load(om), _hf(checkpoints(kind))) < TOL


def test_precheck_builds_the_longrope_programs(checkpoints: Callable[[str], Path]) -> None:
    """`npuc check` traces the prefill as the compile does (long_factor, --max_seq_len > ORIG),
    so its programs agree with the decode table."""
    report = precheck(str(checkpoints("longrope")), input_shape="input_ids:1,8", max_seq_len=MAX)
    assert not report.problems, [str(p) for p in report.problems]
    assert "generation (prefill + decode)" in report.checked


def test_a_phi3_gguf_keeps_its_longrope_factors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's Phi-3 GGUF holds LongRoPE's factors as two tensors (rope_factors_long and
    rope_factors_short) and the original context and attention factor as metadata: the import
    makes them the config's rope_scaling, so the compile agrees with transformers past the
    original context."""
    import math

    import gguf_models
    import numpy as np

    cfg = _config("longrope")
    params, metadata = cfg.rope_parameters, gguf_models._metadata

    def with_longrope(w: Any, c: Any, a: str) -> None:  # what llama.cpp's converter adds for Phi-3
        metadata(w, c, a)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", ORIG)
        w.add_float32(f"{a}.rope.scaling.attn_factor", math.sqrt(1 + math.log(MAX / ORIG) / math.log(ORIG)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(params[f"{kind}_factor"], dtype=np.float32))

    monkeypatch.setattr(gguf_models, "small_config", lambda arch: cfg)
    monkeypatch.setattr(gguf_models, "_metadata", with_longrope)
    model, _ = gguf_models.write_arch(tmp_path / "phi3.gguf", "phi3")  # F32: HF runs the same weights
    om = compile_model(str(tmp_path / "phi3.gguf"), input_shape=f"input_ids:1,{2 * ORIG}",
                       output=str(tmp_path / "m"), max_seq_len=MAX)
    prompt = _prompt(2 * ORIG, seed=3)
    err = _errors(Session.load(om), prompt, _hf_generate(model, prompt, ORIG))
    assert max(err.values()) < TOL, err
