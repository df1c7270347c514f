"""Prefill computes the logits of one row per sequence (`--prefill_logits last`, the
default with --max_seq_len; passes/last_token_logits.py).

The pass in FileCheck style: input IR -> pass -> the exact expected IR, each case headed
by a comment, and the rewritten graph's rows checked against the input graph's at
several `last_token` values with the registry's reference kernels; the cases it leaves
alone say why. End to end: tiny Hugging Face models compiled with --max_seq_len give HF
eager's logits at the row asked for and HF's greedy tokens, the runtime refuses a row
outside the prompt, `--prefill_logits all` keeps every row, and the option's mistakes
are usage errors."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from npuc.apps.generate import generate
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.ir import Graph, TensorSource, get_op, parse_graph, print_graph, verify
from npuc.passes.last_token_logits import LAST_TOKEN, LastTokenLogits
from npuc.passes.manager import PassManager
from npuc.runtime import Session

VOCAB = 128


def ir(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def load(src: str, seed: int = 0) -> Graph:
    """Parse `src` (which must round-trip) and give every constant random data in [0.5, 1.5)."""
    g = parse_graph(ir(src))
    assert print_graph(g) == ir(src)
    gen = torch.Generator().manual_seed(seed)
    for c in g.constants.values():
        c.const = TensorSource(torch.rand(c.type.shape, generator=gen).to(c.type.dtype.torch) + 0.5)
    verify(g)
    return g


def interpret(g: Graph, feeds: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    env = {id(v): feeds[v.name] for v in g.inputs}
    for c in g.constants.values():
        env[id(c)] = c.const.load()  # type: ignore[union-attr]
    for n in g.nodes:
        for o, t in zip(n.outputs, get_op(n.op).run([env[id(v)] for v in n.inputs], n.attrs), strict=True):
            env[id(o)] = t
    return [env[id(v)] for v in g.outputs]


def assert_rows(before: Graph, after: Graph, atol: float = 1e-6) -> None:
    """`after` computes row last_token[i] of each sequence i of what `before` computes, for
    every row (the same rows for the whole batch, and one row per sequence)."""
    ids = next(v for v in before.inputs if v.name == "input_ids")
    b, s = ids.type.shape
    x = torch.randint(0, 16, (b, s), generator=torch.Generator().manual_seed(1))
    wants = interpret(before, {"input_ids": x})
    picks = [torch.full((b,), r) for r in range(s)] + [torch.arange(b) % s]
    for rows in picks:
        for got, want in zip(interpret(after, {"input_ids": x, LAST_TOKEN: rows}), wants, strict=True):
            assert got.shape == (b, 1, *want.shape[2:])
            torch.testing.assert_close(got[:, 0], want[torch.arange(b), rows], atol=atol, rtol=1e-5)


def check(src: str, expected: str, numerics: bool = True) -> dict[str, Any]:
    g = load(src)
    res = LastTokenLogits(required=True)(g)
    verify(res.graph)
    assert print_graph(res.graph) == ir(expected)
    assert print_graph(parse_graph(ir(expected))) == ir(expected)
    assert res.modified
    if numerics:
        assert_rows(load(src), res.graph)
    return res.details


def leaves(src: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    """By default the pass leaves `src` as it is, warns and says why; asked for, it refuses."""
    g = load(src)
    # The handler on npuc's logger itself: an in-process CLI run earlier in the session
    # stops npuc's records from propagating to the root logger (cli/diagnostics.py).
    npuc_log = logging.getLogger("npuc")
    npuc_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="npuc"):
            res = LastTokenLogits()(g)
    finally:
        npuc_log.removeHandler(caplog.handler)
    assert print_graph(res.graph) == ir(src) and not res.modified
    assert reason in res.details["fallback"], res.details
    assert any(reason in r.getMessage() and "--prefill_logits all" in r.getMessage() for r in caplog.records)
    with pytest.raises(NpucError) as e:
        LastTokenLogits(required=True)(load(src))
    assert e.value.code == "NPUC-E0129" and e.value.exit_code == 3 and reason in e.value.message
    assert "--prefill_logits all" in e.value.hint


# =========================================================================================
# the pass
# =========================================================================================


def test_row_is_picked_before_the_final_norm() -> None:
    # -- the row is picked from the hidden state; norm and LM head run on it alone --
    details = check("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          const @lm_head.weight : f32[16,8]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %n : f32[1,4,8] = rms_norm[axis=2](%h, @norm.weight)
          %logits : f32[1,4,16] = linear(%n, @lm_head.weight)
          return %logits
        }
        """, """
        graph prefill(%input_ids : i64[1,4], %last_token : i64[1]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          const @lm_head.weight : f32[16,8]
          const @batch_rows : i64[1]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %h_last : f32[1,8] = index(%h, @batch_rows, %last_token)
          %h_last_row : f32[1,1,8] = reshape[shape=[1,1,8]](%h_last)
          %n : f32[1,1,8] = rms_norm[axis=2](%h_last_row, @norm.weight)
          %logits : f32[1,1,16] = linear(%n, @lm_head.weight)
          return %logits
        }
        """)
    assert details == {"last_row": ["logits"], "all_rows": []}


