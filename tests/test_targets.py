"""Targets as data files: built-ins, a user's own file, and the checks they drive."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import npuc
from npuc.backend.targets import BUILTIN_DIR, builtin_targets, get_target
from npuc.errors import NpucError
from npuc.ir import DType


def test_builtins_load() -> None:
    assert builtin_targets() == ["cpu", "npu"]
    npu, cpu = get_target(None), get_target("cpu")
    assert (npu.name, npu.matrix_tile, npu.alignment, npu.max_head_dim) == ("npu", 16, 512, 256)
    assert (cpu.matrix_tile, cpu.alignment) == (1, 64)
    assert DType.f64 not in npu.dtypes and DType.f64 in cpu.dtypes


def _custom(tmp_path: Path, **edits: str) -> Path:
    text = (BUILTIN_DIR / "npu.toml").read_text()
    for old, new in edits.items():
        assert old.replace("_", " ") in text or old in text
        text = text.replace(old, new)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


def test_a_users_target_file_drives_alignment_and_tiles(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = _custom(tmp_path, **{"tile = 16": "tile = 32", "alignment = 512 ": "alignment = 256 "})
    om = npuc.compile(str(hf_checkpoints["llama"]), input_shape="input_ids:1,7", output=str(tmp_path / "m"),
                      soc_version=str(path))
    sess = npuc.load(om, executor="torch")
    assert sess.model.target == "npu"  # the name inside the file
    arena = [t for t in sess.tensors if t.region == "arena"]
    assert all(t.offset % 256 == 0 for t in arena) and any(t.offset % 512 for t in arena)
    for o in sess.program.ops:
        if o.op == "linear":
            x, w = (sess.tensors[i] for i in o.inputs[:2])
            assert x.shape[-2] % 32 == 0 and w.shape[0] % 32 == 0 and w.shape[1] % 32 == 0


@pytest.mark.parametrize("edit, key", [
    ({"[matrix]\ntile = 16": "[matrix]"}, "matrix.tile is missing"),
    ({"tile = 16": 'tile = "sixteen"'}, "matrix.tile must be a int"),
    ({"alignment = 512 ": "alignment = 500 "}, "memory.alignment must be a positive power of two"),
    ({'"bool"]': '"bool", "f8"]'}, "dtypes.supported has unknown dtypes ['f8']"),
    ({"name = ": "name = = "}, "the file is not valid TOML"),
    ({'quant_activations = "bf16"': 'quant_activations = "int8"'}, "matrix.quant_activations must be one of"),
])
def test_bad_target_files_name_the_key(edit: dict[str, str], key: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        get_target(str(_custom(tmp_path, **edit)))
    assert info.value.code == "NPUC-E0118" and key in info.value.message and "mine.toml" in info.value.message


def test_a_model_too_big_for_the_target_is_refused_with_the_breakdown(hf_checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    path = _custom(tmp_path, **{"capacity_bytes = 34359738368": "capacity_bytes = 100000"})
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(hf_checkpoints["llama"]), "--input_shape",
                        "input_ids:1,16", "--output", str(tmp_path / "big"), "--soc_version", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "NPUC-E0119" in r.stderr and "(weights " in r.stderr and "+ arena " in r.stderr and "has 100,000" in r.stderr
    assert not (tmp_path / "big.om").exists()


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).exp()


def test_dtypes_the_target_lacks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        npuc.compile(Double(), input_shape="x:4", input_dtypes={"x": "float64"}, output=str(tmp_path / "d"))
    assert info.value.code == "NPUC-E0122" and "does not support f64" in info.value.message
    path = npuc.compile(Double(), input_shape="x:4", input_dtypes={"x": "float64"}, output=str(tmp_path / "d"),
                        soc_version="cpu")
    x = torch.arange(4, dtype=torch.float64)
    torch.testing.assert_close(npuc.load(path, executor="torch").run({"x": x})["output_0"], (x * 2).exp())
