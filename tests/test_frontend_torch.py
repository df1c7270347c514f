"""torch frontend: nn.Module and .pt2 sources, the unsupported-op report, user errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import npuc
from npuc.errors import NpucError


class Block(nn.Module):
    """A grab bag of ops the frontend must convert (bias, gelu, masked_fill, softmax, split, cumsum...)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(ids) + x
        y = nn.functional.gelu(self.lin(h)) * self.scale
        a, b = y.split([6, 10], dim=-1)
        mask = torch.arange(6) > 2
        a = a.masked_fill(mask, -1e4)
        z = torch.softmax(a, dim=-1).sum(-1, keepdim=True) + b.mean(-1, keepdim=True)
        return z.transpose(0, 1).contiguous(), torch.cumsum(h, dim=1).exp().sqrt()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (2, 4), generator=g), torch.randn(2, 4, 8, generator=g)


def test_module_api_matches_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = Block().eval()
    ids, x = _inputs()
    path = npuc.compile(m, input_shape="ids:2,4;x:2,4,8", input_dtypes={"ids": "int64"},
                        output=str(tmp_path / "block"))
    out = npuc.load(path, executor="torch").run({"ids": ids, "x": x})
    ref = m(ids, x)
    assert list(out) == ["output_0", "output_1"]
    for got, want in zip(out.values(), ref, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pt2_static_and_dynamic(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = Block().eval()
    ids, x = _inputs()
    torch.export.save(torch.export.export(m, (ids, x)), str(tmp_path / "static.pt2"))
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(tmp_path / "static.pt2"), "--input_shape",
                        "ids:2,4;x:2,4,8", "--output", str(tmp_path / "s")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = npuc.load(str(tmp_path / "s.om"), executor="torch").run({"ids": ids, "x": x})
    torch.testing.assert_close(out["output_0"], m(ids, x)[0], atol=1e-5, rtol=1e-5)

    # A static .pt2 cannot be compiled at another shape: say so, naming the input and the dims.
    with pytest.raises(NpucError) as info:
        npuc.compile(str(tmp_path / "static.pt2"), input_shape="ids:3,4;x:3,4,8", output=str(tmp_path / "bad"))
    assert info.value.code == "NPUC-E0115" and info.value.exit_code == 2
    assert "- 'ids:3,4': dim 0 is 3, but the model fixes it to 2 [NPUC-E0115]" in info.value.details
    assert "model inputs: ids: i64[2,4], x: f32[2,4,8]" in info.value.details

    # A dynamic .pt2 is specialised to the shapes given.
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(m, (ids, x), dynamic_shapes={"ids": {0: batch}, "x": {0: batch}})
    torch.export.save(ep, str(tmp_path / "dyn.pt2"))
    path = npuc.compile(str(tmp_path / "dyn.pt2"), input_shape="ids:3,4;x:3,4,8", output=str(tmp_path / "d"))
    ids3, x3 = torch.randint(0, 10, (3, 4)), torch.randn(3, 4, 8)
    out = npuc.load(path, executor="torch").run({"ids": ids3, "x": x3})
    torch.testing.assert_close(out["output_1"], m(ids3, x3)[1], atol=1e-5, rtol=1e-5)


class Unsupported(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sort(x, dim=-1).values
        b = torch.cumprod(x, -1) + torch.cumprod(a, -1)
        return torch.fft.fft(b).real


def test_every_unsupported_op_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        npuc.compile(Unsupported(), input_shape="x:2,8", output=str(tmp_path / "u"))
    e = info.value
    assert e.code == "NPUC-E0301" and e.exit_code == 3
    assert "aten.sort.default (x1)" in e.message
    assert "aten.cumprod.default (x2)" in e.message
    assert "aten.fft_fft.default (x1)" in e.message or "fft" in e.message
    assert not (tmp_path / "u.om").exists()


def test_unsupported_via_cli_has_no_traceback(tmp_path: Path) -> None:
    torch.export.save(torch.export.export(Unsupported(), (torch.randn(2, 8),)), str(tmp_path / "u.pt2"))
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(tmp_path / "u.pt2"), "--input_shape", "x:2,8",
                        "--output", str(tmp_path / "u")], capture_output=True, text=True)
    assert r.returncode == 3
    assert "Traceback" not in r.stderr
    assert "NPUC-E0301" in r.stderr and "aten.sort.default (x1)" in r.stderr and "hint:" in r.stderr
    assert not (tmp_path / "u.om").exists()


class Extremes(nn.Module):
    """x.max(dim) and x.min(dim, keepdim): values and indices (DeepSeek-V2's group scores)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hi = x.max(dim=-1)
        lo = x.min(dim=1, keepdim=True)
        return hi.values, hi.indices, lo.values, lo.indices


def test_max_and_min_along_a_dim(tmp_path: Path) -> None:
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    x[0, 0, 1] = x[0, 0, 3] = 9.0  # a tie: torch gives the first index
    out = npuc.load(npuc.compile(Extremes(), input_shape="x:3,4,5", output=str(tmp_path / "x")), executor="torch").run({"x": x})
    for got, want in zip(out.values(), Extremes()(x), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_tied_embeddings_checkpoint(tmp_path: Path) -> None:
    import transformers
    from hf_models import COMMON

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path / "tied"))
    path = npuc.compile(str(tmp_path / "tied"), input_shape="input_ids:1,16", output=str(tmp_path / "tied"))
    ids = torch.randint(0, 128, (1, 16))
    got = npuc.load(path, executor="torch").run({"input_ids": ids})["logits"]
    torch.testing.assert_close(got, model(ids).logits, atol=1e-4, rtol=0)


def test_missing_input_shape_lists_inputs(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        npuc.compile(str(hf_checkpoints["llama"]), output=str(tmp_path / "x"))
    assert info.value.code == "NPUC-E0113" and info.value.exit_code == 2
    assert "input 'input_ids' (i64) has dynamic dims" in info.value.message


def test_checkpoint_weights_stream_without_loading(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 safetensors weights are copied into the .om as file ranges: no tensor is ever loaded."""
    from npuc.compiler.loaders import SafetensorsSource

    loads: list[str] = []
    original = SafetensorsSource.load
    monkeypatch.setattr(SafetensorsSource, "load", lambda self: loads.append(self.key) or original(self))
    path = npuc.compile(str(hf_checkpoints["qwen2"]), input_shape="input_ids:1,16", output=str(tmp_path / "q"))
    assert loads == []
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["qwen2"])).eval()
    ids = torch.arange(16).reshape(1, 16)
    torch.testing.assert_close(npuc.load(path, executor="torch").run({"input_ids": ids})["logits"], model(ids).logits,
                               atol=1e-4, rtol=0)