def test_tied_embedding_head() -> None:
    # -- a tied LM head reads the embedding table: nothing changes for the pass --
    check("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %n : f32[1,4,8] = layer_norm[axis=-1](%h, @norm.weight)
          %logits : f32[1,4,16] = linear(%n, @embed)
          return %logits
        }
        """, """
        graph prefill(%input_ids : i64[1,4], %last_token : i64[1]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          const @batch_rows : i64[1]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %h_last : f32[1,8] = index(%h, @batch_rows, %last_token)
          %h_last_row : f32[1,1,8] = reshape[shape=[1,1,8]](%h_last)
          %n : f32[1,1,8] = layer_norm[axis=-1](%h_last_row, @norm.weight)
          %logits : f32[1,1,16] = linear(%n, @embed)
          return %logits
        }
        """)


def test_soft_capped_logits_with_a_bias_one_row_per_sequence() -> None:
    # -- batch 2, a kn head, a bias and a soft cap after it: each op is rebuilt on the rows --
    check("""
        graph prefill(%input_ids : i64[2,4]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[8,16]
          const @bias : f32[16]
          const @cap : f32[]
          %h : f32[2,4,8] = gather(@embed, %input_ids)
          %y : f32[2,4,16] = linear[weight_layout="kn"](%h, @lm_head.weight)
          %b : f32[2,4,16] = add(@bias, %y)
          %d : f32[2,4,16] = div(%b, @cap)
          %t : f32[2,4,16] = tanh(%d)
          %logits : f32[2,4,16] = mul(%t, @cap)
          return %logits
        }
        """, """
        graph prefill(%input_ids : i64[2,4], %last_token : i64[2]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[8,16]
          const @bias : f32[16]
          const @cap : f32[]
          const @batch_rows : i64[2]
          %h : f32[2,4,8] = gather(@embed, %input_ids)
          %h_last : f32[2,8] = index(%h, @batch_rows, %last_token)
          %h_last_row : f32[2,1,8] = reshape[shape=[2,1,8]](%h_last)
          %y : f32[2,1,16] = linear[weight_layout="kn"](%h_last_row, @lm_head.weight)
          %b : f32[2,1,16] = add(@bias, %y)
          %d : f32[2,1,16] = div(%b, @cap)
          %t : f32[2,1,16] = tanh(%d)
          %logits : f32[2,1,16] = mul(%t, @cap)
          return %logits
        }
        """)


def test_matmul_head_then_reshape_and_log_softmax() -> None:
    # -- a matmul head; a reshape that keeps [batch, seq] in front gets its shape rewritten --
    check("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @w : f32[8,16]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %y : f32[1,4,16] = matmul(%h, @w)
          %r : f32[1,4,2,8] = reshape[shape=[1,4,2,8]](%y)
          %logits : f32[1,4,2,8] = log_softmax[axis=-1](%r)
          return %logits
        }
        """, """
        graph prefill(%input_ids : i64[1,4], %last_token : i64[1]) {
          const @embed : f32[16,8]
          const @w : f32[8,16]
          const @batch_rows : i64[1]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %h_last : f32[1,8] = index(%h, @batch_rows, %last_token)
          %h_last_row : f32[1,1,8] = reshape[shape=[1,1,8]](%h_last)
          %y : f32[1,1,16] = matmul(%h_last_row, @w)
          %r : f32[1,1,2,8] = reshape[shape=[1,1,2,8]](%y)
          %logits : f32[1,1,2,8] = log_softmax[axis=-1](%r)
          return %logits
        }
        """)


