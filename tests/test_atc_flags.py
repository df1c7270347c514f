"""`npuc compile` speaks ATC: its flags and spellings, --mode 1/3/6, --framework,
--out_nodes, --input_format, --log, --config/--print-config, the precheck, and
machine-readable diagnostics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import npuc
from npuc.tools.om_tools import dump_json


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.fixture(scope="module")
def onnx_llama(onnx_exports: dict[tuple[str, int], Path]) -> Path:
    return onnx_exports[("llama", 18)]


@pytest.fixture(scope="module")
def atc_om(onnx_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compiled with ATC's spellings: --flag=value, --model, --framework=5."""
    out = tmp_path_factory.mktemp("atc") / "m"
    r = cli("compile", f"--model={onnx_llama}", "--framework=5", "--input_shape=input_ids:1,16", f"--output={out}",
            "--soc_version=cpu", "--log=error")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # not a terminal: no progress bar, nothing else
    return Path(f"{out}.om")


def test_spellings_agree(atc_om: Path, onnx_llama: Path, tmp_path: Path) -> None:
    """--flag value, kebab-case and the positional model give the same bytes as --flag=value."""
    r = cli("compile", str(onnx_llama), "--input-shape", "input_ids:1,16", "--output", str(tmp_path / "k"),
            "--soc-version", "cpu")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "k.om").read_bytes() == atc_om.read_bytes()


@pytest.mark.parametrize("framework, code, exit_code", [
    ("pt2", "NPUC-E0130", 2), ("3", "NPUC-E0130", 3), ("caffe", "NPUC-E0130", 2)])
def test_framework_is_checked_against_the_file(framework: str, code: str, exit_code: int, onnx_llama: Path,
                                               tmp_path: Path) -> None:
    r = cli("compile", "--model", str(onnx_llama), "--framework", framework, "--input_shape", "input_ids:1,16",
            "--output", str(tmp_path / "m"))
    assert r.returncode == exit_code and code in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def test_mode_1_converts_an_om_and_a_model_to_json(atc_om: Path, onnx_llama: Path, tmp_path: Path) -> None:
    r = cli("compile", "--mode=1", f"--om={atc_om}", f"--json={tmp_path / 'om.json'}")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "om.json").read_text()) == json.loads(dump_json(str(atc_om)))
    r = cli("compile", "--mode", "1", "--model", str(onnx_llama), "--input_shape", "input_ids:1,16",
            "--json", str(tmp_path / "graph.json"))
    assert r.returncode == 0, r.stderr
    g = json.loads((tmp_path / "graph.json").read_text())
    assert g["inputs"] == [{"name": "input_ids", "dtype": "i64", "shape": [1, 16]}]
    assert len(g["outputs"]) == 1 and len(g["nodes"]) > 50
    r = cli("compile", "--mode=1", f"--om={atc_om}")
    assert r.returncode == 2 and "NPUC-E0109" in r.stderr


def test_mode_6_shows_model_info(atc_om: Path) -> None:
    r = cli("compile", "--mode=6", f"--om={atc_om}")
    assert r.returncode == 0 and "lower bound" in r.stdout and "program" in r.stdout