class Norms(nn.Module):
    """LayerNorm with a bias, without one, without any affine parameters, over one and two
    trailing axes; and torch.stack (interleaved rotary embeddings build their pairs so)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.ln_nobias = nn.LayerNorm(8, bias=False)
        self.ln_plain = nn.LayerNorm(8, elementwise_affine=False, eps=1e-3)
        self.ln_2d = nn.LayerNorm((4, 8))
        for p in (self.ln.weight, self.ln.bias, self.ln_nobias.weight, self.ln_2d.weight, self.ln_2d.bias):
            nn.init.normal_(p)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = x[..., 0::2], x[..., 1::2]
        pairs = torch.stack((-b, a), dim=-1).flatten(-2)
        return self.ln(x) + pairs, self.ln_nobias(x), self.ln_plain(x) * 2, self.ln_2d(x), torch.stack([x, x * 3])


def test_layer_norm_and_stack(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = Norms().eval()
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)) * 3 + 1
    out = npuc.load(npuc.compile(m, input_shape="x:2,4,8", output=str(tmp_path / "n")), executor="torch").run({"x": x})
    for got, want in zip(out.values(), m(x), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class MoreOps(nn.Module):
    """Element-wise and shape ops that more HF families use: square, clamp (number and tensor
    bounds), max/min against a
    tensor, softplus (beta 1 and 2), expm1, log1p, a scalar base to a tensor power, rms_norm
    (aten's, with and without a weight), repeat, index_select and baddbmm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(8, eps=1e-6)
        nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        idx = torch.tensor([3, 0, 3])
        return (torch.square(x) + x.clamp(min=-0.5) - x.clamp(-1, 1) + x.clamp(max=0.25) + x.clamp(b, b + 1),
                torch.max(x, b) - torch.min(x, b),
                nn.functional.softplus(x) + nn.functional.softplus(x, beta=2.0) + torch.expm1(x) + torch.log1p(x.abs()),
                torch.pow(2.0, x),
                self.norm(x) + nn.functional.rms_norm(x, (8,)),
                x.repeat(2, 1, 3), x.index_select(1, idx),
                torch.baddbmm(b[..., :4], x, b.transpose(1, 2)[..., :4], beta=0.5, alpha=2.0))


def test_more_ops_match_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = MoreOps().eval()
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    out = npuc.load(npuc.compile(m, input_shape="x:2,4,8;b:2,4,8", output=str(tmp_path / "o")), executor="torch").run({"x": x, "b": b})
    for got, want in zip(out.values(), m(x, b), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class MathOps(nn.Module):
    """What compiler/torch_math.py writes out in IR ops: logsumexp (with and without keepdim,
    over large values), floor/ceil/round/trunc, sign, floor division of floats and of integers
    (negative ones round down), div with rounding modes, unbind, scalar_tensor, select_scatter,
    multiply, triu/tril."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        big = x * 100
        parts = torch.unbind(x, dim=1)
        return (torch.logsumexp(big, dim=-1), torch.logsumexp(x, dim=(1, 2), keepdim=True),
                torch.floor(x * 3) + torch.ceil(x * 3) + torch.round(x * 3) + torch.trunc(x * 3) + torch.sign(x),
                torch.floor_divide(x * 7, 2.5), torch.div(x * 7, -2, rounding_mode="trunc"),
                torch.floor_divide(n, 3), torch.div(n, 4, rounding_mode="trunc"), torch.floor(n),
                parts[0] - parts[3], x + torch.scalar_tensor(2.5),
                torch.select_scatter(x, parts[1] * 2, 1, 2), torch.multiply(x, x),
                torch.triu(x, 1) + torch.tril(x, -2) + torch.tril(x))


def test_math_ops_match_eager(tmp_path: Path) -> None:
    m = MathOps().eval()
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(4))
    n = torch.arange(-16, 16).reshape(2, 16)
    om = npuc.compile(m, input_shape="x:2,4,8;n:2,16", input_dtypes={"n": torch.int64}, output=str(tmp_path / "m"))
    out = npuc.load(om, executor="torch").run({"x": x, "n": n})
    for got, want in zip(out.values(), m(x, n), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class MixerOps(nn.Module):
    """What hybrid and state-space mixers use: a depthwise causal conv1d (left padding, then a
    slice), a grouped conv with 'same' padding and a bias, einsum, pad in torch's modes,
    eye, vector norms of orders 1, 2, 3 and inf, log_sigmoid, clamp_min, concatenate."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv1d(8, 8, kernel_size=4, groups=8, padding=3, bias=False)
        self.same = nn.Conv1d(8, 4, kernel_size=3, groups=2, padding="same", dilation=2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = x.transpose(1, 2)  # [N, C, L]
        causal = self.dw(c)[..., : c.shape[-1]]
        a = torch.einsum("bcl,bdl->bcd", c, causal)
        return (causal, self.same(c), a, torch.einsum("bld,d->bl", x, x[0, 0]),
                torch.nn.functional.pad(x, (1, 2, 0, 3)), torch.nn.functional.pad(x, (2, 1), value=-1.5),
                torch.nn.functional.pad(c, (2, 3), mode="replicate"), torch.nn.functional.pad(c, (2, 1), mode="reflect"),
                x @ torch.eye(8) * 3, torch.linalg.vector_norm(x, dim=-1),
                torch.linalg.vector_norm(x, ord=1, dim=(1, 2), keepdim=True),
                torch.linalg.vector_norm(x, ord=float("inf"), dim=1), torch.linalg.vector_norm(x, ord=3, dim=-1),
                torch.nn.functional.logsigmoid(x * 40), torch.clamp_min(x, 0.1),
                torch.concatenate([x, x * 2], dim=-1))


def test_mixer_ops_match_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = MixerOps().eval()
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(5))
    om = npuc.compile(m, input_shape="x:2,12,8", output=str(tmp_path / "m"))
    out = npuc.load(om, executor="torch").run({"x": x})
    with torch.no_grad():
        want = m(x)
    assert len(out) == len(want)
    for got, w in zip(out.values(), want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


class IndexAfterSlices(nn.Module):
    """Advanced indexing behind full slices: one index tensor (a gather), adjacent ones (their
    dims stay where the first indexed axis was) and apart ones (their dims go first)."""

    def forward(self, x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x[:, i], x[:, :, j], x[:, i, j], x[:, i, :, j], x[i, j]


def test_index_after_slices_matches_eager(tmp_path: Path) -> None:
    m = IndexAfterSlices().eval()
    x = torch.randn(3, 4, 5, 6, generator=torch.Generator().manual_seed(6))
    i, j = torch.tensor([[0, 2], [2, 1]]), torch.tensor([1, 0])
    om = npuc.compile(m, input_shape="x:3,4,5,6;i:2,2;j:2", input_dtypes={"i": torch.int64, "j": torch.int64},
                      output=str(tmp_path / "m"))
    out = npuc.load(om, executor="torch").run({"x": x, "i": i, "j": j})
    for got, want in zip(out.values(), m(x, i, j), strict=True):
        torch.testing.assert_close(got, want)
