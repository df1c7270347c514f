"""The `.om` container: named, checksummed, aligned byte sections in one file.

This module only knows the container. What the sections hold (the serialized
model definition, the weights) is opaque bytes here.

Layout, format version 2 (all integers little-endian; docs/om-format.md)::

    header   64 bytes   magic b"NPUCOM\\x00\\x01", version u32 (=2), flags u32 (=0),
                        section count u32, reserved u32 (=0),
                        SHA-256 of the section table (32 bytes), 8 zero bytes
    table    64 bytes per section: name (16 bytes ASCII, NUL padded),
                        offset u64, size u64, digest (32 bytes)
    payloads in table order, each at an offset aligned to its section's
                        alignment (64 by default, 4096 for "weights" so the
                        runtime can mmap it); padding is zero bytes and the
                        file ends exactly where the last payload ends.

Every section but "weights" carries the SHA-256 of its payload. The weights carry a
fast non-cryptographic checksum instead: XXH3-128 of each CHUNK_SIZE piece, listed
in the section "weights.xxh3" (chunk size u64, chunk count u64, then one 16-byte
digest per chunk), which is SHA-256-covered like any other; the weights entry's
digest is the XXH3-128 of that list followed by 16 zero bytes. So every byte of the
file is under a checksum, and the table's SHA-256 covers them all.

The table precedes the payloads yet holds their digests, so `OmWriter` lays the
file out first, writes each payload at its offset and then the table and header.
A streamed payload is hashed as it is written: a chunk that is a byte range of a
file (`FileRange`: a weight as safetensors or ONNX external data store it) is copied
by backend/om_copy.py (`RangeCopy`: in the kernel, each block then hashed from the
output's page cache and handed to the input model's hash, `FileSequenceHash`). Late
sections (the metadata holding that hash, the chunk digests) are written after the
others. The writer writes to a temporary file and renames it into place, so readers
never see a half-written file. `OmFile` checks the whole structure and every header
section's SHA-256 before handing out any section (and, by default, every weights
chunk), and only ever hands out bytes: nothing is unpickled or executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import stat
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import xxhash

from npuc.backend.om_copy import (
    E_BOUNDS,
    E_OPEN,
    Chunk,
    FileRange,
    FileSequenceHash,
    RangeCopy,
    pwrite_all,
    read_into,
)
from npuc.errors import EXIT_IO, InternalError, NpucError

if TYPE_CHECKING:
    from npuc.backend.om_image import WeightImage

__all__ = [
    "CHUNK_SIZE",
    "ChunkDigests",
    "FORMAT_VERSION",
    "IMAGE_OFFSET",
    "MAGIC",
    "SECTION_ALIGN_DEFAULT",
    "WEIGHTS_ALIGN",
    "WEIGHTS",
    "WEIGHTS_DIGESTS",
    "FileRange",
    "FileSequenceHash",
    "OmFile",
    "OmWriter",
    "SectionInfo",
    "open_temp",
]

MAGIC = b"NPUCOM\x00\x01"
FORMAT_VERSION = 2
WEIGHTS = "weights"
WEIGHTS_DIGESTS = "weights.xxh3"
# Bytes of weights per XXH3-128 digest (docs/om-format.md says why 4 MiB).
CHUNK_SIZE = 4 << 20
_CHUNK_MIN, _CHUNK_MAX = 4096, 1 << 30  # the chunk sizes a reader accepts (powers of two)
_CHUNKS_HEAD = struct.Struct("<QQ")  # chunk size, chunk count
SECTION_ALIGN_DEFAULT = 64
WEIGHTS_ALIGN = 4096
# Where the weights start in a file whose weights come first (`first`): right after a header and
# a table of up to 63 sections, so a writer can place them before it knows the other sections.
IMAGE_OFFSET = WEIGHTS_ALIGN

_HEADER = struct.Struct("<8sIIII32s8s")
_ENTRY = struct.Struct("<16sQQ32s")
assert _HEADER.size == 64 and _ENTRY.size == 64
HEADER_SIZE = _HEADER.size
ENTRY_SIZE = _ENTRY.size

# Alignments the reader enforces by section name; the table does not record
# the alignment a writer asked for, so only these (and the default) are checked.
_REQUIRED_ALIGN = {"weights": WEIGHTS_ALIGN}
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,16}")

E_MAGIC = "NPUC-E0402"
E_VERSION = "NPUC-E0403"
E_CHECKSUM = "NPUC-E0405"
E_WRITE = "NPUC-E0406"

_HINT_RECOMPILE = "the file is damaged or incomplete; recompile the model with `npuc compile`"

def _required_align(name: str) -> int:
    return _REQUIRED_ALIGN.get(name, SECTION_ALIGN_DEFAULT)


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class SectionInfo:
    """One table entry. `align` is the alignment the reader has checked for it; `digest`
    (hex) is the entry's digest field: the payload's SHA-256 (`checksum` "sha256"), or
    for the weights the XXH3-128 of their chunk digests and 16 zero bytes ("xxh3-128")."""

    name: str
    offset: int
    size: int
    align: int
    digest: str
    checksum: str = "sha256"


# --- writing ---------------------------------------------------------------------


class ChunkDigests:
    """XXH3-128 of each CHUNK_SIZE piece of a section, fed its bytes in order in pieces of
    any size; `payload` is the "weights.xxh3" section (chunk size, count, digests)."""

    checksum = "xxh3-128"

    def __init__(self) -> None:
        self._chunk = CHUNK_SIZE
        self._h = xxhash.xxh3_128()
        self._in = 0  # bytes of the current chunk hashed
        self._digests: list[bytes] = []

    def update(self, data: memoryview) -> None:
        while data:
            n = min(len(data), self._chunk - self._in)
            self._h.update(data[:n])  # xxhash lets go of the GIL for the hashing itself
            self._in += n
            data = data[n:]
            if self._in == self._chunk:
                self._digests.append(self._h.digest())
                self._h.reset()
                self._in = 0

    def payload(self) -> bytes:
        if self._in:
            self._digests.append(self._h.digest())
            self._h.reset()
            self._in = 0
        return _CHUNKS_HEAD.pack(self._chunk, len(self._digests)) + b"".join(self._digests)


def _chunks_payload_size(size: int) -> int:
    return _CHUNKS_HEAD.size + 16 * -(-size // CHUNK_SIZE)


def _weights_digest(chunks_payload: bytes | memoryview) -> bytes:
    """The weights' table digest: XXH3-128 of their "weights.xxh3" payload, 16 zero bytes."""
    return xxhash.xxh3_128_digest(chunks_payload) + bytes(16)


