"""Recurrent state (compiler/recurrent.py, ir/recurrent_ops.py, passes/recurrent_state.py):
hybrid and state-space models compiled from a Hugging Face folder generate HF's greedy
tokens, every sequence over the slots as it would alone, including in a slot a finished
request left, and `npuc info` reports the state each slot keeps. Speculative decoding over
them: a verify step's rejected drafts are undone by rolling the states back to a row."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compile_pool import CompilePool
from model_matrix import tiny_config
from om_edit import rewrite

from npuc.apps.generate import steps
from npuc.apps.scheduler import Scheduler
from npuc.backend.om_schema import ROLLBACK_SUFFIX
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.passes.recurrent_state import BY_ROW
from npuc.runtime import Session
from npuc.tools.om_tools import model_info

# Gated DeltaNet beside attention; Mamba2 alone; Mamba beside attention without positions (NoPE) and MoE:
# compiled with four slots, and the first two with one too (Jamba's one-slot model: test_model_matrix)
FAMILIES = ["qwen3_5_text", "mamba2", "jamba"]
# and, with four slots only (tests/test_model_matrix.py generates every family with one): the rest of
# the list, and the other recurrences (RWKV's WKV, RecurrentGemma's RG-LRU, MiniMax's lightning
# attention, Kimi's per-channel delta rule)
MORE = ["qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "mamba", "rwkv",
        "recurrent_gemma", "minimax", "kimi_linear"]
PREFILL, MAX_SEQ, SLOTS, NEW = 8, 48, 4, 12
Models = dict[str, tuple[Path, Path | None, Path]]  # per family: HF folder, one-slot .om (or none), SLOTS-slot .om
K = 3  # --speculative_tokens of these four-slot models: a verify program, with its states kept by row
# every recurrence (per-head and per-channel scans, the delta rule, WKV, RG-LRU, lightning
# attention), conv windows, NoPE attention and MoE beside them (the verify trace costs each compile
# ~6 s: the other families repeat these kinds; Kimi's delta rule differs from Qwen's in g's shape
# only, operand 3 sliced along the rows alike; Qwen3-Next's is Qwen3.5's, beside MoE as Jamba's)
SPECULATIVE = ["qwen3_5_text", "mamba2", "jamba", "rwkv", "recurrent_gemma", "minimax"]
# Shorter than the prefill (right padding the state must not see), as long, and longer (the rest by decode)
PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 11], [1, 2, 3], [9] * 12, [100, 50, 25, 12, 6, 3], [7, 7], [2, 3, 4, 5, 6]]
NEW_EACH = [10, 4, 8, 12, 3, 6]  # so that requests finish and the queued ones reuse their slots


def _hf(folder: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _hf_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.fixture(scope="module")
def recurrent_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """(HF folder, one-slot .om, SLOTS-slot .om) per family: tiny random weights, compiled in
    worker processes (tests/compile_pool.py) while this one builds the next folders."""
    import transformers as tf

    root = tmp_path_factory.mktemp("recurrent")
    futures: dict[str, tuple[Path, Future[str] | None, Future[str]]] = {}
    with CompilePool() as pool:
        for fam in FAMILIES + MORE:
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(tiny_config(fam)).eval()
            with torch.no_grad():  # away from init's ties (an MoE router of zeros)
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            folder = root / fam
            model.save_pretrained(str(folder))
            one = pool.compile(str(folder), input_shape=f"input_ids:1,{PREFILL}", max_seq_len=MAX_SEQ,
                               output=str(root / f"{fam}-1")) if fam in FAMILIES[:2] else None
            many = pool.compile(str(folder), input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=MAX_SEQ,
                                speculative_tokens=K if fam in SPECULATIVE else None,
                                output=str(root / f"{fam}-{SLOTS}"))
            futures[fam] = (folder, one, many)
        return {fam: (folder, Path(one.result()) if one is not None else None, Path(many.result()))
                for fam, (folder, one, many) in futures.items()}


@pytest.mark.parametrize("fam", FAMILIES)
def test_generates_hf_greedy_tokens(fam: str, recurrent_models: Models) -> None:
    """32 greedy tokens after a full-length prompt equal HF generate's, on the one-slot model
    and in slot 0 of the four-slot one."""
    folder, one, many = recurrent_models[fam]
    prompt = [(7 * i + 3) % 90 + 4 for i in range(PREFILL)]
    want = _hf_greedy(_hf(folder), prompt, 32)
    for om in (one, many) if one is not None else (many,):
        got = [t for t, _ in steps(Session.load(str(om)), prompt, 32, ignore_eos=True)]
        assert got == want, (om.name, got, want)


@pytest.mark.parametrize("fam", FAMILIES + MORE)
def test_slots_decode_each_sequence_as_alone_and_reuse_slots_clean(
        fam: str, recurrent_models: Models) -> None:
    """Six requests over four slots, of lengths shorter than the prefill, equal to it and
    longer: each one's tokens equal HF's for that prompt alone. The last two run in slots that
    finished requests left, whose recurrent state a prefill must not carry over."""
    folder, _, many = recurrent_models[fam]
    hf = _hf(folder)
    sched = Scheduler(Session.load(str(many)))
    ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, NEW_EACH, strict=True)]
    got: dict[int, list[int]] = {i: [] for i in ids}
    slots_used: dict[int, int] = {}
    while not sched.idle:
        for e in sched.step():
            assert e.token is not None
            got[e.request].append(e.token)
            slots_used.setdefault(e.request, sched.requests[e.request].slot)
    assert len(set(slots_used.values())) == SLOTS and len(slots_used) > SLOTS  # some slots were reused
    for i, p, n in zip(ids, PROMPTS, NEW_EACH, strict=True):
        assert got[i] == _hf_greedy(hf, p, n), (i, p)


def test_refilled_slot_equals_alone(recurrent_models: Models) -> None:
    """The peers' bug, directly: a slot filled by one request, freed, refilled by another;
    the second's tokens equal its tokens alone in a fresh session."""
    _, one, _ = recurrent_models["mamba2"]
    first, second = [3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28]
    alone = [t for t, _ in steps(Session.load(str(one)), second, 16, ignore_eos=True)]
    s = Session.load(str(one))
    list(steps(s, first, 16, ignore_eos=True))
    sched = Scheduler(s)  # the same session: slot 0 holds what the first request left
    rid = sched.submit(second, 16, ignore_eos=True)
    toks = []
    while not sched.idle:
        toks += [e.token for e in sched.step() if e.request == rid]
    assert toks == alone


