"""Causal convolutions over the sequence (the short-conv mixers of LFM2-style hybrids)
cached by their inputs, and the decode check that refuses a mixer whose state npuc does
not cache (passes/kv_cache.py, passes/decode_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from npuc.apps.generate import steps
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.ir import get_op
from npuc.runtime import Session


class ConvLM(nn.Module):
    """Per layer a gated causal depthwise conv mixer (LFM2's short conv) and an MLP; with
    `recurrent`, token mixing after the conv that no conv window holds: a running sum over
    the sequence ("cumsum", a scan), or the previous position's value ("shift", spelled
    with a pad and a slice, as RWKV's token shift is)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, k: int = 3, layers: int = 2, recurrent: str = "",
                 dilation: int = 1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.convs = nn.ModuleList(nn.Conv1d(hidden, hidden, k, groups=hidden, padding=dilation * (k - 1),
                                             dilation=dilation) for _ in range(layers))
        self.gates = nn.ModuleList(nn.Linear(hidden, 2 * hidden) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.recurrent = recurrent
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        for conv, gate, mlp in zip(self.convs, self.gates, self.mlps, strict=True):
            b, c = gate(h).chunk(2, dim=-1)
            x = (b * h).transpose(1, 2)
            y = conv(x)[..., : x.shape[-1]]
            if self.recurrent == "cumsum":
                y = y.cumsum(-1) * 0.3
            elif self.recurrent == "shift":
                y = y + F.pad(y, (1, 0))[..., :-1]
            h = h + c * y.transpose(1, 2)
            h = h + mlp(F.gelu(h))
        return {"logits": self.head(h)}


def _compile(m: nn.Module, out: Path, **kw: object) -> str:
    return compile_model(m.eval(), input_shape="input_ids:1,8", input_dtypes={"input_ids": "int64"},
                         output=str(out), max_seq_len=40, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("k", "dilation", "groups", "bias"), [(3, 1, 6, True), (2, 2, 2, False), (4, 1, 1, True)])
def test_cached_conv1d_is_the_causal_conv_at_each_position(k: int, dilation: int, groups: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    c, seq = 6, 9
    x = torch.randn(2, c, seq, generator=g)
    w = torch.randn(c, c // groups, k, generator=g)
    b = torch.randn(c, generator=g) if bias else None
    full = F.conv1d(F.pad(x, (dilation * (k - 1), 0)), w, b, dilation=dilation, groups=groups)
    op = get_op("cached_conv1d")
    for p in range(seq):
        cache = torch.full((2, 1, 12, c), float("nan"))  # rows after the token are never read
        cache[:, 0, : p + 1] = x[..., : p + 1].transpose(1, 2)
        ins = [cache, w, torch.tensor([p])] + ([b] if b is not None else [])
        (got,) = op.run(ins, {"dilation": dilation, "groups": groups})
        assert torch.allclose(got[..., 0], full[..., p], atol=1e-5), p


def test_a_conv_mixer_decodes_as_it_prefills(tmp_path: Path) -> None:
    m = ConvLM().eval()
    sess = Session.load(_compile(m, tmp_path / "c"))
    states = {t.name: tuple(t.shape) for t in sess.model.tensors if t.region == "state"}
    assert states["conv_cache.0"] == states["conv_cache.1"] == (1, 1, 48, 32)  # [b, 1, cache rows, channels]
    decode_ops = [st.opdef.name for st in sess.programs["decode"].steps]
    assert decode_ops.count("cached_conv1d") == 2 and "conv1d" not in decode_ops
    prompt = [3, 9, 1, 40, 22, 5, 7, 11, 2, 60, 33]  # longer than the prefill: the rest goes through decode
    got = [(t, lg.clone()) for t, lg in steps(sess, prompt, 16, ignore_eos=True)]
    tokens = [t for t, _ in got]
    with torch.no_grad():
        ref = m(torch.tensor([prompt + tokens]))["logits"][0]
    scale = float(ref.abs().max())
    for i, (_, lg) in enumerate(got):
        assert float((ref[len(prompt) - 1 + i] - lg).abs().max()) <= 1e-5 * scale, i
    assert len(set(tokens)) > 3  # not a degenerate repeat


def test_a_dilated_conv_mixer_decodes_as_it_prefills(tmp_path: Path) -> None:
    m = ConvLM(k=2, dilation=3, layers=1).eval()
    sess = Session.load(_compile(m, tmp_path / "d"))
    prompt = [1, 2, 3, 4, 5, 6]
    got = [(t, lg.clone()) for t, lg in steps(sess, prompt, 12, ignore_eos=True)]
    with torch.no_grad():
        ref = m(torch.tensor([prompt + [t for t, _ in got]]))["logits"][0]
    assert max(float((ref[len(prompt) - 1 + i] - lg).abs().max()) for i, (_, lg) in enumerate(got)) \
        <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize(("recurrent", "why"), [
    ("cumsum", "cumsum .* beside a cached convolution: the scan of a state-space"),
    ("shift", "decode's logits differ from prefill's by .* of what the earlier tokens move them")])
def test_a_recurrence_after_the_conv_is_refused(recurrent: str, why: str, tmp_path: Path) -> None:
    """State after the conv (a scan, as state-space layers keep; a token shift) is in no cache:
    the ops of a scan are refused outright, and what they miss decode-check measures, as a
    decode that disagrees with prefill, instead of writing that program."""
    with pytest.raises(NpucError, match=f"NPUC-E0123: cannot compile a decode program: {why}") as e:
        _compile(ConvLM(recurrent=recurrent), tmp_path / "r")
    assert e.value.exit_code != 0 and not (tmp_path / "r.om").exists()
    # without --max_seq_len it compiles (a single program, which is exact)
    compile_model(ConvLM(recurrent=recurrent).eval(), input_shape="input_ids:1,8", input_dtypes={"input_ids": "int64"},
                  output=str(tmp_path / "one"))


def test_conv_caches_per_slot(tmp_path: Path) -> None:
    """Three slots: each sequence's tokens are what it gets alone, the decode-check pass
    probing slot 0; cached_conv1d reads each slot's window at its own position."""
    from npuc.apps.scheduler import generate_many

    m = ConvLM().eval()
    one = Session.load(_compile(m, tmp_path / "one"))
    many = Session.load(compile_model(m, input_shape="input_ids:3,8", input_dtypes={"input_ids": "int64"},
                                      output=str(tmp_path / "many"), max_seq_len=40))
    assert {tuple(t.shape) for t in many.model.tensors if t.name.startswith("conv_cache.")} == {(3, 1, 48, 32)}
    prompts = [[3, 9, 1, 40, 22, 5, 7, 11, 2, 60, 33], [4, 5], [8, 1, 2, 3, 9], [6] * 9, [12, 13, 14]]
    want = [[t for t, _ in steps(one, p, 10, ignore_eos=True)] for p in prompts]
    assert generate_many(many, prompts, 10, ignore_eos=True) == want
    op = get_op("cached_conv1d")
    cache = torch.randn(2, 1, 12, 6)
    w = torch.randn(6, 1, 3)
    (both,) = op.run([cache, w, torch.tensor([[4], [9]])], {"dilation": 1, "groups": 6})
    for b, p in enumerate((4, 9)):
        (alone,) = op.run([cache[b:b + 1], w, torch.tensor([p])], {"dilation": 1, "groups": 6})
        assert torch.equal(both[b:b + 1], alone)


def test_several_decode_tokens_beside_a_cached_conv_are_refused(tmp_path: Path) -> None:
    from npuc.errors import NpucError

    with pytest.raises(NpucError) as e:
        _compile(ConvLM().eval(), tmp_path / "c", decode_tokens=2)
    assert e.value.code == "NPUC-E0123" and "cached_conv1d" in e.value.message
    assert not list(tmp_path.iterdir())