class _Sha256:
    """A streamed section other than the weights: one SHA-256, like a header section."""

    checksum = "sha256"

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data: memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


@dataclass(frozen=True)
class _Pending:
    name: str
    size: int
    align: int
    data: bytes | None
    chunks: Iterable[Chunk] | None = None
    produce: Callable[[], bytes] | None = None
    also: FileSequenceHash | None = None
    image: WeightImage | None = None
    first: bool = False


def _remove_orphans(directory: str, prefix: str) -> None:
    """Delete temp files that killed writers of this output left (`.<name>.<pid>.*.tmp`
    whose process is gone); a live writer's are left alone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(prefix) and name.endswith(".tmp")):
                continue
            pid = name[len(prefix):].split(".", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
            except OSError:
                pass  # alive, but another user's


def open_temp(path: str) -> tuple[int, str]:
    """A new temporary file beside `path` (`.<name>.<pid>.*.tmp`, open for reading and
    writing), after sweeping those of this output that killed writers left."""
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}."
    _remove_orphans(directory, prefix)
    return tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")


class OmWriter:
    """Collects sections, then writes the `.om` file atomically on `close()`.

    Nothing touches the disk until `close()` (or a clean exit from the `with`
    block); an exception inside the block discards everything.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._sections: list[_Pending] = []
        self._closed = False
        self._image_digests: ChunkDigests | None = None  # an adopted weight image's

    def __enter__(self) -> OmWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._closed = True
            for sec in self._sections:
                if sec.also is not None:
                    sec.also.cancel()
                if sec.image is not None:
                    sec.image.discard()
            self._sections.clear()
            return
        self.close()

    def add_section(self, name: str, data: bytes | bytearray | memoryview, align: int = SECTION_ALIGN_DEFAULT) -> None:
        """Register a section whose payload is already in memory (copied now)."""
        self._register(_Pending(name, 0, align, bytes(data)))

    def add_streamed_section(
        self, name: str, chunks: Iterable[Chunk], size: int, align: int = SECTION_ALIGN_DEFAULT,
        also: FileSequenceHash | None = None, first: bool = False, image: WeightImage | None = None,
    ) -> None:
        """Register a section of exactly `size` bytes, pulled from `chunks` while writing.

        The iterable is consumed during `close()`, one chunk at a time, so the
        payload never has to exist as one bytes object. A `FileRange` chunk is read
        from its file once, in blocks, each hashed and written from that read; `also`
        is handed the blocks it wants (see FileSequenceHash).

        `first` (the weights only) puts the section first in the file, where its opening
        bytes can be written before the header sections are known. With `image`
        (backend/om_image.py, copying exactly the first chunk ahead into a file of its
        own) the writer adopts that file and writes the other chunks only.
        """
        if size < 0:
            raise InternalError(f"section '{name}': negative size {size}")
        if (first or image is not None) and name != WEIGHTS:
            raise InternalError(f"section '{name}': only the weights can come first")
        if image is not None and not first:
            raise InternalError(f"section '{name}': an image is copied to the start of the file")
        self._register(_Pending(name, size, align, None, chunks, also=also, image=image, first=first))

    def add_late_section(self, name: str, size: int, produce: Callable[[], bytes],
                         align: int = SECTION_ALIGN_DEFAULT) -> None:
        """Register a section of exactly `size` bytes whose payload `produce` returns once
        every other section is written (metadata holding a hash of what they copied).
        It keeps its place in the table and the file."""
        if size < 0:
            raise InternalError(f"section '{name}': negative size {size}")
        self._register(_Pending(name, size, align, None, produce=produce))

    def _register(self, sec: _Pending) -> None:
        if self._closed:
            raise InternalError("OmWriter is closed")
        if not isinstance(sec.name, str) or not _NAME_RE.fullmatch(sec.name):
            raise InternalError(f"invalid section name {sec.name!r}: use 1-16 of [A-Za-z0-9_.-]")
        if any(s.name == sec.name for s in self._sections):
            raise InternalError(f"section '{sec.name}' added twice")
        if sec.name == WEIGHTS_DIGESTS:
            raise InternalError(f"section '{WEIGHTS_DIGESTS}' is the writer's own (the weights' chunk digests)")
        a = sec.align
        if a < SECTION_ALIGN_DEFAULT or a & (a - 1):
            raise InternalError(f"section '{sec.name}': alignment {a} is not a power of two >= {SECTION_ALIGN_DEFAULT}")
        if a < _required_align(sec.name):
            raise InternalError(f"section '{sec.name}' needs alignment {_required_align(sec.name)}, got {a}")
        if sec.data is not None:
            sec = _Pending(sec.name, len(sec.data), a, sec.data)
        self._sections.append(sec)

    def _adopt_image(self, sections: list[_Pending], offsets: list[int]) -> tuple[int, str] | None:
        """The temporary file a weight image has been copied into, with its chunk digests
        kept for the rest of the section, if the section lies where the image was copied;
        else the image is discarded (the writer copies those bytes itself)."""
        sec = sections[0] if sections else None
        if sec is None or sec.image is None:
            return None
        if offsets[0] != IMAGE_OFFSET or os.path.abspath(self._path) != sec.image.out_path:
            sec.image.discard()
            return None
        try:
            with self._io():
                fd, tmp, digests, model_hash = sec.image.take()
        except BaseException:
            if sec.also is not None:
                sec.also.cancel()
            raise
        if model_hash is not None and model_hash is not sec.also:
            model_hash.cancel()
        self._image_digests = digests
        return fd, tmp

    def close(self) -> None:
        """Write the file (once). Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        sections, self._sections = self._sections, []
        self._write(sections)

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        # OS failures of our own file operations (disk full, no permission) are
        # the user's to fix; failures of a caller's chunk source pass through.
        try:
            yield
        except OSError as e:
            raise NpucError(
                E_WRITE,
                f"cannot write '{self._path}': {e.strerror or e}",
                hint="check free disk space and write permission for the output directory",
                exit_code=EXIT_IO,
            ) from e

    def _write(self, sections: list[_Pending]) -> None:
        for i, sec in enumerate(sections):
            if sec.name != WEIGHTS:
                continue
            chunk_table = _Pending(WEIGHTS_DIGESTS, _chunks_payload_size(sec.size), SECTION_ALIGN_DEFAULT,
                                   None, produce=_weights_chunks)
            if sec.first:  # first in the file, its chunk digests right after it
                sections[:] = [sec, chunk_table, *sections[:i], *sections[i + 1:]]
            else:  # its chunk digests go just before it, written once it is
                sections.insert(i, chunk_table)
            break
        table_end = HEADER_SIZE + ENTRY_SIZE * len(sections)
        offsets: list[int] = []
        cursor = table_end
        for sec in sections:
            offsets.append(_align_up(cursor, sec.align))
            cursor = offsets[-1] + sec.size

        directory = os.path.dirname(os.path.abspath(self._path))
        adopted = self._adopt_image(sections, offsets)
        try:
            with self._io():
                mode = stat.S_IMODE(os.stat(self._path).st_mode) if os.path.isfile(self._path) else 0o644
                fd, tmp = adopted or open_temp(self._path)
        except BaseException:
            for sec in sections:
                if sec.also is not None:
                    sec.also.cancel()
            raise
        try:
            try:
                digests = self._write_payloads(fd, sections, offsets, table_end)
                table = b"".join(_ENTRY.pack(sec.name.encode("ascii"), off, sec.size, digest)
                                 for sec, off, digest in zip(sections, offsets, digests, strict=True))
                header = _HEADER.pack(
                    MAGIC, FORMAT_VERSION, 0, len(sections), 0, hashlib.sha256(table).digest(), bytes(8)
                )
                with self._io():
                    pwrite_all(fd, header + table, 0)
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._io():
                os.chmod(tmp, mode)
                os.replace(tmp, self._path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # Make the rename itself durable; not every platform/filesystem allows it.
        with contextlib.suppress(OSError):
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _write_payloads(self, fd: int, sections: list[_Pending], offsets: list[int], pos: int) -> list[bytes]:
        """Every payload (and the zero padding before it) at its offset; late sections
        last. Their table digests, in table order."""
        digests: dict[int, bytes] = {}
        late: list[int] = []
        chunk_table = b""
        try:
            for i, (sec, off) in enumerate(zip(sections, offsets, strict=True)):
                with self._io():
                    pwrite_all(fd, bytes(off - pos), pos)
                pos = off + sec.size
                if sec.produce is not None:
                    late.append(i)
                    continue
                digester: ChunkDigests | _Sha256 = (self._image_digests or ChunkDigests()) if sec.name == WEIGHTS \
                    else _Sha256()
                if sec.data is not None:
                    with self._io():
                        pwrite_all(fd, sec.data, off)
                    digester.update(memoryview(sec.data))
                else:
                    self._write_streamed(fd, sec, off, digester)
                if isinstance(digester, ChunkDigests):
                    chunk_table = digester.payload()
                    digests[i] = _weights_digest(chunk_table)
                else:
                    digests[i] = digester.digest()
            for i in late:
                produce = sections[i].produce
                assert produce is not None
                data = chunk_table if produce is _weights_chunks else produce()
                if len(data) != sections[i].size:
                    raise InternalError(f"section '{sections[i].name}' declared {sections[i].size} bytes "
                                        f"but produced {len(data)}")
                with self._io():
                    pwrite_all(fd, data, offsets[i])
                digests[i] = hashlib.sha256(data).digest()
        except BaseException:
            for sec in sections:
                if sec.also is not None:
                    sec.also.cancel()
            raise
        return [digests[i] for i in range(len(sections))]

    def _write_streamed(self, fd: int, sec: _Pending, off: int, digester: ChunkDigests | _Sha256) -> None:
        """Write a streamed section's chunks, hashing each from the buffer it is written from."""
        assert sec.chunks is not None
        copy = RangeCopy(fd, digester, sec.also)
        written = 0
        chunks = iter(sec.chunks)
        if sec.image is not None and self._image_digests is not None:  # its first chunk is on file already
            first = next(chunks, None)
            if first != sec.image.source:
                raise InternalError(f"section '{sec.name}' does not begin with its image {sec.image.source}")
            written = sec.image.source.length
        if sec.also is not None:
            sec.also.start()  # it reads what it will not be handed meanwhile
        try:
            for chunk in chunks:
                if isinstance(chunk, FileRange):
                    n = chunk.length
                else:
                    try:
                        chunk = memoryview(chunk).cast("B")
                    except (TypeError, ValueError) as e:
                        raise InternalError(
                            f"section '{sec.name}': chunk {type(chunk).__name__} is not contiguous bytes") from e
                    n = chunk.nbytes
                if written + n > sec.size:
                    raise InternalError(f"section '{sec.name}' declared {sec.size} bytes but its chunks hold more")
                if not n:
                    continue
                with self._io():
                    if isinstance(chunk, FileRange):
                        copy.copy(chunk, off + written)
                    else:
                        copy.write(chunk, off + written)
                written += n
            if written != sec.size:
                raise InternalError(f"section '{sec.name}' declared {sec.size} bytes but its chunks hold {written}")
            if sec.also is not None:
                sec.also.done()
        finally:
            copy.close()


