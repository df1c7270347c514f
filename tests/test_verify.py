"""`npuc verify`: a compiled .om against its source (transformers, onnxruntime), on
random or given inputs, with per-layer localisation of a broken fused kernel."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.ir import OpDef, get_op
from npuc.ir.registry import REGISTRY
from npuc.runtime import Session
from npuc.tools import verify as verify_mod
from npuc.tools.verify import (
    render_report,
    report_json,
    verify,
    verify_failure,
)


@pytest.fixture(scope="module")
def llama_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "llama"
    return Path(compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(out)))


def _json_strict(report: Any) -> dict[str, Any]:
    data = report_json(report)
    json.dumps(data, allow_nan=False)  # valid JSON: no NaN or infinity
    return data


def test_hf_om_matches_its_checkpoint(llama_om: Path, hf_checkpoints: dict[str, Path]) -> None:
    r = verify(str(llama_om), str(hf_checkpoints["llama"]), per_layer=True)
    assert r.ok and r.source_kind == "hf" and r.program == "main" and not r.notes
    (o,) = r.outputs
    assert o.name == o.source_name == "logits" and o.shape == (1, 16, 128)
    assert 0 < o.max_abs < 1e-4 and o.max_rel < 1e-2 and o.cosine > 0.9999 and o.mismatched == 0
    # Random ids over the whole vocabulary (the embedding table's 128 rows), seeded.
    assert "[0, 128)" in r.inputs[0].origin
    again = verify(str(llama_om), str(hf_checkpoints["llama"]))
    assert again.outputs[0].max_abs == o.max_abs
    # A healthy model: every op output has its counterpart, none diverges.
    pl = r.per_layer
    assert pl is not None and pl.first is None and pl.diverging_count == 0
    assert pl.compared == pl.ops > 40 and pl.skipped == 0
    text = render_report(r)
    assert "logits" in text and "ok:" in text and "no intermediate past the tolerance" in text
    data = _json_strict(r)
    assert data["ok"] is True and data["outputs"][0]["mismatched"] == 0


def test_onnx_om_matches_onnxruntime(onnx_exports: dict[tuple[str, int], Path], tmp_path: Path) -> None:
    src = onnx_exports[("llama", 18)]
    om = compile_model(str(src), input_shape="input_ids:1,16", output=str(tmp_path / "llama_onnx"))
    r = verify(om, str(src), per_layer=True)
    assert r.ok and r.source_kind == "onnx"
    (o,) = r.outputs
    assert o.source_name == o.name and o.shape == (1, 16, 128)
    assert o.max_abs < 1e-4 and o.cosine > 0.9999
    assert r.per_layer is not None and r.per_layer.first is None and r.per_layer.compared > 40
    assert "onnxruntime" in render_report(r)


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.nn.functional.gelu(self.a(x))
        return {"y": self.b(h), "h": h}


def test_pt2_om_matches_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ep = torch.export.export(_TwoOutputs().eval(), (torch.randn(2, 8, 32),))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    om = compile_model(str(tmp_path / "m.pt2"), output=str(tmp_path / "m"))
    r = verify(om, str(tmp_path / "m.pt2"), per_layer=True, seed=3)
    assert r.ok and r.source_kind == "pt2" and [o.name for o in r.outputs] == ["y", "h"]
    assert [o.source_name for o in r.outputs] == ["y", "h"] and all(o.cosine > 0.9999 for o in r.outputs)
    assert r.inputs[0].origin == "random normal (seed 3)"
    assert r.per_layer is not None and r.per_layer.compared > 0 and r.per_layer.first is None


def test_multi_program_om_verifies_prefill(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(tmp_path / "kv"),
                       max_seq_len=32)
    r = verify(om, str(hf_checkpoints["llama"]), per_layer=True)
    assert r.ok and r.program == "prefill" and r.programs == ["prefill", "decode"]
    assert any("prefill" in n and "decode not verified" in n for n in r.notes)
    # Prefill computes the logits of one row (--prefill_logits last): the source's are compared there.
    (o,) = r.outputs
    assert o.shape == o.source_shape == (1, 1, 128) and 0 < o.max_abs < 1e-4
    assert [i.name for i in r.inputs] == ["input_ids", "last_token"]
    assert r.inputs[1].origin.startswith("random ints in [0, 16) (the rows it picks from")
    assert any("row last_token of each sequence" in n for n in r.notes)
    assert r.per_layer is not None and r.per_layer.first is None
    assert r.per_layer.skipped > 0  # the KV-cache writes have no counterpart in the source graph
    assert "decode not verified" in render_report(r)


def test_inputs_dir_is_used(llama_om: Path, hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    ids = np.random.default_rng(123).integers(0, 128, size=(1, 16), dtype=np.int64)
    np.save(tmp_path / "input_ids.npy", ids)
    r = verify(str(llama_om), str(hf_checkpoints["llama"]), inputs_dir=str(tmp_path))
    assert r.ok and r.inputs[0].origin == f"file {tmp_path / 'input_ids.npy'}"

    got = Session.load(str(llama_om)).run({"input_ids": ids})["logits"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_checkpoints["llama"]),
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids), use_cache=False).logits
    assert r.outputs[0].max_abs == float((got.double() - ref.double()).abs().max())
    # The default inputs give other errors: all three statistics at once (one alone, max_abs, can
    # coincide: errors this small are a few ulps, and two inputs hit the same one).
    default = verify(str(llama_om), str(hf_checkpoints["llama"])).outputs[0]
    stats = (r.outputs[0].max_abs, r.outputs[0].max_rel, r.outputs[0].cosine)
    assert stats != (default.max_abs, default.max_rel, default.cosine)


def test_inputs_dir_errors(llama_om: Path, hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ckpt = str(hf_checkpoints["llama"])
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), ckpt, inputs_dir=str(tmp_path / "nope"))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0140", 2)
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), ckpt, inputs_dir=str(tmp_path))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0141", 2) and "input_ids.npy" in e.value.message
    np.save(tmp_path / "input_ids.npy", np.zeros((1, 8), dtype=np.int64))
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), ckpt, inputs_dir=str(tmp_path))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0142", 2)
    np.save(tmp_path / "input_ids.npy", np.zeros((1, 16), dtype=np.float32))
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), ckpt, inputs_dir=str(tmp_path))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0142", 2)
    (tmp_path / "input_ids.npy").write_bytes(b"not a npy file")
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), ckpt, inputs_dir=str(tmp_path))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0141", 2)


def test_bad_arguments(llama_om: Path, hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ckpt = str(hf_checkpoints["llama"])
    for kw in ({"atol": -1.0}, {"rtol": math.nan}):
        with pytest.raises(NpucError) as e:
            verify(str(llama_om), ckpt, **kw)
        assert (e.value.code, e.value.exit_code) == ("NPUC-E0146", 2)
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), str(tmp_path / "missing.onnx"))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0401", 4)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(NpucError) as e:
        verify(str(llama_om), str(tmp_path / "model.bin"))
    assert (e.value.code, e.value.exit_code) == ("NPUC-E0143", 2)


def _broken(op: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], OpDef]:
    """Make the registry's `op` compute wrong numbers (for Sessions loaded from now on);
    return a lookup that still gives the original kernels, for the reference graph."""
    original = get_op(op)
    originals = {op: original}

    def wrong(xs: list[Any], attrs: Mapping[str, Any]) -> Any:
        return [t * 1.5 + 0.25 for t in original.run(xs, attrs)]

    monkeypatch.setitem(REGISTRY, op, dataclasses.replace(original, kernel=wrong, out_kernel=None))
    from npuc.runtime import launch

    monkeypatch.delitem(launch._NATIVE, op, raising=False)  # the runtime's native form of it, too
    return lambda name: originals.get(name) or get_op(name)


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope_lut"])
def test_per_layer_names_the_broken_fused_op(op: str, llama_om: Path, hf_checkpoints: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sess = Session.load(str(llama_om))
    steps = sess.programs["main"].steps
    first_step = next(i for i, st in enumerate(steps) if st.opdef.name == op)
    first_name = sess.tensors[steps[first_step].outputs[0]].name
    assert first_step > 0 and (op == "rms_norm" or first_step > 1)  # not merely the first op

    lookup = _broken(op, monkeypatch)
    r = verify(str(llama_om), str(hf_checkpoints["llama"]), per_layer=True, op_lookup=lookup)
    assert not r.ok and r.outputs[0].mismatched > 0
    pl = r.per_layer
    assert pl is not None and pl.first is not None
    assert (pl.first.op, pl.first.name, pl.first.step) == (op, first_name, first_step)
    assert pl.first.mismatched > 0 and pl.first.max_abs > 1e-2
    # Everything downstream diverges too; nothing upstream does.
    assert pl.diverging_count > 1 and all(d.step >= first_step for d in pl.diverging)
    text = render_report(r)
    assert f"first divergence: op #{first_step} {op} %{first_name}" in text and "FAILED" in text
    _json_strict(r)
    err = verify_failure(r)
    assert (err.code, err.exit_code) == ("NPUC-E0145", 1) and f"%{first_name}" in err.hint


def test_per_layer_reference_uses_its_own_kernels(llama_om: Path, hf_checkpoints: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Breaking an op the unfused reference graph uses (mul) in the reference only:
    then the .om looks wrong at the first op that consumes it, so the evaluator really
    runs the graph with `op_lookup`'s kernels."""
    mul = get_op("mul")
    bad = dataclasses.replace(mul, kernel=lambda xs, a: mul.run(xs, a)[0] * 2)
    r = verify(str(llama_om), str(hf_checkpoints["llama"]), per_layer=True,
               op_lookup=lambda n: bad if n == "mul" else get_op(n))
    assert r.ok  # outputs are the .om's against transformers: unaffected
    assert r.per_layer is not None and r.per_layer.first is not None
    assert "first divergence" in render_report(r)


