"""Tests for the .om container (npuc.backend.om_format)."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from npuc.backend import om_format
from npuc.backend.om_format import (
    HEADER_SIZE,
    MAGIC,
    SECTION_ALIGN_DEFAULT,
    WEIGHTS_ALIGN,
    OmFile,
    OmWriter,
)
from npuc.errors import EXIT_IO, InternalError, NpucError


def _chunks(data: bytes, sizes: list[int]) -> Iterator[bytes | memoryview]:
    """Yield `data` in pieces of the given sizes (cycled), alternating bytes and memoryview."""
    pos = i = 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        piece = data[pos : pos + n]
        yield memoryview(piece) if i % 2 else piece
        pos += n
        i += 1


SECTIONS: dict[str, bytes] = {
    "modeldef": b"\x0a\x03abc" * 37,  # 185 bytes, opaque
    "empty": b"",
    "one": b"\x7f",
    "exact64": bytes(range(64)),
    "exact128": bytes(range(128)),
}
WEIGHTS = bytes(random.Random(0).randbytes(10_000 + 3))


def _write(path: Path, weights: bytes = WEIGHTS) -> None:
    with OmWriter(path) as w:
        for name, data in SECTIONS.items():
            w.add_section(name, data)
        w.add_streamed_section("weights", _chunks(weights, [1, 7, 4096, 333, 4095]), len(weights), WEIGHTS_ALIGN)
        w.add_section("tail", b"end", align=128)


@pytest.fixture
def om(tmp_path: Path) -> Path:
    path = tmp_path / "model.om"
    _write(path)
    return path


def _open_error(path: Path) -> NpucError:
    with pytest.raises(NpucError) as info:
        OmFile.open(path).close()
    assert info.value.exit_code == EXIT_IO
    assert info.value.code.startswith("NPUC-E040")
    assert "\n" not in info.value.message
    return info.value


# --- round trip and layout -------------------------------------------------------


def test_round_trip(om: Path) -> None:
    with OmFile.open(om) as f:
        assert f.section_names() == [*SECTIONS, "weights.xxh3", "weights", "tail"]
        for name, data in SECTIONS.items():
            view = f.section(name)
            assert isinstance(view, memoryview) and view.readonly
            assert bytes(view) == data
            view.release()
        assert f.section("weights") == WEIGHTS
        assert f.section("tail") == b"end"
        infos = {i.name: i for i in f.section_info()}
        assert infos["weights"].offset % WEIGHTS_ALIGN == 0 and infos["weights"].align == WEIGHTS_ALIGN
        assert infos["tail"].offset % 128 == 0
        for info in infos.values():
            assert info.offset % SECTION_ALIGN_DEFAULT == 0
            if info.name != "weights":
                assert info.checksum == "sha256"
                assert info.digest == hashlib.sha256(bytes(f.section(info.name))).hexdigest()
        # One XXH3-128 per 4 MiB chunk (here one), listed in weights.xxh3; the weights entry
        # holds the XXH3-128 of that list.
        table = bytes(f.section("weights.xxh3"))
        assert table == struct.pack("<QQ", 4 << 20, 1) + xxhash.xxh3_128_digest(WEIGHTS)
        assert infos["weights"].checksum == "xxh3-128"
        assert infos["weights"].digest == (xxhash.xxh3_128_digest(table) + bytes(16)).hex()
        assert infos["empty"].size == 0 and infos["one"].size == 1
    # The file ends exactly at the last payload.
    assert om.stat().st_size == infos["tail"].offset + 3


def test_header_layout(om: Path) -> None:
    raw = om.read_bytes()
    magic, version, flags, count, reserved = struct.unpack_from("<8sIIII", raw, 0)
    assert (magic, version, flags, count, reserved) == (MAGIC, 2, 0, 8, 0)
    table = raw[HEADER_SIZE : HEADER_SIZE + 64 * count]
    assert raw[24:56] == hashlib.sha256(table).digest()
    assert raw[56:64] == bytes(8)
    name, offset, size, digest = struct.unpack_from("<16sQQ32s", raw, HEADER_SIZE)
    assert name == b"modeldef".ljust(16, b"\0") and offset == 64 + 64 * 8 and size == 185
    assert digest == hashlib.sha256(SECTIONS["modeldef"]).digest()


def test_padding_is_zero(om: Path) -> None:
    raw = om.read_bytes()
    with OmFile.open(om) as f:
        infos = f.section_info()
    covered = bytearray(len(raw))
    covered[: HEADER_SIZE + 64 * len(infos)] = b"\1" * (HEADER_SIZE + 64 * len(infos))
    for i in infos:
        covered[i.offset : i.offset + i.size] = b"\1" * i.size
    assert all(raw[k] == 0 for k in range(len(raw)) if not covered[k])


def test_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a.om", tmp_path / "b.om"
    _write(a)
    _write(b)
    assert a.read_bytes() == b.read_bytes()


def test_no_sections(tmp_path: Path) -> None:
    path = tmp_path / "empty.om"
    with OmWriter(path):
        pass
    assert path.stat().st_size == HEADER_SIZE
    with OmFile.open(path) as f:
        assert f.section_names() == []


def test_weights_only_is_page_aligned(tmp_path: Path) -> None:
    path = tmp_path / "w.om"
    with OmWriter(path) as w:
        w.add_section("weights", b"\1" * WEIGHTS_ALIGN, align=WEIGHTS_ALIGN)
    with OmFile.open(path) as f:
        table, info = f.section_info()
        assert table.name == "weights.xxh3" and table.size == 16 + 16
        assert info.offset == WEIGHTS_ALIGN and info.size == WEIGHTS_ALIGN


def test_missing_section(om: Path) -> None:
    with OmFile.open(om) as f:
        with pytest.raises(NpucError, match="no section 'nope'"):
            f.section("nope")


def test_close_with_live_view(om: Path) -> None:
    f = OmFile.open(om)
    view = f.section("weights")
    f.close()  # must not raise although a view is still alive
    assert view[:3] == WEIGHTS[:3]
    view.release()
    with pytest.raises(InternalError):
        f.section("weights")


def test_writer_rejects_misuse(tmp_path: Path) -> None:
    w = OmWriter(tmp_path / "x.om")
    w.add_section("a", b"")
    for bad in (lambda: w.add_section("a", b""),  # duplicate
                lambda: w.add_section("", b""),
                lambda: w.add_section("x" * 17, b""),
                lambda: w.add_section("b", b"", align=96),
                lambda: w.add_section("b", b"", align=32),
                lambda: w.add_section("weights", b"", align=64),
                lambda: w.add_section("weights.xxh3", b"")):  # the writer's own
        with pytest.raises(InternalError):
            bad()
    w.close()
    with pytest.raises(InternalError):
        w.add_section("c", b"")


@pytest.mark.parametrize("declared", [len(WEIGHTS) - 1, len(WEIGHTS) + 1])
def test_streamed_size_mismatch(tmp_path: Path, declared: int) -> None:
    path = tmp_path / "m.om"
    with pytest.raises(InternalError, match="declared"):
        with OmWriter(path) as w:
            w.add_streamed_section("weights", _chunks(WEIGHTS, [1000]), declared, WEIGHTS_ALIGN)
    assert list(tmp_path.iterdir()) == []


# --- atomicity --------------------------------------------------------------------


def test_failed_stream_leaves_old_file(om: Path) -> None:
    before = om.read_bytes()

    def broken() -> Iterator[bytes]:
        yield b"\0" * 5000
        raise RuntimeError("disk source went away")

    with pytest.raises(RuntimeError, match="went away"):
        with OmWriter(om) as w:
            w.add_section("modeldef", b"new")
            w.add_streamed_section("weights", broken(), 10_000, WEIGHTS_ALIGN)
    assert om.read_bytes() == before
    assert sorted(p.name for p in om.parent.iterdir()) == ["model.om"]


def test_exception_in_block_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.om"
    with pytest.raises(ValueError):
        with OmWriter(path) as w:
            w.add_section("modeldef", b"x")
            raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_directory_is_npuc_error(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as info:
        with OmWriter(tmp_path / "no" / "such" / "dir.om") as w:
            w.add_section("modeldef", b"x")
    assert info.value.exit_code == EXIT_IO


# --- reading bad files -------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    err = _open_error(tmp_path / "absent.om")
    assert err.code == "NPUC-E0401"


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    assert _open_error(tmp_path).code == "NPUC-E0401"


@pytest.mark.parametrize("content", [b"", b"NPUC", b"hello world", b"PK\x03\x04" + bytes(100)])
def test_short_or_foreign_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "f.om"
    path.write_bytes(content)
    err = _open_error(path)
    assert err.code in ("NPUC-E0402", "NPUC-E0404")
    if content[:4] in (b"hell", b"PK\x03\x04"):
        assert err.code == "NPUC-E0402" and "not an npuc .om file" in err.message


def test_bad_magic(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    raw[0:8] = b"GGUF\0\0\0\0"
    om.write_bytes(raw)
    err = _open_error(om)
    assert err.code == "NPUC-E0402" and "not an npuc .om file" in err.message


def test_unsupported_version(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    struct.pack_into("<I", raw, 8, 7)
    om.write_bytes(raw)
    err = _open_error(om)
    assert err.code == "NPUC-E0403" and "version 7" in err.message and "reads version 2" in err.message
    assert "npuc compile" in err.hint


def test_version_1_is_refused_with_a_coded_line(tmp_path: Path) -> None:
    """A v1 file (SHA-256 over the weights, no chunk digests), as npuc <= this change wrote it."""
    payload = b"model-bytes"
    table = struct.pack("<16sQQ32s", b"modeldef".ljust(16, b"\0"), 128, len(payload), hashlib.sha256(payload).digest())
    raw = struct.pack("<8sIIII32s8s", MAGIC, 1, 0, 1, 0, hashlib.sha256(table).digest(), bytes(8)) + table + payload
    path = tmp_path / "v1.om"
    path.write_bytes(raw)
    err = _open_error(path)
    assert err.code == "NPUC-E0403"
    assert err.message == f"'{path}' has .om format version 1; this npuc reads version 2"
    assert "recompile" in err.hint


def _small(tmp_path: Path) -> Path:
    path = tmp_path / "small.om"
    with OmWriter(path) as w:
        w.add_section("modeldef", b"model-bytes")
        w.add_section("one", b"\1")
        w.add_section("weights", b"\2" * 100, align=WEIGHTS_ALIGN)
    return path


def test_every_truncation_is_npuc_error(tmp_path: Path) -> None:
    src = _small(tmp_path)
    raw = src.read_bytes()
    cut = tmp_path / "cut.om"
    for n in range(len(raw)):
        cut.write_bytes(raw[:n])
        _open_error(cut)


def test_every_header_and_table_bit_flip_is_npuc_error(tmp_path: Path) -> None:
    src = _small(tmp_path)
    raw = src.read_bytes()
    bad = tmp_path / "bad.om"
    with OmFile.open(src) as f:
        table_end = HEADER_SIZE + 64 * len(f.section_names())
    for byte in range(table_end):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[byte] ^= 1 << bit
            bad.write_bytes(flipped)
            _open_error(bad)


def test_payload_and_padding_bit_flips_are_npuc_errors(om: Path) -> None:
    raw = om.read_bytes()
    with OmFile.open(om) as f:
        table_end = HEADER_SIZE + 64 * len(f.section_names())
    rnd = random.Random(42)
    for pos in rnd.sample(range(table_end, len(raw)), 300):
        flipped = bytearray(raw)
        flipped[pos] ^= 1 << rnd.randrange(8)
        om.write_bytes(flipped)
        err = _open_error(om)
        assert err.code == "NPUC-E0405" and "the file is corrupt" in err.message


def test_header_sections_are_checked_even_without_verify(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    with OmFile.open(om) as f:
        info = next(i for i in f.section_info() if i.name == "modeldef")
    raw[info.offset] ^= 1
    om.write_bytes(raw)
    assert _open_error(om).message == "section 'modeldef' fails its checksum: the file is corrupt"
    with pytest.raises(NpucError, match="section 'modeldef' fails its checksum"):
        OmFile.open(om, verify=False)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(om_format, "CHUNK_SIZE", 4096)
    return 4096


def test_a_flipped_weight_byte_is_caught_by_its_chunk(tmp_path: Path, small_chunks: int) -> None:
    """WEIGHTS (10,003 bytes) in 4096-byte chunks: three digests; a flip in chunk k names k.
    Without verify the weights are not read at all, so the flip goes unseen there."""
    path = tmp_path / "m.om"
    _write(path)
    with OmFile.open(path) as f:
        w = next(i for i in f.section_info() if i.name == "weights")
        table = bytes(f.section("weights.xxh3"))
    assert table[:16] == struct.pack("<QQ", 4096, 3)
    assert [table[16 + 16 * k:32 + 16 * k] for k in range(3)] == [
        xxhash.xxh3_128_digest(WEIGHTS[k * 4096:(k + 1) * 4096]) for k in range(3)]
    good = path.read_bytes()
    for pos, k in ((0, 0), (4095, 0), (4096, 1), (9000, 2), (len(WEIGHTS) - 1, 2)):
        raw = bytearray(good)
        raw[w.offset + pos] ^= 0x10
        path.write_bytes(raw)
        err = _open_error(path)
        assert err.code == "NPUC-E0405"
        assert err.message == (f"section 'weights' (chunk {k}, bytes {k * 4096}..{min((k + 1) * 4096, len(WEIGHTS))}) "
                               "fails its checksum: the file is corrupt")
        with OmFile.open(path, verify=False) as f:
            assert f.section("weights")[pos] == WEIGHTS[pos] ^ 0x10


def test_the_chunk_size_is_recorded_and_read_back(tmp_path: Path, small_chunks: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A file written with 4 KiB chunks reads with any CHUNK_SIZE: the reader takes the file's."""
    path = tmp_path / "m.om"
    _write(path)
    monkeypatch.setattr(om_format, "CHUNK_SIZE", 1 << 20)
    with OmFile.open(path) as f:
        assert bytes(f.section("weights")) == WEIGHTS