def test_info_reports_state_per_slot(recurrent_models: Models,
                                     tmp_path: Path) -> None:
    """`npuc info` gives each slot's recurrent bytes: per Mamba2 layer its scan state
    [heads * head_dim, d_state] and its conv window [conv_kernel, conv channels], f32; a pure
    SSM's whole state is the same at another --max_seq_len. Qwen3.5's linear layers keep a
    delta-rule state [heads, d_k, d_v] and a window each."""
    folder, one, many = recurrent_models["mamba2"]
    cfg = tiny_config("mamba2")
    conv = cfg.expand * cfg.hidden_size + 2 * cfg.n_groups * cfg.state_size
    want = cfg.num_hidden_layers * (cfg.num_heads * cfg.head_dim * cfg.state_size + cfg.conv_kernel * conv) * 4
    info = model_info(str(one))
    assert info["recurrent_state_bytes_per_slot"] == want and info["state_bytes"] == want
    assert model_info(str(many))["recurrent_state_bytes_per_slot"] == want
    # and with a verify program, a copy after each of its K + 1 rows but the last: the rollback's
    # (named as the runtime and `npuc info` look for them without the compiler)
    assert BY_ROW == ROLLBACK_SUFFIX
    assert model_info(str(one))["recurrent_rollback_bytes_per_slot"] == 0
    assert model_info(str(many))["recurrent_rollback_bytes_per_slot"] == K * want
    assert model_info(str(many))["state_bytes"] == SLOTS * (K + 1) * want
    longer = compile_model(str(folder), input_shape=f"input_ids:1,{PREFILL}", max_seq_len=4 * MAX_SEQ,
                           output=str(tmp_path / "longer"))
    assert model_info(longer)["state_bytes"] == want  # independent of --max_seq_len
    q = tiny_config("qwen3_5_text")
    linear = q.layer_types.count("linear_attention")
    conv_q = 2 * q.linear_num_key_heads * q.linear_key_head_dim + q.linear_num_value_heads * q.linear_value_head_dim
    want_q = linear * (q.linear_num_value_heads * q.linear_key_head_dim * q.linear_value_head_dim
                       + q.linear_conv_kernel_dim * conv_q) * 4
    assert model_info(str(recurrent_models["qwen3_5_text"][1]))["recurrent_state_bytes_per_slot"] == want_q


