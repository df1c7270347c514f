"""The KV cache in the mode's half dtype (passes/precision.py, docs/precision.md): under
allow_mix_precision_bf16 every architecture's cache states are bf16 in the .om, `npuc
info` counts half the bytes per token, decode still allocates nothing, and greedy tokens
agree with the fp32 .om for 32 tokens, or diverge only at a near-tie below the logit
tolerance. The half kernels compute their scores in f32 and agree with the reference.

The models are random-init with initializer_range 0.1, as in test_reduced_precision.py:
at the default 0.02 their logits span about +-0.6 and greedy decoding runs through ties."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_models import ARCHS, make_config

from npuc.apps.generate import generation_info, steps
from npuc.compiler.driver import compile_model
from npuc.ir import DType, TensorType, get_op
from npuc.runtime import Session
from npuc.tools.om_tools import model_info

NEW = 32
BF16 = "allow_mix_precision_bf16"
# Logits must be within 8 bf16 epsilons of the largest |logit| of the fp32 .om; measured: at most 2.1.
TOL_EPS = 8
_rng = random.Random(1)
PROMPTS = [[5, 17, 3, 99, 42, 7, 11, 64]] + [[_rng.randrange(128) for _ in range(8)] for _ in range(4)]


@dataclass
class Pair:
    """One architecture compiled twice: fp32 (the default mode) and bf16."""
    arch: str
    f32: Path
    bf16: Path


def _compile(ckpt: Path, out: Path, mode: str = "must_keep_origin_dtype", keep: list[str] | None = None) -> Path:
    return Path(compile_model(str(ckpt), input_shape="input_ids:1,8", max_seq_len=48, precision_mode=mode,
                              keep_dtype=keep, output=str(out)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers as tf

    root, out = tmp_path_factory.mktemp("half_kv"), {}
    for arch in ARCHS:
        cfg = make_config(arch)
        cfg.initializer_range = 0.1
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(root / arch))
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Pair:
    arch, root = request.param, tmp_path_factory.mktemp(request.param)
    return Pair(arch, _compile(checkpoints[arch], root / "f32"), _compile(checkpoints[arch], root / "bf16", BF16))


def _states(sess: Session) -> dict[str, DType]:
    """The cache states (kv_cache.<layer>.<kind>; not the views kv_write's results are)."""
    return {t.name: t.dtype for t in sess.tensors
            if t.region == "state" and t.name.startswith("kv_cache.") and t.name.count(".") == 2}


def test_cache_states_are_bf16_and_cost_half(pair: Pair) -> None:
    full, half = Session.load(str(pair.f32)), Session.load(str(pair.bf16))
    kinds = {"latent"} if pair.arch.startswith("deepseek") else {"k", "v"}
    assert {n.split(".")[2] for n in _states(full)} == kinds  # the latent cache is one state per layer
    assert set(_states(full).values()) == {DType.f32} and _states(half) == dict.fromkeys(_states(full), DType.bf16)
    per_token = model_info(str(pair.f32))["kv_cache_bytes_per_token"]
    assert model_info(str(pair.bf16))["kv_cache_bytes_per_token"] * 2 == per_token > 0
    # decode writes bf16 rows and its attention reads the bf16 cache (and returns bf16)
    decode = half.programs["decode"]
    for st in decode.steps:
        if st.opdef.name in ("kv_write", "cached_attention", "mla_attention"):  # their float operands
            floats = st.inputs[:2 if st.opdef.name == "kv_write" else 3]
            assert all(half.tensors[i].dtype == DType.bf16 for i in (*floats, *st.outputs)), st.name


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_decode_allocates_nothing_under_bf16(pair: Pair, native: bool) -> None:
    # torch: the registry's out-kernels (ir/out_kernels.py), which widen the half cache
    # into their planned workspace; native: the runtime's C kernels where they apply
    from npuc.tools.alloc_profile import profile_run

    sess = Session.load(str(pair.bf16), use_native=native)
    step = {"input_ids": torch.tensor([[5]]), "position": torch.tensor([20])}  # 21 rows widened per layer
    for _ in range(2):
        sess.run(step, "decode")
    r = profile_run(sess, step, "decode", copy_outputs=False)
    assert (r.count, r.bytes) == (0, 0)


def _forced(s: Session, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits each of `tokens` is chosen from, with `tokens` fed back (not s's own choice)."""
    info = generation_info(s)
    s.reset_state()
    feeds = {info.ids_name: torch.tensor([prompt])}
    if info.last_token:  # prefill computes the logits of the prompt's last row alone
        feeds["last_token"] = torch.tensor([len(prompt) - 1])
    rows = [s.run(feeds, "prefill")["logits"][0, -1]]
    pos = next(t.name for t in s.programs["decode"].inputs if t.name != info.ids_name)
    for i, t in enumerate(tokens[:-1]):
        out = s.run({info.ids_name: torch.tensor([[t]]), pos: torch.tensor([len(prompt) + i])}, "decode")
        rows.append(out["logits"][0, -1])
    return torch.stack(rows).float()


def test_greedy_tokens_agree_with_fp32(pair: Pair, record_property: pytest.RecordProperty) -> None:
    full, half = Session.load(str(pair.f32)), Session.load(str(pair.bf16))
    runs = []
    for prompt in PROMPTS:
        ours = list(steps(half, prompt, NEW, ignore_eos=True))
        ref = list(steps(full, prompt, NEW, ignore_eos=True))
        runs.append((prompt, [t for t, _ in ours], torch.stack([lg.float() for _, lg in ours]),
                     [t for t, _ in ref], torch.stack([lg.float() for _, lg in ref])))
    tol = TOL_EPS * torch.finfo(torch.bfloat16).eps * max(float(r[4].abs().max()) for r in runs)
    diverged = []
    for prompt, toks, logits, ref_toks, ref_logits in runs:
        err = float((logits - _forced(full, prompt, toks)).abs().max())  # fp32 along bf16's tokens
        assert err < tol, (prompt, err, tol)
        if toks != ref_toks:  # only where fp32's own top two are closer than the tolerance
            i = next(i for i, (a, b) in enumerate(zip(toks, ref_toks, strict=True)) if a != b)
            top = ref_logits[i].topk(2).values
            gap = float(top[0] - top[1])
            diverged.append(f"prompt {PROMPTS.index(prompt)} step {i}: fp32 top-2 gap {gap:.3g}")
            assert gap < tol, f"{pair.arch}: diverged at step {i} of {prompt}, gap {gap:.3g} >= {tol:.3g}"
    record_property("divergences", "; ".join(diverged) or "none")
    print(f"{pair.arch} bf16 vs fp32, {NEW} tokens: {len(PROMPTS) - len(diverged)}/{len(PROMPTS)} agree;",
          "; ".join(diverged) or "no divergence")


def test_fp16_modes_cache_in_f16_and_kept_attention_in_f32(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # force_fp16 converts every op, the cache with its attention (allow_fp32_to_fp16: test_reduced_precision.py)
    sess = Session.load(str(_compile(checkpoints["llama"], tmp_path / "f16", "force_fp16")))
    assert set(_states(sess).values()) == {DType.f16}
    # --keep_dtype names prefill's attention: decode's (".cached") and the shared cache stay f32 too
    sess = Session.load(str(_compile(checkpoints["llama"], tmp_path / "keep", BF16,
                                     keep=["scaled_dot_product_attention"])))
    states = _states(sess)
    assert {n: d for n, d in states.items() if n.startswith("kv_cache.0.")} == {
        "kv_cache.0.k": DType.f32, "kv_cache.0.v": DType.f32}
    assert {states["kv_cache.1.k"], states["kv_cache.1.v"]} == {DType.bf16}
    assert len(list(steps(sess, PROMPTS[0], 4, ignore_eos=True))) == 4


# --- the kernels over a half cache --------------------------------------------------------

def _run_both(name: str, ins: list[torch.Tensor], attrs: dict[str, float | bool]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference kernel's result and the out-kernel's (which must not decline)."""
    od = get_op(name)
    types = [TensorType(tuple(x.shape), DType.from_torch(x.dtype)) for x in ins]
    outs_t = od.infer_types(types, attrs)
    want = od.run(ins, attrs)[0]
    out = torch.full(outs_t[0].shape, float("nan")).to(outs_t[0].dtype.torch)
    ws = torch.full((od.workspace_bytes(types, outs_t, od.full_attrs(attrs)),), 0xFF, dtype=torch.uint8)
    assert od.out_kernel is not None and od.out_kernel(ins, od.full_attrs(attrs), [out], ws)
    return want, out


def _rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same f32 result rounded once: equal but for the odd element one unit apart (the
    f32 sums may run in another order). Scores kept in the half dtype would round every
    product and agree on about half the elements."""
    diff = (got.float() - want.float()).abs()
    assert float((diff == 0).float().mean()) >= 0.97, float((diff == 0).float().mean())
    assert bool((diff <= torch.finfo(got.dtype).eps * want.float().abs()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s, position", [(1, [13]), (3, [4, 9, 19])], ids=["decode", "chunk"])
def test_cached_attention_over_a_half_cache(dtype: torch.dtype, s: int, position: list[int]) -> None:
    gen = torch.Generator().manual_seed(s)
    q = torch.randn(1, 4, s, 16, generator=gen).to(dtype)
    kc, vc = (torch.randn(1, 2, 24, 16, generator=gen).to(dtype) for _ in range(2))
    pos = torch.tensor(position)
    want, got = _run_both("cached_attention", [q, kc, vc, pos], {"scale": 0.25})
    assert want.dtype == got.dtype == dtype
    # scores and softmax in f32 from the widened operands, rounded once at the end
    mask = torch.arange(24)[None, :] <= pos[:, None]
    f32 = F.scaled_dot_product_attention(q.float(), kc.float().repeat_interleave(2, 1),
                                         vc.float().repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    _rounded_alike(want, f32.to(dtype))
    _rounded_alike(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s, position", [(1, [13]), (3, [4, 9, 19])], ids=["decode", "chunk"])
def test_mla_attention_over_a_half_latent_cache(dtype: torch.dtype, s: int, position: list[int]) -> None:
    h, dn, dr, r, dv, n = 4, 16, 8, 16, 16, 20
    gen = torch.Generator().manual_seed(s)
    q_nope, q_rot = torch.randn(1, h, s, dn, generator=gen), torch.randn(1, h, s, dr, generator=gen)
    kv = torch.randn(1, 1, n, r + dr, generator=gen)
    w_uk, w_uv = torch.randn(h, dn, r, generator=gen) / 4, torch.randn(h, r, dv, generator=gen) / 4
    ins = [x.to(dtype) for x in (q_nope, q_rot, kv, w_uk, w_uv)] + [torch.tensor(position)]
    want, got = _run_both("mla_attention", ins, {"scale": 0.2})
    assert want.dtype == got.dtype == dtype
    _rounded_alike(got, want)
    # against f32 over the same operands: only the latent queries and the result round to
    # the half dtype (as a linear's would), so a few units of the half dtype at most
    f32 = get_op("mla_attention").run([x.float() for x in ins[:5]] + ins[5:], {"scale": 0.2})[0]
    assert float((want.float() - f32).abs().max()) <= 4 * torch.finfo(dtype).eps * float(f32.abs().max())


@pytest.mark.parametrize("program", ["prefill", "mixed"])
def test_a_half_cache_keeps_each_rows_slot(checkpoints: dict[str, Path], tmp_path: Path, program: str) -> None:
    """With slots, prefill (and the mixed step) write the slot their `slot` input names: the
    bf16 cache's rebuilt kv_write keeps that operand, and each slot decodes as the model of
    one slot does."""
    from npuc.apps.scheduler import generate_many

    slotted = Session.load(compile_model(str(checkpoints["llama"]), input_shape="input_ids:2,8", max_seq_len=48,
                                         precision_mode=BF16, mixed_tokens=2 if program == "mixed" else None,
                                         output=str(tmp_path / "slots")), use_native=False)
    one = Session.load(str(_compile(checkpoints["llama"], tmp_path / "one", BF16)), use_native=False)
    want = [generate_many(one, [p], 12, True)[0] for p in PROMPTS[:2]]
    assert generate_many(slotted, PROMPTS[:2], 12, True) == want
