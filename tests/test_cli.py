"""The command line: compile/run/dump/--version, and one-line errors for bad files and inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import npuc


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def llama_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("om") / "llama"
    return Path(npuc.compile(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(out)))


def test_version() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"npuc {npuc.__version__}"


def test_output_defaults_to_the_model_name(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "npuc", "compile", str(hf_checkpoints["qwen2"]), "--input_shape",
                        "input_ids:1,16"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "qwen2.om").is_file() and "wrote qwen2.om" in r.stdout


def test_dump_lists_every_op_with_offsets(llama_om: Path) -> None:
    r = cli("dump", str(llama_om))
    assert r.returncode == 0, r.stderr
    sess = npuc.load(str(llama_om), executor="torch")
    n_ops = len(sess.program.ops)
    op_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("#")]
    assert len(op_lines) == n_ops > 30
    assert "fused_attention" in r.stdout and "@weights+" in r.stdout and "@arena+" in r.stdout
    assert f"arena {sess.arena_bytes:,} B" in r.stdout
    summary = cli("dump", "--summary", str(llama_om))
    assert summary.returncode == 0 and not any(ln.startswith("#") for ln in summary.stdout.splitlines())
    assert "ops:" in summary.stdout and "linear 15" in summary.stdout


def test_run_writes_named_outputs(llama_om: Path, tmp_path: Path) -> None:
    ids = np.arange(16, dtype=np.int64).reshape(1, 16)
    np.save(tmp_path / "ids.npy", ids)
    r = cli("run", str(llama_om), "--input", f"input_ids={tmp_path / 'ids.npy'}", "--output-dir", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "o/logits.npy")
    want = npuc.load(str(llama_om), executor="torch").run({"input_ids": ids})["logits"].numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("damage", ["truncate", "bitflip_header", "bitflip_modeldef", "bitflip_weights", "empty"])
def test_damaged_om_is_refused_in_one_line(llama_om: Path, tmp_path: Path, damage: str) -> None:
    data = bytearray(llama_om.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        where = {"bitflip_header": 9, "bitflip_modeldef": 64 * 3 + 100, "bitflip_weights": len(data) - 100}[damage]
        data[where] ^= 0x10
    bad = tmp_path / "bad.om"
    bad.write_bytes(bytes(data))
    for cmd in (["dump", str(bad)], ["run", str(bad), "--output-dir", str(tmp_path / "o")]):
        r = cli(*cmd)
        assert r.returncode == 4, (cmd, r.stderr)
        assert "Traceback" not in r.stderr
        first = r.stderr.splitlines()[0]
        assert first.startswith("npuc: error NPUC-E04"), r.stderr


def test_wrong_inputs_are_usage_errors(llama_om: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "short.npy", np.zeros((1, 8), dtype=np.int64))
    r = cli("run", str(llama_om), "--input", f"input_ids={tmp_path / 'short.npy'}", "--output-dir", str(tmp_path))
    assert r.returncode == 2 and "compiled for [1, 16]" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", str(llama_om), "--output-dir", str(tmp_path))
    assert r.returncode == 2 and "missing ['input_ids']" in r.stderr
    r = cli("run", str(llama_om), "--input", "input_ids", "--output-dir", str(tmp_path))
    assert r.returncode == 2 and "NAME=FILE.npy" in r.stderr


def test_compile_user_errors_have_no_traceback(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    ck = str(hf_checkpoints["llama"])
    cases = {
        ("compile", str(tmp_path / "missing"), "--input_shape", "x:1", "--output", str(tmp_path / "m")): (4, "E0401"),
        ("compile", ck, "--input_shape", "input_id:1,16", "--output", str(tmp_path / "m")): (2, "the model has no input or dim named 'input_id' (closest: 'input_ids')"),
        ("compile", ck, "--input_shape", "input_ids:1,x", "--output", str(tmp_path / "m")): (2, "not an integer"),
        ("compile", ck, "--input_shape", "input_ids:1,16", "--output", str(tmp_path / "m"), "--soc_version", "tpu"):
            (2, "unknown --soc_version 'tpu'"),
    }
    for args, (code, text) in cases.items():
        r = cli(*args)
        assert r.returncode == code, (args, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*.om"))


def test_arena_garbage_does_not_leak_into_results(llama_om: Path) -> None:
    """Every value is written before it is read: poisoning the arena changes nothing."""
    sess = npuc.load(str(llama_om), executor="torch")
    ids = torch.arange(16).reshape(1, 16)
    clean = sess.run({"input_ids": ids})["logits"]
    sess.arena.view(torch.float32).fill_(float("nan")) if sess.arena_bytes % 4 == 0 else sess.arena.fill_(255)
    again = sess.run({"input_ids": ids})["logits"]
    assert torch.equal(clean, again) and not torch.isnan(again).any()


def test_compile_is_byte_reproducible(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    paths = [npuc.compile(str(hf_checkpoints["deepseek_v3"]), input_shape="input_ids:1,16",
                          output=str(tmp_path / f"m{i}")) for i in range(2)]
    assert Path(paths[0]).read_bytes() == Path(paths[1]).read_bytes()


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["info", "nowhere.om"], 4), (["nosuch"], 2)])
def test_the_process_skips_teardown_but_not_atexit_or_output(args: list[str], code: int) -> None:
    """As a process of its own the command line ends with os._exit (no interpreter teardown:
    `python -v` reports no module cleanup), after the atexit handlers, with its output flushed
    and the exit code sys.exit would give; under a tracer (coverage) it exits as Python does."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('atexit ran', flush=True))\n"
              f"sys.argv = ['npuc', *{args!r}]\nfrom npuc.cli.main import main\nmain()\n")
    for traced in (False, True):
        r = subprocess.run([sys.executable, "-v", "-c", ("import sys; sys.settrace(lambda *a: None)\n" if traced
                                                          else "") + script],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == code, r.stderr[-2000:]
        assert ("npuc " in r.stdout) if code == 0 else ("NPUC-E" in r.stderr)
        assert r.stdout.rstrip().endswith("atexit ran")
        assert ("# cleanup" in r.stderr) == traced
