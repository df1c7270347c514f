"""Which source file a compile's weights section begins with, and copying it ahead.

An ONNX model with its weights in an external data file, compiled with them as they are
(no quantization, no precision change, one rank), gets a weights section that begins with
that whole file, each weight at its offset in it (backend/lower.py `image_offsets`; the
lowering falls back to laying the weights out one by one where they use less than 90% of
the file). Those bytes are known as soon as the model's file is parsed, so `start` begins
copying them into the output (backend/om_image.py) before the compiler is even imported:
the copy, the disk's work, then overlaps the import, the passes and the planning, the CPU's.

`image_source` is the layout's rule and depends only on the files and the options, so the
same compile gives the same bytes whether or not the copy ran ahead. This module imports
neither torch nor the compiler (the command line calls `start` before importing them).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from npuc.backend.om_copy import FileRange
from npuc.backend.om_image import WeightImage

log = logging.getLogger("npuc.compile")

# A file smaller than this is copied in the time the rest of the compile takes to start.
MIN_IMAGE_BYTES = 64 << 20
_KEEP_MODES = (None, "must_keep_origin_dtype")


def hashed_files(files: Sequence[str]) -> list[tuple[str, bytes]]:
    """The input model's hash's files (metadata source_xxh3), in its order, each with what
    precedes its bytes: its name and size."""
    return [(path, os.path.basename(path).encode() + b"\0" + os.path.getsize(path).to_bytes(8, "little"))
            for path in sorted(files, key=os.path.basename)]


def image_source(kind: str, files: Sequence[str], world: int) -> FileRange | None:
    """The file the weights section may begin with: a one-rank ONNX model's largest
    external data file (`files` as the loader lists them: the model first) of at least
    MIN_IMAGE_BYTES; else None. The lowering takes it where the weights, as the passes
    left them, use most of it."""
    if kind != "onnx" or world > 1 or len(files) < 2:
        return None
    sizes = [(os.path.getsize(p), p) for p in files[1:]]
    size, path = max(sizes)
    return FileRange(path, 0, size, "the weights' image") if size >= MIN_IMAGE_BYTES else None


def onnx_files(path: str) -> list[str]:
    """The model file and its external data files, as compiler/onnx_frontend.py's loader
    lists them, with the same checks (compiler/onnx_checks.py `external_data`: a location
    outside the model's folder is refused). Read off the file's protobuf encoding without
    importing onnx (0.75 s, most of it ml_dtypes), which the compile imports meanwhile."""
    from npuc.compiler.onnx_checks import external_data

    base = os.path.dirname(os.path.abspath(path))
    files = [path]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            for t in _initializers(buf):
                if t.data_location == 1:
                    ext = external_data(t, base).path
                    if ext not in files:
                        files.append(ext)
        finally:
            buf.release()
    return files


# -- the few fields of an ONNX ModelProto the image needs, from protobuf's wire format -------

class _Entry(NamedTuple):
    key: str
    value: str


@dataclass
class _Tensor:
    """A TensorProto's fields that onnx_checks.external_data reads."""

    name: str = ""
    data_type: int = 0
    data_location: int = 0
    dims: list[int] = field(default_factory=list)
    external_data: list[_Entry] = field(default_factory=list)


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value or start, end) of each field of the message in
    buf[start:end]; a length-delimited field's bytes are buf[value:end'] (not read)."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield num, wire, value, i
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > end:
                raise ValueError("a field runs past its message")
            yield num, wire, i, i + n
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")
    if i != end:
        raise ValueError("a field runs past its message")


def _initializers(buf: memoryview) -> Iterator[_Tensor]:
    """ModelProto.graph (7) .initializer (5): name (8), data_type (2), dims (1, packed or
    not), external_data (13: key 1, value 2), data_location (14)."""
    for num, wire, a, b in _fields(buf, 0, len(buf)):
        if num != 7 or wire != 2:
            continue
        for gnum, gwire, ga, gb in _fields(buf, a, b):
            if gnum != 5 or gwire != 2:
                continue
            t = _Tensor()
            for tnum, twire, ta, tb in _fields(buf, ga, gb):
                if tnum == 1 and twire == 0:
                    t.dims.append(ta)
                elif tnum == 1 and twire == 2:
                    i = ta
                    while i < tb:
                        d, i = _varint(buf, i)
                        t.dims.append(d)
                elif tnum == 2 and twire == 0:
                    t.data_type = ta
                elif tnum == 14 and twire == 0:
                    t.data_location = ta
                elif tnum == 8 and twire == 2:
                    t.name = bytes(buf[ta:tb]).decode("utf-8", "replace")
                elif tnum == 13 and twire == 2:
                    kv = {k: bytes(buf[ka:kb]).decode("utf-8", "replace")
                          for k, kw, ka, kb in _fields(buf, ta, tb) if kw == 2}
                    t.external_data.append(_Entry(kv.get(1, ""), kv.get(2, "")))
            yield t


def start(model: object, output: str, *, tp: int | None, ep: int | None, quant_type: str | None,
          precision_mode: str | None) -> WeightImage | None:
    """Begin copying `model`'s weight image into `output`'s temporary file, if the compile
    will lay its weights out so (None otherwise, or on any trouble: the compile then reads
    the model as usual and reports what is wrong with it)."""
    if not isinstance(model, str) or not model.endswith(".onnx") or quant_type is not None \
            or precision_mode not in _KEEP_MODES or not _has_big_file(model):
        return None  # no image, or one the quantization or precision change would leave unused
    out = output if output.endswith(".om") else output + ".om"
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        return None
    try:
        files = onnx_files(model)
        source = image_source("onnx", files, max(tp or 1, ep or 1, 1))
        if source is None:
            return None
        return WeightImage(source, out, hashed_files(files))
    except Exception as e:  # noqa: BLE001 - the compile itself reads the model and says what is wrong
        log.debug("weights not copied ahead: %s", e)
        return None


def _has_big_file(model: str) -> bool:
    """Whether the model's folder holds a file large enough to be an image (a look at the
    folder before parsing the model)."""
    try:
        with os.scandir(os.path.dirname(os.path.abspath(model))) as it:
            return any(e.is_file() and e.stat().st_size >= MIN_IMAGE_BYTES and not e.name.endswith(".onnx")
                       for e in it)
    except OSError:
        return False


def discard(image: WeightImage | None) -> None:
    if image is not None:
        with contextlib.suppress(OSError):
            image.discard()
