"""Compile time close to the I/O.

- `--max_seq_len`: one torch.export, at a symbolic length, gives the prefill program, the
  decode program and the RoPE tables (compiler/driver.py `build_programs`); models that
  do not trace at a symbolic length are traced per length, as before.
- Weights stored as they are in a file are copied into the `.om` from one read of each
  byte, hashed from the buffer they are written from: the weights' XXH3-128 chunk
  digests and the input model's hash (backend/om_format.py `FileRange`,
  `FileSequenceHash`); the bytes are those of a plain write.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hf_models import ARCHS
from test_fusion_passes import assert_same_numerics

import npuc.backend.om_copy as om_copy
import npuc.backend.om_format as om_format
from npuc.backend.om_format import WEIGHTS_ALIGN, FileRange, FileSequenceHash, OmFile, OmWriter
from npuc.compiler import driver
from npuc.errors import NpucError

# --- one trace for prefill, decode and the RoPE tables -----------------------------------


def _count_exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch.export.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


def test_generation_programs_come_from_one_export(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_exports(monkeypatch)
    out = driver.compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=24,
                               output=str(tmp_path / "m"))
    assert len(calls) == 1
    with OmFile.open(out) as f:
        assert "weights" in f.section_names()


def test_a_model_that_needs_a_trace_per_length_still_compiles(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise driver._NotStatic("a size depends on the data")

    monkeypatch.setattr(driver, "_at_length", refuse)
    calls = _count_exports(monkeypatch)
    driver.compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=24,
                         output=str(tmp_path / "m"))
    assert len(calls) == 4  # the symbolic one that did not do, then prefill, decode and tables


@pytest.mark.parametrize("arch", ARCHS)
def test_one_export_gives_what_three_traces_give(arch: str, hf_checkpoints: dict[str, Path]) -> None:
    """Prefill, decode (at DECODE_TRACE_POSITION) and the tables specialised from the
    symbolic trace compute what the static traces at each length compute."""
    ckpt = str(hf_checkpoints[arch])
    with pytest.MonkeyPatch.context() as m:
        calls = _count_exports(m)
        prefill, decode, tables, _ = driver.build_programs(ckpt, "input_ids:1,8", None, 24)
    assert len(calls) == 1
    loaded = driver._load(ckpt, None)
    static_prefill = driver._import(loaded, driver._export(loaded, {"input_ids": (1, 8)}))
    static_decode, static_tables = driver._decode_inputs(ckpt, static_prefill, 24, None, loaded)
    assert len(tables.tables) == len(static_tables.tables) >= 1 and tables.windows == static_tables.windows
    for (c, s), (sc, ss) in zip(tables.tables, static_tables.tables, strict=True):
        assert c.shape[0] == 24 and torch.equal(c, sc) and torch.equal(s, ss)
    for static, one in ((static_prefill, prefill), (static_decode, decode)):
        assert [v.type for v in one.inputs] == [v.type for v in static.inputs]
        assert_same_numerics(static, one, ints={"input_ids": 128}, atol=1e-5)
    # One token attends to itself alone whatever its position: the RoPE rows say where it is.
    assert _rope_rows(decode) == _rope_rows(static_decode) != _rope_rows(prefill)[:1]


def _rope_rows(g: Any) -> list[list[float]]:
    from npuc.compiler import instrument
    from npuc.passes.pipeline import rope_table_pipeline

    g = instrument.run_pipeline(g, rope_table_pipeline()).graph
    return [v.const.load()[0].tolist() for n in g.nodes if n.op == "rope_lut" for v in n.inputs[2:3]]


def test_decodable_checks_come_before_the_trace(hf_checkpoints: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_exports(monkeypatch)
    with pytest.raises(NpucError) as e:
        driver.compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=8,
                             output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0124" and "no room" in e.value.message
    assert not calls


# --- the writer: file ranges, fallbacks, one read for two hashes -------------------------


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Blocks of 4099 bytes, so a range spans many and ends inside one."""
    monkeypatch.setattr(om_copy, "_BLOCK", 4099)
    return 4099


def _source(tmp_path: Path, name: str, size: int, seed: int) -> Path:
    path = tmp_path / name
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def _ranges(path: Path, spans: list[tuple[int, int]]) -> list[FileRange]:
    return [FileRange(str(path), off, n, f"weight {i}") for i, (off, n) in enumerate(spans)]


def _payload(chunks: list[Any]) -> bytes:
    return b"".join(Path(c.path).read_bytes()[c.offset:c.offset + c.length] if isinstance(c, FileRange)
                    else bytes(c) for c in chunks)