def test_norm_with_another_reader_keeps_its_rows() -> None:
    # -- the normed hidden state is also an output: the row is picked after the norm, which stays whole --
    check("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          const @lm_head.weight : f32[16,8]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %n : f32[1,4,8] = rms_norm[axis=2](%h, @norm.weight)
          %logits : f32[1,4,16] = linear(%n, @lm_head.weight)
          return %logits, %n
        }
        """, """
        graph prefill(%input_ids : i64[1,4], %last_token : i64[1]) {
          const @embed : f32[16,8]
          const @norm.weight : f32[8]
          const @lm_head.weight : f32[16,8]
          const @batch_rows : i64[1]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %n : f32[1,4,8] = rms_norm[axis=2](%h, @norm.weight)
          %n_last : f32[1,8] = index(%n, @batch_rows, %last_token)
          %n_last_row : f32[1,1,8] = reshape[shape=[1,1,8]](%n_last)
          %logits : f32[1,1,16] = linear(%n_last_row, @lm_head.weight)
          return %logits, %n
        }
        """, numerics=False)


def test_two_outputs_through_one_head() -> None:
    # -- each output's chain is rebuilt; the head's copies are left for CSE, and names stay --
    details = check("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[16,8]
          const @t : f32[]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %y : f32[1,4,16] = linear(%h, @lm_head.weight)
          %scaled : f32[1,4,16] = mul(%y, @t)
          return %scaled, %y
        }
        """, """
        graph prefill(%input_ids : i64[1,4], %last_token : i64[1]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[16,8]
          const @t : f32[]
          const @batch_rows : i64[1]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %h_last : f32[1,8] = index(%h, @batch_rows, %last_token)
          %h_last_row : f32[1,1,8] = reshape[shape=[1,1,8]](%h_last)
          %y_last : f32[1,1,16] = linear(%h_last_row, @lm_head.weight)
          %h_last_1 : f32[1,8] = index(%h, @batch_rows, %last_token)
          %h_last_row_2 : f32[1,1,8] = reshape[shape=[1,1,8]](%h_last_1)
          %y : f32[1,1,16] = linear(%h_last_row_2, @lm_head.weight)
          %scaled : f32[1,1,16] = mul(%y_last, @t)
          return %scaled, %y
        }
        """)
    assert details["last_row"] == ["scaled", "y"]


_HEAD = """
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[16,8]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %y : f32[1,4,16] = linear(%h, @lm_head.weight)
          %logits : f32[1,4,16] = OP
          return %logits
        }
        """