def _weights_chunks() -> bytes:
    """The produce of the "weights.xxh3" section: a marker, the writer fills it in."""
    raise InternalError("the weights' chunk digests are written by OmWriter itself")


# --- reading ---------------------------------------------------------------------


def _corrupt(message: str) -> NpucError:
    return NpucError(E_BOUNDS, f"file is truncated or corrupt: {message}", hint=_HINT_RECOMPILE, exit_code=EXIT_IO)


def _checksum(what: str) -> NpucError:
    return NpucError(E_CHECKSUM, f"{what} fails its checksum: the file is corrupt", hint=_HINT_RECOMPILE, exit_code=EXIT_IO)


class OmFile:
    """A validated, read-only, memory-mapped `.om` file. Use `OmFile.open`."""

    def __init__(self, path: str, mm: mmap.mmap, sections: list[SectionInfo]) -> None:
        self.path = path
        self._mm: mmap.mmap | None = mm
        self._view: memoryview | None = memoryview(mm)
        self._sections = sections
        self._by_name = {s.name: s for s in sections}

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = True) -> OmFile:
        """Map and check `path`: its structure and every header section's SHA-256, always;
        with `verify` also every weights chunk's XXH3-128 (reading the whole file)."""
        p = os.fspath(path)
        try:
            # O_NONBLOCK so that a FIFO fails the regular-file check instead of hanging.
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise _cannot_open(p, e.strerror or str(e)) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _cannot_open(p, "not a regular file")
            if st.st_size < HEADER_SIZE:
                head = os.pread(fd, HEADER_SIZE, 0) if hasattr(os, "pread") else os.read(fd, HEADER_SIZE)
                _check_magic(p, head)
                raise _corrupt(f"it has {len(head)} bytes, less than the {HEADER_SIZE}-byte header")
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise _cannot_open(p, str(e)) from e
        except OSError as e:
            os.close(fd)
            raise _cannot_open(p, e.strerror or str(e)) from e
        except BaseException:
            os.close(fd)
            raise
        try:  # the weights are read from this descriptor: the file mapped, whatever the path names now
            sections = _parse(p, mm, verify, fd)
        except BaseException:
            mm.close()
            raise
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        return cls(p, mm, sections)

    def section_names(self) -> list[str]:
        return [s.name for s in self._sections]

    def section_info(self) -> list[SectionInfo]:
        return list(self._sections)

    def section(self, name: str) -> memoryview:
        """Zero-copy read-only view of a payload; valid while the file is open."""
        if self._view is None:
            raise InternalError(f"OmFile '{self.path}' is closed")
        info = self._by_name.get(name)
        if info is None:
            have = ", ".join(self.section_names()) or "none"
            raise _corrupt(f"it has no section '{name}' (sections: {have})")
        return self._view[info.offset : info.offset + info.size]

    def close(self) -> None:
        """Unmap the file; if section views are still alive, it is unmapped when they go."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            # mmap refuses to close under live exports; dropping our reference
            # lets the last outstanding section view unmap it instead.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def __enter__(self) -> OmFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _cannot_open(path: str, why: str) -> NpucError:
    return NpucError(E_OPEN, f"cannot open '{path}': {why}", hint="check the path and its permissions", exit_code=EXIT_IO)


def _check_magic(path: str, head: bytes) -> None:
    # A short prefix of the magic is a truncated .om file, not a foreign one.
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise NpucError(
            E_MAGIC,
            f"'{path}' is not an npuc .om file (bad magic bytes)",
            hint="pass a model compiled with `npuc compile`",
            exit_code=EXIT_IO,
        )


def _parse(path: str, mm: mmap.mmap, verify: bool, fd: int) -> list[SectionInfo]:
    """Check the whole structure of a mapped file; returns its sections in table order."""
    size = len(mm)
    magic, version, flags, count, reserved, table_sha, pad = _HEADER.unpack_from(mm, 0)
    _check_magic(path, magic)
    if version != FORMAT_VERSION:
        # Version 1 (SHA-256 over every weight byte) is not read: a recompile writes version 2.
        raise NpucError(
            E_VERSION,
            f"'{path}' has .om format version {version}; this npuc reads version {FORMAT_VERSION}",
            hint="recompile the model with `npuc compile` from this npuc release",
            exit_code=EXIT_IO,
        )
    if flags != 0:
        raise NpucError(
            E_VERSION,
            f"'{path}' uses .om format flags {flags:#x}, which this npuc does not support",
            hint="recompile the model with `npuc compile` from this npuc release",
            exit_code=EXIT_IO,
        )
    if reserved != 0 or pad != bytes(len(pad)):
        raise _corrupt("reserved header fields are not zero")

    table_end = HEADER_SIZE + ENTRY_SIZE * count
    if table_end > size:
        raise _corrupt(f"the section table spans bytes {HEADER_SIZE}..{table_end} but the file has {size} bytes")
    if hashlib.sha256(mm[HEADER_SIZE:table_end]).digest() != table_sha:
        raise _checksum("the section table")

    sections: list[SectionInfo] = []
    digests: list[bytes] = []
    seen: set[str] = set()
    prev_end = table_end
    for i in range(count):
        raw_name, offset, length, digest = _ENTRY.unpack_from(mm, HEADER_SIZE + ENTRY_SIZE * i)
        name_bytes = raw_name.rstrip(b"\0")
        name = name_bytes.decode("ascii", "replace")
        if not _NAME_RE.fullmatch(name):
            raise _corrupt(f"section {i} has an invalid name {name_bytes!r}")
        if name in seen:
            raise _corrupt(f"section '{name}' appears twice")
        seen.add(name)
        end = offset + length
        if end > size:
            raise _corrupt(f"section '{name}' spans bytes {offset}..{end} but the file has {size} bytes")
        if offset < prev_end:
            raise _corrupt(f"section '{name}' starts at byte {offset}, before the end of the previous data at {prev_end}")
        align = _required_align(name)
        if offset % align:
            raise _corrupt(f"section '{name}' starts at byte {offset}, not a multiple of {align}")
        # Padding is not covered by any hash; insist it is zero so no byte of
        # the file goes unchecked. At most one alignment's worth per section.
        if mm[prev_end:offset].count(0) != offset - prev_end:
            raise _checksum(f"the padding before section '{name}'")
        sections.append(SectionInfo(name, offset, length, align, digest.hex(),
                                    "xxh3-128" if name == WEIGHTS else "sha256"))
        digests.append(digest)
        prev_end = end
    if prev_end != size:
        raise _corrupt(f"{size - prev_end} unexpected bytes after the last section")

    # Every section but the weights: its SHA-256, always (they are small: the model
    # definition, the chunk digests, a tokenizer).
    for info, digest in zip(sections, digests, strict=True):
        if info.name != WEIGHTS and hashlib.sha256(mm[info.offset:info.offset + info.size]).digest() != digest:
            raise _checksum(f"section '{info.name}'")
    by_name = {s.name: (s, d) for s, d in zip(sections, digests, strict=True)}
    if WEIGHTS in by_name or WEIGHTS_DIGESTS in by_name:
        chunk = _check_chunk_table(mm, by_name)
        if verify:
            _verify_weights(path, fd, by_name[WEIGHTS][0], mm, by_name[WEIGHTS_DIGESTS][0], chunk)
    return sections


def _check_chunk_table(mm: mmap.mmap, by_name: dict[str, tuple[SectionInfo, bytes]]) -> int:
    """The weights' chunk digests agree with the weights (present together, one digest per
    chunk of a sane size) and with the weights entry's digest. The chunk size."""
    if WEIGHTS_DIGESTS not in by_name:
        raise _corrupt(f"section '{WEIGHTS}' has no chunk digests (no section '{WEIGHTS_DIGESTS}')")
    if WEIGHTS not in by_name:
        raise _corrupt(f"section '{WEIGHTS_DIGESTS}' is there without a '{WEIGHTS}' section")
    (weights, wdigest), (table, _) = by_name[WEIGHTS], by_name[WEIGHTS_DIGESTS]
    if table.size < _CHUNKS_HEAD.size:
        raise _corrupt(f"section '{WEIGHTS_DIGESTS}' has {table.size} bytes, less than its {_CHUNKS_HEAD.size}-byte head")
    chunk, count = _CHUNKS_HEAD.unpack_from(mm, table.offset)
    if not _CHUNK_MIN <= chunk <= _CHUNK_MAX or chunk & (chunk - 1):
        raise _corrupt(f"section '{WEIGHTS_DIGESTS}' has chunk size {chunk}, not a power of two in "
                       f"{_CHUNK_MIN}..{_CHUNK_MAX}")
    want = -(-weights.size // chunk)
    if count != want or table.size != _CHUNKS_HEAD.size + 16 * want:
        raise _corrupt(f"section '{WEIGHTS_DIGESTS}' lists {count} chunks in {table.size} bytes; "
                       f"{weights.size} bytes of weights in chunks of {chunk} need {want} "
                       f"in {_CHUNKS_HEAD.size + 16 * want} bytes")
    if _weights_digest(mm[table.offset:table.offset + table.size]) != wdigest:
        raise _checksum(f"the chunk digests of section '{WEIGHTS}'")
    return chunk


_READ_AHEAD = 128 << 20  # bytes of weights asked for ahead of the hashing (as npucrt/src/om.c)


def _want(fd: int, weights: SectionInfo, chunk: int, start: int, end: int) -> None:
    """Ask the kernel to read the weights' chunks [start, end) now (it is only advice)."""
    lo, hi = start * chunk, min(end * chunk, weights.size)
    if lo < hi and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, weights.offset + lo, hi - lo, os.POSIX_FADV_WILLNEED)