def _write(path: Path, chunks: list[Any], also: FileSequenceHash | None = None) -> None:
    size = sum(len(c) for c in chunks)
    with OmWriter(path) as w:
        w.add_section("modeldef", b"\x0a\x03abc" * 5)
        w.add_streamed_section("weights", iter(chunks), size, WEIGHTS_ALIGN, also=also)


def _mixed(src: Path) -> list[Any]:
    """File ranges out of file order, a zero-length one, in-memory chunks between them."""
    r = _ranges(src, [(50_000, 30_001), (7, 12_345), (0, 0), (90_000, 10_000), (12_352, 37_648)])
    return [b"\0" * 64, r[0], memoryview(b"in memory"), r[1], r[2], r[3], bytearray(b"\1" * 4096), r[4]]


def _no_kernel_copy(monkeypatch: pytest.MonkeyPatch, how: str) -> list[int]:
    """Make copy_file_range refuse (EXDEV, as between filesystems) or report nothing
    copied (as some filesystems do); returns the list its calls are counted in."""
    calls = [0]

    def refuse(*args: Any) -> int:
        calls[0] += 1
        if how == "EXDEV":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return 0

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    return calls


@pytest.mark.parametrize("copy", ["kernel", "EXDEV", "copies nothing"])
def test_file_ranges_are_written_and_hashed_as_their_bytes(tmp_path: Path, small_blocks: int,
                                                          monkeypatch: pytest.MonkeyPatch, copy: str) -> None:
    """4 KiB chunks, so chunk, block and range boundaries all fall at different places;
    copied by the kernel, or by reads and writes where the kernel cannot copy."""
    monkeypatch.setattr(om_format, "CHUNK_SIZE", 4096)
    if copy != "kernel":
        calls = _no_kernel_copy(monkeypatch, copy)
    src = _source(tmp_path, "w.bin", 100_000, 0)
    chunks = _mixed(src)
    _write(tmp_path / "ranges.om", chunks)
    _write(tmp_path / "bytes.om", [_payload([c]) for c in chunks])
    assert (tmp_path / "ranges.om").read_bytes() == (tmp_path / "bytes.om").read_bytes()
    payload = _payload(chunks)
    with OmFile.open(tmp_path / "ranges.om") as f:
        assert bytes(f.section("weights")) == payload
        digests = bytes(f.section("weights.xxh3"))[16:]
    assert digests == b"".join(xxhash.xxh3_128_digest(payload[k:k + 4096]) for k in range(0, len(payload), 4096))
    if copy != "kernel":
        assert calls[0] == 1  # tried once, then never again in that write


