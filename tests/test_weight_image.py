"""A weights section that begins with the ONNX external data file, copied while the compile runs
(compiler/weight_image.py, backend/om_image.py, backend/lower.py image_offsets)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import npuc
from npuc.backend.om_format import WEIGHTS, OmFile
from npuc.backend.om_image import IMAGE_OFFSET
from npuc.backend.om_sections import join_model
from npuc.cli.main import main
from npuc.compiler import driver, weight_image
from npuc.errors import NpucError

SEQ = 8


def _external(src: Path, out: Path, *, align: int = 64, lead: int = 64, dead: int = 0) -> Path:
    """`src` re-saved with every initializer in one data file: `lead` bytes first, each
    tensor at a multiple of `align` after it, and `dead` unused bytes at the end."""
    import onnx

    m = onnx.load(str(src))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "model.data"
    with open(data, "wb") as f:
        f.write(b"\xa5" * lead)
        for t in m.graph.initializer:
            raw = onnx.numpy_helper.to_array(t).tobytes()
            if len(raw) < 256:
                continue  # small ones stay inline, as exporters keep them
            f.write(b"\0" * (-f.tell() % align))
            offset = f.tell()
            f.write(raw)
            t.ClearField("raw_data")
            for field in ("float_data", "int64_data", "int32_data", "double_data"):
                t.ClearField(field)  # type: ignore[arg-type]
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(len(raw)))):
                t.external_data.add(key=k, value=v)
        f.write(b"\x5a" * dead)
    path = out / "model.onnx"
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def llama_onnx(onnx_exports: dict[tuple[str, int], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _external(onnx_exports[("llama", 18)], tmp_path_factory.mktemp("image") / "aligned")


@pytest.fixture
def small_images(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_image, "MIN_IMAGE_BYTES", 1)


def _compile(model: Path, out: Path) -> Path:
    r = CliRunner().invoke(main, ["compile", str(model), "--input_shape", f"input_ids:1,{SEQ}", "--output",
                                  str(out), "--soc_version", "cpu", "--log", "null"])
    assert r.exit_code == 0, r.output
    return out.with_suffix(".om")


def _sections(path: Path) -> list[Any]:
    with OmFile.open(path) as om:
        return om.section_info()


def _logits(path: Path, executor: str) -> np.ndarray:
    ids = np.arange(SEQ, dtype=np.int64).reshape(1, SEQ) % 50
    out = npuc.load(str(path), executor=executor).run({"input_ids": ids})
    return np.asarray(next(iter(out.values())))


@pytest.mark.parametrize("executor", ["native", "torch"])
def test_weights_first_as_the_source_file_run_as_weights_laid_out_one_by_one(
        llama_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executor: str) -> None:
    plain = _compile(llama_onnx, tmp_path / "plain")  # the file is below MIN_IMAGE_BYTES
    assert _sections(plain)[-1].name == WEIGHTS
    monkeypatch.setattr(weight_image, "MIN_IMAGE_BYTES", 1)
    imaged = _compile(llama_onnx, tmp_path / "imaged")
    first = _sections(imaged)[0]
    assert (first.name, first.offset) == (WEIGHTS, IMAGE_OFFSET)
    data = (llama_onnx.parent / "model.data").read_bytes()
    with OmFile.open(imaged) as om:
        assert bytes(om.section(WEIGHTS)[:len(data)]) == data
    np.testing.assert_array_equal(_logits(imaged, executor), _logits(plain, executor))


def test_copied_ahead_or_not_the_bytes_are_the_same(llama_onnx: Path, tmp_path: Path, small_images: None) -> None:
    ahead = _compile(llama_onnx, tmp_path / "ahead")  # the command line starts the copy first
    at_end = Path(driver.compile_model(str(llama_onnx), input_shape=f"input_ids:1,{SEQ}", output=str(tmp_path / "end"),
                                       soc_version="cpu"))  # no image given: the writer copies it itself
    assert ahead.read_bytes() == at_end.read_bytes()
    with OmFile.open(ahead) as om:
        model = join_model(str(ahead), {n: bytes(om.section(n)) for n in om.section_names() if n != WEIGHTS})
    meta = {e.key: e.value for e in model.metadata}
    files = [str(llama_onnx), str(llama_onnx.parent / "model.data")]
    assert meta["source_xxh3"] == driver.source_hash(files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ahead.om", "end.om"]


@pytest.mark.parametrize("how", ["dead bytes", "unaligned"])
def test_weights_that_use_little_of_the_file_are_laid_out_one_by_one(
        onnx_exports: dict[tuple[str, int], Path], tmp_path: Path, small_images: None, how: str) -> None:
    kw = {"dead": 1 << 20} if how == "dead bytes" else {"align": 4, "lead": 4}
    model = _external(onnx_exports[("llama", 18)], tmp_path / "src", **kw)
    (tmp_path / "out").mkdir()
    om = _compile(model, tmp_path / "out" / "m")
    assert _sections(om)[-1].name == WEIGHTS
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["m.om"]  # the copy made ahead is gone


def test_a_failed_compile_leaves_no_file_and_no_thread(llama_onnx: Path, tmp_path: Path, small_images: None) -> None:
    r = CliRunner().invoke(main, ["compile", str(llama_onnx), "--input_shape", "nosuch:1,8", "--output",
                                  str(tmp_path / "m"), "--log", "null"])
    assert r.exit_code != 0 and "NPUC-E" in r.output
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("npuc-weights")]


def test_a_flipped_byte_of_the_image_is_caught(llama_onnx: Path, tmp_path: Path, small_images: None) -> None:
    om = _compile(llama_onnx, tmp_path / "m")
    raw = bytearray(om.read_bytes())
    raw[IMAGE_OFFSET + 100] ^= 0x10
    om.write_bytes(bytes(raw))
    with pytest.raises(NpucError) as e:
        OmFile.open(om).close()
    assert e.value.code == "NPUC-E0405"
    with pytest.raises(NpucError) as e:
        npuc.load(str(om), executor="native")
    assert e.value.code == "NPUC-E0405"


def test_the_initializers_read_off_the_wire_are_onnx_s(onnx_exports: dict[tuple[str, int], Path],
                                                        llama_onnx: Path) -> None:
    import onnx

    for path in [llama_onnx, onnx_exports[("llama", 18)], onnx_exports[("qwen2", 23)]]:
        want = onnx.load(str(path), load_external_data=False).graph.initializer
        got = list(weight_image._initializers(memoryview(path.read_bytes())))
        assert [(t.name, t.data_type, t.data_location, t.dims, [(e.key, e.value) for e in t.external_data])
                for t in got] == [(t.name, t.data_type, t.data_location, list(t.dims),
                                   [(e.key, e.value) for e in t.external_data]) for t in want]
    assert weight_image.onnx_files(str(llama_onnx)) == [str(llama_onnx), str(llama_onnx.parent / "model.data")]


@pytest.mark.parametrize("cut", [1, 7, 100, -3])
def test_a_truncated_model_is_no_image_and_the_compile_says_why(llama_onnx: Path, tmp_path: Path,
                                                                small_images: None, cut: int) -> None:
    raw = llama_onnx.read_bytes()
    bad = tmp_path / "model.onnx"
    bad.write_bytes(raw[:cut] if cut > 0 else raw[:len(raw) + cut])
    (tmp_path / "model.data").symlink_to(llama_onnx.parent / "model.data")
    with pytest.raises(ValueError):
        list(weight_image._initializers(memoryview(bad.read_bytes())))
    assert weight_image.start(str(bad), str(tmp_path / "m"), tp=None, ep=None, quant_type=None,
                              precision_mode=None) is None
    r = CliRunner().invoke(main, ["compile", str(bad), "--input_shape", "input_ids:1,8", "--output",
                                  str(tmp_path / "m"), "--log", "null"])
    assert r.exit_code != 0 and "NPUC-E0407" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.data", "model.onnx"]