def test_prompt_logprobs_refused_where_they_would_bypass_the_reset(
        recurrent_models: Models) -> None:
    """Scoring a prompt with a one-row prefill feeds it through decode from position 0, where
    nothing resets a slot's recurrent state: refused with a hint, not computed wrong."""
    _, _, many = recurrent_models["mamba2"]
    sched = Scheduler(Session.load(str(many)))
    with pytest.raises(NpucError, match="recurrent layers") as e:
        sched.submit([1, 2, 3], 0, prompt_logprobs=True)
    assert e.value.code == "NPUC-E0125"


class _LearnedPositions(torch.nn.Module):
    """Causal attention whose positions are a learned table read at arange(seq): a one-token
    trace bakes position 0 in, which the graph cannot tell from NoPE."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.pos = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(64, hidden)
        self.qkv, self.out = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.head, self.heads = torch.nn.Linear(hidden, vocab), heads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        b, s = input_ids.shape  # position_ids ignored, as a model whose positions are its own
        h = self.emb(input_ids) + self.pos(torch.arange(s))
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return {"logits": self.head(h + self.out(a.transpose(1, 2).reshape(b, s, -1)))}


def test_positions_baked_into_the_decode_trace_are_refused(tmp_path: Path) -> None:
    """An attention without RoPE is cached as NoPE (Jamba above generates), and the decode
    check, run token by token from position 0, finds positions a learned table baked in."""
    for prefill in (8, 24):  # 24: the check runs a short prefill of the same trace (driver.PROBE_TOKENS)
        with pytest.raises(NpucError, match="baked in") as e:
            compile_model(_LearnedPositions().eval(), input_shape=f"input_ids:1,{prefill}",
                          input_dtypes={"input_ids": "int64"}, output=str(tmp_path / "m"), max_seq_len=32)
        assert e.value.code == "NPUC-E0123" and not (tmp_path / "m.om").exists()


def test_decode_check_probes_a_short_prefill(recurrent_models: Models,
                                            tmp_path: Path) -> None:
    """A prompt longer than driver.PROBE_TOKENS: the decode check runs the same trace at 8
    tokens (its reference kernels then cost a few tokens' work at compile time), and the
    prompt-long prefill still generates HF's tokens; a state-space model's forward takes no
    position ids and still traces once."""
    from npuc.compiler.driver import PROBE_TOKENS, build_programs

    for fam in ("qwen3_5_text", "mamba2"):
        folder = recurrent_models[fam][0]
        prefill, _, long, _ = build_programs(str(folder), "input_ids:1,32", None, MAX_SEQ)
        assert long.probe is not None and long.probe.inputs[0].type.shape == (1, PROBE_TOKENS)
        assert prefill.inputs[0].type.shape == (1, 32)
        _, _, short, _ = build_programs(str(folder), f"input_ids:1,{PROBE_TOKENS}", None, MAX_SEQ)
        assert short.probe is None
    folder = recurrent_models["qwen3_5_text"][0]
    om = compile_model(str(folder), input_shape="input_ids:1,32", max_seq_len=MAX_SEQ, output=str(tmp_path / "q"))
    prompt = [(5 * i + 1) % 90 + 4 for i in range(20)]
    got = [t for t, _ in steps(Session.load(om), prompt, 12, ignore_eos=True)]
    assert got == _hf_greedy(_hf(folder), prompt, 12)


def _oracle_drafts(monkeypatch: pytest.MonkeyPatch, answers: dict[tuple[int, ...], list[int]]) -> None:
    """Drafts from the answers without speculation, every sequence's: right, wrong at the
    last draft, or wrong at the first, in turn by the sequence's length, so that verify steps
    keep every row, some, or only the first (and the shorter drafts near the end pad theirs)."""
    def draft(self: Any, k: int) -> list[int]:
        seq = self.tokens
        for prompt, out in answers.items():
            n = len(prompt)
            if tuple(seq[:n]) == prompt and seq[n:] == out[:len(seq) - n]:
                d = list(out[len(seq) - n:][:k])
                if d and len(seq) % 3:
                    d[-1 if len(seq) % 3 == 1 else 0] += 1
                return d
        return []

    monkeypatch.setattr("npuc.apps.speculative.NgramIndex.draft", draft)


def _answers(s: Any, config: Any, rows: list[list[Any]] | None = None) -> tuple[list[list[int]], Any]:
    """Each request's tokens (and, into `rows`, the logits each was chosen from)."""
    sched = Scheduler(s, keep_logits=rows is not None, speculative=config)
    ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, NEW_EACH, strict=True)]
    got: dict[int, list[Any]] = {i: [] for i in ids}
    while not sched.idle:
        for e in sched.step():
            got[e.request].append(torch.as_tensor(np.asarray(e.logits)) if rows is not None else None)
    if rows is not None:
        rows += [got[i] for i in ids]
    return [sched.requests[i].tokens for i in ids], sched.stats