def _perturbed_source(monkeypatch: pytest.MonkeyPatch, delta: float) -> None:
    run_hf = verify_mod._RUNNERS["hf"]

    def perturbed(path: str, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.double() + delta for k, v in run_hf(path, feeds).items()}

    monkeypatch.setitem(verify_mod._RUNNERS, "hf", perturbed)


def test_tolerances(llama_om: Path, hf_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _perturbed_source(monkeypatch, 1e-5)
    om, ckpt = str(llama_om), str(hf_checkpoints["llama"])
    loose = verify(om, ckpt)  # 1e-5 < atol 1e-4
    assert loose.ok and 0.9e-5 < loose.outputs[0].max_abs < 1.1e-5
    exact = verify(om, ckpt, atol=0.0, rtol=0.0)
    assert not exact.ok and exact.outputs[0].mismatched == exact.outputs[0].numel == 2048
    assert not verify(om, ckpt, atol=5e-6, rtol=0.0).ok
    assert verify(om, ckpt, atol=2e-5, rtol=0.0).ok
    # rtol alone: an element fails when |om - source| > rtol * |source|.
    worst = exact.outputs[0].max_rel
    assert 0 < worst < 1 and verify(om, ckpt, atol=0.0, rtol=2 * worst).ok
    half = verify(om, ckpt, atol=0.0, rtol=worst / 2).outputs[0]
    assert 0 < half.mismatched < half.numel
    err = verify_failure(exact)
    assert (err.code, err.exit_code) == ("NPUC-E0145", 1) and "--per-layer" in err.hint
    assert "logits" in err.details[0]


def test_compare_semantics() -> None:
    cmp = verify_mod._compare
    b = torch.tensor([1.0, -2.0, 0.0, 100.0], dtype=torch.float64)
    s = cmp(b + torch.tensor([0.0, 0.0, 0.0, 0.05], dtype=torch.float64), b, atol=0.0, rtol=1e-3)  # 0.05 <= 1e-3 * 100
    assert s.mismatched == 0 and s.max_abs == pytest.approx(0.05) and s.max_rel == pytest.approx(5e-4)
    s = cmp(b + torch.tensor([0.0, 0.0, 1e-5, 0.0]), b, atol=0.0, rtol=1e-3)  # nothing is relative to 0
    assert s.mismatched == 1 and s.max_rel == 0.0  # max rel err is over non-zero references
    assert cmp(-b, b, 1e-4, 1e-3).cosine == pytest.approx(-1.0)
    nan = torch.tensor([math.nan, 1.0])
    assert cmp(nan, nan, 0.0, 0.0).mismatched == 0  # NaN where the source has NaN agrees
    s = cmp(nan, torch.tensor([0.0, 1.0]), 1.0, 1.0)
    assert s.mismatched == 1 and s.max_abs == math.inf and math.isnan(s.cosine)
    assert cmp(torch.tensor([1, 2]), torch.tensor([1, 3]), 0.5, 0.0).mismatched == 1  # integer outputs


def test_cli_verify_exit_codes(llama_om: Path, hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "npuc", "verify", str(llama_om), "--against",
                               str(hf_checkpoints["llama"]), *args], capture_output=True, text=True)

    r = cli("--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outputs"]
    r = cli("--atol", "0", "--rtol", "0")  # float noise exists: exact agreement fails with exit 1
    assert r.returncode == 1 and "NPUC-E0145" in r.stderr and "Traceback" not in r.stderr
    r = cli("--inputs", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "NPUC-E0140" in r.stderr