@pytest.mark.skipif(not hasattr(os, "copy_file_range"), reason="no copy_file_range on this platform")
def test_the_kernel_copies_and_the_hash_reads_the_output(tmp_path: Path, small_blocks: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every range byte is copied by the kernel, and hashed from a read of the output
    (its page cache), never by reading the source in user space: the source is read from
    the disk once."""
    src = _source(tmp_path, "w.bin", 100_000, 1)
    chunks = _mixed(src)
    copied = [0]
    real_copy = os.copy_file_range

    def counting_copy(fd_in: int, fd_out: int, n: int, off_in: int, off_out: int) -> int:
        got = real_copy(fd_in, fd_out, n, off_in, off_out)
        copied[0] += got
        return got

    read: dict[str, int] = {}
    real = om_copy.read_into

    def counting(fd: int, buf: memoryview, offset: int) -> int:
        n = real(fd, buf, offset)
        which = "source" if os.path.samefile(f"/proc/self/fd/{fd}", src) else "output"
        read[which] = read.get(which, 0) + n
        return n

    monkeypatch.setattr(os, "copy_file_range", counting_copy)
    monkeypatch.setattr(om_copy, "read_into", counting)
    _write(tmp_path / "m.om", chunks)
    in_ranges = sum(c.length for c in chunks if isinstance(c, FileRange))
    assert copied[0] == in_ranges and read == {"output": in_ranges}
    monkeypatch.undo()
    _write(tmp_path / "ref.om", [_payload([c]) for c in chunks])
    assert (tmp_path / "m.om").read_bytes() == (tmp_path / "ref.om").read_bytes()


def test_without_a_kernel_copy_each_byte_is_read_once(tmp_path: Path, small_blocks: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffered copy is its own hash's read: every range byte read once, by the writer."""
    src = _source(tmp_path, "w.bin", 100_000, 1)
    chunks = _mixed(src)
    _no_kernel_copy(monkeypatch, "EXDEV")
    read = [0]
    real = om_copy.read_into

    def counting(fd: int, buf: memoryview, offset: int) -> int:
        n = real(fd, buf, offset)
        read[0] += n
        return n

    monkeypatch.setattr(om_copy, "read_into", counting)
    _write(tmp_path / "m.om", chunks)
    assert read[0] == sum(c.length for c in chunks if isinstance(c, FileRange))
    monkeypatch.undo()
    _write(tmp_path / "ref.om", [_payload([c]) for c in chunks])
    assert (tmp_path / "m.om").read_bytes() == (tmp_path / "ref.om").read_bytes()


def _reference_hash(files: list[tuple[Path, bytes]]) -> str:
    h = xxhash.xxh3_128()
    for path, prefix in files:
        h.update(prefix + path.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("order", ["file order", "reversed", "unplanned", "none", "no spare buffer"])
def test_the_model_hash_comes_from_the_copy_reads(tmp_path: Path, small_blocks: int,
                                                  monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """The input model's hash equals one over the whole files. Where the section reads a
    file in order, the hash thread reads none of those bytes itself; reversed, it takes
    the longest range; when the writer reads what was not planned, or has no buffer to
    spare (the hash thread is behind), the hash thread reads it all."""
    # Enough buffers that the writer never has to skip handing a block over, or none.
    monkeypatch.setattr(om_copy, "_BUFFERS", 0 if order == "no spare buffer" else 64)
    head = _source(tmp_path, "a.json", 1000, 2)
    data = _source(tmp_path, "b.bin", 120_000, 3)
    spans = [(16, 40_000), (40_016, 50_000), (90_016, 29_984)]  # all but a 16-byte header
    ranges = _ranges(data, spans if order != "reversed" else spans[::-1])
    files = [(head, b"a\0"), (data, b"b\0")]
    read_by: dict[str, int] = {}
    real = om_copy.read_into

    def counting(fd: int, buf: memoryview, offset: int) -> int:
        n = real(fd, buf, offset)
        read_by[threading.current_thread().name] = read_by.get(threading.current_thread().name, 0) + n
        return n

    monkeypatch.setattr(om_copy, "read_into", counting)
    planned = {"unplanned": _ranges(data, [(0, 5)]), "none": []}.get(order, ranges)
    also = FileSequenceHash([(str(p), b) for p, b in files], planned)
    _write(tmp_path / "m.om", [b"x" * 10, *(ranges if order != "none" else [])], also)
    assert also.hexdigest() == _reference_hash(files)
    own = {"file order": 1000 + 16, "reversed": 1000 + 40_016 + 29_984}.get(order, 1000 + 120_000)
    assert read_by.get("npuc-source-hash", 0) == own
    by_writer = sum(n for name, n in read_by.items() if name != "npuc-source-hash")  # its own or its hash thread
    assert by_writer == sum(r.length for r in ranges) * (order != "none")


def test_the_longest_run_in_file_order_is_taken() -> None:
    spans = [(100, 200), (0, 10), (10, 20), (200, 300), (20, 150), (300, 310), (310, 900)]
    # (100,200) (200,300) (300,310) (310,900): 800 bytes; the longer run from (0,10) holds 750
    assert om_copy._chain(spans) == [0, 3, 5, 6]
    assert om_copy._chain([]) == [] and len(om_copy._chain([(5, 9), (0, 4)])) == 1


def test_source_hash_matches_the_formula(tmp_path: Path) -> None:
    a = _source(tmp_path, "config.json", 300, 4)
    b = _source(tmp_path, "model.safetensors", 20_000, 5)
    want = _reference_hash([(a, b"config.json\0" + (300).to_bytes(8, "little")),
                            (b, b"model.safetensors\0" + (20_000).to_bytes(8, "little"))])
    assert driver.source_hash([str(b), str(a)]) == want


def test_a_truncated_weights_file_is_a_user_error_and_leaves_the_old_file(tmp_path: Path) -> None:
    src = _source(tmp_path, "w.bin", 1000, 6)
    out = tmp_path / "m.om"
    _write(out, [b"old"])
    old = out.read_bytes()
    with pytest.raises(NpucError) as e:
        _write(out, _ranges(src, [(0, 500), (900, 200)]))
    assert e.value.code == "NPUC-E0404" and "weight 1" in e.value.message and "1000 bytes" in e.value.message
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.om", "w.bin"]


def test_an_interrupt_mid_copy_leaves_the_old_file_and_no_thread(tmp_path: Path, small_blocks: int) -> None:
    src = _source(tmp_path, "w.bin", 200_000, 7)
    out = tmp_path / "m.om"
    _write(out, [b"old"])
    old = out.read_bytes()
    also = FileSequenceHash([(str(src), b"")])

    def interrupted() -> Iterator[Any]:
        yield from _ranges(src, [(0, 100_000)])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with OmWriter(out) as w:
            w.add_late_section("metadata", 64, lambda: also.hexdigest().encode())
            w.add_streamed_section("weights", interrupted(), 200_000, WEIGHTS_ALIGN, also=also)
    assert out.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.om", "w.bin"]
    assert not [t for t in threading.enumerate() if t.name.startswith("npuc-") and t.is_alive()]


def test_a_late_section_keeps_its_place_and_is_made_last(tmp_path: Path) -> None:
    src = _source(tmp_path, "w.bin", 50_000, 8)
    order: list[str] = []

    def weights() -> Iterator[Any]:
        yield from _ranges(src, [(0, 50_000)])
        order.append("weights")

    def late() -> bytes:
        order.append("late")
        return b"L" * 100

    with OmWriter(tmp_path / "late.om") as w:
        w.add_section("modeldef", b"m")
        w.add_late_section("metadata", 100, late)
        w.add_streamed_section("weights", weights(), 50_000, WEIGHTS_ALIGN)
    with OmWriter(tmp_path / "plain.om") as w:
        w.add_section("modeldef", b"m")
        w.add_section("metadata", b"L" * 100)
        w.add_streamed_section("weights", iter([src.read_bytes()]), 50_000, WEIGHTS_ALIGN)
    assert order == ["weights", "late"]
    assert (tmp_path / "late.om").read_bytes() == (tmp_path / "plain.om").read_bytes()


def test_a_late_section_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    from npuc.errors import InternalError

    with pytest.raises(InternalError, match="declared 10 bytes but produced 3"):
        with OmWriter(tmp_path / "m.om") as w:
            w.add_late_section("metadata", 10, lambda: b"abc")
    assert list(tmp_path.iterdir()) == []


# --- end to end: the compile writes what write_om writes ----------------------------------


def _lowered(model: str, input_shape: str, max_seq_len: int | None) -> tuple[Any, driver.Source]:
    from npuc.backend.lower import lower
    from npuc.backend.targets import get_target
    from npuc.compiler import instrument

    target = get_target("cpu")
    if max_seq_len is None:
        g, source = driver.build_graph(model, input_shape)
        graphs = [instrument.run_pipeline(g, driver.pipelines("must_keep_origin_dtype", frozenset(), target)[0]).graph]
    else:
        p, d, tables, source = driver.build_programs(model, input_shape, None, max_seq_len)
        p.name, d.name = "prefill", "decode"
        passes = driver.pipelines("must_keep_origin_dtype", frozenset(), target, max_seq_len, tables)
        graphs = [instrument.run_pipeline(g, ps).graph for g, ps in zip((p, d), passes, strict=True)]
    return lower(graphs, target, driver._metadata(source, target.name)), source


def _external_onnx(tmp_path: Path) -> Path:
    from onnx import TensorProto, helper
    from onnx_build import external_tensor

    data, inits, nodes, offset = tmp_path / "w.data", [], [], 0
    with open(data, "wb") as f:
        f.write(b"\0" * 100)  # the weights do not start the file
        offset = 100
        for i in range(3):
            w = np.random.default_rng(i).standard_normal((32, 32)).astype(np.float32)
            f.write(w.tobytes())
            inits.append(external_tensor(f"w{i}", w, data.name, offset))
            nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"],
                                          [f"h{i}" if i < 2 else "y"], name=f"mm{i}"))
            offset += w.nbytes
    model = helper.make_model(helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 32])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits), opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "chain.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("source", ["hf", "onnx"])
def test_the_compile_writes_what_write_om_writes(source: str, hf_checkpoints: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Weights copied file to file and the model hash from the copy's reads: the bytes of
    write_om (which reads every weight through Python) once the hash is in the metadata."""
    from npuc.backend.lower import weight_chunks
    from npuc.backend.writer import write_om

    if source == "hf":
        low, src = _lowered(str(hf_checkpoints["llama"]), "input_ids:1,8", 24)
    else:
        low, src = _lowered(str(_external_onnx(tmp_path)), "x:1,32", None)
    assert any(isinstance(c, FileRange) for c in weight_chunks(low, ranges=True))
    driver._write(low, str(tmp_path / "copied.om"), {}, src.files, lambda n: None)
    meta = {e.key: e.value for e in low.model.metadata}
    assert meta["source_xxh3"] == driver.source_hash(src.files) != driver._HASH_PENDING
    write_om(low, str(tmp_path / "read.om"))
    assert (tmp_path / "copied.om").read_bytes() == (tmp_path / "read.om").read_bytes()