def _verify_weights(path: str, fd: int, weights: SectionInfo, mm: mmap.mmap, table: SectionInfo, chunk: int) -> None:
    """Every weights chunk against its XXH3-128. With plain reads, not through the mapping:
    touching mapped pages would make every weight resident in this process before the first
    run; the reads fill the page cache that the run's mapping then finds warm."""
    expected = mm[table.offset + _CHUNKS_HEAD.size:table.offset + table.size]
    buf = memoryview(bytearray(min(chunk, max(weights.size, 1))))
    # Reads asked for _READ_AHEAD ahead of the hashing, so the disk works while xxh3 hashes.
    ahead = max(1, _READ_AHEAD // chunk)
    _want(fd, weights, chunk, 0, ahead)
    h = xxhash.xxh3_128()
    for k in range(len(expected) // 16):
        _want(fd, weights, chunk, k + ahead, k + ahead + 1)
        start = weights.offset + k * chunk
        n = min(chunk, weights.offset + weights.size - start)
        h.reset()
        done = 0
        while done < n:  # in pieces of the buffer, should a chunk be larger than it
            try:
                got = read_into(fd, buf[:min(len(buf), n - done)], start + done)
            except OSError as e:
                raise _cannot_open(path, e.strerror or str(e)) from e
            if got == 0:
                raise _corrupt(f"section '{weights.name}' ends early")
            h.update(buf[:got])
            done += got
        if h.digest() != expected[16 * k:16 * k + 16]:
            raise _checksum(f"section '{weights.name}' (chunk {k}, bytes {start - weights.offset}.."
                            f"{start - weights.offset + n})")