def _reseal(raw: bytearray, name: str, payload: bytes | None = None) -> None:
    """Replace section `name`'s payload (same size) and its SHA-256, and re-seal the table."""
    (count,) = struct.unpack_from("<I", raw, 16)
    for i in range(count):
        at = HEADER_SIZE + 64 * i
        n, off, size, _ = struct.unpack_from("<16sQQ32s", raw, at)
        if n.rstrip(b"\0") == name.encode():
            if payload is not None:
                assert len(payload) == size
                raw[off:off + size] = payload
            raw[at + 32:at + 64] = hashlib.sha256(bytes(raw[off:off + size])).digest()
    raw[24:56] = hashlib.sha256(bytes(raw[HEADER_SIZE:HEADER_SIZE + 64 * count])).digest()


@pytest.mark.parametrize(("edit", "code", "words"), [
    ("chunk 3000", "NPUC-E0404", "chunk size 3000, not a power of two in 4096..1073741824"),
    ("chunk 2048", "NPUC-E0404", "chunk size 2048, not a power of two"),
    ("chunk 8192", "NPUC-E0404", "lists 3 chunks in 64 bytes; 10003 bytes of weights in chunks of 8192 need 2"),
    ("count 2", "NPUC-E0404", "lists 2 chunks in 64 bytes"),
    ("digest", "NPUC-E0405", "the chunk digests of section 'weights' fails its checksum"),
    ("no table", "NPUC-E0404", "section 'weights' has no chunk digests (no section 'weights.xxh3')"),
    ("no weights", "NPUC-E0404", "section 'weights.xxh3' is there without a 'weights' section"),
])
def test_a_resealed_chunk_table_that_lies_is_refused(tmp_path: Path, small_chunks: int, edit: str, code: str,
                                                     words: str) -> None:
    """Edits a fuzzer makes with every SHA-256 re-sealed: the structure checks still refuse them."""
    path = tmp_path / "m.om"
    _write(path)
    raw = bytearray(path.read_bytes())
    with OmFile.open(path) as f:
        names = f.section_names()
        table = bytearray(f.section("weights.xxh3"))
    if edit.startswith(("chunk", "count")):
        struct.pack_into("<Q", table, 0 if edit.startswith("chunk") else 8, int(edit.split()[1]))
        _reseal(raw, "weights.xxh3", bytes(table))
    elif edit == "digest":
        table[20] ^= 1  # a chunk digest changed and its section re-sealed, the weights entry not
        _reseal(raw, "weights.xxh3", bytes(table))
    else:  # rename a section away
        i = names.index("weights.xxh3" if edit == "no table" else "weights")
        raw[HEADER_SIZE + 64 * i:HEADER_SIZE + 64 * i + 16] = b"other".ljust(16, b"\0")
        _reseal(raw, "other")
    path.write_bytes(raw)
    for verify in (True, False):  # structure is checked without verify too
        with pytest.raises(NpucError) as e:
            OmFile.open(path, verify=verify)
        assert e.value.code == code and words in e.value.message, e.value.message


