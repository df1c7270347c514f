"""Hostile inputs at the CLI: `.pt2` archives that would run code while torch loads them
(compiler/pt2_safety.py), corrupt archives, and malformed `--prompt-ids`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from npuc.cli.main import _parse_ids
from npuc.compiler.pt2_safety import check_pt2
from npuc.errors import NpucError


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.shift = torch.arange(8.0)  # a tensor constant: data/constants/

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale + self.shift


class Marker:
    """Unpickling this creates a file: proof that code from the archive ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _pickled_marker(path: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(Marker(str(path)), buf)
    return buf.getvalue()


def _rewrite(src: Path, dst: Path, edits: dict[str, bytes]) -> None:
    """Copy a torch.export.save archive, replacing or adding entries (paths under its root folder)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.infolist()[0].filename.split("/", 1)[0]
        for info in zin.infolist():
            rest = info.filename.split("/", 1)[1]
            zout.writestr(info.filename, edits.pop(rest) if rest in edits else zin.read(info))
        for rest, data in edits.items():
            zout.writestr(f"{root}/{rest}", data)


def _read(src: Path, rest: str) -> bytes:
    with zipfile.ZipFile(src) as z:
        root = z.infolist()[0].filename.split("/", 1)[0]
        return z.read(f"{root}/{rest}")


@pytest.fixture(scope="module")
def tiny_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(Tiny().eval(), (torch.randn(2, 8),)), str(path))
    return path


def _pickled_constant(src: Path, dst: Path, marker: Path) -> None:
    """The constants config flags a tensor constant use_pickle: torch.load(weights_only=False)."""
    cfg = json.loads(_read(src, "data/constants/model_constants_config.json"))
    name, meta = next(iter(cfg["config"].items()))
    meta["use_pickle"] = True
    _rewrite(src, dst, {"data/constants/model_constants_config.json": json.dumps(cfg).encode(),
                        f"data/constants/{meta['path_name']}": _pickled_marker(marker)})


def _opaque_constant(src: Path, dst: Path, marker: Path) -> None:
    """A constant stored as an opaque object: pickle.loads."""
    cfg = json.loads(_read(src, "data/constants/model_constants_config.json"))
    cfg["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                             "tensor_meta": None}
    import pickle

    _rewrite(src, dst, {"data/constants/model_constants_config.json": json.dumps(cfg).encode(),
                        "data/constants/opaque_obj_0": pickle.dumps(Marker(str(marker)))})


def _sample_inputs(src: Path, dst: Path, marker: Path) -> None:
    """Sample inputs torch loads weights-only, falling back to full pickle when that fails."""
    _rewrite(src, dst, {"data/sample_inputs/model.pt": _pickled_marker(marker)})


def _legacy_weights(src: Path, dst: Path, marker: Path) -> None:
    """A legacy data/weights/model.pt: the same weights-only-then-pickle fallback."""
    _rewrite(src, dst, {"data/weights/model.pt": _pickled_marker(marker)})


def _guards(src: Path, dst: Path, marker: Path) -> None:
    """guards_code is exec'ed when the loaded program runs."""
    program = json.loads(_read(src, "models/model.json"))
    program["guards_code"] = [f"open({str(marker)!r}, 'w') is not None"]
    _rewrite(src, dst, {"models/model.json": json.dumps(program).encode()})


def _sym_expr(src: Path, dst: Path, marker: Path) -> None:
    """A symbolic size torch parses with sympy.sympify (eval)."""
    program = json.loads(_read(src, "models/model.json"))
    for value in program["graph_module"]["graph"]["tensor_values"].values():
        value["sizes"][0] = {"as_expr": {"expr_str": f"__import__('builtins').open({str(marker)!r}, 'w') and 2",
                                         "hint": {"as_int": 2}}}
        break
    _rewrite(src, dst, {"models/model.json": json.dumps(program).encode()})


HOSTILE = {"pickled-constant": (_pickled_constant, "data/constants/model_constants_config.json"),
           "opaque-constant": (_opaque_constant, "data/constants/model_constants_config.json"),
           "sample-inputs": (_sample_inputs, "data/sample_inputs/model.pt"),
           "legacy-weights": (_legacy_weights, "data/weights/model.pt"),
           "guards-code": (_guards, "models/model.json"),
           "sympy-expr": (_sym_expr, "models/model.json")}


def _torch_runs_it(path: Path) -> None:
    """What torch itself does with the archive: load it, and run the program."""
    try:
        torch.export.load(str(path)).module()(torch.randn(2, 8))
    except Exception:  # the payload is no model; only its side effect matters
        pass


@pytest.mark.parametrize("kind", ["pickled-constant", "sample-inputs", "guards-code", "sympy-expr"])
def test_crafted_archives_really_run_code_in_torch(kind: str, tiny_pt2: Path, tmp_path: Path) -> None:
    """Without npuc's check the payload runs: so the refusal tests below can fail."""
    marker = tmp_path / "ran"
    HOSTILE[kind][0](tiny_pt2, tmp_path / "evil.pt2", marker)
    _torch_runs_it(tmp_path / "evil.pt2")
    assert marker.exists()


def test_plain_export_passes_the_check_and_compiles(tiny_pt2: Path, tmp_path: Path) -> None:
    check_pt2(str(tiny_pt2))
    r = cli("compile", str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "tiny"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "tiny.om").is_file()


def test_dynamic_export_passes_the_check(tmp_path: Path) -> None:
    """Symbolic sizes and the guards of a dynamic export are expressions npuc lets through."""
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(Tiny().eval(), (torch.randn(2, 8),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(ep, str(tmp_path / "dyn.pt2"))
    check_pt2(str(tmp_path / "dyn.pt2"))


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_archive_is_refused_before_it_runs(kind: str, tiny_pt2: Path, tmp_path: Path) -> None:
    make, entry = HOSTILE[kind]
    marker = tmp_path / "ran"
    make(tiny_pt2, tmp_path / "evil.pt2", marker)
    r = cli("compile", str(tmp_path / "evil.pt2"), "--input_shape", "x:2,8", "--output", str(tmp_path / "out"))
    assert r.returncode == 3, r.stderr
    assert "NPUC-E0318" in r.stderr and entry in r.stderr and "--trust-pickle" in r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()
    assert not (tmp_path / "out.om").exists()
    # The precheck and verify read the same archive the same way.
    r = cli("check", str(tmp_path / "evil.pt2"), "--input_shape", "x:2,8")
    assert r.returncode == 3 and "NPUC-E0318" in r.stdout + r.stderr and not marker.exists()


def test_verify_refuses_a_hostile_source(tiny_pt2: Path, tmp_path: Path) -> None:
    assert cli("compile", str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "t")).returncode == 0
    marker = tmp_path / "ran"
    _pickled_constant(tiny_pt2, tmp_path / "evil.pt2", marker)
    r = cli("verify", str(tmp_path / "t.om"), "--against", str(tmp_path / "evil.pt2"))
    assert r.returncode == 3 and "NPUC-E0318" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


def test_trust_pickle_loads_it_and_runs_its_code(tiny_pt2: Path, tmp_path: Path) -> None:
    """--trust-pickle is what its help says: code from the file runs. Here the pickled
    constant becomes a file object, so the compile then fails on it, with a coded error."""
    marker = tmp_path / "ran"
    _pickled_constant(tiny_pt2, tmp_path / "evil.pt2", marker)
    r = cli("compile", str(tmp_path / "evil.pt2"), "--input_shape", "x:2,8", "--output", str(tmp_path / "out"),
            "--trust-pickle")
    assert marker.exists()
    assert "Traceback" not in r.stderr and "NPUC-E0318" not in r.stderr
    assert "runs code from the file" in cli("compile", "--help").stdout.replace("\n", " ").replace("  ", " ")


def test_trust_pickle_compiles_a_pickled_but_valid_tensor(tiny_pt2: Path, tmp_path: Path) -> None:
    """A real tensor constant saved with pickle: refused by default, compiled when trusted."""
    cfg = json.loads(_read(tiny_pt2, "data/constants/model_constants_config.json"))
    name, meta = next(iter(cfg["config"].items()))
    meta["use_pickle"] = True
    buf = io.BytesIO()
    torch.save(torch.arange(8.0), buf)
    _rewrite(tiny_pt2, tmp_path / "p.pt2", {"data/constants/model_constants_config.json": json.dumps(cfg).encode(),
                                             f"data/constants/{meta['path_name']}": buf.getvalue()})
    args = ("compile", str(tmp_path / "p.pt2"), "--input_shape", "x:2,8", "--output", str(tmp_path / "p"))
    assert cli(*args).returncode == 3
    r = cli(*args, "--trust-pickle")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not-torch"])
def test_corrupt_archive_is_a_coded_error(damage: str, tiny_pt2: Path, tmp_path: Path) -> None:
    data = tiny_pt2.read_bytes()
    bad = tmp_path / "bad.pt2"
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        with zipfile.ZipFile(bad, "w") as z:
            z.writestr("x/hello.txt", "hi")
    for trust in ((), ("--trust-pickle",)):
        r = cli("compile", str(bad), "--input_shape", "x:2,8", "--output", str(tmp_path / "out"), *trust)
        assert r.returncode == 4, r.stderr
        assert "NPUC-E0407" in r.stderr and "Traceback" not in r.stderr
        assert len([ln for ln in r.stderr.splitlines() if "error NPUC-" in ln]) == 1
        assert "Traceback" not in r.stdout


# ---------------------------------------------------------------- --prompt-ids

@pytest.mark.parametrize("text", ["١٢", "1,,2", ",1", "1,", "+1", "-1", "1.0", "0x10", "1_0", "", " "])
def test_bad_prompt_ids_are_usage_errors(text: str, tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        _parse_ids(text)
    assert e.value.code == "NPUC-E0125" and e.value.exit_code == 2 and repr(text) in e.value.message
    # Checked before the .om is read: no model needed to be told.
    r = cli("generate", str(tmp_path / "missing.om"), "--prompt-ids", text)
    assert r.returncode == 2 and "NPUC-E0125" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("text", "ids"), [("1 2,3", [1, 2, 3]), ("  1,2 ", [1, 2]), ("1 , 2", [1, 2]),
                                           ("007", [7])])
def test_good_prompt_ids(text: str, ids: list[int]) -> None:
    assert _parse_ids(text) == ids


def test_good_prompt_ids_generate() -> None:
    from tests.fuzz.om_fuzz import seed_files

    kv = next(p for p in seed_files() if p.stem == "kv")
    for text in ("1 2,3", "  1,2 "):
        r = cli("generate", str(kv), "--prompt-ids", text, "--max-new-tokens", "2")
        assert r.returncode == 0, r.stderr
        assert len(r.stdout.split()) == 2


@pytest.mark.parametrize("header", [
    (1 << 63).to_bytes(8, "little") + b"{}",                      # a header length past the file
    (20).to_bytes(8, "little") + b'{"w": {"dtype": "F32", ',       # not JSON
    (60).to_bytes(8, "little") + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1099511627776]}}',
])
def test_a_hostile_safetensors_header_is_refused(header: bytes, hf_checkpoints: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """A checkpoint folder's safetensors header is read within the file, never past it."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"], folder)
    (folder / "model.safetensors").write_bytes(header.ljust(len(header) + 64, b" "))
    r = cli("compile", str(folder), "--input_shape", "input_ids:1,8", "--output", str(tmp_path / "out" / "m"))
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith("npuc: error NPUC-E0407: ") and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no output file


def _damage_tensor(src: Path, folder: Path, key_part: str, how: str) -> str:
    """Copy checkpoint `src` to `folder` with the first tensor whose key holds `key_part` stored
    transposed or cropped, as a checkpoint saved for another config holds it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, folder)
    f = next(folder.glob("*.safetensors"))
    tensors = load_file(str(f))
    key = next(k for k in sorted(tensors) if key_part in k)
    t = tensors[key]
    tensors[key] = (t.t() if how == "transposed" else t[:-1]).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    return key


