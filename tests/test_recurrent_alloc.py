"""The torch interpreter's decode of a recurrent model allocates nothing (runtime/launch.py): the
recurrences through npucrt/src/ops_recurrent.c's flat entry points, the depthwise conv1d over a
layer's conv window through its own, every other decode op natively or by an out-kernel.

Tiny Mamba2 and Qwen3.5 (Gated DeltaNet beside attention) models of four slots: a prompt into
each slot, then decode steps at four positions. The profiled step allocates nothing, and every
step's logits are the reference interpreter's (use_native=False) within f32's rounding. Then
the two launchers other recurrent families' decode needs, on their own: RWKV's layer_norm on
load-time scratch (the reference's ops, to the bit) and the depthwise conv1d.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compile_pool import CompilePool
from model_matrix import tiny_config

from npuc.runtime import Session, native

FAMILIES = {"mamba2": "selective_scan_state", "qwen3_5_text": "gated_delta_rule_state"}
SLOTS, PREFILL, MAX_SEQ = 4, 8, 48


@pytest.fixture(scope="module")
def slot_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers as tf

    if native.library() is None:
        pytest.skip("the native runtime cannot be built here (no C compiler, or NPUC_NATIVE=0)")
    root = tmp_path_factory.mktemp("recurrent_alloc")
    with CompilePool() as pool:  # in worker processes, while this one saves the next checkpoint
        oms = {}
        for fam in FAMILIES:
            torch.manual_seed(0)
            folder = root / fam
            tf.AutoModelForCausalLM.from_config(tiny_config(fam)).eval().save_pretrained(str(folder))
            oms[fam] = pool.compile(str(folder), input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=MAX_SEQ,
                                    output=str(root / fam))
        return {fam: Path(om.result()) for fam, om in oms.items()}


def _prefill_every_slot(s: Session) -> None:
    for slot in range(SLOTS):
        ids = torch.tensor([[(11 * slot + 3 * i) % 100 + 4 for i in range(PREFILL)]])
        s.run({"input_ids": ids, "slot": torch.tensor([slot]), "last_token": torch.tensor([PREFILL - 1 - slot])},
              "prefill")


def _step(k: int) -> dict[str, torch.Tensor]:
    """Decode step k: each slot at its own position (after its prompt's last row)."""
    return {"input_ids": torch.tensor([[5 + k], [6], [7 + k], [8]]),
            "position": torch.tensor([PREFILL - 1 - slot + 1 + k for slot in range(SLOTS)])}


@pytest.mark.parametrize("fam", FAMILIES)
def test_decode_allocates_nothing(fam: str, slot_models: dict[str, Path]) -> None:
    from npuc.tools.alloc_profile import profile_run

    s, ref = Session.load(str(slot_models[fam])), Session.load(str(slot_models[fam]), use_native=False)
    kinds = {b.opdef.name: s.launchers._choose(b)[0] for b in s._bound["decode"]}
    assert kinds[FAMILIES[fam]] == "native" and kinds["conv1d"] == "native", kinds
    for sess in (s, ref):
        _prefill_every_slot(sess)
    for k in range(3):
        got, want = s.run(_step(k), "decode"), ref.run(_step(k), "decode")
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)
    r = profile_run(s, _step(3), "decode", copy_outputs=False)
    assert (r.count, r.bytes) == (0, 0), r.ops


def _launch(op: str, ins: list[torch.Tensor], attrs: dict[str, object]) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the launcher's kind, its output, the reference kernel's) for one step of `op`."""
    from npuc.ir import get_op
    from npuc.runtime.launch import Bound, Launchers

    od = get_op(op)
    full = od.full_attrs(attrs)
    want = od.run(ins, full)[0]
    out = torch.full_like(want, float("nan"))
    kind, f = Launchers(native.library())._choose(Bound(od, full, ins, [out], None))
    assert f is not None
    f()
    return kind, out, want


@pytest.mark.parametrize("shape,axis,bias", [((4, 1, 64), -1, True), ((3, 5, 7, 9), 2, False), ((2, 300), 1, True)])
def test_layer_norm_on_scratch_is_the_reference(shape: tuple[int, ...], axis: int, bias: bool) -> None:
    """RWKV's layer_norm: the reference kernel's ops on the session's scratch, to the bit."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3 + 1
    norm = shape[axis % len(shape):]
    ins = [x, torch.randn(norm, generator=g)] + ([torch.randn(norm, generator=g)] if bias else [])
    kind, got, want = _launch("layer_norm", ins, {"axis": axis, "eps": 1e-5})
    assert kind == "scratch" and torch.equal(got, want)


@pytest.mark.parametrize("b,c,length,k,bias", [(4, 160, 4, 4, True), (3, 300, 9, 4, False), (2, 5, 3, 1, True)])
def test_depthwise_conv1d_runs_natively(b: int, c: int, length: int, k: int, bias: bool) -> None:
    """A conv window's depthwise conv1d (no padding) through npuc_conv1d_depthwise_f32."""
    if native.library() is None:
        pytest.skip("the native runtime cannot be built here (no C compiler, or NPUC_NATIVE=0)")
    g = torch.Generator().manual_seed(2)
    ins = [torch.randn(b, c, length, generator=g), torch.randn(c, 1, k, generator=g)]
    ins += [torch.randn(c, generator=g)] if bias else []
    kind, got, want = _launch("conv1d", ins, {"groups": c})
    assert kind == "native"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