def _rewrite_entry(raw: bytearray, index: int, offset: int | None = None, size: int | None = None) -> None:
    """Patch a table entry and re-sign the table, as a crafted (not just damaged) file would."""
    at = HEADER_SIZE + 64 * index
    name, old_off, old_size, digest = struct.unpack_from("<16sQQ32s", raw, at)
    struct.pack_into("<16sQQ32s", raw, at, name, old_off if offset is None else offset,
                     old_size if size is None else size, digest)
    (count,) = struct.unpack_from("<I", raw, 16)
    raw[24:56] = hashlib.sha256(bytes(raw[HEADER_SIZE : HEADER_SIZE + 64 * count])).digest()


def test_offset_past_eof(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    size = len(raw)
    with OmFile.open(om) as f:
        idx = f.section_names().index("weights")
        weights = f.section_info()[idx]
    _rewrite_entry(raw, idx, offset=size + WEIGHTS_ALIGN)
    om.write_bytes(raw)
    err = _open_error(om)
    assert err.code == "NPUC-E0404"
    assert err.message == (
        f"file is truncated or corrupt: section 'weights' spans bytes {size + WEIGHTS_ALIGN}.."
        f"{size + WEIGHTS_ALIGN + weights.size} but the file has {size} bytes"
    )


def test_huge_size_and_overlap_are_rejected(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    for patch in ({"size": 2**64 - 1}, {"offset": 0}, {"offset": 2**64 - 64}):
        crafted = bytearray(raw)
        _rewrite_entry(crafted, 1, **patch)
        om.write_bytes(crafted)
        assert _open_error(om).code == "NPUC-E0404"


def test_misaligned_weights_rejected(om: Path) -> None:
    raw = bytearray(om.read_bytes())
    with OmFile.open(om) as f:
        idx = f.section_names().index("weights")
        info = f.section_info()[idx]
    _rewrite_entry(raw, idx, offset=info.offset - 64, size=info.size + 64)
    om.write_bytes(raw)
    err = _open_error(om)
    assert err.code == "NPUC-E0404" and "multiple of 4096" in err.message


def test_trailing_garbage_rejected(om: Path) -> None:
    with om.open("ab") as fh:
        fh.write(b"\0")
    assert _open_error(om).code == "NPUC-E0404"


def test_imports_stay_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, npuc.backend.om_format, npuc.backend.memory_plan;"
        "bad = [m for m in ('torch', 'numpy', 'networkx', 'onnx', 'pickle') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