@pytest.mark.parametrize("how", ["transposed", "cropped"])
def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused(how: str, hf_checkpoints: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """A stored tensor whose shape is not the one config.json makes (same size or not) is the
    checkpoint's fault: a coded error naming it, not a bug report and not silently reshaped."""
    key = _damage_tensor(hf_checkpoints["llama"], tmp_path / "ckpt", "mlp.up_proj", how)
    r = cli("compile", str(tmp_path / "ckpt"), "--input_shape", "input_ids:1,8", "--output", str(tmp_path / "out" / "m"))
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith("npuc: error NPUC-E0305: ") and key in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "bug" not in r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_expert_of_the_wrong_shape_is_refused(moe_checkpoint: Path, tmp_path: Path) -> None:
    """Experts stored one tensor each and stacked when read (transformers' converter, or npuc's
    own stacking under older transformers): one cropped expert is a coded error at compile."""
    _damage_tensor(moe_checkpoint, tmp_path / "ckpt", "experts.3.up_proj", "cropped")
    r = cli("compile", str(tmp_path / "ckpt"), "--input_shape", "input_ids:1,8", "--output", str(tmp_path / "out" / "m"))
    assert r.returncode == 4, r.stderr
    assert r.stderr.startswith("npuc: error NPUC-E0305: ") and "Traceback" not in r.stderr, r.stderr
    assert "experts" in r.stderr and "bug" not in r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_safetensors_header_whose_sizes_disagree_is_refused(tmp_path: Path) -> None:
    """A tensor whose byte range is not its dtype times its shape would be read short or long."""
    from npuc.compiler.weights import safetensors_layout

    body = b'{"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}'
    f = tmp_path / "m.safetensors"
    f.write_bytes(len(body).to_bytes(8, "little") + body + bytes(16))
    with pytest.raises(NpucError, match=r"NPUC-E0407: .* tensor 'w' is F32\[4, 4\] in 16 bytes"):
        safetensors_layout(str(f))
