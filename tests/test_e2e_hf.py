"""The walking skeleton end to end: HF checkpoint -> `npuc compile` -> `npuc run`
in a fresh process with the checkpoint deleted and transformers unimportable,
compared with HF eager attention."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import ARCHS

# The runtime must work from the .om alone: these imports fail inside `npuc run`.
BLOCKED = ["transformers", "onnx", "onnxruntime", "safetensors", "networkx", "npuc.compiler", "npuc.passes"]
RUNNER = textwrap.dedent("""
    import sys
    BLOCKED = {blocked!r}
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError("blocked for this test: " + name)
            return None
    sys.meta_path.insert(0, _Block())
    from npuc.cli.main import main
    sys.argv = ["npuc"] + {argv!r}
    try:
        main()
    finally:
        leaked = [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]
        assert not leaked, leaked
""")


def npuc_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=600)


def run_isolated(argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = RUNNER.format(blocked=BLOCKED, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def hf_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_then_run_without_source(arch: str, hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints[arch], src)
    ids = np.random.default_rng(1).integers(0, 128, size=(1, 16), dtype=np.int64)
    ref = hf_logits(src, ids)

    r = npuc_cli("compile", str(src), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "build/model"))
    assert r.returncode == 0, r.stderr
    om = tmp_path / "build/model.om"
    assert om.is_file()

    shutil.rmtree(src)
    np.save(tmp_path / "ids.npy", ids)
    r = run_isolated(["run", str(om), "--input", f"input_ids={tmp_path / 'ids.npy'}",
                      "--output-dir", str(tmp_path / "out")])
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "out/logits.npy")
    assert got.shape == ref.shape == (1, 16, 128)
    err = float(np.abs(got - ref).max())
    assert err < 1e-4, f"{arch}: max abs error {err}"
    # Not trivially equal: the logits vary, so a zero or constant output would fail.
    assert float(np.abs(ref).max()) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_roundtrips_and_verifies_after_every_pass(arch: str, hf_checkpoints: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from npuc.compiler.driver import build_graph
    from npuc.compiler.loaders import SafetensorsSource
    from npuc.ir import parse_graph, verify
    from npuc.passes.manager import PassManager
    from npuc.passes.pipeline import default_pipeline

    loads: list[str] = []
    original = SafetensorsSource.load
    monkeypatch.setattr(SafetensorsSource, "load", lambda self: loads.append(self.key) or original(self))

    graphs = []
    g, _ = build_graph(str(hf_checkpoints[arch]), "input_ids:1,16")
    graphs.append(str(g))
    verify(g)
    pm = PassManager(default_pipeline(), verify_each=True, on_after=lambda i, p, g: graphs.append(str(g)))
    g = pm.run(g)
    # Weights stay in the checkpoint while the graph is imported and optimised.
    assert loads == []
    for text in graphs:
        g2 = parse_graph(text)
        verify(g2)
        assert str(g2) == text
    assert [p for p, _ in pm.timings] == [p.name for p in default_pipeline()]
    # Mask construction and RoPE tables fold away; what is left is the model's real work.
    ops = {n.op for n in g.nodes}
    assert {"arange", "cumsum", "index", "cos", "sin", "full"}.isdisjoint(ops), ops
    # DeepSeek's MLA; transformers 4.x writes it so that it fuses as ordinary attention
    # (docs/user-guide.md, Install), exactly as well.
    import transformers

    mla = arch.startswith("deepseek") and int(transformers.__version__.split(".")[0]) >= 5
    attention = "mla_attention" if mla else "fused_attention"
    assert attention in ops and "linear" in ops


def test_a_transformers_without_an_experts_choice(hf_checkpoints: dict[str, Path], moe_checkpoint: Path,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers before 5 has no `experts_implementation` and rejects the keyword (every
    HF-folder compile crashed on 4.57): it is asked for only where it exists. Without it a
    dense model compiles as before, and MoE layers, which such versions build as a loop over
    the experts, are refused with one coded line."""
    from npuc.compiler import loaders
    from npuc.compiler.driver import compile_model
    from npuc.errors import NpucError
    from npuc.runtime import Session

    built: list[dict[str, object]] = []
    import transformers

    original = transformers.AutoModelForCausalLM.from_config

    def from_config(config: object, **kw: object) -> object:
        built.append(kw)
        return original(config, **kw)

    monkeypatch.setattr(loaders, "_has_experts_choice", lambda tf: False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(tmp_path / "dense"))
    assert built and all("experts_implementation" not in kw for kw in built)
    ids = np.arange(3, 11, dtype=np.int64).reshape(1, 8)
    got = Session.load(om).run({"input_ids": torch.from_numpy(ids)})["logits"].numpy()
    np.testing.assert_allclose(got, hf_logits(hf_checkpoints["llama"], ids), atol=1e-4)
    with pytest.raises(NpucError) as info:
        compile_model(str(moe_checkpoint), input_shape="input_ids:1,8", output=str(tmp_path / "moe"))
    assert info.value.code == "NPUC-E0306" and "DeepseekV3MoE" in info.value.message
    assert not (tmp_path / "moe.om").exists()


# Families beyond the Llama lineage: tests/test_model_matrix.py (docs/models.md).