@pytest.mark.parametrize("op, reason", [
    # -- a softmax over the sequence mixes the rows --
    ("softmax[axis=1](%y)", "softmax runs along another axis than the last"),
    # -- an operand computed from the whole sequence --
    ("add(%y, %y)", "logits: add reads 2 computed values"),
    # -- a cumulative sum is not known to be row-wise --
    ("cumsum[axis=2](%y)", "logits: cumsum is neither an LM head (a product of the [1,4,H] hidden state"),
])
def test_ops_that_mix_rows_are_left_alone(op: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    leaves(_HEAD.replace("OP", op), reason, caplog)


def test_an_output_no_lm_head_computes_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    # -- the logits are the embedding itself: there is no head to move --
    leaves("""
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,8]
          %logits : f32[1,4,8] = gather(@embed, %input_ids)
          return %logits
        }
        """, "logits: gather is neither an LM head", caplog)


def test_a_model_input_named_last_token_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    # -- the name the runtime feeds is taken --
    leaves("""
        graph prefill(%input_ids : i64[1,4], %last_token : f32[1,4,16]) {
          const @embed : f32[16,8]
          const @lm_head.weight : f32[16,8]
          %h : f32[1,4,8] = gather(@embed, %input_ids)
          %y : f32[1,4,16] = linear(%h, @lm_head.weight)
          %logits : f32[1,4,16] = add(%y, %last_token)
          return %logits
        }
        """, "already has a value named 'last_token'", caplog)


@pytest.mark.parametrize("mode", ["must_keep_origin_dtype", "force_fp32", "force_fp16", "allow_fp32_to_fp16",
                                  "allow_mix_precision_bf16"])
@pytest.mark.parametrize("tile", [1, 16], ids=["cpu", "npu"])
def test_one_row_through_precision_and_alignment(mode: str, tile: int) -> None:
    """Precision converts and alignment pads the 1-row head (valid_rows=1 on the npu target); the
    rows still agree with the input graph's."""
    from npuc.passes.align import TargetAlignment
    from npuc.passes.constant_folding import ConstantFolding
    from npuc.passes.cse import CommonSubexpressionElimination
    from npuc.passes.dce import DeadCodeElimination
    from npuc.passes.precision import Precision

    src = """
        graph prefill(%input_ids : i64[1,4]) {
          const @embed : f32[16,24]
          const @norm.weight : f32[24]
          const @lm_head.weight : f32[40,24]
          %h : f32[1,4,24] = gather(@embed, %input_ids)
          %n : f32[1,4,24] = rms_norm[axis=2](%h, @norm.weight)
          %logits : f32[1,4,40] = linear(%n, @lm_head.weight)
          return %logits
        }
        """
    passes = [LastTokenLogits(required=True), Precision(mode), TargetAlignment(tile), ConstantFolding(),
              CommonSubexpressionElimination(), DeadCodeElimination()]  # the pipeline's order
    g = PassManager(passes, verify_each=True).run(load(src))
    heads = [n for n in g.nodes if n.op == "linear"]
    assert len(heads) == 1 and heads[0].inputs[0].type.shape[1] == (16 if tile == 16 else 1)
    assert heads[0].attrs.get("valid_rows") == (1 if tile == 16 else None)
    assert_rows(load(src), g, atol={"force_fp16": 2e-2, "allow_fp32_to_fp16": 2e-2,
                                    "allow_mix_precision_bf16": 1e-1}.get(mode, 1e-5))


# =========================================================================================
# end to end
# =========================================================================================

PREFILL, MAX_SEQ = 8, 32


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Llama with tied embeddings, and its .om (default target, --prefill_logits by default)."""
    import transformers
    from hf_models import COMMON

    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)).save_pretrained(str(root / "ckpt"))
    om = compile_model(str(root / "ckpt"), input_shape=f"input_ids:1,{PREFILL}", max_seq_len=MAX_SEQ,
                       output=str(root / "m"))
    return root / "ckpt", Path(om)


def _hf(ckpt: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()


def test_prefill_gives_hf_logits_at_the_row_asked_for(tied: tuple[Path, Path]) -> None:
    ckpt, om = tied
    sess = Session.load(str(om))
    prefill = sess.programs["prefill"]
    assert [(t.name, str(t.dtype), t.shape) for t in prefill.inputs] == [
        ("input_ids", "i64", (1, PREFILL)), (LAST_TOKEN, "i64", (1,))]
    assert [(t.name, t.shape) for t in prefill.outputs] == [("logits", (1, 1, VOCAB))]
    assert sess.index_rows("prefill") == {"input_ids": VOCAB, LAST_TOKEN: PREFILL}
    meta = {m.key: m.value for m in sess.model.metadata}
    assert meta["option.prefill_logits"] == "last"
    ids = torch.randint(0, VOCAB, (1, PREFILL), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _hf(ckpt)(ids, use_cache=False).logits
    for row in (0, 3, PREFILL - 1):
        sess.reset_state()
        sess.arena.fill_(0xFF)  # NaN: nothing may read a byte it did not write
        got = sess.run({"input_ids": ids, LAST_TOKEN: torch.tensor([row])}, "prefill")["logits"]
        assert got.shape == (1, 1, VOCAB)
        assert float((got[0, 0] - want[0, row]).abs().max()) < 1e-4, row


def test_generation_matches_hf_greedy(tied: tuple[Path, Path]) -> None:
    from hf_models import hf_greedy

    ckpt, om = tied
    model, sess = _hf(ckpt), Session.load(str(om))
    for prompt in ([5, 17, 3], [9, 8, 7, 6, 5, 4, 3, 2], list(range(20, 31))):  # shorter, as long as, longer
        assert generate(sess, prompt, 12, ignore_eos=True) == hf_greedy(model, prompt, 12)


def test_a_row_outside_the_prompt_is_a_user_error(tied: tuple[Path, Path], tmp_path: Path) -> None:
    sess = Session.load(str(tied[1]))
    ids = torch.zeros(1, PREFILL, dtype=torch.int64)
    for row in (-1, PREFILL, 1000):
        with pytest.raises(NpucError) as e:
            sess.run({"input_ids": ids, LAST_TOKEN: torch.tensor([row])}, "prefill")
        assert e.value.code == "NPUC-E0108" and e.value.exit_code == 2
        assert f"holds {row}, outside the {PREFILL} rows it picks from" in e.value.message
        assert f"0..{PREFILL - 1}" in e.value.hint
    # `npuc run` without the row names it among the model's inputs.
    np.save(tmp_path / "ids.npy", ids.numpy())
    r = subprocess.run([sys.executable, "-m", "npuc", "run", str(tied[1]), "--program", "prefill", "--input",
                        f"input_ids={tmp_path / 'ids.npy'}", "--output-dir", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "NPUC-E0107" in r.stderr and "missing ['last_token']" in r.stderr and "last_token: i64[1]" in r.stderr


def test_all_keeps_every_row(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    om = compile_model(str(hf_checkpoints["llama"]), input_shape=f"input_ids:1,{PREFILL}", max_seq_len=MAX_SEQ,
                       prefill_logits="all", soc_version="cpu", output=str(tmp_path / "all"))
    sess = Session.load(om)
    prefill = sess.programs["prefill"]
    assert [t.name for t in prefill.inputs] == ["input_ids"]
    assert prefill.outputs[0].shape == (1, PREFILL, VOCAB)
    assert {m.key: m.value for m in sess.model.metadata}["option.prefill_logits"] == "all"
    ids = torch.randint(0, VOCAB, (1, PREFILL), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = _hf(hf_checkpoints["llama"])(ids, use_cache=False).logits
    assert float((sess.run({"input_ids": ids}, "prefill")["logits"] - want).abs().max()) < 1e-4
    # Generation reads the last row of an .om without the input (as one compiled before the option).
    from hf_models import hf_greedy

    assert generate(sess, [5, 17, 3], 8, ignore_eos=True) == hf_greedy(_hf(hf_checkpoints["llama"]), [5, 17, 3], 8)


@pytest.mark.parametrize("kwargs, message", [
    ({"prefill_logits": "last"}, "--prefill_logits last needs --max_seq_len"),
    ({"prefill_logits": "first", "max_seq_len": 32}, "--prefill_logits 'first' is not one npuc knows"),
])
def test_option_mistakes_are_usage_errors(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:  # before the model is read: the path does not exist
        compile_model(str(tmp_path / "no_such_model"), input_shape="input_ids:1,8", output=str(tmp_path / "m"),
                      **kwargs)
    assert e.value.code == "NPUC-E0129" and e.value.exit_code == 2 and message in e.value.message


def test_cli_flag_and_precheck(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(hf_checkpoints["llama"]), "--input_shape",
                        "input_ids:1,8", "--prefill-logits", "last", "--output", str(tmp_path / "m")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "NPUC-E0129" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m.om").exists()
    from npuc.compiler.precheck import precheck

    rep = precheck(str(tmp_path / "no_such_model"), input_shape="input_ids:1,8", prefill_logits="last")
    assert "prefill_logits" in rep.checked and rep.problems[0].code == "NPUC-E0129"