def test_precheck_lists_every_problem_and_writes_nothing(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    keep = tmp_path / "keep.txt"
    r = cli("compile", "--mode=3", "--model", str(hf_checkpoints["llama"]), "--input_shape", "input_id:1,16",
            "--soc_version", "tpu", "--precision_mode", "fp8", "--keep_dtype", str(keep),
            "--json", str(tmp_path / "report.json"), "--output", str(tmp_path / "m"))
    rep = json.loads((tmp_path / "report.json").read_text())
    codes = sorted(p["code"] for p in rep["problems"])
    assert codes == ["NPUC-E0102", "NPUC-E0105", "NPUC-E0117", "NPUC-E0401"], codes
    assert rep["ok"] is False and rep["format"] == "npuc-precheck/1" and rep["skipped"]
    assert r.returncode == 4  # the worst problem's exit code (a missing file: I/O)
    assert "4 problem(s)" in r.stdout and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*.om"))


def test_precheck_of_onnx_reports_unsupported_ops_even_with_bad_shapes(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Hardmax", ["r"], ["h"]),
                           helper.make_node("NonMaxSuppressionX", ["h"], ["y"], domain="com.example")],
                          "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    r = cli("check", str(path), "--input_shape", "x:1,5", "--json", str(tmp_path / "r.json"))
    rep = json.loads((tmp_path / "r.json").read_text())
    messages = " ".join(p["message"] for p in rep["problems"])
    assert "Hardmax" in messages and "NonMaxSuppressionX" in messages
    assert r.returncode == 3 and not rep["ok"]


def test_precheck_of_a_good_model_is_ok(onnx_llama: Path, tmp_path: Path) -> None:
    r = cli("check", str(onnx_llama), "--input_shape", "input_ids:1,16", "--json", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] and rep["problems"] == [] and "target capacity" in rep["checked"]
    assert not list(tmp_path.glob("*.om"))


def test_precheck_reports_a_model_over_the_targets_capacity(onnx_llama: Path, tmp_path: Path) -> None:
    small = tmp_path / "small.toml"
    small.write_text((Path(npuc.__file__).parent / "backend/target_files/cpu.toml").read_text()
                     .replace("name = \"cpu\"", "name = \"small\""))
    text = small.read_text()
    key = next(ln.split("=")[0].strip() for ln in text.splitlines() if "capacity" in ln)
    small.write_text("\n".join(f"{key} = 1024" if ln.startswith(key) else ln for ln in text.splitlines()) + "\n")
    r = cli("check", str(onnx_llama), "--input_shape", "input_ids:1,16", "--soc_version", str(small))
    assert r.returncode == 1 and "NPUC-E0119" in r.stdout


def test_json_diagnostics_own_stderr(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    r = cli("compile", str(hf_checkpoints["llama"]), "--input_shape", "input_id:1,16", "--output",
            str(tmp_path / "m"), "--diagnostics-format", "json")
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["code"] == "NPUC-E0102" and d["severity"] == "error" and d["hint"] and d["exit_code"] == 2
    r = cli("compile", "--no-such-flag", "--diagnostics-format=json")
    assert r.returncode == 2 and json.loads(r.stderr)["code"] == "NPUC-E0100"


def test_out_nodes_pick_the_outputs(onnx_llama: Path, tmp_path: Path) -> None:
    graph = tmp_path / "g.json"
    assert cli("compile", "--mode=1", "--model", str(onnx_llama), "--input_shape", "input_ids:1,16",
               "--json", str(graph)).returncode == 0
    doc = json.loads(graph.read_text())
    final = doc["outputs"][0]
    mid = next(n for n in doc["nodes"] if n["op"] == "gather")["name"]  # the token embedding
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"),
            "--out_nodes", f"{mid}:0;{final}")
    assert r.returncode == 0, r.stderr
    outs = npuc.load(str(tmp_path / "m.om"), executor="torch").outputs
    assert [t.name for t in outs][1] == final and outs[0].shape == (1, 16, 64)
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "n"),
            "--out_nodes", f"{final}x;nope:0")
    assert r.returncode == 2 and "NPUC-E0127" in r.stderr and f"closest: '{final}'" in r.stderr


def test_input_format(onnx_llama: Path, tmp_path: Path) -> None:
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"),
            "--input_format", "NCHW")
    assert r.returncode == 2 and "NPUC-E0128" in r.stderr and "4-D" in r.stderr
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"),
            "--input_format", "NHWC5D")
    assert r.returncode == 2 and "NPUC-E0128" in r.stderr


def test_log_levels(onnx_llama: Path, tmp_path: Path) -> None:
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"),
            "--log", "info")
    assert r.returncode == 0 and "npuc: info: wrote" in r.stderr
    r = cli("compile", str(onnx_llama), "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"),
            "--log", "null")
    assert r.returncode == 0 and r.stderr == ""


def test_config_file_supplies_options_and_flags_win(atc_om: Path, onnx_llama: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "npuc.toml"
    cfg.write_text(f'model_opt = "{onnx_llama}"\ninput-shape = "input_ids:1,8"\nsoc_version = "cpu"\n'
                   f'output = "{tmp_path / "m"}"\n')
    r = cli("compile", "--config", str(cfg), "--print-config")
    assert r.returncode == 0
    assert 'input_shape = "input_ids:1,8"' in r.stdout and 'soc_version = "cpu"' in r.stdout
    r = cli("compile", "--config", str(cfg), "--input_shape", "input_ids:1,16", "--print-config")
    assert 'input_shape = "input_ids:1,16"' in r.stdout
    r = cli("compile", "--config", str(cfg), "--input_shape", "input_ids:1,16")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.om").read_bytes() == atc_om.read_bytes()
    cfg.write_text('input_shape = "input_ids:1,8"\nsoc = "cpu"\n')
    r = cli("compile", "--config", str(cfg))
    assert r.returncode == 2 and "NPUC-E0100" in r.stderr and "unknown option(s) soc" in r.stderr


def test_progress_shows_on_a_terminal(onnx_llama: Path, tmp_path: Path) -> None:
    import pty

    out = bytearray()

    def read(fd: int) -> bytes:
        data = os.read(fd, 1024)
        out.extend(data)
        return data

    argv = [sys.executable, "-m", "npuc", "compile", str(onnx_llama), "--input_shape", "input_ids:1,16",
            "--output", str(tmp_path / "m")]
    status = pty.spawn(argv, read)
    assert os.waitstatus_to_exitcode(status) == 0
    text = out.decode(errors="replace")
    assert "optimise" in text and "wrote" in text