@pytest.mark.parametrize("fam", SPECULATIVE)
def test_speculation_keeps_the_greedy_tokens(fam: str, recurrent_models: Models,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every recurrence (and conv window) under speculation: drafts accepted whole, in part
    and not at all, over six requests in four slots; each slot's states rolled back to its
    last kept row (the rest of a short draft's rows included). The tokens equal the answers
    without speculation."""
    from npuc.apps.speculative import SpeculativeConfig

    _, _, many = recurrent_models[fam]
    s = Session.load(str(many))
    plain: list[list[Any]] = []
    spec: list[list[Any]] = []
    want, _ = _answers(s, SpeculativeConfig(method="off"), plain)
    _oracle_drafts(monkeypatch, {tuple(p): w for p, w in zip(PROMPTS, want, strict=True)})
    got, stats = _answers(s, SpeculativeConfig(method="ngram", min_gain=0.0), spec)
    assert got == want
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted
    for a, b in zip(plain, spec, strict=True):  # every token's logits, not only its argmax
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def test_speculation_on_the_c_and_reference_executors(recurrent_models: Models,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through libnpucrt (npuc_session_rollback) and the reference kernels."""
    from npuc.apps.speculative import SpeculativeConfig
    from npuc.runtime.native_session import NativeSession, runtime_library

    _, _, many = recurrent_models["qwen3_5_text"]
    want, _ = _answers(Session.load(str(many)), SpeculativeConfig(method="off"))
    _oracle_drafts(monkeypatch, {tuple(p): w for p, w in zip(PROMPTS, want, strict=True)})
    sessions = [Session.load(str(many), use_native=False)]
    if runtime_library() is not None:
        sessions.append(NativeSession(str(many)))
    for s in sessions:
        got, stats = _answers(s, SpeculativeConfig(method="ngram", min_gain=0.0))
        assert got == want and 0 < stats.accepted < stats.drafted, type(s).__name__


@pytest.mark.parametrize("fam", ["qwen3_5_text", "mamba2"])
def test_the_c_decode_loop_speculates_over_recurrent_state(fam: str,
                                                          recurrent_models: Models) -> None:
    """npuc_generate_speculative on a recurrent model: each verify step's slots are rolled back
    to their last kept row in C; the tokens are npuc_generate's, requests reusing slots."""
    from test_speculative import c_generate

    from npuc.runtime.native_session import runtime_library

    if runtime_library() is None:
        pytest.skip("no C compiler: the native runtime is not built")
    _, _, many = recurrent_models[fam]
    prompts = [p * 2 for p in PROMPTS]  # repeats: the n-grams find drafts
    want, plain = c_generate(many, prompts, 16)
    got, stats = c_generate(many, prompts, 16, (K, 1, 3, 0.0))
    assert got == want
    assert stats.verify_steps > 0 and stats.drafted > stats.accepted and stats.steps <= plain.steps


def test_the_c_decode_loops_speculation_under_the_sanitizers(recurrent_models: Models,
                                                             tmp_path: Path) -> None:
    """npucrt/tests/generate_driver.c under ASan and UBSan: npuc_generate_speculative's drafts,
    verify steps and rollbacks over six requests in four slots (a prompt longer than the
    prefill fed through decode steps), the tokens npuc_generate's; the refusals."""
    import subprocess

    import npucrt_util

    if npucrt_util.compiler() is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parent.parent
    subprocess.run([npucrt_util.compiler(), "-std=c11", "-fsyntax-only", *npucrt_util.WARNINGS,
                    f"-I{root / 'include'}", f"-I{root / 'npucrt' / 'src'}", str(root / "npucrt/src/decode.c"),
                    str(root / "npucrt/tests/generate_driver.c")], check=True, capture_output=True, timeout=120)
    exe = npucrt_util.build_exe(tmp_path, "npucrt/tests/generate_driver.c", sanitize=True, warnings=False)
    for fam in ("mamba2", "qwen3_5_text"):
        r = subprocess.run([str(exe), str(recurrent_models[fam][2]), "16"], capture_output=True, text=True,
                           timeout=300)
        assert (r.returncode, r.stdout) == (0, "ok\n"), f"{fam}: {r.stderr[-2000:]}"


def test_rollback_restores_a_rows_state_and_refuses_what_it_cannot(
        recurrent_models: Models) -> None:
    """After a verify step of four rows, rolling back to row 1 gives the state two decode
    steps give; a slot or row out of range, or a model without states by row, is refused
    with NPUC-E0108 on both runtimes, and nothing is copied."""
    from npuc.runtime.native_session import NativeSession, runtime_library

    _, one, many = recurrent_models["mamba2"]
    prompt, feed = [5, 17, 3, 99, 42, 7], [11, 23, 8, 40]
    makers: list[Any] = [Session.load] + ([NativeSession] if runtime_library() is not None else [])

    def prefill(s: Any) -> None:
        ids = np.zeros((1, PREFILL), np.int64)
        ids[0, :len(prompt)] = prompt
        s.reset_state()
        s.run({"input_ids": ids, "last_token": np.array([len(prompt) - 1]), "slot": np.array([2])}, "prefill")

    def decode(s: Any, t: int, at: int) -> np.ndarray:
        ids, pos = np.zeros((SLOTS, 1), np.int64), np.zeros((SLOTS,), np.int64)
        ids[2, 0], pos[2] = t, at
        out = s.run({"input_ids": ids, "position": pos}, "decode")["logits"]
        return (out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out))[2, -1]

    for make in makers:
        s = make(str(many))
        prefill(s)
        want = [decode(s, t, len(prompt) + i) for i, t in enumerate(feed[:3])][2]
        for back in (True, False):
            prefill(s)
            ids, pos = np.zeros((SLOTS, K + 1), np.int64), np.zeros((SLOTS, K + 1), np.int64)
            ids[2], pos[2] = [feed[0], feed[1], 77, 78], np.arange(len(prompt), len(prompt) + K + 1)
            s.run({"input_ids": ids, "position": pos}, "verify")
            for slot, row in ((SLOTS, 0), (0, K + 1), (-1, 0), (0, -1)):
                with pytest.raises(NpucError) as e:
                    s.rollback(slot, row)
                assert e.value.code == "NPUC-E0108"
            s.rollback(2, K)  # every row kept: nothing to undo
            if back:
                s.rollback(2, 1)
            got = decode(s, feed[2], len(prompt) + 2)
            assert (np.abs(got - want).max() < 1e-4) == back, (make, back)
        with pytest.raises(NpucError) as e:
            make(str(one)).rollback(0, 0)
        assert e.value.code == "NPUC-E0108" and "--speculative_tokens" in (e.value.hint or "")


def test_a_copy_by_row_without_its_state_is_refused_at_rollback(recurrent_models: Models, tmp_path: Path) -> None:
    """A hostile file (every checksum re-sealed) whose `.by_row` copies no longer pair with
    their state (the state renamed): both runtimes load it and run it, and refuse every
    rollback with NPUC-E0410 naming the copy, and roll back nothing (the other pairs neither)."""
    from npuc.runtime.native_session import NativeSession, runtime_library

    def rename(m: Any) -> None:
        next(t for t in m.tensors if t.name == "conv_window.0").name = "conv_window.0.renamed"

    om = rewrite(recurrent_models["mamba2"][2], tmp_path / "renamed.om", rename)
    for make in [Session.load] + ([NativeSession] if runtime_library() is not None else []):
        s = make(str(om))
        ids, pos = np.zeros((SLOTS, K + 1), np.int64), np.tile(np.arange(K + 1), (SLOTS, 1))
        s.run({"input_ids": ids, "position": pos}, "verify")
        before = s.state.clone() if isinstance(s, Session) else None  # (the C session's state is its own)
        with pytest.raises(NpucError) as e:
            s.rollback(0, 0)
        assert e.value.code == "NPUC-E0410" and "conv_window.0.by_row" in e.value.message, (make, e.value)
        assert before is None or torch.equal(s.state, before)


def test_several_decode_tokens_beside_a_recurrence_are_refused(
        recurrent_models: Models, tmp_path: Path) -> None:
    """--decode_tokens C > 1 keeps no states by row (only verify does): refused, with the
    reason, and no file left."""
    folder = recurrent_models["mamba2"][0]
    with pytest.raises(NpucError, match="verify program") as e:
        compile_model(str(folder), input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=MAX_SEQ, decode_tokens=2,
                      output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0123" and not (tmp_path / "m.om").exists()
